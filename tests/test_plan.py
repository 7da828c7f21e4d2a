"""`qwenft plan`: per-rank memory from every rank's share of the model, built on meta on a fake process group.

Checked against references outside the planner: the unsharded model's parameter count, a real CPU training
step's allocated tensors (gloo ranks through the runner), and autograd's own record of saved tensors.
"""

import json

import pytest
import torch

from distributed import run_distributed
from helpers import compose, model_config
from qwenft.cli import main
from qwenft.models.qwen3_5.configs import FULL_ATTENTION, TextConfig
from qwenft.train import plan as plan_lib
from qwenft.train.activations import moe_activation_bytes, saved_tensor_bytes


_PLANS: dict = {}  # repr(config) -> its plans: tests that plan the same config share one predict


def _plan(*overrides):
    """The config of `overrides` and every rank's plan of it, predicted once per distinct config in this module
    (predict builds every rank's share on meta: seconds for the 8- to 128-rank layouts)."""
    cfg = compose(list(overrides), missing_ok=True)
    key = repr(cfg)
    if key not in _PLANS:
        _PLANS[key] = plan_lib.predict(cfg)
    return cfg, _PLANS[key]


def _model_params(cfg) -> int:
    from qwenft.models.loader import build_model

    return sum(p.numel() for p in build_model(model_config(cfg), device="meta").parameters())


@pytest.fixture(scope="module")
def tp4pp4():
    return _plan("recipe=qwen3_5_27b_tp4pp4")


def test_27b_tp4pp4_sixteen_ranks_cover_the_model_once(tp4pp4):
    """Every element of the 27B model is held by exactly one (pp, tp) position: summed over the 16 ranks, each
    tensor-parallel replica counted once, the shards add up to the unsharded model."""
    cfg, plans = tp4pp4
    assert [p.rank for p in plans] == list(range(16))
    assert sorted({p.pp_rank for p in plans}) == [0, 1, 2, 3] and {p.layers for p in plans} == {16}
    assert sum(p.params_owned for p in plans) == _model_params(cfg) > 26e9
    assert all(p.total_bytes < cfg.plan.gpu_memory_gib * plan_lib.GIB for p in plans)
    assert plans[-1].logits_bytes > 0 and plans[0].logits_bytes == 0  # only the last stage has the head


@pytest.mark.parametrize("overrides", [
    ["recipe=tiny_3d"],  # tp2 x pp2 x dp2: FSDP's shards of tp shards
    ["recipe=tiny_moe", "mesh.dp=2", "mesh.ep=2", "mesh.cp=2", "mesh.tp=2"],  # ep inside dp, cp
    ["recipe=qwen3_5_35b_a3b", "model.num_layers=4", "model.activation_checkpointing=false"],  # a 1-row gate over dp8
])
def test_ranks_planned_from_a_stage_mates_share_equal_their_own_builds(overrides):
    """predict builds a rank only when no built rank of its stage has shards of its shapes; every rank built on its
    own (share_stages=False) gives the same plans, uneven shards (some ranks holding an empty row) included."""
    cfg = compose(overrides, missing_ok=True)
    assert plan_lib.predict(cfg) == plan_lib.predict(cfg, share_stages=False)


def test_tiny_3d_ranks_cover_the_model_once():
    cfg, plans = _plan("recipe=tiny_3d")
    assert len(plans) == 8
    assert sum(p.params_owned for p in plans) == _model_params(cfg)
    # dp2: each dp rank holds half; tp-replicated norms are stored on both tp ranks
    assert sum(p.params for p in plans) > sum(p.params_owned for p in plans)


