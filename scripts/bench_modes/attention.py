"""Causal attention at head_dim 256 (Qwen3.5-27B's 24 query heads, 4 KV heads) through each of torch's kernels
on one GPU: forward and forward + backward time and TFLOP/s (the backward counted as 2.5 forwards), bf16.

    python scripts/bench.py attention [--json out.json]

The kernels: qwenft's varlen flash path (`attention.flash_varlen`, FlashAttention 2), SDPA restricted to its
flash and cuDNN backends (GQA, and key/value heads expanded), and compiled flex_attention; a kernel that refuses
a shape gets an `error` entry instead of times. Results: docs/performance.md ("Attention by halves against
contiguous spans")."""
import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from qwenft.models.qwen3_5.attention import flash_varlen as qwenft_flash_varlen

H, HKV, D = 24, 4, 256
dev = "cuda"


def timed(fn, iters=5):
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / iters / 1e3


def case(name, tq, tk, causal, fn_factory) -> dict:
    q = torch.randn(tq, H, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(tk, HKV, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(tk, HKV, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    # query-key pairs computed; causal: the queries are the keys' last tq (bottom-right aligned)
    pairs = tq * (tk - tq) + tq * (tq + 1) // 2 if causal else tq * tk
    flops_f = 4 * pairs * H * D
    try:
        fn = fn_factory(q, k, v, causal)
        out = fn()
        g = torch.randn_like(out)
        tf = timed(fn)
        tfb = timed(lambda: torch.autograd.grad(fn(), (q, k, v), g))
        r = dict(kernel=name, tq=tq, tk=tk, causal=causal, fwd_ms=tf * 1e3, fwd_bwd_ms=tfb * 1e3,
                 fwd_tflops=flops_f / tf / 1e12, fwd_bwd_tflops=3.5 * flops_f / tfb / 1e12)
    except Exception as exc:  # noqa: BLE001
        r = dict(kernel=name, tq=tq, tk=tk, causal=causal, error=f"{type(exc).__name__}: {str(exc)[:200]}")
    print(json.dumps(r), flush=True)
    return r


def flash_varlen(q, k, v, causal):
    cq = torch.tensor([0, q.shape[0]], device=dev, dtype=torch.int32)
    ck = torch.tensor([0, k.shape[0]], device=dev, dtype=torch.int32)
    if not causal:
        raise ValueError("qwenft's varlen path is causal only")
    return lambda: qwenft_flash_varlen(q, k, v, D**-0.5, cq, ck, q.shape[0], k.shape[0])


def sdpa(backend, gqa=True):
    def make(q, k, v, causal):
        def fn():
            qq, kk, vv = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            if not gqa:
                kk, vv = (t.repeat_interleave(H // HKV, dim=1) for t in (kk, vv))
            with sdpa_kernel(backend):
                if causal and q.shape[0] != k.shape[0]:
                    from torch.nn.attention.bias import causal_lower_right
                    mask = causal_lower_right(q.shape[0], k.shape[0])
                    return F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, enable_gqa=gqa)
                return F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal, enable_gqa=gqa)
        return fn
    return make


def flex(q, k, v, causal):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    off = k.shape[0] - q.shape[0]
    mask = create_block_mask(lambda b, h, qi, ki: qi + off >= ki, 1, 1, q.shape[0], k.shape[0], device=dev) \
        if causal else None
    compiled = torch.compile(flex_attention)
    return lambda: compiled(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)), block_mask=mask, enable_gqa=True)


SHAPES = [(32768, 32768, True), (16384, 16384, True), (16384, 65536, False), (8192, 8192, True)]
KERNELS = [("flash_varlen", flash_varlen), ("sdpa_cudnn_gqa", sdpa(SDPBackend.CUDNN_ATTENTION)),
           ("sdpa_cudnn_expanded", sdpa(SDPBackend.CUDNN_ATTENTION, gqa=False)),
           ("sdpa_flash", sdpa(SDPBackend.FLASH_ATTENTION)), ("flex", flex)]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="bench.py attention", description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    print(torch.__version__, torch.backends.cudnn.version(), torch.cuda.get_device_name(), flush=True)
    results = [case(name, tq, tk, causal, make) for tq, tk, causal in SHAPES for name, make in KERNELS]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
