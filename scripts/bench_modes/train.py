"""Training throughput and memory of a recipe on GPU(s), through the real runner (bench.py's default mode).

    python scripts/bench.py [train] [--warmup 2] [--json out.json] [--profile out.txt [--trace DIR]] [--host-profile out.txt] [--sync-debug out.txt] [--plan] recipe=NAME [overrides ...]
    torchrun --nproc-per-node 2 scripts/bench.py recipe=NAME mesh.dp=2 ...

Runs `qwenft train` in-process for the recipe's `train.max_steps` from random init (or model.path), then
reports, over the steps after the warm-up: median step time, tokens/s per GPU, TFLOP/s per GPU and MFU
(Qwen3.5 FLOPs per token from qwenft.train.metrics.flops_per_token, the count metrics.jsonl uses), and the
peak memory of every rank. `--profile` runs torch.profiler over the steps after the warm-up, writes the top CUDA kernels
and every kernel's time per step, and adds the GPU time per step by kernel kind (matmul, attention, GDN, optimizer,
communication, other) and by kernel (`gpu_kernels_per_step`, what `bench.py compare` reads) to the report;
`--trace DIR` also writes every rank's timeline of those steps (DIR/rank<R>.json.gz).
`--host-profile` runs Python's cProfile over the same steps instead: where the host's time goes, by function
(what a host-bound step, GPU idle between kernels, is made of).
`--sync-debug FILE` writes every distinct place where the host waits for the GPU during the steps after the
warm-up (torch's CUDA sync debug mode, with the Python stack of each): a wait the step does not need leaves the
GPU idle until the host has queued work again.
`--plan` adds `qwenft plan`'s predicted peak of every rank (qwenft.train.plan), to compare with the measured one.
"""

import argparse
import dataclasses
import json
import os
import statistics
from pathlib import Path

import torch
import torch.distributed as dist

from qwenft.conf import compose
from qwenft.distributed.fake_pg import init_fake_process_group
from qwenft.train.metrics import read_metrics_rows
from qwenft.train.runner import run


def summarize(rows: list[dict], warmup: int, peaks_gib: list[float]) -> dict:
    timed = rows[warmup:] or rows[-1:]
    step_s = statistics.median(r["step_time_s"] for r in timed)
    out = {
        "steps_timed": len(timed),
        "step_time_s": step_s,
        "tokens_per_sec_per_gpu": statistics.median(r["tokens_per_sec_per_gpu"] for r in timed),
        "peak_memory_gib_per_rank": peaks_gib,
        "final_loss": rows[-1]["loss"],
    }
    if "tflops_per_gpu" in rows[-1]:
        out["tflops_per_gpu"] = statistics.median(r["tflops_per_gpu"] for r in timed)
    if rows[-1].get("mfu") is not None:
        out["mfu"] = statistics.median(r["mfu"] for r in timed)
    return out


def predicted_peaks(cfg) -> list[float]:
    """`qwenft plan`'s peak (GiB) of every rank, planned for this run's world size (before it starts: the plan
    plays every rank on a fake process group of its own)."""
    from qwenft.train.plan import GIB, predict

    if cfg.mesh.dp == -1:  # the plan takes mesh.dp=-1 as 1; here the world size says what it is
        dp = int(os.environ.get("WORLD_SIZE", 1)) // (cfg.mesh.tp * cfg.mesh.pp)
        cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, dp=dp))
    return [round(p.total_bytes / GIB, 2) for p in predict(cfg)]


PROFILER_OVERHEAD = ("Buffer Flush", "Activity Buffer Request")  # CUPTI's own work on the GPU timeline
KERNEL_KINDS = (  # first match wins; names of CUDA kernels as the profiler reports them
    ("communication", ("nccl",)),
    ("optimizer", ("adam",)),
    ("attention", ("flash", "fmha", "attention")),
    # GatedDeltaNet's mixer: fla's Triton kernels, its TileLang kernel (named kernel_kernel), qwenft's conv kernels
    ("gdn", ("chunk", "gated_delta", "causal_conv", "_conv_fwd_kernel", "_conv_bwd_kernel", "l2norm", "tilelang",
             "kernel_kernel", "wy_repr", "recompute_w_u", "solve_tril")),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "wgmma")),
)