def test_knob_on_keeps_fewer_gradient_bytes(tp4pp4):
    _, plans = _plan("recipe=qwen3_5_27b_pp2dp4")
    for p in plans:  # dp4: sharded gradients are a quarter of the accumulator
        assert p.grad_bytes["knob_on"] * 4 == p.grad_bytes["knob_off"]
        assert p.peaks["knob_on"]["ac_on"] < p.peaks["knob_off"]["ac_on"]
    # dp1 with fp32 master weights: FSDP2 wraps the ranks to cast them; the knob off keeps each stage gathered,
    # and the gradients (every one its parameter's tp shard, the vocab-parallel embedding's too) are alike
    for p in _plan("recipe=qwen3_5_27b_tp4pp4", "optim.master_dtype=float32")[1]:
        assert p.unsharded_bytes["knob_on"] < p.unsharded_bytes["knob_off"]
        assert p.grad_bytes["knob_on"] == p.grad_bytes["knob_off"]
    for p in tp4pp4[1]:  # dp1 with bf16 weights (the 27B model group's): no FSDP2, so the knob changes nothing
        assert p.unsharded_bytes["knob_on"] == p.unsharded_bytes["knob_off"] == 0
        assert p.grad_bytes["knob_on"] == p.grad_bytes["knob_off"]


def test_one_microbatch_plans_the_knob_off_as_the_knob_on():
    """pp = 1 with one microbatch a step: the backward reduce-scatters at once and parameters reshard after the
    forward (build.build_model_parts), so the knob off has neither the accumulator nor the gathered stage.
    fp32 master weights: FSDP casts them to the compute dtype, so it wraps the model at dp = 1 too."""
    shape = ["recipe=tiny", "model=qwen3_5_27b", "model.num_layers=2", "data.seq_len=1024",
             "train.micro_batch_size=1", "pipeline.reduce_grad_per_microbatch=false", "optim.master_dtype=float32",
             "model.activation_checkpointing=true"]
    ((one,),), ((two,),) = (_plan(*shape, f"train.global_batch_size={n}")[1:] for n in (1, 2))
    assert one.peaks["knob_off"] == one.peaks["knob_on"] and one.total_bytes == one.peaks["knob_on"]["ac_on"]
    assert two.peaks["knob_off"]["ac_on"] > two.peaks["knob_on"]["ac_on"]


@pytest.mark.parametrize("ac", ["true", "selective"])
def test_each_activation_checkpointing_mode_is_planned_as_a_run_of_that_mode(ac):
    """`ac_mode_peaks` (every mode from one prediction) equals the peak a prediction of the config set to that mode
    gives, on every rank; `cheapest_ac_mode` takes the first mode in cost order under 90% of the limit."""
    cfg, plans = _plan("recipe=qwen3_5_27b_pp2dp4", f"model.activation_checkpointing={ac}")
    for mode in plan_lib.AC_BY_COST:
        _, of_mode = _plan("recipe=qwen3_5_27b_pp2dp4", f"model.activation_checkpointing={mode}")
        assert [p.ac_mode_peaks[mode] for p in plans] == [p.total_bytes for p in of_mode], mode
    chosen, worst = plan_lib.cheapest_ac_mode(plans, 139.0)
    assert worst["false"] > 0.9 * 139 * plan_lib.GIB and chosen == "selective"  # AC off: 126.93 GiB
    assert plan_lib.cheapest_ac_mode(plans, 160.0)[0] == "false"
    assert plan_lib.cheapest_ac_mode(plans, 30.0)[0] is None


def test_tp4_quarters_a_ranks_parameter_bytes(tp4pp4):
    """27B on 4 stages: tp4 holds a quarter of tp1's bytes per rank, plus the replicated norm weights."""
    _, tp1 = _plan("recipe=qwen3_5_27b_tp4pp4", "mesh.tp=1")
    for p4 in tp4pp4[1]:
        p1 = tp1[p4.pp_rank]
        assert p1.pp_rank == p4.pp_rank
        assert 0.25 < p4.param_bytes / p1.param_bytes < 0.2502, (p4.param_bytes, p1.param_bytes)


