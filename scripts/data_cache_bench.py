"""Benchmark of the token cache on a generated chat JSONL (run by hand; not a test).

    OMP_NUM_THREADS=1 python scripts/data_cache_bench.py --rows 1000000 --old-rows 100000 --out /tmp/qwenft-bench

Generates `--rows` synthetic chat rows (deterministic, ~0.4 KB each, under --out, never in the repo), then
times `qwenft train recipe=tiny train.max_steps=1` from launch to its `step 1/` line and reads the peak
resident memory (VmHWM) of every training rank:

1. the cache's first run on all --rows rows with 2 ranks started together (one builds, the other waits:
   the script checks one cache directory came out), and its second run with 2 ranks;
2. today's in-memory pipeline (`data.cache=false`) on a --old-rows file, one rank;
3. the cache's first run on that file (builds it), one rank, and its second run (reuses it).

With `--assemble-from CACHE_ROOT` (a finished `--runs small` cache root) the big file is instead
`--rows / --old-rows` copies of the small file with its cache assembled from the small one (what a build
would write, row by row), and only the big second run runs: for measuring a large cache's reads where
tokenizing it takes too long on a shared machine.

Prints a markdown table and the cache's tokenization throughput (rows per second per process) from its
meta.json; --json writes the numbers too.
"""

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

def generate(path: Path, rows: int, seed: int = 0) -> None:
    """`rows` chat rows of the tiny set's words in random order (words the tiny tokenizer knows): 1-2
    user/assistant turns, a quarter with a system prompt."""
    from qwenft.data.tiny_chat import train_words

    words = train_words()
    rng = random.Random(seed)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        for i in range(rows):
            messages = [{"role": "system", "content": "Answer briefly."}] if i % 4 == 0 else []
            for _ in range(rng.randint(1, 2)):
                messages.append({"role": "user", "content": " ".join(rng.choices(words, k=rng.randint(3, 15))) + "?"})
                messages.append({"role": "assistant",
                                 "content": " ".join(rng.choices(words, k=rng.randint(5, 40))) + "."})
            f.write(json.dumps({"messages": messages}) + "\n")
    tmp.rename(path)


