"""The lm_head, and its cross-entropy computed a chunk of tokens at a time (`model.ce_chunk_tokens`).

    logits = lm_head(hidden)                       # [B, T, V], as nn.Linear
    ce_sum = lm_head(hidden, labels)               # fp32 CE summed over labelled tokens, chunked

The [tokens, vocab] logits never exist whole: the forward keeps only each token's log-sum-exp, and the
backward recomputes one chunk's logits at a time to form its gradient. For Qwen3.5's 248,320-token vocabulary
and 4096 tokens, unchunked fp32 logits are 3.8 GiB (and as much again for the log-softmax and for the
gradient); a chunk of 1024 tokens holds 0.95 GiB. The price is one more [chunk, hidden] x [hidden, vocab]
matmul per chunk in the backward (docs/performance.md, "Memory options").

`model.kernels.ce=fused` (`fused_linear_ce_sum`) forms the gradients in the forward instead, and also runs on
a head sharded over the vocabulary by tensor parallelism (`mesh.vocab_parallel`): each rank multiplies its
own rows of the weight, and only three fp32 numbers per token (row max, sum of exponentials, label logit)
cross the tp ranks, never logits.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from qwenft.constants import IGNORE_INDEX
from qwenft.models.qwen3_5.attention import local, shard_extent



class LMHead(nn.Linear):
    """Hidden states -> vocabulary logits; given labels, the CE sum instead (`ce_chunk_tokens` tokens at a time,
    0 = from the whole logits). `ce_kernel="fused"`: `fused_linear_ce_sum`, chunked the same way.

    The CE runs in this module's forward so that whatever FSDP unit holds the head (the root, or its own
    `fully_shard`) has all-gathered the weight: outside a forward, FSDP2 leaves `weight` a sharded DTensor.

    Vocab-parallel with `ce_kernel="fused"` (`tensor_parallel.apply_tp`): `weight` is a Shard(0) DTensor over the
    tp mesh and the hidden states a plain tensor, the same on every tp rank. The logits come back as a DTensor
    sharded on the vocabulary, as torch's ColwiseParallel returns them (the vocab-parallel `loss.token_ce_sum`
    takes them); the CE sum is the same plain tensor on every rank.
    """

    # the fused cross-entropy adds the weight's gradient into the `weight_grad` buffer (qwenft.models.weight_grad);
    # the other paths' autograd adds into it as the weight's `.grad`
    takes_weight_grad = True

    def __init__(self, hidden_size: int, vocab_size: int, ce_chunk_tokens: int = 0, ce_kernel: str = "torch"):
        super().__init__(hidden_size, vocab_size, bias=False)
        if ce_kernel not in ("torch", "fused"):
            raise ValueError(f"model.kernels.ce={ce_kernel!r} is not valid here; choose torch or fused")
        self.ce_chunk_tokens = ce_chunk_tokens
        self.ce_kernel = ce_kernel
        # (d loss / d CE sum, d loss / d MTP CE sum) of the coming step, as host numbers, where the fused CE adds
        # its weight gradient into the `weight_grad` buffer (`weight_grad.prepare_grads`): it then adds it inside
        # its forward matmuls, already scaled; None = scaled into the buffer in the backward
        self.grad_scales: tuple[float | None, float | None] | None = None

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor | None = None, mtp=None):
        """Logits, or with `labels` the CE sum. `mtp` = (hidden, labels, detach): the multi-token-prediction
        head's states and targets through the same weight in the same call (so an FSDP unit holding the head
        gathers it once), `detach` keeping the head's loss out of the weight's gradient; then the return is
        (logits or CE sum, the MTP CE sum, how many MTP targets are their logits' argmax)."""
        out = self._logits_or_ce(hidden, labels)
        if mtp is None:
            return out
        mtp_hidden, mtp_labels, detach = mtp
        hits = torch.zeros((), dtype=torch.long, device=mtp_hidden.device)
        return out, self.ce_sum(mtp_hidden, mtp_labels, self.weight.detach() if detach else self.weight, hits,
                                trained=not detach, mtp=True), hits

    def _logits_or_ce(self, hidden, labels):
        if labels is None:
            if self.ce_kernel == "fused" and isinstance(self.weight, DTensor):
                return _vocab_parallel_logits(hidden, self.weight)
            return super().forward(hidden)
        if self.ce_kernel != "fused" and self.ce_chunk_tokens == 0:
            return F.cross_entropy(super().forward(hidden).flatten(0, -2).float(), labels.flatten(),
                                   ignore_index=IGNORE_INDEX, reduction="sum")
        return self.ce_sum(hidden, labels, self.weight)

    def ce_sum(self, hidden, labels, weight, hits: torch.Tensor | None = None, trained: bool = True,
               mtp: bool = False) -> torch.Tensor:
        """CE of `hidden @ weight.T` summed over `labels`, by this head's kernel and chunking; `hits` (a 0-d int64
        tensor) += the labelled tokens whose label is the argmax (a tie counts as a hit). `trained`: `weight` is
        this head's own (not detached), whose gradient the fused kernel adds into the `weight_grad` buffer when
        `weight_grad.enable` gave it one; `mtp`: the MTP head's loss (its scale in `grad_scales`)."""
        h_nh, labels_n = hidden.flatten(0, -2), labels.flatten()
        if self.ce_kernel == "fused":
            buffer = getattr(self, "weight_grad", None) if trained and torch.is_grad_enabled() else None
            scale = None if buffer is None or self.grad_scales is None else self.grad_scales[1 if mtp else 0]
            return fused_linear_ce_sum(h_nh, weight, labels_n, self.ce_chunk_tokens, hits, grad_buffer=buffer,
                                       grad_scale=scale)
        if self.ce_chunk_tokens:
            return chunked_linear_ce_sum(h_nh, weight, labels_n, self.ce_chunk_tokens, hits)
        if isinstance(weight, DTensor):
            raise ValueError("the MTP head's loss on a vocab-parallel lm_head needs model.kernels.ce=fused (or "
                             "mesh.vocab_parallel=false)")
        logits_nv = F.linear(h_nh, weight).float()
        if hits is not None:
            hits += _hits(logits_nv.gather(1, labels_n.clamp(min=0)[:, None])[:, 0], logits_nv.amax(-1), labels_n)
        return F.cross_entropy(logits_nv, labels_n, ignore_index=IGNORE_INDEX, reduction="sum")


def _hits(target_n: torch.Tensor, max_n: torch.Tensor, labels_n: torch.Tensor) -> torch.Tensor:
    """How many labelled tokens have their label's logit at the row's max (top-1 correct; a tie counts)."""
    return ((target_n >= max_n) & (labels_n != IGNORE_INDEX)).sum()


def _vocab_parallel_logits(hidden: torch.Tensor, weight: DTensor) -> DTensor:
    """hidden @ weight.T as a DTensor sharded on the vocabulary, what ColwiseParallel(output_layouts=Shard(-1),
    use_local_output=False) gives: the hidden states enter as a replicated DTensor, so the backward sums their
    gradient (a partial sum on each rank, over its vocabulary rows) over the tp ranks. Through DTensor's
    dispatch: this path serves evaluation and inspection, the training step takes the fused CE."""
    return F.linear(DTensor.from_local(hidden, weight.device_mesh, [Replicate()], run_check=False), weight)


def chunked_linear_ce_sum(hidden_nh: torch.Tensor, weight_vh: torch.Tensor, labels_n: torch.Tensor,
                          chunk_tokens: int, hits: torch.Tensor | None = None) -> torch.Tensor:
    """Sum over tokens with a label of CE(hidden @ weight.T, label), in fp32; same value and gradients as
    `F.cross_entropy((hidden @ weight.T).float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")`.

    `weight_vh` must be a plain tensor holding the whole vocabulary (inside an FSDP unit's forward, the
    all-gathered parameter); a vocab-sharded DTensor (tensor parallelism with vocab_parallel) is refused.
    """
    if isinstance(weight_vh, DTensor):
        raise ValueError("model.ce_chunk_tokens with model.kernels.ce=torch needs the whole lm_head on each rank, "
                         f"but it is a DTensor {weight_vh.placements} (mesh.vocab_parallel=true with mesh.tp > 1); "
                         "set model.kernels.ce=fused, mesh.vocab_parallel=false or model.ce_chunk_tokens=0")
    if chunk_tokens < 1:
        raise ValueError(f"model.ce_chunk_tokens={chunk_tokens} must be >= 1 here (0 = unchunked, handled by the caller)")
    return _ChunkedLinearCE.apply(hidden_nh, weight_vh, labels_n, chunk_tokens, hits)


def _chunk_logits(h_ch: torch.Tensor, weight_vh: torch.Tensor) -> torch.Tensor:
    # in the compute dtype, like nn.Linear, then fp32 like qwenft.models.loss.token_ce_sum
    return (h_ch @ weight_vh.t()).float()


class _ChunkedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_nh, weight_vh, labels_n, chunk_tokens: int, hits):
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
            if hits is not None:
                hits += _hits(target_c, max_c, labels_n[s:e])
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
        return grad_hidden, grad_weight, None, None, None


