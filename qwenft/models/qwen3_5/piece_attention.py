"""Causal attention of document pieces through a dense kernel that returns its log-sum-exp: cuDNN's on CUDA,
faster than FlashAttention 2 at Qwen3.5's head_dim 256 (docs/performance.md), and the CPU's flash kernel, the
same math, as its reference in tests. `model.kernels.attention=cudnn` (or auto, for long documents) runs it.

A piece is `lq` queries of one document over `lk >= lq` keys of it, the queries being the keys' last ones: a
whole document (lq == lk), or a context-parallel span's piece of a document that began before the span. A dense
kernel's causal mask is aligned at the top left (query i sees keys up to i), so a piece with lq < lk runs as two
blocks: every query over the keys before the queries (no mask), and over its own keys (the causal square). The
blocks' outputs merge by their log-sum-exps, and the backward runs each block's kernel backward with the merged
output and log-sum-exp: each block's softmax is then normalised by the whole row's, which makes the blocks'
gradients sum to the piece's exactly. Grouped-query attention: cuDNN takes the fewer key-value heads itself
where it can (checked once a process, `cudnn_takes_gqa`); otherwise, and on the CPU, the key-value heads are
repeated to the query heads for the kernels and their gradients summed back.
"""

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

aten = torch.ops.aten


@dataclass(frozen=True)
class _Kernel:
    forward: object  # (q, k, v, causal, scale) -> (out, lse, state)
    backward: object  # (dout, q, k, v, out, lse, state, causal, scale) -> (dq, dk, dv)


def _cudnn_forward(q, k, v, causal: bool, scale: float):
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale)
    return out, lse, (seed, offset, cum_q, cum_k, max_q, max_k)


def _cudnn_backward(dout, q, k, v, out, lse, state, causal: bool, scale: float):
    seed, offset, cum_q, cum_k, max_q, max_k = state
    return aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse, seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, causal, scale=scale)


def _cpu_forward(q, k, v, causal: bool, scale: float):
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse, None


def _cpu_backward(dout, q, k, v, out, lse, state, causal: bool, scale: float):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal,
                                                                     scale=scale)


KERNELS = {"cudnn": _Kernel(_cudnn_forward, _cudnn_backward), "cpu_flash": _Kernel(_cpu_forward, _cpu_backward)}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@functools.cache
def cudnn_takes_gqa(dtype: torch.dtype) -> bool:
    """Whether cuDNN's attention runs grouped-query attention itself (fewer key-value heads than query heads): its
    output and gradients on a small causal block and a small unmasked one equal those with the heads repeated.
    Its kernel then reads each key-value head once, and no repeated copy of the keys and values is made. Run
    outside any dispatch mode: selective checkpointing's mode would keep these calls' outputs as the layer's."""
    # torch has no public way to step outside the active dispatch modes (2.13)
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch.no_grad():
        return _grouped_equals_repeated(dtype)


def _grouped_equals_repeated(dtype: torch.dtype) -> bool:
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 4, 128, 64, device="cuda", generator=g).to(dtype)
    k, v = (torch.randn(1, 2, 192, 64, device="cuda", generator=g).to(dtype) for _ in range(2))
    dout = torch.randn(1, 4, 128, 64, device="cuda", generator=g).to(dtype)
    for keys, causal in ((slice(64, None), True), (slice(0, 64), False)):
        kv = [t[:, :, keys].contiguous() for t in (k, v)]
        try:
            grouped = _cudnn_forward(q, *kv, causal, 0.125)
            grouped_grads = _cudnn_backward(dout, q, *kv, *grouped, causal, 0.125)
        except RuntimeError:  # this cuDNN or torch refuses the head counts
            return False
        rep = [t.repeat_interleave(2, dim=1) for t in kv]
        full = _cudnn_forward(q, *rep, causal, 0.125)
        dq, dk, dv = _cudnn_backward(dout, q, *rep, *full, causal, 0.125)
        want = [full[0], dq, *(d.unflatten(1, (2, 2)).sum(2) for d in (dk, dv))]
        got = [grouped[0], *grouped_grads]
        if any(a.shape != b.shape or _rel(a, b) > 1e-2 for a, b in zip(got, want)):
            return False
    return True


