"""One process playing one rank of a larger world on torch's fake process group.

Collectives on the "fake" backend return at once and leave their outputs as their inputs (an all-gather
repeats the local shard), so every kernel runs at a rank's real sizes with no other process: `qwenft plan`
builds each rank's share this way, scripts/bench.py --fake-world times a tensor parallel rank without its
communication, and tests/gpu runs the multi-rank code paths on one GPU. The numbers such a run trains are
meaningless; only shapes, memory and time are the real rank's.
"""

from contextlib import contextmanager

import torch.distributed as dist


def init_fake_process_group(world_size: int, rank: int = 0) -> None:
    """Make this process `rank` of `world_size` ranks on the fake backend (the default process group)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


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