def test_vocab_parallel_fused_head_plans_its_share_of_the_vocabulary():
    """27B's head (vocabulary 248,320, hidden 5120) at tp1 and tp2 with mesh.vocab_parallel=true: model.kernels.ce=auto
    is the fused CE on CUDA at both, chunked by 1024 tokens; each rank holds a [1024, vocab/tp] bf16 chunk of logits
    and keeps, from the forward to the backward, its [vocab/tp, hidden] weight gradient and the [tokens, hidden]
    hidden gradient (bf16), plus fp32 per-token CE values."""
    shape = ["recipe=tiny", "model=qwen3_5_27b", "model.num_layers=2", "data.seq_len=4096", "train.micro_batch_size=1",
             "train.global_batch_size=1", "model.ce_chunk_tokens=1024"]
    vocab, hidden, tokens = 248_320, 5120, 4096
    for tp in (1, 2):
        _, plans = _plan(*shape, f"mesh.tp={tp}")
        share = vocab // tp
        assert [p.logits_bytes for p in plans] == [2 * share * 1024 + 2 * hidden * (share + tokens) + 4 * tokens] * tp


# ------------------------------------------------------------------ against a real training step

def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (DTensors by their local shards)."""
    from torch.distributed.tensor import DTensor

    storages = {}
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def _fsdp_accumulators(module) -> list:
    """The unsharded gradients FSDP2 accumulates outside `.grad`: with a compute dtype other than the reduce
    dtype (bf16 and fp32), the first backward without gradient sync moves each gradient into an fp32
    `unsharded_accumulated_grad` of its FSDPParam (no public accessor)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from qwenft.distributed.fsdp import param_groups

    return [fp.unsharded_accumulated_grad for m in module.modules() if isinstance(m, FSDPModule)
            for group in param_groups(fully_shard.state(m)) for fp in group.fsdp_params
            if fp.unsharded_accumulated_grad is not None]


def _real_step_bytes(rank, world_size, overrides):
    """Run the real runner for one step and record, on this rank: the gradients held after the first microbatch's
    backward (knob off: the unsharded accumulator; a pipeline stage's, or at pp = 1 the model's), and after the optimizer step (before zero_grad) the
    trained parameters, every parameter of the model parts (a frozen base too), sharded gradients and optimizer
    state."""
    from qwenft.distributed.pipeline import stage as pp_stage
    from qwenft.train import build, runner, step

    seen = {}

    class RecordingStage(pp_stage.ReduceGradStage):
        def backward_maybe_with_nosync(self, *args, **kwargs):
            result = super().backward_maybe_with_nosync(*args, **kwargs)
            seen.setdefault("first_backward_grads", _storage_bytes(
                [p.grad for p in self.submod.parameters() if p.grad is not None] + _fsdp_accumulators(self.submod)))
            return result

    set_grad_sync = step.set_microbatch_grad_sync
    microbatches = []

    def recording_grad_sync(model, is_last, reduce_grad_per_microbatch):  # pp = 1: before each microbatch
        microbatches.append(is_last)
        if len(microbatches) == 2:  # the first microbatch's backward is done
            seen.setdefault("first_backward_grads", _storage_bytes(
                [p.grad for p in model.parameters() if p.grad is not None] + _fsdp_accumulators(model)))
        set_grad_sync(model, is_last, reduce_grad_per_microbatch)

    build_optimizer, build_model_parts = build.build_optimizer, build.build_model_parts
    parts = []

    def recording_model_parts(*args, **kwargs):
        parts.extend(build_model_parts(*args, **kwargs))
        return parts

    def recording_optimizer(*args, **kwargs):
        optimizer = build_optimizer(*args, **kwargs)
        zero_grad = optimizer.zero_grad

        def measure_then_zero_grad(set_to_none=True):
            params = [p for group in optimizer.param_groups for p in group["params"]]
            seen.setdefault("params", _storage_bytes(params))
            seen.setdefault("all_params", _storage_bytes(p for _, m in parts for p in m.parameters()))
            seen.setdefault("grads", _storage_bytes(p.grad for p in params))
            seen.setdefault("optimizer", _storage_bytes(v for s in optimizer.state.values() for v in s.values()))
            zero_grad(set_to_none)

        optimizer.zero_grad = measure_then_zero_grad
        return optimizer

    pp_stage.ReduceGradStage = RecordingStage  # observers only: the stage and optimizer behave as the real ones
    build.build_optimizer = recording_optimizer
    build.build_model_parts = recording_model_parts
    step.set_microbatch_grad_sync = recording_grad_sync
    runner.run(compose(overrides))
    return seen


