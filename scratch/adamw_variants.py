# Where the fused AdamW's time goes: the working tree's kernel body with knobs (Philox on/off, IEEE sqrt/div or
# fast, block size, warps), bf16 p/g/m/v over ~1e9 parameters, CUDA events, medians of 5.
import torch, triton, triton.language as tl
from qwenft.train.adamw_kernel import _round_to_bf16, PHILOX_ROUNDS

@triton.jit
def k(p_ptr, g_ptr, m_ptr, v_ptr, n, decay, beta1, beta2, eps, step_size, bc2, seed,
      STOCH: tl.constexpr, PRECISE: tl.constexpr, ROUNDS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(p_ptr + offs, mask=mask).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask).to(tl.float32)
    p = p * decay
    m = m + (1 - beta1) * (g - m)
    v = v * beta2 + (1 - beta2) * g * g
    if PRECISE:
        denom = tl.div_rn(tl.sqrt_rn(v), bc2) + eps
        p = p + step_size * tl.div_rn(m, denom)
    else:
        denom = tl.sqrt(v) / bc2 + eps
        p = p + step_size * (m / denom)
    b0 = tl.zeros_like(offs).to(tl.uint32)
    b1 = b0
    b2 = b0
    if STOCH:
        pairs = tl.program_id(0).to(tl.int64) * (BLOCK // 2) + tl.arange(0, BLOCK // 2)
        r0, r1, r2, _ = tl.randint4x(seed, pairs, n_rounds=ROUNDS)
        b0 = tl.interleave(r0 & 0xFFFF, r1 >> 16)
        b1 = tl.interleave(r0 >> 16, r2 & 0xFFFF)
        b2 = tl.interleave(r1 & 0xFFFF, r2 >> 16)
    tl.store(p_ptr + offs, _round_to_bf16(p, b0, STOCH), mask=mask)
    tl.store(m_ptr + offs, _round_to_bf16(m, b1, STOCH), mask=mask)
    tl.store(v_ptr + offs, _round_to_bf16(v, b2, STOCH), mask=mask)

@triton.jit
def copy4(p_ptr, g_ptr, m_ptr, v_ptr, n, BLOCK: tl.constexpr):  # the memory traffic alone: 3 reads+writes, 1 read
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(p_ptr + offs, mask=mask)
    g = tl.load(g_ptr + offs, mask=mask)
    m = tl.load(m_ptr + offs, mask=mask)
    v = tl.load(v_ptr + offs, mask=mask)
    tl.store(p_ptr + offs, p + g, mask=mask)
    tl.store(m_ptr + offs, m + g, mask=mask)
    tl.store(v_ptr + offs, v + g, mask=mask)

shapes = [(5120, 17408), (17408, 5120), (5120, 5120)] * 3
gen = torch.Generator(device="cuda").manual_seed(0)
ts = [[torch.randn(s, device="cuda", generator=gen).mul_(0.02).bfloat16() for _ in range(4)] for s in shapes]
N = sum(t[0].numel() for t in ts)

def timed(fn):
    fn(); fn()
    out = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); torch.cuda.synchronize()
        out.append(a.elapsed_time(b) * 1e9 / N)
    return sorted(out)[2]

def variant(stoch, precise, rounds, block, warps):
    def fn():
        for p, g, m, v in ts:
            n = p.numel()
            k[(triton.cdiv(n, block),)](p, g, m, v, n, 1 - 1e-6, 0.9, 0.95, 1e-8, -1e-5, 0.5, 3, STOCH=stoch,
                                        PRECISE=precise, ROUNDS=rounds, BLOCK=block, num_warps=warps)
    return fn

def copy(block, warps):
    def fn():
        for p, g, m, v in ts:
            copy4[(triton.cdiv(p.numel(), block),)](p, g, m, v, p.numel(), BLOCK=block, num_warps=warps)
    return fn

print(f"VAR memory only (block 2048, 4 warps): {timed(copy(2048, 4)):.3f} ms/1e9;  block 4096/8: {timed(copy(4096, 8)):.3f}")
for stoch, precise, rounds, block, warps in [(True, True, 7, 2048, 4), (False, True, 7, 2048, 4), (True, False, 7, 2048, 4),
                                             (False, False, 7, 2048, 4), (True, True, 10, 2048, 4), (True, True, 7, 1024, 4),
                                             (True, True, 7, 4096, 8), (True, True, 7, 2048, 8), (True, True, 7, 1024, 8)]:
    ms = timed(variant(stoch, precise, rounds, block, warps))
    print(f"VAR stoch={stoch} precise={precise} rounds={rounds} block={block} warps={warps}: {ms:.3f} ms/1e9")
