"""scripts/automodel on the CPU: the MoE checkpoint make_ckpt.py writes for NeMo Automodel is qwenft's config, and
means the same model to transformers and to qwenft; summarize.py's step times and qwenft-counted TFLOP/s."""

import dataclasses
import importlib.util
import json
import statistics

import pytest
import torch

from helpers import REPO
from qwenft.constants import IGNORE_INDEX
from qwenft.models.loader import build_model, load_hf_weights
from qwenft.models.qwen3_5.configs import config_from_hf_dir, named_config
from qwenft.train.metrics import flops_per_token

HARNESS = REPO / "scripts" / "automodel"


def _script(name):
    spec = importlib.util.spec_from_file_location(f"automodel_{name}", HARNESS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_ckpt, summarize = _script("make_ckpt"), _script("summarize")

# moe_intermediate_size 16: the expert tensors' 2I (32) differs from hidden (64), so a transposed layout shows
MOE_ARGS = ["--model", "tiny_moe", "--set", "moe_intermediate_size=16"]


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe_ckpt")
    make_ckpt.main([str(out), *MOE_ARGS])
    return out


@pytest.fixture(scope="module")
def dense_ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("dense_ckpt")
    make_ckpt.main([str(out), "--tiny"])
    return out


def test_moe_checkpoint_is_qwenfts_config_in_the_layout_automodel_reads(moe_ckpt):
    from safetensors import safe_open
    from transformers import AutoConfig

    expected = dataclasses.replace(named_config("tiny_moe").text, moe_intermediate_size=16, pad_token_id=0,
                                   eos_token_id=1)
    assert config_from_hf_dir(moe_ckpt).text == expected
    hf = AutoConfig.from_pretrained(moe_ckpt)
    # the architecture Automodel's registry maps to its native nemo_automodel...qwen3_5_moe.model.Qwen3_5MoeForCausalLM
    assert (type(hf).__name__, hf.architectures) == ("Qwen3_5MoeTextConfig", ["Qwen3_5MoeForCausalLM"])
    assert (hf.num_experts, hf.num_experts_per_tok, hf.moe_intermediate_size) == (8, 2, 16)
    with safe_open(str(moe_ckpt / "model.safetensors"), "pt") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
        dtypes = {str(f.get_slice(k).get_dtype()) for k in f.keys()}
    assert dtypes == {"BF16"}
    # grouped expert tensors ([E, 2I, H] and [E, H, I]), as the released checkpoints store them: Automodel's
    # Qwen3_5MoeStateDictAdapter reads per-expert tensors only as block-FP8 with scales
    for layer in range(4):
        assert shapes[f"model.layers.{layer}.mlp.experts.gate_up_proj"] == [8, 32, 64]
        assert shapes[f"model.layers.{layer}.mlp.experts.down_proj"] == [8, 64, 16]
    assert not [k for k in shapes if ".experts.0." in k]


def test_moe_checkpoint_means_the_same_model_to_transformers_and_qwenft(moe_ckpt):
    from transformers import Qwen3_5MoeForCausalLM

    ids = torch.randint(1, 512, (1, 48), generator=torch.Generator().manual_seed(0))
    hf = Qwen3_5MoeForCausalLM.from_pretrained(moe_ckpt, dtype=torch.float32)
    with torch.no_grad():
        reference = hf(input_ids=ids, labels=ids).loss  # transformers shifts the labels itself

    cfg = config_from_hf_dir(moe_ckpt)
    native = load_hf_weights(build_model(cfg, kernels="torch"), moe_ckpt, device="cpu", dtype=torch.float32)
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], IGNORE_INDEX)], dim=1)
    with torch.no_grad():
        ce_sum = native(input_ids=ids, cu_seqlens=torch.tensor([0, 48], dtype=torch.int32), labels=labels)
    torch.testing.assert_close(ce_sum / 47, reference, rtol=1e-5, atol=1e-5)


def test_make_ckpt_refuses_a_bad_size_with_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit):
        make_ckpt.main([str(tmp_path / "out"), "--model", "tiny_moe", "--layers", "9"])
    assert "--layers 9: must be 1 to 4 for --model 'tiny_moe'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        make_ckpt.main([str(tmp_path / "out"), "--model", "tiny_vlm"])
    assert "is a vision-language size" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["moe", "dense"])
def test_summarize_recovers_step_times_and_counts_active_flops_with_qwenft(kind, request, tmp_path):
    ckpt = request.getfixturevalue(f"{kind}_ckpt")
    seq, sequences = 256, 2
    tps = [2.0e6, 4.0e7, 5.0e7, 4.5e7, 3.0e7]  # tokens/s as Automodel logs them; the first step is compile-slow
    rows = [dict(step=i, num_tokens_per_step=seq * sequences, tps=t, mem=1.0 + i, loss=6.0 - 0.1 * i)
            for i, t in enumerate(tps)]
    (tmp_path / "training.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "result.json"
    summarize.main([str(tmp_path / "training.jsonl"), str(ckpt), "--warmup", "2", "--seq", str(seq),
                    "--mbs", str(sequences), "--out", str(out)])
    res = json.loads(out.read_text())

    step_s = statistics.median(seq * sequences / t for t in tps[2:])  # the steps after the warm-up
    assert res["step_s_median"] == round(step_s, 4)
    assert res["tok_s_median"] == round(seq * sequences / step_s)
    assert (res["steps_measured"], res["warmup_excluded"], res["peak_mem_alloc_gib_measured"]) == (3, 2, 5.0)
    # qwenft's own count, as its runs report it: MoE counts active parameters (top-2 of 8 experts, the shared expert)
    t = config_from_hf_dir(ckpt).text
    assert res["tflops_qwenft_median"] == round(flops_per_token(t, seq) * seq * sequences / step_s / 1e12, 1)
    if kind == "moe":
        assert res["tflops_6N_attn_median"] is None  # all-parameter 6N has no MoE meaning
        assert res["model"].startswith("Qwen3_5MoeForCausalLM") and res["model"].endswith("8 experts top 2")
    else:
        assert res["tflops_6N_attn_median"] > 0 and res["model"].startswith("Qwen3_5ForCausalLM")
