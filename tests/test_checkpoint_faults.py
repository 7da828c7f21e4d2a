"""Checkpoints and HF exports against the faults around them, on real runs (CPU, tiny): a resume from an older step
than the newest (the abandoned run's newer checkpoints), an export killed or failing mid-write, and an export whose
checkpoint a live run's rotation deletes."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from distributed import run_distributed
from helpers import REPO, compose, read_metrics, tiny_overrides, train

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "PYTHONDONTWRITEBYTECODE": "1"}
SMALL = ("data.seq_len=64", "train.global_batch_size=2", "train.micro_batch_size=1")
LIMIT = 256 * 1024  # bytes a file may grow to below: the tiny model's bf16 model.safetensors is 577 KB


def _run(run_dir, *extra):
    """`qwenft train` of the tiny model on one forked rank, without the HF export unless `extra` asks for it."""
    return run_distributed(train, 1, tiny_overrides(run_dir, *SMALL, "checkpoint.export_hf=false", *extra))[0]


def _entries(ckpts) -> list[str]:
    return sorted(p.name for p in ckpts.iterdir())


def _pointer(ckpts, name) -> str:
    return (ckpts / name).read_text().strip()


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory):
    """4 steps, a checkpoint after steps 2 and 4 (checkpoint.keep=2). Tests copy it."""
    run_dir = tmp_path_factory.mktemp("four") / "run"
    _run(run_dir, "train.max_steps=4", "checkpoint.every_steps=2")
    assert _entries(run_dir / "checkpoints") == ["latest", "step-000002", "step-000004"]
    return run_dir


# ---------------------------------------------------------------- a resume from an older step


@pytest.mark.distributed
def test_a_resume_from_another_runs_checkpoint_into_a_run_dir_with_its_own_is_refused(tmp_path, four_steps):
    """The two runs' checkpoints would mix, and checkpoint.resume=auto would later take this dir's own `latest`."""
    def start(rank, world_size, overrides):
        from qwenft.train.runner import run

        try:
            run(compose(overrides))
        except ValueError as e:
            return str(e)

    run_dir = tmp_path / "run"
    shutil.copytree(four_steps, run_dir)
    other = four_steps / "checkpoints" / "step-000002"
    (msg,) = run_distributed(start, 1, tiny_overrides(run_dir, *SMALL, "train.max_steps=4",
                                                      f"checkpoint.resume={other}"))
    assert msg == (f"run_dir={run_dir} holds its own checkpoints (step-000002, step-000004) and checkpoint.resume="
                   f"{other} is another run's: the two runs' checkpoints would mix; resume it in a new run_dir, or "
                   f"resume this one from its own (checkpoint.resume=auto)"), msg


@pytest.mark.distributed
def test_resume_from_an_older_step_deletes_the_abandoned_steps_not_its_own(tmp_path, four_steps, capsys):
    """The reviewer's case: resumed from step-000002 of a run that went on to step-000004, with a checkpoint every
    step and keep=1. The checkpoint this run publishes stays and `latest` names it; the abandoned step-000004 goes;
    the export and a resume=auto take this run's step-000003."""
    from qwenft.cli import main

    run_dir = tmp_path / "run"
    shutil.copytree(four_steps, run_dir)
    ckpts = run_dir / "checkpoints"
    _run(run_dir, "train.max_steps=3", "checkpoint.every_steps=1", "checkpoint.keep=1",
         f"checkpoint.resume={ckpts / 'step-000002'}")
    assert _entries(ckpts) == ["latest", "step-000003"]
    assert _pointer(ckpts, "latest") == "step-000003"
    assert json.loads((ckpts / "step-000003" / "checkpoint.json").read_text())["step"] == 3
    log = (run_dir / "train.log").read_text()
    assert (f"resume: resuming from step-000002, older than step-000004 in {ckpts} (the checkpoints of the run "
            f"this one abandons): this run's first checkpoint deletes them") in log, log

    out = tmp_path / "hf"
    assert main(["export", f"run_dir={run_dir}", f"out={out}"]) == 0
    assert f"exported {ckpts / 'step-000003'} (bfloat16) to {out}" in capsys.readouterr().out
    assert (out / "model.safetensors").is_file()

    result = _run(run_dir, "train.max_steps=4", "checkpoint.every_steps=1", "checkpoint.keep=1")
    assert len(result.losses) == 1  # step 4 alone, after step-000003
    assert f"resumed from {ckpts / 'step-000003'}; continuing at step 4" in (run_dir / "train.log").read_text()
    assert _entries(ckpts) == ["latest", "step-000004"] and _pointer(ckpts, "latest") == "step-000004"


