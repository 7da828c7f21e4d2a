"""Cross-entropy of a chunk of bf16 logits and its gradient, in Triton kernels over the logits in place.

One program per token row: a first pass over the row finds the log-sum-exp (running max and sum per lane,
in fp32), a second overwrites the logits with d CE / d logits = softmax - one_hot(label), rounded to the
logits' dtype, which is what the matmuls of the head's backward consume. Two reads and one write of the bf16
logits, where torch's path writes fp32 logits, their log-softmax and an fp32 gradient (about 7x the traffic).

Whole vocabulary: `ce_grad_`, both passes in one kernel. Vocabulary sharded over tensor-parallel ranks (each
holds the columns [vocab_start, vocab_start + V) of every row): `shard_stats` is the first pass (row max, sum
of exp(x - max) and the label's logit where this rank holds it), the caller all-reduces those into the
log-sum-exp, and `shard_ce_grad_` is the second pass.
"""

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _row_max_sum(ptr, V, BLOCK: tl.constexpr):
    """One row's max and sum of exp(x - max), in fp32, in one online pass."""
    cols = tl.arange(0, BLOCK)
    max_l = tl.full([BLOCK], -3.0e38, tl.float32)
    sum_l = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        mask = start + cols < V
        x = tl.load(ptr + start + cols, mask=mask, other=-3.0e38).to(tl.float32)
        new_max = tl.maximum(max_l, x)
        sum_l = sum_l * tl.exp(max_l - new_max) + tl.where(mask, tl.exp(x - new_max), 0.0)
        max_l = new_max
    row_max = tl.max(max_l, 0)
    return row_max, tl.sum(sum_l * tl.exp(max_l - row_max), 0)


