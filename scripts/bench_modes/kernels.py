"""Time and check qwenft's own CUDA kernels against the torch paths they replace, at the 27B benchmark's sizes.

    python scripts/bench.py kernels [--json out.json] [--params 1.0e9] [--tokens 4096] [--parts adamw ce conv embed]
                                    [--channels 10240 [2560 ...]] [--doc-tokens 150]

- AdamW: `LowPrecisionAdamW` over bf16 weights, gradients and moments, foreach (torch ops) against fused (one
  Triton kernel pass): ms per step per billion parameters, and the two paths' results with rounding to nearest
  (max difference in bf16 ulps), plus the stochastic-rounding bias of the fused path. Then the fused step over
  the tensors of a tp4 rank of the 27B shape cut to 8 layers (each weight's first dim split 4 ways where it
  divides), where launches and not bytes set the time: one launch per tensor (each in a parameter group of its
  own) against one per group, the host's ms until `step()` returns and the step's ms between CUDA events.
- Cross-entropy of the lm_head (hidden 5120, vocabulary 248,320): torch (bf16 logits, fp32 CE, as
  `model.kernels.ce=torch`) against the fused linear CE (`model.kernels.ce=fused`) whole and chunked:
  forward + backward ms, memory above the inputs, and gradient errors against an fp32 computation.
- GatedDeltaNet's causal conv + SiLU over q|k|v (`--channels`: 10,240 at the 27B's whole layer, 2,560 a tp4 rank's;
  bf16): fla's `causal_conv1d` against qwenft's kernels (`conv_kernel.py`) at each launch tried, on `--tokens` tokens
  as one row and as a packed row of `--doc-tokens`-token documents: forward and forward + backward ms between CUDA
  events, the forward + backward's kernels alone (the profiler's GPU time), and each one's errors against the fp64
  torch conv.
- The embedding's backward into bf16 `.grad` (vocabulary 248,320, hidden 5120): `index_put_(accumulate=True)`
  (torch's path, which rounds after every repeat of a token) against qwenft's sort and `add_sorted_rows_` at each
  launch and tile size tried (and without tiles), on `--tokens` tokens drawn from the vocabulary's first 50,000
  ids, on the same tokens with their last three quarters one pad id (a run of one id as long as a microbatch's
  padding tail) and on a Zipf-like draw over 512 ids (the benchmark's tiny tokenizer: runs of hundreds of rows of
  one id): the kernels' GPU time and the largest error against the fp64 sum, in units of the result's bf16 step.
  Then rank 0 of a vocab-parallel tp4 world (`tp4_rank`): the tokens outside its rows put as spread ids with
  zeroed gradients, against ids of -1 that the kernel skips, and whether both give the same bits.
"""

import argparse
import json
import time

import torch
import torch.nn.functional as F

from bench_modes.layers import time_ms
from qwenft.models.ce_kernel import add_sorted_rows_
from qwenft.models.linear_ce import IGNORE_INDEX, fused_linear_ce_sum
from qwenft.models.qwen3_5.conv_kernel import causal_conv_silu
from qwenft.models.qwen3_5.gdn import causal_conv, positions_in_document
from qwenft.models.qwen3_5.varlen import varlen_info
from qwenft.train.optim import LowPrecisionAdamW


def bench_adamw(total_params: float) -> dict:
    shapes = [(5120, 17408), (17408, 5120), (5120, 5120), (5120,)]
    per_round = sum(torch.Size(s).numel() for s in shapes)
    rounds = max(1, round(total_params / per_round))
    gen = torch.Generator(device="cuda").manual_seed(0)

    def make():
        ps = [torch.nn.Parameter(torch.randn(s, device="cuda", generator=gen).mul_(0.02).bfloat16())
              for _ in range(rounds) for s in shapes]
        for p in ps:
            p.grad = torch.randn(p.shape, device="cuda", generator=gen).mul_(1e-3).bfloat16()
        return ps

    n = rounds * per_round
    out = {"params": n}
    hyper = dict(lr=1e-5, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, state_dtype=torch.bfloat16)
    for fused in (False, True):
        ps = make()
        opt = LowPrecisionAdamW(ps, fused=fused, **hyper)
        ms = time_ms(opt.step, warmup=2, iters=5)
        out[f"{'fused' if fused else 'foreach'}_ms_per_1e9_params"] = ms * 1e9 / n
        del ps, opt
        torch.cuda.empty_cache()
    # the two paths with rounding to nearest, a few steps from the same start
    small = [(513, 1031), (4097,)]
    results = []
    for fused in (False, True):
        g = torch.Generator(device="cuda").manual_seed(1)
        ps = [torch.nn.Parameter(torch.randn(s, device="cuda", generator=g).bfloat16()) for s in small]
        opt = LowPrecisionAdamW(ps, fused=fused, stochastic_rounding=False, **dict(hyper, lr=1e-2))
        for _ in range(3):
            for p in ps:
                p.grad = torch.randn(p.shape, device="cuda", generator=g).bfloat16()
            opt.step()
        results.append(ps)
    ulps = 0.0
    for a, b in zip(*results):
        ulp = torch.finfo(torch.bfloat16).eps * b.float().abs().clamp(min=1e-30)
        ulps = max(ulps, ((a.float() - b.float()).abs() / ulp).max().item())
    out["nearest_max_diff_bf16_ulps"] = ulps
    # stochastic rounding: a tiny update on 1.0, averaged over 2^20 elements, keeps its mean
    p = torch.nn.Parameter(torch.ones(1 << 20, device="cuda", dtype=torch.bfloat16))
    p.grad = torch.ones_like(p)
    opt = LowPrecisionAdamW([p], fused=True, lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                            state_dtype=torch.float32)
    opt.step()
    out["sr_mean_update"] = (1.0 - p.float().mean().item())
    out["sr_expected_update"] = 1e-4
    out["tp4_rank_8_layers"] = bench_adamw_launches(hyper)
    return out


