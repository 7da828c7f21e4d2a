"""The lm_head, and its cross-entropy computed a chunk of tokens at a time (`model.ce_chunk_tokens`).

    logits = lm_head(hidden)                       # [B, T, V], as nn.Linear
    ce_sum = lm_head(hidden, labels)               # fp32 CE summed over labelled tokens, chunked

The [tokens, vocab] logits never exist whole: the forward keeps only each token's log-sum-exp, and the
backward recomputes one chunk's logits at a time to form its gradient. For Qwen3.5's 248,320-token vocabulary
and 4096 tokens, unchunked fp32 logits are 3.8 GiB (and as much again for the log-softmax and for the
gradient); a chunk of 1024 tokens holds 0.95 GiB. The price is one more [chunk, hidden] x [hidden, vocab]
matmul per chunk in the backward (docs/performance.md, "Memory options").
"""

import torch
import torch.nn.functional as F
from torch import nn

from qwenft.constants import IGNORE_INDEX



class LMHead(nn.Linear):
    """Hidden states -> vocabulary logits; given labels, the CE sum instead (`ce_chunk_tokens` tokens at a time,
    0 = from the whole logits). `ce_kernel="fused"`: `fused_linear_ce_sum`, chunked the same way.

    The CE runs in this module's forward so that whatever FSDP unit holds the head (the root, or its own
    `fully_shard`) has all-gathered the weight: outside a forward, FSDP2 leaves `weight` a sharded DTensor.
    """

    def __init__(self, hidden_size: int, vocab_size: int, ce_chunk_tokens: int = 0, ce_kernel: str = "torch"):
        super().__init__(hidden_size, vocab_size, bias=False)
        if ce_kernel not in ("torch", "fused"):
            raise ValueError(f"model.kernels.ce={ce_kernel!r} is not valid here; choose torch or fused")
        self.ce_chunk_tokens = ce_chunk_tokens
        self.ce_kernel = ce_kernel

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if labels is None:
            return super().forward(hidden)
        if self.ce_kernel == "fused":
            return fused_linear_ce_sum(hidden.flatten(0, -2), self.weight, labels.flatten(), self.ce_chunk_tokens)
        if self.ce_chunk_tokens == 0:
            return F.cross_entropy(super().forward(hidden).flatten(0, -2).float(), labels.flatten(),
                                   ignore_index=IGNORE_INDEX, reduction="sum")
        return chunked_linear_ce_sum(hidden.flatten(0, -2), self.weight, labels.flatten(), self.ce_chunk_tokens)


def chunked_linear_ce_sum(hidden_nh: torch.Tensor, weight_vh: torch.Tensor, labels_n: torch.Tensor,
                          chunk_tokens: int) -> torch.Tensor:
    """Sum over tokens with a label of CE(hidden @ weight.T, label), in fp32; same value and gradients as
    `F.cross_entropy((hidden @ weight.T).float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")`.

    `weight_vh` must be a plain tensor holding the whole vocabulary (inside an FSDP unit's forward, the
    all-gathered parameter); a vocab-sharded DTensor (tensor parallelism with vocab_parallel) is refused.
    """
    from torch.distributed.tensor import DTensor

    if isinstance(weight_vh, DTensor):
        raise ValueError("model.ce_chunk_tokens needs the whole lm_head on each rank, but it is a DTensor "
                         f"{weight_vh.placements} (mesh.vocab_parallel=true with mesh.tp > 1); set "
                         "mesh.vocab_parallel=false or model.ce_chunk_tokens=0")
    if chunk_tokens < 1:
        raise ValueError(f"model.ce_chunk_tokens={chunk_tokens} must be >= 1 here (0 = unchunked, handled by the caller)")
    return _ChunkedLinearCE.apply(hidden_nh, weight_vh, labels_n, chunk_tokens)


def _chunk_logits(h_ch: torch.Tensor, weight_vh: torch.Tensor) -> torch.Tensor:
    # in the compute dtype, like nn.Linear, then fp32 like qwenft.models.loss.token_ce_sum
    return (h_ch @ weight_vh.t()).float()


class _ChunkedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_nh, weight_vh, labels_n, chunk_tokens: int):
        n = hidden_nh.shape[0]
        valid_n = labels_n != IGNORE_INDEX
        target_n = labels_n.clamp(min=0)  # any index for ignored tokens; masked out below
        lse_n = torch.empty(n, device=hidden_nh.device, dtype=torch.float32)
        loss = torch.zeros((), device=hidden_nh.device, dtype=torch.float32)
        for s in range(0, n, chunk_tokens):
            e = min(s + chunk_tokens, n)
            logits_cv = _chunk_logits(hidden_nh[s:e], weight_vh)
            target_c = logits_cv.gather(1, target_n[s:e, None])[:, 0]
            max_c = logits_cv.amax(dim=-1)
            # log-sum-exp in place: one fp32 [chunk, vocab] buffer, where torch.logsumexp would take a second
            lse_n[s:e] = logits_cv.sub_(max_c[:, None]).exp_().sum(dim=-1).log_().add_(max_c)
            loss += ((lse_n[s:e] - target_c) * valid_n[s:e]).sum()
        ctx.save_for_backward(hidden_nh, weight_vh, target_n, valid_n, lse_n)
        ctx.chunk_tokens = chunk_tokens
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        hidden_nh, weight_vh, target_n, valid_n, lse_n = ctx.saved_tensors
        n, chunk = hidden_nh.shape[0], ctx.chunk_tokens
        grad_hidden = hidden_nh.new_empty(hidden_nh.shape) if ctx.needs_input_grad[0] else None
        # accumulated in the weight's dtype: one rounding per chunk (addmm accumulates each product in fp32)
        grad_weight = torch.zeros_like(weight_vh) if ctx.needs_input_grad[1] else None
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            # d ce / d logits = softmax - one_hot(label), on tokens with a label
            grad_cv = _chunk_logits(hidden_nh[s:e], weight_vh)
            grad_cv.sub_(lse_n[s:e, None]).exp_()
            grad_cv.scatter_add_(1, target_n[s:e, None], -torch.ones_like(lse_n[s:e, None]))
            grad_cv.mul_((valid_n[s:e] * grad_loss)[:, None])
            grad_cv = grad_cv.to(hidden_nh.dtype)
            if grad_hidden is not None:
                torch.mm(grad_cv, weight_vh, out=grad_hidden[s:e])
            if grad_weight is not None:
                grad_weight.addmm_(grad_cv.t(), hidden_nh[s:e])
        return grad_hidden, grad_weight, None, None