def kernel_kind(name: str) -> str:
    """The kind (KERNEL_KINDS) of the CUDA kernel `name`."""
    name = name.lower()
    return next((k for k, pats in KERNEL_KINDS if any(p in name for p in pats)), "other (elementwise, CE, copies)")


def kernel_times(averages, steps: int) -> list[dict]:
    """Every CUDA kernel and copy of the profiler's averages: its kind, name, self time per step in ms and calls
    per step, the longest first (what `kernel_breakdown` sums by kind).

    Only kernels and copies: the ranges that `record_function` marks on the GPU timeline (FSDP's
    "FSDP::post_backward_accumulate (...)", "Optimizer.step#AdamW.step", ...) are CUDA events too, spanning
    kernels already counted; torch's own tables leave them out of the device totals, and so does this. So are
    the profiler's own buffer flushes (CUPTI's "Buffer Flush", "Activity Buffer Request": ~23 ms per step)."""
    from torch.autograd import DeviceType

    rows = [{"kind": kernel_kind(evt.key), "name": evt.key, "ms": evt.self_device_time_total / 1e3 / steps,
             "calls": getattr(evt, "count", 0) / steps}
            for evt in averages
            if evt.device_type == DeviceType.CUDA and not getattr(evt, "is_user_annotation", False)
            and evt.key not in PROFILER_OVERHEAD]
    return sorted(rows, key=lambda r: -r["ms"])


def kernel_breakdown(averages, steps: int, kernels: list[dict] | None = None) -> dict:
    """Self CUDA time per step of each kernel kind, in ms (NCCL overlaps compute on its own stream), over
    `kernel_times` (`kernels`, where the caller has them)."""
    totals: dict[str, float] = {}
    for row in kernels if kernels is not None else kernel_times(averages, steps):
        totals[row["kind"]] = totals.get(row["kind"], 0.0) + row["ms"]
    return {k: round(v, 1) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}


def profiled_run(cfg, warmup: int, trace: str | None = None):
    """`run(cfg)` under torch.profiler, recording the steps after the first `warmup` (compiles, autotuning and
    first allocations stay out; the last warm-up step warms the profiler up). Returns the run's result, the
    profiler's averages over the recorded steps and their number. `trace`: also write this rank's timeline of
    those steps there (Chrome trace JSON, gzipped if the name ends in .gz; chrome://tracing or Perfetto)."""
    from torch.profiler import ProfilerActivity, profile, schedule

    if not cfg.train.max_steps or cfg.train.max_steps <= warmup:
        raise ValueError(f"--profile records the steps after --warmup={warmup}: set train.max_steps above it "
                         f"(train.max_steps={cfg.train.max_steps})")
    profiled = cfg.train.max_steps - warmup
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    when = schedule(skip_first=max(warmup - 1, 0), wait=0, warmup=min(warmup, 1), active=profiled, repeat=1)
    with profile(activities=activities, schedule=when) as prof:
        result = run(cfg, on_step=lambda step: prof.step())
    if trace:
        Path(trace).parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(trace)
    return result, prof.key_averages(), profiled  # slow: > 45 s for 3 steps of the 27B shape on an H200


def write_profile_table(averages, path: str, kernels: list[dict] | None = None) -> None:
    """The profiler's kernels by their own time, then ops (FSDP's record_function ranges among them) with what they
    launch, as text at `path`; then, given `kernels` (`kernel_times`), every kernel's time and calls per step."""
    text = (averages.table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=90)
            + averages.table(sort_by="cuda_time_total", row_limit=60, max_name_column_width=90))
    if kernels is not None:
        text += "\nEvery kernel, per step: ms, calls, kind, name\n" + "".join(
            f"{r['ms']:10.3f} {r['calls']:8.1f}  {r['kind'].split(' ')[0]:13s} {r['name']}\n" for r in kernels)
    Path(path).write_text(text)


