"""What every layer needs to know about a packed batch's documents, computed once per batch.

Each GDN layer calls fla's conv and chunk kernels with the batch's `cu_seqlens`; fla derives chunk indices
from it and, without a CPU copy, reads it back from the GPU (a host sync per kernel call, several per layer,
forward and backward). fla caches those derivations by tensor identity, so all layers must also pass the
very same int64 tensor. `varlen_info` hands every layer one shared `Varlen` per `cu_seqlens` tensor: one
device->host copy per batch instead of one per kernel call.
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


@torch.compiler.disable  # an identity cache and a host copy: never traced into a graph (model.compile)
def varlen_info(cu_seqlens: torch.Tensor) -> Varlen:
    for key, info in _RECENT:
        if key is cu_seqlens:
            return info
    cpu = cu_seqlens.to("cpu", torch.long)
    info = Varlen(cu_seqlens.to(torch.long), cpu, int((cpu[1:] - cpu[:-1]).max()))
    _RECENT.append((cu_seqlens, info))
    return info
