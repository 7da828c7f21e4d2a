"""`python -m qwenft.launch.torchrun ARGS` = `torchrun ARGS`, except that torchrun ignores SIGUSR1.

SLURM delivers a step's signal to every process of the step: torchrun and its workers. torchrun does not
handle SIGUSR1 by default, so the signal would kill it (and then its workers); told to handle it
(--signals-to-handle), it forwards it and SIGKILLs the workers 30 s later, which can cut a large checkpoint
short (torch 2.11 has the 30 s fixed; 2.13 reads TORCH_ELASTIC_SHUTDOWN_TIMEOUT). Ignored here, the workers
(which inherit SIG_IGN and install their own handler when training starts) save at their pace and exit.
"""

import signal

if __name__ == "__main__":
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    from torch.distributed.run import main

    main()