def host_profiled_run(cfg, warmup: int, out: str):
    """`run(cfg)` with cProfile on for the steps after the first `warmup` (to the end of the last step, not the
    run's teardown); writes the functions by own time and by cumulative time to `out` (rank R > 0: `out.rankR`).
    cProfile's overhead per Python call inflates Python-heavy code most."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()

    def sync():
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def on_step(step):
        if step == warmup:
            sync()
            prof.enable()
        if step == cfg.train.max_steps:
            sync()
            prof.disable()

    if warmup == 0:
        prof.enable()
    result = run(cfg, on_step=on_step)
    prof.disable()
    text = io.StringIO()
    for key in ("tottime", "cumulative"):
        pstats.Stats(prof, stream=text).sort_stats(key).print_stats(60)
    rank = int(os.environ.get("RANK", "0"))
    Path(out if rank == 0 else f"{out}.rank{rank}").write_text(text.getvalue())
    return result


def sync_debug_run(cfg, warmup: int, out: str):
    """`run(cfg)` with torch's CUDA sync debug mode on for the steps after the first `warmup`; writes each
    distinct synchronizing call (its message and the innermost Python frames) to `out` (rank R > 0:
    `out.rankR`), with how many times it ran. Recording each call's stack slows those steps: their times are
    not the run's."""
    import traceback
    import warnings

    seen: dict[str, int] = {}

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1] if "warnings" not in f.filename][-8:]
        key = str(message).splitlines()[0] + "\n" + "".join(traceback.format_list(frames))
        seen[key] = seen.get(key, 0) + 1

    def watch(on: bool):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn" if on else "default")

    def on_step(step):
        if step == warmup:
            watch(True)
        if step == cfg.train.max_steps:
            watch(False)

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record  # restored with the filters when the block ends
        if warmup == 0:
            watch(True)
        try:
            result = run(cfg, on_step=on_step)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    steps = cfg.train.max_steps - warmup
    text = [f"{count} times in {steps} steps: {key}" for key, count in sorted(seen.items(), key=lambda kv: -kv[1])]
    rank = int(os.environ.get("RANK", "0"))
    Path(out if rank == 0 else f"{out}.rank{rank}").write_text(
        "\n".join(text) or f"no synchronizing call in {steps} steps\n")
    return result


