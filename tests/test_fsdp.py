"""FSDP2 units and mixed precision: bf16 compute for the model, fp32 for GatedDeltaNet's decay parameters; the
embedding and the head (final norm + lm_head) as units of their own."""

import dataclasses

import pytest
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


def _tiny(tied: bool, device="meta"):
    from qwenft.models.loader import build_model
    from qwenft.models.qwen3_5.configs import named_config

    cfg = dataclasses.replace(named_config("tiny"), tie_word_embeddings=tied)
    return build_model(cfg, kernels="torch", device=device, dtype=torch.float32)


def _batch():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (2, 24), generator=gen)
    labels = torch.randint(0, 512, (2, 24), generator=gen)
    labels[:, ::4] = -100
    return ids, labels


def _edge_units_step(rank, world_size, tied):
    """One forward + backward on dp ranks, each with one row of the batch; records which of embed_tokens and
    lm_head are all-gathered (plain tensors, not sharded DTensors) while layer 0 runs its forward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from qwenft.distributed.fsdp import apply_fsdp
    from qwenft.models.loader import init_random_weights

    model = _tiny(tied)
    apply_fsdp(model, init_device_mesh("cpu", (world_size,)), torch.float32)
    init_random_weights(model, seed=0, device="cpu", dtype=torch.float32)
    gathered = {}
    model.layers["0"].register_forward_hook(lambda m, i, o: gathered.update(
        embed=not isinstance(model.embed_tokens.weight, DTensor), head=not isinstance(model.lm_head.weight, DTensor)))
    ids, labels = _batch()
    loss = model(input_ids=ids[rank:rank + 1], labels=labels[rank:rank + 1])
    loss.backward()
    return loss.item(), gathered, {n: p.grad.full_tensor() for n, p in model.named_parameters()}


@pytest.mark.parametrize("tied", [False, True])
def test_embedding_and_head_units_gather_only_around_their_own_forward(tied):
    """dp2: the embedding and the head are resharded while the layers run (tied: one parameter, kept in the
    root's unit, so gathered); loss and gradients equal one process's on the whole batch (gradients summed)."""
    from qwenft.models.loader import init_random_weights

    ref_model = init_random_weights(_tiny(tied), seed=0, device="cpu", dtype=torch.float32)
    ids, labels = _batch()
    ref = ref_model(input_ids=ids, labels=labels)
    ref.backward()
    out = run_distributed(_edge_units_step, 2, tied)
    assert abs(sum(loss for loss, _, _ in out) - ref.item()) <= 1e-5 * abs(ref.item())
    for _, gathered, grads in out:
        assert gathered == {"embed": tied, "head": tied}
        assert sorted(grads) == sorted(n for n, _ in ref_model.named_parameters())
        for name, p in ref_model.named_parameters():
            err = ((grads[name] - p.grad).norm() / p.grad.norm()).item()
            assert err < 1e-5, (name, err)
