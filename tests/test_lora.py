"""LoRA (peft=lora): the adapted model starts as the base, trains, and every mesh computes the adapters' losses and
gradients of one process (fp32, CPU)."""

import pytest
import torch

from distributed import run_distributed
from helpers import assert_same_tensors, assert_within, fp32_rtol, train_recording_grads
from qwenft.conf import compose


def _train(rank, world_size, overrides):
    """(losses, [{adapter name: gradient} per step], {adapter name: value after training}) of this rank."""
    from qwenft.models.lora import is_adapter

    _, losses, grads, values = train_recording_grads(overrides)
    assert values and all(is_adapter(n) for n in values)
    return losses, grads, values


LR = 5e-3


def _overrides(tmp_path, name, *extra):
    return ["recipe=tiny", "peft=lora", "train.max_steps=3", "data.seq_len=128", "model.kernels.gdn=torch",
            "train.progress_bar=false", f"optim.lr={LR}", "optim.max_grad_norm=0", "lr_scheduler.warmup_steps=0",
            "checkpoint.export_hf=false", "train.global_batch_size=4", "train.micro_batch_size=1",
            f"run_dir={tmp_path / name}", *extra]


def _merge(results):
    """One result from every rank's: the losses of rank 0, gradients and values of all stages."""
    losses = results[0][0]
    grads = [{k: v for r in results for k, v in r[1][step].items()} for step in range(len(results[0][1]))]
    values = {k: v for r in results for k, v in r[2].items()}
    return losses, grads, values


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, global batch 4 as 4 microbatches of 1."""
    (result,) = run_distributed(_train, 1, _overrides(tmp_path_factory.mktemp("reference"), "ref"))
    return result


def _assert_same(result, reference):
    """Each step's loss, and its adapter gradients as one vector and each tensor, within fp32_rtol of one process's
    at this run's lr 5e-3 for the AdamW steps before it."""
    losses, grads, values = result
    ref_losses, ref_grads, ref_values = reference
    assert len(losses) == len(ref_losses) == 3
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        assert_within(f"step {step + 1}'s loss", abs(a - b) / abs(b), fp32_rtol(step, lr=LR))
    for step, (got, ref) in enumerate(zip(grads, ref_grads)):
        assert_same_tensors(got, ref, fp32_rtol(step, lr=LR), f"step {step + 1}'s adapter gradients")
    # The trained values themselves are not compared: AdamW's first steps are ~lr * sign(g), so gradients equal
    # to 1e-5 give values equal to ~1e-4 only; steps 2 and 3 check the values through their losses and gradients.
    assert values.keys() == ref_values.keys()


@pytest.mark.slow
@pytest.mark.distributed
def test_reference_trains_every_adapter(reference):
    """Guards against a vacuous comparison: every adapter, B included, has a gradient from step 2 on (B's is
    nonzero at step 1, A's is zero then: B = 0) and the loss falls."""
    losses, grads, values = reference
    assert losses[-1] < losses[0]
    assert all(g.norm() > 0 for name, g in grads[0].items() if "lora_B" in name)
    assert all(g.norm() > 0 for g in grads[1].values())
    # GDN's in_proj_qkv is one adapter: one A (on q_proj), three Bs
    assert "layers.0.linear_attn.q_proj.lora_A.weight" in values
    assert "layers.0.linear_attn.k_proj.lora_A.weight" not in values
    assert {f"layers.0.linear_attn.{p}_proj.lora_B.weight" for p in "qkv"} <= values.keys()


@pytest.mark.slow
@pytest.mark.distributed
def test_step0_loss_equals_base_model_exactly(tmp_path, reference):
    from qwenft.train.runner import run

    def base(rank, world_size, overrides):
        return run(compose(overrides)).losses

    overrides = [o for o in _overrides(tmp_path, "base", "train.max_steps=1") if o != "peft=lora"]
    (losses,) = run_distributed(base, 1, overrides)
    assert losses[0] == reference[0][0]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("knob", ["false", "true"])
def test_dp2_equals_one_process(tmp_path, reference, knob):
    results = run_distributed(_train, 2, _overrides(tmp_path, f"dp2-{knob}",
                                                    f"pipeline.reduce_grad_per_microbatch={knob}"))
    for result in results:
        _assert_same(result, reference)


