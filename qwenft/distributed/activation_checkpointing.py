"""Activation checkpointing of the decoder layers (`model.activation_checkpointing`), one mode for the model:

- false: autograd keeps every activation of every layer.
- true: every layer keeps only its input; the whole layer re-runs in the backward.
- linear_attention / full_attention: only layers of that `layer_type` (GatedDeltaNet, gated attention) are
  checkpointed like `true`; the others keep everything.
- selective: every layer is checkpointed keeping the outputs of its matmuls and attention kernels
  (`save_matmuls`) but the last matmul's (down_proj: only the residual add follows it, and the recompute
  stops before it); the cheap ops between them (norms, activations, gates, rotary, the GDN convs and delta
  rule) re-run in the backward, which so runs no matmul of the forward again.

Each layer's own forward is wrapped in place (no wrapper module), so parameter names, and with them
checkpoint and HF keys, stay unchanged.
"""

import functools
import importlib
from collections import deque

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only
from torch.utils.checkpoint import checkpoint

MODES = ("false", "true", "linear_attention", "full_attention", "selective")
_MATMULS = frozenset((torch.ops.aten.mm.default, torch.ops.aten.addmm.default))


@functools.cache
def _saved_ops() -> frozenset:
    """The ops whose outputs `selective` keeps. Linear layers reach the dispatcher as mm (addmm with a bias);
    attention as SDPA's fused kernels, or torch's varlen flash attention, a custom op that the dispatch mode sees
    whole (model.kernels.attention=flash_varlen). bmm is left out: only the GDN torch reference uses it, on
    chunk-sized tensors. fla's delta rule is Triton kernels inside autograd Functions, invisible to the dispatch
    mode: it re-runs in the backward, as with `true`."""
    aten = torch.ops.aten
    names = ("mm", "addmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_flash_attention_forward", "_efficient_attention_forward")
    ops = {getattr(aten, n) for n in names if hasattr(aten, n)}
    try:
        importlib.import_module("torch.nn.attention.varlen")  # registers torch_attn::_varlen_attn (torch >= 2.10)
        ops.add(torch.ops.torch_attn._varlen_attn)
    except (ImportError, AttributeError):
        pass
    return frozenset(op.default if hasattr(op, "default") else op for op in ops)


class _KeptOutputsMode(TorchDispatchMode):
    """The dispatch modes of one `selective` layer share `kept`: op -> its kept outputs, in call order."""

    def __init__(self, kept: dict):
        super().__init__()
        self.kept = kept

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # model.compile's graphs run whole inside the layer (their matmuls are recomputed)


class _KeepOutputs(_KeptOutputsMode):
    """Forward of a `selective` layer: keeps the outputs of `_saved_ops`, in call order per op.

    At the end of the forward it lets go of the output of the layer's last op if that is a matmul (down_proj):
    only the residual add follows it, which saves nothing for the backward, so the recompute's early stop
    (torch's default) ends before it (`tests/test_activation_checkpointing.py` counts the matmuls). Were it
    reached, the recompute would find nothing kept for it and run it: right either way."""

    def __init__(self, kept: dict):
        super().__init__(kept)
        self.last = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _saved_ops():
            self.kept.setdefault(func, deque()).append(tree_map_only(torch.Tensor, torch.Tensor.detach, out))
            self.last = func
        return out

    def __exit__(self, *exc):
        if self.last in _MATMULS:
            self.kept[self.last].pop()
        return super().__exit__(*exc)


class _ReuseOutputs(_KeptOutputsMode):
    """Recompute of a `selective` layer in the backward: the kept outputs instead of running those ops again.
    They serve one recompute: what it leaves (an early stop) is dropped, so that a second recompute of the
    layer (checkpoint recomputes once per backward graph task) runs its ops instead of taking the wrong ones."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.kept.get(func):
            return self.kept[func].popleft()
        return func(*args, **(kwargs or {}))

    def __exit__(self, *exc):
        self.kept.clear()
        return super().__exit__(*exc)


def save_matmuls():
    """`context_fn` for `checkpoint`: the forward keeps the outputs of `_saved_ops`; the recompute takes them.

    Not torch's `create_selective_checkpoint_contexts`: it replays the recompute op for op against the forward
    (every op, saved or not, by its call index) and fails on what legitimately differs between the two: the
    FSDP hooks of GDN's fp32 decay unit inside each layer run one more profiler op in the recompute (torch 2.13:
    "profiler._record_function_enter_new.default invocation index 3 encountered during backward but not found
    in storage"). Here only the kept ops are matched, by their order; everything else simply runs again.
    """
    kept = {}
    return _KeepOutputs(kept), _ReuseOutputs(kept)


def apply_activation_checkpointing(model: nn.Module, mode: str = "true") -> int:
    """Checkpoint the decoder layers of `model` (a `Qwen3_5Model` or one pipeline stage of it) as `mode` (one
    of `MODES`) says; returns the number of layers wrapped."""
    if mode not in MODES:
        raise ValueError(f"model.activation_checkpointing={mode!r} is not valid; choose one of {', '.join(MODES)}")
    wrapped = 0
    for layer in model.decoder_layers():
        if mode == "selective":
            layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False, context_fn=save_matmuls)
        elif mode in ("true", layer.layer_type):
            layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)
        else:
            continue
        wrapped += 1
    return wrapped
