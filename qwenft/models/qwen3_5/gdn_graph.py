"""GatedDeltaNet's kernels (qwenft's causal conv, fla's chunked delta rule) replayed as CUDA graphs, under
`model.cuda_graphs=true` with `mesh.tp > 1` (`parallelize`): a layer's conv and delta rule become one graph
launch forward and one backward, instead of some twenty Triton launches each, every one through fla's Python
wrappers and autotuner. That host work sets the pace of a tensor-parallel shard's small kernels; a whole layer's
kernels keep the GPU busy anyway, and there the layouts' pad blocks, the input copies and each graph's own
buffers (inputs, outputs, saved activations, per layer and layout) would cost more than they save.

fla sizes its grids from the batch's document layout, which changes from batch to batch, and a graph needs
fixed shapes: the graphs run on the batch's `FixedLayout` (varlen.py), the stream with pad documents after
it, whose shapes are the same for every batch laid out in one document bucket (1, 2, 4, ... 64, then multiples
of 64) and block count (fla's 64-token chunks, one to 64 more than the batch's own). A batch takes the layout
already in use with the fewest blocks that holds it, or a new one of its own, and a layer keeps a pair of graphs
per layout: each pair's buffers (inputs, output, saved activations, gradients) stay allocated, about 1.5 GiB
per layout at tp4 on the 27B shape's six GatedDeltaNet layers of 4096 tokens. The layout's offsets
and chunk indices are copied once per batch into buffers that every layer's graphs read, and each call copies
its inputs into the graphs' own buffers (the pad rows stay zero).

What the graphs write is overwritten by the layer's next replay: the forward's output and saved activations by
the next microbatch's forward, the input gradients by its backward. That is safe where each microbatch's
backward runs before the next one's forward: no pipeline schedule, no activation checkpointing (both refused
with CUDA graphs, `spec.check_cuda_graphs`). The input gradients feed the compiled graphs' backward, which
copies them; the conv weight's is handed out as a copy, so no `.grad` keeps a graph's buffer. All layers'
graphs share one memory pool: the buffers of every captured pair stay referenced, so a later capture only
reuses another's scratch, and graphs run one at a time. Under `torch.no_grad` (validation) the kernels run
eagerly.
"""

import contextlib
import dataclasses
import logging
import os
from typing import Callable

import torch

from .varlen import fixed_layout, layout_holds, varlen_info

log = logging.getLogger("qwenft")
_POOL = []  # one memory pool for every layer's graphs: they run one at a time, on one stream


@dataclasses.dataclass
class _Slot:
    """One layout's buffers, which every layer's graphs of that layout read."""
    offsets: torch.Tensor
    chunk_indices: torch.Tensor
    pad: int  # pad tokens after the stream
    loaded: object  # the batch's Varlen whose layout the buffers hold


_LAYOUTS: dict[tuple, _Slot] = {}  # (device, stream length, document bucket, blocks) -> its buffers


class GraphedMix:
    """One GatedDeltaNet layer's `fla_kernels`, captured per input shape and layout on first use."""

    def __init__(self, kernels: Callable):
        self.kernels = kernels  # kernels(qkv, beta, g, weight, sizes, cu_seqlens=, chunk_indices=) -> out
        self.graphs: dict = {}

    def __call__(self, qkv, beta, g, weight, sizes: tuple[int, ...], cu_seqlens: torch.Tensor | None):
        """Like `kernels(qkv, beta, g, weight, sizes, ...)` on the batch's documents `cu_seqlens` (None: one
        document per row)."""
        pad, varlen = 0, {"cu_seqlens": None}
        if cu_seqlens is not None:
            offsets, indices, pad = _load_layout(varlen_info(cu_seqlens), qkv.device)
            varlen = {"cu_seqlens": offsets, "chunk_indices": indices}
        key = (tuple(qkv.shape), tuple(weight.shape), qkv.dtype, g.dtype, sizes, pad,
               None if cu_seqlens is None else (len(varlen["cu_seqlens"]), len(varlen["chunk_indices"])))
        graphs = self.graphs.get(key)
        if graphs is None:
            graphs = self.graphs[key] = _Graphs(lambda *a: self.kernels(*a, sizes, **varlen), (qkv, beta, g, weight),
                                                pad)
        return _Replay.apply(graphs, qkv, beta, g, weight)


