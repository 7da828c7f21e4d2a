"""Validation loss (eval.*) against an independent single-process computation, and the non-finite guard."""

import math

import pytest
import torch
import torch.nn.functional as F

from distributed import run_distributed
from helpers import assert_within, compose, fp32_rtol, parity_overrides, raised_line, read_metrics, train_with_state


def _overrides(tmp_path, name, *extra):
    return parity_overrides(tmp_path / name, "checkpoint.export_hf=false", "eval.every_steps=2", "eval.dataset=tiny",
                            *extra)


def _independent_val_loss(state: dict) -> float:
    """The trained parameters in a plain model, CE summed over the whole validation set / its label tokens."""
    from qwenft.data.loader import build_sft_data
    from qwenft.data.tiny_chat import VAL_PATH
    from qwenft.data.tokenizer import load_tokenizer
    from qwenft.models.loader import build_model
    from qwenft.models.qwen3_5.configs import named_config

    cfg = named_config("tiny")
    cfg.text.vocab_size = state["embed_tokens.weight"].shape[0]
    model = build_model(cfg, kernels="torch", device="cpu").float()
    model.load_state_dict(state)
    data = build_sft_data(VAL_PATH, load_tokenizer("tiny"), seq_len=128, micro_batch_size=3, packing="pack")
    ce, tokens = 0.0, 0
    with torch.no_grad():
        for mb in data.eval_batches():
            logits = model(input_ids=mb["input_ids"], position_ids=mb["position_ids"], cu_seqlens=mb["cu_seqlens"])
            ce += F.cross_entropy(logits.flatten(0, 1).double(), mb["labels"].flatten(), ignore_index=-100,
                                  reduction="sum").item()
            tokens += (mb["labels"] != -100).sum().item()
    return ce / tokens


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    (result,) = run_distributed(train_with_state, 1, _overrides(tmp_path_factory.mktemp("eval"), "one"))
    return result


@pytest.mark.distributed
def test_val_loss_equals_independent_computation(one_process):
    val_losses, state = one_process.val_losses, one_process.state_dict
    assert sorted(val_losses) == [2, 3]  # every 2 steps and at the end
    assert val_losses[2] != val_losses[3]
    assert abs(val_losses[3] - _independent_val_loss(state)) < 1e-5


@pytest.mark.distributed
def test_val_loss_in_metrics(tmp_path):
    run_distributed(train_with_state, 1, _overrides(tmp_path, "m", "train.max_steps=2", "eval.max_batches=2"))
    records = read_metrics(tmp_path / "m")
    val = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in val] == [2] and math.isfinite(val[0]["val_loss"])
    assert all(r["skipped_steps"] == 0 for r in records if "loss" in r)


@pytest.mark.distributed
def test_dp2_val_loss_equals_one_process(tmp_path, one_process):
    results = run_distributed(train_with_state, 2, _overrides(tmp_path, "dp2"))
    for result in results:
        for step, ref in one_process.val_losses.items():
            assert_within(f"val_loss after {step} steps", abs(result.val_losses[step] - ref) / ref, fp32_rtol(step))


@pytest.mark.distributed
def test_pp2_val_loss_equals_one_process(tmp_path, one_process):
    results = run_distributed(train_with_state, 2, _overrides(tmp_path, "pp2", "mesh.pp=2"))
    for result in results:
        for step, ref in one_process.val_losses.items():
            assert_within(f"val_loss after {step} steps", abs(result.val_losses[step] - ref) / ref, fp32_rtol(step))


def test_every_steps_without_dataset_is_an_error():
    with pytest.raises(Exception, match="eval.every_steps=2 needs a validation set; set eval.dataset"):
        compose(["recipe=tiny", "eval.every_steps=2"])


def test_a_validation_set_without_every_steps_is_an_error():
    for key, value in (("eval.dataset", "tiny"), ("eval.max_batches", "2")):
        with pytest.raises(ValueError) as e:
            compose(["recipe=tiny", f"{key}={value}"])
        assert str(e.value) == (f"{key}={value} has no effect while eval.every_steps=0 (never); set eval.every_steps=N "
                                f"for a validation loss every N steps and at the end, or {key}=null")


