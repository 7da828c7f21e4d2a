"""Where the GPU idles in a profiled timeline (`bench.py train --profile F --trace DIR` writes one per rank).

    python scripts/bench.py idle DIR/rank0.json.gz [--min-us 20] [--top 15] [--json out.json]

The GPU's busy time is the union of its kernels, copies and memsets on every stream; a gap is a stretch of the
recorded steps with none of them. Each gap is put down to the kernel after it: the host launched it late (its
launch call started after the gap began: the host was busy elsewhere, and the op that launched it says where) or
on time (the GPU waited for something else, an event or a copy from the host). Gaps are summed per profiled step
(the ProfilerStep#N ranges) and grouped by the op that launched the kernel after them, and by the training loop's
phase the host was in when the GPU ran dry (the innermost `qwenft.*` range the runner marks: step_inputs,
forward_backward, clip, make_ahead, wait_for_step, optimizer_step, zero_grad, log_step, next_batches; "between
phases" outside them).
"""

import argparse
import bisect
import gzip
import json
from collections import defaultdict
from pathlib import Path

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
HOST_CATEGORIES = ("cpu_op", "user_annotation", "python_function")


def load_events(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]


def busy_intervals(events: list[dict]) -> list[tuple[float, float, dict]]:
    """The GPU's events merged into busy stretches [(start, end, first event of the stretch)], in time order."""
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATEGORIES), key=lambda e: e["ts"])
    merged: list[list] = []
    for e in gpu:
        start, end = e["ts"], e["ts"] + e["dur"]
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end, e])
    return [tuple(m) for m in merged]


def open_ops(events: list[dict]):
    """A lookup: (thread, time) -> names of the host ops open then, outermost first."""
    by_thread: dict = defaultdict(list)
    for e in events:
        if e.get("cat") in HOST_CATEGORIES:
            by_thread[e.get("tid")].append(e)
    for ops in by_thread.values():
        ops.sort(key=lambda e: e["ts"])
    starts = {tid: [e["ts"] for e in ops] for tid, ops in by_thread.items()}

    def at(tid, ts: float) -> list[str]:
        ops, keys = by_thread.get(tid, []), starts.get(tid, [])
        i = bisect.bisect_right(keys, ts)
        # ops open at ts: started before it and not yet ended (nested ranges: scan back a bounded window)
        open_ops = [e for e in ops[max(0, i - 400):i] if e["ts"] + e["dur"] >= ts]
        return [e["name"] for e in sorted(open_ops, key=lambda e: (e["ts"], -e["dur"]))]

    return at


def loop_phases(events: list[dict], tid):
    """A lookup: time -> the innermost `qwenft.*` range open then on the training loop's thread `tid` (the one that
    marks the steps; the backward's kernels come from autograd's own thread, while this one waits in the
    forward_backward range), or "between phases"."""
    ranges = sorted(((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                     if e["name"].startswith("qwenft.") and e.get("cat") in HOST_CATEGORIES and e.get("tid") == tid))

    def at(ts: float) -> str:
        open_ranges = [r for r in ranges[:bisect.bisect_right(ranges, (ts, float("inf"), ""))] if r[1] >= ts]
        return open_ranges[-1][2] if open_ranges else "between phases"
    return at


def summarize(path: str, min_us: float = 20.0, top: int = 15) -> dict:
    events = load_events(path)
    # the host's step ranges (the profiler marks each step on the GPU's timeline too: "gpu_user_annotation")
    steps = sorted((e for e in events if e["name"].startswith("ProfilerStep#") and e.get("cat") in HOST_CATEGORIES),
                   key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})}
    busy = busy_intervals(events)
    ops_at = open_ops(events)
    phase_at = loop_phases(events, steps[0]["tid"] if steps else None)
    if steps:  # the recorded steps only: the profiler's start and the trace's tail stay out
        lo, hi = steps[0]["ts"], steps[-1]["ts"] + steps[-1]["dur"]
        busy = [b for b in busy if lo <= b[0] <= hi]
    gaps = []
    for (_, prev_end, _), (start, _, nxt) in zip(busy, busy[1:]):
        gap = start - prev_end
        if gap < min_us:
            continue
        launch = launches.get(nxt.get("args", {}).get("correlation"))
        late = launch is not None and launch["ts"] > prev_end
        ops = ops_at(launch.get("tid"), launch["ts"]) if launch is not None else []
        gaps.append({"us": round(gap, 1), "at": prev_end, "next": nxt["name"][:100], "host_late": late,
                     "launched_in": " > ".join(o[:60] for o in ops[-4:]) or "?", "host_phase": phase_at(prev_end)})
    report = {"trace": path, "steps": len(steps), "gap_threshold_us": min_us}
    per_step = []
    for s in steps:
        inside = [g for g in gaps if s["ts"] <= g["at"] < s["ts"] + s["dur"]]
        per_step.append({"step": s["name"], "wall_ms": round(s["dur"] / 1e3, 1),
                         "idle_ms": round(sum(g["us"] for g in inside) / 1e3, 1),
                         "host_late_ms": round(sum(g["us"] for g in inside if g["host_late"]) / 1e3, 1)})
    report["per_step"] = per_step
    by_op: dict = defaultdict(lambda: [0.0, 0])
    for g in gaps:
        key = (g["launched_in"].rsplit(" > ", 1)[-1], g["host_late"])
        by_op[key][0] += g["us"]
        by_op[key][1] += 1
    n = max(len(steps), 1)
    report["idle_ms_per_step_by_launching_op"] = [
        {"op": op, "host_late": late, "ms_per_step": round(us / 1e3 / n, 2), "gaps_per_step": round(count / n, 1)}
        for (op, late), (us, count) in sorted(by_op.items(), key=lambda kv: -kv[1][0])[:top]]
    by_phase: dict = defaultdict(lambda: [0.0, 0])
    for g in gaps:
        by_phase[g["host_phase"]][0] += g["us"]
        by_phase[g["host_phase"]][1] += 1
    report["idle_ms_per_step_by_host_phase"] = [
        {"phase": phase, "ms_per_step": round(us / 1e3 / n, 2), "gaps_per_step": round(count / n, 1)}
        for phase, (us, count) in sorted(by_phase.items(), key=lambda kv: -kv[1][0])]
    report["largest_gaps"] = [{k: v for k, v in g.items() if k != "at"}
                              for g in sorted(gaps, key=lambda g: -g["us"])[:top]]
    return report


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="bench.py idle", description=__doc__.splitlines()[0])
    parser.add_argument("trace", help="a Chrome trace from bench.py train --profile F --trace DIR (DIR/rank0.json.gz)")
    parser.add_argument("--min-us", type=float, default=20.0, help="shorter gaps are left out")
    parser.add_argument("--top", type=int, default=15, help="rows in each list")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not Path(args.trace).is_file():
        parser.error(f"trace {args.trace}: no such file (bench.py train --profile F --trace DIR writes DIR/rank0.json.gz)")
    report = summarize(args.trace, args.min_us, args.top)
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
