"""Ctrl-C on real signals to this process: the first stops after the step with a checkpoint, a second (not the
same Ctrl-C forwarded by torchrun) stops at once with nothing half-written; and the warning at start when the
disk under checkpoints/ has less room than one checkpoint, whose size it states (checked against a real save)."""

import os
import re
import shutil
import signal
import threading
import time

import pytest

from helpers import qwenft_alone, read_metrics, tiny_overrides, train_alone
from qwenft.launch import signals


def _ctrl_c() -> None:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)  # the handler runs in this (main) thread; sleep returns once it has


def test_ctrl_c_counts_once_within_the_window_and_waits_for_uninterruptible_blocks():
    with signals.StopOnSignal() as stop:
        _ctrl_c()
        assert stop.signum == signal.SIGINT and not stop.interrupted
        _ctrl_c()  # the same Ctrl-C forwarded by a torchrun: within SAME_CTRL_C_S of the first
        assert not stop.interrupted
        time.sleep(signals.SAME_CTRL_C_S)
        finished = False
        with pytest.raises(signals.Interrupted):
            with signals.uninterruptible():
                _ctrl_c()
                finished = True  # the block ran to its end: the Ctrl-C waited for it
        assert finished and stop.interrupted
        _ctrl_c()  # stopping already: a third is ignored
    assert signal.getsignal(signal.SIGINT) is not stop._ctrl_c  # the previous handler is back


@pytest.mark.slow
def test_second_ctrl_c_during_the_stop_save_leaves_latest_and_no_temp_dir(tmp_path, monkeypatch, capfd):
    """The first Ctrl-C after step-000002 is saved; the second comes while the stop's own checkpoint is written
    (a slow disk: fsync waits until the second Ctrl-C counts as one). Exit 130 with one line naming the checkpoint
    to resume from; `latest` still names step-000002 and no temp dir or pointer file is left."""
    run_dir = tmp_path / "run"
    ckpt = run_dir / "checkpoints"
    first = []

    def press_once_step_2_is_saved():
        while not ((ckpt / "latest").is_file() and any(r["step"] >= 3 for r in read_metrics(run_dir))):
            time.sleep(0.02)
        first.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)

    real_fsync = os.fsync

    def slow_fsync(fd):
        if first and not getattr(slow_fsync, "pressed", False):
            time.sleep(max(0.0, first[0] + signals.SAME_CTRL_C_S + 0.1 - time.monotonic()))
            slow_fsync.pressed = True
            os.kill(os.getpid(), signal.SIGINT)
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", slow_fsync)
    threading.Thread(target=press_once_step_2_is_saved, daemon=True).start()
    code = qwenft_alone("train", *tiny_overrides(run_dir, "train.max_steps=40", "checkpoint.every_steps=2",
                                                 "checkpoint.export_hf=false", "train.global_batch_size=4"))
    err = capfd.readouterr().err
    assert code == signals.EXIT_INTERRUPTED == 130, err[-3000:]
    assert getattr(slow_fsync, "pressed", False), "the second Ctrl-C came in a save"
    assert "Traceback" not in err
    assert err.count("qwenft: Ctrl-C: stopping at the end of this step or the next, after a checkpoint") == 1
    lines = [line for line in err.splitlines() if line.startswith("qwenft: stopped at once")]
    assert len(lines) == 1, err[-3000:]
    assert (f"the newest complete checkpoint is {ckpt / 'step-000002'}; resume with: qwenft train recipe=tiny"
            in lines[0] and f"run_dir={run_dir}" in lines[0]), lines[0]
    assert (ckpt / "latest").read_text().strip() == "step-000002"
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step-000002"]  # no .step-*.tmp, no .latest.tmp
    assert not (run_dir / signals.MARKER).exists()
    assert "stopped at once by a second Ctrl-C" in (run_dir / "train.log").read_text()


@pytest.mark.slow
def test_low_disk_warning_at_start_states_one_checkpoints_size(tmp_path, monkeypatch):
    """shutil.disk_usage reports 4096 bytes free: one warning line at start with the estimated size of a
    checkpoint, which is within 2% of the size of the checkpoint the run then writes."""
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=4096))
    run_dir = tmp_path / "run"
    train_alone(tiny_overrides(run_dir, "train.max_steps=1", "checkpoint.every_steps=1", "checkpoint.export_hf=false",
                               "train.global_batch_size=2"))
    lines = [line for line in (run_dir / "train.log").read_text().splitlines() if "less than one checkpoint" in line]
    assert len(lines) == 1, lines
    assert f"WARNING checkpoints: 4096 bytes free under {run_dir / 'checkpoints'}, less than one checkpoint" in lines[0]
    estimate = float(re.search(r"less than one checkpoint \(about ([\d.]+) MiB\)", lines[0]).group(1)) * 2**20
    written = sum(p.stat().st_size for p in (run_dir / "checkpoints" / "step-000001").iterdir())
    assert abs(estimate - written) < 0.02 * written, (estimate, written)


def test_a_launchers_children_stop_when_it_is_killed(tmp_path):
    """`qwenft train launcher.nproc_per_node=N` starts torchrun with `signals.stop_with_parent()`: a SIGKILL of the
    launcher (which no handler sees) reaches the child as SIGTERM, which torchrun passes to its workers."""
    import subprocess
    import sys

    child = ("import signal, sys, time, pathlib\n"
             f"signal.signal(signal.SIGTERM, lambda *a: (pathlib.Path({str(tmp_path / 'stopped')!r}).touch(), "
             "sys.exit(0)))\n"
             f"pathlib.Path({str(tmp_path / 'ready')!r}).touch()\n"
             "time.sleep(120)\n")
    launcher = ("import subprocess, sys, time\n"
                "from qwenft.launch import signals\n"
                f"subprocess.Popen([sys.executable, '-c', {child!r}], preexec_fn=signals.stop_with_parent())\n"
                "time.sleep(120)\n")
    parent = subprocess.Popen([sys.executable, "-c", launcher])
    deadline = time.monotonic() + 120
    while not (tmp_path / "ready").exists():
        assert time.monotonic() < deadline and parent.poll() is None
        time.sleep(0.05)
    parent.kill()
    parent.wait()
    while not (tmp_path / "stopped").exists():
        assert time.monotonic() < deadline, "the child outlived its killed parent"
        time.sleep(0.05)
