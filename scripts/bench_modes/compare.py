"""Two profiled runs' GPU time side by side, by kernel kind and by kernel: where one run's step spends more.

    python scripts/bench.py compare A.json B.json [--scale-a 0.25] [--scale-b 1] [--top 30] [--json out.json]

A and B are reports of `bench.py train --profile F --json A.json` (their `gpu_kernels_per_step`: every kernel's
time and calls per step). `--scale-a` / `--scale-b` multiply a run's times first (not its calls): 0.25 sets a
quarter of tp1's step against a tp4 rank's, what the rank would take if tp4 divided every kernel perfectly. Kernels are
matched by name; a kernel of one run only counts against zero. The lists: each kind's total in A and B and B - A,
then the kernels by |B - A|, the largest first. Compare runs from one machine (one call): the same step on
another GPU of the same name differs by a few percent, and an H100's memory-bound kernels are slower than an
H200's.
"""

import argparse
import json
from pathlib import Path


def kernels(path: str, scale: float) -> dict[str, dict]:
    """{name: {"kind", "ms", "calls"}} of a report's `gpu_kernels_per_step`, its times multiplied by `scale`."""
    report = json.loads(Path(path).read_text())
    if "gpu_kernels_per_step" not in report:
        raise SystemExit(f"bench.py compare: {path} has no gpu_kernels_per_step: run bench.py train with --profile F "
                         "--json FILE (a report from before this field, or without --profile, has none)")
    out: dict[str, dict] = {}
    for row in report["gpu_kernels_per_step"]:
        seen = out.setdefault(row["name"], {"kind": row["kind"], "ms": 0.0, "calls": 0.0})
        seen["ms"] += row["ms"] * scale
        seen["calls"] += row["calls"]
    return out


def compare(a: dict[str, dict], b: dict[str, dict]) -> dict:
    """Kinds' totals (a, b, b - a), the largest difference first, and every kernel's (a, b, b - a, calls)."""
    names = sorted(set(a) | set(b))
    none = {"ms": 0.0, "calls": 0.0}
    rows = [{"name": n, "kind": (a.get(n) or b[n])["kind"], "a_ms": a.get(n, none)["ms"], "b_ms": b.get(n, none)["ms"],
             "diff_ms": b.get(n, none)["ms"] - a.get(n, none)["ms"],
             "a_calls": a.get(n, none)["calls"], "b_calls": b.get(n, none)["calls"]} for n in names]
    kinds: dict[str, dict] = {}
    total = {"a_ms": 0.0, "b_ms": 0.0, "diff_ms": 0.0}
    for r in rows:
        for sums in (kinds.setdefault(r["kind"], {"a_ms": 0.0, "b_ms": 0.0, "diff_ms": 0.0}), total):
            for key in sums:
                sums[key] += r[key]
    return {"total": total, "kinds": dict(sorted(kinds.items(), key=lambda kv: -abs(kv[1]["diff_ms"]))),
            "kernels": sorted(rows, key=lambda r: -abs(r["diff_ms"]))}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="bench.py compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("a", help="a report of bench.py train --profile F --json A.json")
    parser.add_argument("b", help="the report to set against it")
    parser.add_argument("--scale-a", type=float, default=1.0, help="multiply A's times (0.25: tp1 / 4)")
    parser.add_argument("--scale-b", type=float, default=1.0, help="multiply B's times")
    parser.add_argument("--top", type=int, default=30, help="kernels listed")
    parser.add_argument("--json", help="also write the whole comparison here")
    args = parser.parse_args(argv)
    for key in ("scale_a", "scale_b"):
        if not getattr(args, key) > 0:
            parser.error(f"--{key.replace('_', '-')}={getattr(args, key)}: a factor above 0")
    out = compare(kernels(args.a, args.scale_a), kernels(args.b, args.scale_b))
    t = out["total"]
    print(f"GPU ms a step: A {t['a_ms']:.1f}, B {t['b_ms']:.1f}, B - A {t['diff_ms']:+.1f}")
    print(f"\n{'kind':32s} {'A':>9s} {'B':>9s} {'B - A':>9s}")
    for kind, k in out["kinds"].items():
        print(f"{kind:32s} {k['a_ms']:9.2f} {k['b_ms']:9.2f} {k['diff_ms']:+9.2f}")
    print(f"\n{'A ms':>9s} {'B ms':>9s} {'B - A':>9s} {'A calls':>8s} {'B calls':>8s}  kernel")
    for r in out["kernels"][: args.top]:
        print(f"{r['a_ms']:9.3f} {r['b_ms']:9.3f} {r['diff_ms']:+9.3f} {r['a_calls']:8.1f} {r['b_calls']:8.1f}  "
              f"{r['name'][:100]}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
