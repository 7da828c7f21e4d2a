"""`python -m qwenft.launch.torchrun ARGS` = `torchrun ARGS`, except that torchrun ignores SIGUSR1 and SIGINT and that
workers that stop on a user mistake (exit code 2), after a signal with a checkpoint (75) or on a second Ctrl-C (130)
leave that exit code and their own lines, not torchrun's ChildFailedError traceback and exit code 1. A user
mistake's one line comes from here: each failing rank writes it into its torchrun error file (`qwenft.cli._fail`),
and the first failed rank's is printed once, naming the rank when it is not rank 0, so a mistake that one rank alone
meets (a path missing on its node) is shown too.

SLURM delivers a step's signal to every process of the step: torchrun and its workers. torchrun does not
handle SIGUSR1 by default, so the signal would kill it (and then its workers); told to handle it
(--signals-to-handle), it forwards it and SIGKILLs the workers 30 s later, which can cut a large checkpoint
short (torch 2.11 has the 30 s fixed; 2.13 reads TORCH_ELASTIC_SHUTDOWN_TIMEOUT). Ignored here, the workers
(which inherit SIG_IGN and install their own handler when training starts) save at their pace and exit.

torchrun starts each worker in a session of its own, so a terminal's Ctrl-C reaches torchrun alone. torchrun would
forward it and SIGKILL the workers 30 s later, and a second Ctrl-C would end torchrun in its shutdown without
reaching them. Here SIGINT is left out of torchrun's handled signals, and each one is passed to the workers as it
comes: the first makes them save and stop, a second makes them stop at once (qwenft.launch.signals).
"""

import logging
import os
import signal
import sys

from qwenft.launch import ERROR_PREFIX, LINE_TO_LAUNCHER, with_rank
from qwenft.launch.signals import EXIT_INTERRUPTED, EXIT_PREEMPTED

EXIT_USER_ERROR = 2  # qwenft.cli's exit code for a config, input or file fault
_PASSED_ON = (EXIT_USER_ERROR, EXIT_PREEMPTED, EXIT_INTERRUPTED)


class _QuietUserErrors(logging.Filter):
    """Drop the elastic agent's lines about a worker that exited with a code it explains itself (2, 75, 130) and
    about the SIGTERM that then stops the others (a crash's own summary still lists every worker's exit)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        # "child error file": torchrun's own error-file bookkeeping about the file a worker's mistake wrote
        return (not any(f"exitcode: {code})" in message for code in _PASSED_ON) and "closing signal" not in message
                and "child error file" not in message)


def _children() -> list[int]:
    """The pids of this process's children (torchrun's workers), from /proc (Linux; none elsewhere)."""
    me, found = os.getpid(), []
    for entry in os.scandir("/proc") if os.path.isdir("/proc") else []:
        try:  # /proc/PID/stat: "PID (command) STATE PPID ...", the command may hold spaces and parentheses
            if entry.name.isdigit() and int(open(f"{entry.path}/stat").read().rsplit(")", 1)[1].split()[1]) == me:
                found.append(int(entry.name))
        except (OSError, ValueError, IndexError):  # it has just exited
            pass
    return found


def user_error_line(rank: int, message) -> str | None:
    """The line to print for a worker that stopped on a user mistake: its error file's line (`message`, as torch's
    ProcessFailure read it), with the rank named unless it is 0; None when the worker wrote none."""
    if not isinstance(message, str) or not message.startswith(ERROR_PREFIX):
        return None
    return with_rank(message, rank)


def first_user_error(failures: dict) -> str | None:
    """The line of the earliest of the failed workers (rank -> torch's ProcessFailure) that wrote a user mistake's
    line, whatever its exit code: one may be stopped by torchrun between writing it and exiting, and the ranks that
    a mistake leaves waiting in a collective may fail before torchrun stops them."""
    lines = sorted((f.timestamp, rank, line) for rank, f in failures.items()
                   if (line := user_error_line(rank, f.message)))
    return lines[0][2] if lines else None


def _pass_to_workers(signum, frame) -> None:
    for pid in _children():
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


if __name__ == "__main__":
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGINT, _pass_to_workers)
    os.environ.setdefault("PET_SIGNALS_TO_HANDLE", "SIGTERM,SIGHUP,SIGQUIT")  # torchrun's default less SIGINT
    os.environ[LINE_TO_LAUNCHER] = "1"
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main

    for name in ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api",
                 "torch.distributed.elastic.multiprocessing.errors.error_handler"):
        logging.getLogger(name).addFilter(_QuietUserErrors())
    try:
        main()
    except ChildFailedError as e:
        if line := first_user_error(e.failures):
            print(line, file=sys.stderr)
            sys.exit(EXIT_USER_ERROR)
        _, first = e.get_first_failure()  # the others were stopped by torchrun after it
        if first.exitcode in _PASSED_ON:
            sys.exit(first.exitcode)
        raise
