"""One-off: the 27B-cut step's matmuls by shape at 4,096 tokens (forward, dX, dW += dY^T X), tp1 and one rank of tp2 and tp4, cuBLAS and cuBLASLt, and the input projections merged (one-off check: python scratch/matmul_shapes.py)."""
import json
import sys

import torch

M, H = 4096, 5120
dev = "cuda"
# (name, N, K, calls per step): 8 microbatches x (6 GDN, 2 attention, 8 MLP layers) + head
SEP = [
    ("gdn_q", 2048, H, 48), ("gdn_k", 2048, H, 48), ("gdn_v", 6144, H, 48), ("gdn_z", 6144, H, 48),
    ("gdn_a", 48, H, 48), ("gdn_b", 48, H, 48), ("gdn_out", H, 6144, 48),
    ("att_q", 12288, H, 16), ("att_k", 1024, H, 16), ("att_v", 1024, H, 16), ("att_o", H, 6144, 16),
    ("mlp_gate", 17408, H, 64), ("mlp_up", 17408, H, 64), ("mlp_down", H, 17408, 64),
    ("head", 248320, H, 8),
]
SMALL_MERGED = [  # only the small projections folded into a neighbour: GDN z|a|b, attention q|k|v
    ("gdn_q", 2048, H, 48), ("gdn_k", 2048, H, 48), ("gdn_v", 6144, H, 48), ("gdn_zab", 6240, H, 48), ("gdn_out", H, 6144, 48),
    ("att_qkv", 14336, H, 16), ("att_o", H, 6144, 16),
    ("mlp_gate", 17408, H, 64), ("mlp_up", 17408, H, 64), ("mlp_down", H, 17408, 64),
    ("head", 248320, H, 8),
]
MERGED = [
    ("gdn_qkvzab", 16480, H, 48), ("gdn_out", H, 6144, 48),
    ("att_qkv", 14336, H, 16), ("att_o", H, 6144, 16),
    ("mlp_gateup", 34816, H, 64), ("mlp_down", H, 17408, 64),
    ("head", 248320, H, 8),
]


def timed(fn, reps):
    for _ in range(3):
        fn()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    s.record()
    for _ in range(reps):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / reps


def shape_ms(N, K):
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.01
    dy = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
    g = torch.zeros(N, K, device=dev, dtype=torch.bfloat16)
    reps = max(3, min(50, int(2e12 / (2 * M * N * K))))
    f = timed(lambda: x @ w.t(), reps)
    dx = timed(lambda: dy @ w, reps)
    dw = timed(lambda: g.addmm_(dy.t(), x), reps)
    return f, dx, dw


def table(shapes):
    rows, total = [], 0.0
    for name, N, K, calls in shapes:
        f, dx, dw = shape_ms(N, K)
        tf = 2 * M * N * K / 1e9
        rows.append(dict(name=name, N=N, K=K, fwd_ms=f, dx_ms=dx, dw_ms=dw,
                         tflops=[round(tf / t, 1) for t in (f, dx, dw)], step_ms=(f + dx + dw) * calls))
        total += (f + dx + dw) * calls
    return rows, total


ROW = {"gdn_out", "att_o", "mlp_down"}  # row-parallel: K sharded; the rest column-parallel: N sharded


def at_tp(shapes, tp):
    return [(n, N, K // tp, c) if n in ROW else (n, max(N // tp, 1), K, c) for n, N, K, c in shapes]



out = {}
for rep in range(2):
    for tp in (1, 4):
        for kind, shapes in (("separate", SEP), ("small_merged", SMALL_MERGED), ("merged", MERGED)):
            rows, total = table(at_tp(shapes, tp))
            out[f"{kind}/tp{tp}/rep{rep}"] = total
            print(f"== {kind}, one rank of tp{tp} (rep {rep}): {total:.1f} ms a step")
            for r in rows:
                print(f"  {r['name']:12s} N={r['N']:6d} K={r['K']:5d} fwd {r['fwd_ms']:.3f} dx {r['dx_ms']:.3f} "
                      f"dw {r['dw_ms']:.3f} ms  TFLOP/s {r['tflops']}  step {r['step_ms']:.1f} ms", flush=True)
print(json.dumps(out))
