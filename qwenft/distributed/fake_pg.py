"""One process playing one rank of a larger world on a process group of its own that sends nothing.

Collectives return at once and fill their outputs from this rank's inputs, as if every rank held the same
tensors: an all-gather repeats the local shard, a reduce-scatter keeps this rank's chunk of its input (no sum),
an all-to-all gets back what it sends to each rank, an all-reduce or a broadcast leaves the tensor as it is, and
a receive (or a scatter off the root), which no local tensor determines, fills with zeros. So every kernel runs
at a rank's real sizes on defined numbers with no other process: `qwenft plan` builds each rank's share this
way, scripts/bench.py --fake-world times a tensor parallel rank without its communication, and tests/gpu runs
the multi-rank code paths on one GPU. The numbers such a run trains are meaningless but finite; only shapes,
memory and time are the real rank's. A pipeline stage cannot train this way: torch's schedules receive the
other stages' shapes as pickled objects, and zeros unpickle to nothing.

Why not torch's "fake" backend (torch.testing._internal.distributed.fake_pg): on torch 2.11 (the GPU image's)
its reduce-scatter and all-to-all leave their outputs untouched, and a functional collective's output is fresh
memory, so a sequence parallel layer read garbage and trained NaN. torch 2.13's fake backend fills them as this
group does; the group can go once the oldest supported torch is 2.13. It costs host time: about 10 us of Python
a collective on the CPU box, where the C++ fake backend takes about 5.
"""

from contextlib import contextmanager

import torch
import torch.distributed as dist

BACKEND = "local_copy"


