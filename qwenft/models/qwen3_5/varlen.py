"""What every layer needs to know about a packed batch's documents, computed once per batch.

Each GDN layer calls fla's conv and chunk kernels with the batch's `cu_seqlens`; fla derives chunk indices
from it and, without a CPU copy, reads it back from the GPU (a host sync per kernel call, several per layer,
forward and backward). fla caches those derivations by tensor identity, so all layers must also pass the
very same int64 tensor. `varlen_info` hands every layer one shared `Varlen` per `cu_seqlens` tensor: one
device->host copy per batch instead of one per kernel call, and none for a batch whose offsets were put on the
device by `to_device`, which keeps the host copy they came from (a device->host copy waits for every kernel
queued before it, so the host could not run ahead of the GPU from one microbatch into the next).
"""

from collections import deque
from dataclasses import dataclass

import torch

_RECENT: deque = deque(maxlen=8)  # (cu_seqlens, Varlen): a few batches are in flight under pipelining


@dataclass
class Varlen:
    cu_seqlens: torch.Tensor  # int64, on the batch's device
    cu_seqlens_cpu: torch.Tensor  # int64 copy on the CPU
    max_len: int  # longest document


def _remember(cu_seqlens: torch.Tensor, cpu: torch.Tensor) -> Varlen:
    info = Varlen(cu_seqlens.to(torch.long), cpu, int((cpu[1:] - cpu[:-1]).max()))
    _RECENT.append((cu_seqlens, info))
    return info


def to_device(cu_seqlens: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The host offsets `cu_seqlens` on `device`, copied without waiting for the GPU, and known to
    `varlen_info` (which then needs no copy back)."""
    on_device = copy_to_device(cu_seqlens, device)
    _remember(on_device, cu_seqlens.to("cpu", torch.long))
    return on_device


def copy_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`; to a GPU through pinned memory, asynchronously: a copy from pageable memory
    makes the host wait for the GPU."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@torch.compiler.disable  # an identity cache and a host copy: never traced into a graph (model.compile)
def varlen_info(cu_seqlens: torch.Tensor) -> Varlen:
    for key, info in _RECENT:
        if key is cu_seqlens:
            return info
    return _remember(cu_seqlens, cu_seqlens.to("cpu", torch.long))
