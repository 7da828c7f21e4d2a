"""FSDP2 over the data-parallel mesh: one `fully_shard` per decoder layer, the embedding and the head, then the root."""

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard


def edge_units(model: nn.Module) -> list:
    """What `apply_fsdp` shards as units of their own besides the layers: `embed_tokens`, and the final norm
    with `lm_head` as one unit (as torchtitan does with norm + output), where this model or stage has them.

    Each is all-gathered only around its own forward and backward, instead of from the forward's start to the
    backward's end as in the root (for the 27B vocabulary 248,320 x 5,120: 1.27 B parameters each). Tied
    embeddings (one parameter for both) stay in the root: one parameter, one unit. The vision tower stays in
    the root too.
    """
    embed, head = getattr(model, "embed_tokens", None), getattr(model, "lm_head", None)
    if embed is not None and head is not None and head.weight is embed.weight:
        return []
    units = [embed] if embed is not None else []
    return units + ([[model.norm, head]] if head is not None else [])


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, param_dtype: torch.dtype,
               reshard_after_forward: bool = True, reduce_dtype: torch.dtype = torch.float32,
               prefetch: int = 0, expert_mesh: DeviceMesh | None = None) -> None:
    """Shard every decoder layer, the embedding, the head (`edge_units`) and the root; gradients are reduced in
    `reduce_dtype` and summed, not averaged.

    `expert_mesh` (expert parallelism, qwenft.distributed.expert_parallel): each MoE layer's `experts`, already
    sharded over ep, become a unit of their own over these ranks (those holding the same experts), inside
    their layer's unit. Where that is one rank (ep = dp) and the experts are stored in the compute dtype, FSDP
    leaves them out (`ignored_params`): there is nothing to shard, reduce or cast, and its all-gather would
    only copy them into a second buffer; each rank's expert gradients are whole already (the all-to-all's
    backward brings every token's), and autograd accumulates them in place.

    Every unit follows `reshard_after_forward`: the head too, although its backward comes right after its
    forward, since without `model.ce_chunk_tokens` the loss is computed on the logits after it (a kept head
    would sit gathered next to the fp32 logits). FSDP2's implicit backward prefetch follows the forward's
    order (embedding, layers, head): the head's unit runs first in the backward and prefetches the last
    layer, and layer 0 prefetches the embedding. Training passes `pipeline.stage.reshard_policy` (at pp = 1 too).

    The loss is already divided by the label tokens of the whole global batch (qwenft.models.loss), so the
    default 1/dp averaging of FSDP would count data parallel ranks twice.

    `reduce_dtype` is also the dtype gradients accumulate in over the microbatches of a step while sync is off
    (FSDP keeps an unsharded accumulator in it): fp32 costs 4 bytes per parameter there even with bf16 weights,
    bf16 (with bf16 weights, optim.master_dtype=bfloat16) keeps gradients in bf16 throughout.

    `prefetch` > 0 replaces that implicit prefetching with explicit lists (`set_prefetch`).
    """
    from qwenft.models.qwen3_5.gdn import Decay
    from qwenft.models.qwen3_5.moe import Experts

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    experts = [m for m in model.modules() if isinstance(m, Experts)] if expert_mesh is not None else []
    ignored = set()
    if expert_mesh is not None and expert_mesh.size() == 1:
        ignored = {p for m in experts for p in m.parameters() if p.dtype == param_dtype}
    for module in model.modules():  # GDN's decay parameters stay fp32 in a bf16 model (gdn.Decay)
        if isinstance(module, Decay):
            fully_shard(module, mesh=dp_mesh, mp_policy=fp32, reshard_after_forward=reshard_after_forward)
    for module in experts:
        if not ignored.issuperset(module.parameters()):
            fully_shard(module, mesh=expert_mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    # the MTP head (model.mtp=train|head): its layer a unit like the trunk's, its fc and norms one more
    mtp = [] if getattr(model, "mtp", None) is None else [model.mtp]
    for unit in model.decoder_layers() + mtp + edge_units(model):
        fully_shard(unit, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward,
                    ignored_params=ignored or None)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward,
                ignored_params=ignored or None)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
    if prefetch:
        set_prefetch(model, prefetch)


def set_prefetch(model: nn.Module, count: int) -> None:
    """Each unit of the forward chain (embedding, layers in order, head; `edge_units`), when its forward starts,
    issues the all-gathers of the next `count` units, and when its backward starts those of the `count` units
    before it (nearest first). Without it FSDP2 prefetches one unit ahead in the backward only; in the forward
    each unit's all-gather is issued when the CPU reaches that unit. More units in flight: more overlap, and
    up to `count` + 1 units' parameters all-gathered at once, `count` - 1 more than FSDP2's own prefetching
    (qwenft.train.plan counts them).

    The head unit `fully_shard([norm, lm_head])` returns the plain list; both modules become FSDPModules of one
    state, so `model.norm` stands for it. The root and GDN's fp32 `Decay` units stay outside the chain: the
    root is gathered for the whole forward, and a Decay unit is gathered by its own layer's forward.
    """
    edges = edge_units(model)
    embed = [unit for unit in edges if not isinstance(unit, list)]
    head = [unit[0] for unit in edges if isinstance(unit, list)]
    chain = embed + list(model.layers.values()) + head
    for i, unit in enumerate(chain):
        unit.set_modules_to_forward_prefetch(chain[i + 1:i + 1 + count])
        unit.set_modules_to_backward_prefetch(chain[max(i - count, 0):i][::-1])


def param_groups(fsdp_state) -> list:
    """FSDP's parameter groups of one `fully_shard.state(...)`: a list from torch 2.13 (`_fsdp_param_groups`),
    one group or None before (`_fsdp_param_group`, torch 2.11). No public accessor yet."""
    groups = getattr(fsdp_state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(fsdp_state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return groups


def set_microbatch_grad_sync(model: nn.Module, is_last: bool, reduce_grad_per_microbatch: bool) -> None:
    """Gradient-accumulation policy for the microbatches of one optimizer step.

    reduce_grad_per_microbatch=False: keep unsharded gradients across microbatches and reduce-scatter once,
    after the last one: fewest collectives, but a full-size gradient accumulator. Parameters also stay
    unsharded from one microbatch's backward to the next one's forward; with reshard_after_forward=False
    (`pipeline.stage.reshard_policy`, knob off) each unit then all-gathers once per step.
    True: reduce-scatter after every microbatch so gradients stay sharded: 1/dp of the memory, more
    collectives.
    """
    if not isinstance(model, FSDPModule):
        return
    sync = reduce_grad_per_microbatch or is_last
    model.set_requires_gradient_sync(sync)
    model.set_reshard_after_backward(sync)
