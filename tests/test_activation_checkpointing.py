"""model.activation_checkpointing: false | true | linear_attention | full_attention | selective.

Each mode trains the same numbers as no checkpointing; what a mode keeps after the forward is measured from
the storages the forward's ops create that are still alive, and the recomputed matmuls by counting aten.mm in
the backward; the planner's estimate is checked to order the modes as those measurements do."""

import gc
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from distributed import run_distributed
from helpers import assert_same_training, compose, parity_overrides, train_with_state
from qwenft.distributed.activation_checkpointing import MODES, apply_activation_checkpointing
from qwenft.models.loader import build_model, init_random_weights
from qwenft.models.qwen3_5.configs import named_config
from qwenft.train import plan as plan_lib

CHECKPOINTED = [m for m in MODES if m != "false"]


def _train_every_mode(rank, world_size, tmp_path, modes=MODES, *extra):
    """mode -> the RunResult of 3 steps of 2 microbatches of 2 packed rows with that activation checkpointing."""
    return {mode: train_with_state(rank, world_size, parity_overrides(
        tmp_path / mode, "train.micro_batch_size=2", "checkpoint.export_hf=false",
        f"model.activation_checkpointing={mode}", *extra)) for mode in modes}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    (results,) = run_distributed(_train_every_mode, 1, tmp_path_factory.mktemp("ac"))
    return results


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("mode", CHECKPOINTED)
def test_every_mode_trains_like_no_checkpointing(trained, mode):
    """3 steps of 2 microbatches of 2 packed rows (fp32): losses and every parameter within a tenth of fp32_rtol's
    bound (margin 0.4: the recompute repeats the forward's sums in their own order, one mesh, one kernel)."""
    assert_same_training(trained[mode], trained["false"], margin=0.4)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["mesh.tp=2", "mesh.dp=2"])
def test_selective_under_tp2_and_dp2(tmp_path, mesh):
    """Head-sharded projections (their local mm outputs are kept), and FSDP2 with the fp32 decay units inside
    each layer all-gathering again in the recompute: selective trains as no checkpointing on the same mesh."""
    for result in run_distributed(_train_every_mode, 2, tmp_path, ("false", "selective"), mesh):
        assert_same_training(result["selective"], result["false"], margin=0.4)


class _Ops(TorchDispatchMode):
    """Counts aten.mm calls, and tracks the bytes of every storage an op creates until it is freed."""

    def __init__(self, track_storages: bool = True):
        super().__init__()
        self.mm, self.alive, self.track = 0, {}, track_storages

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.mm += func is torch.ops.aten.mm.default
        for t in tree_flatten(out)[0] if self.track else ():
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                storage = t.untyped_storage()
                if storage.data_ptr() not in self.alive:
                    self.alive[storage.data_ptr()] = storage.nbytes()
                    weakref.finalize(storage, self.alive.pop, storage.data_ptr(), None)
        return out


def _forward_backward(mode: str) -> dict:
    """The tiny decoder (3 GDN layers, then 1 attention layer; no head) on a row of packed documents."""
    cfg = named_config("tiny")
    model = init_random_weights(build_model(cfg, kernels="torch", head=False), seed=1, device="cpu",
                                dtype=torch.float32)
    if mode != "false":
        apply_activation_checkpointing(model, mode)
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.text.vocab_size, (1, 64))
    cu = torch.tensor([0, 40, 64], dtype=torch.int32)
    with _Ops() as forward:
        out = model(input_ids=ids, cu_seqlens=cu)
    gc.collect()
    kept = sum(forward.alive.values())
    with _Ops(track_storages=False) as backward:
        out.square().mean().backward()
    return {"kept": kept, "forward_mm": forward.mm, "backward_mm": backward.mm,
            "grads": {n: p.grad for n, p in model.named_parameters()}}


@pytest.fixture(scope="module")
def measured():
    return {mode: _forward_backward(mode) for mode in MODES}