def tp4_rank_shapes(layers: int = 8, tp: int = 4) -> list[torch.Size]:
    """The parameter shapes of the 27B shape's first `layers` decoder layers, each first dim split `tp` ways where it
    divides: a tensor parallel rank's count of tensors and about its sizes."""
    from qwenft.models.qwen3_5.configs import named_config
    from qwenft.models.qwen3_5.model import DecoderLayer

    text = named_config("27b").text
    with torch.device("meta"):
        params = [p for i in range(layers) for p in DecoderLayer(text, i, kernels="torch").parameters()]
    return [torch.Size((s[0] // tp if s[0] % tp == 0 else s[0], *s[1:])) for s in (p.shape for p in params)]


def bench_adamw_launches(hyper: dict, iters: int = 10) -> dict:
    shapes = tp4_rank_shapes()
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = {"tensors": len(shapes), "params": sum(s.numel() for s in shapes)}
    for label, grouped in (("per_tensor", False), ("per_group", True)):
        ps = [torch.nn.Parameter(torch.randn(s, device="cuda", generator=gen).mul_(0.02).bfloat16()) for s in shapes]
        for p in ps:
            p.grad = torch.randn(p.shape, device="cuda", generator=gen).mul_(1e-3).bfloat16()
        opt = LowPrecisionAdamW([{"params": ps}] if grouped else [{"params": [p]} for p in ps], fused=True, **hyper)
        opt.step()  # compiles, makes the moments
        torch.cuda.synchronize()
        host = []
        for _ in range(iters):
            start = time.perf_counter()
            opt.step()
            host.append((time.perf_counter() - start) * 1e3)
            torch.cuda.synchronize()
        out[label] = {"host_ms": sorted(host)[iters // 2], "step_ms": time_ms(opt.step, warmup=1, iters=iters)}
        del ps, opt
    return out


def bench_ce(tokens: int, hidden: int = 5120, vocab: int = 248320) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    h = (torch.randn(tokens, hidden, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(vocab, hidden, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), device="cuda", generator=g)
    labels[::7] = IGNORE_INDEX
    scale = 1.0 / tokens

    def torch_path():
        return F.cross_entropy((h @ w.t()).float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")

    ref_loss = F.cross_entropy(h.float() @ w.float().t(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
    ref_dh, ref_dw = torch.autograd.grad(ref_loss * scale, (h, w))
    ref_dh, ref_dw = ref_dh.float(), ref_dw.float()
    variants = {"torch": torch_path}
    for chunk in (0, 2048, 1024):
        variants[f"fused_chunk{chunk}"] = lambda chunk=chunk: fused_linear_ce_sum(h, w, labels, chunk)
    out = {"tokens": tokens, "vocab": vocab, "hidden": hidden}
    for name, fn in variants.items():
        def step():
            loss = fn() * scale
            dh, dw = torch.autograd.grad(loss, (h, w))
            return loss, dh, dw

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss, dh, dw = step()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        rel = lambda a, b: ((a.float() - b).norm() / b.norm()).item()  # noqa: E731
        out[name] = {"ms": time_ms(step), "peak_gib_above_inputs": peak,
                     "loss_rel_err": abs(loss.item() / scale - ref_loss.item()) / abs(ref_loss.item()),
                     "dh_rel_err": rel(dh, ref_dh), "dw_rel_err": rel(dw, ref_dw)}
        del loss, dh, dw
    # the backward scales bf16 gradients by the fp32 incoming gradient: it must round once, from fp32
    x = torch.randn(1 << 20, device="cuda").bfloat16()
    s = torch.tensor(1.0 / 3001, device="cuda")
    out["bf16_mul_fp32_scalar_exact"] = torch.equal(x.clone().mul_(s), (x.float() * s).bfloat16())
    return out


def kernels_ms(fn, iters: int = 10) -> float:
    """GPU time of the kernels one call of `fn` launches, ms (torch.profiler's device time): without the host's
    launch time, which the timing between CUDA events includes where the host is slower than the kernels."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()
               if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)) / 1e3 / iters


def bench_conv(tokens: int, channels: int = 10240, doc_tokens: int = 150) -> dict:
    from fla.modules.convolution import causal_conv1d

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, tokens, channels, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(channels, 4, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_()
    probe = torch.randn(1, tokens, channels, device="cuda", generator=g).bfloat16()
    # a packed row: documents of `doc_tokens` (150: three blocks each, the last one partial) and a shorter last one
    offsets = list(range(0, tokens, doc_tokens)) + [tokens]
    cu = torch.tensor(offsets, dtype=torch.long, device="cuda")
    out = {"tokens": tokens, "channels": channels, "packed_offsets": offsets}
    rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()  # noqa: E731
    for layout, cu_seqlens in (("row", None), ("packed", cu)):
        pos = None if cu_seqlens is None else positions_in_document(cu_seqlens, tokens)
        xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
        ref_y = causal_conv(xr, wr[:, None], pos)
        ref_dx, ref_dw = torch.autograd.grad((ref_y * probe.double()).sum(), (xr, wr))
        # the chunk indices made once, as the model does (`varlen_info`): no host sync inside a timed call
        info = None if cu_seqlens is None else varlen_info(cu_seqlens)
        varlen = {} if info is None else {"cu_seqlens": info.cu_seqlens, "cu_seqlens_cpu": info.cu_seqlens_cpu,
                                          "chunk_indices": info.chunk_indices}
        variants = {"fla": lambda: causal_conv1d(x=x, weight=w, activation="silu", **varlen)[0]}
        for block_d, warps in ((64, 1), (64, 2), (128, 1), (128, 2), (128, 4), (256, 1), (256, 2), (256, 4), (512, 2),
                               (512, 4), (1024, 4)):
            variants[f"qwenft_bd{block_d}_w{warps}"] = lambda b=block_d, n=warps: causal_conv_silu(
                x, w, varlen.get("cu_seqlens"), varlen.get("chunk_indices"), block_d=b, num_warps=n)
        out[layout] = {}
        for name, fn in variants.items():
            def fwd_bwd(fn=fn):
                y = fn()
                return (y, *torch.autograd.grad(y, (x, w), probe))

            with torch.no_grad():
                fwd_ms = time_ms(fn)
            y, dx, dw = fwd_bwd()
            out[layout][name] = {"fwd_ms": fwd_ms, "fwd_bwd_ms": time_ms(fwd_bwd),
                                 "fwd_bwd_kernels_ms": kernels_ms(fwd_bwd), "y_rel_err": rel(y, ref_y),
                                 "dx_rel_err": rel(dx, ref_dx), "dw_rel_err": rel(dw, ref_dw)}
    return out


def bench_embed(tokens: int, hidden: int = 5120, vocab: int = 248320) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    grad = (torch.randn(vocab, hidden, device="cuda", generator=g) * 1e-2).bfloat16()
    dy = (torch.randn(tokens, hidden, device="cuda", generator=g) * 1e-2).bfloat16()
    drawn = torch.randint(0, 50_000, (tokens,), device="cuda", generator=g)
    padded = drawn.clone()
    padded[tokens // 4:] = vocab - 1
    # a small vocabulary's Zipf-like counts (id k drawn with weight 1 / (k + 1) among 512): the benchmark's tiny
    # tokenizer, whose frequent ids each make a run of hundreds of rows
    zipf = torch.multinomial(1.0 / torch.arange(1, 513, device="cuda", dtype=torch.float), tokens, replacement=True,
                             generator=g)
    out = {"tokens": tokens, "hidden": hidden, "vocab": vocab}
    for layout, ids in (("drawn", drawn), ("pad_tail", padded), ("zipf512", zipf)):
        touched = ids.unique()
        ref = grad[touched].double().index_add(0, torch.searchsorted(touched, ids), dy.double())

        def steps_off(result):  # the largest error in units of the bf16 step at the exact result
            step = torch.finfo(torch.bfloat16).eps * ref.abs().clamp(min=1e-30).log2().floor().exp2()
            return ((result[touched].double() - ref).abs() / step).max().item()

        variants = {"index_put": lambda: grad.index_put_((ids,), dy, accumulate=True)}
        # tile: the rows a tile of one id sums ahead of its run's program; more than the tokens: no tiles,
        # each run's program walks all its rows
        for rows, block, warps, tile in ((8, 512, 4, tokens + 1), (8, 512, 4, 32), (8, 512, 4, 64), (8, 512, 4, 128),
                                         (16, 512, 4, 64), (32, 512, 8, 128)):
            def ours(rows=rows, block=block, warps=warps, tile=tile):
                sorted_ids, order = ids.sort(stable=True)
                return add_sorted_rows_(grad, sorted_ids, order, dy, rows=rows, block=block, num_warps=warps,
                                        tile=tile)
            tiles = "untiled" if tile > tokens else f"t{tile}"
            variants[f"sorted_rows_r{rows}_b{block}_w{warps}_{tiles}"] = ours

        def int32_keys():  # the default launch on ids sorted as int32 keys (add_token_rows_ sorts int64)
            sorted_ids, order = ids.to(torch.int32).sort(stable=True)
            return add_sorted_rows_(grad, sorted_ids, order, dy)
        variants["sorted_rows_int32_keys"] = int32_keys
        out[layout] = {"runs": touched.numel(), "longest_run": int(torch.bincount(ids).max())}
        original = grad.clone()
        for name, fn in variants.items():
            grad.copy_(original)
            err = steps_off(fn())
            out[layout][name] = {"kernels_ms": kernels_ms(fn), "max_err_bf16_steps": err}
        grad.copy_(original)
    out["tp4_rank"] = bench_embed_shard(tokens, hidden, vocab, tp=4)
    return out


def bench_embed_shard(tokens: int, hidden: int, vocab: int, tp: int) -> dict:
    """Rank 0 of a vocab-parallel tp world: tokens drawn from the whole vocabulary, most outside the rank's rows.
    Their rows put as ids spread over the shard with zero gradients (a masking pass first, as autograd's
    masked_fill backward makes it), against ids of -1 that the kernel skips."""
    rows = vocab // tp
    g = torch.Generator(device="cuda").manual_seed(0)
    grad = (torch.randn(rows, hidden, device="cuda", generator=g) * 1e-2).bfloat16()
    dy = (torch.randn(tokens, hidden, device="cuda", generator=g) * 1e-2).bfloat16()
    ids = torch.randint(0, vocab, (tokens,), device="cuda", generator=g)
    outside = ids >= rows
    spread = torch.where(outside, torch.arange(tokens, device="cuda") % rows, ids)
    skipped = ids.masked_fill(outside, -1)

    def put(row_ids, mask_first):
        src = dy.masked_fill(outside.unsqueeze(-1), 0) if mask_first else dy
        sorted_ids, order = row_ids.sort(stable=True)
        return add_sorted_rows_(grad, sorted_ids, order, src)

    original, out = grad.clone(), {"tp": tp, "outside": int(outside.sum())}
    results = {}
    for name, fn in (("spread_masked", lambda: put(spread, True)), ("skipped", lambda: put(skipped, False))):
        grad.copy_(original)
        results[name] = fn().clone()
        out[name] = {"kernels_ms": kernels_ms(fn)}
    out["same_bits"] = bool(torch.equal(results["spread_masked"], results["skipped"]))
    grad.copy_(original)
    return out


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="bench.py kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--params", type=float, default=1.0e9, help="AdamW: parameters per step")
    parser.add_argument("--tokens", type=int, default=4096, help="CE and the conv: tokens per microbatch")
    parser.add_argument("--channels", type=int, nargs="+", default=[10240],
                        help="the conv: channels (10240: the 27B's q|k|v; 5120 a tp2 rank's, 2560 a tp4 rank's)")
    parser.add_argument("--doc-tokens", type=int, default=150, help="the conv: tokens per packed document")
    parser.add_argument("--parts", nargs="+", choices=("adamw", "ce", "conv", "embed"),
                        default=["adamw", "ce", "conv", "embed"])
    args = parser.parse_args(argv)
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    benches = {"adamw": lambda: bench_adamw(args.params), "ce": lambda: bench_ce(args.tokens),
               "conv": lambda: {c: bench_conv(args.tokens, c, args.doc_tokens) for c in args.channels},
               "embed": lambda: bench_embed(args.tokens)}
    for part in args.parts:
        report[part] = benches[part]()
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")

