"""Run a function on `world_size` gloo ranks forked from the already-imported pytest process.

Forking skips the per-rank torch + transformers import (7-8 s each): 6 distributed tests took 36 s this
way against ~300 s with torchrun on the 2-core CI box.
"""

import faulthandler
import multiprocessing as mp
import os
import pickle
import queue as queue_module
import signal
import socket
import time
import traceback


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def threads_per_rank() -> int:
    """Torch threads in each forked rank: QWENFT_TEST_THREADS, else 1. Matmul kernels split their sums by the thread
    count, so running the suite at 1 and 2 checks that the parity bounds hold for other summation orders."""
    return int(os.environ.get("QWENFT_TEST_THREADS", "1"))


def _worker(rank, world_size, port, fn, args, queue):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads_per_rank())
    # the parent sends SIGUSR2 to a rank that outlives the timeout: every thread's stack goes to stderr
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        # rank 0 holds the TCPStore: wait until every rank is done with it (one may still be creating its mesh's
        # groups), or their store connection breaks
        if dist.is_initialized():
            dist.barrier()
        # Plain pickle: the queue's pickler would share tensor memory through file descriptors, which
        # vanish when this process exits before the parent reads them.
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # report every failure to the parent, whatever its kind
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, timeout: float = 300.0) -> list:
    """Call fn(rank, world_size, *args) on each rank; return the results in rank order.

    fn's arguments are inherited through fork; its result must be picklable.
    """
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, []
    deadline, grace = time.monotonic() + timeout, 0
    try:
        while len(results) < world_size and not errors:
            try:
                rank, status, payload = queue.get(timeout=1.0)
            except queue_module.Empty:
                # a rank that exited without reporting never will (a crash or a kill): fail now, once a report it
                # put just before exiting has had 3 s to come through the pipe
                dead = [r for r, p in enumerate(procs) if r not in results and p.exitcode is not None]
                grace = grace + 1 if dead else 0
                if grace > 3:
                    errors += [f"rank {r}: exited with code {procs[r].exitcode} before reporting" for r in dead]
                elif time.monotonic() > deadline:
                    for p in procs:  # each live rank prints its threads' stacks to stderr (pytest shows it)
                        if p.is_alive():
                            os.kill(p.pid, signal.SIGUSR2)
                    time.sleep(2.0)
                    errors.append(f"ranks {sorted(set(range(world_size)) - set(results))} did not finish within "
                                  f"{timeout:.0f} s (their stacks are in the captured stderr)")
                continue
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors.append(f"rank {rank}:\n{payload}")
    finally:
        for p in procs:
            p.join(timeout=5 if errors else timeout)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("distributed test failed on " + "\n".join(errors))
    return [results[r] for r in range(world_size)]