def _planned_and_real(world_size: int, overrides: list) -> tuple[list, list]:
    """Every rank's plan of `overrides`, and what one real step of it allocates on `world_size` gloo ranks."""
    real = run_distributed(_real_step_bytes, world_size, overrides)
    return _plan(*overrides)[1], real


def _assert_plan_bytes(plans, real, params: str) -> None:
    """Every rank's planned parameter bytes equal the real step's `params` ("params": the trained ones,
    "all_params": every parameter, a frozen base too), and its gradient (sharded after the step, knob on; the
    first microbatch's, knob off) and optimizer bytes equal the real step's, byte for byte."""
    for p, seen in zip(plans, real):
        assert p.param_bytes == seen[params], (p.rank, p.param_bytes, seen)
        assert p.grad_bytes["knob_on"] == seen["grads"], (p.rank, p.grad_bytes, seen)
        assert p.grad_bytes["knob_off"] == seen["first_backward_grads"], (p.rank, p.grad_bytes, seen)
        assert p.optimizer_bytes == seen["optimizer"], (p.rank, p.optimizer_bytes, seen)


@pytest.mark.distributed
@pytest.mark.slow
def test_tiny_3d_plan_equals_a_real_steps_bytes(tmp_path):
    """tp2 x pp2 x dp2 (fp32 on CPU, knob off, 2 microbatches): the planner's parameter, gradient and optimizer
    bytes of every rank equal what one real training step allocates, byte for byte."""
    overrides = ["recipe=tiny_3d", "train.max_steps=1", "data.seq_len=64", "pipeline.reduce_grad_per_microbatch=false",
                 "model.dtype=float32",
                 "model.kernels.gdn=torch", "train.progress_bar=false", "checkpoint.export_hf=false",
                 f"run_dir={tmp_path}"]
    plans, real = _planned_and_real(8, overrides)
    _assert_plan_bytes(plans, real, params="params")


def test_one_rank_in_the_compute_dtype_plans_no_gathered_copy():
    """dp = tp = 1 with bf16 weights (the 27B model group's default): no FSDP, so nothing is all-gathered, the knob
    changes nothing, and the peak is the weights, gradients, AdamW state, activations and logits."""
    (one,) = _plan("recipe=tiny", "model=qwen3_5_27b", "model.num_layers=2", "data.seq_len=1024",
                   "train.micro_batch_size=1", "train.global_batch_size=4")[1]
    assert one.unsharded_bytes == {"knob_off": 0, "knob_on": 0} and one.peaks["knob_off"] == one.peaks["knob_on"]
    assert one.grad_bytes["knob_off"] == one.grad_bytes["knob_on"] == one.param_bytes  # each in its weight's dtype


@pytest.mark.distributed
@pytest.mark.slow
def test_pp2_without_fsdp_plan_equals_a_real_steps_bytes(tmp_path):
    """pp2 at dp = tp = 1 with bf16 weights and moments: FSDP is left out (spec.uses_fsdp); each rank's planned
    parameter, gradient and optimizer bytes equal one real training step's, byte for byte."""
    overrides = ["recipe=tiny", "mesh.pp=2", "train.max_steps=1", "data.seq_len=64", "model.dtype=bfloat16",
                 "optim.master_dtype=bfloat16", "optim.state_dtype=bfloat16", "model.kernels.gdn=torch",
                 "train.progress_bar=false", "checkpoint.export_hf=false", f"run_dir={tmp_path}"]
    plans, real = _planned_and_real(2, overrides)
    _assert_plan_bytes(plans, real, params="params")
    for p in plans:
        assert p.unsharded_bytes == {"knob_off": 0, "knob_on": 0}
        assert p.grad_bytes["knob_on"] == p.grad_bytes["knob_off"], (p.rank, p.grad_bytes)