@pytest.mark.slow
def test_base_frozen_in_compute_dtype(tmp_path):
    """bf16 compute: the base is held in bf16 only, the adapters in fp32 (master), and only adapters are trained."""
    from qwenft.conf.layout import resolve_layout
    from qwenft.train.build import build_model_parts, model_config
    from qwenft.train.peft_setup import lora_config
    from qwenft.train.spec import resolve_spec

    cfg = compose(["recipe=tiny", "peft=lora", "model.dtype=bfloat16", "optim.master_dtype=float32"])
    model_cfg = model_config(cfg)
    layout = resolve_layout(1, 1, -1, 1)

    def parts(rank, world_size):
        spec = resolve_spec(cfg, layout, model_cfg, "cpu")
        from qwenft.distributed.mesh import build_mesh

        [(_, model)] = build_model_parts(cfg, model_cfg, spec, build_mesh(layout))
        return {n: (p.dtype, p.requires_grad) for n, p in model.named_parameters()}

    (params,) = run_distributed(parts, 1)
    assert lora_config(cfg).target_modules == ("all-linear",)
    for name, (dtype, trained) in params.items():
        adapter = ".lora_A." in name or ".lora_B." in name
        assert trained == adapter, name
        if adapter:
            assert dtype == torch.float32, name
        elif not name.endswith(("A_log", "dt_bias")):
            assert dtype == torch.bfloat16, name


@pytest.mark.parametrize("world_size, mesh", [
    (2, ["mesh.tp=2"]),
    (2, ["mesh.pp=2"]),
    (2, ["mesh.pp=2", "pipeline.schedule=interleaved_1f1b", "pipeline.reduce_grad_per_microbatch=true"]),
    (2, ["mesh.pp=2", "pipeline.schedule=gpipe"]),
    (2, ["mesh.pp=2", "pipeline.schedule=zbv"]),
    (2, ["mesh.pp=2", "pipeline.schedule=interleaved_zb"]),
    (4, ["mesh.tp=2", "mesh.pp=2"]),
    (2, ["mesh.tp=2", "model.compile=true"]),
    (2, ["mesh.cp=2"]),
], ids=["tp2", "pp2", "pp2-interleaved-knob", "pp2-gpipe", "pp2-zbv", "pp2-interleaved-zb", "tp2xpp2", "tp2-compile",
        "cp2"])
@pytest.mark.slow
@pytest.mark.distributed
def test_mesh_equals_one_process(tmp_path, reference, world_size, mesh):
    """Adapters sharded with their projections (tp) and split over stages (pp): same losses and gradients. Under
    model.compile the graphs take the frozen base's and the adapters' local tensors."""
    results = run_distributed(_train, world_size, _overrides(tmp_path, "mesh", *mesh))
    _assert_same(_merge(results), reference)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("option", ["model.activation_checkpointing=true", "model.activation_checkpointing=selective",
                                    "model.compile=true"])
def test_layer_options_equal_one_process(tmp_path, reference, option):
    """The adapters' hooks run inside recomputed and compiled layers."""
    (result,) = run_distributed(_train, 1, _overrides(tmp_path, "option", option))
    _assert_same(result, reference)


def _vlm_overrides(tmp_path, name, *extra):
    return ["recipe=tiny_vlm", "train.max_steps=4", "data.seq_len=256", "model.kernels.gdn=torch",
            "train.progress_bar=false", f"optim.lr={LR}", "lr_scheduler.warmup_steps=0", "checkpoint.export_hf=false",
            "train.global_batch_size=4", "train.micro_batch_size=2", f"run_dir={tmp_path / name}", *extra]


@pytest.mark.slow
@pytest.mark.distributed
def test_vlm_language_adapters_train_from_the_base(tmp_path):
    """recipe=tiny_vlm peft=lora: adapters on the language model only (the vision tower frozen whole), step 0's loss
    is the base VLM's exactly, and the loss falls."""
    from qwenft.train.runner import run

    def base(rank, world_size, overrides):
        return run(compose(overrides)).losses

    (losses, grads, values) = run_distributed(_train, 1, _vlm_overrides(tmp_path, "lora", "peft=lora"))[0]
    (base_losses,) = run_distributed(base, 1, _vlm_overrides(tmp_path, "base", "train.max_steps=1"))
    assert losses[0] == base_losses[0]
    assert losses[-1] < losses[0] - 0.1, losses
    assert values and not any(n.startswith("visual.") for n in values)
    assert all(g.norm() > 0 for g in grads[1].values())


