"""Token cross-entropy summed over label tokens (the training loop divides by the global batch's label count),
with a vocab-parallel path for logits sharded by tensor parallelism."""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from qwenft.constants import IGNORE_INDEX
from qwenft.models.qwen3_5.attention import shard_extent


def token_ce_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of cross-entropy over tokens whose label is not IGNORE_INDEX, in fp32.

    Labels are already shifted by the data pipeline: labels[:, t] is the token that follows input t.
    `logits` may be a DTensor sharded on the vocab dimension (tensor parallelism with vocab_parallel): the
    loss is then computed without gathering the logits, and is the same plain tensor on every tp rank.
    """
    from torch.distributed.tensor import DTensor, Shard

    if isinstance(logits, DTensor):
        (placement,) = logits.placements  # the 1-D tp mesh
        if isinstance(placement, Shard) and placement.dim % logits.ndim == logits.ndim - 1:
            return _vocab_parallel_ce_sum(logits, labels)
        logits = logits.full_tensor()
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def _vocab_parallel_ce_sum(logits, labels: torch.Tensor) -> torch.Tensor:
    _, offset = shard_extent(logits)
    local = logits.to_local()
    return _VocabParallelCE.apply(local.flatten(0, -2), labels.flatten(), offset[-1],
                                  logits.device_mesh.get_group())


class _VocabParallelCE(torch.autograd.Function):
    """Cross-entropy summed over tokens, each rank holding a contiguous slice of the vocab (Megatron's
    scheme): all-reduce the max, the sum of exponentials and the target logit, never the logits. The
    backward is local: d loss / d logit = softmax - one_hot, restricted to this rank's slice."""

    @staticmethod
    def forward(ctx, logits_nv, labels_n, vocab_start: int, group):
        x = logits_nv.float()
        v_local = x.shape[-1]
        row_max = x.max(-1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        x = x - row_max[:, None]
        exp = x.exp()
        sum_exp = exp.sum(-1)
        dist.all_reduce(sum_exp, group=group)
        valid = labels_n != IGNORE_INDEX
        idx = labels_n - vocab_start
        owned = valid & (idx >= 0) & (idx < v_local)
        idx = idx.clamp(0, v_local - 1)
        target = x.gather(1, idx[:, None])[:, 0] * owned
        dist.all_reduce(target, group=group)
        loss = ((sum_exp.log() - target) * valid).sum()
        exp /= sum_exp[:, None]  # softmax, kept for the backward
        ctx.save_for_backward(exp, idx, owned, valid)
        ctx.dtype = logits_nv.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, idx, owned, valid = ctx.saved_tensors
        grad = softmax  # in place: the graph is not kept for a second backward
        grad.scatter_add_(1, idx[:, None], -owned[:, None].to(grad.dtype))
        grad *= valid[:, None] * grad_loss
        return grad.to(ctx.dtype), None, None, None


def count_label_tokens(labels: torch.Tensor) -> torch.Tensor:
    return (labels != IGNORE_INDEX).sum()