@pytest.mark.distributed
@pytest.mark.slow
def test_tiny_3d_lora_plan_equals_a_real_steps_bytes(tmp_path):
    """peft=lora on tp2 x pp2 x dp2, bf16 compute with fp32 master weights (knob off, 2 microbatches): the frozen
    base is held in bf16 only, the adapters in fp32 with gradients and AdamW state; every rank's planned parameter
    (base + adapters), gradient and optimizer bytes equal one real training step's, byte for byte."""
    overrides = ["recipe=tiny_3d", "peft=lora", "train.max_steps=1", "data.seq_len=64",
                 "pipeline.reduce_grad_per_microbatch=false", "model.dtype=bfloat16", "optim.master_dtype=float32",
                 "optim.state_dtype=float32", "model.kernels.gdn=torch", "train.progress_bar=false",
                 "checkpoint.export_hf=false", f"run_dir={tmp_path}"]
    plans, real = _planned_and_real(8, overrides)
    _assert_plan_bytes(plans, real, params="all_params")
    assert all(seen["params"] < seen["all_params"] for seen in real)  # the optimizer holds the adapters only


@pytest.mark.distributed
@pytest.mark.slow
def test_tied_lora_train_embeddings_plan_equals_a_real_steps_bytes(tmp_path):
    """peft=lora with peft.train_embeddings=true on a model with tied embeddings, tp2 x dp2 (vocab parallel), bf16
    compute with fp32 master weights: the one tied matrix (in the FSDP root) is counted once, in fp32 with its
    gradient and AdamW state, beside the adapters; every rank's planned bytes equal one real step's."""
    import dataclasses

    from helpers import save_random_checkpoint
    from qwenft.data.tokenizer import load_tokenizer
    from qwenft.models.qwen3_5.configs import named_config

    cfg = dataclasses.replace(named_config("tiny"), tie_word_embeddings=True)
    cfg.text.vocab_size = max(cfg.text.vocab_size, len(load_tokenizer("tiny")))
    ckpt = save_random_checkpoint(cfg, tmp_path / "tied", tokenizer="tiny")
    overrides = ["recipe=tiny", "peft=lora", "peft.train_embeddings=true", f"model.path={ckpt}", "mesh.tp=2",
                 "mesh.dp=2", "train.max_steps=1", "data.seq_len=64", "train.global_batch_size=4",
                 "train.micro_batch_size=1", "pipeline.reduce_grad_per_microbatch=false", "model.dtype=bfloat16",
                 "optim.master_dtype=float32", "optim.state_dtype=float32", "model.kernels.gdn=torch",
                 "train.progress_bar=false", "checkpoint.export_hf=false", f"run_dir={tmp_path / 'run'}"]
    plans, real = _planned_and_real(4, overrides)
    _assert_plan_bytes(plans, real, params="all_params")
    # the optimizer holds the tied matrix: two fp32 moments of its shard over tp x dp, and the adapters
    shard = cfg.text.vocab_size * cfg.text.hidden_size // 4
    assert real[0]["optimizer"] > 2 * 4 * shard


@pytest.mark.slow
@pytest.mark.parametrize("recipe, world", [("qwen3_5_35b_a3b", 8), ("qwen3_5_122b_a10b", 32), ("qwen3_5_397b_a17b", 128)])
def test_moe_recipes_fit_every_rank(recipe, world):
    """The MoE recipes' layouts, chosen with the planner (their comments give the numbers): every rank of the
    whole mesh planned and within plan.gpu_memory_gib, every expert of the model held once over the ranks."""
    cfg, plans = _plan(f"recipe={recipe}")
    assert [p.rank for p in plans] == list(range(world))
    assert all(p.total_bytes < cfg.plan.gpu_memory_gib * plan_lib.GIB for p in plans)
    t = model_config(cfg).text
    assert sum(p.expert_params for p in plans) == (
        t.num_hidden_layers * t.num_experts * 3 * t.moe_intermediate_size * t.hidden_size)


