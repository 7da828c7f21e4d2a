"""FSDP2 over the data-parallel mesh: one `fully_shard` per decoder layer, then the root."""

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, param_dtype: torch.dtype,
               reshard_after_forward: bool = True, reduce_dtype: torch.dtype = torch.float32) -> None:
    """Shard every decoder layer and the root; gradients are reduced in `reduce_dtype` and summed, not averaged.

    The loss is already divided by the label tokens of the whole global batch (qwenft.train.loss), so the
    default 1/dp averaging of FSDP would count data parallel ranks twice.

    `reduce_dtype` is also the dtype gradients accumulate in over the microbatches of a step while sync is off
    (FSDP keeps an unsharded accumulator in it): fp32 costs 4 bytes per parameter there even with bf16 weights,
    bf16 (with bf16 weights, optim.master_dtype=bfloat16) keeps gradients in bf16 throughout.
    """
    from qwenft.models.qwen3_5.gdn import Decay

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    for module in model.modules():  # GDN's decay parameters stay fp32 in a bf16 model (gdn.Decay)
        if isinstance(module, Decay):
            fully_shard(module, mesh=dp_mesh, mp_policy=fp32, reshard_after_forward=reshard_after_forward)
    for layer in model.layers.values():
        fully_shard(layer, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM


def set_microbatch_grad_sync(model: nn.Module, is_last: bool, reduce_grad_per_microbatch: bool) -> None:
    """Gradient-accumulation policy for the microbatches of one optimizer step.

    reduce_grad_per_microbatch=False: keep unsharded gradients across microbatches and reduce-scatter once,
    after the last one: fewest collectives, but a full-size gradient accumulator. Parameters also stay
    unsharded from one microbatch's backward to the next one's forward (one all-gather saved each).
    True: reduce-scatter after every microbatch so gradients stay sharded: 1/dp of the memory, more
    collectives.
    """
    if not isinstance(model, FSDPModule):
        return
    sync = reduce_grad_per_microbatch or is_last
    model.set_requires_gradient_sync(sync)
    model.set_reshard_after_backward(sync)
