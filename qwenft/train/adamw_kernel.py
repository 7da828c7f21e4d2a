"""One Triton kernel for `LowPrecisionAdamW`'s whole update of many tensors, on CUDA.

The foreach path upcasts parameter, gradient and moments to fp32 copies, runs about ten passes over them and
rounds each bf16 result back with a separate random-bits tensor: some 170 bytes of memory traffic per
parameter. This kernel reads each element once and writes it once (14 bytes per parameter for bf16 weights,
gradients and moments), computing the same formulas in fp32 registers (for a bf16 weight with fast sqrt and
division, whose error is far below the weight's rounding), and draws the stochastic-rounding bits from Philox
keyed by (seed, index of the element pair): deterministic for a seed, so replicas round alike and a resumed run
rounds as the original did. Its random bits differ from the foreach path's (torch's generator), so the two agree
exactly only with rounding to nearest.

One launch updates every tensor of a parameter group that shares the parameter, gradient and moment dtypes: each
program takes one chunk of one tensor, found through a table of the tensors' addresses and per-tensor scalars
that the host writes once a step. A launch per tensor costs the host some 0.1 ms (Python, the DTensor shard, the
launch itself): at tensor or data parallel sizes, where each rank's shards are small, that and not the GPU set
the optimizer's time.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from qwenft.transfer import copy_to_device

BLOCK = 2048
CHUNK_BLOCKS = 16  # blocks a program updates: 32K bf16 or 16K fp32 weight elements
# Philox4x32 with 7 rounds: the fewest that pass the BigCrush statistical tests (Salmon et al., SC 2011; Triton's
# default of 10 adds a safety margin), where stochastic rounding needs only unbiased, independent bits. Its integer
# multiplies are a large part of the kernel's time: one call serves two elements (three 16-bit draws each).
PHILOX_ROUNDS = tl.constexpr(7)


@triton.jit
def _round_to_bf16(x, bits16, STOCHASTIC: tl.constexpr):
    if STOCHASTIC:
        # add 16 random bits below bf16's last mantissa bit and truncate: sign-magnitude, so the carry rounds
        # the magnitude up with the probability that makes the result unbiased
        raw = x.to(tl.uint32, bitcast=True)
        raw = (raw + bits16) & 0xFFFF0000
        return raw.to(tl.float32, bitcast=True).to(tl.bfloat16)
    return x.to(tl.bfloat16)


@triton.jit
def _store(ptr, offs, mask, x, bits16, IS_BF16: tl.constexpr, STOCHASTIC: tl.constexpr):
    if IS_BF16:
        tl.store(ptr + offs, _round_to_bf16(x, bits16, STOCHASTIC), mask=mask)
    else:
        tl.store(ptr + offs, x, mask=mask)


@triton.jit
def _adamw_block(p_ptr, g_ptr, m_ptr, v_ptr, start, n, scale, decay, beta1, beta2, eps, step_size,
                 bias_correction2_sqrt, seed, P_BF16: tl.constexpr, M_BF16: tl.constexpr, STOCHASTIC: tl.constexpr,
                 MASKED: tl.constexpr, BLOCK: tl.constexpr):
    # a whole block loads and stores unmasked: with 16-byte aligned tensors, 16-byte vector accesses (a mask whose
    # bound is a runtime value would split them into single elements)
    offs = tl.max_contiguous(tl.multiple_of(start + tl.arange(0, BLOCK), BLOCK), BLOCK)
    mask = offs < n if MASKED else None
    p = tl.load(p_ptr + offs, mask=mask).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32) * scale
    m = tl.load(m_ptr + offs, mask=mask).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask).to(tl.float32)
    p = p * decay
    m = m + (1 - beta1) * (g - m)  # torch.lerp(m, g, 1 - beta1) for a weight below 0.5
    v = v * beta2 + (1 - beta2) * g * g
    if P_BF16:
        # the update lands in a bf16 weight (rounding error up to 2^-8 relative): fast sqrt and division (about
        # 2^-22 relative error) cannot move it measurably, and IEEE-rounded ones take most of the kernel's time
        denom = tl.sqrt(v) / bias_correction2_sqrt + eps
        p = p + step_size * (m / denom)
    else:  # an fp32 weight: torch's IEEE-rounded formulas
        denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
        p = p + step_size * tl.div_rn(m, denom)
    bits16 = tl.zeros_like(offs).to(tl.uint32)
    bits_m = bits16
    bits_v = bits16
    if STOCHASTIC:
        # one Philox call per element pair (its index in the tensor): its four 32-bit words give the pair's six
        # 16-bit draws (element 2i: p r0 low, m r0 high, v r1 low; element 2i+1: p r1 high, m r2 low, v r2 high)
        pairs = start // 2 + tl.arange(0, BLOCK // 2)
        r0, r1, r2, _ = tl.randint4x(seed, pairs, n_rounds=PHILOX_ROUNDS)
        bits16 = tl.interleave(r0 & 0xFFFF, r1 >> 16)
        bits_m = tl.interleave(r0 >> 16, r2 & 0xFFFF)
        bits_v = tl.interleave(r1 & 0xFFFF, r2 >> 16)
    _store(p_ptr, offs, mask, p, bits16, P_BF16, STOCHASTIC)
    _store(m_ptr, offs, mask, m, bits_m, M_BF16, STOCHASTIC)
    _store(v_ptr, offs, mask, v, bits_v, M_BF16, STOCHASTIC)


@triton.jit
def _adamw_kernel(table_ptr, floats_ptr, owner_ptr, skip_ptr, decay, beta1, beta2, eps, P_DTYPE: tl.constexpr,
                  G_DTYPE: tl.constexpr, M_DTYPE: tl.constexpr, STOCHASTIC: tl.constexpr, ALIGNED: tl.constexpr,
                  GUARDED: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    # the program's tensor and its row of the table: addresses of weight, gradient and moments, element count,
    # the tensor's first program, its Philox seed, its clip coefficient's address (0: none); two fp32 scalars
    t = tl.load(owner_ptr + tl.program_id(0))
    row = table_ptr + t * 8
    p_ptr = tl.load(row).to(tl.pointer_type(P_DTYPE))
    g_ptr = tl.load(row + 1).to(tl.pointer_type(G_DTYPE))
    m_ptr = tl.load(row + 2).to(tl.pointer_type(M_DTYPE))
    v_ptr = tl.load(row + 3).to(tl.pointer_type(M_DTYPE))
    if ALIGNED:  # every address a multiple of 16 bytes (the host checked): vector loads and stores
        p_ptr = tl.multiple_of(p_ptr, 16)
        g_ptr = tl.multiple_of(g_ptr, 16)
        m_ptr = tl.multiple_of(m_ptr, 16)
        v_ptr = tl.multiple_of(v_ptr, 16)
    n = tl.load(row + 4)
    first = tl.load(row + 5)
    seed = tl.load(row + 6)
    scale_addr = tl.load(row + 7)
    step_size = tl.load(floats_ptr + t * 2)
    bias_correction2_sqrt = tl.load(floats_ptr + t * 2 + 1)
    scale = 1.0
    if scale_addr != 0:  # gradient clipping's coefficient, a 0-dim fp32 tensor on the device (no host sync)
        scale = tl.load(scale_addr.to(tl.pointer_type(tl.float32)))
    lo = (tl.program_id(0) - first).to(tl.int64) * CHUNK
    hi = tl.minimum(n, lo + CHUNK)
    if GUARDED:  # a step skipped on the device (a non-finite loss or norm): no block to update
        hi = tl.where(tl.load(skip_ptr) != 0, lo, hi)
    for start in range(lo, hi, BLOCK):
        if start + BLOCK <= n:
            _adamw_block(p_ptr, g_ptr, m_ptr, v_ptr, start, n, scale, decay, beta1, beta2, eps, step_size,
                         bias_correction2_sqrt, seed, P_DTYPE == tl.bfloat16, M_DTYPE == tl.bfloat16, STOCHASTIC,
                         False, BLOCK)
        else:  # the tensor's last, partial block
            _adamw_block(p_ptr, g_ptr, m_ptr, v_ptr, start, n, scale, decay, beta1, beta2, eps, step_size,
                         bias_correction2_sqrt, seed, P_DTYPE == tl.bfloat16, M_DTYPE == tl.bfloat16, STOCHASTIC,
                         True, BLOCK)


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@dataclass
class AdamWTensor:
    """One tensor's update: contiguous CUDA weight, gradient and moments (both moments one dtype), its bias
    corrections as torch's foreach AdamW computes them (`step_size` = -lr / (1 - beta1^step)), its Philox seed and
    the clip coefficient its gradient is multiplied by in fp32 first (a 0-dim tensor on the device, or None)."""
    param: torch.Tensor
    grad: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step_size: float
    bias_correction2_sqrt: float
    seed: int
    grad_scale: torch.Tensor | None = None


class FusedAdamW:
    """Launches `_adamw_kernel` over a parameter group's tensors, one launch per dtype combination. A launch's
    program-to-tensor map depends only on the tensors' sizes: the last one made for each kind of launch stays on the
    device for the next step."""

    def __init__(self):
        self._owners: dict[tuple, tuple[tuple[int, ...], torch.Tensor, list[int]]] = {}

    def update_(self, items: list[AdamWTensor], *, lr: float, beta1: float, beta2: float, eps: float,
                weight_decay: float, stochastic_rounding: bool, skip_if: torch.Tensor | None = None) -> None:
        """AdamW on every item in place (parameters fp32 or bf16, moments fp32 or bf16, gradients any float
        dtype); the gradients are not written. `skip_if`: a 1-element tensor on the device; nonzero, the kernels
        change nothing (read by the GPU: the host does not wait for it)."""
        launches: dict[tuple, list[AdamWTensor]] = {}
        for item in items:
            if item.param.numel():
                tensors = (item.param, item.grad, item.exp_avg, item.exp_avg_sq)
                # a gradient can be a view at any element of a flat buffer (FSDP2's reduce-scatter output): such
                # tensors go in a launch of their own, without the vector accesses
                aligned = all(t.data_ptr() % 16 == 0 for t in tensors)
                key = (item.param.dtype, item.grad.dtype, item.exp_avg.dtype, item.param.device, aligned)
                launches.setdefault(key, []).append(item)
        for key, batch in launches.items():
            p_dtype, g_dtype, m_dtype, device, aligned = key
            # an fp32 weight's IEEE sqrt and division: fewer elements a thread (4, not 16) and more warps hide
            # their latency
            block, warps = (BLOCK, 4) if p_dtype == torch.bfloat16 else (BLOCK // 2, 8)
            chunk = block * CHUNK_BLOCKS
            owner, firsts = self._owner(key, tuple(it.param.numel() for it in batch), chunk, device)
            scales = [None if it.grad_scale is None else it.grad_scale.float() for it in batch]
            ints, floats = [], []
            for it, first, scale in zip(batch, firsts, scales):
                ints += [it.param.data_ptr(), it.grad.data_ptr(), it.exp_avg.data_ptr(), it.exp_avg_sq.data_ptr(),
                         it.param.numel(), first, it.seed % 2**31, 0 if scale is None else scale.data_ptr()]
                floats += [it.step_size, it.bias_correction2_sqrt]
            table = torch.cat([torch.tensor(ints, dtype=torch.int64).view(torch.uint8),
                               torch.tensor(floats, dtype=torch.float32).view(torch.uint8)])
            table = copy_to_device(table, device)
            _adamw_kernel[(owner.numel(),)](
                table[:len(ints) * 8].view(torch.int64), table[len(ints) * 8:].view(torch.float32), owner,
                owner if skip_if is None else skip_if.to(device, torch.int32),  # unguarded: any pointer, unread
                1 - lr * weight_decay, beta1, beta2, eps, P_DTYPE=_TL_DTYPES[p_dtype], G_DTYPE=_TL_DTYPES[g_dtype],
                M_DTYPE=_TL_DTYPES[m_dtype], STOCHASTIC=stochastic_rounding, ALIGNED=aligned,
                GUARDED=skip_if is not None, BLOCK=block, CHUNK=chunk, num_warps=warps)

    def _owner(self, key: tuple, numels: tuple[int, ...], chunk: int, device: torch.device
               ) -> tuple[torch.Tensor, list[int]]:
        """The tensor index of each program (int32, on the device) and each tensor's first program."""
        kept = self._owners.get(key)
        if kept is None or kept[0] != numels:
            counts = [triton.cdiv(n, chunk) for n in numels]
            firsts = [0]
            for c in counts[:-1]:
                firsts.append(firsts[-1] + c)
            owner = torch.repeat_interleave(torch.arange(len(counts), dtype=torch.int32), torch.tensor(counts))
            self._owners[key] = kept = (numels, copy_to_device(owner, device), firsts)
        return kept[1], kept[2]