HUGE_LR = ["optim.lr=1e6", "optim.max_grad_norm=0", "train.max_steps=6", "eval.every_steps=0", "eval.dataset=null"]


@pytest.mark.distributed
def test_nonfinite_error_raises_one_line(tmp_path):
    with pytest.raises(RuntimeError) as info:
        run_distributed(train_with_state, 1, _overrides(tmp_path, "err", *HUGE_LR))
    line = raised_line(info)
    assert "ValueError: non-finite loss/grad norm at step " in line and "train.on_nonfinite=skip" in line


@pytest.mark.distributed
@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
def test_nonfinite_skip_keeps_params_finite(tmp_path, state_dtype):
    """With torch's AdamW (fp32 state), stepped after the step's numbers are read, and with LowPrecisionAdamW (bf16
    state), queued before the read and skipped by a flag."""
    (result,) = run_distributed(train_with_state, 1, _overrides(tmp_path, "skip", *HUGE_LR, "train.on_nonfinite=skip",
                                                                f"optim.state_dtype={state_dtype}"))
    state, skipped, losses = result.state_dict, result.skipped_steps, result.losses
    assert skipped >= 1 and sum(not math.isfinite(x) for x in losses) <= skipped
    assert all(torch.isfinite(t).all() for t in state.values())


@pytest.mark.distributed
def test_a_validation_set_problem_names_eval_dataset_and_its_skipped_rows_are_logged(tmp_path):
    import json

    from qwenft.data.tiny_chat import VAL_PATH

    gone = tmp_path / "data.path" / "nope.jsonl"  # the path itself is never rewritten
    with pytest.raises(RuntimeError) as info:
        run_distributed(train_with_state, 1, _overrides(tmp_path, "gone", f"eval.dataset={gone}"))
    assert raised_line(info) == f"ValueError: eval.dataset='{gone}' does not exist"
    rows = VAL_PATH.read_text().splitlines()
    bad = tmp_path / "val.jsonl"
    bad.write_text("\n".join(rows[:10] + [json.dumps({"messages": [{"role": "robot", "content": "x"}]})]) + "\n")
    with pytest.raises(RuntimeError) as info:
        run_distributed(train_with_state, 1, _overrides(tmp_path, "strict", f"eval.dataset={bad}",
                                                         "data.on_bad_row=error"))
    assert raised_line(info).startswith(f"ValueError: eval.dataset={bad}: data row 10: message 0 has role 'robot'")
    run_distributed(train_with_state, 1, _overrides(tmp_path, "skip", f"eval.dataset={bad}", "train.max_steps=1",
                                                    "eval.every_steps=1"))
    assert "per rank every 1 steps; skipped rows: {'bad_role': 1}" in (tmp_path / "skip" / "train.log").read_text()


def test_eval_max_batches_makes_no_more_batches_than_it_keeps():
    from itertools import count

    from qwenft.train.evaluate import val_micro_batches

    class Endless:  # a validation stream longer than any max_batches: only the kept batches may be made
        def eval_batches(self):
            return ({"batch": i} for i in count())

    assert val_micro_batches(Endless(), 3) == [{"batch": 0}, {"batch": 1}, {"batch": 2}]


def test_eval_dataset_tiny_vlm_is_the_generated_validation_set():
    from qwenft.data.tiny_vlm import tiny_vlm_data_dir
    from qwenft.train.data_setup import eval_path

    assert eval_path("tiny_vlm") == tiny_vlm_data_dir() / "val.jsonl" and eval_path("tiny_vlm").is_file()
    assert eval_path("/d/val.jsonl") == "/d/val.jsonl"


def test_mfu_peaks_by_device_name():
    from qwenft.train.metrics import peak_of

    assert peak_of("NVIDIA H100 80GB HBM3") == peak_of("NVIDIA H200") == 989e12
    assert (peak_of("NVIDIA H100 PCIe"), peak_of("NVIDIA H100 NVL"), peak_of("NVIDIA L4")) == (756e12, 835e12, None)
    assert peak_of("NVIDIA H200 NVL") == 835e12
