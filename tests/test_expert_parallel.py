"""Expert parallelism (`mesh.ep`) on the MoE model (tiny_moe: 8 experts, top 2; fp32, CPU, gloo): every ep mesh
trains the losses, gradients, parameters and validation loss of one process, a checkpoint saved at ep2 resumes
on ep1 and ep4, an ep2 run loads an HF checkpoint and exports one that transformers loads, tp2 x ep2 trains one process's
numbers, `qwenft plan` counts a rank's experts, and a bad mesh.ep fails at start with one line.

Router ties are avoided, not broken: the test data are the shipped chat rows through randomly initialised fp32
weights, so router probabilities are continuous and no two of a token's top scores are exactly equal; every
mesh routes from activations equal up to fp32 rounding, so no top-k choice flips (a flip would show as a loss
or gradient far outside fp32_rtol's bounds).
"""

import pytest
import torch
from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM

from distributed import run_distributed
from helpers import (assert_same_grads, assert_same_training, assert_within, compose, fp32_rtol, logged_losses,
                     make_hf_moe_model, model_config, parity_overrides, raised_line, read_metrics, rel_err,
                     tiny_overrides, train, train_with_grads, train_with_state)

MOE = ("model.name=tiny_moe", "model.kernels.moe=loop", "checkpoint.export_hf=false")
# validation after the last step: its forward runs the all-to-alls too (pipelined under pp)
# AdamW's eps at 1e-5: with the default 1e-8 an update is ~lr x sign(m) even where the gradient is at the
# level of rounding (some norm-weight elements of the tiny MoE model are ~1e-6 and change sign across steps), so
# rounding differences between meshes would become lr-sized parameter differences. At 1e-6 one AdamW step still
# turned tp2's rounding gap in the gradients of GatedDeltaNet's q_proj (elements near 1e-6) into a gap over the bound
# on some hosts; 1e-5 keeps those updates proportional to their gradients and the comparison about the parallelism.
PARITY = (*MOE, "eval.every_steps=3", "eval.dataset=tiny", "optim.eps=1e-5")


def _logged(run_dir) -> dict:
    """Each step's grad norm and the validation losses, from metrics.jsonl."""
    rows = read_metrics(run_dir)
    return {"grad_norm": [r["grad_norm"] for r in rows if "loss" in r],
            "val_loss": [r["val_loss"] for r in rows if "val_loss" in r]}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, global batch 4 as 4 microbatches of 1, 3 steps, gradient clipping active (grad norm ~3 > 1)."""
    run_dir = tmp_path_factory.mktemp("ep") / "ref"
    (result,) = run_distributed(train_with_grads, 1, parity_overrides(run_dir, *PARITY))
    logged = _logged(run_dir)
    assert len(logged["val_loss"]) == 1 and logged["grad_norm"][0] > 1.0
    return result, logged


def _assert_equals_reference(results, run_dir, reference):
    """Each step's grad norm (clipping scales every gradient by the total norm: an expert counted twice shows) and
    loss, the validation loss, every parameter after the 3 steps and every gradient of the last one within
    fp32_rtol of one process's for the AdamW steps before each (GDN's decay path, whose small gradients sum over
    every token, takes the per-tensor bound's room: 2.1e-5 seen on ep2)."""
    ref, ref_logged = reference
    logged = _logged(run_dir)
    for step, (got, want) in enumerate(zip(logged["grad_norm"], ref_logged["grad_norm"], strict=True)):
        assert_within(f"step {step + 1}'s grad norm", abs(got - want) / want, fp32_rtol(step))
    for got, want in zip(logged["val_loss"], ref_logged["val_loss"], strict=True):
        assert_within("val_loss after 3 steps", abs(got - want) / want, fp32_rtol(3))
    for result in results:
        assert_same_training(result, ref)
        assert_same_grads(result, ref)


