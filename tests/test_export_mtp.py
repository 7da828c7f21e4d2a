"""The source checkpoint's multi-token-prediction head (`mtp.*`) through a run: copied raw into the run dir at its
start, then written by every HF export (checkpoint.export_hf=true and merged, `qwenft export` and its merged=true)
byte-identical, in the source's dtype and expert layout, with config.json's `mtp_*` keys; an export still has it
once model.path is gone. A random-init run keeps none and says so.

transformers drops `mtp.*` on load and never writes it, so each source checkpoint here is made by transformers (or
qwenft's writer, for fused experts) and given a head of bf16 tensors afterwards, shaped as the checkpoint's own
full-attention layer."""

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from helpers import (make_hf_model, make_hf_moe_model, qwenft_alone, save_random_checkpoint, tiny_overrides, tiny_vlm,
                     train_alone)

MTP_CONFIG = {"mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False}
NO_HEAD = "exports carry no MTP head (vLLM's MTP speculative decoding needs one)"
ONE_STEP = ("train.max_steps=1", "train.global_batch_size=2", "train.micro_batch_size=2", "data.tokenizer=tiny")


def _model_cfg(name: str):
    from qwenft.data.tokenizer import load_tokenizer
    from qwenft.models.qwen3_5.configs import named_config

    cfg = named_config(name)
    cfg.text.vocab_size = max(cfg.text.vocab_size, len(load_tokenizer("tiny")))
    return cfg


def _give_head(src, shards: bool) -> dict[str, torch.Tensor]:
    """Add an MTP head to the checkpoint at `src` (written as one model.safetensors): `mtp.fc`, the three norms and
    `mtp.layers.0.*` shaped as the checkpoint's first full-attention layer (so in its expert layout), random bf16;
    the `mtp_*` keys go into config.json. `shards`: the head in a second file, both listed in an index, as the
    released checkpoints store it; else added to model.safetensors. Returns the head."""
    from qwenft.models.qwen3_5.configs import FULL_ATTENTION, config_from_hf_dir

    text = config_from_hf_dir(src).text
    trunk = load_file(src / "model.safetensors")
    layer = f"model.layers.{text.layer_types.index(FULL_ATTENTION)}."
    hidden = text.hidden_size
    shapes = {"mtp.fc.weight": (hidden, 2 * hidden), "mtp.pre_fc_norm_embedding.weight": (hidden,),
              "mtp.pre_fc_norm_hidden.weight": (hidden,), "mtp.norm.weight": (hidden,)}
    shapes.update({"mtp.layers.0." + k[len(layer):]: t.shape for k, t in trunk.items() if k.startswith(layer)})
    gen = torch.Generator().manual_seed(11)
    head = {k: torch.randn(shape, generator=gen).to(torch.bfloat16) for k, shape in shapes.items()}
    if shards:
        names = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
        (src / "model.safetensors").rename(src / names[0])
        save_file(head, str(src / names[1]), metadata={"format": "pt"})
        index = {"metadata": {}, "weight_map": {**{k: names[0] for k in trunk}, **{k: names[1] for k in head}}}
        (src / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        save_file({**trunk, **head}, str(src / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, **MTP_CONFIG}))
    return head


def _assert_head(out, head: dict[str, torch.Tensor]) -> None:
    """The HF export at `out` holds exactly `head`'s `mtp.*` tensors, equal and in their dtype, in the files its
    index (or its single model.safetensors) lists, and config.json's text config has the `mtp_*` keys."""
    from qwenft.models.loader import checkpoint_files

    files = {k: f for k, f in checkpoint_files(out).items() if k.startswith("mtp.")}
    assert set(files) == set(head)
    for key, path in files.items():
        with safe_open(path, "pt") as f:
            got = f.get_tensor(key)
        assert got.dtype == head[key].dtype == torch.bfloat16 and torch.equal(got, head[key]), key
    config = json.loads((out / "config.json").read_text())
    text = config.get("text_config", config)
    assert {k: text.get(k) for k in MTP_CONFIG} == MTP_CONFIG


def _kept_line(head, src, run_dir) -> str:
    from qwenft.checkpoint.dcp import size_text

    nbytes = sum(t.numel() * t.element_size() for t in head.values())
    return (f"mtp: {len(head)} tensors ({size_text(nbytes)}) kept from {src} to {run_dir / 'mtp.safetensors'}, "
            f"written with every HF export")


def test_dense_head_through_the_run_export_and_qwenft_export_without_the_source(tmp_path, capfd):
    """A dense model from a transformers checkpoint whose head sits in a second shard: the run's fp32 export and
    `qwenft export` of its checkpoint once model.path has moved away both hold the head as the source had it;
    transformers loads the export."""
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM

    src, run_dir = tmp_path / "src", tmp_path / "run"
    make_hf_model(_model_cfg("tiny")).save_pretrained(src)
    head = _give_head(src, shards=True)
    train_alone(tiny_overrides(run_dir, f"model.path={src}", *ONE_STEP, "checkpoint.every_steps=1",
                               "checkpoint.export_hf=true", "checkpoint.export_dtype=float32"))
    assert _kept_line(head, src, run_dir) in (run_dir / "train.log").read_text()
    _assert_head(run_dir / "hf", head)
    _, info = Qwen3_5ForCausalLM.from_pretrained(run_dir / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info

    src.rename(tmp_path / "moved")
    capfd.readouterr()
    assert qwenft_alone("export", f"run_dir={run_dir}", f"out={tmp_path / 'out'}") == 0
    assert f"to {tmp_path / 'out'}, with the MTP head kept from {src} ({len(head)} tensors)" in capfd.readouterr().out
    _assert_head(tmp_path / "out", head)


def test_moe_head_with_per_expert_tensors(tmp_path):
    """transformers' MoE checkpoint stores one tensor per expert, and so does its head here: the export writes the
    trunk's experts fused and the head's as they were; that export is a model.path again, its head trained from
    the per-expert tensors beside a fused trunk."""
    from qwenft.models.qwen3_5 import adapter

    src, run_dir = tmp_path / "src", tmp_path / "run"
    make_hf_moe_model(_model_cfg("tiny_moe")).save_pretrained(src)
    head = _give_head(src, shards=False)
    assert {"mtp.layers.0.mlp.experts.7.down_proj.weight", "mtp.layers.0.mlp.shared_expert_gate.weight"} <= set(head)
    train_alone(tiny_overrides(run_dir, f"model.path={src}", *ONE_STEP, "model.kernels.moe=loop",
                               "checkpoint.export_hf=true"))
    _assert_head(run_dir / "hf", head)
    from qwenft.models.loader import checkpoint_files

    assert adapter.detect_per_expert(checkpoint_files(run_dir / "hf")) == adapter.PerExpert(trunk=False, mtp=True)
    again = tmp_path / "again"
    train_alone(tiny_overrides(again, f"model.path={run_dir / 'hf'}", *ONE_STEP, "model.kernels.moe=loop",
                               "model.mtp=train", "checkpoint.export_hf=false"))
    assert "done: 1 steps" in (again / "train.log").read_text()


def test_moe_head_with_fused_experts_through_merged_lora_exports(tmp_path, capfd):
    """A LoRA run on an MoE checkpoint with fused experts (qwenft's writer), head too: checkpoint.export_hf=merged
    and `qwenft export ... merged=true` both write the head as it was."""
    src, run_dir = tmp_path / "src", tmp_path / "run"
    save_random_checkpoint(_model_cfg("tiny_moe"), src)
    head = _give_head(src, shards=False)
    assert "mtp.layers.0.mlp.experts.gate_up_proj" in head
    train_alone(tiny_overrides(run_dir, f"model.path={src}", *ONE_STEP, "model.kernels.moe=loop", "peft=lora",
                               "checkpoint.every_steps=1", "checkpoint.export_hf=merged"))
    _assert_head(run_dir / "hf", head)
    assert qwenft_alone("export", f"run_dir={run_dir}", f"out={tmp_path / 'merged'}", "merged=true") == 0
    _assert_head(tmp_path / "merged", head)
    assert qwenft_alone("export", f"run_dir={run_dir}", f"out={tmp_path / 'adapter'}") == 0
    assert not any("mtp" in k for k in load_file(tmp_path / "adapter" / "adapter_model.safetensors"))


def test_random_init_keeps_no_head(tmp_path, capfd):
    """recipe=tiny from random init: the log says there is no head, the export and `qwenft export` write none."""
    run_dir = tmp_path / "run"
    train_alone(tiny_overrides(run_dir, *ONE_STEP, "checkpoint.every_steps=1", "checkpoint.export_hf=true"))
    assert f"mtp: none (random init, no model.path); {NO_HEAD}" in (run_dir / "train.log").read_text()
    assert not (run_dir / "mtp.safetensors").exists()
    capfd.readouterr()
    assert qwenft_alone("export", f"run_dir={run_dir}", f"out={tmp_path / 'out'}") == 0
    assert "without an MTP head (the run kept none" in capfd.readouterr().out
    for out in (run_dir / "hf", tmp_path / "out"):
        assert not any(k.startswith("mtp.") for k in load_file(out / "model.safetensors"))
        assert not any(k.startswith("mtp_") for k in json.loads((out / "config.json").read_text()))


def test_sharded_export_lists_the_head_in_its_index(tmp_path):
    """An export written in shards lists the head's tensors in model.safetensors.index.json with the rest."""
    from qwenft.checkpoint.hf_export import write_hf_checkpoint
    from qwenft.models.loader import build_model, init_random_weights
    from qwenft.models.qwen3_5 import adapter

    src, out = tmp_path / "src", tmp_path / "out"
    cfg = _model_cfg("tiny")
    save_random_checkpoint(cfg, src)
    head = _give_head(src, shards=False)
    model = init_random_weights(build_model(cfg, kernels="torch", device="meta"), device="cpu")
    hf_sd = adapter.to_hf_state_dict({n: p.detach() for n, p in model.named_parameters()}, cfg.text)
    write_hf_checkpoint({**hf_sd, **head}, cfg, out, max_shard_size="200KB", text_config_extra=MTP_CONFIG)
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) > 2 and set(head) <= set(weight_map)
    _assert_head(out, head)


def test_vlm_config_keeps_the_keys_in_its_text_config(tmp_path):
    """A VLM checkpoint's `mtp_*` keys sit in its text_config: read from there, and written back there."""
    from qwenft.checkpoint import mtp
    from qwenft.models.qwen3_5.configs import to_hf_config

    cfg = tiny_vlm()
    source = to_hf_config(cfg, MTP_CONFIG)
    assert {k: getattr(source.text_config, k) for k in MTP_CONFIG} == MTP_CONFIG
    source.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["text_config"]["mtp_num_hidden_layers"] == 1
    assert mtp.source_config(tmp_path) == MTP_CONFIG


def test_keep_reuses_on_resume_and_copies_afresh_otherwise(tmp_path):
    """`mtp.keep` at a run's start: a resumed run reuses its copy even when model.path's head has changed since; a
    fresh start copies again, and removes the copy when the source has no head; a damaged copy is one line."""
    from qwenft.checkpoint import mtp

    src, run_dir = tmp_path / "src", tmp_path / "run"
    run_dir.mkdir()
    save_random_checkpoint(_model_cfg("tiny"), src)
    assert mtp.keep(str(src), run_dir, resumed=False) == f"mtp: none in {src}; {NO_HEAD}"
    first = _give_head(src, shards=False)
    assert mtp.keep(str(src), run_dir, resumed=False) == _kept_line(first, src, run_dir)
    assert [p.name for p in run_dir.iterdir()] == ["mtp.safetensors"]  # the temp file renamed, nothing else
    second = {k: (t.float() + 1).to(t.dtype) for k, t in first.items()}
    save_file({**load_file(src / "model.safetensors"), **second}, str(src / "model.safetensors"))

    kept = run_dir / "mtp.safetensors"
    assert mtp.keep(str(src), run_dir, resumed=True) == _kept_line(first, src, run_dir).replace(
        f" to {kept}", f" (reused {kept})")
    head = mtp.read(run_dir)
    assert head.config == MTP_CONFIG and all(torch.equal(head.tensors[k], t) for k, t in first.items())
    mtp.keep(str(src), run_dir, resumed=False)
    assert all(torch.equal(mtp.read(run_dir).tensors[k], t) for k, t in second.items())

    data = kept.read_bytes()
    kept.write_bytes(data[:len(data) // 2])
    for damaged in (lambda: mtp.read(run_dir), lambda: mtp.keep(str(src), run_dir, resumed=True)):
        with pytest.raises(ValueError) as info:
            damaged()
        assert str(info.value).startswith(f"{kept} ({len(data) // 2} bytes) is truncated or corrupt")
        assert "\n" not in str(info.value)

    shutil.rmtree(src)
    save_random_checkpoint(_model_cfg("tiny"), src)
    assert mtp.keep(str(src), run_dir, resumed=False) == f"mtp: none in {src}; {NO_HEAD}"
    assert not (run_dir / "mtp.safetensors").exists()
    assert mtp.keep(None, run_dir, resumed=False) == f"mtp: none (random init, no model.path); {NO_HEAD}"