@pytest.mark.distributed
@pytest.mark.slow
def test_tiny_moe_plan_equals_a_real_steps_bytes(tmp_path):
    """tiny_moe on pp2 x dp2 (fp32 on CPU, knob off, 2 microbatches): the fused routed experts, the router and the
    shared expert of every MoE layer are in each rank's planned parameter, gradient and optimizer bytes, equal to
    what one real training step allocates, byte for byte."""
    overrides = ["recipe=tiny_moe", "mesh.pp=2", "mesh.dp=2", "train.max_steps=1", "data.seq_len=64",
                 "pipeline.reduce_grad_per_microbatch=false", "model.dtype=float32", "model.kernels.moe=loop",
                 "model.kernels.gdn=torch", "train.progress_bar=false", "checkpoint.export_hf=false",
                 f"run_dir={tmp_path}"]
    plans, real = _planned_and_real(4, overrides)
    _assert_plan_bytes(plans, real, params="params")


def test_tiny_moe_plan_holds_every_expert_once():
    """pp2 x dp2: each rank stores half of its stage's experts (FSDP shards the experts' dim over dp), the four
    ranks together every expert of every layer once, and the whole model once."""
    cfg, plans = _plan("recipe=tiny_moe", "mesh.pp=2", "mesh.dp=2")
    t = model_config(cfg).text
    one_layer = t.num_experts * 3 * t.moe_intermediate_size * t.hidden_size
    for p in plans:
        assert p.expert_params * 2 * cfg.mesh.ep == p.layers * one_layer
    assert sum(p.expert_params for p in plans) == t.num_hidden_layers * one_layer
    assert sum(p.params_owned for p in plans) == _model_params(cfg)


@pytest.mark.slow
def test_27b_lora_plan_keeps_optimizer_state_for_the_adapters_only(tmp_path, capsys):
    """`qwenft plan recipe=qwen3_5_27b_lora` against the same recipe fully finetuned (fp32 master weights and AdamW
    state both): per rank, the adapters' (~0.4% of the model) optimizer state and gradients are under 1% of full
    finetuning's, and the frozen base is held once in bf16, half of the fp32 master weights."""
    reports = {}
    for peft in ("lora", "none"):
        out = tmp_path / f"{peft}.json"
        assert main(["plan", "recipe=qwen3_5_27b_lora", f"peft={peft}", f"plan.json={out}"]) == 0
        reports[peft] = json.loads(out.read_text())["ranks"]
        table = capsys.readouterr().out
        assert ("frozen base bfloat16, lora adapters float32" in table) == (peft == "lora"), table
    assert len(reports["lora"]) == len(reports["none"]) == 2  # tp2 (mesh.dp=-1 planned as 1)
    for lora, full in zip(reports["lora"], reports["none"]):
        assert 0 < lora["optimizer_bytes"] < 0.01 * full["optimizer_bytes"], (lora, full)
        assert 0 < lora["grad_bytes"]["knob_off"] < 0.01 * full["grad_bytes"]["knob_off"], (lora, full)
        assert 0.5 * full["param_bytes"] < lora["param_bytes"] < 0.51 * full["param_bytes"], (lora, full)
        assert lora["total_bytes"] < 0.5 * full["total_bytes"]


