"""Memory options through the runner (CPU, gloo): model.ce_chunk_tokens trains the same numbers as the whole
logits; optim.state_dtype / optim.master_dtype = bfloat16 train like fp32 within bf16's tolerance."""

import dataclasses

import pytest
import torch

from distributed import run_apart, run_distributed
from helpers import assert_same_training, compose, parity_overrides, train, train_with_state


def _overrides(tmp_path, name, *extra):
    return parity_overrides(tmp_path / name, "checkpoint.export_hf=false", *extra)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, whole logits, with a validation pass after every step."""
    tmp = tmp_path_factory.mktemp("reference")
    (result,) = run_distributed(train_with_state, 1, _overrides(tmp, "ref", "eval.every_steps=1", "eval.dataset=tiny",
                                                                "eval.max_batches=2"))
    return result


@pytest.mark.distributed
@pytest.mark.slow
def test_chunked_ce_trains_like_whole_logits(tmp_path, reference):
    """48 tokens per chunk: 128-token rows split into 48 + 48 + 32."""
    (result,) = run_distributed(train_with_state, 1, _overrides(
        tmp_path, "ce48", "model.ce_chunk_tokens=48", "eval.every_steps=1", "eval.dataset=tiny", "eval.max_batches=2"))
    assert_same_training(result, reference)


@pytest.mark.distributed
@pytest.mark.slow
def test_chunked_ce_under_pp2_trains_like_whole_logits(tmp_path, reference):
    """The last stage gets the labels as a kwarg and returns the CE sum; the eval schedule does the same."""
    results = run_distributed(train_with_state, 2, _overrides(
        tmp_path, "pp2-ce", "mesh.pp=2", "model.ce_chunk_tokens=48", "eval.every_steps=1", "eval.dataset=tiny",
        "eval.max_batches=2"))
    for result in results:
        assert_same_training(result, reference)


@pytest.mark.distributed
@pytest.mark.slow
def test_chunked_ce_under_dp2_trains_like_whole_logits(tmp_path, reference):
    """FSDP over 2 ranks: lm_head.weight is all-gathered for the head's forward and backward."""
    results = run_distributed(train_with_state, 2, _overrides(tmp_path, "dp2-ce", "model.ce_chunk_tokens=48",
                                                              "pipeline.reduce_grad_per_microbatch=true"))
    assert_same_training(results[0], dataclasses.replace(reference, val_losses={}))


@pytest.mark.distributed
@pytest.mark.slow
def test_bf16_state_and_weights_train_like_fp32(tmp_path):
    """20 steps at the tiny recipe's lr 3e-3: bf16 moments (state), bf16 weights with stochastic rounding
    (master), and both, follow the fp32 run's losses while they fall from 6.25 to 3.9. Measured worst per-step
    differences: 0.04% (state), 0.45% (master), 0.48% (both); bf16 compute alone (model.dtype=bfloat16,
    fp32 master) already differs by 0.63%, so the bf16 weights add no more than bf16 compute does."""
    common = ["train.max_steps=20", "optim.lr=3e-3", "lr_scheduler.warmup_steps=5"]
    runs = {
        "fp32": [],
        "state": ["optim.state_dtype=bfloat16"],
        "master": ["optim.master_dtype=bfloat16"],
        "both": ["optim.state_dtype=bfloat16", "optim.master_dtype=bfloat16"],
    }
    overrides = [_overrides(tmp_path, name, *common, *extra) for name, extra in runs.items()]
    results = run_apart(lambda i: train(0, 1, overrides[i]), len(overrides))  # side by side, a lone rank each
    losses = {name: result.losses for name, result in zip(runs, results)}
    ref = losses["fp32"]
    assert ref[-1] < ref[0] - 2.0
    for name, tol in {"state": 0.002, "master": 0.015, "both": 0.015}.items():
        worst = max(abs(a - b) / b for a, b in zip(losses[name], ref))
        assert worst < tol, f"{name}: losses {losses[name]} vs fp32 {ref} (worst rel diff {worst:.4f})"


