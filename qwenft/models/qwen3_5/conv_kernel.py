"""GatedDeltaNet's depthwise causal conv and SiLU as two Triton kernels (CUDA): forward, and a backward that forms
the input's and the weight's gradients in one pass.

y[t, c] = silu(sum_j w[c, j] x[t - (W - 1) + j, c]) over x [B, T, C], a tap never reaching before the start of
its row, or of its document in a packed row (`cu_seqlens`). The backward recomputes the pre-activation from x in
registers, where fla's conv writes it to memory in a kernel of its own first and then evaluates the activation's
derivative once per tap for every token: here each program derives it once per tap shift from tiles that sit in
its cache, and adds its tokens' share of the weight gradient (fp32, one partial per token block, summed after:
the same bits every run).

Token blocks are FLA_CHUNK tokens of one document, laid out as fla's kernels lay them out: (document, block in it)
from `varlen.chunk_indices`, so the kernels need no host sync and take fixed layouts under CUDA graphs.
"""

import torch
import triton
import triton.language as tl

from .varlen import FLA_CHUNK, varlen_info

BLOCK_D = 64  # channels a program takes (C: 10240 at the 27B's q|k|v, 2560 a rank at tp4)
NUM_WARPS = 4


@triton.jit
def _block(cu_ptr, idx_ptr, i_t, i_b, T, VARLEN: tl.constexpr):
    """(first token of the program's document in the flattened stream, the document's length, the block's index
    in the document)."""
    if VARLEN:
        doc = tl.load(idx_ptr + i_t * 2).to(tl.int32)
        i_t = tl.load(idx_ptr + i_t * 2 + 1).to(tl.int32)
        bos = tl.load(cu_ptr + doc).to(tl.int64)
        length = tl.load(cu_ptr + doc + 1).to(tl.int64) - bos
    else:
        bos = i_b.to(tl.int64) * T
        length = bos * 0 + T
    return bos, length, i_t


