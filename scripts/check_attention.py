"""Packed (varlen) full attention on CUDA: torch's flash varlen kernel against SDPA with the dense block mask.

    python scripts/check_attention.py [--seq 4096] [--docs 60]

One 27B-shaped gated attention layer (24 q / 4 kv heads of dim 256, hidden 5120), bf16, random weights and
input, `--docs` documents of random lengths packed into one row. Prints the relative difference of the
output and of every gradient, and the forward+backward time of each kernel (median of 10 after 3 warm-ups).
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from qwenft.models.qwen3_5.attention import GatedAttention, RotaryEmbedding  # noqa: E402
from qwenft.models.qwen3_5.configs import named_config  # noqa: E402
from qwenft.models.qwen3_5.gdn import positions_in_document  # noqa: E402


def fwd_bwd(layer, x, rope, cu_seqlens, grad_out):
    x = x.detach().requires_grad_()
    layer.zero_grad(set_to_none=True)
    out = layer(x, rope, cu_seqlens)
    out.backward(grad_out)
    return out.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--docs", type=int, default=60)
    args = parser.parse_args()
    cfg = named_config("27b").text
    torch.manual_seed(0)
    layer = GatedAttention(cfg).cuda().to(torch.bfloat16)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
    rotary = RotaryEmbedding(cfg).cuda()
    cuts = torch.randperm(args.seq - 1)[: args.docs - 1].add(1).sort().values
    cu_seqlens = torch.cat([torch.tensor([0]), cuts, torch.tensor([args.seq])]).to(torch.int32).cuda()
    rope = rotary(positions_in_document(cu_seqlens, args.seq).view(1, -1), torch.bfloat16)
    x = torch.randn(1, args.seq, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    grad_out = torch.randn_like(x)
    results, report = {}, {"seq": args.seq, "docs": args.docs}
    for kernel in ("sdpa", "flash_varlen"):
        layer.kernel = kernel
        results[kernel] = fwd_bwd(layer, x, rope, cu_seqlens, grad_out)
        times = []
        for i in range(13):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fwd_bwd(layer, x, rope, cu_seqlens, grad_out)
            end.record()
            torch.cuda.synchronize()
            if i >= 3:
                times.append(start.elapsed_time(end))
        report[f"{kernel}_fwd_bwd_ms"] = statistics.median(times)
    (o1, dx1, g1), (o2, dx2, g2) = results["sdpa"], results["flash_varlen"]
    report["output_rel"] = rel(o2, o1)
    report["input_grad_rel"] = rel(dx2, dx1)
    report["worst_param_grad_rel"] = max((rel(g2[n], g1[n]), n) for n in g1)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
