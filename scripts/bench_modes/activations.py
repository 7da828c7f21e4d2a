"""Activation bytes per token of one decoder layer of each kind, measured, against `qwenft plan`'s estimate.

    python scripts/bench.py activations [--docs 60] recipe=tiny model=qwen3_5_27b data.seq_len=4096 [mesh.tp=...]

Builds one layer of each kind (GatedDeltaNet + MLP, gated attention + MLP) at the model's dims in the compute
dtype, on CUDA when there is one, runs its forward on one row of data.seq_len tokens (packed into `--docs`
documents, as the benchmarks' data is) and counts what autograd keeps for the backward two ways: the storages
its saved-tensor hooks see, and the allocator's growth over the forward. Prints both per token next to
`qwenft.train.activations.layer_activation_bytes`, the number the planner multiplies by tokens and microbatches.
"""

import argparse
import json

import torch

from qwenft.conf import compose
from qwenft.models.qwen3_5.attention import RotaryEmbedding
from qwenft.models.qwen3_5.configs import FULL_ATTENTION, LINEAR_ATTENTION
from qwenft.models.qwen3_5.model import DecoderLayer
from qwenft.train.activations import layer_activation_bytes, saved_tensor_bytes
from qwenft.train.build import model_config
from qwenft.train.spec import resolve_dtypes


def measure(layer, h, rope, cu_seqlens) -> tuple[float, float | None]:
    """(bytes autograd saves, bytes the allocator grew by: CUDA only) over one forward, both per token."""
    cuda = h.is_cuda
    if cuda:
        torch.cuda.synchronize()
    before = torch.cuda.memory_allocated() if cuda else 0
    with saved_tensor_bytes(*layer.parameters(), h) as saved:
        out = layer(h, rope, cu_seqlens)
    tokens = h.shape[0] * h.shape[1]
    grown = (torch.cuda.memory_allocated() - before - out.nbytes) / tokens if cuda else None
    return sum(saved.values()) / tokens, grown


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="bench.py activations", description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=60, help="packed documents in the row (1 = unpacked)")
    args, overrides = parser.parse_known_args(argv)
    cfg = compose(overrides, missing_ok=True)
    t = model_config(cfg).text
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = resolve_dtypes(cfg, "cuda").compute
    tokens = cfg.data.seq_len
    bounds = torch.linspace(0, tokens, args.docs + 1).round().to(torch.int32)
    cu_seqlens = bounds.to(device) if args.docs > 1 else None
    positions = torch.cat([torch.arange(int(e - s)) for s, e in zip(bounds[:-1], bounds[1:])])[None].to(device)
    rope = RotaryEmbedding(t).to(device)
    rope.reset()
    rope_cs = rope(positions, dtype)
    report = {"tokens": tokens, "docs": args.docs, "dtype": str(dtype), "device": str(device), "layers": {}}
    for kind in (LINEAR_ATTENTION, FULL_ATTENTION):
        layer_id = t.layer_types.index(kind)
        with torch.device(device):
            layer = DecoderLayer(t, layer_id, cfg.model.kernels.gdn)
        for name, p in layer.named_parameters():
            p.data = p.data.to(torch.float32 if name.endswith(("A_log", "dt_bias")) else dtype)
        h = torch.randn(1, tokens, t.hidden_size, device=device, dtype=dtype, requires_grad=True)
        saved, grown = measure(layer, h, rope_cs, cu_seqlens)
        report["layers"][kind] = {"saved_per_token": saved, "allocated_per_token": grown,
                                  "planned_per_token": layer_activation_bytes(t, kind, 1, dtype.itemsize)}
        del layer, h
    print(json.dumps(report, indent=2))