@pytest.mark.slow
def test_fsdp_prefetch_gathers_one_more_layer_per_unit_ahead():
    """27B pp2 x dp4 in bf16: the largest run of units gathered at once holds the head (or the embedding) and the
    layer next to it; mesh.fsdp_prefetch=2 adds the second layer from each end, a GatedDeltaNet layer on both
    stages (layers 1 and 62), its unsharded parameters at 2 bytes each (4 for the fp32 decay parameters,
    gdn.Decay). fsdp_prefetch=1 is what FSDP2 does implicitly: no change."""
    from qwenft.models.loader import build_model

    gathered = {}
    for n in (0, 1, 2):
        cfg, plans = _plan("recipe=qwen3_5_27b_pp2dp4", f"mesh.fsdp_prefetch={n}")
        gathered[n] = {p.pp_rank: p.unsharded_bytes["knob_on"] for p in plans}
    layers = build_model(model_config(cfg), device="meta").layers
    for stage, layer in ((0, "1"), (1, "62")):
        assert layers[layer].layer_type != FULL_ATTENTION
        decay = {id(p) for p in layers[layer].linear_attn.decay.parameters()}
        one_layer = sum((4 if id(p) in decay else 2) * p.numel() for p in layers[layer].parameters())
        assert gathered[1][stage] == gathered[0][stage]
        assert gathered[2][stage] - gathered[0][stage] == one_layer, (stage, gathered, one_layer)


# ------------------------------------------------------------------ activation estimate, CLI

def test_attention_layer_estimate_matches_autograds_saved_tensors():
    """A bf16 gated-attention layer's forward on CPU (SDPA's flash kernel keeps q, k, v, output, log-sum-exp, as on
    GPU): the bytes autograd saves per token, counted by saved-tensor hooks, within 1% of the estimate."""
    from qwenft.models.qwen3_5.attention import RotaryEmbedding
    from qwenft.models.qwen3_5.model import DecoderLayer

    t = TextConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=2, head_dim=128, mrope_section=[6, 5, 5], vocab_size=512)
    tokens = 256
    torch.manual_seed(0)
    layer = DecoderLayer(t, 3, "torch").to(torch.bfloat16)
    assert layer.layer_type == FULL_ATTENTION
    h = torch.randn(1, tokens, t.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    rope = RotaryEmbedding(t)(torch.arange(tokens)[None], torch.bfloat16)
    with saved_tensor_bytes(*layer.parameters(), h) as saved:
        layer(h, rope)
    measured = sum(saved.values()) / tokens
    estimate = plan_lib.layer_activation_bytes(t, FULL_ATTENTION, tp=1, compute_bytes=2)
    assert abs(measured - estimate) < 0.01 * measured, (measured, estimate)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_moe_block_estimate_matches_autograds_saved_tensors(dtype):
    """An MoE block's forward on CPU (the expert loop; each expert's SwiGLU keeps what torch._grouped_mm's does):
    the bytes autograd saves per token, the block's input included as the estimate counts it, within 1% of
    `moe_activation_bytes`. The estimate leaves out the router weight's fp32 copy (per layer, not per token)."""
    from qwenft.models.qwen3_5.moe import MoE

    t = TextConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                   mrope_section=[4, 2, 2], vocab_size=512, num_experts=16, num_experts_per_tok=4,
                   moe_intermediate_size=64, shared_expert_intermediate_size=96)
    tokens = 512
    torch.manual_seed(0)
    block = MoE(t, kernel="loop").to(dtype)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.05)
    x = torch.randn(1, tokens, t.hidden_size, dtype=dtype, requires_grad=True)
    with saved_tensor_bytes(*block.parameters(), x) as saved:
        block(x)
    measured = sum(saved.values()) / tokens + dtype.itemsize * t.hidden_size
    estimate = moe_activation_bytes(t, dtype.itemsize)
    assert abs(measured - estimate) < 0.01 * measured, (measured, estimate)
    # the routed copies dominate: top_k x the expert width, not num_experts x
    assert estimate < dtype.itemsize * t.num_experts_per_tok * (3 * t.hidden_size + 4 * t.moe_intermediate_size) * 2


