"""`python -m qwenft.launch.torchrun ARGS` = `torchrun ARGS`, except that torchrun ignores SIGUSR1 and that
workers failing on a user mistake (exit code 2, the one line printed by rank 0) leave exit code 2 and that
line alone, not torchrun's ChildFailedError traceback and exit code 1.

SLURM delivers a step's signal to every process of the step: torchrun and its workers. torchrun does not
handle SIGUSR1 by default, so the signal would kill it (and then its workers); told to handle it
(--signals-to-handle), it forwards it and SIGKILLs the workers 30 s later, which can cut a large checkpoint
short (torch 2.11 has the 30 s fixed; 2.13 reads TORCH_ELASTIC_SHUTDOWN_TIMEOUT). Ignored here, the workers
(which inherit SIG_IGN and install their own handler when training starts) save at their pace and exit.
"""

import logging
import signal
import sys

EXIT_USER_ERROR = 2  # qwenft.cli's exit code for a config, input or file fault


class _QuietUserErrors(logging.Filter):
    """Drop the elastic agent's lines about a worker that exited with the user-error code (it said why) and
    about the SIGTERM that then stops the others (a crash's own summary still lists every worker's exit)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return f"exitcode: {EXIT_USER_ERROR})" not in message and "closing signal" not in message


if __name__ == "__main__":
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main

    for name in ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api"):
        logging.getLogger(name).addFilter(_QuietUserErrors())
    try:
        main()
    except ChildFailedError as e:
        _, first = e.get_first_failure()  # the others were stopped by torchrun after it
        if first.exitcode == EXIT_USER_ERROR:
            sys.exit(EXIT_USER_ERROR)
        raise