def _ce_grad_torch_(logits_nv: torch.Tensor, labels_n: torch.Tensor, hits: torch.Tensor | None = None) -> torch.Tensor:
    """`ce_kernel.ce_grad_` in torch ops (CPU, or CUDA without Triton): per-token CE, logits -> gradient."""
    x = logits_nv.to(torch.promote_types(logits_nv.dtype, torch.float32))
    lse_n = torch.logsumexp(x, dim=-1)
    valid_n = labels_n != IGNORE_INDEX
    target_n = labels_n.clamp(min=0)[:, None]
    if hits is not None:
        hits += _hits(x.gather(1, target_n)[:, 0], x.amax(dim=-1), labels_n)
    loss_n = (lse_n - x.gather(1, target_n)[:, 0]) * valid_n
    grad = (x - lse_n[:, None]).exp_()
    grad.scatter_add_(1, target_n, -torch.ones_like(lse_n[:, None]))
    logits_nv.copy_(grad.mul_(valid_n[:, None]))
    return loss_n


def _owned_columns(labels_n: torch.Tensor, vocab_start: int, v_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(each label's column in the slice [vocab_start, vocab_start + v_local), clamped into it; whether the slice
    holds the label)."""
    col_n = labels_n - vocab_start
    owned_n = (labels_n != IGNORE_INDEX) & (col_n >= 0) & (col_n < v_local)
    return col_n.clamp(0, v_local - 1), owned_n


def _shard_stats_torch(logits_nv: torch.Tensor, labels_n: torch.Tensor, vocab_start: int) -> torch.Tensor:
    """`ce_kernel.shard_stats` in torch ops: [3, n] of row max, sum of exp(x - max), owned label logit."""
    x = logits_nv.to(torch.promote_types(logits_nv.dtype, torch.float32))
    col_n, owned_n = _owned_columns(labels_n, vocab_start, x.shape[1])
    max_n = x.amax(dim=-1)
    sum_n = (x - max_n[:, None]).exp_().sum(dim=-1)
    return torch.stack([max_n, sum_n, x.gather(1, col_n[:, None])[:, 0].where(owned_n, 0)])


def _shard_ce_grad_torch_(logits_nv: torch.Tensor, labels_n: torch.Tensor, lse_n: torch.Tensor,
                          vocab_start: int) -> torch.Tensor:
    """`ce_kernel.shard_ce_grad_` in torch ops: logits (this rank's columns) -> the CE's gradient there."""
    x = logits_nv.to(torch.promote_types(logits_nv.dtype, torch.float32))
    col_n, owned_n = _owned_columns(labels_n, vocab_start, x.shape[1])
    grad = (x - lse_n[:, None]).exp_()
    grad.scatter_add_(1, col_n[:, None], -owned_n[:, None].to(grad.dtype))
    return logits_nv.copy_(grad.mul_((labels_n != IGNORE_INDEX)[:, None]))


def _triton_kernels(t: torch.Tensor):
    """`qwenft.models.ce_kernel` for a CUDA tensor when Triton imports, else None (the torch ops above)."""
    if not t.is_cuda:
        return None
    try:
        from qwenft.models import ce_kernel
    except ImportError:
        return None
    return ce_kernel


def _ce_grad_(logits_nv: torch.Tensor, labels_n: torch.Tensor, hits: torch.Tensor | None = None) -> torch.Tensor:
    kernels = _triton_kernels(logits_nv)
    if kernels is None:
        return _ce_grad_torch_(logits_nv, labels_n, hits)
    if hits is None:
        return kernels.ce_grad_(logits_nv, labels_n, IGNORE_INDEX)
    loss_n, hit_n = kernels.ce_grad_(logits_nv, labels_n, IGNORE_INDEX, with_hits=True)
    hits += hit_n.sum()
    return loss_n


def _chunk_ce_grad_(logits_nv: torch.Tensor, labels_n: torch.Tensor, vocab_start: int, group,
                    grad: bool = True, hits: torch.Tensor | None = None) -> torch.Tensor:
    """One chunk's per-token CE in fp32, its logits turned into d CE / d logits (with `grad`; a whole-vocabulary
    chunk either way, one kernel doing both). `group` None: the logits cover the whole vocabulary. Else they are
    the columns [vocab_start, vocab_start + V_local) of a vocabulary sharded over `group`, and the CE is the same
    on every rank: two all-reduces of fp32 per-token values (the row max; the rescaled sums of exponentials with
    the label's logit, which one rank holds and the others give as 0), never logits. `hits` += the labelled
    tokens whose label's logit is the row's max."""
    if group is None:
        return _ce_grad_(logits_nv, labels_n, hits)
    kernels = _triton_kernels(logits_nv)
    if kernels is None:
        stats_3n = _shard_stats_torch(logits_nv, labels_n, vocab_start)
    else:
        stats_3n = kernels.shard_stats(logits_nv, labels_n, vocab_start, IGNORE_INDEX)
    max_n = stats_3n[0].clone()
    dist.all_reduce(max_n, op=dist.ReduceOp.MAX, group=group)
    stats_3n[1].mul_((stats_3n[0] - max_n).exp_())
    dist.all_reduce(stats_3n[1:], group=group)  # sum of exp(x - max) over the vocabulary; the label's logit
    lse_n = stats_3n[1].log().add_(max_n)
    if hits is not None:
        hits += _hits(stats_3n[2], max_n, labels_n)
    if grad:
        if kernels is None:
            _shard_ce_grad_torch_(logits_nv, labels_n, lse_n, vocab_start)
        else:
            kernels.shard_ce_grad_(logits_nv, labels_n, lse_n, vocab_start, IGNORE_INDEX)
    return (lse_n - stats_3n[2]) * (labels_n != IGNORE_INDEX)


def _scale_(grad: torch.Tensor | None, grad_loss: torch.Tensor) -> torch.Tensor | None:
    """grad *= grad_loss, the product formed in fp32 and rounded once, as the unfused head's backward does."""
    if grad is None:
        return None
    if grad.dtype in (torch.float32, torch.float64):
        return grad.mul_(grad_loss)
    kernels = _triton_kernels(grad)
    if kernels is not None:
        return kernels.scale_(grad, grad_loss)
    for part in grad.view(-1).split(1 << 24):  # bounded fp32 temporaries
        part.copy_(part.float() * grad_loss.float())
    return grad


def _scale_add_(acc: torch.Tensor, grad: torch.Tensor, grad_loss: torch.Tensor) -> None:
    """acc += grad * grad_loss, the product and sum formed in fp32 and rounded once."""
    if acc.dtype in (torch.float32, torch.float64):
        acc.addcmul_(grad, grad_loss)
        return
    kernels = _triton_kernels(acc)
    if kernels is not None:
        kernels.scale_add_(acc, grad, grad_loss)
        return
    for a, g in zip(acc.view(-1).split(1 << 24), grad.view(-1).split(1 << 24)):  # bounded fp32 temporaries
        a.copy_(a.float() + g.float() * grad_loss.float())


def fused_linear_ce_sum(hidden_nh: torch.Tensor, weight_vh: torch.Tensor, labels_n: torch.Tensor,
                        chunk_tokens: int = 0, hits: torch.Tensor | None = None,
                        grad_buffer: torch.Tensor | None = None, grad_scale: float | None = None) -> torch.Tensor:
    """Sum over labelled tokens of CE(hidden @ weight.T, label), with the gradients formed in the forward.

    The CE is linear in its output, so its gradients are known as soon as the logits are: each chunk of
    `chunk_tokens` tokens (0 = all) gets its logits in the compute dtype, the CE and d CE / d logits in place of
    them (one kernel on CUDA), then d hidden and d weight by two matmuls; the backward only scales them by the
    incoming gradient. No fp32 logits, log-softmax or fp32 logits gradient ever exist, and nothing of the
    logits outlives its chunk. The head's matmuls are the three of nn.Linear + CE, in the same dtype.

    `weight_vh` may be a DTensor sharded over the vocabulary (Shard(0)) on a 1-D tp mesh (vocab_parallel), with
    `hidden_nh` the same plain tensor on every tp rank: each rank computes its own columns of each chunk's
    logits, the log-sum-exp comes from all-reduced per-token statistics (`_chunk_ce_grad_`), the weight's
    gradient is this rank's rows (Shard(0), like the weight) and the hidden states' gradient is summed over tp.
    The CE sum is the same on every rank. That sum of the hidden gradient runs in the forward, each chunk's
    all-reduce started as soon as its rows exist and left in flight while the weight gradient's and the next
    chunk's matmuls run; summed in the backward instead (an all-reduce after the head's backward, as
    `tensor_parallel._ToBlock` does for a block), it would sit between the head's and the final norm's backward
    with nothing to overlap it.

    `grad_buffer` (`model.kernels.weight_grad=in_matmul`, a plain weight): the weight's gradient goes into it
    (the weight's `.grad`, qwenft.models.weight_grad) and the weight gets none from autograd. With `grad_scale`,
    the gradient the backward will be given (d loss / d CE sum, a host number), each chunk's weight-gradient
    matmul adds into the buffer itself (cuBLAS's alpha = the scale, beta = 1: no weight-sized tensor, no pass
    over it), and the backward checks that it was given that scale; without, the backward scales the gradient
    into the buffer in one pass (`ce_kernel.scale_add_`).
    """
    vocab_start, group = 0, None
    if isinstance(weight_vh, DTensor):
        vocab_start, group = _vocab_shard(weight_vh)
        weight_vh = local(weight_vh)  # its rows' gradient goes to the weight's `.grad`, Shard(0) like the weight
    chunk = chunk_tokens or hidden_nh.shape[0]
    if torch.is_grad_enabled() and (hidden_nh.requires_grad or weight_vh.requires_grad):
        return _FusedLinearCE.apply(hidden_nh, weight_vh, labels_n, chunk, vocab_start, group, hits, grad_buffer,
                                    grad_scale)
    loss = torch.zeros((), device=hidden_nh.device, dtype=torch.float32)
    for s in range(0, hidden_nh.shape[0], chunk):
        loss += _chunk_ce_grad_(hidden_nh[s:s + chunk] @ weight_vh.t(), labels_n[s:s + chunk], vocab_start, group,
                                grad=False, hits=hits).sum()
    return loss


def _vocab_shard(weight: DTensor) -> tuple[int, dist.ProcessGroup]:
    """(first vocabulary row of this rank's shard, the tp process group) of a vocab-parallel lm_head weight."""
    if weight.device_mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
        raise ValueError("the fused linear cross-entropy (model.kernels.ce=fused) takes the lm_head whole or sharded "
                         f"over the vocabulary (Shard(0)) on the 1-D tp mesh, but it is a DTensor "
                         f"{weight.placements} on a {weight.device_mesh.ndim}-D mesh")
    _, (start, _) = shard_extent(weight)
    return start, weight.device_mesh.get_group()


class _FusedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_nh, weight_vh, labels_n, chunk: int, vocab_start: int, group, hits, grad_buffer,
                grad_scale):
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        ctx.grad_buffer = grad_buffer if want_weight else None  # not saved: the step's other microbatches add to it
        ctx.grad_scale = grad_scale if ctx.grad_buffer is not None else None
        into_buffer = ctx.grad_scale is not None
        grad_hidden = torch.empty_like(hidden_nh) if want_hidden else None
        grad_weight = None
        pending = []  # vocab-parallel: the hidden gradient's all-reduces, in flight while the next matmuls run
        loss = torch.zeros((), device=hidden_nh.device, dtype=torch.float32)
        for s in range(0, hidden_nh.shape[0], chunk):
            h_ch = hidden_nh[s:s + chunk]
            logits_cv = h_ch @ weight_vh.t()
            # logits_cv now holds d ce / d logits
            loss += _chunk_ce_grad_(logits_cv, labels_n[s:s + chunk], vocab_start, group, hits=hits).sum()
            if want_hidden:
                torch.mm(logits_cv, weight_vh, out=grad_hidden[s:s + chunk])
                if group is not None:  # this rank's vocabulary rows' share of it
                    pending.append(dist.all_reduce(grad_hidden[s:s + chunk], group=group, async_op=True))
            if into_buffer:  # scaled and added in the matmul: one rounding per chunk
                grad_buffer.addmm_(logits_cv.t(), h_ch, alpha=grad_scale)
            elif want_weight:
                # accumulated in the weight's dtype: one rounding per chunk (addmm sums each product in fp32)
                if grad_weight is None:
                    grad_weight = logits_cv.t() @ h_ch
                else:
                    grad_weight.addmm_(logits_cv.t(), h_ch)
        for work in pending:
            work.wait()
        ctx.save_for_backward(grad_hidden, grad_weight)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        if ctx.grad_scale is not None:  # added in the forward, with the scale the loss promised
            torch._assert_async((grad_loss.double() - ctx.grad_scale).abs() <= 1e-5 * abs(ctx.grad_scale),
                                "the fused cross-entropy added its weight gradient with another scale than the loss "
                                "gave it (model.kernels.weight_grad=in_matmul)")
        elif ctx.grad_buffer is not None:
            _scale_add_(ctx.grad_buffer, grad_weight, grad_loss)
            grad_weight = None
        return (_scale_(grad_hidden, grad_loss), _scale_(grad_weight, grad_loss), None, None, None, None, None, None,
                None)
