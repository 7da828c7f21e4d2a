"""FSDP2 mixed precision: bf16 compute for the model, fp32 for GatedDeltaNet's decay parameters."""

import torch

from distributed import run_distributed


def _dtypes_seen_in_forward(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    from qwenft.distributed.fsdp import apply_fsdp
    from qwenft.models.loader import build_model, init_random_weights
    from qwenft.models.qwen3_5.configs import named_config

    model = build_model(named_config("tiny"), kernels="torch", device="meta")
    apply_fsdp(model, init_device_mesh("cpu", (world_size,)), torch.bfloat16)
    init_random_weights(model, seed=0, device="cpu", dtype=torch.float32)
    seen = {}
    gdn = model.layers["0"].linear_attn
    gdn.decay.register_forward_hook(lambda m, i, o: seen.update(A_log=m.A_log.dtype, g=o.dtype))
    gdn.q_proj.register_forward_hook(lambda m, i, o: seen.update(q_proj=m.weight.dtype))
    model(input_ids=torch.randint(0, 512, (1, 16))).float().sum().backward()
    seen["A_log_grad"] = gdn.decay.A_log.grad.dtype
    return seen


def test_decay_parameters_stay_fp32_under_bf16_fsdp():
    for seen in run_distributed(_dtypes_seen_in_forward, 2):
        assert seen == {"q_proj": torch.bfloat16, "A_log": torch.float32, "g": torch.float32,
                        "A_log_grad": torch.float32}, seen
