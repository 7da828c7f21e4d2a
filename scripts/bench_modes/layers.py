"""One 27B-shaped Qwen3.5 layer of each kind on a GPU: kernel agreement and forward+backward time.

    python scripts/bench.py layers [--seq 4096] [--json out.json]

1. Agreement: the fla GatedDeltaNet path in bf16 against the torch path in fp32 (the reference), same
   weights and input, on a packed row of 3 documents: relative error ||a - b|| / ||b|| of the layer output,
   the input gradient and every parameter gradient.
2. Time: forward + backward of one decoder layer (mixer + MLP) in bf16, median of CUDA-event timings, for
   GDN with fla and with torch kernels and for gated full attention; unpacked and packed.
"""

import argparse
import json

import torch

from qwenft.models.loader import build_model, init_random_weights
from qwenft.models.qwen3_5.configs import FULL_ATTENTION, named_config


def layer_model(cfg, layer_id: int, kernels: str, dtype: torch.dtype):
    model = build_model(cfg, kernels=kernels, layer_ids=[layer_id], embed=False, head=False)
    init_random_weights(model, seed=0, device="cuda", dtype=dtype)
    return model


def fwd_bwd(model, x, cu_seqlens):
    x = x.detach().requires_grad_(True)
    for p in model.parameters():
        p.grad = None
    out = model(hidden_states=x, cu_seqlens=cu_seqlens)
    out.float().pow(2).mean().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in model.named_parameters()}


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def agreement(cfg, seq: int) -> dict:
    gdn_layer = cfg.text.layer_types.index("linear_attention")
    fast = layer_model(cfg, gdn_layer, "fla", torch.bfloat16)
    ref = layer_model(cfg, gdn_layer, "torch", torch.float32)
    x = torch.randn(1, seq, cfg.text.hidden_size, device="cuda")
    cu = torch.tensor([0, seq // 4, (2 * seq) // 3, seq], dtype=torch.int32, device="cuda")
    report = {}
    for name, cu_seqlens in (("unpacked", None), ("packed_3_docs", cu)):
        out_f, dx_f, g_f = fwd_bwd(fast, x.bfloat16(), cu_seqlens)
        out_r, dx_r, g_r = fwd_bwd(ref, x, cu_seqlens)
        grads = {n: rel(g_f[n], g_r[n]) for n in g_r}
        report[name] = {"output": rel(out_f, out_r), "input_grad": rel(dx_f, dx_r),
                        "max_param_grad": max(grads.values()), "param_grads": grads}
    return report


def time_ms(fn, warmup: int = 3, iters: int = 10) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def layer_flops(cfg, layer_type: str, seq: int) -> float:
    """Matmul FLOPs of forward+backward (6 per parameter per token) plus the mixer's sequence term."""
    t = cfg.text
    mlp = 3 * t.hidden_size * t.intermediate_size
    if layer_type == FULL_ATTENTION:
        q, kv = t.num_attention_heads * t.head_dim, t.num_key_value_heads * t.head_dim
        mixer = t.hidden_size * (2 * q + 2 * kv) + q * t.hidden_size
        # causal QK^T and PV: 2 matmuls x 2 FLOPs x T^2/2 x heads x head_dim, x3 for fwd+bwd
        seq_term = 3 * 2 * 2 * (seq * seq / 2) * t.num_attention_heads * t.head_dim
    else:
        kd, vd = t.linear_num_key_heads * t.linear_key_head_dim, t.linear_num_value_heads * t.linear_value_head_dim
        mixer = t.hidden_size * (2 * kd + 2 * vd + 2 * t.linear_num_value_heads) + vd * t.hidden_size
        # chunked delta rule, chunk 64: per value head ~ 4 matmuls of (64 x d x d) per chunk + intra-chunk terms
        chunk = 64
        per_head = seq * (4 * t.linear_key_head_dim * t.linear_value_head_dim + 2 * chunk * t.linear_key_head_dim
                          + 2 * chunk * t.linear_value_head_dim)
        seq_term = 3 * 2 * per_head * t.linear_num_value_heads
    return 6 * (mlp + mixer) * seq + seq_term


def timings(cfg, seq: int) -> dict:
    x = torch.randn(1, seq, cfg.text.hidden_size, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, seq // 4, (2 * seq) // 3, seq], dtype=torch.int32, device="cuda")
    gdn_layer = cfg.text.layer_types.index("linear_attention")
    attn_layer = cfg.text.layer_types.index(FULL_ATTENTION)
    report = {}
    for name, layer_id, kernels in (("gdn_fla", gdn_layer, "fla"), ("gdn_torch", gdn_layer, "torch"),
                                    ("attention_sdpa", attn_layer, "torch")):
        model = layer_model(cfg, layer_id, kernels, torch.bfloat16)
        flops = layer_flops(cfg, cfg.text.layer_types[layer_id], seq)
        for packing, cu_seqlens in (("unpacked", None), ("packed_3_docs", cu)):
            ms = time_ms(lambda: fwd_bwd(model, x, cu_seqlens))
            report[f"{name}/{packing}"] = {"fwd_bwd_ms": ms, "tflops": flops / ms / 1e9}
        model = None  # freed before the next layer is built
        torch.cuda.empty_cache()
    return report


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="bench.py layers", description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    cfg = named_config("27b")
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "seq": args.seq}
    try:
        import fla

        result["fla"] = fla.__version__
    except ImportError:
        result["fla"] = None
    result["agreement_fla_bf16_vs_torch_fp32"] = agreement(cfg, args.seq)
    result["fwd_bwd_one_layer"] = timings(cfg, args.seq)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    for packing, r in result["agreement_fla_bf16_vs_torch_fp32"].items():
        print(f"agreement {packing:14s} output {r['output']:.2e}  input grad {r['input_grad']:.2e}  "
              f"max param grad {r['max_param_grad']:.2e}")
    for name, r in result["fwd_bwd_one_layer"].items():
        print(f"{name:30s} {r['fwd_bwd_ms']:8.2f} ms  {r['tflops']:6.1f} TFLOP/s")

