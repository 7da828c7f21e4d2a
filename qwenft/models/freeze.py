"""Training switches for the VLM's parts: freezing (`model.freeze_vision`, `model.freeze_language`) and
activation checkpointing of the vision tower (`model.vision_activation_checkpointing`).

Call on each (pipeline-stage) module after building and before parallelizing / making the optimizer:

    freeze(model, vision=cfg.model.freeze_vision, language=cfg.model.freeze_language)
    if cfg.model.vision_activation_checkpointing:
        checkpoint_vision(model)
    params = [p for p in model.parameters() if p.requires_grad]   # frozen ones need no optimizer state

Frozen parameters get `requires_grad=False`, so autograd computes no gradient for them (`.grad` stays
None) and AdamW leaves them untouched — weight decay included, since it skips parameters without grads.
"""

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint

VISION_PROJECTOR = "merger"  # the vision tower's patch merger: projects vision features to the text width


def freeze(model: nn.Module, vision: bool = False, language: bool = False,
           projector: bool | None = None) -> dict[str, int]:
    """Set `requires_grad=False` on the parts asked for; returns {part: parameter count frozen}.

    vision: the vision tower (`visual.*`) except its merger; projector: `visual.merger.*` (None = follow
    `vision`, i.e. freezing the tower freezes the merger too); language: everything else (embeddings,
    decoder layers, final norm, lm_head). A module without a tower (a later pipeline stage, a text model)
    just has nothing to freeze for `vision`. Never unfreezes: parts not asked for are left as they are.
    """
    projector = vision if projector is None else projector
    frozen = {"vision": 0, "projector": 0, "language": 0}
    for name, p in model.named_parameters():
        if name.startswith("visual."):
            part = "projector" if name.startswith(f"visual.{VISION_PROJECTOR}.") else "vision"
        else:
            part = "language"
        if {"vision": vision, "projector": projector, "language": language}[part]:
            p.requires_grad_(False)
            frozen[part] += p.numel()
    return frozen


def checkpoint_vision(model: nn.Module) -> int:
    """Recompute each vision block's activations in the backward instead of storing them; returns the number
    of blocks wrapped. Like the decoder's activation checkpointing, it wraps `forward` in place, so
    parameter names (and with them checkpoints and HF keys) do not change. A frozen tower needs no
    checkpointing: without parameters that need grads, autograd stores nothing for it anyway."""
    visual = getattr(model, "visual", None)
    if visual is None:
        return 0
    for block in visual.blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return len(visual.blocks)
