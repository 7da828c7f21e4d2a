"""model.fp8: which linears become torchao float8 linears, training with them on the CPU, checkpoints across the
setting, the config errors."""

import pytest
import torch
from torch import nn

from helpers import compose, read_metrics, tiny_overrides, train_alone

pytest.importorskip("torchao.float8")

_SCALED_MM = torch._scaled_mm


def _scaled_mm_on_cpu(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
    """torch._scaled_mm as the CPU computes it, for one scale per operand: float8 values are exact in fp32, so the
    fp32 product of the upcast operands, scaled, is the same float8 GEMM up to fp32's summation order (checked
    against torch's kernel: within 3.3e-7 of the largest output in fp32). torch's CPU kernel takes about 35 ms for
    a 128 x 64 x 256 product when both operands have one float8 dtype and one scale each (0.1 ms with row scales
    or mixed dtypes), most of these tests' minutes; the GPU tier runs cuBLAS's."""
    if a.is_cuda or scale_a.numel() != 1 or scale_b.numel() != 1 or bias is not None or scale_result is not None:
        return _SCALED_MM(a, b, scale_a, scale_b, bias=bias, scale_result=scale_result, out_dtype=out_dtype,
                          use_fast_accum=use_fast_accum)
    out = (a.float() @ b.float()) * (scale_a.float() * scale_b.float())
    return out.to(out_dtype or a.dtype)


@pytest.fixture(autouse=True)
def _cpu_scaled_mm(monkeypatch):
    monkeypatch.setattr(torch, "_scaled_mm", _scaled_mm_on_cpu)


def _linears(model) -> dict[str, str]:
    return {fqn: type(m).__name__ for fqn, m in model.named_modules() if isinstance(m, nn.Linear)}


@pytest.mark.parametrize("name", ["tiny", "tiny_moe"])
def test_exactly_the_large_decoder_linears_convert(name):
    """The trunk's and the MTP head's large projections become Float8Linear; lm_head, the router (`mlp.gate`),
    `shared_expert_gate`, GatedDeltaNet's a/b and attention's k/v projections stay nn.Linear."""
    from qwenft.distributed.float8 import convert_fp8
    from qwenft.models.loader import build_model
    from qwenft.models.qwen3_5.configs import FULL_ATTENTION, named_config

    cfg = named_config(name)
    cfg.text.mtp_num_hidden_layers = 1
    model = build_model(cfg, kernels="torch", mtp="train")
    converted = convert_fp8(model, "rowwise")
    mlp = ["shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj"] if cfg.text.is_moe else \
        ["gate_proj", "up_proj", "down_proj"]
    want = set()
    for prefix, kind in [(f"layers.{i}.", k) for i, k in enumerate(cfg.text.layer_types)] + [("mtp.layers.0.",
                                                                                              FULL_ATTENTION)]:
        mixer = (["self_attn.q_proj", "self_attn.o_proj"] if kind == FULL_ATTENTION else
                 [f"linear_attn.{p}_proj" for p in ("q", "k", "v", "z", "out")])
        want |= {prefix + p for p in mixer} | {prefix + "mlp." + p for p in mlp}
    assert set(converted) == want
    kinds = _linears(model)
    assert {fqn for fqn, kind in kinds.items() if kind == "Float8Linear"} == want
    kept = {fqn for fqn, kind in kinds.items() if kind != "Float8Linear"}
    assert {"lm_head", "mtp.fc", "layers.3.self_attn.k_proj", "layers.3.self_attn.v_proj",
            "layers.0.linear_attn.a_proj", "layers.0.linear_attn.b_proj"} <= kept
    if cfg.text.is_moe:
        assert {"layers.0.mlp.gate", "layers.0.mlp.shared_expert_gate"} <= kept  # the router and the shared gate


@pytest.mark.slow
def test_training_with_fp8_follows_the_unconverted_run(tmp_path):
    """recipe=tiny with model.fp8=rowwise on the CPU: the start log lists the converted linears, the first step's
    loss (the same weights, float8 matmuls) is within float8 rounding of the unconverted run's, and the loss falls
    as the unconverted run's does; the checkpoint resumes with model.fp8=off (the same keys)."""
    runs = {recipe: tmp_path / recipe for recipe in ("off", "rowwise")}
    for recipe, run_dir in runs.items():
        train_alone(tiny_overrides(run_dir, "train.max_steps=6", f"model.fp8={recipe}", "checkpoint.every_steps=3",
                                   "checkpoint.export_hf=false"))
    off, fp8 = ([r["loss"] for r in read_metrics(runs[k]) if "loss" in r] for k in ("off", "rowwise"))
    # e4m3 keeps 3 mantissa bits: each operand within 2^-4 relative, averaged over the 64-128-term dot products
    assert abs(fp8[0] - off[0]) < 0.02 * off[0], (fp8, off)
    assert fp8[-1] < fp8[0] - 0.1 and abs(fp8[-1] - off[-1]) < 0.05 * off[-1], (fp8, off)
    log = (runs["rowwise"] / "train.log").read_text()
    assert "fp8: model.fp8=rowwise (torchao float8) on 29 linears (" in log, log
    result = train_alone(tiny_overrides(runs["rowwise"], "train.max_steps=7", "model.fp8=off",
                                        "checkpoint.every_steps=3", "checkpoint.export_hf=false"))
    assert len(result.losses) == 1 and read_metrics(runs["rowwise"])[-1]["step"] == 7  # resumed after step 6


def _train_metrics(rank, world_size, overrides):
    from helpers import train

    train(rank, world_size, overrides)
    return None


@pytest.mark.slow
@pytest.mark.distributed
def test_tensor_parallel_fp8_follows_one_process(tmp_path):
    """recipe=tiny with model.fp8=rowwise at mesh.tp=2: every linear whose shards keep sizes in multiples of 16
    runs float8 on its shard (ShardedFloat8Linear), and the run follows the one-process float8 run within float8
    rounding (each rank scales its own shard, so the roundings differ), its loss falling as that run's does."""
    from distributed import run_distributed
    from qwenft.distributed.float8 import fp8_target
    from qwenft.models.loader import build_model
    from qwenft.train.build import model_config

    common = ("train.max_steps=6", "model.fp8=rowwise", "checkpoint.export_hf=false")
    one, two = tmp_path / "tp1", tmp_path / "tp2"
    train_alone(tiny_overrides(one, *common))
    run_distributed(_train_metrics, 2, tiny_overrides(two, *common, "mesh.tp=2"))
    ref, got = ([r["loss"] for r in read_metrics(d) if "loss" in r] for d in (one, two))
    assert abs(got[0] - ref[0]) < 0.02 * ref[0], (got, ref)
    assert got[-1] < got[0] - 0.1 and abs(got[-1] - ref[-1]) < 0.05 * ref[-1], (got, ref)
    model = build_model(model_config(compose(tiny_overrides(two))), device="meta")
    expected = sum(fp8_target(fqn, m, tp=2) for fqn, m in model.named_modules())
    assert 0 < expected and f"fp8: model.fp8=rowwise (torchao float8) on {expected} linears (" in (
        two / "train.log").read_text()


@pytest.mark.parametrize("overrides, message", [
    (["model.fp8=fp4"], "model.fp8='fp4' is not valid; choose one of off, rowwise, rowwise_with_gw_hp, tensorwise"),
    (["model.fp8=tensorwise", "peft=lora"], "model.fp8=tensorwise with peft=lora: float8 linears do not take LoRA "
                                            "adapters yet; use peft=none or model.fp8=off"),
    (["model.fp8=rowwise", "data.seq_len=100", "train.micro_batch_size=1", "train.global_batch_size=1"],
     "model.fp8=rowwise: a microbatch holds 100 tokens a rank (train.micro_batch_size x data.seq_len / mesh.cp, "
     "rounded up), and float8 GEMMs need a multiple of 16; set data.seq_len=112 (or another "
     "train.micro_batch_size)"),
])
def test_bad_fp8_settings_fail_with_one_line(tmp_path, overrides, message):
    """Through `qwenft train`'s own checks, with activation checkpointing given (not `auto`, whose plan resolves the
    whole spec) and leaving the run dir without a config."""
    from distributed import run_distributed

    def train(rank, world_size, overrides):
        from qwenft.train.runner import run

        try:
            run(compose(overrides))
        except ValueError as e:
            return str(e)

    assert run_distributed(train, 1, tiny_overrides(tmp_path, *overrides, "model.activation_checkpointing=false")) \
        == [message]
    assert not (tmp_path / "config.yaml").exists()


def test_fp8_counts_a_context_parallel_ranks_padded_span(capfd):
    """Context parallel pads the stream to a multiple of mesh.cp before splitting it, so 33 tokens over cp2 put 17 on
    a rank, which float8's GEMMs refuse: refused at the start, as 34 tokens are."""
    from helpers import qwenft_alone

    for seq_len in (33, 34):
        assert qwenft_alone("plan", "recipe=tiny", "mesh.cp=2", f"data.seq_len={seq_len}", "model.fp8=rowwise",
                            "train.micro_batch_size=1", "train.global_batch_size=4", "model.kernels.gdn=torch") == 2
        assert "model.fp8=rowwise: a microbatch holds 17 tokens a rank" in capfd.readouterr().err, seq_len
