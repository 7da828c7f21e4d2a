"""FSDP2 units and mixed precision: bf16 compute for the model, fp32 for GatedDeltaNet's decay parameters; the
embedding and the head (final norm + lm_head) as units of their own."""

import dataclasses

import pytest
import torch

from distributed import run_distributed
from helpers import compose, parity_overrides, run_qwenft, train_with_state


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


@pytest.mark.distributed
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


@pytest.mark.distributed
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


@pytest.mark.distributed
def test_prefetch_trains_the_same_numbers(tmp_path):
    """dp2, fp32: 3 optimizer steps with mesh.fsdp_prefetch=2 (two units all-gathered ahead) give the losses and
    parameters of FSDP2's implicit prefetching, bit for bit: prefetching moves when an all-gather is issued,
    not what it gathers."""
    runs = {}
    for prefetch in (0, 2):
        runs[prefetch] = run_distributed(train_with_state, 2, parity_overrides(
            tmp_path / str(prefetch), "data.seq_len=64", "train.global_batch_size=2", "checkpoint.export_hf=false",
            f"mesh.fsdp_prefetch={prefetch}"))[0]
    result, reference = runs[2], runs[0]
    assert len(result.losses) == 3 and reference.losses[0] != reference.losses[-1]
    assert result.losses == reference.losses
    assert result.state_dict.keys() == reference.state_dict.keys()
    for name, ref in reference.state_dict.items():
        assert torch.equal(result.state_dict[name], ref), name


def _lists(model):
    """The units each FSDP unit of `model` prefetches in its forward and its backward, by module name."""
    from torch.distributed.fsdp import FSDPModule

    named = {}  # FSDP state -> module name; the head's norm and lm_head share one state, "norm" names it
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            named.setdefault(module._get_fsdp_state(), name)
    return {name: ([named[s] for s in state._states_to_forward_prefetch],
                   [named[s] for s in state._states_to_backward_prefetch]) for state, name in named.items()}


def _prefetch_lists(rank, world_size, overrides):
    """`_lists` of this rank's stage as `qwenft train` builds it (build.build_model_parts)."""
    from qwenft.conf import compose
    from qwenft.conf.layout import resolve_layout
    from qwenft.distributed.mesh import build_mesh
    from qwenft.train import build, step
    from qwenft.train.spec import resolve_spec

    cfg = compose(overrides)
    layout = resolve_layout(cfg.mesh.tp, cfg.mesh.pp, cfg.mesh.dp, world_size)
    model_cfg = build.model_config(cfg)
    spec = resolve_spec(cfg, layout, model_cfg, "cpu")
    [(_, model)] = build.build_model_parts(cfg, model_cfg, spec, build_mesh(layout))
    return _lists(model)


