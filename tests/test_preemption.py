"""Preemption and kill/resume on real runs: `qwenft train` killed with SIGKILL or stopped with SIGTERM or Ctrl-C
resumes to the losses of a run that never stopped, bit for bit (fp32, CPU); a signal to one of two ranks stops
both at the same step with a complete checkpoint."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from distributed import run_distributed
from helpers import REPO, compose, logged_losses, read_metrics, tiny_overrides, train
from qwenft.launch.signals import EXIT_PREEMPTED, MARKER

# Each test trains for 15-30 s on the 2-core CPU box, on forked ranks (the uninterrupted reference) or torchrun workers
pytestmark = [pytest.mark.distributed, pytest.mark.slow]

MAX_STEPS = 24


def _overrides(run_dir, *extra):
    # ~0.2 s a step on one CPU thread: long enough to be signalled mid-run, short enough to resume quickly
    return tiny_overrides(run_dir, f"train.max_steps={MAX_STEPS}", "checkpoint.export_hf=false",
                          "train.global_batch_size=4", "train.micro_batch_size=1", "checkpoint.every_steps=4", *extra)


def _train_signalling_rank_1(rank, world_size, overrides, after_step):
    """helpers.train, and on rank 1 a thread that sends this process SIGUSR1 once metrics.jsonl shows
    after_step."""
    if rank == 1:
        run_dir = Path(compose(overrides).run_dir)
        threading.Thread(target=_signal_when_logged, daemon=True, args=(run_dir, after_step)).start()
    return train(rank, world_size, overrides)


def _signal_when_logged(run_dir: Path, step: int) -> None:
    while not any(r["step"] >= step for r in read_metrics(run_dir)):
        time.sleep(0.02)
    os.kill(os.getpid(), signal.SIGUSR1)


def _start(run_dir: Path, *extra) -> subprocess.Popen:
    log = open(run_dir.parent / f"{run_dir.name}.out", "a")
    return subprocess.Popen([sys.executable, "-m", "qwenft", "train", *_overrides(run_dir, *extra)], cwd=REPO,
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _printed(run_dir: Path, since: int = 0) -> str:
    """What the run's starts printed, from byte `since` of their output file on."""
    return (run_dir.parent / f"{run_dir.name}.out").read_bytes()[since:].decode()


def _output(run_dir: Path) -> str:
    return _printed(run_dir)[-3000:]


def _wait_for_checkpoint(proc: subprocess.Popen, run_dir: Path, timeout: float = 60, after: int = 0) -> None:
    """Until `latest` names a checkpoint of a step after `after`."""
    latest = run_dir / "checkpoints" / "latest"
    deadline = time.monotonic() + timeout
    while not (latest.exists() and _checkpoint_step(run_dir) > after):
        assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before a checkpoint after step {after}"
        assert time.monotonic() < deadline, _output(run_dir)
        time.sleep(0.02)


def _checkpoint_step(run_dir: Path) -> int:
    return int((run_dir / "checkpoints" / "latest").read_text().strip().removeprefix("step-"))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    run_distributed(train, 1, _overrides(run_dir))
    return logged_losses(run_dir)


def test_sigkill_sigterm_and_ctrl_c_each_resume_bit_identically(tmp_path, uninterrupted):
    """One run stopped three ways, each start resuming where the one before stopped: SIGKILL after a periodic
    checkpoint (no marker; the steps it logged after its checkpoint are cut on resume), then SIGTERM (a
    checkpoint at the step it stopped at, exit 75), then one Ctrl-C (SIGINT: the same, and one line with the
    command that resumes). That command, run as printed, finishes with every step once in metrics.jsonl and,
    bit for bit, the losses of a run that never stopped."""
    import shlex

    run_dir = tmp_path / "run"
    # SIGKILL: no time to save or leave a marker; the resume starts after the last periodic checkpoint
    proc = _start(run_dir)
    _wait_for_checkpoint(proc, run_dir)
    proc.kill()
    assert proc.wait(timeout=30) == -signal.SIGKILL
    killed_after = _checkpoint_step(run_dir)
    assert killed_after < MAX_STEPS and not (run_dir / MARKER).exists()

    # SIGTERM: a checkpoint at the step it stopped at, not at the last periodic one, and exit 75
    proc = _start(run_dir, "checkpoint.resume=auto")
    _wait_for_checkpoint(proc, run_dir, after=killed_after)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == EXIT_PREEMPTED == 75, _output(run_dir)
    assert f"continuing at step {killed_after + 1}" in (run_dir / "train.log").read_text()
    stopped_at = max(logged_losses(run_dir))
    assert stopped_at < MAX_STEPS
    assert _checkpoint_step(run_dir) == stopped_at
    assert (run_dir / MARKER).read_text().startswith(f"step {stopped_at}, SIGTERM, checkpoint ")
    assert f"SIGTERM: stopped after step {stopped_at}" in (run_dir / "train.log").read_text()

    # Ctrl-C on the next start (checkpoint.resume=auto is the default)
    printed_before = len(_printed(run_dir).encode())
    proc = _start(run_dir)
    _wait_for_checkpoint(proc, run_dir, after=stopped_at)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == EXIT_PREEMPTED, _output(run_dir)
    out = _printed(run_dir, printed_before)
    assert f"continuing at step {stopped_at + 1}" in out
    stopped_at = max(logged_losses(run_dir))
    assert stopped_at < MAX_STEPS and _checkpoint_step(run_dir) == stopped_at
    assert (run_dir / MARKER).read_text().startswith(f"step {stopped_at}, SIGINT, checkpoint ")
    assert out.count("qwenft: Ctrl-C: stopping at the end of this step or the next, after a checkpoint; press Ctrl-C "
                     "again to stop at once without one") == 1 and "Traceback" not in out
    (line,) = [line for line in out.splitlines() if f"SIGINT: stopped after step {stopped_at} with checkpoint" in line]
    command = shlex.split(line.split("; resume with: ")[1])
    assert command[:2] == ["qwenft", "train"] and f"run_dir={run_dir}" in command

    resumed = subprocess.run([sys.executable, "-m", "qwenft", *command[1:]], cwd=REPO, capture_output=True, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"continuing at step {stopped_at + 1}" in resumed.stderr
    assert not (run_dir / MARKER).exists()
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, MAX_STEPS + 1))
    assert logged_losses(run_dir) == uninterrupted