@triton.jit
def _write_grad(ptr, V, lse, target_col, scale, BLOCK: tl.constexpr):
    """Overwrite one row with (exp(x - lse) - one_hot(target_col)) * scale; target_col -1 = no one_hot."""
    cols = tl.arange(0, BLOCK)
    for start in range(0, V, BLOCK):
        mask = start + cols < V
        x = tl.load(ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
        grad = tl.exp(x - lse) - tl.where(start + cols == target_col, 1.0, 0.0)
        tl.store(ptr + start + cols, (grad * scale).to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _ce_grad_kernel(logits_ptr, stride, target_ptr, loss_ptr, hits_ptr, V, IGNORE: tl.constexpr,
                    HITS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    ptr = logits_ptr + row * stride
    row_max, row_sum = _row_max_sum(ptr, V, BLOCK)
    lse = row_max + tl.log(row_sum)
    target = tl.load(target_ptr + row)
    valid = target != IGNORE
    safe_target = tl.where(valid, target, 0)
    x_target = tl.load(ptr + safe_target).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(valid, lse - x_target, 0.0))
    if HITS:  # the label is the row's argmax (a tie counts): the same fp32 values the max was taken over
        tl.store(hits_ptr + row, (valid & (x_target >= row_max)).to(tl.int32))
    _write_grad(ptr, V, lse, safe_target, tl.where(valid, 1.0, 0.0), BLOCK)


def ce_grad_(logits_nv: torch.Tensor, labels_n: torch.Tensor, ignore_index: int, with_hits: bool = False):
    """Per-token CE (0 where the label is `ignore_index`) in fp32; `logits_nv` becomes the CE's gradient.
    `with_hits`: also per token 1 where the label is the logits' argmax (int32), as (loss_n, hits_n)."""
    n, v = logits_nv.shape
    assert logits_nv.stride(1) == 1, "rows of the logits must be contiguous"
    loss_n = torch.empty(n, device=logits_nv.device, dtype=torch.float32)
    hits_n = torch.empty(n if with_hits else 0, device=logits_nv.device, dtype=torch.int32)
    if n:
        _ce_grad_kernel[(n,)](logits_nv, logits_nv.stride(0), labels_n, loss_n, hits_n, v, IGNORE=ignore_index,
                              HITS=with_hits, BLOCK=BLOCK, num_warps=8)
    return (loss_n, hits_n) if with_hits else loss_n


@triton.jit
def _shard_stats_kernel(logits_ptr, stride, target_ptr, stats_ptr, n, V, vocab_start, IGNORE: tl.constexpr,
                        BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    ptr = logits_ptr + row * stride
    row_max, row_sum = _row_max_sum(ptr, V, BLOCK)
    target = tl.load(target_ptr + row)
    col = target - vocab_start
    owned = (target != IGNORE) & (col >= 0) & (col < V)
    x_target = tl.load(ptr + tl.where(owned, col, 0)).to(tl.float32)
    tl.store(stats_ptr + row, row_max)
    tl.store(stats_ptr + n + row, row_sum)
    tl.store(stats_ptr + 2 * n + row, tl.where(owned, x_target, 0.0))


def shard_stats(logits_nv: torch.Tensor, labels_n: torch.Tensor, vocab_start: int, ignore_index: int) -> torch.Tensor:
    """fp32 [3, n] over this rank's columns [vocab_start, vocab_start + V) of each row: the max, the sum of
    exp(x - max), and the label's logit (0 where the label is `ignore_index` or another rank's column)."""
    n, v = logits_nv.shape
    assert logits_nv.stride(1) == 1, "rows of the logits must be contiguous"
    stats_3n = torch.empty(3, n, device=logits_nv.device, dtype=torch.float32)
    if n:
        _shard_stats_kernel[(n,)](logits_nv, logits_nv.stride(0), labels_n, stats_3n, n, v, vocab_start,
                                  IGNORE=ignore_index, BLOCK=BLOCK, num_warps=8)
    return stats_3n


@triton.jit
def _shard_ce_grad_kernel(logits_ptr, stride, target_ptr, lse_ptr, V, vocab_start, IGNORE: tl.constexpr,
                          BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    ptr = logits_ptr + row * stride
    target = tl.load(target_ptr + row)
    valid = target != IGNORE
    col = target - vocab_start
    owned = valid & (col >= 0) & (col < V)
    _write_grad(ptr, V, tl.load(lse_ptr + row), tl.where(owned, col, -1), tl.where(valid, 1.0, 0.0), BLOCK)


def shard_ce_grad_(logits_nv: torch.Tensor, labels_n: torch.Tensor, lse_n: torch.Tensor, vocab_start: int,
                   ignore_index: int) -> torch.Tensor:
    """`logits_nv` (this rank's columns [vocab_start, vocab_start + V)) becomes the CE's gradient there, given
    each row's log-sum-exp over the whole vocabulary `lse_n` (fp32)."""
    n, v = logits_nv.shape
    assert logits_nv.stride(1) == 1, "rows of the logits must be contiguous"
    if n:
        _shard_ce_grad_kernel[(n,)](logits_nv, logits_nv.stride(0), labels_n, lse_n, v, vocab_start,
                                    IGNORE=ignore_index, BLOCK=BLOCK, num_warps=8)
    return logits_nv


@triton.jit
def _scale_kernel(x_ptr, scale_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    scale = tl.load(scale_ptr)
    x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
    tl.store(x_ptr + offs, (x * scale).to(x_ptr.dtype.element_ty), mask=mask)


def scale_(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x *= scale (a 0-dim fp32 tensor on x's device), formed in fp32 and rounded once to x's dtype: torch's
    bf16 `mul_` by an fp32 tensor rounds differently (the scale is not kept in fp32)."""
    assert x.is_contiguous()
    n = x.numel()
    if n:
        _scale_kernel[(triton.cdiv(n, 8192),)](x, scale.float(), n, BLOCK=8192)
    return x


@triton.jit
def _scale_add_kernel(acc_ptr, x_ptr, scale_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    scale = tl.load(scale_ptr)
    acc = tl.load(acc_ptr + offs, mask=mask).to(tl.float32)
    x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
    tl.store(acc_ptr + offs, (acc + x * scale).to(acc_ptr.dtype.element_ty), mask=mask)


def scale_add_(acc: torch.Tensor, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """acc += x * scale (a 0-dim fp32 tensor on their device), formed in fp32 and rounded once to acc's dtype:
    one read of each and one write, where scaling x and then adding it reads x twice and writes twice."""
    assert acc.is_contiguous() and x.is_contiguous() and acc.shape == x.shape
    n = acc.numel()
    if n:
        _scale_add_kernel[(triton.cdiv(n, 8192),)](acc, x, scale.float(), n, BLOCK=8192)
    return acc


@triton.jit
def _sum_rows(acc, src_ptr, order_ptr, cols, col_mask, H, begin, end, ROWS: tl.constexpr):
    """acc plus the sum of the rows src[order[j]] for j in [begin, end), ROWS at a time, in fp32."""
    for start in range(begin, end, ROWS):
        pos = start + tl.arange(0, ROWS)
        inside = pos < end
        src_rows = tl.load(order_ptr + pos, mask=inside, other=0).to(tl.int64)
        tile = tl.load(src_ptr + src_rows[:, None] * H + cols[None, :], mask=inside[:, None] & col_mask[None, :],
                       other=0.0)
        acc += tl.sum(tile.to(tl.float32), axis=0)
    return acc


@triton.jit
def _sum_tiles_kernel(tiles_ptr, ids_ptr, order_ptr, src_ptr, H, TILE: tl.constexpr, ROWS: tl.constexpr,
                      BLOCK: tl.constexpr):
    """The program of tile m (sorted positions [m * TILE, (m + 1) * TILE)) and a slab of columns: where the tile
    is all one id (not negative), the fp32 sum of its rows into tiles[m]."""
    m = tl.program_id(0)
    first = m * TILE
    row = tl.load(ids_ptr + first)
    if row < 0:
        return
    if tl.load(ids_ptr + first + TILE - 1) != row:
        return
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_mask = cols < H
    acc = _sum_rows(tl.zeros([BLOCK], tl.float32), src_ptr, order_ptr, cols, col_mask, H, first, first + TILE,
                    ROWS)
    tl.store(tiles_ptr + m.to(tl.int64) * H + cols, acc, mask=col_mask)


@triton.jit
def _add_sorted_rows_kernel(dst_ptr, ids_ptr, ends_ptr, order_ptr, src_ptr, tiles_ptr, H, TILE: tl.constexpr,
                            ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """The program of sorted position i and a slab of columns: where i starts a run of one id (ending before
    ends[i]), it sums the run in fp32 and adds the sum into dst[id]: the rows before the run's first whole tile,
    the sums of its whole tiles (`_sum_tiles_kernel`'s), ROWS at a time, then the rows after them. A negative id
    has no row: its programs return at once."""
    i = tl.program_id(0)
    row = tl.load(ids_ptr + i)
    if row < 0:
        return
    if tl.load(ids_ptr + i - 1, mask=i > 0, other=-1) == row:  # inside a run: its first position sums it
        return
    end = tl.load(ends_ptr + i).to(tl.int32)
    first_tile, last_tile = (i + TILE - 1) // TILE, end // TILE  # the run's whole tiles: [first_tile, last_tile)
    head_end, tail_start = end, end
    if last_tile > first_tile:
        head_end, tail_start = first_tile * TILE, last_tile * TILE
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_mask = cols < H
    acc = _sum_rows(tl.zeros([BLOCK], tl.float32), src_ptr, order_ptr, cols, col_mask, H, i, head_end, ROWS)
    for start in range(first_tile, last_tile, ROWS):
        m = start + tl.arange(0, ROWS)
        tile = tl.load(tiles_ptr + m[:, None].to(tl.int64) * H + cols[None, :],
                       mask=(m < last_tile)[:, None] & col_mask[None, :], other=0.0)
        acc += tl.sum(tile, axis=0)
    acc = _sum_rows(acc, src_ptr, order_ptr, cols, col_mask, H, tail_start, end, ROWS)
    dst = dst_ptr + row.to(tl.int64) * H + cols
    tl.store(dst, (tl.load(dst, mask=col_mask).to(tl.float32) + acc).to(dst_ptr.dtype.element_ty), mask=col_mask)


def add_sorted_rows_(dst: torch.Tensor, ids: torch.Tensor, order: torch.Tensor, src: torch.Tensor, rows: int = 8,
                     block: int = 512, num_warps: int = 4, tile: int = 64) -> torch.Tensor:
    """dst[ids[i]] += src[order[i]] for every i whose id is not negative, given ids sorted (order: the sort's
    permutation). Each run of one id is summed in fp32 in a fixed order (`rows` rows at a time over `block`
    columns a program), then added into its row and rounded once to dst's dtype: no host sync, the same bits
    every run for a given order and launch. The sorted positions fall in tiles of `tile` rows; a tile of one id
    is summed by a program of its own first, so a long run of one id (a padding tail, a frequent token) costs
    its run's program one read per tile, not `tile` rows' worth of reads. A run of negative ids costs nothing."""
    assert dst.is_contiguous() and src.is_contiguous() and dst.shape[1] == src.shape[1]
    n, H = src.shape
    if n:
        ends = torch.searchsorted(ids, ids, right=True)  # where each position's run ends
        # one row at least: the run kernel takes its pointer, though with no whole tile it reads none
        tiles = torch.empty(max(n // tile, 1), H, dtype=torch.float32, device=src.device)
        col_blocks = triton.cdiv(H, block)
        if n >= tile:
            _sum_tiles_kernel[(n // tile, col_blocks)](tiles, ids, order, src, H, TILE=tile, ROWS=rows, BLOCK=block,
                                                       num_warps=num_warps)
        _add_sorted_rows_kernel[(n, col_blocks)](dst, ids, ends, order, src, tiles, H, TILE=tile, ROWS=rows,
                                                 BLOCK=block, num_warps=num_warps)
    return dst
