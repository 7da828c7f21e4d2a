"""One rank of tests/gpu/test_multi_gpu.py's runs, started by torchrun:

    python -m torch.distributed.run --standalone --nproc-per-node N tests/gpu/multi_gpu_rank.py OUT_DIR OVERRIDE...

trains `qwenft train OVERRIDE...` through the runner's loop and writes OUT_DIR/rank<R>.json: every step's loss and,
for each parameter whose local tensor is the same on every tensor-parallel rank, a hash of its bytes (exact to the
bit); those tensors themselves go to OUT_DIR/rank<R>_replicated.pt. Replicated over tp: a plain tensor (norms, the
MoE block, the vision tower: qwenft.distributed.tensor_parallel's table) and a DTensor placed Replicate on the "tp"
mesh dimension or not laid over it (q_norm, k_norm, GatedDeltaNet's gated norm; FSDP's dp shards, which tp peers
hold alike).
"""

import hashlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: helpers.py
from helpers import train_job  # noqa: E402


def replicated_on_tp(p) -> bool:
    if not isinstance(p, DTensor):
        return True
    names = p.device_mesh.mesh_dim_names or ()
    return "tp" not in names or isinstance(p.placements[names.index("tp")], Replicate)


def checksum(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def main(out_dir: Path, overrides: list[str]) -> None:
    job, result = train_job(overrides)
    replicated = {n: (p.to_local() if isinstance(p, DTensor) else p).detach().cpu()
                  for m in job.model_parts for n, p in m.named_parameters() if replicated_on_tp(p)}
    report = {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "device": str(job.device),
              "losses": result.losses, "skipped_steps": result.skipped_steps,
              "replicated_on_tp": {n: checksum(t) for n, t in replicated.items()}}
    # the values too (the tiny models': a few MB), so that a checksum mismatch can say by how much they differ
    torch.save(replicated, out_dir / f"rank{dist.get_rank()}_replicated.pt")
    path = out_dir / f"rank{dist.get_rank()}.json"
    path.with_suffix(".part").write_text(json.dumps(report))
    path.with_suffix(".part").replace(path)  # a rank that died mid-write leaves no report


if __name__ == "__main__":
    try:
        main(Path(sys.argv[1]), sys.argv[2:])
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