def _wide(t: torch.Tensor) -> torch.Tensor:
    """`t` in fp32 at least (fp64 stays fp64): the merge's precision."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _as_rows(lse: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """A kernel's log-sum-exp ([B, H, lq] or [B, H, lq, 1]) as [B, H, lq, 1], to weigh `out`'s rows."""
    return _wide(lse).reshape(*out.shape[:-1], 1)


class _PieceAttention(torch.autograd.Function):
    """q [1, H, lq, D], k and v [1, H, lk, D] (heads already repeated), lq <= lk -> [1, H, lq, D]."""

    @staticmethod
    def forward(ctx, q, k, v, scale: float, kernel: _Kernel):
        before = k.shape[2] - q.shape[2]  # keys ahead of the queries: the unmasked block
        blocks = [(slice(before, None), True)] + ([(slice(0, before), False)] if before else [])
        outs, lses, states = [], [], []
        for keys, causal in blocks:
            out, lse, state = kernel.forward(q, k[:, :, keys], v[:, :, keys], causal, scale)
            outs.append(out)
            lses.append(lse)
            states.append(state)
        if len(blocks) == 1:
            out, lse = outs[0], lses[0]
        else:
            rows = [_as_rows(lse, o) for lse, o in zip(lses, outs)]
            merged = torch.logaddexp(*rows)
            total = sum(_wide(o) * torch.exp(r - merged) for o, r in zip(outs, rows))
            # the kernels' own layouts, which their backward expects
            out = torch.empty_like(outs[0]).copy_(total)
            lse = torch.empty_like(lses[0]).copy_(merged.reshape(lses[0].shape))
        ctx.blocks, ctx.states, ctx.scale, ctx.kernel = blocks, states, scale, kernel
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dout = torch.empty_like(out).copy_(dout)  # the output's strides, which the kernels' backward expects
        dq = torch.zeros_like(q)
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        for (keys, causal), state in zip(ctx.blocks, ctx.states):
            gq, gk, gv = ctx.kernel.backward(dout, q, k[:, :, keys], v[:, :, keys], out, lse, state, causal,
                                             ctx.scale)
            dq += gq
            dk[:, :, keys] += gk
            dv[:, :, keys] += gv
        return dq, dk, dv, None, None


# pieces with fewer queries take masked SDPA instead: cuDNN refuses a 1 x 1 causal block (s_q = s_kv = 1), and a
# kernel call pair costs more than such a piece's whole attention
SMALL_PIECE = 64


def _masked_piece(q_bhld, k_bhld, v_bhld, scale: float) -> torch.Tensor:
    lq, lk = q_bhld.shape[2], k_bhld.shape[2]
    mask = torch.ones(lq, lk, dtype=torch.bool, device=q_bhld.device).tril(lk - lq)  # the keys' last lq, causal
    return F.scaled_dot_product_attention(q_bhld, k_bhld, v_bhld, attn_mask=mask, scale=scale,
                                          enable_gqa=True).transpose(1, 2)


def attend_piece(q_bhld, k_bhld, v_bhld, scale: float, kernel: str = "cudnn") -> torch.Tensor:
    """Causal attention of one document piece: queries [1, H, lq, D] that are the last lq of the keys and
    values [1, Hkv, lk, D] -> [1, lq, H, D]. Pieces of fewer than SMALL_PIECE queries take masked SDPA."""
    if q_bhld.shape[2] < SMALL_PIECE:
        return _masked_piece(q_bhld, k_bhld, v_bhld, scale)
    heads = q_bhld.shape[1] // k_bhld.shape[1]
    grouped = heads == 1 or (kernel == "cudnn" and cudnn_takes_gqa(q_bhld.dtype))
    k, v = (t if grouped else t.repeat_interleave(heads, dim=1) for t in (k_bhld, v_bhld))
    return _PieceAttention.apply(q_bhld, k, v, scale, KERNELS[kernel]).transpose(1, 2)


def attend_pieces(q_bhld, keys, values, scale: float, cu_q: list[int], cu_k: list[int],
                  kernel: str = "cudnn") -> torch.Tensor:
    """Pieces one after another: queries [1, H, l, D] cut by the offsets `cu_q`, keys and values [1, Hkv, t, D]
    by `cu_k` (host lists of equal length; piece i is queries cu_q[i]:cu_q[i+1] over keys cu_k[i]:cu_k[i+1], the
    queries the keys' last ones) -> [1, l, H, D]. One kernel call pair a piece: for rows of few long documents."""
    outs = [attend_piece(q_bhld[:, :, q0:q1], keys[:, :, k0:k1], values[:, :, k0:k1], scale, kernel)
            for q0, q1, k0, k1 in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:]) if q1 > q0]
    return torch.cat(outs, dim=1)
