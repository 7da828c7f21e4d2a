"""LoRA on a model with tied embeddings (`tie_word_embeddings`, as Qwen3.5 0.8B / 2B / 4B): with
peft.train_embeddings or peft.train_head the one matrix that embed_tokens and lm_head share trains, one parameter
with one gradient summing both uses and one AdamW state; peft loads the adapter dir with its `ensure_weight_tying`
(fp32, CPU)."""

import dataclasses
import json

import pytest
import torch

from distributed import run_distributed
from helpers import (assert_same_tensors, assert_within, compose, fp32_rtol, save_random_checkpoint,
                     train_recording_grads)

EMBED = "embed_tokens.weight"
LR = 5e-3


def _tied_config():
    from qwenft.data.tokenizer import load_tokenizer
    from qwenft.models.qwen3_5.configs import named_config

    cfg = dataclasses.replace(named_config("tiny"), tie_word_embeddings=True)
    cfg.text.vocab_size = max(cfg.text.vocab_size, len(load_tokenizer("tiny")))
    return cfg


@pytest.fixture(scope="module")
def tied_ckpt(tmp_path_factory):
    """The tiny model with tied embeddings, random weights (norms perturbed) and the tiny tokenizer, in HF layout."""
    return save_random_checkpoint(_tied_config(), tmp_path_factory.mktemp("tied") / "base", perturb_norms=True,
                                  tokenizer="tiny")


def _overrides(ckpt, run_dir, *extra):
    return ["recipe=tiny", "peft=lora", f"model.path={ckpt}", "data.tokenizer=tiny", "train.max_steps=3",
            "data.seq_len=64", "model.kernels.gdn=torch", "train.progress_bar=false", f"optim.lr={LR}",
            "optim.max_grad_norm=0", "lr_scheduler.warmup_steps=0", "checkpoint.export_hf=false",
            "train.global_batch_size=4", "train.micro_batch_size=1", "peft.train_embeddings=true",
            f"run_dir={run_dir}", *extra]


def _train(rank, world_size, overrides):
    """(losses, [{trained name: gradient} per step], {trained name: value after training}, facts about the tied
    parameter and the optimizer) of this rank."""
    job, losses, grads, values = train_recording_grads(overrides)
    model = job.model_parts[0]
    facts = {"head_is_embedding": model.lm_head is not None and model.embed_tokens is not None
             and model.lm_head.weight is model.embed_tokens.weight,
             "optimizer_params": sum(len(g["params"]) for g in job.optimizer.param_groups),
             "optimizer_states": len(job.optimizer.state), "trained_names": list(values)}
    return losses, grads, values, facts


@pytest.fixture(scope="module")
def reference(tied_ckpt, tmp_path_factory):
    """One process, peft.train_embeddings=true, global batch 4 as 4 microbatches of 1."""
    (result,) = run_distributed(_train, 1, _overrides(tied_ckpt, tmp_path_factory.mktemp("ref") / "run"))
    return result


def _base_embedding(ckpt) -> torch.Tensor:
    from safetensors.torch import load_file

    return load_file(ckpt / "model.safetensors")["model.embed_tokens.weight"].float()


@pytest.mark.slow
@pytest.mark.distributed
def test_step0_loss_equals_base_model_exactly(tied_ckpt, reference, tmp_path):
    from qwenft.train.runner import run

    def base(rank, world_size, overrides):
        return run(compose(overrides)).losses

    overrides = [o for o in _overrides(tied_ckpt, tmp_path / "base", "train.max_steps=1")
                 if not o.startswith("peft")]
    (losses,) = run_distributed(base, 1, overrides)
    assert losses[0] == reference[0][0]