@pytest.mark.distributed
@pytest.mark.slow
def test_bf16_weights_keep_small_updates(tmp_path):
    """lr 2e-5, constant: each AdamW update (~2e-5) is below half a bf16 ulp of most weights (6e-5 at 0.02).
    Stochastic rounding keeps them on average: the loss after 20 steps is the fp32 run's (measured 6.1691 vs
    6.1692, down from 6.2542). Round to nearest (stochastic_rounding=False, not a config key) measured 6.2356:
    it kept 30% of the fp32 run's parameter change."""
    common = ["train.max_steps=20", "optim.lr=2e-5", "lr_scheduler.warmup_steps=0", "lr_scheduler.decay=constant"]
    overrides = [_overrides(tmp_path, "fp32", *common),
                 _overrides(tmp_path, "bf16", *common, "optim.state_dtype=bfloat16", "optim.master_dtype=bfloat16")]
    fp32, bf16 = run_apart(lambda i: train(0, 1, overrides[i]), 2)  # side by side, a lone rank each
    fell = fp32.losses[0] - fp32.losses[-1]
    assert fell > 0.05
    assert abs(bf16.losses[-1] - fp32.losses[-1]) < 0.1 * fell, (bf16.losses, fp32.losses)


@pytest.mark.distributed
def test_master_bf16_keeps_bf16_weights_grads_and_state(tmp_path):
    """The 8-bytes-per-parameter layout: bf16 weights, bf16 gradients, bf16 moments (GDN's A_log / dt_bias
    stay fp32)."""
    def body(rank, world_size, overrides):
        from qwenft.train import build, runner

        seen = {}
        original = build.build_optimizer

        def spy(params, *args, **kwargs):  # records what the first optimizer step sees
            opt = original(params, *args, **kwargs)

            def before(opt, args, kwargs):
                seen.setdefault("param", {p.dtype for p in params})  # a DTensor's dtype is its shard's
                seen.setdefault("grad", {p.grad.dtype for p in params})

            def after(opt, args, kwargs):
                seen.setdefault("state", {t.dtype for s in opt.state.values() for k, t in s.items() if k != "step"})

            opt.register_step_pre_hook(before)
            opt.register_step_post_hook(after)
            return opt

        build.build_optimizer = spy
        try:
            runner.run(compose(overrides))
        finally:
            build.build_optimizer = original
        return seen

    (seen,) = run_distributed(body, 1, _overrides(tmp_path, "dtypes", "train.max_steps=1", "optim.state_dtype=bfloat16",
                                                  "optim.master_dtype=bfloat16"))
    assert seen["param"] == {torch.bfloat16, torch.float32}  # fp32: A_log, dt_bias only
    assert seen["grad"] == seen["param"]
    assert seen["state"] == {torch.bfloat16}


# every bf16 option and the chunked CE at the tiny recipe's lr, 5 steps
BF16_OPTIONS = ["train.max_steps=5", "optim.lr=3e-3", "optim.state_dtype=bfloat16", "optim.master_dtype=bfloat16",
                "model.ce_chunk_tokens=48"]


@pytest.fixture(scope="module")
def bf16_one(tmp_path_factory):
    """One process with BF16_OPTIONS, keeping its checkpoints of steps 2, 4 and 5: the reference of the two-rank
    runs and the uninterrupted run a resume is compared with."""
    tmp = tmp_path_factory.mktemp("bf16_one")
    (result,) = run_distributed(train_with_state, 1, _overrides(tmp, "one", "checkpoint.every_steps=2",
                                                                "checkpoint.keep=3", *BF16_OPTIONS))
    return result, tmp / "one"


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("mesh", [["mesh.dp=2"], ["mesh.pp=2"], ["mesh.tp=2", "mesh.vocab_parallel=false"],
                                  ["mesh.tp=2", "model.kernels.ce=fused"]])