def _tied_prefetch_lists(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    from qwenft.distributed.fsdp import apply_fsdp

    model = _tiny(tied=True)
    apply_fsdp(model, init_device_mesh("cpu", (world_size,)), torch.float32, prefetch=2)
    return _lists(model)


def _expected_lists(chain, n):
    return {name: (chain[i + 1:i + 1 + n], chain[max(i - n, 0):i][::-1]) for i, name in enumerate(chain)}


@pytest.mark.distributed
def test_prefetch_lists_follow_the_forward_order():
    """mesh.fsdp_prefetch=2 on the tiny model (4 layers), through the runner: each unit prefetches the next two
    in the forward and the two before it in the backward, nearest first; the root and GDN's Decay units are
    left to FSDP2's implicit prefetching (empty lists). Tied embeddings: the root holds both, the chain is the
    layers. bf16 compute on the fp32 weights: FSDP wraps one rank only to cast them (spec.uses_fsdp)."""
    (lists,) = run_distributed(_prefetch_lists, 1, ["recipe=tiny", "mesh.fsdp_prefetch=2", "model.kernels.gdn=torch",
                                                    "model.dtype=bfloat16"])
    layers = ["layers.0", "layers.1", "layers.2", "layers.3"]
    chain = ["embed_tokens", *layers, "norm"]
    expected = _expected_lists(chain, 2)
    assert expected["layers.1"] == (["layers.2", "layers.3"], ["layers.0", "embed_tokens"])
    assert {name: lists[name] for name in chain} == expected
    assert all(lists[name] == ([], []) for name in lists if name not in chain)
    (tied,) = run_distributed(_tied_prefetch_lists, 1)
    assert {name: tied[name] for name in layers} == _expected_lists(layers, 2)
    assert all(tied[name] == ([], []) for name in tied if name not in layers)


@pytest.mark.distributed
def test_prefetch_chain_is_per_pipeline_stage():
    """pp2: each stage chains only its own units (stage 0: embedding, layers 0-1; stage 1: layers 2-3, head)."""
    stages = run_distributed(_prefetch_lists, 2, [
        "recipe=tiny", "mesh.pp=2", "mesh.fsdp_prefetch=1", "model.kernels.gdn=torch", "model.dtype=bfloat16",
        "train.global_batch_size=2", "train.micro_batch_size=1"])
    for lists, chain in zip(stages, (["embed_tokens", "layers.0", "layers.1"], ["layers.2", "layers.3", "norm"])):
        assert {name: lists[name] for name in chain} == _expected_lists(chain, 1)


def test_negative_prefetch_fails_in_validation():
    with pytest.raises(ValueError) as e:
        compose(["mesh.fsdp_prefetch=-1"])
    assert str(e.value) == ("mesh.fsdp_prefetch=-1 must be >= 0 (0 = FSDP2's implicit prefetching, "
                            "N = all-gather N units ahead)")


def _all_gathers_per_step(rank, world_size, knob, microbatches):
    """All-gathers of each decoder-layer unit over one step of `microbatches` at dp2, pp1, built as training
    builds it (build.build_model_parts)."""
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

    from qwenft.conf import compose
    from qwenft.conf.layout import resolve_layout
    from qwenft.distributed.mesh import build_mesh
    from qwenft.train import build, step
    from qwenft.train.spec import resolve_spec

    class Counting(AllGather):
        def __init__(self):
            self.calls = 0

        def allocate(self, size, *, dtype, device):
            return torch.empty(size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            self.calls += 1
            return torch.distributed.all_gather_into_tensor(output_tensor, input_tensor, group=group,
                                                            async_op=async_op)

    cfg = compose(["recipe=tiny", "model.kernels.gdn=torch", f"pipeline.reduce_grad_per_microbatch={knob}",
                   "train.micro_batch_size=1", f"train.global_batch_size={microbatches * world_size}"])
    layout = resolve_layout(1, 1, world_size, world_size)
    device = torch.device("cpu")
    model_cfg = build.model_config(cfg)
    spec = resolve_spec(cfg, layout, model_cfg, device.type)
    [(_, model)] = build.build_model_parts(cfg, model_cfg, spec, build_mesh(layout))
    build.load_weights(model, cfg, spec.dtypes.master, device)
    counters = {name: Counting() for name in model.layers}
    for name, layer in model.layers.items():
        layer.set_custom_all_gather(counters[name])
    ids, labels = _batch()
    mbs = [{"input_ids": ids[i:i + 1], "labels": labels[i:i + 1], "position_ids": torch.arange(24)[None],
            "cu_seqlens": torch.tensor([0, 24], dtype=torch.int32)} for i in range(microbatches)]
    step.accumulate(model, mbs, torch.tensor(float((labels != -100).sum())), device,
                     spec.parallel.reduce_grad_per_microbatch, spec.parallel.ce_in_model)
    return {name: c.calls for name, c in counters.items()}


@pytest.mark.distributed
@pytest.mark.parametrize("knob, microbatches, gathers", [(False, 2, 1), (True, 2, 4), (False, 1, 2)])
def test_layers_all_gather_once_per_step_without_reduce_grad_per_microbatch(knob, microbatches, gathers):
    """pp1, 2 microbatches: knob off, parameters stay gathered from the first forward to the step's one
    reduce-scatter (pipeline.stage.reshard_policy); knob on, each layer gathers in every forward and every backward.
    One microbatch: nothing to keep them for (the backward reduces at once), so they reshard after the
    forward as with the knob on, not held all through it."""
    for counts in run_distributed(_all_gathers_per_step, 2, knob, microbatches):
        assert set(counts.values()) == {gathers}, counts


def test_one_rank_without_fsdp_says_which_keys_change_nothing(tmp_path):
    """dp = tp = 1 with the weights in the compute dtype: FSDP2 is left out, and the log names the set FSDP keys
    that then have no effect."""
    run = run_qwenft("train", "recipe=tiny", "train.max_steps=1", "mesh.fsdp_prefetch=2",
                     "pipeline.reduce_grad_per_microbatch=true", "train.progress_bar=false",
                     "checkpoint.export_hf=false", f"run_dir={tmp_path}")
    assert run.returncode == 0, run.stderr[-2000:]
    assert ("FSDP2: not applied (one data-parallel rank, weights in the compute dtype float32 or LoRA adapters: "
            "nothing to shard, reduce or cast); mesh.fsdp_prefetch=2 and "
            "pipeline.reduce_grad_per_microbatch=true change nothing") in (tmp_path / "train.log").read_text()