@pytest.mark.slow
@pytest.mark.distributed
def test_vlm_vision_adapters_are_peft_modules_and_train(tmp_path):
    """peft.vision=true: every linear of transformers' vision tower (Qwen3_5ForConditionalGeneration's
    `model.visual.*`, the merger included) gets an adapter under that module's name, and the adapters get
    gradients."""
    from transformers import Qwen3_5ForConditionalGeneration

    from qwenft.models.lora import PEFT_PREFIX, hf_source
    from qwenft.models.qwen3_5.configs import named_config, to_hf_config

    (losses, grads, values) = run_distributed(_train, 1, _vlm_overrides(tmp_path, "lora", "peft=lora",
                                                                         "peft.vision=true", "train.max_steps=2"))[0]
    cfg = named_config("tiny_vlm")
    with torch.device("meta"):
        hf = Qwen3_5ForConditionalGeneration(to_hf_config(cfg))
    hf_linears = {n for n, m in hf.named_modules() if isinstance(m, torch.nn.Linear)}
    adapted = {hf_source(n, cfg).hf_key.removeprefix(PEFT_PREFIX).rsplit(".lora_", 1)[0] for n in values}
    assert adapted <= hf_linears
    assert {n for n in adapted if n.startswith("model.visual.")} == {n for n in hf_linears
                                                                     if n.startswith("model.visual.")}
    vision = {n: g for n, g in grads[1].items() if n.startswith("visual.")}
    assert vision and all(g.norm() > 0 for g in vision.values())