def _tree(root: int) -> list[int]:
    """`root` and its descendants."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def _status(pid: int, root: int) -> tuple[str, int] | None:
    """(role, VmHWM in bytes): a training rank, a tokenizing worker or a launcher (qwenft's, torchrun)."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        environ = Path(f"/proc/{pid}/environ").read_bytes()
        hwm = next(int(line.split()[1]) * 1024 for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                   if line.startswith("VmHWM"))
    except (OSError, StopIteration):
        return None
    if "multiprocessing" in cmd:
        return "worker", hwm
    if b"LOCAL_RANK=" in environ or (pid == root and "launcher.nproc_per_node" not in cmd):
        return "rank", hwm
    return "launcher", hwm


def run(label: str, args: list[str], log_dir: Path) -> dict:
    """One `qwenft train` from launch to exit: seconds to its `step 1/` line, peak RSS per rank."""
    cmd = [sys.executable, "-m", "qwenft", "train", "recipe=tiny", "train.max_steps=1", "train.progress_bar=false",
           "checkpoint.every_steps=0", f"run_dir={log_dir / label}", *args]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    seen: dict[int, tuple[str, int]] = {}
    step1, data_at, lines = None, None, []

    def read():
        nonlocal step1, data_at
        for line in proc.stdout:
            lines.append(line)
            if step1 is None and " step 1/" in line:
                step1 = time.perf_counter() - start
            if data_at is None and " data: " in line and " documents, " in line:
                data_at = time.perf_counter() - start

    reader = threading.Thread(target=read)
    reader.start()
    while proc.poll() is None:
        for pid in _tree(proc.pid):
            status = _status(pid, proc.pid)
            if status is not None:
                seen[pid] = status
        time.sleep(0.5)  # VmHWM is a high-water mark: a slow poll still reads the peak
    reader.join()
    (log_dir / f"{label}.log").write_text("".join(lines))
    if proc.returncode != 0:
        raise SystemExit(f"{label} failed ({proc.returncode}); see {log_dir / label}.log")
    ranks = sorted((hwm for role, hwm in seen.values() if role == "rank"), reverse=True)
    workers = [hwm for role, hwm in seen.values() if role == "worker"]
    return {"label": label, "seconds_to_data_line": round(data_at, 1), "seconds_to_step_1": round(step1, 1), "peak_rss_gb_per_rank": [round(r / 1e9, 2) for r in ranks],
            "peak_rss_gb_tokenizer_worker": round(max(workers) / 1e9, 2) if workers else None,
            "tokenizing_lines": sum("data: tokenizing" in line for line in lines),
            "data_line": next((line.strip() for line in lines if " data: " in line and "documents" in line), "")}


def assemble_big(small: Path, small_cache: Path, big: Path, big_cache: Path, copies: int, seq_len: int) -> None:
    """`big` = `copies` copies of `small`, and its token cache assembled from `small`'s (tiled arrays, rows
    and skip counts times `copies`) instead of tokenizing it: every row tokenizes on its own, so a build
    would write the same arrays. For measuring reads of a large cache where building one takes too long."""
    import numpy as np

    from qwenft.data import cache as cache_lib
    from qwenft.data.tokenizer import load_tokenizer

    with open(big, "wb") as out:
        for _ in range(copies):
            out.write(small.read_bytes())
    (src,) = [p.parent for p in small_cache.glob("*/meta.json")]
    meta = json.loads((src / "meta.json").read_text())
    key = cache_lib.cache_key(big, load_tokenizer("tiny"), seq_len, "assistant", "truncate_right", None)
    final = cache_lib.cache_dir_for(big, key, big_cache)
    final.mkdir(parents=True)
    for name in ("tokens", "targets"):
        np.save(final / f"{name}.npy", np.tile(np.load(src / f"{name}.npy"), copies))
    lengths = np.diff(np.load(src / "offsets.npy"))
    np.save(final / "offsets.npy", np.concatenate([[0], np.cumsum(np.tile(lengths, copies))]).astype(np.int64))
    meta.update(documents=meta["documents"] * copies, tokens=meta["tokens"] * copies, rows=meta["rows"] * copies,
                skipped={k: v * copies for k, v in meta["skipped"].items()}, key=key,
                build_seconds=None, assembled_from=str(src))
    (final / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")


def cache_meta(cache_root: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(cache_root.glob("*/meta.json"))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--old-rows", type=int, default=100_000, help="rows for today's in-memory pipeline")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--num-proc", type=int, default=os.cpu_count())
    parser.add_argument("--out", type=Path, default=Path("/tmp/qwenft-bench"))
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--runs", choices=("all", "big", "small"), default="all",
                        help="big: the --rows runs with 2 ranks; small: the --old-rows runs (old pipeline, cache)")
    parser.add_argument("--assemble-from", type=Path, default=None,
                        help="a finished small run's cache dir: the big file becomes --rows/--old-rows copies of the "
                             "small file, its cache is assembled from this one, and only the big second run runs")
    opts = parser.parse_args()
    out = opts.out
    out.mkdir(parents=True, exist_ok=True)
    big, small = out / f"chat-{opts.rows}.jsonl", out / f"chat-{opts.old_rows}.jsonl"
    for path, n in ((big, opts.rows), (small, opts.old_rows)):
        if opts.assemble_from is not None and n == opts.rows:
            continue
        if not path.exists() and (opts.runs == "all" or (opts.runs == "big") == (n == opts.rows)):
            t = time.perf_counter()
            generate(path, n)
            print(f"generated {path} ({path.stat().st_size / 1e6:.0f} MB) in {time.perf_counter() - t:.0f} s",
                  flush=True)
    common = [f"data.seq_len={opts.seq_len}", f"data.num_proc={opts.num_proc}"]
    stamp = time.strftime("%H%M%S")
    small_cache, big_cache = out / f"cache-small-{stamp}", out / f"cache-big-{stamp}"
    if opts.assemble_from is not None:
        big, small_cache = out / f"chat-{opts.rows}-assembled.jsonl", opts.assemble_from
        assemble_big(small, small_cache, big, big_cache, opts.rows // opts.old_rows, opts.seq_len)
    logs = out / f"logs-{stamp}"
    logs.mkdir()
    results = []
    for label, args in (
            ("cache, first run, 2 ranks", [f"data.path={big}", f"data.cache_dir={big_cache}",
                                           "launcher.nproc_per_node=2"]),
            ("cache, second run, 2 ranks", [f"data.path={big}", f"data.cache_dir={big_cache}",
                                            "launcher.nproc_per_node=2"]),
            ("old pipeline, 1 rank", [f"data.path={small}", "data.cache=false"]),
            ("cache, first run, 1 rank", [f"data.path={small}", f"data.cache_dir={small_cache}"]),
            ("cache, second run, 1 rank", [f"data.path={small}", f"data.cache_dir={small_cache}"])):
        rows = opts.rows if "2 ranks" in label else opts.old_rows
        if opts.runs != "all" and (opts.runs == "big") != (rows == opts.rows):
            continue
        if opts.assemble_from is not None and label != "cache, second run, 2 ranks":
            continue
        result = {**run(label.replace(" ", "_").replace(",", ""), [*common, *args], logs), "rows": rows,
                  "what": label}
        print(json.dumps(result), flush=True)
        results.append(result)
    builds = {"small": cache_meta(small_cache), "big": cache_meta(big_cache)}
    assert opts.runs == "small" or len(builds["big"]) == 1, \
        f"2 ranks made {len(builds['big'])} cache directories, not one"
    print("\n| run | rows | time to the `data:` line | time to step 1 | peak RSS per rank |")
    print("|---|---|---|---|---|")
    for r in results:
        print(f"| {r['what']} | {r['rows']:,} | {r['seconds_to_data_line']} s | {r['seconds_to_step_1']} s | "
              f"{', '.join(f'{x:.2f}' for x in r['peak_rss_gb_per_rank'])} GB |")
    for name, metas in builds.items():
        for m in metas:
            if m["build_seconds"] is None:
                print(f"\n{name} cache: {m['rows']:,} rows -> {m['documents']:,} documents, {m['tokens']:,} tokens, "
                      f"assembled from {m['assembled_from']}")
                continue
            rate = m["rows"] / m["build_seconds"]
            print(f"\n{name} cache: {m['rows']:,} rows -> {m['documents']:,} documents, {m['tokens']:,} tokens in "
                  f"{m['build_seconds']} s with {m['num_proc']} processes: {rate:,.0f} rows/s, "
                  f"{rate / m['num_proc']:,.0f} rows/s per process, {m['tokens'] / m['build_seconds'] / m['num_proc']:,.0f} "
                  f"tokens/s per process; skipped {m['skipped'] or 'none'}")
    if opts.json:
        opts.json.write_text(json.dumps({"runs": results, "builds": builds}, indent=1) + "\n")


if __name__ == "__main__":
    main()
