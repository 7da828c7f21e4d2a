"""One `qwenft train` per run dir: rank 0 holds an exclusive lock on `<run_dir>/.lock` for the run's life.

A second run into the same dir (two shells, a requeued job whose first copy still runs) would interleave its
steps into metrics.jsonl and race the first one's checkpoint saves; it fails at once instead, naming the
holder. The lock is `flock`'s: the kernel drops it when the holder dies however it dies, so a lock file left
by a dead process is no obstacle (its stale pid/host text is just overwritten).
"""

import fcntl
import os
import socket
from pathlib import Path

LOCK = ".lock"


class RunLock:
    def __init__(self, path: Path, fd: int):
        self.path, self.fd = path, fd

    def release(self) -> None:
        """Unlink, then unlock: a run waiting on this file finds it gone and locks a fresh one (acquire checks
        that the file it locked is still the one at the path)."""
        if self.fd is None:
            return
        self.path.unlink(missing_ok=True)
        os.close(self.fd)
        self.fd = None


def acquire(run_dir: Path) -> RunLock:
    """Lock `run_dir` for this process, or raise ValueError naming the process that holds it."""
    path = run_dir / LOCK
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 256).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise ValueError(f"run_dir={run_dir} is in use by another qwenft run ({holder}); wait for it to end or "
                             f"stop it, or give another run_dir") from None
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:  # the holder released it between our open and our lock
            same = False
        if same:
            break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode())
    return RunLock(path, fd)
