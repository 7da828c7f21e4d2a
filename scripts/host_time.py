"""Host-side time of one microbatch's forward + backward, with no kernel run: what the CPU must keep up with.

    python scripts/host_time.py [--repeat 4] recipe=tiny model=qwen3_5_27b model.num_layers=8 data.seq_len=4096 \
        [mesh.tp=2] [model.activation_checkpointing=true]

Builds the model as `qwenft train` does up to FSDP (tensor parallel over mesh.tp on a fake process group,
activation checkpointing), on the meta device, and times forward + backward of one microbatch of
`data.seq_len` tokens: Python, torch's dispatch, DTensor's sharding propagation and redistributions, autograd
and checkpointing all run, kernels do not. Leaves out FSDP (it refuses meta parameters) and the collectives'
own cost. GatedDeltaNet's delta rule runs as a single stand-in op, as fla's kernels are a few launches (the
torch reference's chunk loop would dominate). On a GPU the step is host-bound where this time per microbatch
exceeds the GPU's.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from qwenft.cli import compose  # noqa: E402


def _stand_in_delta_rule(q, k, v, g, beta, cu_seqlens):
    """Shapes and autograd of the delta rule's output, in one op per input."""
    return v * beta[..., None] + q.sum(-1, keepdim=True) * g[..., None]


def build(cfg):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from qwenft.distributed.activation_checkpointing import apply_activation_checkpointing
    from qwenft.distributed.mesh import build_mesh, resolve_layout
    from qwenft.distributed.tensor_parallel import apply_tp, validate_tp
    from qwenft.models.loader import build_model
    from qwenft.train.runner import _model_config

    model_cfg = _model_config(cfg)
    validate_tp(model_cfg.text, cfg.mesh.tp)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=cfg.mesh.tp)
    layout = resolve_layout(cfg.mesh.tp, 1, 1, cfg.mesh.tp)
    model = build_model(model_cfg, kernels="torch", attention_kernel="sdpa", device="meta", dtype=torch.bfloat16)
    if cfg.mesh.tp > 1:
        apply_tp(model, build_mesh(layout, device="cpu")["tp"], vocab_parallel=cfg.mesh.vocab_parallel,
                 sequence_parallel=cfg.mesh.sequence_parallel)
    if cfg.model.activation_checkpointing != "false":
        apply_activation_checkpointing(model, cfg.model.activation_checkpointing)
    return model


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=4, help="timed microbatches (after one warm-up)")
    args, overrides = parser.parse_known_args()
    cfg = compose(overrides, missing_ok=True)
    import qwenft.models.qwen3_5.gdn as gdn

    gdn._torch_delta_rule = _stand_in_delta_rule
    model = build(cfg)
    ids = torch.randint(0, 1000, (cfg.train.micro_batch_size, cfg.data.seq_len), device="meta")
    times = []
    for _ in range(args.repeat + 1):
        start = time.perf_counter()
        model(input_ids=ids).float().sum().backward()
        times.append(time.perf_counter() - start)
    print(json.dumps({"overrides": overrides, "host_ms_per_microbatch": round(1e3 * statistics.median(times[1:]), 1)}))


if __name__ == "__main__":
    main()