@pytest.mark.distributed
def test_resume_from_an_older_step_deletes_every_abandoned_step_at_its_first_checkpoint(tmp_path):
    """Resumed from step-000001 of a run that saved every step to 4, saving every 3rd: the first save (step 3)
    deletes the abandoned steps 2 to 4, not only those at or above 3, so the rotation (keep=2) keeps this run's own
    step-000001 rather than the abandoned step-000002."""
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    _run(run_dir, "train.max_steps=4", "checkpoint.every_steps=1", "checkpoint.keep=5")
    _run(run_dir, "train.max_steps=3", "checkpoint.every_steps=3", "checkpoint.keep=2",
         f"checkpoint.resume={ckpts / 'step-000001'}")
    assert _entries(ckpts) == ["latest", "step-000001", "step-000003"] and _pointer(ckpts, "latest") == "step-000003"


@pytest.mark.distributed
def test_resume_from_an_older_step_is_what_auto_continues_before_its_first_checkpoint(tmp_path, four_steps):
    """Resumed from step-000002 and failed before saving (a resumed run saves after its last step): `latest` names
    step-000002, so resume=auto trains step 3 again instead of jumping to the abandoned step-000004, which is still
    there (only a checkpoint of this run deletes it)."""
    def fail_at_step_3(rank, world_size, overrides):
        from qwenft.train.runner import run

        def fail(step):
            raise RuntimeError(f"the node failed at step {step}")

        try:
            run(compose(overrides), on_step=fail)
        except RuntimeError as e:
            return str(e)

    run_dir = tmp_path / "run"
    shutil.copytree(four_steps, run_dir)
    ckpts = run_dir / "checkpoints"
    failed = run_distributed(fail_at_step_3, 1, tiny_overrides(run_dir, *SMALL, "checkpoint.export_hf=false",
                                                               "train.max_steps=3",
                                                               f"checkpoint.resume={ckpts / 'step-000002'}"))
    assert failed == ["the node failed at step 3"]
    assert _pointer(ckpts, "latest") == "step-000002"
    assert _entries(ckpts) == ["latest", "step-000002", "step-000004"]
    result = _run(run_dir, "train.max_steps=3")  # checkpoint.resume=auto
    assert len(result.losses) == 1, result.losses  # step 3; from step-000004 it would train none
    assert f"resumed from {ckpts / 'step-000002'}; continuing at step 3" in (run_dir / "train.log").read_text()


