"""One Triton kernel for `LowPrecisionAdamW`'s whole update of one tensor, on CUDA.

The foreach path upcasts parameter, gradient and moments to fp32 copies, runs about ten passes over them and
rounds each bf16 result back with a separate random-bits tensor: some 170 bytes of memory traffic per
parameter. This kernel reads each element once and writes it once (14 bytes per parameter for bf16 weights,
gradients and moments), computing the same formulas in fp32 registers (for a bf16 weight with fast sqrt and
division, whose error is far below the weight's rounding), and draws the stochastic-rounding bits from Philox
keyed by (seed, index of the element pair): deterministic for a seed, so replicas round alike and a resumed run
rounds as the original did. Its random bits differ from the foreach path's (torch's generator), so the two agree
exactly only with rounding to nearest.
"""

import torch
import triton
import triton.language as tl

BLOCK = 2048
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
def _adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, scale_ptr, n, decay, beta1, beta2, eps, step_size,
                  bias_correction2_sqrt, seed, P_BF16: tl.constexpr, M_BF16: tl.constexpr, STOCHASTIC: tl.constexpr,
                  SCALED: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(p_ptr + offs, mask=mask).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
    if SCALED:  # gradient clipping's coefficient, a 0-dim fp32 tensor on the device (no host sync)
        g = g * tl.load(scale_ptr)
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
        # one Philox call per element pair: its four 32-bit words give the pair's six 16-bit draws
        # (element 2i: p r0 low, m r0 high, v r1 low; element 2i+1: p r1 high, m r2 low, v r2 high)
        pairs = tl.program_id(0).to(tl.int64) * (BLOCK // 2) + tl.arange(0, BLOCK // 2)
        r0, r1, r2, _ = tl.randint4x(seed, pairs, n_rounds=PHILOX_ROUNDS)
        bits16 = tl.interleave(r0 & 0xFFFF, r1 >> 16)
        bits_m = tl.interleave(r0 >> 16, r2 & 0xFFFF)
        bits_v = tl.interleave(r1 & 0xFFFF, r2 >> 16)
    _store(p_ptr, offs, mask, p, bits16, P_BF16, STOCHASTIC)
    _store(m_ptr, offs, mask, m, bits_m, M_BF16, STOCHASTIC)
    _store(v_ptr, offs, mask, v, bits_v, M_BF16, STOCHASTIC)


def adamw_update_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                  lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step_size: float,
                  bias_correction2_sqrt: float, seed: int, stochastic_rounding: bool,
                  grad_scale: torch.Tensor | None = None) -> None:
    """AdamW on one contiguous CUDA tensor, in place: parameters fp32 or bf16, moments fp32 or bf16 (both
    moments one dtype), the gradient any float dtype. `step_size` is -lr / (1 - beta1^step) as torch's
    foreach AdamW computes it. `grad_scale`: a 0-dim tensor on the device the gradient is multiplied by in fp32
    first (gradient clipping's coefficient); `grad` itself is not written."""
    n = param.numel()
    if n == 0:
        return
    scale = grad if grad_scale is None else grad_scale.float()  # any pointer when unscaled: never read then
    p_bf16 = param.dtype == torch.bfloat16
    # an fp32 weight's IEEE sqrt and division: fewer elements a thread (4, not 16) and more warps hide their latency
    block, warps = (BLOCK, 4) if p_bf16 else (BLOCK // 2, 8)
    _adamw_kernel[(triton.cdiv(n, block),)](
        param, grad, exp_avg, exp_avg_sq, scale, n, 1 - lr * weight_decay, beta1, beta2, eps, step_size,
        bias_correction2_sqrt, seed % 2**31, P_BF16=p_bf16, M_BF16=exp_avg.dtype == torch.bfloat16,
        STOCHASTIC=stochastic_rounding, SCALED=grad_scale is not None, BLOCK=block, num_warps=warps)
