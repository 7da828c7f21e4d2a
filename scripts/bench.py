"""qwenft's benchmarks, one entry point: a training step (the default), or a mode named first.

    python scripts/bench.py [train] [--warmup 2] [--json out.json] [--plan] [--fake-world N] recipe=NAME [overrides ...]
    torchrun --nproc-per-node 2 scripts/bench.py recipe=NAME mesh.dp=2 ...
    python scripts/bench.py kernels [--params 1.0e9] [--tokens 4096] [--parts adamw ce conv embed] [--json out.json]
    python scripts/bench.py layers [--seq 4096] [--json out.json]
    python scripts/bench.py fused [--model qwen3_5_27b] [--tokens 4096] [--json out.json]
    python scripts/bench.py moe [--model 35b_a3b] [--layers 4] [--seq 4096] [--steps 6] [--warmup 2] [--json out.json]
    python scripts/bench.py host [--repeat 20] recipe=tiny data.seq_len=16 [mesh.tp=2] [overrides ...]
    python scripts/bench.py activations [--docs 60] recipe=tiny model=qwen3_5_27b data.seq_len=4096 [overrides ...]
    python scripts/bench.py data_workers [--workers 0 2 4] [--videos 24] [--frames 16] [overrides ...]
    python scripts/bench.py media [--frames 16] [--size 360 640] [--json out.json] [--profile PATH] [overrides ...]
    python scripts/bench.py attention [--json out.json]
    python scripts/bench.py idle DIR/rank0.json.gz [--min-us 20] [--top 15] [--json out.json]
    python scripts/bench.py compare A.json B.json [--scale-a 0.25] [--top 30] [--json out.json]

| mode | what it measures | needs |
|---|---|---|
| train | `qwenft train` in-process: step time, tokens/s, TFLOP/s, MFU, peak memory of every rank | GPUs (or the CPU) |
| kernels | qwenft's Triton kernels (fused AdamW, fused linear CE, the causal conv, the embedding's backward) against the paths they replace | CUDA (the conv part: fla) |
| layers | one 27B-shaped layer of each kind: fla against torch agreement, forward + backward time | CUDA |
| fused | a layer's elementwise pieces, eager and compiled, against liger's and fla's fused modules | CUDA |
| moe | a Qwen3.5-MoE training step, qwenft against transformers on the same weights | CUDA |
| host | the host's time per decoder layer (kernels too small to matter) | CPU |
| activations | the activation bytes per token autograd keeps, against `qwenft plan`'s estimate | CUDA or CPU |
| data_workers | VLM video steps with micro batches made by `data.num_workers` threads, against batches made before the run | CUDA (or the CPU) |
| media | tokens/s of VLM video micro batches against image micro batches of the same token counts; the vision tower's share of a step | CUDA (or the CPU) |
| attention | causal attention at the 27B's head sizes through torch's kernels (qwenft's varlen flash, SDPA cuDNN and flash, flex): time and TFLOP/s | CUDA |
| idle | where the GPU idles in a timeline that `train --profile F --trace DIR` wrote: gaps per step, by the host op that launched the kernel after each | a trace file |
| compare | two profiled `train` reports' GPU time per step by kernel kind and by kernel, side by side (one scaled: a quarter of tp1's against a tp4 rank's) | two report files |

`python scripts/bench.py MODE --help` lists a mode's options. Each mode's code is `scripts/bench_modes/MODE.py`.
"""

import importlib
import os
import sys
from pathlib import Path

MODES = ("train", "kernels", "layers", "fused", "moe", "host", "activations", "data_workers", "media", "attention",
         "idle", "compare")

if __name__ == "__main__":
    here = Path(__file__).resolve().parent
    sys.path[:0] = [str(here.parent), str(here)]  # qwenft from this checkout; scripts/bench_modes
    argv = sys.argv[1:]
    mode = argv.pop(0) if argv and argv[0] in MODES else "train"
    if mode == "train" and argv and not argv[0].startswith("-") and "=" not in argv[0]:
        print(f"bench.py: unknown mode {argv[0]!r}: the first argument is one of {', '.join(MODES)}, an option "
              "or a KEY=VALUE override (a training step)", file=sys.stderr)
        sys.exit(2)
    importlib.import_module(f"bench_modes.{mode}").main(argv)
    # Everything is written. Leave without the interpreter's finalization: c10d objects (gloo's work and worker
    # threads) torn down there can still abort a finished rank with SIGABRT, which torchrun reports as a failure.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
