"""A Qwen3.5-MoE training step (forward + backward, no optimizer) on one GPU: qwenft's native model against
transformers' Qwen3_5MoeForCausalLM on the same weights, one after the other in this process.

    python scripts/bench.py moe [--model 35b_a3b] [--layers 4] [--seq 4096] [--steps 6] [--warmup 2] [--json out.json]

Both run bf16 with their defaults on CUDA: qwenft with `model.kernels.*=auto` (fla's GatedDeltaNet, varlen
flash attention, `torch._grouped_mm` experts, the fused linear cross-entropy), transformers with its own
defaults (fla's kernels when installed, SDPA, its grouped-mm experts). The loss is the same for both: token-mean
cross-entropy plus router_aux_loss_coef x transformers' load-balancing loss. Reported per model: median step
time, tokens/s, TFLOP/s on the active parameters (qwenft.train.metrics.flops_per_token: the routed top-k
experts and the shared expert, not all experts) and peak memory; and the two losses of the first step, which
must agree within bf16 rounding (same weights, same batch).
"""

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch

from qwenft.constants import IGNORE_INDEX
from qwenft.models.loader import build_model, init_random_weights
from qwenft.models.qwen3_5 import adapter
from qwenft.models.qwen3_5.configs import named_config, to_hf_config
from qwenft.models.qwen3_5.moe import load_balancing_loss
from qwenft.train.metrics import flops_per_token


def timed(step, steps: int, warmup: int) -> tuple[list[float], float, float]:
    """Run `step` `steps` times: (seconds of the steps after the warm-up, first step's loss, peak GiB)."""
    torch.cuda.reset_peak_memory_stats()
    times, first = [], None
    for i in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = step()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
        first = loss if first is None else first
    return times, first, torch.cuda.max_memory_allocated() / 2**30


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="bench.py moe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="35b_a3b")
    parser.add_argument("--layers", type=int, default=4, help="keep the first N decoder layers")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args(argv)

    cfg = named_config(args.model)
    t = cfg.text
    cfg.text = t = dataclasses.replace(t, num_hidden_layers=args.layers, layer_types=t.layer_types[:args.layers])
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, t.vocab_size, (1, args.seq), generator=gen).cuda()
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], IGNORE_INDEX)], dim=1)
    count = int((labels != IGNORE_INDEX).sum())
    coef = t.router_aux_loss_coef

    native = init_random_weights(build_model(cfg, ce_kernel="fused"), seed=0, device="cuda", dtype=torch.bfloat16)
    cu_seqlens = torch.tensor([0, args.seq], dtype=torch.int32, device="cuda")

    def native_step():
        ce_sum = native(input_ids=ids, cu_seqlens=cu_seqlens, labels=labels)
        loss = ce_sum / count + coef * load_balancing_loss(list(native.router_stats().values()))
        loss.backward()
        native.zero_grad(set_to_none=True)
        return loss.item()

    results = {"model": args.model, "layers": args.layers, "seq": args.seq, "gpu": torch.cuda.get_device_name(),
               "torch": torch.__version__, "params_b": sum(p.numel() for p in native.parameters()) / 1e9}
    flops = flops_per_token(t, args.seq) * args.seq

    def measure(name, step):
        times, first_loss, peak = timed(step, args.steps, args.warmup)
        step_s = statistics.median(times)
        results[name] = {"step_time_s": step_s, "tokens_per_sec": args.seq / step_s,
                         "tflops_active": flops / step_s / 1e12, "peak_memory_gib": round(peak, 2),
                         "first_loss": first_loss}
        print(name, json.dumps(results[name]), flush=True)

    measure("qwenft", native_step)
    try:
        import transformers
        from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM
    except ImportError as e:
        results["transformers"] = f"not run: {e}"
    else:
        results["transformers_version"] = transformers.__version__
        native_sd = {k: v.detach().cpu() for k, v in native.state_dict().items()}
        native = None  # one model on the GPU at a time: each peak is its own
        torch.cuda.empty_cache()
        with torch.device("cuda"):
            hf = Qwen3_5MoeForCausalLM(to_hf_config(cfg)).to(torch.bfloat16).train()
        missing, unexpected = hf.load_state_dict(
            adapter.to_hf_state_dict(native_sd, t, adapter.CAUSAL_LM_PREFIX, tied=cfg.tie_word_embeddings),
            strict=False)
        if unexpected or [k for k in missing if "rotary" not in k]:
            raise RuntimeError(f"transformers' model: missing {missing[:5]}, unexpected {unexpected[:5]}")

        def hf_step():
            out = hf(input_ids=ids, labels=ids, output_router_logits=True)  # transformers shifts the labels itself
            out.loss.backward()
            hf.zero_grad(set_to_none=True)
            return out.loss.item()

        measure("transformers", hf_step)
    if "qwenft" in results and isinstance(results.get("transformers"), dict):
        results["speedup"] = results["transformers"]["step_time_s"] / results["qwenft"]["step_time_s"]
    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))