@triton.jit
def _preact(x_ptr, w_ptr, rows, length, o_d, m_d, C: tl.constexpr, W: tl.constexpr, BT: tl.constexpr,
            BD: tl.constexpr):
    """The conv before its activation at the document positions `rows` [BT], fp32 [BT, BD]; x_ptr at the
    document's first token."""
    acc = tl.zeros((BT, BD), dtype=tl.float32)
    for j in tl.static_range(W):
        src = rows - (W - 1) + j
        m = ((src >= 0) & (src < length))[:, None] & m_d[None, :]
        x = tl.load(x_ptr + src[:, None] * C + o_d[None, :], mask=m, other=0.0).to(tl.float32)
        acc += x * tl.load(w_ptr + o_d * W + j, mask=m_d, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _conv_fwd_kernel(x_ptr, w_ptr, y_ptr, cu_ptr, idx_ptr, T, C: tl.constexpr, W: tl.constexpr, BT: tl.constexpr,
                     BD: tl.constexpr, VARLEN: tl.constexpr):
    i_d, i_t, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, length, i_t = _block(cu_ptr, idx_ptr, i_t, i_b, T, VARLEN)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < C
    rows = (i_t * BT + tl.arange(0, BT)).to(tl.int64)
    acc = _preact(x_ptr + bos * C, w_ptr, rows, length, o_d, m_d, C, W, BT, BD)
    y = acc * tl.sigmoid(acc)
    m = (rows < length)[:, None] & m_d[None, :]
    tl.store(y_ptr + bos * C + rows[:, None] * C + o_d[None, :], y.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _conv_bwd_kernel(x_ptr, w_ptr, dy_ptr, dx_ptr, dw_ptr, cu_ptr, idx_ptr, T, C: tl.constexpr, W: tl.constexpr,
                     BW: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, VARLEN: tl.constexpr):
    i_d, i_t, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    partial = i_t if VARLEN else i_b * tl.num_programs(1) + i_t  # this block's row of the weight's partials
    bos, length, i_t = _block(cu_ptr, idx_ptr, i_t, i_b, T, VARLEN)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < C
    o_w = tl.arange(0, BW)
    rows = (i_t * BT + tl.arange(0, BT)).to(tl.int64)
    x_doc, dy_doc = x_ptr + bos * C, dy_ptr + bos * C
    dx = tl.zeros((BT, BD), dtype=tl.float32)
    dw = tl.zeros((BD, BW), dtype=tl.float32)
    # input token r feeds outputs r .. r + W - 1 of its document: output r + s through tap W - 1 - s
    for s in tl.static_range(W):
        out_rows = rows + s
        acc = _preact(x_doc, w_ptr, out_rows, length, o_d, m_d, C, W, BT, BD)
        m_out = (out_rows < length)[:, None] & m_d[None, :]
        dy = tl.load(dy_doc + out_rows[:, None] * C + o_d[None, :], mask=m_out, other=0.0).to(tl.float32)
        sig = tl.sigmoid(acc)
        g = dy * sig * (1 + acc * (1 - sig))  # through SiLU: silu'(a) = sig(a) (1 + a (1 - sig(a)))
        dx += g * tl.load(w_ptr + o_d * W + (W - 1 - s), mask=m_d, other=0.0).to(tl.float32)[None, :]
        if s == 0:  # the weight's gradient over this block's outputs: tap j reads input row r - (W - 1) + j
            for j in tl.static_range(W):
                src = rows - (W - 1) + j
                m = ((src >= 0) & (src < length))[:, None] & m_d[None, :]
                x = tl.load(x_doc + src[:, None] * C + o_d[None, :], mask=m, other=0.0).to(tl.float32)
                dw += tl.where(o_w[None, :] == j, tl.sum(g * x, 0)[:, None], 0.0)
    m = (rows < length)[:, None] & m_d[None, :]
    tl.store(dx_ptr + bos * C + rows[:, None] * C + o_d[None, :], dx.to(dx_ptr.dtype.element_ty), mask=m)
    tl.store(dw_ptr + partial.to(tl.int64) * C * W + o_d[:, None] * W + o_w[None, :], dw,
             mask=m_d[:, None] & (o_w[None, :] < W))


def _grid_and_layout(x: torch.Tensor, cu_seqlens, chunk_indices, block_d: int):
    """(grid, cu_seqlens, chunk indices, varlen?) of a launch over x [B, T, C]."""
    B, T, C = x.shape
    if cu_seqlens is None:
        return (triton.cdiv(C, block_d), triton.cdiv(T, FLA_CHUNK), B), x, x, False
    if chunk_indices is None:
        chunk_indices = varlen_info(cu_seqlens).chunk_indices
    return (triton.cdiv(C, block_d), chunk_indices.shape[0], 1), cu_seqlens, chunk_indices, True


class _CausalConvSiLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, cu_seqlens, chunk_indices, block_d, num_warps):
        grid, cu, idx, is_varlen = _grid_and_layout(x, cu_seqlens, chunk_indices, block_d)
        y = torch.empty_like(x)
        _conv_fwd_kernel[grid](x, weight, y, cu, idx, x.shape[1], C=x.shape[2], W=weight.shape[1], BT=FLA_CHUNK,
                               BD=block_d, VARLEN=is_varlen, num_warps=num_warps)
        ctx.save_for_backward(x, weight)
        ctx.layout = (grid, cu, idx, is_varlen, block_d, num_warps)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        grid, cu, idx, is_varlen, block_d, num_warps = ctx.layout
        dy = dy.contiguous()
        dx = torch.empty_like(x)
        C, W = weight.shape
        partials = torch.empty(grid[1] * grid[2], C, W, device=x.device, dtype=torch.float32)
        _conv_bwd_kernel[grid](x, weight, dy, dx, partials, cu, idx, x.shape[1], C=C, W=W,
                               BW=triton.next_power_of_2(W), BT=FLA_CHUNK, BD=block_d, VARLEN=is_varlen,
                               num_warps=num_warps)
        return dx, partials.sum(0).to(weight.dtype), None, None, None, None


def causal_conv_silu(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                     chunk_indices: torch.Tensor | None = None, *, block_d: int = BLOCK_D,
                     num_warps: int = NUM_WARPS) -> torch.Tensor:
    """silu(depthwise causal conv) of x [B, T, C] with weight [C, W] (any float dtypes; fp32 inside), in x's
    dtype. `cu_seqlens`: document offsets of a packed stream (then B = 1; documents never see each other);
    `chunk_indices`: their FLA_CHUNK-token blocks (`varlen.Varlen.chunk_indices`, or a fixed layout's), derived
    from `cu_seqlens` when not given. `block_d` and `num_warps`: the launch (benchmarks try others)."""
    if cu_seqlens is not None and x.shape[0] != 1:
        raise ValueError(f"causal_conv_silu: packed documents (cu_seqlens) need one row, got x of shape "
                         f"{tuple(x.shape)}")
    return _CausalConvSiLU.apply(x.contiguous(), weight.contiguous(), cu_seqlens, chunk_indices, block_d,
                                 num_warps)
