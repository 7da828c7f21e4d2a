"""Faults a user meets from files, processes and the environment, on real files and processes: each ends in one
line naming the file or key, exit code 2, rank 0 alone printing it under torchrun, the traceback in train.log."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from distributed import run_distributed
from helpers import train

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
FAST = ("train.progress_bar=false", "checkpoint.export_hf=false", "train.global_batch_size=4")


def qwenft(*args, module="qwenft", timeout=600):
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True,
                          env=ENV, timeout=timeout)


def one_line_error(out, *needles) -> str:
    """The run failed with exit code 2 and exactly one error line, no traceback; returns that line.

    Known exception: under load, a process that joined a gloo group could abort in the C++ teardown at
    interpreter exit ("terminate called without an active exception", SIGABRT) after it printed its line and
    destroyed its group. `qwenft.cli.entry` leaves such a process with os._exit(2); this accepts that exit,
    with that exact message alone, for any other path that reaches it."""
    aborted_at_exit = out.returncode == -6 and out.stderr.rstrip().endswith("terminate called without an active "
                                                                             "exception")
    assert out.returncode == 2 or aborted_at_exit, (out.returncode, out.stderr[-3000:])
    if aborted_at_exit:
        out = subprocess.CompletedProcess(out.args, 2, out.stdout,
                                          out.stderr.rstrip().removesuffix("terminate called without an active "
                                                                           "exception"))
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if "qwenft: error:" in line]
    assert len(lines) == 1, out.stderr[-3000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A tiny Qwen3.5 HF checkpoint as `qwenft train` exports it, from a run without OMP_NUM_THREADS (its train.log
    holds the thread count qwenft chose)."""
    run = tmp_path_factory.mktemp("hf") / "run"
    env = {k: v for k, v in ENV.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-m", "qwenft", "train", "train.max_steps=1", f"run_dir={run}",
                          "train.progress_bar=false", "train.global_batch_size=2"], cwd=REPO, capture_output=True,
                         text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return run / "hf"


@pytest.mark.slow
def test_model_path_empty_dir(tmp_path):
    (tmp_path / "empty").mkdir()
    run = tmp_path / "run"
    line = one_line_error(qwenft("train", f"model.path={tmp_path / 'empty'}", f"run_dir={run}", *FAST),
                          f"model.path={tmp_path / 'empty'}", "config.json")
    assert "Hugging Face" in line
    log = (run / "train.log").read_text()
    assert "Traceback" in log and "no config.json" in log  # the traceback for debugging
    assert not (run / "config.yaml").exists()


def test_model_path_a_file(tmp_path):
    from qwenft.models.qwen3_5.configs import config_from_hf_dir

    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="is a file, not a directory"):
        config_from_hf_dir(tmp_path / "model.safetensors")


@pytest.mark.slow
def test_model_path_bad_generation_config(tmp_path, hf_dir):
    """Refused at start, before training, when the run will export (the export carries the file over)."""
    model = tmp_path / "model"
    shutil.copytree(hf_dir, model)
    (model / "generation_config.json").write_text('{"eos_token_id": [2, 0],')
    run = tmp_path / "run"
    line = one_line_error(qwenft("train", f"model.path={model}", f"run_dir={run}", *FAST, "checkpoint.export_hf=true"),
                          f"model.path={model}: generation_config.json is not valid JSON (", "fix or remove it")
    assert not (run / "metrics.jsonl").exists(), line


@pytest.mark.slow
def test_model_path_shard_missing(tmp_path, hf_dir):
    model = tmp_path / "model"
    shutil.copytree(hf_dir, model)
    from safetensors import safe_open

    with safe_open(model / "model.safetensors", "pt") as f:
        keys = list(f.keys())
    (model / "model.safetensors").rename(model / "model-00001-of-00002.safetensors")
    weight_map = {k: "model-00001-of-00002.safetensors" for k in keys[1:]}
    weight_map[keys[0]] = "model-00002-of-00002.safetensors"
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    one_line_error(qwenft("train", f"model.path={model}", f"run_dir={tmp_path / 'run'}", *FAST),
                   f"model.path={model}", "model-00002-of-00002.safetensors", "missing")