def test_microbatches_in_flight_follow_the_schedule():
    assert [plan_lib.microbatches_in_flight("1f1b", 4, r, 1, 32) for r in range(4)] == [4, 3, 2, 1]
    assert plan_lib.microbatches_in_flight("gpipe", 4, 3, 1, 32) == 32
    assert plan_lib.microbatches_in_flight("1f1b", 4, 0, 1, 2) == 2
    assert plan_lib.microbatches_in_flight("1f1b", 1, 0, 1, 8) == 1  # pp=1: gradient accumulation


def test_cli_plan_table_json_and_over_flag(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "recipe=tiny_3d", f"plan.json={out}", "plan.gpu_memory_gib=0.001"]) == 0
    table = capsys.readouterr().out
    assert "8 ranks = pp 2 x dp 2 x tp 2" in table and "OVER" in table
    report = json.loads(out.read_text())
    assert report["layout"] == {"pp": 2, "dp": 2, "cp": 1, "tp": 2} and report["over"] == list(range(8))
    assert main(["plan", "recipe=tiny_3d", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["over"] == []


def test_plan_errors_name_the_key(capsys):
    assert main(["plan", "recipe=qwen3_5_27b_tp4pp4", "mesh.tp=8"]) == 2
    assert "mesh.tp=8 does not divide" in capsys.readouterr().err
    with pytest.raises(ValueError, match="plan.gpu_memory_gib=0"):
        compose(["plan.gpu_memory_gib=0"])


@pytest.mark.slow
def test_vlm_plan_counts_videos_at_their_pixel_budget(tmp_path):
    """plan.videos: each video counts the patches the data pipeline makes of the largest video the pixel budget
    lets through (data.video.max_pixels, else the checkpoint's: tiny_vlm's 16 x 64 x 64): 5 frames, which the
    resize counts as 4 and the temporal patches pad to 6, each at a quarter of the budget; on top of
    plan.image_patches; at most every token a vision token, which is also the default."""
    import numpy as np
    from PIL import Image

    from helpers import build_data

    rows = tmp_path / "rows.jsonl"
    row = {"messages": [{"role": "user", "content": [{"type": "video", "video": None}, {"type": "text", "text": "?"}]},
                        {"role": "assistant", "content": "!"}]}
    for budget, (h, w) in ((None, (128, 128)), (32768, (64, 128))):  # tiny_vlm's own; data.video.max_pixels
        frames = []
        for i in range(5):
            frames.append(str(tmp_path / f"{h}x{w}_{i}.png"))
            Image.fromarray(np.full((h, w, 3), 16 * i, np.uint8)).save(frames[-1])
        row["messages"][0]["content"][0]["video"] = frames
        rows.write_text(json.dumps(row) + "\n")
        over = [f"data.video.max_pixels={budget}"] if budget else []
        cfg = compose(["recipe=tiny_vlm", f"data.path={rows}", *over])
        _, data, _ = build_data(cfg, model_config(cfg), 1, 0, 1)
        video_patches = int(next(iter(data))["video_grid_thw"].prod())  # the video at the budget, as trained
        assert video_patches == 6 * h * w // (2 * 16 * 16) == 3 * (budget or 16 * 64 * 64) // (2 * 2 * 16 * 16)

        def act(*plan):
            return _plan("recipe=tiny_vlm", *over, *plan)[1][0].activation_bytes["ac_off"]

        per_patch = (act("plan.image_patches=11") - act("plan.image_patches=10")) / cfg.train.micro_batch_size
        assert per_patch > 0
        assert act("plan.image_patches=10", "plan.videos=2") - act("plan.image_patches=10") == pytest.approx(
            2 * video_patches * cfg.train.micro_batch_size * per_patch)
        assert act("plan.videos=1") - act("plan.image_patches=1") == pytest.approx(
            (video_patches - 1) * cfg.train.micro_batch_size * per_patch)
    every = act()  # seq_len x merge^2 patches a row
    assert act("plan.videos=1000") == every and act("plan.image_patches=10", "plan.videos=1") < every
    with pytest.raises(ValueError, match=r"^plan.videos=-1 must be >= 0$"):
        compose(["plan.videos=-1"])
