"""Stopping a run on a signal. SIGTERM, SIGUSR1 or a first Ctrl-C (SIGINT) to any rank stops every rank at the same
step boundary, after a checkpoint; a second Ctrl-C stops at once, without one.

A handler only records the signal; every step the runner asks `StopOnSignal.ask()` (an all-reduce (MAX) of one
integer over the world group, launched just before the step reads its loss) and reads the answer with the loss
(`agreed_signal()`), so every rank sees the same answer at the same step even when only one rank was signalled,
and the question costs no wait of its own: a signal that comes later in the step stops the run after the next.
The run then saves a checkpoint, writes `<run_dir>/preempted` and `qwenft train` exits with EXIT_PREEMPTED. A
second Ctrl-C raises `Interrupted` where the process is; the runner removes the checkpoint being written, if
any, and `qwenft train` exits with EXIT_INTERRUPTED.

Under torchrun the workers' exit code does not reach the caller (torchrun exits 1 when a worker exits with
anything but 0), so the marker file is what tells a batch script "preempted, requeue me" from "failed".
"""

import os
import shlex
import signal
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from qwenft.transfer import copy_to_device

# EX_TEMPFAIL from sysexits.h: "temporary failure, try again later": the run saved a checkpoint and stopped.
EXIT_PREEMPTED = 75
# 128 + SIGINT, what a shell reports for a program Ctrl-C ended: a second Ctrl-C stopped the run without a checkpoint.
EXIT_INTERRUPTED = 130
# In the run dir: written (rank 0) after the preemption checkpoint is complete, removed when a run starts.
MARKER = "preempted"
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# One Ctrl-C can reach a process twice: from the terminal and again from a launcher in the same process group that
# passes it on (srun; torchrun versions that keep their workers in the terminal's group). SIGINTs this soon after
# the first are that one.
SAME_CTRL_C_S = 1.0

_active: "StopOnSignal | None" = None  # the StopOnSignal entered in this process, for `uninterruptible`


class Interrupted(KeyboardInterrupt):
    """A second Ctrl-C: the run stops where it is."""


def _say(line: str) -> None:
    """One line on stderr from rank 0 (every rank of a terminal's process group gets the Ctrl-C). os.write: this runs
    in a signal handler, which may have interrupted a print or a log call."""
    if os.environ.get("RANK", "0") == "0":
        os.write(2, f"\nqwenft: {line}\n".encode())


class StopOnSignal:
    """While entered, SIGTERM, SIGUSR1 and a first SIGINT set a flag instead of ending the process; a second SIGINT
    (SAME_CTRL_C_S or more after the first) raises Interrupted. Leaving restores the previous handlers. Signals must
    be installed from the main thread (Python's rule). `command_args` (the `qwenft train` arguments) make the resume
    command the stop message prints; `torchrun`: the run was started by a torchrun of the user's."""

    def __init__(self, command_args: list[str] | None = None, torchrun: bool = False):
        self.signum = 0
        self.first_ctrl_c: float | None = None
        self.interrupted = False  # a second Ctrl-C came
        self.command_args, self.torchrun = command_args, torchrun
        self._critical, self._deferred = 0, False
        self._previous = {}

    def _record(self, signum, frame) -> None:
        self.signum = signum

    def _ctrl_c(self, signum, frame) -> None:
        now = time.monotonic()
        if self.interrupted:  # stopping already: the cleanup (removing a temp dir) is not cut short
            return
        if self.first_ctrl_c is None:
            self.first_ctrl_c, self.signum = now, signum
            _say("Ctrl-C: stopping at the end of this step or the next, after a checkpoint; press Ctrl-C again to stop "
                 "at once without one")
        elif now - self.first_ctrl_c >= SAME_CTRL_C_S:
            self.interrupted = True
            if self._critical:  # a checkpoint's rename and pointers: raised once they are done
                self._deferred = True
            else:
                raise Interrupted

    def __enter__(self) -> "StopOnSignal":
        global _active
        self._previous = {s: signal.signal(s, self._record) for s in SIGNALS}
        self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._ctrl_c)
        _active = self
        return self

    def __exit__(self, *exc) -> None:
        global _active
        _active = None
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def ask(self, device: torch.device) -> torch.Tensor:
        """Collective over the world group: starts agreeing on the signal some rank received (`agreed_signal`
        reads the answer). The flag goes to a GPU through pinned memory: the host does not wait there for it."""
        flag = copy_to_device(torch.tensor([self.signum], dtype=torch.int32), device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag

    def resume_command(self, run_dir: Path) -> str:
        """The command that continues this run: its arguments with this run dir, and without checkpoint.resume
        (auto, the default, finds the newest checkpoint)."""
        if self.command_args is None:
            return f"the same command with run_dir={run_dir}"
        args = [a for a in self.command_args if not a.startswith(("run_dir=", "checkpoint.resume="))]
        prefix = "torchrun <its options> -m qwenft train" if self.torchrun else "qwenft train"
        return " ".join([prefix, *map(shlex.quote, args), shlex.quote(f"run_dir={run_dir}")])


def agreed_signal(signum: int) -> str | None:
    """The name of the signal that `StopOnSignal.ask`'s all-reduce agreed on (its flag's value), or None."""
    return signal.Signals(signum).name if signum else None


@contextmanager
def uninterruptible():
    """A second Ctrl-C during the block takes effect at its end (a few renames and deletions that must not stop
    halfway)."""
    stop = _active
    if stop is None:
        yield
        return
    stop._critical += 1
    try:
        yield
    finally:
        stop._critical -= 1
        if not stop._critical and stop._deferred:
            stop._deferred = False
            raise Interrupted


def stop_with_parent():
    """A `subprocess.Popen` preexec_fn: on Linux, the child gets SIGTERM when the process that started it dies, so
    a `qwenft train launcher.nproc_per_node=N` killed with SIGKILL (an OOM killer, a scheduler) takes torchrun
    along, which stops its workers after a checkpoint, instead of leaving them training under init, holding the
    run dir. None elsewhere."""
    if os.uname().sysname != "Linux":
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it
    parent = os.getpid()
    pr_set_pdeathsig = 1

    def preexec() -> None:
        prctl(pr_set_pdeathsig, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def clear_marker(run_dir: Path) -> None:
    (run_dir / MARKER).unlink(missing_ok=True)


def write_marker(run_dir: Path, step: int, signal_name: str, checkpoint: Path) -> None:
    (run_dir / MARKER).write_text(f"step {step}, {signal_name}, checkpoint {checkpoint}\n")


def preempted(run_dir: Path) -> bool:
    return (run_dir / MARKER).is_file()
