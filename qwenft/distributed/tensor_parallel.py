"""Tensor parallelism for the native Qwen3.5 decoder: every projection sharded by head over the "tp" mesh.

| module                         | placement                                                             |
|--------------------------------|-----------------------------------------------------------------------|
| full attention q/k/v_proj      | column-parallel (q_proj rows are [head, query|gate], so heads stay whole) |
| full attention o_proj          | row-parallel (all-reduce of the output)                              |
| q_norm / k_norm weight         | replicated; grad summed over tp (`attention.local`)                    |
| GDN q/k/v/z/a/b_proj           | column-parallel: a contiguous split of key heads and of value heads keeps each key head's value heads on its rank |
| GDN conv_q/conv_k/conv_v, A_log, dt_bias | Shard(0) (per channel / per value head)                      |
| GDN gated norm weight          | replicated; grad summed over tp                                        |
| GDN out_proj, MLP down_proj    | row-parallel                                                           |
| MLP gate/up_proj               | column-parallel                                                        |
| embed_tokens / lm_head         | vocab_parallel: Shard(0) over vocab (masked lookup + all-reduce; logits stay a DTensor sharded on vocab, `qwenft.train.loss.token_ce_sum` takes it); else plain, replicated |
| layer norms, final norm, vision tower | plain, replicated (identical compute and grads on every tp rank) |

The residual stream between blocks is replicated (no sequence parallelism yet).
"""

import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from qwenft.models.qwen3_5.configs import FULL_ATTENTION, LINEAR_ATTENTION, TextConfig


def validate_tp(text: TextConfig, tp: int) -> None:
    """Raise before anything is built when a head count of `text` cannot be split evenly over `tp` ranks."""
    if tp < 1:
        raise ValueError(f"mesh.tp={tp}; it must be >= 1")
    counts = [("num_attention_heads", text.num_attention_heads, "full attention query heads"),
              ("num_key_value_heads", text.num_key_value_heads, "full attention key/value heads"),
              ("linear_num_key_heads", text.linear_num_key_heads, "GatedDeltaNet key heads"),
              ("linear_num_value_heads", text.linear_num_value_heads, "GatedDeltaNet value heads")]
    kinds = set(text.layer_types)
    counts = [c for c in counts if (FULL_ATTENTION if c[0].startswith("num_") else LINEAR_ATTENTION) in kinds]
    for key, n, what in counts:
        if n % tp:
            valid = [d for d in range(1, n + 1) if all(c % d == 0 for _, c, _ in counts)]
            raise ValueError(f"mesh.tp={tp} does not divide {key}={n} ({what}); valid mesh.tp: {valid}")


def _shard_param(module: nn.Module, name: str, mesh: DeviceMesh, placement) -> None:
    p = getattr(module, name)
    # src_data_rank=None: every rank already holds the same (meta or loaded) tensor; no communication
    dt = distribute_tensor(p.data, mesh, [placement], src_data_rank=None)
    module.register_parameter(name, nn.Parameter(dt, requires_grad=p.requires_grad))


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, vocab_parallel: bool = True) -> None:
    """Shard `model` (a `Qwen3_5Model` or one pipeline stage of it, usually on the meta device) over `tp_mesh`.

    Call `validate_tp` first. Weights are not moved: loading afterwards (`qwenft.models.loader`) reads each
    rank's rows only.
    """
    col, row = ColwiseParallel(), RowwiseParallel()
    for layer in model.layers.values():
        if layer.layer_type == FULL_ATTENTION:
            plan = {"self_attn.q_proj": col, "self_attn.k_proj": col, "self_attn.v_proj": col,
                    "self_attn.o_proj": row}
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                _shard_param(norm, "weight", tp_mesh, Replicate())
        else:
            gdn = layer.linear_attn
            plan = {f"linear_attn.{p}_proj": col for p in "qkvzab"} | {"linear_attn.out_proj": row}
            for name in ("conv_q", "conv_k", "conv_v", "A_log", "dt_bias"):
                _shard_param(gdn, name, tp_mesh, Shard(0))
            _shard_param(gdn.norm, "weight", tp_mesh, Replicate())
        plan |= {"mlp.gate_proj": col, "mlp.up_proj": col, "mlp.down_proj": row}
        parallelize_module(layer, tp_mesh, plan)
    if vocab_parallel:
        plan = {}
        if model.embed_tokens is not None:
            plan["embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        if model.lm_head is not None:
            # logits stay a DTensor sharded on vocab: token_ce_sum runs a vocab-parallel cross-entropy on it
            plan["lm_head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
        parallelize_module(model, tp_mesh, plan)
        if hasattr(model, "tie_weights"):  # both now Shard(0) over vocab: share the one DTensor again
            model.tie_weights()


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0, pp_group=None) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` for parameters on different meshes, optionally over pipeline stages.

    TP + FSDP leaves (dp, tp) DTensors for sharded weights next to dp-only DTensors (or plain tensors) for
    replicated ones, and torch's version refuses to stack norms from different meshes. Each mesh's norm is
    reduced on its own, then combined (and over `pp_group`, each stage holding its own parameters). Returns
    the total norm as a plain tensor, equal on all ranks, as one process would compute it.
    """
    params = [p for p in parameters if p.grad is not None]
    groups = defaultdict(list)
    for p in params:
        groups[p.grad.device_mesh if isinstance(p.grad, DTensor) else None].append(p.grad)
    norms = []
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    device = params[0].device if params else None
    total = torch.linalg.vector_norm(torch.stack(norms), norm_type) if norms else torch.zeros((), device=device)
    total = total.float()
    if pp_group is not None:
        if math.isinf(norm_type):
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=pp_group)
        else:
            total = total**norm_type
            dist.all_reduce(total, group=pp_group)
            total = total ** (1.0 / norm_type)
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    with torch.no_grad():
        for grads in groups.values():
            for g in grads:
                (g.to_local() if isinstance(g, DTensor) else g).mul_(coef.to(g.dtype))
    return total
