"""Expert parallelism for Qwen3.5-MoE: the routed experts shared out over the "ep" ranks of the mesh.

| parameter                                   | placement                                                  |
|---------------------------------------------|------------------------------------------------------------|
| mlp.experts.gate_up_proj [E, 2I, H]         | Shard(0) over ep (E/ep experts a rank); FSDP over dp_outer  |
| mlp.experts.down_proj [E, H, I]             | Shard(0) over ep; FSDP over dp_outer                        |
| everything else (router, shared expert, ...) | FSDP over the whole dp, as without ep                       |

ep ranks are carved from the data-parallel ranks (qwenft.distributed.mesh: dp = dp_outer x ep). Each ep rank
routes its own tokens; `moe.dispatch_combine` sends each routed row to the rank of its expert and back. An
expert's gradient is then the sum over the rows every ep rank sent it, so its FSDP unit reduces over dp_outer
only (the ranks that hold the same experts), with the same summed-loss convention as every other gradient.
The weights stay DTensors over ep, so DCP checkpoints, the HF loader and the export see the whole [E, ...]
tensors: a checkpoint resumes on any ep. With peft=lora the experts (no adapters: they are not linear layers)
stay frozen and expert-parallel all the same.
"""

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from qwenft.distributed.tensor_parallel import shard_param
from qwenft.models.qwen3_5.configs import TextConfig
from qwenft.models.qwen3_5.moe import MoE


def validate_ep(text: TextConfig, ep: int) -> None:
    """Raise before anything is built when the model cannot be split over `ep` expert-parallel ranks."""
    if ep == 1:
        return
    if not text.is_moe:
        raise ValueError(f"mesh.ep={ep} shares out the experts of an MoE model, but this model is dense; "
                         f"use mesh.ep=1")
    if text.num_experts % ep:
        valid = [d for d in range(1, text.num_experts + 1) if text.num_experts % d == 0]
        raise ValueError(f"mesh.ep={ep} does not divide num_experts={text.num_experts}; valid mesh.ep: {valid} "
                         f"(that also divide mesh.dp)")


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Shard every MoE layer's experts over `ep_mesh` (on meta: no data moves; the loader fills each rank's
    experts) and give the layer the group its tokens are exchanged in. FSDP then wraps each `experts` as a unit
    of its own over dp_outer (`fsdp.apply_fsdp`'s `expert_mesh`)."""
    for module in model.modules():
        if not isinstance(module, MoE):
            continue
        for name in ("gate_up_proj", "down_proj"):
            shard_param(module.experts, name, ep_mesh, Shard(0))
        module.ep_group = ep_mesh.get_group()