@pytest.mark.distributed
def test_resume_from_an_older_step_moves_best_to_this_runs_steps(tmp_path):
    """keep_best with the best of the abandoned run above the step resumed from: at this run's first checkpoint
    (step 2, a step number the abandoned run had too) every abandoned step goes, the new step-000002 holds this run's
    weights, and `best` names the lowest val_loss of this run's own steps (1 and 2), read from metrics.jsonl."""
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    best_every_step = ("eval.every_steps=1", "eval.dataset=tiny", "eval.max_batches=2", "checkpoint.every_steps=1",
                       "checkpoint.keep=4", "checkpoint.keep_best=true", "lr_scheduler.warmup_steps=0",
                       "lr_scheduler.decay=constant")
    _run(run_dir, "train.max_steps=4", "optim.lr=3e-2", *best_every_step)
    first = {r["step"]: r["val_loss"] for r in read_metrics(run_dir) if "val_loss" in r}
    abandoned_best = _pointer(ckpts, "best")
    assert abandoned_best == f"step-{min(first, key=first.get):06d}" != "step-000001", first
    abandoned_shard = json.loads((ckpts / "step-000002" / "manifest.json").read_text())["files"]["__0_0.distcp"]

    _run(run_dir, "train.max_steps=2", "optim.lr=1e-3", *best_every_step,
         f"checkpoint.resume={ckpts / 'step-000001'}")
    assert f"(`best` among them: {abandoned_best})" in (run_dir / "train.log").read_text()
    val = {r["step"]: r["val_loss"] for r in read_metrics(run_dir) if "val_loss" in r}
    assert sorted(val) == [1, 2] and val[1] == first[1] and val[2] != first[2], (val, first)
    assert _entries(ckpts) == ["best", "latest", "step-000001", "step-000002"]
    assert _pointer(ckpts, "latest") == "step-000002"
    assert _pointer(ckpts, "best") == f"step-{min(val, key=val.get):06d}"
    assert json.loads((ckpts / "step-000002" / "checkpoint.json").read_text())["val_loss"] == val[2]
    assert json.loads((ckpts / "step-000002" / "manifest.json").read_text())["files"]["__0_0.distcp"] != \
        abandoned_shard


# ---------------------------------------------------------------- an HF export killed or failing mid-write


def _qwenft_with_small_files(*args, killed: bool) -> subprocess.CompletedProcess:
    """`qwenft ARGS` in a fresh interpreter whose files may not grow past LIMIT (RLIMIT_FSIZE): the HF export's
    model.safetensors is the first file that does. killed: SIGXFSZ ends the process there, as a SIGKILL mid-write
    would; else the write fails with EFBIG (File too large), as on a full disk."""
    action = "signal.SIG_DFL" if killed else "signal.SIG_IGN"
    code = (f"import resource, signal, sys; signal.signal(signal.SIGXFSZ, {action}); "
            f"resource.setrlimit(resource.RLIMIT_FSIZE, ({LIMIT}, resource.getrlimit(resource.RLIMIT_FSIZE)[1])); "
            f"from qwenft.cli import entry; sys.argv[1:] = {list(args)!r}; entry()")
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, env=ENV,
                          timeout=600)


def _temps(out) -> list[str]:
    return sorted(p.name for p in out.parent.glob(f"{out.name}.tmp-*"))


@pytest.mark.distributed
def test_failed_export_leaves_no_temp_dir(tmp_path, four_steps):
    """`qwenft export` and the end-of-training export, each failing as their model.safetensors is written: no
    `<out>.tmp-*` dir is left beside the export, and no export either."""
    out = tmp_path / "hf"
    failed = _qwenft_with_small_files("export", f"run_dir={four_steps}", f"out={out}", killed=False)
    assert failed.returncode != 0 and "File too large" in failed.stderr, failed.stderr[-3000:]
    assert _temps(out) == [] and not out.exists()

    run_dir = tmp_path / "run"
    overrides = tiny_overrides(run_dir, *SMALL, "train.max_steps=1", "data.cache=false")
    failed = _qwenft_with_small_files("train", *overrides, killed=False)
    assert failed.returncode != 0 and "File too large" in failed.stderr, failed.stderr[-3000:]
    assert _temps(run_dir / "hf") == [] and not (run_dir / "hf").exists()


@pytest.mark.distributed
def test_export_removes_what_a_killed_export_left(tmp_path, four_steps, capsys):
    """A `qwenft export` killed while it writes model.safetensors leaves `<out>.tmp-<host>-<pid>`; the next export
    into the same out removes it and writes the export. A temp dir of a live process, and one of another host (a
    shared filesystem), may be being written: they stay."""
    from qwenft.cli import main

    out, host = tmp_path / "hf", socket.gethostname()
    killed = _qwenft_with_small_files("export", f"run_dir={four_steps}", f"out={out}", killed=True)
    assert killed.returncode == -signal.SIGXFSZ, (killed.returncode, killed.stderr[-3000:])
    (name,) = _temps(out)
    left = out.with_name(name)
    assert name.startswith(f"hf.tmp-{host}-") and any(left.iterdir())  # safetensors' temp file of the weights
    other_host = out.with_name(f"hf.tmp-node-b-{name.rsplit('-', 1)[1]}")
    shutil.copytree(left, other_host)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        writing = out.with_name(f"hf.tmp-{host}-{live.pid}")
        writing.mkdir()
        (writing / "model.safetensors").write_bytes(b"\0" * 1024)
        assert main(["export", f"run_dir={four_steps}", f"out={out}"]) == 0
        assert _temps(out) == sorted([other_host.name, writing.name])
        assert (writing / "model.safetensors").stat().st_size == 1024
    finally:
        live.kill()
        live.wait()
    assert f"to {out}" in capsys.readouterr().out and (out / "model.safetensors").stat().st_size > LIMIT