def _load_layout(info, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(offsets, chunk indices, pad tokens) of the batch `info` in the device buffers of its layout: the one in
    use for its stream length with the fewest blocks (then documents) that holds it, else a new one of its own.
    Copied in once per batch (by the first layer to see it), from pinned memory without waiting for the GPU."""
    for (d, *_), slot in _LAYOUTS.items():  # the batch's later layers: its layout is loaded
        if d == device and slot.loaded is info:
            return slot.offsets, slot.chunk_indices, slot.pad
    total, docs = int(info.cu_seqlens_cpu[-1]), len(info.cu_seqlens_cpu) - 1
    fits = [(k, b) for d, t, b, k in _LAYOUTS if d == device and t == total and layout_holds(b, k, docs, info.blocks)]
    blocks, bucket = min(fits) if fits else (None, None)
    layout = fixed_layout(info.cu_seqlens_cpu, bucket, blocks)
    slot = _LAYOUTS.get((device, total, bucket, blocks))
    if slot is None:
        slot = _LAYOUTS[(device, total, layout.bucket, layout.blocks)] = _Slot(
            layout.cu_seqlens.to(device), layout.chunk_indices.to(device), layout.pad, info)
        log.info("GatedDeltaNet CUDA graphs: a new layout of %d documents and %d blocks for %d-token rows (%d in "
                 "use; each layer records a graph pair per layout)", layout.bucket, layout.blocks, total,
                 len(_LAYOUTS))
    else:
        for buffer, host in ((slot.offsets, layout.cu_seqlens), (slot.chunk_indices, layout.chunk_indices)):
            buffer.copy_(host.pin_memory() if buffer.is_cuda else host, non_blocking=buffer.is_cuda)
        slot.loaded = info
    return slot.offsets, slot.chunk_indices, slot.pad


def _pool():
    if not _POOL:
        _POOL.append(torch.cuda.graph_pool_handle())
    return _POOL[0]


@contextlib.contextmanager
def _capturable_fla():
    """fla as a capture needs it. Its tensor cache memoises what it derives from `cu_seqlens` (the chunk offsets)
    by tensor identity: a hit would bake in a tensor that no replay recomputes, so every derived tensor is computed
    inside the graph. Its FlashQLA backend for the delta rule, where installed, takes no chunk indices: the
    Triton and TileLang kernels, whose grids the fixed layout fixes, run instead."""
    import fla.utils

    before = fla.utils.FLA_DISABLE_TENSOR_CACHE, os.environ.get("FLA_FLASH_QLA")
    fla.utils.FLA_DISABLE_TENSOR_CACHE = True
    os.environ["FLA_FLASH_QLA"] = "0"
    try:
        yield
    finally:
        fla.utils.FLA_DISABLE_TENSOR_CACHE = before[0]
        if before[1] is None:
            del os.environ["FLA_FLASH_QLA"]
        else:
            os.environ["FLA_FLASH_QLA"] = before[1]


class _Graphs:
    """The forward and backward graphs of `run` on inputs shaped like `inputs` with `pad` zero rows appended to
    all but the last (the conv weight), and the buffers they read and write."""

    def __init__(self, run: Callable, inputs: tuple[torch.Tensor, ...], pad: int):
        self.rows = inputs[0].shape[1]
        self.inputs = [torch.zeros(t.shape[0], t.shape[1] + pad, *t.shape[2:], dtype=t.dtype, device=t.device)
                       for t in inputs[:-1]] + [torch.zeros_like(inputs[-1])]
        self.load(*inputs)
        for t in self.inputs:
            t.requires_grad_(True)
        with _capturable_fla():
            # a warm-up outside any graph first: fla's autotuning and TileLang's compilation cannot be captured
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                out = run(*self.inputs)
                torch.autograd.grad(out, self.inputs, torch.zeros_like(out))
            torch.cuda.current_stream().wait_stream(side)
            del out
            self.forward = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.forward, pool=_pool(), capture_error_mode="thread_local"):
                self.out = run(*self.inputs)
            self.grad_out = torch.zeros_like(self.out)
            self.backward = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.backward, pool=_pool(), capture_error_mode="thread_local"):
                # retain_graph: the saved activations stay allocated, so no later capture in the shared pool
                # reuses memory this pair's backward reads after its forward wrote it
                self.grads = torch.autograd.grad(self.out, self.inputs, self.grad_out, retain_graph=True)
        self.out_rows = self.out.detach()[:, : self.rows]

    def load(self, *inputs: torch.Tensor) -> None:
        with torch.no_grad():
            for buffer, t in zip(self.inputs, inputs):
                (buffer if buffer.shape == t.shape else buffer[:, : self.rows]).copy_(t)


class _Replay(torch.autograd.Function):
    """`_Graphs`' forward replay, and its backward replay in the backward."""

    @staticmethod
    def forward(ctx, graphs: _Graphs, *inputs: torch.Tensor) -> torch.Tensor:
        graphs.load(*inputs)
        graphs.forward.replay()
        ctx.graphs = graphs
        return graphs.out_rows.view_as(graphs.out_rows)  # a tensor of its own for autograd to mark

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        graphs = ctx.graphs
        graphs.grad_out[:, : graphs.rows].copy_(grad)
        graphs.backward.replay()
        # the conv weight's gradient may become a parameter's `.grad` (autograd keeps an incoming gradient it
        # alone holds): a copy of its few values, not the buffer the next replay overwrites
        grads = [g[:, : graphs.rows] for g in graphs.grads[:-1]] + [graphs.grads[-1].clone()]
        return None, *grads
