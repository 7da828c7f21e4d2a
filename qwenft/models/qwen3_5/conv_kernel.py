"""GatedDeltaNet's depthwise causal conv and SiLU as two Triton kernels (CUDA): forward, and a backward that forms
the input's and the weight's gradients in one pass.

y[t, c] = silu(sum_j w[c, j] x[t - 3 + j, c]) over x [B, T, C] with TAPS = 4 taps, a tap never reaching before the
start of its row, or of its document in a packed row (`cu_seqlens`). fla's conv backward first writes the
pre-activation to memory in a pass of its own, then evaluates SiLU's derivative once per tap for every token over
2-D tiles. Here a program walks its block's rows one at a time over a slab of channels, with the taps' window of
rows in registers: each row of x and of the incoming gradient is loaded once (the three rows on either side of a
block's edge twice), the pre-activation and SiLU's derivative are formed once per row, and the addresses and masks
are one per row, not one per element. The weight's gradient is summed in fp32 per block and the blocks' partials
summed after, in a fixed order (the same bits every run).

Token blocks are FLA_CHUNK tokens of one document, laid out as fla's kernels lay them out: (document, block in it)
from `varlen.chunk_indices`, so the kernels need no host sync and take fixed layouts under CUDA graphs.
"""

import torch
import triton
import triton.language as tl

from .varlen import FLA_CHUNK, varlen_info

TAPS = 4  # Qwen3.5's linear_conv_kernel_dim; another width takes fla's conv (gdn._triton_conv)
BLOCK_D = 256  # channels a program takes (C: 10240 at the 27B's q|k|v, 2560 a rank at tp4)
NUM_WARPS = 2


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
        length = bos * 0 + T  # int64, as the varlen branch's
    return bos, length, i_t


@triton.jit
def _row(doc_ptr, r, length, o_d, m_d, C: tl.constexpr):
    """Row r of a document as fp32 [BD], zero outside the document."""
    return tl.load(doc_ptr + r * C + o_d, mask=m_d & (r >= 0) & (r < length), other=0.0).to(tl.float32)


@triton.jit
def _taps(w_ptr, o_d, m_d):
    """The 4 taps of the channels o_d, fp32 [BD] each (weight [C, 4] contiguous)."""
    w0 = tl.load(w_ptr + o_d * 4, mask=m_d, other=0.0).to(tl.float32)
    w1 = tl.load(w_ptr + o_d * 4 + 1, mask=m_d, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + o_d * 4 + 2, mask=m_d, other=0.0).to(tl.float32)
    w3 = tl.load(w_ptr + o_d * 4 + 3, mask=m_d, other=0.0).to(tl.float32)
    return w0, w1, w2, w3


@triton.jit
def _conv_fwd_kernel(x_ptr, w_ptr, y_ptr, cu_ptr, idx_ptr, T, C: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                     VARLEN: tl.constexpr):
    i_d, i_t, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, length, i_t = _block(cu_ptr, idx_ptr, i_t, i_b, T, VARLEN)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < C
    w0, w1, w2, w3 = _taps(w_ptr, o_d, m_d)
    x_doc, y_doc = x_ptr + bos * C, y_ptr + bos * C
    r0 = i_t.to(tl.int64) * BT
    x1 = _row(x_doc, r0 - 3, length, o_d, m_d, C)  # rows r - 3, r - 2, r - 1
    x2 = _row(x_doc, r0 - 2, length, o_d, m_d, C)
    x3 = _row(x_doc, r0 - 1, length, o_d, m_d, C)
    n = length - r0  # the block's rows: BT, or fewer in a document's last block
    # constant trip counts, the rows past a short block skipped inside (Triton's CPU interpreter, which can check
    # these kernels without a GPU, takes no loop bound derived from the program's ids or memory)
    for i in range(0, BT):
        if i < n:
            r = r0 + i
            x4 = _row(x_doc, r, length, o_d, m_d, C)
            pre = w0 * x1 + w1 * x2 + w2 * x3 + w3 * x4
            tl.store(y_doc + r * C + o_d, (pre * tl.sigmoid(pre)).to(y_ptr.dtype.element_ty), mask=m_d)
            x1, x2, x3 = x2, x3, x4


