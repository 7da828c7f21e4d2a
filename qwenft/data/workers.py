"""Micro batches made ahead in background threads (`data.num_workers`), handed out in stream order.

    ahead = Prefetcher(make, plans, num_workers=2, depth=4)   # make(plan) -> batch; plans: an iterator of plans
    plan, batch = ahead.take()   # the next plan and the Future of its batch (.result() re-raises make's error)
    ahead.close()                # cancel what has not started, wait for what has (at most num_workers batches)

The training process plans every micro batch in order (which documents make its rows: cheap) and a worker
thread makes it (decode the images and video frames, run the processors: the costly part). `make` is a pure
function of the plan, and batches come back in plan order, so the batches, their order and every count the
training process keeps are those of making each batch in the training process when it is asked for.

Threads, not processes (torch DataLoader workers), because:
- nothing is forked from a process that holds CUDA, NCCL or gloo state, or from a test's forked ranks;
- SLURM's and a terminal's stop signals reach every process of the job or group: a DataLoader worker they
  stop makes torch raise in the training process, where threads leave the signal to the runner, which
  saves its checkpoint;
- a worker's error is the same exception object in the training process, its one-line message unchanged;
- nothing is pickled: the documents and the processor are shared, not copied into each worker.
The costly parts release the GIL while they run (PIL decoding and resizing, PyAV decoding, torch's
interpolate and normalize), so threads overlap them with the training step.
"""

from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

THREAD_NAME = "qwenft-data"


class Prefetcher:
    """Keeps `depth` plans of `plans` submitted to `num_workers` threads that run `make(plan)`; `take` hands
    out the oldest. The threads start here: build one after any fork, in the process that trains."""

    def __init__(self, make: Callable, plans: Iterator, num_workers: int, depth: int):
        assert num_workers >= 1 and depth >= 1, (num_workers, depth)
        self.make, self.plans, self.depth = make, plans, depth
        self.pool = ThreadPoolExecutor(num_workers, thread_name_prefix=THREAD_NAME)
        self.pending: deque[tuple[object, Future]] = deque()

    def _fill(self) -> None:
        while len(self.pending) < self.depth:
            plan = next(self.plans)
            self.pending.append((plan, self.pool.submit(self.make, plan)))

    def take(self) -> tuple[object, Future]:
        self._fill()
        oldest = self.pending.popleft()
        self._fill()  # the threads keep working while the caller trains on this one
        return oldest

    def close(self) -> None:
        for _, future in self.pending:
            future.cancel()
        self.pending.clear()
        self.pool.shutdown(wait=True, cancel_futures=True)
