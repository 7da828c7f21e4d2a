"""Checkpoint bookkeeping at its edges, on real runs (CPU, tiny) and real checkpoint dirs: a pointer cut short or
naming a damaged step dir, `best` against a non-finite val_loss and with keep_best turned off, the checkpoint a stop
signal writes, an async save in flight when the run fails, counts carried across a resume, a resumed run's final
checkpoint without checkpoint.every_steps, and refused resumes that leave the run dir as it was."""

import json
import os
import shutil
import signal

import pytest

from distributed import run_distributed
from helpers import compose, read_metrics, tiny_overrides, train
from qwenft.checkpoint import files
from qwenft.checkpoint.dcp import Checkpointer
from qwenft.launch import signals

SMALL = ("data.seq_len=64", "train.global_batch_size=2", "train.micro_batch_size=1", "checkpoint.export_hf=false")
BLOW_UP = ("optim.lr=1e30", "lr_scheduler.warmup_steps=0", "lr_scheduler.decay=constant")  # step 2 is not finite


def _run(run_dir, *extra):
    return run_distributed(train, 1, tiny_overrides(run_dir, *SMALL, *extra))[0]


def _refused(rank, world_size, overrides):
    """A run_distributed fn: the run's ValueError, as text (None when it trained)."""
    from qwenft.train.runner import run

    try:
        run(compose(overrides))
    except ValueError as e:
        return str(e)


def _pointer(root, name) -> str:
    return (root / name).read_text().strip()


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    """2 steps, a checkpoint after each. Tests copy it."""
    run_dir = tmp_path_factory.mktemp("two") / "run"
    _run(run_dir, "train.max_steps=2", "checkpoint.every_steps=1")
    return run_dir


# ---------------------------------------------------------------- pointers

@pytest.mark.distributed
def test_a_pointer_cut_short_or_naming_a_damaged_dir(tmp_path, two_steps, capsys):
    """An empty `latest` (a crash while writing it): resume=auto passes it over to the newest complete step dir, and
    the export of checkpoint=latest says what the file holds. A byte flipped in the checkpoint `latest` names: the
    export refuses it as the export of that step dir by name does."""
    from qwenft.cli import main

    run_dir = tmp_path / "run"
    shutil.copytree(two_steps, run_dir)
    ckpts = run_dir / "checkpoints"
    (ckpts / "latest").write_text("")
    path, passed_over = files.find("auto", ckpts)
    assert path == ckpts / "step-000002" and passed_over == [f"{ckpts / 'latest'} names no step dir ('')"]
    assert main(["export", f"run_dir={run_dir}", f"out={tmp_path / 'a'}"]) == 2
    assert f"checkpoint=latest: {ckpts / 'latest'} names no step dir (''); give checkpoint=STEP_DIR" in \
        capsys.readouterr().err

    files.write_pointer(ckpts, "latest", "step-000002")
    shard = ckpts / "step-000002" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert main(["export", f"run_dir={run_dir}", f"out={tmp_path / 'b'}"]) == 2
    assert (f"checkpoint=latest: {ckpts / 'step-000002'} is incomplete or corrupt (__0_0.distcp has another checksum "
            f"than when saved); give another checkpoint=STEP_DIR") in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


# ---------------------------------------------------------------- best

def _publisher(root, keep: int, keep_best: bool) -> Checkpointer:
    """A Checkpointer for `_publish` alone: the renames, pointers and rotation of a save, on the files under `root`
    (no model, optimizer or process group: those write what `_publish` renames)."""
    checkpointer = Checkpointer.__new__(Checkpointer)
    checkpointer.root, checkpointer.keep, checkpointer.keep_best, checkpointer.resumed_step = root, keep, keep_best, None
    return checkpointer


def _publish(checkpointer, step: int, val_loss):
    tmp = checkpointer.root / f".step-{step:06d}.tmp"
    tmp.mkdir()
    (tmp / files.META).write_text(json.dumps({"step": step, "val_loss": val_loss}))
    checkpointer._publish(f"step-{step:06d}", val_loss)


def test_best_passes_over_a_val_loss_that_is_not_finite(tmp_path):
    checkpointer = _publisher(tmp_path, keep=1, keep_best=True)
    _publish(checkpointer, 1, float("nan"))
    assert not (tmp_path / "best").exists()
    _publish(checkpointer, 2, 5.0)
    assert _pointer(tmp_path, "best") == "step-000002"
    _publish(checkpointer, 3, float("inf"))
    _publish(checkpointer, 4, 4.0)
    assert _pointer(tmp_path, "best") == "step-000004" and sorted(p.name for p in tmp_path.iterdir()) == [
        "best", "latest", "step-000004"]