@pytest.mark.distributed
def test_end_of_training_export_removes_what_a_killed_one_left(tmp_path):
    """A `qwenft train` killed while its end-of-training export writes leaves `<run_dir>/hf.tmp-<host>-<pid>`; the
    run's next export into <run_dir>/hf removes it, and also one from another host (a requeue on another node) that
    nothing has written for an hour; another host's written since is left (a `qwenft export` there may be writing)."""
    run_dir = tmp_path / "run"
    overrides = tiny_overrides(run_dir, *SMALL, "train.max_steps=1", "data.cache=false")
    killed = _qwenft_with_small_files("train", *overrides, killed=True)
    assert killed.returncode == -signal.SIGXFSZ, (killed.returncode, killed.stderr[-3000:])
    hf, host = run_dir / "hf", socket.gethostname()
    (left,) = _temps(hf)
    assert left.startswith(f"hf.tmp-{host}-") and not hf.exists()
    idle, busy = (run_dir / f"hf.tmp-node-{n}-{left.rsplit('-', 1)[1]}" for n in "bc")
    shutil.copytree(run_dir / left, idle)
    shutil.copytree(run_dir / left, busy)
    hour_ago = time.time() - 3700
    for path in (idle, *idle.iterdir()):
        os.utime(path, (hour_ago, hour_ago))
    run_distributed(train, 1, overrides)
    assert _temps(hf) == [busy.name] and (hf / "model.safetensors").stat().st_size > LIMIT


# ---------------------------------------------------------------- an export whose checkpoint is rotated away


@pytest.mark.distributed
def test_export_of_a_checkpoint_rotated_away_is_one_line(tmp_path, four_steps, capfd):
    """An export of step-000002 whose run, resumed meanwhile with a checkpoint every step and keep=1, rotates it
    away before the export reads its weights: one ValueError naming the step and what to do, and nothing of DCP's
    on stderr. The same for a step dir the rotation has half deleted (its shard file gone, .metadata not yet)."""
    from qwenft.checkpoint import dcp, files

    run_dir = tmp_path / "run"
    shutil.copytree(four_steps, run_dir)
    ckpts = run_dir / "checkpoints"
    step2 = ckpts / "step-000002"
    half_deleted = tmp_path / "other" / "checkpoints" / "step-000002"
    shutil.copytree(step2, half_deleted)
    (half_deleted / "__0_0.distcp").unlink()
    model_cfg = files.model_config_from_meta(files.read_meta(step2))  # as `qwenft export` reads it, before the weights
    _run(run_dir, "train.max_steps=5", "checkpoint.every_steps=1", "checkpoint.keep=1")
    assert _entries(ckpts) == ["latest", "step-000005"]
    capfd.readouterr()
    for path, why in ((step2, "the dir is missing"), (half_deleted, "__0_0.distcp is missing")):
        with pytest.raises(ValueError) as info:
            dcp.load_model_state(path, model_cfg, torch.bfloat16)
        assert str(info.value) == (
            f"checkpoint {path} was deleted while it was being exported ({why}): the run training in "
            f"{path.parent.parent} rotated it away (checkpoint.keep); rerun the export (it takes the newest "
            f"checkpoint then), or export checkpoint=best or a step-NNNNNN dir that run keeps")
        assert capfd.readouterr().err == ""