def play_cp_span(span: int) -> None:
    """Every microbatch's context-parallel shard made span `span`'s: this process embeds the whole row as every cp
    rank does, then keeps span `span`'s tokens and attends over the keys up to that span's end (the fake
    all-gather fills them with copies of its own). fla's kernels take their rank from the group (0): their state
    summaries fold as span 0's, the same work."""
    from qwenft.models.qwen3_5 import context_parallel

    shard_of = context_parallel.cp_shard

    def cp_shard(cu_seqlens, group, balanced=False):
        return dataclasses.replace(shard_of(cu_seqlens, group, balanced), rank=span)

    context_parallel.cp_shard = cp_shard


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="bench.py [train]", description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the medians")
    parser.add_argument("--json", default=None)
    parser.add_argument("--profile", default=None, help="write torch.profiler's top CUDA kernels here")
    parser.add_argument("--trace", default=None, metavar="DIR",
                        help="with --profile: every rank writes its timeline to DIR/rank<R>.json.gz (where the GPU idles: "
                             "`bench.py idle DIR/rank0.json.gz`; which rank a collective waits for)")
    parser.add_argument("--host-profile", default=None, metavar="FILE",
                        help="cProfile the steps after the warm-up (host time by Python function) into FILE")
    parser.add_argument("--sync-debug", default=None, metavar="FILE",
                        help="write each place where the host waits for the GPU in the steps after the warm-up to FILE")
    parser.add_argument("--plan", action="store_true", help="also report qwenft plan's predicted peak per rank")
    parser.add_argument("--fake-world", type=int, default=None, metavar="N",
                        help="run rank 0 of N ranks on a process group that sends nothing (qwenft.distributed.fake_pg): "
                             "collectives return at once with copies of the rank's own data, "
                             "kernels run at one rank's real sizes (a tensor parallel rank's ceiling on one GPU)")
    parser.add_argument("--fake-cp-rank", type=int, default=0, metavar="R",
                        help="with --fake-world and mesh.cp: rank 0 computes context-parallel span R instead of its "
                             "own (the last span's attention reads the whole row's keys, the first span's only its "
                             "own: the slowest rank of a real run is the last)")
    args, overrides = parser.parse_known_args(argv)
    if args.fake_cp_rank and not args.fake_world:
        parser.error("--fake-cp-rank needs --fake-world")
    if args.host_profile and args.profile:
        parser.error("--host-profile and --profile each profile the same steps: pass one of them")
    if args.sync_debug and (args.profile or args.host_profile):
        parser.error("--sync-debug runs the steps without a profiler: pass it alone")
    if args.sync_debug and not torch.cuda.is_available():
        parser.error("--sync-debug watches CUDA's synchronizations: it needs a GPU")
    if args.trace and not args.profile:
        parser.error(f"--trace {args.trace} needs --profile (the trace is the profiled steps' timeline)")
    # no HF export (minutes for a 27B-sized model) unless asked for; later overrides win
    cfg = compose(["checkpoint.export_hf=false"] + overrides + ["train.progress_bar=false"])
    if args.fake_world and cfg.mesh.pp > 1:
        parser.error(f"--fake-world plays one rank alone, and a pipeline stage waits for what the other stages send: "
                     f"mesh.pp={cfg.mesh.pp} cannot run there (mesh.pp=1 can)")
    if args.fake_world:
        init_fake_process_group(args.fake_world)
    if args.fake_cp_rank:
        play_cp_span(args.fake_cp_rank)
    planned = predicted_peaks(cfg) if args.plan and os.environ.get("RANK", "0") == "0" else None
    if args.profile:
        trace = f"{args.trace}/rank{os.environ.get('RANK', '0')}.json.gz" if args.trace else None
        result, averages, profiled = profiled_run(cfg, args.warmup, trace)
        kernels = kernel_times(averages, profiled)
        if dist.get_rank() == 0:
            write_profile_table(averages, args.profile, kernels)
        breakdown = kernel_breakdown(averages, profiled, kernels)
    elif args.host_profile:
        result = host_profiled_run(cfg, args.warmup, args.host_profile)
        breakdown = None
    elif args.sync_debug:
        result = sync_debug_run(cfg, args.warmup, args.sync_debug)
        breakdown = None
    else:
        result = run(cfg)
        breakdown = None
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0],
                        device="cuda" if torch.cuda.is_available() else "cpu")
    peaks = [torch.zeros_like(peak) for _ in range(dist.get_world_size())]
    dist.all_gather(peaks, peak)
    if dist.get_rank() == 0:
        # metrics.jsonl holds each step once (a fresh run keeps an earlier run's rows aside, a resumed one cuts them
        # at its checkpoint): this run's steps are its last rows
        steps = [r for r in read_metrics_rows(result.run_dir / "metrics.jsonl") if "step_time_s" in r]
        rows = steps[len(steps) - len(result.losses):]
        report = {"overrides": overrides, "world_size": dist.get_world_size(),
                  "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                  "torch": torch.__version__,
                  **summarize(rows, args.warmup, [round(p.item(), 2) for p in peaks])}
        if breakdown is not None:  # the steps after the warm-up
            report["gpu_ms_per_step_by_kernel_kind"] = breakdown
            # GPU time against wall time over the same steps: what the kernels leave idle (host-bound gaps; with
            # several GPUs NCCL kernels overlap compute, so there the sum is not busy time)
            report["gpu_kernel_ms_per_step"] = round(sum(breakdown.values()), 1)
            walls = [r["step_time_s"] for r in rows[args.warmup:]]
            report["step_ms_profiled"] = round(1e3 * statistics.mean(walls), 1)
            # every kernel, for `bench.py compare` of two profiles
            report["gpu_kernels_per_step"] = [{**r, "ms": round(r["ms"], 4), "calls": round(r["calls"], 2)}
                                              for r in kernels]
        if torch.cuda.is_available():
            # what the allocator holds from the GPU: under model.cuda_graphs a graph's replay writes into its
            # private pool without allocating, so the allocated peak above misses what a replay uses inside
            report["peak_reserved_gib_rank0"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
        if planned is not None:
            report["planned_peak_gib_per_rank"] = planned
        print(json.dumps(report, indent=2))
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2))
    dist.barrier()  # leave together: a rank that tore gloo down while rank 0 wrote the report aborted at exit
    dist.destroy_process_group()