@pytest.mark.slow
@pytest.mark.parametrize("size", [100, 300_000])  # inside the header; inside the tensor data
def test_model_path_shard_truncated(tmp_path, hf_dir, size):
    model = tmp_path / "model"
    shutil.copytree(hf_dir, model)
    os.truncate(model / "model.safetensors", size)
    run = tmp_path / "run"
    one_line_error(qwenft("train", f"model.path={model}", f"run_dir={run}", *FAST),
                   str(model / "model.safetensors"), "truncated", "download it again")
    assert not (run / "config.yaml").exists()


@pytest.mark.slow
def test_run_dir_is_a_file(tmp_path):
    (tmp_path / "file").write_text("x")
    one_line_error(qwenft("train", f"run_dir={tmp_path / 'file'}", *FAST), f"run_dir={tmp_path / 'file'}",
                   "is a file")
    one_line_error(qwenft("train", f"run_dir={tmp_path / 'file' / 'sub'}", *FAST), "Not a directory")


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to a read-only dir")
def test_run_dir_unwritable(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    run.chmod(0o500)
    try:
        one_line_error(qwenft("train", f"run_dir={run}", *FAST), f"run_dir={run}", "cannot be written")
    finally:
        run.chmod(0o700)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("fla") is not None, reason="fla is installed")
def test_fla_not_installed(tmp_path):
    one_line_error(qwenft("train", "model.kernels.gdn=fla", f"run_dir={tmp_path / 'run'}", *FAST),
                   "model.kernels.gdn=fla", "pip install")


TORCHRUN = ("--standalone", "--nproc-per-node=2", "-m", "qwenft", "train")


@pytest.mark.slow
@pytest.mark.distributed
def test_torchrun_mistake_rank0_only(tmp_path):
    """qwenft's torchrun (launcher.nproc_per_node, slurm) passes exit code 2 and the one line through; plain
    torchrun adds its own report, but the line appears once, not once per rank."""
    args = ("mesh.dp=4", f"run_dir={tmp_path / 'run'}", *FAST)
    one_line_error(qwenft(*TORCHRUN, *args, module="qwenft.launch.torchrun"),
                   "mesh.dp=4 = 4 but the world size is 2")
    one_line_error(qwenft("train", "launcher.nproc_per_node=2", *args),
                   "launcher.nproc_per_node=2 starts 2 ranks, but mesh.tp=1 x mesh.pp=1 x mesh.dp=4 = 4; set mesh.dp=-1")
    plain = qwenft(*TORCHRUN, *args, module="torch.distributed.run")
    assert plain.stderr.count("qwenft: error:") == 1, plain.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.distributed
def test_torchrun_one_rank_mistake_is_shown(tmp_path):
    """A mistake that one rank alone meets (a path missing on its node; rank 1 here, while rank 0 goes on): qwenft's
    torchrun prints that rank's line once, naming the rank, and exits 2. Plain torchrun is left as it was."""
    worker = tmp_path / "worker.py"
    worker.write_text("import os, sys, time\n"
                      "from qwenft.cli import _fail\n"
                      "if os.environ['RANK'] == '1':\n"
                      "    sys.exit(_fail(FileNotFoundError(), 'data.path=/nfs/d.jsonl: no such file on this node'))\n"
                      "time.sleep(120)\n")
    out = qwenft("--standalone", "--nproc-per-node=2", str(worker), module="qwenft.launch.torchrun", timeout=120)
    assert one_line_error(out) == "qwenft: error: data.path=/nfs/d.jsonl: no such file on this node (rank 1)"
    assert "error file" not in out.stderr, out.stderr[-3000:]  # torchrun's bookkeeping about it, filtered out
    plain = qwenft("--standalone", "--nproc-per-node=2", str(worker), module="torch.distributed.run", timeout=120)
    assert plain.returncode != 0 and "qwenft: error:" not in plain.stderr, plain.stderr[-3000:]


