"""Bandwidth of NCCL's all-reduce, reduce-scatter and all-gather between this host's GPUs, per message size.

    torchrun --nproc-per-node 2 scripts/collective_bandwidth.py [--sizes-mib 1 4 40 160] [--dtype bfloat16]

Tensor parallelism all-reduces (or reduce-scatters and all-gathers) each layer's activations, seq x hidden
values: 40 MiB in bf16 for 4096 tokens of the 27B shape; FSDP moves each unit's parameters and gradients.
Prints one JSON line per collective and size, from rank 0: the median time of `--repeat` calls after a warm-up,
the algorithm bandwidth (message bytes over time) and the bus bandwidth (NCCL's convention: what each link
carried, (n - 1) / n of the message for reduce-scatter and all-gather, 2 (n - 1) / n for all-reduce). Compare
the bus bandwidth with the link's: a few tens of GB/s at 40 MiB or more means the GPUs talk through host
memory, not NVLink
(run with NCCL_DEBUG=INFO to see the transport NCCL chose). Without GPUs it runs gloo on the CPU.
"""

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist


def timed(fn, repeat: int, cuda: bool) -> float:
    """Median seconds of `fn` over `repeat` calls after three warm-up calls (synchronizing the GPU around each)."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeat):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 4, 16, 40, 160])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo")  # gloo: the CPU, for a quick check of the script
    device = "cuda" if cuda else "cpu"
    n = dist.get_world_size()
    dtype = getattr(torch, args.dtype)
    # renamed in torch 2.13; the GPU image's 2.11 has only the old names
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    for mib in args.sizes_mib:
        numel = int(mib * 2**20) // dtype.itemsize // n * n
        full = torch.ones(numel, dtype=dtype, device=device)
        shard = torch.empty(numel // n, dtype=dtype, device=device)
        nbytes = numel * dtype.itemsize
        for name, fn, bus in (
            ("all_reduce", lambda: dist.all_reduce(full), 2 * (n - 1) / n),
            ("reduce_scatter", lambda: reduce_scatter(shard, full), (n - 1) / n),
            ("all_gather", lambda: all_gather(full, shard), (n - 1) / n),
        ):
            seconds = timed(fn, args.repeat, cuda)
            if dist.get_rank() == 0:
                print(json.dumps({"collective": name, "mib": mib, "ranks": n, "dtype": args.dtype,
                                  "ms": round(seconds * 1e3, 3), "algbw_gbs": round(nbytes / seconds / 1e9, 1),
                                  "busbw_gbs": round(bus * nbytes / seconds / 1e9, 1)}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