@pytest.mark.slow
@pytest.mark.parametrize("whole", [(), ("embed_tokens", "lm_head")], ids=["adapters", "modules-to-save"])
def test_peft_adapter_loads_in_peft_with_equal_logits(tmp_path, whole):
    """The run's adapter dir, loaded by peft onto transformers' Qwen3_5ForCausalLM, uses every key and gives
    qwenft's logits (fp32). With peft.train_embeddings / peft.train_head the trained embed_tokens / lm_head are
    peft's `modules_to_save`: the base given to peft has other (random) ones, which the adapter dir replaces."""
    import json

    from peft import PeftModel
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM

    from qwenft.checkpoint.hf_export import write_hf_checkpoint
    from qwenft.models.loader import build_model
    from qwenft.models.lora import LoRAConfig, apply_lora, is_adapter
    from qwenft.models.qwen3_5 import adapter
    from qwenft.models.qwen3_5.configs import named_config
    from qwenft.train.runner import run

    def train(rank, world_size, overrides):
        return run(compose(overrides), return_state=True).state_dict

    lora = LoRAConfig(rank=4, alpha=8, train_embeddings="embed_tokens" in whole, train_head="lm_head" in whole)
    overrides = _overrides(tmp_path, "run", "checkpoint.export_hf=true", "checkpoint.export_dtype=float32",
                           "peft.rank=4", "peft.alpha=8", f"peft.train_embeddings={lora.train_embeddings}",
                           f"peft.train_head={lora.train_head}")
    (state,) = run_distributed(train, 1, overrides)
    cfg = named_config("tiny")
    cfg.text.vocab_size = state["embed_tokens.weight"].shape[0]
    base = {k: v for k, v in state.items() if not is_adapter(k)}
    gen = torch.Generator().manual_seed(1)
    base.update({f"{m}.weight": torch.randn(base[f"{m}.weight"].shape, generator=gen) for m in whole})
    write_hf_checkpoint(adapter.to_hf_state_dict(base, cfg.text, adapter.CAUSAL_LM_PREFIX), cfg, tmp_path / "base")

    model = build_model(cfg, kernels="torch", device="meta")
    apply_lora(model, lora, adapter_dtype=torch.float32)
    model.to_empty(device="cpu")
    model.load_state_dict(state, strict=True)
    model.init_buffers()
    model.eval()
    input_ids = torch.randint(0, cfg.text.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(input_ids=input_ids)

    adapter_dir = tmp_path / "run" / "adapter"
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["base_model_name_or_path"] == "tiny"
    assert config["modules_to_save"] == (list(whole) or None)
    assert set(config["target_modules"]) == {"in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj",
                                             "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    hf = Qwen3_5ForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    with torch.no_grad():
        base_logits = hf(input_ids=input_ids).logits
    peft_model = PeftModel.from_pretrained(hf, adapter_dir).eval()
    saved = load_file(adapter_dir / "adapter_model.safetensors")
    loaded = get_peft_model_state_dict(peft_model)
    assert loaded.keys() == saved.keys()  # every key of the file has its module, every adapter of peft its key
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)
    assert saved["base_model.model.model.layers.0.linear_attn.in_proj_qkv.lora_B.weight"].shape[0] == (
        2 * cfg.text.linear_num_key_heads * cfg.text.linear_key_head_dim
        + cfg.text.linear_num_value_heads * cfg.text.linear_value_head_dim)
    saved_whole = {"embed_tokens": "base_model.model.model.embed_tokens.weight",
                   "lm_head": "base_model.model.lm_head.weight"}
    assert {saved_whole[m] for m in whole} == {k for k in saved if ".lora_" not in k}
    assert all(torch.equal(saved[saved_whole[m]], state[f"{m}.weight"]) for m in whole)
    with torch.no_grad():
        theirs = peft_model(input_ids=input_ids).logits
    err = (theirs - ours).abs().max() / ours.abs().max()
    assert err < 1e-5, f"peft's logits vs qwenft's: rel err {err:.2e}"
    assert (base_logits - ours).abs().max() / ours.abs().max() > 1e-3  # the adapters trained away from zero


@pytest.mark.slow
def test_tiny_lora_recipe_loss_falls(tmp_path):
    from qwenft.train.runner import run

    def train(rank, world_size, overrides):
        return run(compose(overrides)).losses

    (losses,) = run_distributed(train, 1, ["recipe=tiny_lora", "train.max_steps=12", "data.seq_len=128",
                                           "train.progress_bar=false", "model.kernels.gdn=torch",
                                           "checkpoint.export_hf=false", f"run_dir={tmp_path / 'run'}"])
    assert losses[-1] < losses[0] - 0.3, losses


@pytest.mark.parametrize("override, message", [
    ("peft.rank=0", "peft.rank=0 must be >= 1"),
    ("peft.alpha=0", "peft.alpha=0.0 must be > 0"),
    ("peft.alpha=-2", "peft.alpha=-2.0 must be > 0"),
    ("peft.dropout=1.0", "peft.dropout=1.0 must be in [0, 1)"),
    ("peft.method=qlora", "peft.method='qlora' is not valid; choose one of none, lora"),
    ("model.freeze_language=true", "model.freeze_language=true with peft=lora: LoRA freezes the whole base and trains "
                                   "the adapters peft.* places (peft.vision for the vision tower's); drop model.freeze_*"),
    ("peft=qlora", "peft='qlora' is not a peft option; choose one of lora, none"),
])
def test_bad_peft_values_one_line(override, message):
    with pytest.raises(ValueError) as e:
        compose(["recipe=tiny_lora", override])
    assert message in str(e.value) and "\n" not in str(e.value)


def test_dropout_on_the_vision_tower_under_context_parallel_is_refused():
    with pytest.raises(ValueError) as e:
        compose(["recipe=tiny_lora", "model.name=tiny_vlm", "peft.vision=true", "peft.dropout=0.1", "mesh.cp=2"])
    assert str(e.value) == ("peft.dropout=0.1 with peft.vision=true and mesh.cp=2: each cp rank runs the vision tower "
                            "on every image, and would drop other inputs of it; set peft.dropout=0, peft.vision=false "
                            "or mesh.cp=1")


@pytest.mark.parametrize("targets", [("qkv_proj",), ("q_proj", r"layers\.9\..*")])
def test_target_matching_nothing_lists_modules(targets):
    from qwenft.models.lora import LoRAConfig, check_targets
    from qwenft.models.qwen3_5.configs import named_config

    with pytest.raises(ValueError) as e:
        check_targets(named_config("tiny"), LoRAConfig(target_modules=targets))
    msg = str(e.value)
    assert f"peft.target_modules entry {targets[-1]!r} matches no module" in msg and "\n" not in msg
    assert "in_proj_qkv" in msg and "down_proj" in msg and "all-linear" in msg


def test_vision_without_tower():
    from qwenft.models.lora import LoRAConfig, check_targets
    from qwenft.models.qwen3_5.configs import named_config

    with pytest.raises(ValueError, match="peft.vision=true but the model has no vision tower"):
        check_targets(named_config("tiny"), LoRAConfig(vision=True))


@pytest.mark.slow
@pytest.mark.distributed
def test_resume_across_full_and_lora_refused(tmp_path):
    """A full finetuning checkpoint does not resume into a LoRA run, nor the reverse (one line, before loading)."""
    from qwenft.train.runner import run

    def train(rank, world_size, overrides):
        try:
            return run(compose(overrides)).losses
        except ValueError as e:
            return str(e)

    common = ["recipe=tiny", "train.max_steps=1", "data.seq_len=64", "train.global_batch_size=2",
              "train.progress_bar=false", "model.kernels.gdn=torch", "checkpoint.export_hf=false"]
    for name, peft in (("full", "peft=none"), ("lora", "peft=lora")):
        run_distributed(train, 1, common + [peft, "checkpoint.every_steps=1", f"run_dir={tmp_path / name}"])
    for saved, peft, there in (("full", "peft=lora", "peft.method=none"), ("lora", "peft=none", "peft.method=lora")):
        ckpt = tmp_path / saved / "checkpoints" / "step-000001"
        (msg,) = run_distributed(train, 1, common + [peft, f"checkpoint.resume={ckpt}", f"run_dir={tmp_path / 'x'}"])
        assert isinstance(msg, str) and f"checkpoint.resume={ckpt}" in msg and there in msg and "\n" not in msg, msg


def test_lora_resume_refuses_another_alpha_or_base_and_export_keeps_the_trained_alpha(tmp_path):
    """The adapters' values fit the alpha and the frozen base they were trained with: a resume with another
    peft.alpha, another model.path's weights (same shapes) or another random-init seed is refused in one line,
    and an export after config.yaml's alpha changed writes the alpha the checkpoint was trained at."""
    import json

    from helpers import save_random_checkpoint
    from qwenft.cli import main
    from qwenft.train.build import model_config
    from qwenft.train.runner import run

    def train(rank, world_size, overrides):
        try:
            return run(compose(overrides)).losses
        except ValueError as e:
            return str(e)

    cfg = model_config(compose(["recipe=tiny"]))
    base, other = save_random_checkpoint(cfg, tmp_path / "base"), save_random_checkpoint(cfg, tmp_path / "other", 1)
    common = ["recipe=tiny", "peft=lora", "train.max_steps=1", "data.seq_len=64", "train.global_batch_size=2",
              "train.progress_bar=false", "model.kernels.gdn=torch", "checkpoint.export_hf=false", "data.tokenizer=tiny"]
    for name, source in (("random", []), ("path", [f"model.path={base}"])):
        run_distributed(train, 1, common + source + ["checkpoint.every_steps=1", f"run_dir={tmp_path / name}"])
    random, path = (tmp_path / name / "checkpoints" / "step-000001" for name in ("random", "path"))
    for ckpt, change, there in (
            (path, ["peft.alpha=64", f"model.path={base}"], "peft.alpha=32.0"),
            (path, [f"model.path={other}"], f"this run's base, model.path={other}, is not the one the adapters of "
                                            f"{path} were trained on (other weights: the same tensors' names and "
                                            "shapes, other values)"),
            (path, [], "(a model.path's weights)"),
            (random, ["seed=7"], "this run's base, a random init with seed=7, is not the one the adapters of "
                                 f"{random} were trained on (a random-init base, seed=0)")):
        (msg,) = run_distributed(train, 1, common + change + [f"checkpoint.resume={ckpt}", f"run_dir={tmp_path / 'x'}"])
        assert isinstance(msg, str) and there in msg and "\n" not in msg, msg
    moved = tmp_path / "moved"  # the same weights elsewhere, in two files: resumed
    moved.mkdir()
    from safetensors.torch import load_file, save_file

    tensors = load_file(base / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({k: tensors[k] for k in part}, moved / file, metadata={"format": "pt"})
    (moved / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: file for file, part in shards.items() for k in part}}))
    for f in base.iterdir():
        if f.name != "model.safetensors":
            (moved / f.name).write_bytes(f.read_bytes())
    (losses,) = run_distributed(train, 1, common + [f"model.path={moved}", "train.max_steps=2",
                                                    f"checkpoint.resume={path}", f"run_dir={tmp_path / 'y'}"])
    assert isinstance(losses, list) and len(losses) == 1, losses
    config = tmp_path / "path" / "config.yaml"
    config.write_text(config.read_text().replace("alpha: 32.0", "alpha: 64.0").replace(str(base), str(moved)))
    assert main(["export", f"run_dir={tmp_path / 'path'}", f"out={tmp_path / 'adapter'}"]) == 0
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["lora_alpha"] == 32.0