def test_all_options_on_two_ranks_train_like_one(tmp_path, bf16_one, mesh):
    """All three options with FSDP over 2 ranks (DTensor shards in the optimizer), 2 pipeline stages, or 2
    tensor-parallel ranks (the head whole, or vocab-parallel with the fused CE chunked). Stochastic rounding
    draws per local chunk, so the numbers are not bitwise those of one process: measured within 0.05% over 5
    steps (allowed: 1%). Under tp, replicated weights (norms) must
    stay identical on both ranks: each rank rounds its own copy, with the same bits (a rank-dependent seed
    was checked to make them differ)."""
    one, _ = bf16_one
    results = run_distributed(train_with_state, 2, _overrides(tmp_path, "two", *BF16_OPTIONS, *mesh))
    for step, (a, b) in enumerate(zip(results[0].losses, one.losses)):
        assert abs(a - b) < 0.01 * b, f"step {step + 1}: loss {a} vs one process {b}"
    if "mesh.tp=2" in mesh:
        for name, t in results[0].state_dict.items():
            assert torch.equal(t, results[1].state_dict[name]), name


@pytest.mark.distributed
@pytest.mark.slow
def test_bf16_options_resume_exactly(tmp_path, bf16_one):
    """A run resumed from its step-2 checkpoint ends with the uninterrupted run's losses and weights, bit for
    bit: the bf16 moments come back in bf16 (not cast to the weights' dtype) and stochastic rounding draws
    from (seed, step, parameter, chunk), not from a generator state the checkpoint would have to carry."""
    full, full_dir = bf16_one
    step2 = full_dir / "checkpoints" / "step-000002"
    (resumed,) = run_distributed(train_with_state, 1, _overrides(tmp_path, "resumed", f"checkpoint.resume={step2}",
                                                                 *BF16_OPTIONS))
    assert len(full.losses) == 5 and resumed.losses == full.losses[2:]
    for name, t in full.state_dict.items():
        assert torch.equal(resumed.state_dict[name], t), name


@pytest.mark.parametrize("overrides, message", [
    (["model.ce_chunk_tokens=-1"], "model.ce_chunk_tokens=-1 must be >= 0"),
    (["optim.state_dtype=float16"], "optim.state_dtype='float16' is not valid; choose one of float32, bfloat16"),
    (["optim.master_dtype=bfloat16", "model.dtype=float32"], "set model.dtype=auto or bfloat16"),
    (["optim.state_dtype=bfloat16", "optim.fused='true'"], "set optim.fused=auto"),
])
def test_bad_values_are_one_line_errors(overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")) as info:
        compose(["recipe=tiny", *overrides])
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("overrides, device, expected", [
    ([], "cuda", "fused"),  # auto: the fused CE on the vocab-parallel head
    ([], "cpu", "torch"),
    (["model.ce_chunk_tokens=1024"], "cuda", "fused"),
    (["model.ce_chunk_tokens=1024", "model.kernels.ce=fused"], "cpu", "fused"),
    (["model.ce_chunk_tokens=1024", "mesh.vocab_parallel=false"], "cpu", "torch"),
    (["model.ce_chunk_tokens=1024"], "cpu", "model.ce_chunk_tokens=1024 with model.kernels.ce=torch (model.kernels.ce="
     "auto off CUDA) needs the whole lm_head on each rank, but mesh.vocab_parallel=true shards it over mesh.tp=2; "
     "set model.kernels.ce=fused, mesh.vocab_parallel=false or model.ce_chunk_tokens=0"),
    (["model.ce_chunk_tokens=1024", "model.kernels.ce=torch"], "cuda", "set model.kernels.ce=fused, "
     "mesh.vocab_parallel=false or model.ce_chunk_tokens=0"),
])
def test_ce_kernel_on_a_tp2_vocab_parallel_head(overrides, device, expected):
    """model.kernels.ce=auto is fused on CUDA at tp2 with mesh.vocab_parallel=true too; model.ce_chunk_tokens
    chunks the fused CE there, but the torch kernel's chunked recompute needs the whole head: one line, the keys."""
    from qwenft.conf.layout import resolve_layout
    from qwenft.train.build import model_config
    from qwenft.train.spec import resolve_spec

    cfg = compose(["recipe=tiny", "mesh.tp=2", *overrides])
    layout = resolve_layout(2, 1, 1, 2)
    if expected in ("fused", "torch"):
        assert resolve_spec(cfg, layout, model_config(cfg), device).parallel.ce_kernel == expected
        return
    with pytest.raises(ValueError) as info:
        resolve_spec(cfg, layout, model_config(cfg), device)
    assert expected in str(info.value) and "\n" not in str(info.value), str(info.value)