def test_keep_best_turned_off_rotates_best_away_with_its_pointer(tmp_path):
    checkpointer = _publisher(tmp_path, keep=1, keep_best=True)
    _publish(checkpointer, 1, 3.0)
    _publish(checkpointer, 2, 4.0)
    assert _pointer(tmp_path, "best") == "step-000001"
    checkpointer.keep_best = False
    _publish(checkpointer, 3, 5.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000003"]


def _train_stopped_after(rank, world_size, overrides, step):
    """helpers.train with SIGTERM sent to this process after `step`: the run stops, with a checkpoint, after the
    step that reads the signal (the next)."""
    from qwenft.train.runner import run

    return run(compose(overrides), on_step=lambda s: os.kill(os.getpid(), signal.SIGTERM) if s == step else None)


@pytest.mark.distributed
def test_a_stop_signals_checkpoint_keeps_its_val_loss_and_can_be_best(tmp_path):
    run_dir = tmp_path / "run"
    overrides = tiny_overrides(run_dir, *SMALL, "train.max_steps=6", "checkpoint.every_steps=4",
                               "checkpoint.keep_best=true", "eval.every_steps=1", "eval.dataset=tiny",
                               "eval.max_batches=1")
    (result,) = run_distributed(_train_stopped_after, 1, overrides, 1)
    assert result.preempted == "SIGTERM" and len(result.losses) == 2
    ckpts = run_dir / "checkpoints"
    val_loss = json.loads((ckpts / "step-000002" / files.META).read_text())["val_loss"]
    assert val_loss == result.val_losses[2] and _pointer(ckpts, "best") == "step-000002"


# ---------------------------------------------------------------- a run that fails or resumes

@pytest.mark.distributed
def test_an_async_save_in_flight_is_published_before_a_non_finite_step_fails_the_run(tmp_path):
    run_dir = tmp_path / "run"
    message, = run_distributed(_refused, 1, tiny_overrides(
        run_dir, *SMALL, *BLOW_UP, "train.max_steps=3", "checkpoint.every_steps=1", "checkpoint.async_save=true",
        "train.on_nonfinite=error"))
    assert message.startswith("non-finite loss/grad norm at step 2"), message
    ckpts = run_dir / "checkpoints"
    assert _pointer(ckpts, "latest") == "step-000001" and not files.damage(ckpts / "step-000001")


@pytest.mark.distributed
def test_skipped_steps_count_on_across_a_resume(tmp_path):
    run_dir = tmp_path / "run"
    skip = (*BLOW_UP, "train.on_nonfinite=skip", "checkpoint.every_steps=3")
    assert _run(run_dir, *skip, "train.max_steps=3").skipped_steps == 2
    assert _run(run_dir, *skip, "train.max_steps=4").skipped_steps == 3
    assert [r["skipped_steps"] for r in read_metrics(run_dir) if "loss" in r] == [0, 1, 2, 3]


@pytest.mark.distributed
def test_a_run_resumed_in_its_run_dir_without_every_steps_saves_at_its_end(tmp_path, two_steps):
    """Else the checkpoint it resumed from (as a stop signal's is) stays `latest`, and the same command, run again,
    trains its steps again."""
    run_dir = tmp_path / "run"
    shutil.copytree(two_steps, run_dir)
    assert len(_run(run_dir, "train.max_steps=3", "checkpoint.every_steps=0").losses) == 1
    assert _pointer(run_dir / "checkpoints", "latest") == "step-000003"
    assert _run(run_dir, "train.max_steps=3", "checkpoint.every_steps=0").losses == []
    # a warm start from another run dir's checkpoint writes none: checkpointing stays off there
    warm = tmp_path / "warm"
    _run(warm, "train.max_steps=3", "checkpoint.every_steps=0",
         f"checkpoint.resume={two_steps / 'checkpoints' / 'step-000002'}")
    assert not (warm / "checkpoints").exists() or not any((warm / "checkpoints").iterdir())


@pytest.mark.distributed
def test_a_refused_resume_leaves_the_marker_and_config(tmp_path, two_steps):
    """A stopped run's preemption marker (what a requeue script reads) and its config.yaml stay as they were when a
    resume is refused: here for another global batch size, and for other mixture weights."""
    run_dir = tmp_path / "run"
    shutil.copytree(two_steps, run_dir)
    signals.write_marker(run_dir, 2, "SIGTERM", run_dir / "checkpoints" / "step-000002")
    marker, config = (run_dir / signals.MARKER).read_text(), (run_dir / "config.yaml").read_text()
    message, = run_distributed(_refused, 1, tiny_overrides(run_dir, *SMALL, "train.max_steps=3",
                                                          "train.global_batch_size=4"))
    assert "train.global_batch_size=4, but" in message, message
    assert (run_dir / signals.MARKER).read_text() == marker and (run_dir / "config.yaml").read_text() == config


@pytest.mark.distributed
def test_a_resume_with_other_mixture_weights_is_refused_before_the_config_is_rewritten(tmp_path):
    from qwenft.data.tiny_chat import TRAIN_PATH, VAL_PATH

    run_dir = tmp_path / "run"

    def sources(weight):
        return f"data.sources=[{{path: {TRAIN_PATH}, weight: 1}}, {{path: {VAL_PATH}, weight: {weight}}}]"

    _run(run_dir, "train.max_steps=1", "checkpoint.every_steps=1", sources(1))
    config = (run_dir / "config.yaml").read_text()
    message, = run_distributed(_refused, 1, tiny_overrides(run_dir, *SMALL, "train.max_steps=2", sources(3)))
    assert "data.sources (name, weight) are [['tiny_chat', 1.0], ['tiny_chat_val', 3.0]], but" in message, message
    assert message.endswith("resume with those, or start afresh with checkpoint.resume=none in a new run_dir")
    assert (run_dir / "config.yaml").read_text() == config