@pytest.mark.distributed
def test_ep2_equals_one_process(tmp_path, reference):
    """dp2 = ep2: each rank holds 4 experts; with the knob on and activation checkpointing (the recompute runs
    the all-to-alls again)."""
    run_dir = tmp_path / "ep2"
    results = run_distributed(train_with_grads, 2, parity_overrides(
        run_dir, *PARITY, "mesh.ep=2", "pipeline.reduce_grad_per_microbatch=true",
        "model.activation_checkpointing=true"))
    _assert_equals_reference(results, run_dir, reference)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("mesh", [
    ["mesh.ep=2"],  # dp4 = 2 x ep2: the experts' FSDP units reduce over the 2 ranks that hold the same experts
    ["mesh.ep=4", "model.kernels.moe=grouped_mm"],  # 2 experts a rank, through torch._grouped_mm (fp32 on CPU)
    ["mesh.ep=2", "mesh.pp=2", "pipeline.schedule=1f1b"],
    # 2 stages a rank, split backward (input, then weights): the all-to-alls' backward runs in the input half
    ["mesh.ep=2", "mesh.pp=2", "pipeline.schedule=interleaved_zb"],
], ids=["ep2-dp4", "ep4", "ep2-pp2-1f1b", "ep2-pp2-interleaved_zb"])
def test_ep_world4_equals_one_process(tmp_path, reference, mesh):
    run_dir = tmp_path / "run"
    results = run_distributed(train_with_grads, 4, parity_overrides(run_dir, *PARITY, *mesh))
    _assert_equals_reference(results, run_dir, reference)


@pytest.mark.slow
@pytest.mark.distributed
def test_tp2_ep2_equals_one_process(tmp_path, reference):
    """tp2 x ep2 on 4 ranks: attention and GDN sharded by head over tp, the MoE block replicated over tp with its
    experts shared out over ep."""
    run_dir = tmp_path / "run"
    results = run_distributed(train_with_grads, 4, parity_overrides(run_dir, *PARITY, "mesh.tp=2", "mesh.ep=2"))
    _assert_equals_reference(results, run_dir, reference)


def _resume_overrides(run_dir, max_steps, *extra):
    # warm-up over all 4 steps with a constant tail, so the 2-step and the 4-step runs share one lr schedule
    return parity_overrides(run_dir, *MOE, f"train.max_steps={max_steps}", "lr_scheduler.warmup_steps=4",
                            "lr_scheduler.decay=constant", "checkpoint.every_steps=2", *extra)


@pytest.fixture(scope="module")
def ep2_run(tmp_path_factory):
    """ep2, 4 steps, checkpoints after steps 2 and 4."""
    run_dir = tmp_path_factory.mktemp("ep2") / "run"
    run_distributed(train, 2, _resume_overrides(run_dir, 4, "mesh.ep=2"))
    return run_dir


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("nproc, mesh", [(1, []), (4, ["mesh.ep=4"])], ids=["ep1", "ep4"])
def test_ep2_checkpoint_resumes_on_another_ep(tmp_path, ep2_run, nproc, mesh):
    """Saved at ep2 after step 2 of 4: steps 3 and 4 on ep1 (one process) and on ep4 train the losses of the
    ep2 run that never stopped."""
    uninterrupted = logged_losses(ep2_run)
    step2 = ep2_run / "checkpoints" / "step-000002"
    losses = run_distributed(train, nproc, _resume_overrides(tmp_path / "resumed", 4,
                                                             f"checkpoint.resume={step2}", *mesh))[0].losses
    assert len(losses) == 2 and uninterrupted[3] != uninterrupted[4]
    for steps_apart, (got, step) in enumerate(zip(losses, (3, 4))):  # the meshes part at step 3
        want = uninterrupted[step]
        assert_within(f"step {step}'s loss", abs(got - want) / abs(want), fp32_rtol(steps_apart))


def _save_hf_moe(path, vocab_size: int = 0):
    """A transformers Qwen3_5MoeForCausalLM of tiny_moe's config (vocabulary grown to vocab_size) with every weight
    perturbed (its init leaves norms at 0 / 1), saved at path; returns the config."""
    from qwenft.models.qwen3_5.configs import named_config

    cfg = named_config("tiny_moe")
    cfg.text.vocab_size = max(cfg.text.vocab_size, vocab_size)
    make_hf_moe_model(cfg).save_pretrained(path)
    return cfg