def test_selective_recomputes_no_matmul_and_keeps_less(measured):
    """Full checkpointing re-runs the layers' projections in the backward (all but each layer's last,
    down_proj, whose output no gradient needs: the recompute stops early); selective re-runs none of them
    (nor keeps down_proj's output).
    Kept after the forward: no checkpointing > selective > full (11.4 > 1.66 > 0.96 MB measured)."""
    none, full, selective = measured["false"], measured["true"], measured["selective"]
    # GDN: q, k, v, z, a|b (one matmul), out, gate, up, down; attention: q, k, v, o, gate, up, down
    assert none["forward_mm"] == full["forward_mm"] == selective["forward_mm"] == 34  # 3 x 9 GDN + 7 attention
    assert full["backward_mm"] - none["backward_mm"] == 34 - 4
    assert selective["backward_mm"] == none["backward_mm"]
    assert none["kept"] > 5 * selective["kept"] and selective["kept"] > 1.5 * full["kept"]
    for mode, run in measured.items():
        for name, grad in none["grads"].items():
            assert torch.allclose(run["grads"][name], grad, rtol=1e-6, atol=1e-9), (mode, name)


def test_selective_keeps_every_matmul_output_but_each_layers_last(monkeypatch):
    """After the forward each layer holds its matmul outputs but down_proj's (GDN 9 matmuls -> 8 kept,
    attention 7 -> 6); the backward takes every one of them and recomputes no matmul (the test above), so the
    dropped output was never needed."""
    from qwenft.distributed import activation_checkpointing as ac

    layers_kept, save_matmuls = [], ac.save_matmuls

    def recording():
        forward, recompute = save_matmuls()
        layers_kept.append(forward.kept)
        return forward, recompute

    monkeypatch.setattr(ac, "save_matmuls", recording)
    cfg = named_config("tiny")
    model = init_random_weights(build_model(cfg, kernels="torch", head=False), seed=1, device="cpu",
                                dtype=torch.float32)
    apply_activation_checkpointing(model, "selective")
    ids = torch.randint(0, cfg.text.vocab_size, (1, 64))
    out = model(input_ids=ids, cu_seqlens=torch.tensor([0, 40, 64], dtype=torch.int32))
    mm = torch.ops.aten.mm.default
    assert [len(kept[mm]) for kept in layers_kept] == [8, 8, 8, 6]
    out.square().mean().backward()
    assert [sum(map(len, kept.values())) for kept in layers_kept] == [0, 0, 0, 0]


def _measured_order(measured) -> list[str]:
    return sorted(MODES, key=lambda m: -measured[m]["kept"])


def test_planner_orders_the_modes_as_measured(measured):
    """Measured on the tiny model: false > full_attention > selective > linear_attention > true. The planner
    (GPU kernels' accounting) gives the same order for the 27B-shaped 8-layer model, and for the tiny one
    but for full_attention: there the one checkpointed layer is the last, the first whose backward runs, and
    its recompute at once brings back what checkpointing saved (the planner counts it; the measure after the
    forward does not)."""
    order = _measured_order(measured)
    assert order == ["false", "full_attention", "selective", "linear_attention", "true"], order

    def planned(*overrides):
        act = {}
        for mode in MODES:
            cfg = compose([*overrides, f"model.activation_checkpointing={mode}"], missing_ok=True)
            (p,) = plan_lib.predict(cfg)
            act[mode] = p.activation_bytes["ac_off" if mode == "false" else "ac_on"]
        return sorted(MODES, key=lambda m: -act[m])

    big = planned("recipe=tiny", "model=qwen3_5_27b", "model.num_layers=8", "data.seq_len=4096",
                  "train.global_batch_size=8", "train.micro_batch_size=1")
    assert big == order
    tiny = planned("recipe=tiny", "data.seq_len=128", "train.global_batch_size=2", "train.micro_batch_size=2")
    assert [m for m in tiny if m != "full_attention"] == [m for m in order if m != "full_attention"]


def test_bools_and_bad_values():
    """true/false from the command line keep their meaning, a recipe's `auto` (qwen3_5_27b_tp4pp4) stays auto
    until a run resolves it; another value is one line naming the key and the modes."""
    assert compose(["model.activation_checkpointing=true"]).model.activation_checkpointing == "true"
    assert compose(["model.activation_checkpointing=false"]).model.activation_checkpointing == "false"
    assert compose(["model.activation_checkpointing=selective"]).model.activation_checkpointing == "selective"
    recipe = compose(["recipe=qwen3_5_27b_tp4pp4"], missing_ok=True)
    assert recipe.model.activation_checkpointing == "auto"
    with pytest.raises(ValueError) as err:
        compose(["model.activation_checkpointing=attention"])
    message = str(err.value)
    assert "\n" not in message and "model.activation_checkpointing='attention'" in message
    assert "linear_attention, full_attention, selective, auto" in message