@pytest.mark.slow
@pytest.mark.distributed
def test_checkpoint_trainable_only_and_resume_bit_identical(tmp_path):
    """A LoRA checkpoint holds the adapters and their AdamW state only; resuming it continues bit-identically
    on the same mesh and within fp32_rtol on dp2."""
    from torch.distributed.checkpoint import FileSystemReader

    def train(rank, world_size, overrides):
        losses, _, values = _train(rank, world_size, overrides)
        return losses, values

    common = ["recipe=tiny", "peft=lora", "data.seq_len=64", "train.global_batch_size=2", "train.micro_batch_size=1",
              "train.progress_bar=false", "model.kernels.gdn=torch", "checkpoint.export_hf=false", "optim.lr=5e-3",
              "lr_scheduler.warmup_steps=0", "lr_scheduler.decay=constant", "checkpoint.every_steps=2"]
    (whole,) = run_distributed(train, 1, common + ["train.max_steps=4", f"run_dir={tmp_path / 'whole'}"])
    run_distributed(train, 1, common + ["train.max_steps=2", f"run_dir={tmp_path / 'split'}"])
    ckpt = tmp_path / "split" / "checkpoints" / "step-000002"
    keys = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata.keys()
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in keys if k.startswith(("model.", "optim.state.")))
    (resumed,) = run_distributed(train, 1, common + ["train.max_steps=4", f"run_dir={tmp_path / 'split'}"])
    assert resumed[0] == whole[0][2:]
    assert all(torch.equal(resumed[1][k], v) for k, v in whole[1].items())
    dp2 = run_distributed(train, 2, common + ["train.max_steps=4", f"checkpoint.resume={ckpt}",
                                              f"run_dir={tmp_path / 'dp2'}"])
    # the two meshes part at step 3, the first step on dp2: its loss is one step's sums in another order
    for step, (a, b) in enumerate(zip(dp2[0][0], whole[0][2:])):
        assert_within(f"step {step + 3}'s loss on dp2", abs(a - b) / abs(b), fp32_rtol(step, lr=LR))