@pytest.mark.slow
@pytest.mark.distributed
def test_one_shared_matrix_trains_for_both_uses(tied_ckpt, reference):
    """The trained parameters are the adapters and the one tied matrix (no separate lm_head), one AdamW state
    each; the head is the embedding's parameter, it gets gradients from step 1 on, moves away from the
    checkpoint's, and the loss falls."""
    losses, grads, values, facts = reference
    assert facts["head_is_embedding"]
    names = facts["trained_names"]
    assert EMBED in names and not any(n.startswith("lm_head") for n in names)
    assert all(".lora_" in n for n in names if n != EMBED)
    assert facts["optimizer_params"] == facts["optimizer_states"] == len(names)
    assert all(step[EMBED].norm() > 0 for step in grads)
    assert (values[EMBED] - _base_embedding(tied_ckpt)).abs().max() > 1e-3
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("flags", [("train_embeddings",), ("train_head",), ("train_embeddings", "train_head")])
def test_shared_gradient_sums_the_embedding_and_head_gradients(flags):
    """Any of the flags trains the tied parameter, and its gradient is the sum of the gradients that an untied copy
    (the same matrix in embed_tokens and lm_head, both trained) gets in its embedding and its head."""
    from qwenft.models.loader import build_model, init_random_weights
    from qwenft.models.lora import LoRAConfig, apply_lora

    cfg = _tied_config()
    lora = LoRAConfig(rank=4, alpha=8, **{f: True for f in flags})
    tied = init_random_weights(build_model(cfg, kernels="torch", device="meta"), seed=0, device="cpu")
    apply_lora(tied, lora, adapter_dtype=torch.float32)
    untied = build_model(dataclasses.replace(cfg, tie_word_embeddings=False), kernels="torch", device="cpu")
    apply_lora(untied, LoRAConfig(rank=4, alpha=8, train_embeddings=True, train_head=True),
               adapter_dtype=torch.float32)
    state = tied.state_dict()
    with torch.no_grad():
        for name, p in untied.named_parameters():
            p.copy_(state[EMBED] if name == "lm_head.weight" else state[name])
        for lora_b in (p for n, p in tied.named_parameters() if ".lora_B." in n):  # adapters off zero: A gets a gradient
            lora_b.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
        for name, p in untied.named_parameters():
            if ".lora_B." in name:
                p.copy_(dict(tied.named_parameters())[name])
    assert tied.lm_head.weight is tied.embed_tokens.weight and tied.embed_tokens.weight.requires_grad
    ids = torch.randint(0, cfg.text.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    for model in (tied, untied):
        model.init_buffers()
        model(input_ids=ids, labels=ids).backward()
    want = untied.embed_tokens.weight.grad + untied.lm_head.weight.grad
    assert untied.embed_tokens.weight.grad.norm() > 0 and untied.lm_head.weight.grad.norm() > 0
    err = (tied.embed_tokens.weight.grad - want).norm() / want.norm()
    assert err < 1e-6, f"tied gradient vs embedding + head gradients: rel err {err:.2e}"


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("mesh", [["pipeline.reduce_grad_per_microbatch=false"],
                                  ["pipeline.reduce_grad_per_microbatch=true"], ["mesh.tp=2"]],
                         ids=["dp2", "dp2-knob", "tp2"])
def test_mesh_equals_one_process(tied_ckpt, reference, tmp_path, mesh):
    """FSDP2 over dp2 (the tied matrix in the root unit), and tp2 (the matrix one vocab-sharded parameter): each
    step's loss, and every trained parameter's gradient (as one vector and each tensor, the tied matrix included),
    within fp32_rtol of one process's for the AdamW steps before it (at this run's lr 5e-3, step 3 allows 6.5e-5,
    seen up to 1.1e-5: AdamW at a large lr turns last-bit differences into lr-sized moves)."""
    results = run_distributed(_train, 2, _overrides(tied_ckpt, tmp_path / "mesh", *mesh))
    ref_losses, ref_grads = reference[0], reference[1]
    for losses, grads, _, _ in results:
        assert len(losses) == 3
        for step, (a, b) in enumerate(zip(losses, ref_losses)):
            assert_within(f"step {step + 1}'s loss", abs(a - b) / abs(b), fp32_rtol(step, lr=LR))
        for step, (got, ref) in enumerate(zip(grads, ref_grads)):
            assert EMBED in ref
            assert_same_tensors(got, ref, fp32_rtol(step, lr=LR), f"step {step + 1}'s gradients")


def _native_logits(cfg, lora, state, input_ids):
    """qwenft's adapted model with the trained `state` (fp32)."""
    from qwenft.models.loader import build_model
    from qwenft.models.lora import apply_lora

    model = build_model(cfg, kernels="torch", device="meta")
    apply_lora(model, lora, adapter_dtype=torch.float32)
    model.to_empty(device="cpu")
    model.tie_weights()
    model.load_state_dict({**state, "lm_head.weight": state[EMBED]}, strict=True)  # tied: one tensor, two keys
    model.init_buffers()
    with torch.no_grad():
        return model.eval()(input_ids=input_ids)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("flags", [("train_embeddings",), ("train_head",)])
def test_adapter_dir_and_merged_export_equal_qwenft(tied_ckpt, tmp_path, flags):
    """The run's adapter dir (and `qwenft export` of its checkpoint) loads in peft onto transformers' tied
    Qwen3_5ForCausalLM with every key used and peft's lm_head tied to the trained embedding: logits equal qwenft's
    within 1e-5; the merged export (W + alpha / r B A, the tied matrix written once) gives them in transformers."""
    from peft import PeftModel
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM

    from qwenft.cli import main
    from qwenft.models.lora import LoRAConfig
    from qwenft.train.runner import run

    def train(rank, world_size, overrides):
        return run(compose(overrides), return_state=True).state_dict

    run_dir = tmp_path / "run"
    flag_overrides = [f"peft.train_embeddings={'train_embeddings' in flags}", f"peft.train_head={'train_head' in flags}"]
    (state,) = run_distributed(train, 1, _overrides(tied_ckpt, run_dir, "peft.rank=4", "peft.alpha=8", "optim.lr=2e-2",
                                                    "checkpoint.export_hf=true", "checkpoint.export_dtype=float32",
                                                    "checkpoint.every_steps=3", *flag_overrides))
    assert "lm_head.weight" not in state and (state[EMBED] - _base_embedding(tied_ckpt)).abs().max() > 1e-3
    assert main(["export", f"run_dir={run_dir}", f"out={tmp_path / 'exported'}", "dtype=float32"]) == 0
    assert main(["export", f"run_dir={run_dir}", f"out={tmp_path / 'merged'}", "dtype=float32", "merged=true"]) == 0

    cfg = _tied_config()
    input_ids = torch.randint(0, cfg.text.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    ours = _native_logits(cfg, LoRAConfig(rank=4, alpha=8, **{f: True for f in flags}), state, input_ids)

    def logits(model):
        with torch.no_grad():
            return model.eval()(input_ids=input_ids).logits

    base_logits = logits(Qwen3_5ForCausalLM.from_pretrained(tied_ckpt, dtype=torch.float32))
    assert (base_logits - ours).abs().max() / ours.abs().max() > 1e-3  # trained away from the base
    for adapter_dir in (run_dir / "adapter", tmp_path / "exported"):
        config = json.loads((adapter_dir / "adapter_config.json").read_text())
        assert config["modules_to_save"] == ["embed_tokens"] and config["ensure_weight_tying"] is True, config
        saved = load_file(adapter_dir / "adapter_model.safetensors")
        whole = {k for k in saved if ".lora_" not in k}
        assert whole == {"base_model.model.model.embed_tokens.weight", "base_model.model.lm_head.weight"}
        assert all(torch.equal(saved[k], state[EMBED]) for k in whole)
        peft_model = PeftModel.from_pretrained(Qwen3_5ForCausalLM.from_pretrained(tied_ckpt, dtype=torch.float32),
                                               adapter_dir)
        loaded = get_peft_model_state_dict(peft_model)
        assert loaded.keys() == saved.keys()  # every key of the file has its module, every adapter of peft its key
        assert all(torch.equal(loaded[k], saved[k]) for k in saved)
        head, embed = peft_model.base_model.model.lm_head, peft_model.base_model.model.model.embed_tokens
        assert head.modules_to_save.default.weight is embed.modules_to_save.default.weight  # peft kept them tied
        err = (logits(peft_model) - ours).abs().max() / ours.abs().max()
        assert err < 1e-5, f"{adapter_dir.name}: peft's logits vs qwenft's: rel err {err:.2e}"
    merged = Qwen3_5ForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    assert merged.lm_head.weight is merged.model.embed_tokens.weight
    assert set(load_file(tmp_path / "merged" / "model.safetensors")) >= {"model.embed_tokens.weight"}
    assert "lm_head.weight" not in load_file(tmp_path / "merged" / "model.safetensors")
    err = (logits(merged) - ours).abs().max() / ours.abs().max()
    assert err < 1e-5, f"merged export's logits vs qwenft's: rel err {err:.2e}"


@pytest.mark.slow
@pytest.mark.distributed
def test_checkpoint_trainable_only_and_resume_bit_identical(tied_ckpt, tmp_path):
    """The checkpoint holds the adapters and the tied matrix (under both of torch's names for the one parameter,
    as its state_dict gives them), and AdamW state for the matrix once; resuming it continues bit-identically."""
    from torch.distributed.checkpoint import FileSystemReader

    def train(rank, world_size, overrides):
        losses, _, values, _ = _train(rank, world_size, overrides)
        return losses, values

    common = ["train.global_batch_size=2", "lr_scheduler.decay=constant", "checkpoint.every_steps=2"]
    (whole,) = run_distributed(train, 1, _overrides(tied_ckpt, tmp_path / "whole", *common, "train.max_steps=4"))
    run_distributed(train, 1, _overrides(tied_ckpt, tmp_path / "split", *common, "train.max_steps=2"))
    keys = FileSystemReader(str(tmp_path / "split" / "checkpoints" / "step-000002")).read_metadata().state_dict_metadata
    model_keys = {k for k in keys if k.startswith("model.")}
    assert {f"model.{EMBED}", "model.lm_head.weight"} <= model_keys
    assert all(".lora_" in k for k in model_keys - {f"model.{EMBED}", "model.lm_head.weight"})
    assert any(k.startswith(f"optim.state.{EMBED}.") for k in keys)
    assert not any(k.startswith("optim.state.lm_head") for k in keys)
    (resumed,) = run_distributed(train, 1, _overrides(tied_ckpt, tmp_path / "split", *common, "train.max_steps=4"))
    assert resumed[0] == whole[0][2:]
    assert resumed[1].keys() == whole[1].keys() and all(torch.equal(resumed[1][k], v) for k, v in whole[1].items())


@pytest.mark.parametrize("peft, key", [(["peft.train_embeddings=true"], "peft.train_embeddings=true"),
                                       (["peft.train_head=true"], "peft.train_head=true"),
                                       (["peft=none"], "model.path=")])
def test_pipeline_parallel_with_a_trained_tied_matrix_fails_in_one_line(tied_ckpt, peft, key):
    """A trained tied matrix (LoRA's flags, or full finetuning) cannot be split over stages: one line at the start,
    naming the key."""
    from qwenft.conf.layout import resolve_layout
    from qwenft.train.build import model_config
    from qwenft.train.spec import resolve_spec

    cfg = compose(["recipe=tiny", "peft=lora", f"model.path={tied_ckpt}", "mesh.pp=2", *peft])
    with pytest.raises(ValueError) as e:
        resolve_spec(cfg, resolve_layout(1, 2, 1, 2), model_config(cfg), "cpu")
    msg = str(e.value)
    assert (key if key != "model.path=" else str(tied_ckpt)) in msg and "mesh.pp=2" in msg and "\n" not in msg, msg


@pytest.mark.slow
@pytest.mark.distributed
def test_pp2_with_the_tied_matrix_frozen_equals_one_process(tied_ckpt, tmp_path):
    """peft=lora without train_embeddings / train_head: stage 0 holds the frozen tied matrix as embed_tokens and
    stage 1 as lm_head, each loaded from the checkpoint's one tensor; losses and adapter gradients within 1e-5 of
    one process."""
    frozen = ["peft.train_embeddings=false"]
    (ref_losses, ref_grads, _, _) = run_distributed(_train, 1, _overrides(tied_ckpt, tmp_path / "one", *frozen))[0]
    results = run_distributed(_train, 2, _overrides(tied_ckpt, tmp_path / "pp2", *frozen, "mesh.pp=2"))
    losses = results[0][0]
    assert len(losses) == 3 and all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, ref_losses)), losses
    for step, ref in enumerate(ref_grads):
        got = {k: v for r in results for k, v in r[1][step].items()}
        assert got.keys() == ref.keys() and all(".lora_" in k for k in ref)
        diff = torch.cat([(got[n] - g).flatten() for n, g in ref.items()]).norm()
        total = torch.cat([g.flatten() for g in ref.values()]).norm()
        assert diff / total < 1e-5, f"step {step + 1}: adapter grads rel err {diff / total:.2e}"
