"""Per-stage parallelization in its fixed order: (TP) -> activation checkpointing -> FSDP2."""

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each decoder layer in the backward instead of keeping its activations.

    The layer's own forward is wrapped in place (no wrapper module), so parameter names, and with them
    checkpoint and HF keys, stay unchanged.
    """
    for layer in model.layers.values():
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)