@pytest.mark.slow
def test_merged_export_loads_in_transformers_with_equal_logits(tmp_path):
    """checkpoint.export_hf=merged: <run_dir>/hf is the base with the adapters merged, transformers' logits equal
    qwenft's adapted model's (fp32)."""
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM

    from qwenft.models.loader import build_model
    from qwenft.models.lora import LoRAConfig, apply_lora
    from qwenft.models.qwen3_5.configs import named_config
    from qwenft.train.runner import run

    def train(rank, world_size, overrides):
        return run(compose(overrides), return_state=True).state_dict

    (state,) = run_distributed(train, 1, _overrides(tmp_path, "run", "checkpoint.export_hf=merged",
                                                    "checkpoint.export_dtype=float32"))
    cfg = named_config("tiny")
    cfg.text.vocab_size = state["embed_tokens.weight"].shape[0]
    model = build_model(cfg, kernels="torch", device="meta")
    apply_lora(model, LoRAConfig(), adapter_dtype=torch.float32)
    model.to_empty(device="cpu")
    model.load_state_dict(state, strict=True)
    model.init_buffers()
    input_ids = torch.randint(0, cfg.text.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    hf = Qwen3_5ForCausalLM.from_pretrained(tmp_path / "run" / "hf", dtype=torch.float32)
    with torch.no_grad():
        ours, theirs = model.eval()(input_ids=input_ids), hf.eval()(input_ids=input_ids).logits
    assert (theirs - ours).abs().max() / ours.abs().max() < 1e-5
    assert not (tmp_path / "run" / "adapter").exists()


@pytest.mark.slow
@pytest.mark.distributed
def test_export_of_a_checkpoint_adapters_and_merged(tmp_path, capsys):
    """`qwenft export` of a LoRA run's training checkpoint: the adapter dir loads in peft onto transformers' model
    with the logits of the run's own end-of-training adapter dir (within 1e-6); merged=true writes the base from
    model.path with the adapters merged (transformers' logits = peft's within 1e-5); once model.path is gone,
    merged=true fails in one line naming it."""
    from peft import PeftModel
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM

    from qwenft.checkpoint.hf_export import write_hf_checkpoint
    from qwenft.cli import main
    from qwenft.data.tokenizer import load_tokenizer
    from qwenft.models.loader import build_model, init_random_weights
    from qwenft.models.qwen3_5 import adapter
    from qwenft.models.qwen3_5.configs import named_config
    from qwenft.train.runner import run

    cfg = named_config("tiny")
    cfg.text.vocab_size = max(cfg.text.vocab_size, len(load_tokenizer("tiny")))
    base_model = init_random_weights(build_model(cfg, kernels="torch", device="meta"), seed=7, device="cpu")
    base = tmp_path / "base"
    write_hf_checkpoint(adapter.to_hf_state_dict({n: p.detach() for n, p in base_model.named_parameters()},
                                                 cfg.text, adapter.CAUSAL_LM_PREFIX), cfg, base)

    def train(rank, world_size, overrides):
        return run(compose(overrides)).losses

    run_dir = tmp_path / "run"
    run_distributed(train, 1, ["recipe=tiny_lora", "train.max_steps=2", "data.seq_len=64", "optim.lr=5e-2",
                               "lr_scheduler.warmup_steps=0", "train.progress_bar=false", "model.kernels.gdn=torch",
                               f"model.path={base}", "data.tokenizer=tiny", "checkpoint.every_steps=2",
                               "checkpoint.export_hf=true", "checkpoint.export_dtype=float32", f"run_dir={run_dir}"])
    assert main(["export", f"run_dir={run_dir}", f"out={tmp_path / 'adapter'}", "dtype=float32"]) == 0
    assert main(["export", f"run_dir={run_dir}", f"out={tmp_path / 'merged'}", "dtype=float32", "merged=true"]) == 0

    input_ids = torch.randint(0, cfg.text.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))

    def logits(model):
        with torch.no_grad():
            return model.eval()(input_ids=input_ids).logits

    def with_adapter(adapter_dir):
        return logits(PeftModel.from_pretrained(Qwen3_5ForCausalLM.from_pretrained(base, dtype=torch.float32),
                                                adapter_dir))

    run_end, exported = with_adapter(run_dir / "adapter"), with_adapter(tmp_path / "adapter")
    assert (exported - run_end).abs().max() / run_end.abs().max() < 1e-6
    base_logits = logits(Qwen3_5ForCausalLM.from_pretrained(base, dtype=torch.float32))
    assert (base_logits - run_end).abs().max() / run_end.abs().max() > 1e-3  # the adapters trained away from zero
    merged = logits(Qwen3_5ForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32))
    assert (merged - run_end).abs().max() / run_end.abs().max() < 1e-5

    base.rename(tmp_path / "moved")
    capsys.readouterr()
    assert main(["export", f"run_dir={run_dir}", f"out={tmp_path / 'again'}", "merged=true"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"model.path={base}" in err and "does not exist" in err and "\n" not in err, err
    assert not (tmp_path / "again").exists()


def test_all_linear_on_moe_adapts_everything_but_the_router_and_every_adapter_learns():
    """peft=lora on the MoE model: the router (`mlp.gate`) computes from its weight, not through its module, so
    an adapter there would never see a gradient (and peft, whose transformers router is no nn.Linear, has none);
    every adapter all-linear does add gets a gradient in one backward once B is nonzero."""
    from qwenft.models.loader import build_model, init_random_weights
    from qwenft.models.lora import LoRAConfig, apply_lora
    from qwenft.models.qwen3_5.configs import named_config

    cfg = named_config("tiny_moe")
    model = build_model(cfg, kernels="torch", moe_kernel="loop")
    apply_lora(model, LoRAConfig(rank=4, alpha=8), adapter_dtype=torch.float32)
    model = init_random_weights(model, seed=0, device="cpu", dtype=torch.float32)
    adapted = {n.rsplit(".lora_", 1)[0] for n, _ in model.named_parameters() if ".lora_" in n}
    assert not any(n.endswith(".mlp.gate") for n in adapted)
    assert any(n.endswith(".mlp.shared_expert_gate") for n in adapted)  # an nn.Linear called as a module
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B" in n:
                p.normal_(std=0.02)
    ids = torch.randint(0, cfg.text.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids).float().square().mean().backward()
    silent = [n for n, p in model.named_parameters() if ".lora_" in n and (p.grad is None or not p.grad.any())]
    assert not silent, silent


@pytest.mark.slow
@pytest.mark.distributed
def test_dropout_masks_follow_seed_step_and_rank_so_a_pp2_resume_is_bit_identical(tmp_path):
    """peft.dropout draws each step's masks from (seed, step, tp group): a pipeline run resumed on its mesh continues
    bit for bit, every stage's masks included (not only those of rank 0, whose generator a checkpoint could hold)."""
    common = _overrides(tmp_path, "whole", "peft.dropout=0.2", "mesh.pp=2", "checkpoint.every_steps=2",
                        "lr_scheduler.decay=constant")
    whole = _merge(run_distributed(_train, 2, common + ["train.max_steps=4"]))
    split = [f"run_dir={tmp_path / 'split'}"]
    run_distributed(_train, 2, common + ["train.max_steps=2", *split])
    resumed = _merge(run_distributed(_train, 2, common + ["train.max_steps=4", *split]))
    assert resumed[0] == whole[0][2:]
    assert resumed[2].keys() == whole[2].keys() and all(torch.equal(resumed[2][k], v) for k, v in whole[2].items())
    without = _merge(run_distributed(_train, 2, common + ["peft.dropout=0", "train.max_steps=2",
                                                          f"run_dir={tmp_path / 'without'}"]))
    assert without[0][1] != whole[0][1]  # the masks are drawn: step 2's loss differs (step 1's adapters are zero)


def _draws_after_seed_step(rank, world_size):
    """This rank's torch.rand after `runner.seed_step` on a (pp 2, dp 2, cp 1, tp 2) mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    from qwenft.train.runner import seed_step, seed_stream

    mesh = init_device_mesh("cpu", (2, 2, 1, 2), mesh_dim_names=("pp", "dp", "cp", "tp"))
    seed_step(seed=7, step=3, stream=seed_stream(mesh))
    return torch.rand(4)


@pytest.mark.distributed
def test_dropouts_draws_are_one_per_tensor_parallel_group():
    """The ranks of a tp group draw alike (what tp replicates stays equal on them); every other rank its own."""
    draws = run_distributed(_draws_after_seed_step, 8)
    groups = [(0, 1), (2, 3), (4, 5), (6, 7)]  # tp is the innermost mesh dim
    assert all(torch.equal(draws[a], draws[b]) for a, b in groups)
    firsts = [draws[a] for a, _ in groups]
    assert all(not torch.equal(x, y) for i, x in enumerate(firsts) for y in firsts[i + 1:])


@pytest.mark.parametrize("vision", [False, True])
def test_peft_adapts_on_transformers_vlm_exactly_the_modules_qwenft_trains(vision):
    """adapter_config.json's target_modules, given to peft on transformers' VLM, adapt exactly the linears qwenft
    adapts: leaf names where every module of that name is adapted and no module of another type has it (the vision
    tower's Conv3d patch_embed.proj shares `proj` with its attention's output linears), full names else."""
    from peft import LoraConfig, get_peft_model
    from transformers.models.qwen3_5 import Qwen3_5ForConditionalGeneration

    from helpers import tiny_vlm
    from qwenft.models.loader import build_model
    from qwenft.models.lora import LoRAConfig, peft_adapter_config, target_modules
    from qwenft.models.qwen3_5.configs import to_hf_config

    cfg = tiny_vlm()
    lora = LoRAConfig(rank=4, alpha=8, vision=vision)
    written = peft_adapter_config(cfg, lora, "base")["target_modules"]
    assert ("proj" in written) is False
    hf = get_peft_model(Qwen3_5ForConditionalGeneration(to_hf_config(cfg)),
                        LoraConfig(r=4, lora_alpha=8, target_modules=written))
    adapted = {n.removeprefix("base_model.model.").removesuffix(".lora_A") for n, _ in hf.named_modules()
               if n.endswith(".lora_A")}
    ours = target_modules(build_model(cfg, kernels="torch"), cfg.text, lora)
    assert adapted == {"model." + n if n.startswith("visual.") else "model.language_model." + n for n in ours}
    assert any(n.startswith("model.visual.") for n in adapted) == vision