@triton.jit
def _conv_bwd_kernel(x_ptr, w_ptr, dy_ptr, dx_ptr, dw_ptr, cu_ptr, idx_ptr, T, C: tl.constexpr, BT: tl.constexpr,
                     BD: tl.constexpr, VARLEN: tl.constexpr):
    i_d, i_t, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    partial = i_t if VARLEN else i_b * tl.num_programs(1) + i_t  # this block's row of the weight's partials
    bos, length, i_t = _block(cu_ptr, idx_ptr, i_t, i_b, T, VARLEN)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < C
    w0, w1, w2, w3 = _taps(w_ptr, o_d, m_d)
    x_doc, dy_doc, dx_doc = x_ptr + bos * C, dy_ptr + bos * C, dx_ptr + bos * C
    r0 = i_t.to(tl.int64) * BT
    n = tl.minimum(BT, length - r0)  # the block's rows
    # row t feeds outputs t .. t + 3 (output t + s through tap 3 - s): walk backwards from the block's last row
    # + 3, the first three steps only filling the window of the gradient through SiLU, g, with rows past the block
    top = r0 + n + 2
    xa = _row(x_doc, top, length, o_d, m_d, C)  # rows t, t - 1, t - 2
    xb = _row(x_doc, top - 1, length, o_d, m_d, C)
    xc = _row(x_doc, top - 2, length, o_d, m_d, C)
    # g at rows t + 1, t + 2, t + 3, each its own zeros: Triton carries a name through the loop only if the body
    # changes its value, and `g2 = g1` of one shared zeros tensor would look unchanged
    g1 = tl.zeros((BD,), dtype=tl.float32)
    g2 = tl.zeros((BD,), dtype=tl.float32)
    g3 = tl.zeros((BD,), dtype=tl.float32)
    dw0 = tl.zeros((BD,), dtype=tl.float32)
    dw1 = tl.zeros((BD,), dtype=tl.float32)
    dw2 = tl.zeros((BD,), dtype=tl.float32)
    dw3 = tl.zeros((BD,), dtype=tl.float32)
    for i in range(0, BT + 3):
        if i < n + 3:
            t = top - i
            xd = _row(x_doc, t - 3, length, o_d, m_d, C)
            pre = w0 * xd + w1 * xc + w2 * xb + w3 * xa
            sig = tl.sigmoid(pre)
            g = _row(dy_doc, t, length, o_d, m_d, C) * sig * (1 + pre * (1 - sig))  # silu' = sig (1 + a (1 - sig))
            tl.store(dx_doc + t * C + o_d, (w3 * g + w2 * g1 + w1 * g2 + w0 * g3).to(dx_ptr.dtype.element_ty),
                     mask=m_d & (i >= 3))
            g_own = tl.where(i >= 3, g, 0.0)  # the weight's gradient over this block's rows only
            dw0 += g_own * xd
            dw1 += g_own * xc
            dw2 += g_own * xb
            dw3 += g_own * xa
            g1, g2, g3 = g, g1, g2
            xa, xb, xc = xb, xc, xd
    out = dw_ptr + partial.to(tl.int64) * C * 4 + o_d * 4
    tl.store(out, dw0, mask=m_d)
    tl.store(out + 1, dw1, mask=m_d)
    tl.store(out + 2, dw2, mask=m_d)
    tl.store(out + 3, dw3, mask=m_d)


def _grid_and_layout(x: torch.Tensor, cu_seqlens, chunk_indices, block_d: int):
    """(grid, cu_seqlens, chunk indices) of a launch over x [B, T, C]; both None for rows of their own."""
    B, T, C = x.shape
    if cu_seqlens is None:
        return (triton.cdiv(C, block_d), triton.cdiv(T, FLA_CHUNK), B), None, None
    if chunk_indices is None:
        chunk_indices = varlen_info(cu_seqlens).chunk_indices
    return (triton.cdiv(C, block_d), chunk_indices.shape[0], 1), cu_seqlens, chunk_indices


class _CausalConvSiLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, cu_seqlens, chunk_indices, block_d, num_warps):
        grid, cu, idx = _grid_and_layout(x, cu_seqlens, chunk_indices, block_d)
        y = torch.empty_like(x)
        varlen = cu is not None  # rows of their own: the weight stands in for the unread offsets' pointers
        _conv_fwd_kernel[grid](x, weight, y, cu if varlen else weight, idx if varlen else weight, x.shape[1],
                               C=x.shape[2], BT=FLA_CHUNK, BD=block_d, VARLEN=varlen, num_warps=num_warps)
        ctx.save_for_backward(x, weight)
        ctx.layout = (grid, cu, idx, block_d, num_warps)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        grid, cu, idx, block_d, num_warps = ctx.layout
        varlen = cu is not None
        dy = dy.contiguous()
        dx = torch.empty_like(x)
        C = weight.shape[0]
        partials = torch.empty(grid[1] * grid[2], C, TAPS, device=x.device, dtype=torch.float32)
        _conv_bwd_kernel[grid](x, weight, dy, dx, partials, cu if varlen else weight, idx if varlen else weight,
                               x.shape[1], C=C, BT=FLA_CHUNK, BD=block_d, VARLEN=varlen, num_warps=num_warps)
        return dx, partials.sum(0).to(weight.dtype), None, None, None, None


def causal_conv_silu(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                     chunk_indices: torch.Tensor | None = None, *, block_d: int = BLOCK_D,
                     num_warps: int = NUM_WARPS) -> torch.Tensor:
    """silu(depthwise causal conv) of x [B, T, C] with weight [C, TAPS] (any float dtypes; fp32 inside), in x's
    dtype. `cu_seqlens`: document offsets of a packed stream (then B = 1; documents never see each other);
    `chunk_indices`: their FLA_CHUNK-token blocks (`varlen.Varlen.chunk_indices`, or a fixed layout's), derived
    from `cu_seqlens` when not given. `block_d` and `num_warps`: the launch (benchmarks try others)."""
    if weight.shape[1] != TAPS:
        raise ValueError(f"causal_conv_silu: the kernels take {TAPS} taps, got a weight of shape {tuple(weight.shape)}")
    if cu_seqlens is not None and x.shape[0] != 1:
        raise ValueError(f"causal_conv_silu: packed documents (cu_seqlens) need one row, got x of shape "
                         f"{tuple(x.shape)}")
    return _CausalConvSiLU.apply(x.contiguous(), weight.contiguous(), cu_seqlens, chunk_indices, block_d,
                                 num_warps)
