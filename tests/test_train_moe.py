"""`qwenft train` on the MoE model (tiny_moe, fp32, CPU): its loss falls, its first loss (token CE + aux loss)
is transformers', every mesh and option (tensor parallelism with the MoE block replicated) trains the numbers of
one process, sequence parallelism refuses it at start, and its HF export loads in transformers."""

import pytest
import torch
from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM

from distributed import run_distributed
from helpers import (assert_same_training, build_data, compose, make_hf_moe_model, model_config, parity_overrides,
                     raised_line, read_metrics, rel_err, tiny_overrides, train, train_with_state)

# AdamW's eps at 1e-6 in the parity runs: see tests/test_expert_parallel.py's PARITY
MOE = ("model.name=tiny_moe", "model.kernels.moe=loop", "optim.eps=1e-6")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, global batch 4 as 4 microbatches of 1."""
    (result,) = run_distributed(train_with_state, 1, parity_overrides(tmp_path_factory.mktemp("moe") / "ref", *MOE))
    return result


@pytest.mark.distributed
def test_tiny_moe_loss_falls_and_logs_routing(tmp_path):
    (result,) = run_distributed(train, 1, tiny_overrides(tmp_path / "run", "recipe=tiny_moe", "train.max_steps=12",
                                                        "checkpoint.export_hf=false"))
    assert result.losses[-1] < result.losses[0] - 0.5, result.losses
    rows = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    for r in rows:
        assert r["aux_loss"] >= 1.0 - 1e-6  # E * sum f P is 1 at a perfectly even routing, above otherwise
        loads = r["expert_load_max_over_mean"]
        assert len(loads) == 4 and all(1.0 <= x <= 8 / 2 for x in loads), loads  # max <= all tokens: E / top_k


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("knob", ["false", "true"])
def test_dp2_equals_one_process(tmp_path, reference, knob):
    results = run_distributed(train_with_state, 2, parity_overrides(
        tmp_path / f"dp2-{knob}", *MOE, f"pipeline.reduce_grad_per_microbatch={knob}"))
    for result in results:
        assert_same_training(result, reference)


@pytest.mark.slow
@pytest.mark.distributed
def test_pp2_equals_one_process(tmp_path, reference):
    """Each stage's routing travels with the hidden states; the last stage's aux loss reaches stage 0's routers
    through the pipeline's backward."""
    results = run_distributed(train_with_state, 2, parity_overrides(
        tmp_path / "pp2", *MOE, "mesh.pp=2", "pipeline.schedule=1f1b"))
    for result in results:
        assert_same_training(result, reference)


@pytest.mark.slow
@pytest.mark.distributed
def test_activation_checkpointing_equals_off(tmp_path, reference):
    """The router statistics come out of checkpointed layers as a side output; the aux gradient must survive
    the recompute."""
    (result,) = run_distributed(train_with_state, 1, parity_overrides(
        tmp_path / "ac", *MOE, "model.activation_checkpointing=true"))
    assert_same_training(result, reference)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("seq_len", [20, 96])
