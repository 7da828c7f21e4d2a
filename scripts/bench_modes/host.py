"""Host-side time of one microbatch's forward + backward per decoder layer, with kernels too small to matter.

    python scripts/bench.py host [--repeat 20] recipe=tiny data.seq_len=16 [mesh.tp=2] \
        [model.activation_checkpointing=true] [model.compile=true] [model.kernels.weight_grad=in_matmul]

Builds the model as `qwenft train` does up to FSDP (tensor parallel over mesh.tp on a fake process group,
whose collectives send nothing; activation checkpointing; the weight gradients added in their matmuls when
model.kernels.weight_grad=in_matmul), on the CPU in fp32, and times forward + backward of
one microbatch of `data.seq_len` tokens. With the tiny model and a few tokens the kernels take microseconds,
so what is timed is the host's work per op: Python, torch's dispatch, DTensor where parameters pass
through it, autograd and the recompute. That work does not depend on the model's dimensions, only on
its structure (ops per layer), so the time per decoder layer carries over to the 27B shape. Leaves out FSDP,
the collectives' own cost and CUDA's launch latency. GatedDeltaNet's delta rule runs as a single stand-in op,
as fla's kernels are a few launches (the torch reference's chunk loop would dominate). A GPU step is
host-bound where this time per microbatch exceeds the GPU's.
"""

import argparse
import json
import statistics
import time

import torch

from qwenft.conf import compose


def _stand_in_delta_rule(q, k, v, g, beta, cu_seqlens):
    """Shapes and autograd of the delta rule's output, in one op per input."""
    return v * beta[..., None] + q.sum(-1, keepdim=True) * g[..., None]


def build(cfg):
    from qwenft.distributed.activation_checkpointing import apply_activation_checkpointing
    from qwenft.conf.layout import resolve_layout
    from qwenft.distributed.fake_pg import init_fake_process_group
    from qwenft.distributed.mesh import build_mesh
    from qwenft.distributed.parallelize import apply_compile
    from qwenft.distributed.tensor_parallel import apply_tp, validate_tp
    from qwenft.models import weight_grad
    from qwenft.models.loader import build_model, init_random_weights
    from qwenft.train.build import model_config

    model_cfg = model_config(cfg)
    validate_tp(model_cfg.text, cfg.mesh.tp)
    init_fake_process_group(cfg.mesh.tp)
    layout = resolve_layout(cfg.mesh.tp, 1, 1, cfg.mesh.tp)
    model = build_model(model_cfg, kernels="torch", attention_kernel="sdpa", device="meta", dtype=torch.float32)
    if cfg.mesh.tp > 1:
        apply_tp(model, build_mesh(layout, device="cpu")["tp"], vocab_parallel=cfg.mesh.vocab_parallel,
                 sequence_parallel=cfg.mesh.sequence_parallel)
    if cfg.model.activation_checkpointing != "false":
        apply_activation_checkpointing(model, cfg.model.activation_checkpointing)
    if cfg.model.compile:
        apply_compile(model)
    in_matmul = cfg.model.kernels.weight_grad == "in_matmul"
    if in_matmul:
        weight_grad.enable(model)
    init_random_weights(model, seed=0, device="cpu", dtype=torch.float32)
    if in_matmul:  # the buffers made once and never zeroed: every microbatch adds, as within a step
        weight_grad.prepare_grads([model])
    return model, model_cfg.text.vocab_size


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="bench.py host", description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20, help="timed microbatches (after two warm-ups)")
    args, overrides = parser.parse_known_args(argv)
    cfg = compose(overrides, missing_ok=True)
    import qwenft.models.qwen3_5.gdn as gdn

    gdn._torch_delta_rule = _stand_in_delta_rule
    model, vocab = build(cfg)
    ids = torch.randint(0, vocab, (cfg.train.micro_batch_size, cfg.data.seq_len))
    times = []
    for _ in range(args.repeat + 2):
        start = time.perf_counter()
        model(input_ids=ids).float().sum().backward()
        times.append(time.perf_counter() - start)
    ms = 1e3 * statistics.median(times[2:])
    print(json.dumps({"overrides": overrides, "host_ms_per_microbatch": round(ms, 2),
                      "host_ms_per_layer": round(ms / len(model.layers), 2)}))