def _ce_grad_torch_(logits_nv: torch.Tensor, labels_n: torch.Tensor) -> torch.Tensor:
    """`ce_kernel.ce_grad_` in torch ops (CPU, or CUDA without Triton): per-token CE, logits -> gradient."""
    x = logits_nv.to(torch.promote_types(logits_nv.dtype, torch.float32))
    lse_n = torch.logsumexp(x, dim=-1)
    valid_n = labels_n != IGNORE_INDEX
    target_n = labels_n.clamp(min=0)[:, None]
    loss_n = (lse_n - x.gather(1, target_n)[:, 0]) * valid_n
    grad = (x - lse_n[:, None]).exp_()
    grad.scatter_add_(1, target_n, -torch.ones_like(lse_n[:, None]))
    logits_nv.copy_(grad.mul_(valid_n[:, None]))
    return loss_n


def _ce_grad_(logits_nv: torch.Tensor, labels_n: torch.Tensor) -> torch.Tensor:
    if logits_nv.is_cuda:
        try:
            from qwenft.models.ce_kernel import ce_grad_
        except ImportError:
            return _ce_grad_torch_(logits_nv, labels_n)
        return ce_grad_(logits_nv, labels_n, IGNORE_INDEX)
    return _ce_grad_torch_(logits_nv, labels_n)


def _scale_(grad: torch.Tensor | None, grad_loss: torch.Tensor) -> torch.Tensor | None:
    """grad *= grad_loss, the product formed in fp32 and rounded once, as the unfused head's backward does."""
    if grad is None:
        return None
    if grad.dtype in (torch.float32, torch.float64):
        return grad.mul_(grad_loss)
    if grad.is_cuda:
        try:
            from qwenft.models.ce_kernel import scale_
        except ImportError:
            pass
        else:
            return scale_(grad, grad_loss)
    for part in grad.view(-1).split(1 << 24):  # bounded fp32 temporaries
        part.copy_(part.float() * grad_loss.float())
    return grad


def fused_linear_ce_sum(hidden_nh: torch.Tensor, weight_vh: torch.Tensor, labels_n: torch.Tensor,
                        chunk_tokens: int = 0) -> torch.Tensor:
    """Sum over labelled tokens of CE(hidden @ weight.T, label), with the gradients formed in the forward.

    The CE is linear in its output, so its gradients are known as soon as the logits are: each chunk of
    `chunk_tokens` tokens (0 = all) gets its logits in the compute dtype, the CE and d CE / d logits in place of
    them (one kernel on CUDA), then d hidden and d weight by two matmuls; the backward only scales them by the
    incoming gradient. No fp32 logits, log-softmax or fp32 logits gradient ever exist, and nothing of the
    logits outlives its chunk. The head's matmuls are the three of nn.Linear + CE, in the same dtype.
    """
    from torch.distributed.tensor import DTensor

    if isinstance(weight_vh, DTensor):
        raise ValueError("the fused linear cross-entropy (model.kernels.ce=fused) needs the whole lm_head on each "
                         f"rank, but it is a DTensor {weight_vh.placements} (mesh.vocab_parallel=true with "
                         "mesh.tp > 1); set mesh.vocab_parallel=false or model.kernels.ce=torch")
    chunk = chunk_tokens or hidden_nh.shape[0]
    if torch.is_grad_enabled() and (hidden_nh.requires_grad or weight_vh.requires_grad):
        return _FusedLinearCE.apply(hidden_nh, weight_vh, labels_n, chunk)
    loss = torch.zeros((), device=hidden_nh.device, dtype=torch.float32)
    for s in range(0, hidden_nh.shape[0], chunk):
        loss += _ce_grad_(hidden_nh[s:s + chunk] @ weight_vh.t(), labels_n[s:s + chunk]).sum()
    return loss


class _FusedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_nh, weight_vh, labels_n, chunk: int):
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.empty_like(hidden_nh) if want_hidden else None
        grad_weight = None
        loss = torch.zeros((), device=hidden_nh.device, dtype=torch.float32)
        for s in range(0, hidden_nh.shape[0], chunk):
            h_ch = hidden_nh[s:s + chunk]
            logits_cv = h_ch @ weight_vh.t()
            loss += _ce_grad_(logits_cv, labels_n[s:s + chunk]).sum()  # logits_cv now holds d ce / d logits
            if want_hidden:
                torch.mm(logits_cv, weight_vh, out=grad_hidden[s:s + chunk])
            if want_weight:
                # accumulated in the weight's dtype: one rounding per chunk (addmm sums each product in fp32)
                if grad_weight is None:
                    grad_weight = logits_cv.t() @ h_ch
                else:
                    grad_weight.addmm_(logits_cv.t(), h_ch)
        ctx.save_for_backward(grad_hidden, grad_weight)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        return _scale_(grad_hidden, grad_loss), _scale_(grad_weight, grad_loss), None, None