class LocalCopyGroup(dist.ProcessGroup):
    """Rank `rank` of `world_size`, every collective computed from this rank's own tensors. Each method takes
    the name the torch release calls it by (2.11: `_allgather_base`, 2.13: `all_gather_single`, ...)."""

    def __init__(self, rank: int, world_size: int):
        super().__init__(rank, world_size)
        self._rank, self._world_size = rank, world_size
        self._done = torch.futures.Future()
        self._done.set_result(None)
        self._name = self._desc = ""

    def getBackendName(self) -> str:
        return BACKEND

    # c10d keeps a group's name on its backends, which this group has none of
    def setGroupName(self, name: str) -> None:
        self._name = name

    def getGroupName(self) -> str:
        return self._name

    def setGroupDesc(self, desc: str) -> None:
        self._desc = desc

    def getGroupDesc(self) -> str:
        return self._desc

    def size(self) -> int:
        return self._world_size

    def rank(self) -> int:
        return self._rank

    def _work(self):
        return torch._C._distributed_c10d._create_work_from_future(self._done)

    # Outputs are written through detached aliases, as a real backend writes them outside autograd's view (an
    # in-place copy into a view of a tensor that autograd tracks would be refused or recorded).

    # ---- nothing to compute: every rank holds these values already (or nothing arrives)
    def allreduce(self, tensors, opts=None):
        return self._work()

    allreduce_coalesced = reduce = broadcast = allreduce

    def barrier(self, opts=None):
        return self._work()

    def send(self, tensors, dst_rank, tag):
        return self._work()

    def recv(self, tensors, src_rank, tag):
        for t in tensors:
            t.detach().zero_()
        return self._work()

    def recv_anysource(self, tensors, tag):
        return self.recv(tensors, -1, tag)

    recvAnysource = recv_anysource

    # ---- gathers: copies of the local tensor
    def allgather(self, output_lists, inputs, opts=None):
        for outputs, t in zip(output_lists, inputs, strict=True):
            for out in outputs:
                out.detach().copy_(t.detach())
        return self._work()

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        for outputs in output_lists:
            for out, t in zip(outputs, inputs, strict=True):
                out.detach().copy_(t.detach())
        return self._work()

    def all_gather_single(self, output, input, opts=None):
        self._gather_into(output, input)
        return self._work()

    def _gather_into(self, output, input):
        """The shard into the first row of the [world, shard] view of the contiguous output, then the filled rows
        doubled into the next ones: ceil(log2(world)) + 1 copies between contiguous tensors, each a device memcpy
        (a broadcasting copy of the shard into every row runs an unvectorized kernel at half the bandwidth, time
        that a real backend's collective does not spend on this GPU). FSDP gathers in place, its input a row of
        the output: the first copy reads it before any later one writes over it."""
        rows = output.detach().view(self._world_size, -1)
        rows[0].copy_(input.detach().reshape(-1))
        filled = 1
        while filled < self._world_size:
            n = min(filled, self._world_size - filled)
            rows[filled:filled + n].copy_(rows[:n])
            filled += n

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        for output, input in zip(outputs, inputs, strict=True):
            self._gather_into(output, input)
        return self._work()

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(self, output_lists, inputs, opts):
        if self._rank == opts.rootRank:
            for out in output_lists[0]:
                out.detach().copy_(inputs[0].detach())
        return self._work()

    def scatter(self, outputs, input_lists, opts):
        if self._rank == opts.rootRank:
            outputs[0].detach().copy_(input_lists[0][self._rank].detach())
        else:
            outputs[0].detach().zero_()
        return self._work()

    # ---- reduce-scatters: this rank's chunk of the local input
    def reduce_scatter(self, outputs, input_lists, opts=None):
        for out, chunks in zip(outputs, input_lists, strict=True):
            out.detach().copy_(chunks[self._rank].detach())
        return self._work()

    def reduce_scatter_single(self, output, input, opts=None):
        output.detach().view(-1).copy_(input.detach().reshape(self._world_size, -1)[self._rank])
        return self._work()

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        for output, input in zip(outputs, inputs, strict=True):
            output.detach().view(-1).copy_(input.detach().reshape(self._world_size, -1)[self._rank])
        return self._work()

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # ---- all-to-all: what this rank sends to rank j comes back from rank j
    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        output, input = output.detach(), input.detach()
        if list(output_split_sizes or []) == list(input_split_sizes or []):  # even splits, or the same uneven ones
            output.copy_(input.view_as(output))
            return self._work()
        n = self._world_size
        outs = output.split(list(output_split_sizes) or [output.shape[0] // n] * n)
        ins = input.split(list(input_split_sizes) or [input.shape[0] // n] * n)
        for out, sent in zip(outs, ins, strict=True):  # a slot longer than what was sent ends in zeros
            rows = min(out.shape[0], sent.shape[0])
            out[:rows].copy_(sent[:rows])
            out[rows:].zero_()
        return self._work()

    alltoall_base = all_to_all_single

    def alltoall(self, outputs, inputs, opts=None):
        for out, t in zip(outputs, inputs, strict=True):
            out.detach().copy_(t.detach())
        return self._work()


# Out of Dynamo's reach: a collective inside a compiled graph calls back into this Python, and a Dynamo that
# compiles the frame (torch 2.11 does) puts its guards and a graph of its own (which CUDA graph trees skip: it
# mutates its inputs) on every collective's host path, work a real backend's C++ collectives do not have.
for _name, _method in list(vars(LocalCopyGroup).items()):
    if callable(_method) and not _name.startswith("__"):
        setattr(LocalCopyGroup, _name, torch.compiler.disable(_method))
del _name, _method


def _create_local_copy_group(store, rank: int, world_size: int, timeout) -> LocalCopyGroup:
    return LocalCopyGroup(rank, world_size)


if not hasattr(dist.Backend, BACKEND.upper()):  # once a process (registering a name twice raises)
    dist.Backend.register_backend(BACKEND, _create_local_copy_group, devices=["cpu", "cuda"])


def init_fake_process_group(world_size: int, rank: int = 0) -> None:
    """Make this process `rank` of `world_size` ranks on LocalCopyGroup (the default process group)."""
    dist.init_process_group(BACKEND, store=dist.HashStore(), rank=rank, world_size=world_size)


def forget_meshes() -> None:
    """Drop DTensor's sharding-propagation caches (Python and C++); call it once a process group is destroyed.
    Their keys compare meshes by shape and names only, so an entry made on the fake group (or any destroyed one)
    would hand a later mesh of the same shape the old one's process groups ("Could not resolve the process group
    registered under the name ..."). torch offers this clearing as a debug helper only (2.13). qwenft's own
    cache of shard offsets (`attention.shard_extent`) goes with them."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    from qwenft.models.qwen3_5.attention import _shard_extent

    _clear_sharding_prop_cache()
    _shard_extent.cache_clear()


@contextmanager
def fake_process_group(world_size: int, rank: int = 0):
    """init_fake_process_group for the block; after it the group is destroyed and its meshes forgotten, so the
    process may join another group (real or fake) afterwards."""
    init_fake_process_group(world_size, rank)
    try:
        yield
    finally:
        dist.destroy_process_group()
        forget_meshes()
