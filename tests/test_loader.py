"""Checkpoint I/O: native <-> transformers round trips, meta init, sharded loads, deterministic init, errors."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.models.qwen3_5 import Qwen3_5ForCausalLM

from distributed import run_distributed
from helpers import make_hf_model, rel_err
from qwenft.checkpoint.hf_export import save_hf
from qwenft.models.loader import build_model, init_random_weights, load_hf_weights
from qwenft.models.qwen3_5 import adapter
from qwenft.models.qwen3_5.configs import config_from_hf_dir, named_config, to_hf_config

TINY = named_config("tiny")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf")
    make_hf_model(TINY).save_pretrained(path)
    return path


def _ids(T=20):
    return torch.randint(0, TINY.text.vocab_size, (2, T), generator=torch.Generator().manual_seed(0))


def test_adapter_round_trip_is_exact(hf_dir):
    hf_sd = load_file(hf_dir / "model.safetensors")
    native_keys = [n for n, _ in build_model(TINY).named_parameters()]
    native = adapter.from_hf_state_dict(hf_sd, native_keys, TINY.text)
    back = adapter.to_hf_state_dict(native, TINY.text)
    assert set(back) == set(hf_sd)
    assert all(torch.equal(back[k], hf_sd[k]) for k in hf_sd)
    # the VLM layout differs only by prefix
    vlm = {k.replace("model.", "model.language_model.", 1): v for k, v in hf_sd.items()}
    native_vlm = adapter.from_hf_state_dict(vlm, native_keys, TINY.text)
    assert all(torch.equal(native_vlm[k], native[k]) for k in native)


@pytest.mark.parametrize("tied", [False, True])
def test_native_save_loads_in_transformers(tmp_path, tied):
    cfg = dataclasses.replace(TINY, tie_word_embeddings=tied)
    model = init_random_weights(build_model(cfg), seed=5, device="cpu")
    save_hf(model, cfg, tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    hf = Qwen3_5ForCausalLM.from_pretrained(tmp_path)
    ids = _ids()
    assert rel_err(model(input_ids=ids), hf(input_ids=ids).logits) < 1e-5


def test_transformers_sharded_save_loads_natively(tmp_path):
    hf = make_hf_model(TINY, seed=1)
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert len(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]) > 0
    model = load_hf_weights(build_model(TINY), tmp_path, device="cpu")
    ids = _ids()
    assert rel_err(model(input_ids=ids), hf(input_ids=ids).logits) < 1e-5


def test_meta_init_equals_eager(hf_dir):
    meta = load_hf_weights(build_model(TINY, device="meta"), hf_dir, device="cpu")
    eager = load_hf_weights(build_model(TINY, device="cpu"), hf_dir)
    assert not any(b.is_meta for b in meta.buffers())
    for (n, a), (_, b) in zip(meta.named_parameters(), eager.named_parameters()):
        assert torch.equal(a, b), n
    ids = _ids()
    assert torch.equal(meta(input_ids=ids), eager(input_ids=ids))


def test_vlm_layout_checkpoint_loads_text_model(tmp_path, hf_dir):
    """Released checkpoints: `model.language_model.*`, plus `model.visual.*` and `mtp.*` the text model skips."""
    sd = {k.replace("model.", "model.language_model.", 1): v for k, v in load_file(hf_dir / "model.safetensors").items()}
    sd["model.visual.patch_embed.proj.weight"] = torch.zeros(2, 2)
    sd["mtp.fc.weight"] = torch.zeros(2, 2)
    save_file(sd, str(tmp_path / "model.safetensors"))
    vlm_cfg = dataclasses.replace(TINY, vision={"depth": 1, "hidden_size": 16, "out_hidden_size": 64})
    to_hf_config(vlm_cfg).save_pretrained(tmp_path)
    assert config_from_hf_dir(tmp_path).vision is not None
    model = load_hf_weights(build_model(TINY), tmp_path, device="cpu")
    ref = load_hf_weights(build_model(TINY), hf_dir, device="cpu")
    ids = _ids()
    assert torch.equal(model(input_ids=ids), ref(input_ids=ids))


def test_random_init_is_independent_of_the_split():
    full = init_random_weights(build_model(TINY), seed=7, device="cpu", dtype=torch.bfloat16)
    stage = init_random_weights(build_model(TINY, layer_ids=[2, 3], embed=False), seed=7, device="cpu",
                                dtype=torch.bfloat16)
    full_params = dict(full.named_parameters())
    for n, p in stage.named_parameters():
        assert torch.equal(p, full_params[n]), n
    assert full.layers["0"].linear_attn.decay.A_log.dtype == torch.float32  # fp32 even in a bf16 model
    assert full.layers["0"].linear_attn.q_proj.weight.dtype == torch.bfloat16
    assert not torch.equal(full.layers["0"].mlp.up_proj.weight, full.layers["1"].mlp.up_proj.weight)


def test_random_init_starts_every_rmsnorm_of_the_model_and_its_mtp_head_at_one():
    """Zero-centred RMSNorms scale by (1 + weight): a fresh model's, its MTP head's included (the head's two pre-fc
    norms too), start at zeros, as transformers initialises them."""
    from qwenft.models.loader import init_value

    for name in ("norm.weight", "layers.0.input_layernorm.weight", "layers.3.self_attn.q_norm.weight",
                 "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight",
                 "mtp.layers.0.post_attention_layernorm.weight"):
        assert not init_value(name, (16,), seed=0).any(), name
    assert init_value("layers.0.linear_attn.norm.weight", (16,), seed=0).eq(1).all()  # a plain-weight RMSNorm


def _sharded_load(rank, world, ckpt, tp):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    model = build_model(TINY)
    mesh = init_device_mesh("cpu", (world,))
    if tp:  # shard q/k/v/z of every GDN layer by rows (heads), as TP would
        for layer in model.layers.values():
            if hasattr(layer, "linear_attn"):
                for name in ("q_proj", "k_proj", "v_proj", "z_proj"):
                    lin = getattr(layer.linear_attn, name)
                    lin.weight = torch.nn.Parameter(distribute_tensor(lin.weight, mesh, [Shard(0)]))
    else:
        for layer in model.layers.values():
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    out = {}
    for fill in ("load", "init"):
        if fill == "load":
            load_hf_weights(model, ckpt, device="cpu")
        else:
            init_random_weights(model, seed=3, device="cpu")
        out[fill] = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                     for n, p in model.named_parameters()}
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [False, True], ids=["fsdp", "tp"])
def test_sharded_params_get_their_local_rows(hf_dir, tp):
    results = run_distributed(_sharded_load, 2, hf_dir, tp)
    loaded = load_hf_weights(build_model(TINY), hf_dir, device="cpu")
    inited = init_random_weights(build_model(TINY), seed=3, device="cpu")
    for rank_result in results:
        for fill, ref in (("load", loaded), ("init", inited)):
            for n, p in ref.named_parameters():
                assert torch.equal(rank_result[fill][n], p), (fill, n)


# ---------------------------------------------------------------- errors: one line naming the cause

def _copy_ckpt(src, dst, transform=None, config=None):
    sd = load_file(src / "model.safetensors")
    if transform:
        sd = transform(sd)
    save_file(sd, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(config or (src / "config.json").read_text())
    return dst


def _load_error(path):
    with pytest.raises((ValueError, FileNotFoundError)) as e:
        load_hf_weights(build_model(TINY), path, device="cpu")
    msg = str(e.value)
    assert "\n" not in msg
    return e.type, msg


def test_error_missing_dir(tmp_path):
    assert _load_error(tmp_path / "nope")[0] is FileNotFoundError


def test_error_missing_config(tmp_path):
    kind, msg = _load_error(tmp_path)
    assert kind is FileNotFoundError and "config.json" in msg


def test_error_missing_shard(tmp_path):
    make_hf_model(TINY).save_pretrained(tmp_path, max_shard_size="40KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    kind, msg = _load_error(tmp_path)
    assert kind is FileNotFoundError and shard.name in msg


def test_error_missing_keys(tmp_path, hf_dir):
    drop = "model.layers.0.linear_attn.in_proj_qkv.weight"
    _copy_ckpt(hf_dir, tmp_path, lambda sd: {k: v for k, v in sd.items() if k != drop})
    kind, msg = _load_error(tmp_path)
    assert kind is ValueError and "missing" in msg and drop in msg


def test_error_unexpected_keys(tmp_path, hf_dir):
    _copy_ckpt(hf_dir, tmp_path, lambda sd: {**sd, "model.layers.0.mystery.weight": torch.zeros(1)})
    kind, msg = _load_error(tmp_path)
    assert kind is ValueError and "model.layers.0.mystery.weight" in msg


def test_error_shape_mismatch(tmp_path, hf_dir):
    key = "model.layers.1.mlp.up_proj.weight"
    _copy_ckpt(hf_dir, tmp_path, lambda sd: {**sd, key: torch.zeros(100, 64)})
    kind, msg = _load_error(tmp_path)
    assert kind is ValueError and "layers.1.mlp.up_proj.weight" in msg and "(128, 64)" in msg and "(100, 64)" in msg


def test_error_unsupported_model_type(tmp_path, hf_dir):
    cfg = json.loads((hf_dir / "config.json").read_text())
    _copy_ckpt(hf_dir, tmp_path, config=json.dumps({**cfg, "model_type": "llama"}))
    kind, msg = _load_error(tmp_path)
    assert kind is ValueError and "'llama'" in msg