def test_step1_loss_equals_transformers(tmp_path, seq_len):
    """One microbatch of 2 rows on one rank: qwenft's first loss is transformers'
    `Qwen3_5MoeForCausalLM(labels=..., attention_mask=..., output_router_logits=True).loss` (mean token CE +
    router_aux_loss_coef x aux) on the same weights and rows, one document per row (data.packing=pad).
    seq_len 20 cuts every document (no padding); at 96 the rows end in padding, which transformers' aux loss
    leaves out through the attention mask and qwenft's through the batch's padding_mask. Right padding changes no
    real token's output in either model (transformers' GatedDeltaNet zeroes padded states; qwenft runs the tail
    as a segment of its own)."""
    from qwenft.data.tokenizer import load_tokenizer
    from qwenft.models.qwen3_5.configs import named_config

    tokenizer = load_tokenizer("tiny")
    cfg = named_config("tiny_moe")
    cfg.text.vocab_size = max(cfg.text.vocab_size, len(tokenizer))
    cfg.text.router_aux_loss_coef = 0.05  # the checkpoint's, 50x the default: an aux term the tolerance resolves
    hf = make_hf_moe_model(cfg)
    hf.save_pretrained(tmp_path / "hf")
    tokenizer.save_pretrained(tmp_path / "hf")

    overrides = tiny_overrides(tmp_path / "run", *MOE, f"model.path={tmp_path / 'hf'}", "train.max_steps=1",
                               "train.global_batch_size=2", "train.micro_batch_size=2", "data.packing=pad",
                               f"data.seq_len={seq_len}", "data.train_on=all", "checkpoint.export_hf=false")
    (result,) = run_distributed(train, 1, overrides)

    run_cfg = compose(overrides)
    _, data, _ = build_data(run_cfg, model_config(run_cfg), 2, 0, 1)
    mb = next(iter(data))
    labels, attention_mask = mb["labels"], (~mb["padding_mask"]).long()
    padded = int(mb["padding_mask"].sum())
    assert (padded == 0) == (seq_len == 20), mb["padding_mask"]
    # one document per row, then its padding tail
    assert (mb["position_ids"] == torch.arange(seq_len) - attention_mask.sum(1, keepdim=True) * mb["padding_mask"]).all()
    with torch.no_grad():
        ref = hf(input_ids=mb["input_ids"], attention_mask=attention_mask, labels=labels, shift_labels=labels,
                 output_router_logits=True)
        unmasked = hf(input_ids=mb["input_ids"], output_router_logits=True).aux_loss
    ce = torch.nn.functional.cross_entropy(ref.logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    assert abs(ref.loss.item() - (ce + cfg.text.router_aux_loss_coef * ref.aux_loss).item()) < 1e-6  # how HF adds them
    assert abs(result.losses[0] - ref.loss.item()) < 1e-5 * ref.loss.item(), (result.losses[0], ref.loss.item())
    assert cfg.text.router_aux_loss_coef * ref.aux_loss.item() > 1e-2 * ref.loss.item()  # an aux term to check
    if padded:  # the padding would move the loss by more than the tolerance, had it been counted
        gap = cfg.text.router_aux_loss_coef * abs(unmasked.item() - ref.aux_loss.item())
        assert gap > 1e-5 * ref.loss.item(), gap


@pytest.mark.slow
@pytest.mark.distributed
def test_tp2_equals_one_process(tmp_path, reference):
    """Attention and GDN sharded by head, the MoE block replicated on both tp ranks: losses and parameters within
    fp32_rtol (seen: 2.0e-5 on layers.0.linear_attn.a_proj.weight, against 1.9e-4 for one tensor)."""
    results = run_distributed(train_with_state, 2, parity_overrides(tmp_path / "tp2", *MOE, "mesh.tp=2"))
    for result in results:
        assert_same_training(result, reference)


@pytest.mark.distributed
def test_sequence_parallel_refuses_moe_at_start(tmp_path):
    with pytest.raises(Exception) as info:
        run_distributed(train, 2, tiny_overrides(tmp_path / "sp", *MOE, "mesh.tp=2", "mesh.sequence_parallel=true"))
    assert raised_line(info) == ("ValueError: mesh.sequence_parallel=true with mesh.tp=2 is not supported for an MoE "
                                 "model (num_experts=8); set mesh.sequence_parallel=false")
    assert not (tmp_path / "sp" / "metrics.jsonl").exists()


@pytest.mark.slow
@pytest.mark.distributed
def test_export_loads_in_transformers_with_equal_logits(tmp_path):
    """A 2-step tiny_moe run's HF export (fp32): every key of transformers' model, and its logits."""
    from qwenft.models.loader import build_model

    (result,) = run_distributed(train_with_state, 1, tiny_overrides(
        tmp_path / "run", *MOE, "train.max_steps=2", "train.global_batch_size=2", "train.micro_batch_size=1",
        "checkpoint.export_hf=true", "checkpoint.export_dtype=float32"))
    hf, info = Qwen3_5MoeForCausalLM.from_pretrained(tmp_path / "run" / "hf", output_loading_info=True,
                                                     torch_dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    hf.set_experts_implementation("eager")
    state = result.state_dict
    cfg = compose(tiny_overrides(tmp_path / "x", *MOE))
    model_cfg = model_config(cfg)
    model_cfg.text.vocab_size = state["embed_tokens.weight"].shape[0]
    model = build_model(model_cfg, kernels="torch", moe_kernel="loop", device="cpu")
    model.load_state_dict(state)
    ids = torch.randint(0, model_cfg.text.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel_err(model(input_ids=ids), hf(input_ids=ids).logits) < 1e-5
