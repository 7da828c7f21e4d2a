"""Run a function on `world_size` gloo ranks forked from the already-imported pytest process.

Forking skips the per-rank torch + transformers import (7-8 s each): 6 distributed tests took 36 s this
way against ~300 s with torchrun on the 2-core CI box.
"""

import faulthandler
import gc
import multiprocessing as mp
import os
import pickle
import queue as queue_module
import signal
import socket
import tempfile
import time
import traceback
import warnings


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def threads_per_rank() -> int:
    """Torch threads in each forked rank: QWENFT_TEST_THREADS, else 1. Matmul kernels split their sums by the thread
    count, so running the suite at 1 and 2 checks that the parity bounds hold for other summation orders."""
    return int(os.environ.get("QWENFT_TEST_THREADS", "1"))


# A forked child inherits OpenMP's (libgomp's) thread team of its parent, but not its threads: a child's parallel
# region of more than one thread (a torch op, or MKL's vectorised cos) waits at the team's barrier forever once the
# parent has run one. So a rank runs more than one thread only where the parent never has: with
# QWENFT_TEST_THREADS > 1 this process keeps to one thread from the time the test modules import this one.
if threads_per_rank() > 1:
    import torch

    torch.set_num_threads(1)


def _worker(rank, world_size, port, fn, args, queue, stacks):
    # Objects inherited from the parent are never collected here: a dead process group of an earlier in-process
    # test, still waiting in the parent's garbage, would join its gloo threads in its destructor, and those
    # threads do not exist in a forked child: the join waits forever.
    gc.freeze()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads_per_rank())
    # Inductor compiles through a pool of worker processes once it has made one, and a parent that ran a compile
    # in-process (a test of one compiled module) holds such a pool, whose reader thread a forked child lacks: a
    # child's compile would wait on it forever. Each rank compiles in its own process instead.
    import torch._inductor.config

    torch._inductor.config.compile_threads = 1
    # the runner sets its own thread count unless OMP_NUM_THREADS names one (train.rundir.set_cpu_threads)
    os.environ["OMP_NUM_THREADS"] = str(threads_per_rank())
    # the parent sends SIGUSR2 to a rank that outlives the timeout: every thread's stack goes to `stacks`
    stacks_file = open(stacks, "w")
    faulthandler.register(signal.SIGUSR2, file=stacks_file, all_threads=True)
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

    fn's arguments are inherited through fork; its result must be picklable. A run whose ranks neither finish
    nor fail within `timeout` runs once more, with a warning that carries the hung ranks' stacks: a forked process
    can inherit state that waits on the parent's threads (a lock one of them held, an object whose destructor
    joins them), which no change to the test would fix; a second hang fails the test with the stacks.
    """
    results, errors, hung = _attempt(fn, world_size, args, timeout)
    if hung:
        warnings.warn(f"{fn.__name__} on {world_size} forked ranks hung and runs again: " + "\n".join(errors))
        results, errors, hung = _attempt(fn, world_size, args, timeout)
    if errors:
        raise RuntimeError("distributed test failed on " + "\n".join(errors))
    return [results[r] for r in range(world_size)]


def run_apart(fn, n: int, *args, timeout: float = 300.0) -> list:
    """fn(i, *args) for i in range(n), each in a process of its own forked at once, as a lone rank (world size 1,
    a rendezvous port of its own): independent runs side by side on the CI box's cores. Their results in order."""
    return run_distributed(_apart, n, fn, args, timeout=timeout)


def _apart(rank, world_size, fn, args):
    import torch.distributed as dist

    dist.barrier()  # every rank has joined rank 0's store before any leaves the group
    dist.destroy_process_group()
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_PORT=str(free_port()))
    return fn(rank, *args)


def _attempt(fn, world_size: int, args: tuple, timeout: float) -> tuple[dict, list, bool]:
    """`_run_once` with the hung ranks' stacks added to its errors."""
    with tempfile.TemporaryDirectory() as stacks:
        results, errors, hung = _run_once(fn, world_size, args, timeout, stacks)
        if hung:
            errors.append(_stacks(stacks, world_size))
    return results, errors, hung


def _stacks(directory: str, world_size: int) -> str:
    """The hung ranks' stacks, as each wrote them on SIGUSR2."""
    parts = []
    for r in range(world_size):
        path = os.path.join(directory, f"rank{r}.stacks")
        text = open(path).read().strip() if os.path.exists(path) else ""
        if text:
            parts.append(f"rank {r} stacks:\n{text}")
    return "\n".join(parts) or "(no rank wrote its stacks)"


def _run_once(fn, world_size: int, args: tuple, timeout: float, stacks: str) -> tuple[dict, list, bool]:
    """One run of fn on forked ranks -> (results by rank, error texts, whether it hung past `timeout`)."""
    gc.collect()  # dead process groups (their gloo threads) are destroyed here, where the threads run, not in a child
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue,
                                               os.path.join(stacks, f"rank{r}.stacks")))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors, hung = {}, [], False
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
                    for p in procs:  # each live rank writes its threads' stacks
                        if p.is_alive():
                            os.kill(p.pid, signal.SIGUSR2)
                    time.sleep(2.0)
                    hung = True
                    errors.append(f"ranks {sorted(set(range(world_size)) - set(results))} did not finish within "
                                  f"{timeout:.0f} s")
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
    return results, errors, hung