def test_launcher_takes_the_earliest_mistake_line(tmp_path, monkeypatch, capsys):
    """Through torch's own reader of the error files: the earliest line wins whatever its worker's exit code (one
    stopped by torchrun after writing it), a failure without a line (a crash) never; a worker that cannot write
    its file prints its line itself, naming its rank."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from qwenft.cli import _fail
    from qwenft.launch import LINE_TO_LAUNCHER
    from qwenft.launch.torchrun import first_user_error

    monkeypatch.setenv(LINE_TO_LAUNCHER, "1")
    failures = {}
    for rank, exitcode, stamp in ((0, 1, None), (1, 2, 200), (2, -15, 100), (3, 2, 300)):
        error_file = tmp_path / f"{rank}.json"
        if stamp is not None:
            monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
            monkeypatch.setattr("time.time", lambda stamp=stamp: stamp)
            assert _fail(ValueError(), f"mistake seen by rank {rank}") == 2
        failures[rank] = ProcessFailure(local_rank=rank, pid=1, exitcode=exitcode, error_file=str(error_file))
    monkeypatch.undo()
    assert first_user_error(failures) == "qwenft: error: mistake seen by rank 2 (rank 2)"
    assert first_user_error({0: failures[0]}) is None
    assert capsys.readouterr().err == ""  # the lines went to the files
    monkeypatch.setenv(LINE_TO_LAUNCHER, "1")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "no such dir" / "error.json"))
    assert _fail(ValueError(), "data.path=x: no such file") == 2
    assert capsys.readouterr().err == "qwenft: error: data.path=x: no such file (rank 3)\n"
    assert not list((tmp_path).glob("*.partial"))


@pytest.mark.slow
@pytest.mark.distributed
def test_torchrun_rank0_file_fault_reaches_every_rank(tmp_path):
    """run_dir is made by rank 0 only; its failure stops every rank at once (none waits in a collective)."""
    (tmp_path / "file").write_text("x")
    one_line_error(qwenft(*TORCHRUN, f"run_dir={tmp_path / 'file'}", *FAST, module="qwenft.launch.torchrun",
                          timeout=120), "is a file")


# ---------------------------------------------------------------- damaged checkpoints

CKPT = ("checkpoint.every_steps=1", "checkpoint.keep=4")


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Path:
    """A run that saved step-000001..4 (each with its manifest), trained in a rank forked from this process (the
    tests damage and resume it through the command; making it needs no process of its own)."""
    run = tmp_path_factory.mktemp("ckpt") / "run"
    run_distributed(train, 1, ["train.max_steps=4", f"run_dir={run}", *FAST, *CKPT])
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == [f"step-{i:06d}" for i in range(1, 5)]
    return run


def _files(root: Path) -> dict:
    return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _assert_unchanged(root: Path, before: dict) -> None:
    """Every file as it was; train.log may only have grown (the failed attempt logs its start and traceback)."""
    after = _files(root)
    log = root / "train.log"
    assert after.pop(log).startswith(before[log])
    assert after == {p: b for p, b in before.items() if p != log}


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.slow
def test_damaged_latest_falls_back_to_newest_complete(tmp_path, saved_run):
    """Three kinds of damage, one to each of the three newest checkpoints: the resume passes over each with a line
    naming what is wrong and resumes from the newest complete one."""
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    ckpt = run / "checkpoints"
    os.truncate(ckpt / "step-000004" / "__0_0.distcp", 1000)
    (ckpt / "step-000003" / "extra.pt").unlink()
    _flip_a_byte(ckpt / "step-000002" / "__0_0.distcp")
    out = qwenft("train", "train.max_steps=2", f"run_dir={run}", *FAST, *CKPT)
    assert out.returncode == 0, out.stderr[-3000:]
    log = (run / "train.log").read_text()
    for step, what in ((4, "__0_0.distcp is 1000 bytes"), (3, "extra.pt is missing"),
                       (2, "__0_0.distcp has another checksum than when saved")):
        assert f"{ckpt / f'step-{step:06d}'} is incomplete or corrupt ({what}" in log, log
    assert "resuming from" in log, log
    assert "resumed from " + str(ckpt / "step-000001") + "; continuing at step 2" in log


@pytest.mark.slow
def test_no_complete_checkpoint_is_one_line_and_leaves_the_run_dir(tmp_path, saved_run):
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    for step in (run / "checkpoints").glob("step-*"):
        os.truncate(step / "extra.pt", 10)
    before = _files(run)
    line = one_line_error(qwenft("train", "train.max_steps=5", "optim.lr=1e-3", f"run_dir={run}", *FAST, *CKPT),
                          "checkpoint.resume=auto: no complete checkpoint in", "extra.pt is 10 bytes",
                          "or give a new run_dir")
    assert "step-000004" in line and "step-000001" in line
    _assert_unchanged(run, before)  # config.yaml keeps the old run's values
    assert "Traceback" in (run / "train.log").read_text()[len(before[run / "train.log"]):]


@pytest.mark.slow
def test_fresh_start_over_checkpoints_is_one_line_and_leaves_the_run_dir(tmp_path, saved_run):
    """checkpoint.resume=none where an earlier run saved checkpoints: refused before anything is rewritten (its
    checkpoints would be rotated against the new run's)."""
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    before = _files(run)
    one_line_error(qwenft("train", "train.max_steps=2", "checkpoint.resume=none", f"run_dir={run}", *FAST, *CKPT),
                   f"run_dir={run} holds an earlier run's checkpoints (step-000001, step-000002, step-000003, "
                   f"step-000004) and checkpoint.resume=none starts afresh", "resume with checkpoint.resume=auto, give a "
                   f"new run_dir, or delete {run / 'checkpoints'}")
    _assert_unchanged(run, before)


@pytest.mark.slow
def test_explicit_damaged_checkpoint_is_refused(tmp_path, saved_run):
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    step2 = run / "checkpoints" / "step-000002"
    (step2 / "__0_0.distcp").unlink()
    one_line_error(qwenft("train", f"checkpoint.resume={step2}", f"run_dir={tmp_path / 'other'}", *FAST),
                   f"checkpoint.resume={step2}", "__0_0.distcp is missing")


# ---------------------------------------------------------------- one run per run dir

@pytest.mark.slow
@pytest.mark.distributed
def test_second_run_into_a_run_dir_fails_at_once_and_a_dead_holder_frees_it(tmp_path):
    import signal
    import socket
    import time

    run = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "qwenft", "train", "train.max_steps=100000", f"run_dir={run}",
                              *FAST], cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while not (run / "metrics.jsonl").exists():  # training: the lock is held
            assert first.poll() is None and time.time() < deadline
            time.sleep(0.5)
        start = time.time()
        one_line_error(qwenft("train", "train.max_steps=2", f"run_dir={run}", *FAST),
                       f"run_dir={run} is in use by another qwenft run", f"pid {first.pid} ",
                       f"host {socket.gethostname()}")
        assert time.time() - start < 60
    finally:
        first.send_signal(signal.SIGKILL)  # dies holding the lock: its .lock file stays, stale
        first.wait()
    assert (run / ".lock").read_text().startswith(f"pid {first.pid} ")
    out = qwenft("train", "train.max_steps=1", f"run_dir={tmp_path / 'run'}", *FAST, "checkpoint.resume=none")
    assert out.returncode == 0, out.stderr[-3000:]
    assert not (run / ".lock").exists()  # released at the end of the run
    # the killed run's rows kept aside, the new run's steps alone in metrics.jsonl
    assert (run / "metrics.1.jsonl").read_text().startswith('{"step": 1,')
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1]


