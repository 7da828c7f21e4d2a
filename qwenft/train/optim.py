"""AdamW and the warmup + decay learning-rate schedule."""

import math

import torch


def build_optimizer(params, lr: float, weight_decay: float, betas, eps: float, fused: str) -> torch.optim.AdamW:
    params = [p for p in params if p.requires_grad]
    on_cuda = any(p.device.type == "cuda" for p in params)
    use_fused = on_cuda if fused == "auto" else fused == "true"
    if use_fused and not on_cuda:
        raise ValueError("optim.fused=true needs CUDA parameters; use optim.fused=auto or false on CPU")
    return torch.optim.AdamW(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                             fused=use_fused or None, foreach=None if use_fused else True)


def lr_factor(step: int, warmup_steps: int, total_steps: int, decay: str, min_lr_ratio: float) -> float:
    """Multiplier of the base lr for optimizer step `step` (0-based): linear warmup, then decay."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay == "constant" or total_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps - 1))  # last step: min lr
    if decay == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


def build_scheduler(optimizer, warmup_steps: int, total_steps: int, decay: str, min_lr_ratio: float):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, warmup_steps, total_steps, decay, min_lr_ratio))