def test_signal_to_one_of_two_ranks_stops_both(tmp_path):
    """Only rank 1 gets SIGUSR1; the per-step all-reduce stops both ranks after the same step. No periodic
    checkpoints: the preemption checkpoint is the only one, and a 2-rank resume from it matches a 2-rank run
    that never stopped."""
    run_dir = tmp_path / "run"
    overrides = _overrides(run_dir, "checkpoint.every_steps=0", f"train.max_steps={MAX_STEPS // 2}")
    rank0, rank1 = run_distributed(_train_signalling_rank_1, 2, overrides, 3)
    assert rank0.preempted == rank1.preempted == "SIGUSR1"
    stopped_at = len(rank0.losses)
    assert len(rank1.losses) == stopped_at and 3 <= stopped_at < MAX_STEPS // 2
    step_dir = run_dir / "checkpoints" / f"step-{stopped_at:06d}"
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "extra.pt"} <= {p.name for p in step_dir.iterdir()}
    assert _checkpoint_step(run_dir) == stopped_at and (run_dir / MARKER).exists()

    resumed = run_distributed(train, 2, overrides)
    assert [len(result.losses) for result in resumed] == [MAX_STEPS // 2 - stopped_at] * 2
    reference_dir = tmp_path / "reference"
    run_distributed(train, 2, _overrides(reference_dir, "checkpoint.every_steps=0", f"train.max_steps={MAX_STEPS // 2}"))
    assert logged_losses(run_dir) == logged_losses(reference_dir)


def test_sigterm_to_self_launched_torchrun(tmp_path):
    """`qwenft train launcher.nproc_per_node=2` (torchrun underneath): SIGTERM to the command reaches both
    workers through torchrun, they stop at one step with a checkpoint, and the command exits 75 although
    torchrun itself exits 1 (SignalException)."""
    run_dir = tmp_path / "run"
    proc = _start(run_dir, "launcher.nproc_per_node=2")
    _wait_for_checkpoint(proc, run_dir, timeout=120)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=90) == EXIT_PREEMPTED, _output(run_dir)
    stopped_at = max(logged_losses(run_dir))
    assert stopped_at < MAX_STEPS and _checkpoint_step(run_dir) == stopped_at
    step_dir = run_dir / "checkpoints" / f"step-{stopped_at:06d}"
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "extra.pt"} <= {p.name for p in step_dir.iterdir()}
    log = (run_dir / "train.log").read_text()
    assert "world 2" in log and f"SIGTERM: stopped after step {stopped_at}" in log


def test_ctrl_c_in_the_terminal_of_self_launched_workers(tmp_path):
    """`qwenft train launcher.nproc_per_node=2` and a terminal's Ctrl-C, which reaches the processes of its group:
    the command and torchrun, which passes it to the workers (each in a session of its own). The workers agree on
    one step and save, and the command exits 75 with one Ctrl-C line (rank 0's), the stop line, and no traceback."""
    run_dir = tmp_path / "run"
    log = open(run_dir.parent / f"{run_dir.name}.out", "a")
    command = [sys.executable, "-m", "qwenft", "train", *_overrides(run_dir, "launcher.nproc_per_node=2")]
    proc = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"},
                            start_new_session=True)  # a process group of its own, as a terminal's job
    _wait_for_checkpoint(proc, run_dir, timeout=120)
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=90) == EXIT_PREEMPTED, _output(run_dir)
    stopped_at = max(logged_losses(run_dir))
    assert stopped_at < MAX_STEPS and _checkpoint_step(run_dir) == stopped_at
    step_dir = run_dir / "checkpoints" / f"step-{stopped_at:06d}"
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "extra.pt"} <= {p.name for p in step_dir.iterdir()}
    out = _output(run_dir)
    assert out.count("qwenft: Ctrl-C: stopping at the end of this step") == 1, out
    assert f"SIGINT: stopped after step {stopped_at} with checkpoint {step_dir}" in out and "Traceback" not in out
    assert (run_dir / MARKER).read_text().startswith(f"step {stopped_at}, SIGINT, ")