# ---------------------------------------------------------------- configs transformers writes

def test_checkpoint_with_transformers_default_rope_loads_and_matches(tmp_path):
    """Qwen3_5TextConfig's own defaults give no mrope_section and head_dim 32 (rotary_dim/2 = 4): qwenft loads
    it and computes what transformers computes, with text and with M-RoPE (3, B, T) position ids."""
    import torch
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM

    from qwenft.models.loader import build_model, load_hf_weights
    from qwenft.models.qwen3_5.configs import config_from_hf_dir

    torch.manual_seed(0)
    hf_cfg = Qwen3_5TextConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=32, linear_key_head_dim=16,
                               linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4)
    assert "mrope_section" not in hf_cfg.rope_parameters
    hf = Qwen3_5ForCausalLM(hf_cfg).eval()
    hf.save_pretrained(tmp_path)
    cfg = config_from_hf_dir(tmp_path)
    model = load_hf_weights(build_model(cfg, kernels="torch"), tmp_path, device="cpu").eval()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(12).expand(2, 12)
    pos3 = torch.stack([pos, pos // 2, pos % 3])  # distinct T, H, W positions exercise the section
    with torch.no_grad():
        for p in (pos, pos3):
            ours, theirs = model(input_ids=ids, position_ids=p), hf(input_ids=ids, position_ids=p).logits
            assert torch.allclose(ours, theirs, atol=1e-5, rtol=1e-4), (ours - theirs).abs().max()


# ---------------------------------------------------------------- CPU threads

@pytest.mark.parametrize("cores, ranks, load, threads", [
    (2, 1, 0.1, 2),   # an idle machine: every core
    (2, 1, 1.0, 1),   # one busy neighbour on 2 cores: 1 thread (oversubscribed threads thrash)
    (2, 1, 5.0, 1),   # never fewer than one
    (16, 2, 0.0, 8),  # ranks on one node share the cores
    (16, 2, 8.0, 4),
])
def test_cpu_threads_leave_busy_cores_alone(cores, ranks, load, threads):
    from qwenft.train.rundir import cpu_threads

    assert cpu_threads(cores, ranks, load) == threads


@pytest.mark.slow
def test_cpu_threads_chosen_are_logged(hf_dir):
    """Without OMP_NUM_THREADS (hf_dir's run), train.log says how many threads qwenft chose and from what."""
    log = (hf_dir.parent / "train.log").read_text()
    assert "cpu threads: " in log and "set OMP_NUM_THREADS to choose" in log, log


def _threads_in_a_forked_rank(rank, world_size):
    import torch

    from qwenft.train.rundir import set_cpu_threads

    set_cpu_threads()
    torch.randn(1 << 22).cos()  # a parallel region, inside MKL where it has one
    return torch.get_num_threads()


@pytest.mark.distributed
def test_a_forked_rank_keeps_the_harness_thread_count(monkeypatch):
    """The runner's own thread choice (no OMP_NUM_THREADS) must not give a forked test rank more threads than the
    harness set: after the parent has run a parallel region, a child's region of two threads waits forever at
    OpenMP's barrier for the parent's threads (tests/distributed.py). The parent runs one first."""
    import torch

    from distributed import threads_per_rank

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.randn(1 << 22).cos()
    assert run_distributed(_threads_in_a_forked_rank, 1, timeout=60) == [threads_per_rank()]


# ---------------------------------------------------------------- smaller edges

@pytest.mark.parametrize("override, needle", [
    ("optim.lr=-1", "optim.lr=-1.0 must be > 0"),
    ("data.path=~/x.jsonl", "data.path=~/x.jsonl: Hydra cannot read a value starting with ~; write the full path"),
])
@pytest.mark.slow
def test_config_edges_are_one_line(tmp_path, override, needle):
    run = tmp_path / "run"
    one_line_error(qwenft("train", override, f"run_dir={run}", *FAST), needle)
    assert not run.exists()  # refused before the run dir


def _embedding_view_warnings(rank, world_size, overrides):
    """The FSDP2 'returned a view tensor' warnings one training step raises on this rank."""
    import warnings

    from helpers import train

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every warning, whatever filters the process had
        train(rank, world_size, overrides)
    return [str(w.message) for w in caught if "returned a view tensor" in str(w.message)]


@pytest.mark.slow
@pytest.mark.distributed
def test_tensor_parallel_under_fsdp_raises_no_view_warning(tmp_path):
    """tp2 x dp2, FSDP2 wrapping the vocab-parallel embedding: its output is the all-reduced sum, not a view,
    so FSDP2 has no in-place-view warning to print (it prints one on every rank for torch's RowwiseParallel,
    which returns a view), and none is filtered."""
    from distributed import run_distributed
    from helpers import tiny_overrides

    overrides = tiny_overrides(tmp_path, "recipe=tiny_tp2", "mesh.dp=2", "train.max_steps=1",
                               "checkpoint.export_hf=false")
    assert run_distributed(_embedding_view_warnings, 4, overrides) == [[], [], [], []]


@pytest.mark.slow
def test_nonfinite_loss_is_its_own_line_and_in_train_log(tmp_path):
    """A diverging run (train.on_nonfinite=error) stops with one line, not glued after the progress bar, and
    train.log holds the same error with its traceback."""
    run = tmp_path / "run"
    out = qwenft("train", "optim.lr=1e30", "optim.max_grad_norm=0", "train.max_steps=5", "train.progress_bar=true",
                 "checkpoint.export_hf=false", "train.global_batch_size=4", f"run_dir={run}")
    line = one_line_error(out, "non-finite loss/grad norm at step", "train.on_nonfinite=skip")
    assert line.startswith("qwenft: error:"), line  # on a line of its own, after the closed bar
    log = (run / "train.log").read_text()
    assert "non-finite loss/grad norm at step" in log and "Traceback" in log


# ---------------------------------------------------------------- checkpoint writes that fail

def _small_files(limit: int):
    """No file of this process may grow past `limit` bytes (RLIMIT_FSIZE, as a quota would stop it): a write beyond
    fails with EFBIG (SIGXFSZ ignored, so the write returns the error instead of ending the process)."""
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def _bytes(text: str) -> float:
    """A size as qwenft.checkpoint.dcp.size_text writes it, in bytes."""
    value, unit = text.split()
    return float(value) * {"bytes": 1, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}[unit]


@pytest.mark.slow
def test_failed_checkpoint_write_is_one_line_and_keeps_latest(tmp_path, saved_run):
    """A real write failure: files may not grow past 1 MiB, so the next checkpoint's 4.9 MB shard file fails in
    torch's writer. One line names the checkpoint, the cause, about one checkpoint's size (within 2% of the last
    one saved) and the free space; the temp dir is gone, `latest` still names step-000004, train.log has the line
    and its traceback."""
    import re

    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    ckpt = run / "checkpoints"
    saved = sum(p.stat().st_size for p in (ckpt / "step-000004").iterdir())
    out = subprocess.run([sys.executable, "-m", "qwenft", "train", "train.max_steps=5", f"run_dir={run}", *FAST, *CKPT],
                         cwd=REPO, capture_output=True, text=True, env=ENV, timeout=600,
                         preexec_fn=lambda: _small_files(2**20))
    line = one_line_error(out, f"checkpoint {ckpt / 'step-000005'} could not be written (",
                          "the partial save was removed and `latest` still names step-000004", "rerun to resume")
    sizes = re.search(r"a checkpoint needs about ([\d.]+ \w+), ([\d.]+ \w+) free there", line)
    assert sizes, line
    assert abs(_bytes(sizes.group(1)) - saved) < 0.02 * saved, (sizes.group(1), saved)
    assert abs(_bytes(sizes.group(2)) - shutil.disk_usage(run).free) < 2**30  # others write on this disk too
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", *(f"step-00000{i}" for i in range(1, 5))]
    assert (ckpt / "latest").read_text().strip() == "step-000004"
    log = (run / "train.log").read_text()
    assert line.removeprefix("qwenft: error: ") in log and "Traceback" in log


def _train_with_small_files_on_rank_0(rank, world_size, overrides):
    from helpers import train

    if rank == 0:
        _small_files(2**20)
    try:
        train(rank, world_size, overrides)
    except ValueError as e:
        return str(e)
    return "trained"


@pytest.mark.slow
@pytest.mark.distributed
def test_checkpoint_write_failing_on_one_rank_stops_every_rank_with_its_line(tmp_path):
    """Rank 0's shard file cannot be written, rank 1's can: both ranks stop with the same line (no rank waits for
    the other in a collective; rank 0 prints it), and nothing of the save is left."""
    from distributed import run_distributed
    from helpers import tiny_overrides

    run = tmp_path / "run"
    overrides = tiny_overrides(run, "train.max_steps=1", "checkpoint.every_steps=1", "checkpoint.export_hf=false",
                               "train.global_batch_size=4")
    import re

    lines = run_distributed(_train_with_small_files_on_rank_0, 2, overrides, timeout=240)
    free = r"[\d.]+ \w+ free there"  # each rank's own look at the disk, a moment apart
    assert re.sub(free, "", lines[0]) == re.sub(free, "", lines[1]), lines
    assert lines[0].startswith(f"checkpoint {run / 'checkpoints' / 'step-000001'} could not be written (")
    assert "the partial save was removed and there is no earlier checkpoint" in lines[0]
    assert list((run / "checkpoints").iterdir()) == []
