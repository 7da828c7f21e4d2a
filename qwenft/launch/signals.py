"""Preemption: SIGTERM or SIGUSR1 to any rank stops every rank at the same step boundary, after a checkpoint.

A handler only records the signal; the runner asks `StopOnSignal.agreed()` after each step, an all-reduce
(MAX) of one integer over the world group, so every rank sees the same answer at the same step even when only
one rank was signalled. The run then saves a checkpoint, writes `<run_dir>/preempted` and `qwenft train`
exits with EXIT_PREEMPTED.

Under torchrun the workers' exit code does not reach the caller (torchrun exits 1 when a worker exits with
anything but 0), so the marker file is what tells a batch script "preempted, requeue me" from "failed".
"""

import signal
from pathlib import Path

import torch
import torch.distributed as dist

# EX_TEMPFAIL from sysexits.h: "temporary failure, try again later": the run saved a checkpoint and stopped.
EXIT_PREEMPTED = 75
# In the run dir: written (rank 0) after the preemption checkpoint is complete, removed when a run starts.
MARKER = "preempted"
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopOnSignal:
    """While entered, SIGTERM and SIGUSR1 set a flag instead of ending the process; leaving restores the
    previous handlers. Signals must be installed from the main thread (Python's rule)."""

    def __init__(self):
        self.signum = 0
        self._previous = {}

    def _record(self, signum, frame) -> None:
        self.signum = signum

    def __enter__(self) -> "StopOnSignal":
        self._previous = {s: signal.signal(s, self._record) for s in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def agreed(self, device: torch.device) -> str | None:
        """Collective over the world group: the name of a signal some rank received, or None."""
        flag = torch.tensor([self.signum], device=device, dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        signum = int(flag.item())
        return signal.Signals(signum).name if signum else None


def clear_marker(run_dir: Path) -> None:
    (run_dir / MARKER).unlink(missing_ok=True)


def write_marker(run_dir: Path, step: int, signal_name: str, checkpoint: Path) -> None:
    (run_dir / MARKER).write_text(f"step {step}, {signal_name}, checkpoint {checkpoint}\n")


def preempted(run_dir: Path) -> bool:
    return (run_dir / MARKER).is_file()