@pytest.mark.slow
@pytest.mark.distributed
def test_ep2_loads_hf_checkpoint_and_exports_to_transformers(tmp_path):
    """An ep2 run from a transformers Qwen3_5MoeForCausalLM checkpoint trains the losses of one process from it
    (each rank read its own experts); its HF export has every key of transformers' model and the logits of the
    parameters it trained, and `qwenft export` of its checkpoint the same experts."""
    from qwenft.cli import main
    from qwenft.data.tokenizer import load_tokenizer
    from qwenft.models.loader import build_model

    tokenizer = load_tokenizer("tiny")
    _save_hf_moe(tmp_path / "src", len(tokenizer))
    tokenizer.save_pretrained(tmp_path / "src")

    common = (*MOE, f"model.path={tmp_path / 'src'}", "train.max_steps=2")
    (one,) = run_distributed(train, 1, parity_overrides(tmp_path / "one", *common))
    results = run_distributed(train_with_state, 2, parity_overrides(
        tmp_path / "ep2", *common, "mesh.ep=2", "checkpoint.export_hf=true", "checkpoint.export_dtype=float32",
        "checkpoint.every_steps=2"))
    for step, (got, want) in enumerate(zip(results[0].losses, one.losses, strict=True)):
        assert_within(f"step {step + 1}'s loss", abs(got - want) / abs(want), fp32_rtol(step))

    exported, info = Qwen3_5MoeForCausalLM.from_pretrained(tmp_path / "ep2" / "hf", output_loading_info=True,
                                                           dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    exported.set_experts_implementation("eager")
    state = results[0].state_dict
    model_cfg = model_config(compose(tiny_overrides(tmp_path / "x", *common)))
    model = build_model(model_cfg, kernels="torch", moe_kernel="loop", device="cpu")
    model.load_state_dict(state)
    ids = torch.randint(0, model_cfg.text.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel_err(model(input_ids=ids), exported(input_ids=ids).logits) < 1e-5

    # `qwenft export` of the run's ep2 checkpoint, on this one process: the same fused experts
    assert main(["export", f"run_dir={tmp_path / 'ep2'}", f"out={tmp_path / 'cli'}", "dtype=float32"]) == 0
    again = Qwen3_5MoeForCausalLM.from_pretrained(tmp_path / "cli", dtype=torch.float32).state_dict()
    for i in range(model_cfg.text.num_hidden_layers):
        for name in ("gate_up_proj", "down_proj"):
            assert torch.equal(again[f"model.layers.{i}.mlp.experts.{name}"], state[f"layers.{i}.mlp.experts.{name}"])


def _load_ep(rank, world_size, path, ep):
    """tiny_moe from the HF checkpoint at `path`, parallelized at dp=world_size with `ep`, loaded; its parameters
    gathered whole, and the shape of this rank's part of layer 0's gate_up_proj."""
    from qwenft.conf.layout import Layout
    from qwenft.distributed.mesh import build_mesh
    from qwenft.distributed.parallelize import parallelize
    from qwenft.models.loader import build_model, load_hf_weights
    from qwenft.models.qwen3_5.configs import config_from_hf_dir

    model = build_model(config_from_hf_dir(path), kernels="torch", moe_kernel="loop", device="meta")
    parallelize(model, build_mesh(Layout(pp=1, dp=world_size, tp=1, ep=ep), device="cpu"), param_dtype=torch.float32)
    load_hf_weights(model, path, device="cpu")
    local = tuple(model.layers["0"].mlp.experts.gate_up_proj.to_local().shape)
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}, local


@pytest.mark.distributed
def test_ep2_dp4_ranks_load_their_experts(tmp_path):
    """At dp4 = 2 x ep2 each rank holds 2 of the 8 experts (its ep group's 4, halved by FSDP); every parameter,
    gathered, is the checkpoint's."""
    from qwenft.models.loader import build_model, load_hf_weights

    cfg = _save_hf_moe(tmp_path / "src")
    ref = load_hf_weights(build_model(cfg, kernels="torch", moe_kernel="loop", device="meta"), tmp_path / "src",
                          device="cpu")
    for state, local in run_distributed(_load_ep, 4, tmp_path / "src", 2):
        assert local[0] == 2, local
        for name, p in ref.named_parameters():
            assert torch.equal(state[name], p), name


@pytest.mark.distributed
def test_ep_on_a_dense_model_fails_at_start(tmp_path):
    with pytest.raises(Exception) as info:
        run_distributed(train, 2, tiny_overrides(tmp_path / "run", "mesh.ep=2"))
    assert raised_line(info) == ("ValueError: mesh.ep=2 shares out the experts of an MoE model, but this model is "
                                 "dense; use mesh.ep=1")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("ep, dp, expected", [
    (3, 2, "mesh.ep=3 does not divide the data-parallel size mesh.dp=2 (experts are shared out over ep of the dp "
           "ranks); valid mesh.ep: [1, 2]"),
    (3, 6, "mesh.ep=3 does not divide num_experts=8; valid mesh.ep: [1, 2, 4, 8] (that also divide mesh.dp)"),
])
def test_bad_ep_is_one_line(ep, dp, expected):
    """Checked before any process group or model exists: the layout against the world, the experts in the spec."""
    from qwenft.conf.layout import resolve_layout
    from qwenft.train.spec import resolve_spec

    cfg = compose(tiny_overrides("unused", *MOE, f"mesh.ep={ep}", "train.global_batch_size=12"))
    with pytest.raises(ValueError) as info:
        layout = resolve_layout(1, 1, -1, dp, ep=ep)
        resolve_spec(cfg, layout, model_config(cfg), "cpu")
    assert str(info.value) == expected


def test_ep_below_one_is_refused():
    with pytest.raises(ValueError, match=r"^mesh.ep=0 must be >= 1$"):
        compose(tiny_overrides("unused", "mesh.ep=0"))


@pytest.mark.slow
@pytest.mark.distributed
def test_ep2_lora_equals_one_process(tmp_path):
    """peft=lora: the experts stay frozen and shared out; losses and the last step's adapter gradients are one
    process's. Values are not compared (AdamW's first steps are ~lr x sign(g): docs/lora.md)."""
    # not all-linear: that would also adapt the router (mlp.gate), whose weight the MoE block reads directly, so
    # its adapters would get no gradient
    lora = (*MOE, "peft=lora", "peft.target_modules=[q_proj,in_proj_qkv,out_proj,down_proj]")
    (ref,) = run_distributed(train_with_grads, 1, parity_overrides(tmp_path / "ref", *lora))
    for result in run_distributed(train_with_grads, 2, parity_overrides(tmp_path / "ep2", *lora, "mesh.ep=2")):
        assert ref.losses[0] != ref.losses[-1]
        for step, (got, want) in enumerate(zip(result.losses, ref.losses, strict=True)):
            assert_within(f"step {step + 1}'s loss", abs(got - want) / abs(want), fp32_rtol(step))
        assert all("lora_" in name for name in ref.grads)
        assert_same_grads(result, ref)


def test_plan_gathers_only_a_ranks_experts():
    """`qwenft plan` at dp2: with mesh.ep=2 each rank stores the same share of every parameter (1/dp), and
    all-gathers its 4 experts instead of all 8: half the routed experts' compute-dtype (bf16) bytes less."""
    from qwenft.train import plan as plan_lib

    def plan(*mesh):
        cfg = compose(["recipe=tiny_moe", "mesh.dp=2", *mesh], missing_ok=True)
        return cfg, plan_lib.predict(cfg)

    cfg, dp2 = plan()
    _, ep2 = plan("mesh.ep=2")
    t = model_config(cfg).text
    experts = t.num_hidden_layers * t.num_experts * 3 * t.moe_intermediate_size * t.hidden_size
    assert len(dp2) == len(ep2) == 2
    for a, b in zip(dp2, ep2):
        assert a.params == b.params
        assert a.unsharded_bytes["knob_off"] - b.unsharded_bytes["knob_off"] == experts // 2 * 2
