"""Training the multi-token-prediction head (model.mtp=train|head): its targets, its forward against one built from
transformers' own pieces, head mode's detached trunk, its metrics, every mesh against one process, its export."""

import json

import pytest
import torch

from distributed import run_distributed
from helpers import (assert_same_training, compose, make_hf_model, parity_overrides, read_metrics,
                     tiny_overrides, train_alone, train_with_grads)

from qwenft.constants import IGNORE_INDEX

I = IGNORE_INDEX


def test_mtp_labels_stay_inside_each_document():
    from qwenft.models.qwen3_5.mtp import mtp_labels

    labels = torch.tensor([[10, 11, 12, I, 20, 21], [30, 31, 32, 33, 34, I]])
    cu = torch.tensor([0, 4, 6, 12], dtype=torch.int32)  # documents [0, 4), [4, 6), [6, 12) of the flat stream
    assert mtp_labels(labels, cu).tolist() == [[11, 12, I, I, 21, I], [31, 32, 33, 34, I, I]]
    assert mtp_labels(labels, None).tolist() == [[11, 12, I, 20, 21, I], [31, 32, 33, 34, I, I]]


def _checkpoint_with_head(tmp_path, cfg, seed=0):
    """A transformers Qwen3.5 checkpoint (every weight perturbed, fp32) plus an `mtp.*` head, and transformers'
    pieces holding that head's weights: (path, hf model, {"layer", "fc", "norm_e", "norm_h", "norm"})."""
    from safetensors.torch import load_file, save_file
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

    hf = make_hf_model(cfg, seed=seed)
    hf.save_pretrained(tmp_path)
    layer_cfg = json.loads(json.dumps(hf.config.to_dict()))
    layer_cfg["layer_types"] = ["full_attention"] * cfg.text.num_hidden_layers  # the head's layer: full attention
    torch.manual_seed(seed + 1)
    h = cfg.text.hidden_size
    layer_config = type(hf.config)(**layer_cfg)
    layer_config._attn_implementation = "sdpa"  # causal without a mask (a standalone layer would get eager's none)
    pieces = {"layer": Qwen3_5DecoderLayer(layer_config, 0),
              "fc": torch.nn.Linear(2 * h, h, bias=False),
              **{k: Qwen3_5RMSNorm(h, eps=cfg.text.rms_norm_eps) for k in ("norm_e", "norm_h", "norm")}}
    with torch.no_grad():
        for piece in pieces.values():
            for p in piece.parameters():
                p.add_(torch.randn_like(p) * 0.1)
    head = {"mtp.fc.weight": pieces["fc"].weight, "mtp.pre_fc_norm_embedding.weight": pieces["norm_e"].weight,
            "mtp.pre_fc_norm_hidden.weight": pieces["norm_h"].weight, "mtp.norm.weight": pieces["norm"].weight,
            **{f"mtp.layers.0.{k}": t for k, t in pieces["layer"].state_dict().items()}}
    weights = load_file(tmp_path / "model.safetensors")
    save_file({**weights, **{k: t.detach().clone().contiguous() for k, t in head.items()}},
              tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    return tmp_path, hf, pieces


def _reference_logits(hf, pieces, ids_n: torch.Tensor) -> torch.Tensor:
    """transformers' pieces on one document: the MTP head's logits at its positions 0 .. n-2 (the last has no
    next token inside the document)."""
    with torch.no_grad():
        hidden = hf.model(input_ids=ids_n[None]).last_hidden_state[:, :-1]  # the final norm's output
        embeds = hf.model.embed_tokens(ids_n[None, 1:])
        x = pieces["fc"](torch.cat([pieces["norm_e"](embeds), pieces["norm_h"](hidden)], dim=-1))
        positions = torch.arange(x.shape[1])[None]
        y = pieces["layer"](x, position_embeddings=hf.model.rotary_emb(x, positions), position_ids=positions)
        return hf.lm_head(pieces["norm"](y))[0]


def test_forward_equals_transformers_pieces_on_packed_rows(tmp_path):
    """The head's logits, on packed rows with M-RoPE position ids, loaded from a checkpoint by the real loader,
    equal transformers' decoder layer (forced to full attention), RMSNorms and a Linear `fc` run on each document
    alone (fp32, 1e-5); its CE equals the reference's on the same targets."""
    from qwenft.models.loader import build_model, load_hf_weights
    from qwenft.models.qwen3_5.configs import named_config
    from qwenft.models.qwen3_5.mtp import mtp_labels

    cfg = named_config("tiny")
    path, hf, pieces = _checkpoint_with_head(tmp_path, cfg)
    cfg.text.mtp_num_hidden_layers = 1
    model = load_hf_weights(build_model(cfg, kernels="torch", mtp="train"), path, device="cpu",
                            dtype=torch.float32)
    lengths = [[5, 9, 2, 16], [32]]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.text.vocab_size, (2, 32), generator=gen)
    cu = torch.tensor([0, 5, 14, 16, 32, 64], dtype=torch.int32)
    starts = cu[:-1].repeat_interleave(cu.diff()).view(2, 32)
    positions = (torch.arange(64).view(2, 32) - starts).expand(3, 2, 32)  # M-RoPE: the text's three equal rows
    labels = ids.roll(-1, 1)
    targets = mtp_labels(labels, cu)
    captured = {}
    model.mtp.register_forward_hook(lambda _m, _a, out: captured.update(y=out))
    _, mtp_ce, hits = model(input_ids=ids, position_ids=positions, cu_seqlens=cu, labels=labels,
                            mtp_labels=targets)
    got = model.lm_head(captured["y"]).detach().flatten(0, 1)
    ref_ce, ref_hits = torch.zeros((), dtype=torch.float64), 0
    flat_ids, flat_targets = ids.flatten(), targets.flatten()
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        ref = _reference_logits(hf, pieces, flat_ids[s:e])
        assert ((got[s:e - 1] - ref).norm() / ref.norm()).item() < 1e-5
        tgt = flat_targets[s:e - 1]
        ref_ce += torch.nn.functional.cross_entropy(ref.double(), tgt, ignore_index=I, reduction="sum")
        ref_hits += int(((ref.argmax(-1) == tgt) & (tgt != I)).sum())
    assert abs(mtp_ce.item() - ref_ce.item()) <= 1e-5 * ref_ce.item()
    assert hits.item() == ref_hits


def test_head_mode_gives_only_the_head_gradients():
    """model.mtp=head: the MTP loss reaches the head's parameters and nothing of the trunk (embeddings, layers,
    final norm, lm_head); model.mtp=train reaches the trunk too."""
    from qwenft.models.loader import build_model, init_random_weights
    from qwenft.models.qwen3_5.configs import named_config
    from qwenft.models.qwen3_5.mtp import mtp_labels

    cfg = named_config("tiny")
    cfg.text.mtp_num_hidden_layers = 1
    ids = torch.randint(0, cfg.text.vocab_size, (1, 48), generator=torch.Generator().manual_seed(1))
    cu = torch.tensor([0, 20, 48], dtype=torch.int32)
    grads = {}
    for mode in ("head", "train"):
        model = init_random_weights(build_model(cfg, kernels="torch", mtp=mode), seed=0, device="cpu",
                                    dtype=torch.float32)
        _, mtp_ce, _ = model(input_ids=ids, cu_seqlens=cu, labels=ids.roll(-1, 1),
                             mtp_labels=mtp_labels(ids.roll(-1, 1), cu))
        mtp_ce.backward()
        grads[mode] = {n: p.grad for n, p in model.named_parameters()}
    for name, g in grads["head"].items():
        if name.startswith("mtp."):
            assert g is not None and g.abs().sum() > 0, name
        else:
            assert g is None or not g.any(), name
    trunk = [n for n, g in grads["train"].items() if not n.startswith("mtp.") and g is not None and g.any()]
    assert {"embed_tokens.weight", "lm_head.weight", "norm.weight", "layers.0.linear_attn.q_proj.weight"} <= set(trunk)


@pytest.mark.slow
def test_head_mode_leaves_the_trunks_training_as_without_mtp(tmp_path):
    """The logged loss of a head-mode run equals a keep-mode run's at every step (the trunk never sees the head's
    loss), while its MTP metrics are logged; keep logs none."""
    runs = {mode: tmp_path / mode for mode in ("keep", "head")}
    for mode, run_dir in runs.items():
        train_alone(tiny_overrides(run_dir, "train.max_steps=4", f"model.mtp={mode}", "checkpoint.export_hf=false"))
    keep, head = (read_metrics(runs[m]) for m in ("keep", "head"))
    assert [r["loss"] for r in head if "loss" in r] == [r["loss"] for r in keep if "loss" in r]
    assert all("mtp_loss" in r and 0 <= r["mtp_accuracy"] <= 1 for r in head if "loss" in r)
    assert not any("mtp_loss" in r for r in keep)


@pytest.mark.slow
def test_mtp_accuracy_rises_and_the_export_carries_the_trained_head(tmp_path):
    """recipe=tiny with model.mtp=train: the head's teacher-forced accuracy on token t+2 rises over training, and the
    HF export holds the trained head (mtp.* equal to the run's final parameters) with mtp_num_hidden_layers."""
    from safetensors.torch import load_file

    run_dir = tmp_path / "run"
    result = train_alone(tiny_overrides(run_dir, "train.max_steps=40", "data.seq_len=128", "model.mtp=train",
                                        "optim.lr=5e-3"), return_state=True)
    rows = [r for r in read_metrics(run_dir) if "mtp_accuracy" in r]
    first, last = (sum(r["mtp_accuracy"] for r in part) / len(part) for part in (rows[:5], rows[-5:]))
    assert last > first + 0.05, (first, last)
    exported = load_file(run_dir / "hf" / "model.safetensors")
    head = {k: v for k, v in result.state_dict.items() if k.startswith("mtp.")}
    assert head and {k for k in exported if k.startswith("mtp.")} == set(head)
    for name, value in head.items():
        assert torch.equal(exported[name].float(), value.to(exported[name].dtype).float()), name
    assert json.loads((run_dir / "hf" / "config.json").read_text())["mtp_num_hidden_layers"] == 1


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process of the parity run with the head trained (model.mtp=train)."""
    (result,) = run_distributed(train_with_grads, 1, parity_overrides(tmp_path_factory.mktemp("mtp") / "ref",
                                                                      "model.mtp=train"))
    return result


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("mesh", [["mesh.dp=2", "pipeline.reduce_grad_per_microbatch=true"],
                                  ["mesh.pp=2", "pipeline.reduce_grad_per_microbatch=true"]],
                         ids=["dp2-knob", "pp2-knob"])
def test_every_mesh_trains_the_head_as_one_process(tmp_path, reference, mesh):
    """Losses, trained parameters and last gradients (the head's included) of each mesh against one process."""
    results = run_distributed(train_with_grads, 2, parity_overrides(tmp_path / "run", "model.mtp=train", *mesh))
    assert any(k.startswith("mtp.") for k in reference.state_dict)
    for result in results:
        assert_same_training(result, reference)


@pytest.mark.parametrize("overrides, message", [
    (["model.mtp=yes"], "model.mtp='yes' is not valid; choose one of keep, train, head"),
    (["model.mtp=train", "model.mtp_loss_weight=-1"], "model.mtp_loss_weight=-1.0 must be a finite number >= 0"),
    (["model.mtp=head", "model.mtp_loss_weight=inf"], "model.mtp_loss_weight=inf must be a finite number >= 0"),
])
def test_bad_mtp_keys_fail_with_one_line(tmp_path, overrides, message):
    from qwenft.train.build import model_config

    with pytest.raises(ValueError) as info:
        model_config(compose(tiny_overrides(tmp_path, *overrides)))
    assert str(info.value) == message


@pytest.mark.parametrize("on_nonfinite", ["error", "skip"])
def test_head_mode_stops_or_skips_a_step_whose_head_gradient_is_not_finite(tmp_path, on_nonfinite):
    """model.mtp=head clips the head's gradients apart from the trunk's: a head whose gradient overflows (a row of
    mtp.fc at 1e38, finite in bf16) stops the run or skips the step as train.on_nonfinite says, as the trunk's
    would, while the trunk's own norm stays finite; the head's norm is logged as mtp_grad_norm."""
    import math

    from safetensors.torch import load_file, save_file

    from test_export_mtp import ONE_STEP, _give_head, _model_cfg

    src, run_dir = tmp_path / "src", tmp_path / "run"
    make_hf_model(_model_cfg("tiny")).save_pretrained(src)
    _give_head(src, shards=False)
    weights = load_file(src / "model.safetensors")
    weights["mtp.fc.weight"][0] = 1e38
    save_file(weights, str(src / "model.safetensors"), metadata={"format": "pt"})
    overrides = tiny_overrides(run_dir, f"model.path={src}", *ONE_STEP, "model.mtp=head",
                               f"train.on_nonfinite={on_nonfinite}", "checkpoint.export_hf=false")
    if on_nonfinite == "error":
        with pytest.raises(ValueError, match=r"^non-finite loss/grad norm at step 1 \(loss=[0-9.]+, grad_norm=[0-9.]+, "
                                             r"mtp_grad_norm=(nan|inf)\); "):
            train_alone(overrides)
        return
    train_alone(overrides)
    (row,) = [r for r in read_metrics(run_dir) if "loss" in r]
    assert row["skipped_steps"] == 1 and math.isfinite(row["grad_norm"]) and not math.isfinite(row["mtp_grad_norm"])


def test_lora_may_target_the_heads_own_linears_alone():
    """`mtp.fc` is a linear LoRA adapts when the head trains: a target naming it alone passes the target check
    (`qwenft plan`, as train and slurm check), and without a trained head it matches nothing."""
    from helpers import qwenft_alone

    args = ("plan", "recipe=tiny_lora", "peft.target_modules=[fc]", "checkpoint.export_hf=merged")
    assert qwenft_alone(*args, "model.mtp=train") == 0
    assert qwenft_alone(*args, "model.mtp=keep") == 2


def test_lora_with_a_trained_head_exports_merged_only(tmp_path):
    """peft=lora with model.mtp=train and checkpoint.export_hf=true is refused before anything is written: a peft
    adapter dir cannot carry the head."""
    from qwenft.train.build import model_config

    run_dir = tmp_path / "run"
    with pytest.raises(ValueError) as info:
        model_config(compose(tiny_overrides(run_dir, "peft=lora", "model.mtp=train", "checkpoint.export_hf=true")))
    assert str(info.value) == ("model.mtp=train with peft=lora and checkpoint.export_hf=true: a peft adapter dir cannot "
                               "carry the trained MTP head (peft and vLLM load adapters onto the trunk alone); set "
                               "checkpoint.export_hf=merged, or false")
    assert not run_dir.exists()


def test_training_a_head_the_checkpoint_lacks_fails_with_one_line(tmp_path):
    from helpers import save_random_checkpoint
    from qwenft.models.qwen3_5.configs import named_config
    from qwenft.train.build import model_config

    path = save_random_checkpoint(named_config("tiny"), tmp_path / "ckpt")
    with pytest.raises(ValueError) as info:
        model_config(compose(tiny_overrides(tmp_path / "run", f"model.path={path}", "model.mtp=head")))
    assert str(info.value) == (f"model.mtp=head: model.path={path} has no MTP head (no mtp_num_hidden_layers in "
                                 f"its config.json); use model.mtp=keep")


def _fp64_model(mode: str = "train", ce_kernel: str = "torch", shard=None):
    """The tiny model with a fresh head in fp64, random init; `shard(model)` (tensor parallelism) runs on meta first."""
    from qwenft.models.loader import build_model, init_random_weights
    from qwenft.models.qwen3_5.configs import named_config

    cfg = named_config("tiny")
    cfg.text.vocab_size, cfg.text.mtp_num_hidden_layers = 128, 1
    model = build_model(cfg, kernels="torch", device="meta", dtype=torch.float64, mtp=mode, ce_kernel=ce_kernel)
    if shard is not None:
        shard(model)
    return init_random_weights(model, seed=0, device="cpu", dtype=torch.float64)


def _mtp_loss_and_grads(model, batch: dict, labels, targets):
    ce, mtp_ce, hits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                             cu_seqlens=batch["cu_seqlens"], labels=labels, mtp_labels=targets)
    (ce + mtp_ce).backward()
    return torch.stack([ce.detach(), mtp_ce.detach(), hits.double()]), {n: p.grad.clone()
                                                                      for n, p in model.named_parameters()}


def _mtp_cp_rank(rank, world_size, batch, targets):
    import torch.distributed as dist

    from qwenft.models.qwen3_5.context_parallel import split_labels

    model = _fp64_model()
    model.cp_group = dist.group.WORLD
    split = lambda t: split_labels(t, rank, world_size)  # noqa: E731
    stats, grads = _mtp_loss_and_grads(model, batch, split(batch["labels"]), split(targets))
    dist.all_reduce(stats)
    for g in grads.values():
        dist.all_reduce(g)
    return stats, grads


@pytest.mark.distributed
@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_head_equals_one_process_in_fp64(cp):
    """The head under cp (its targets from the whole rows, each span's next-token embeddings cut after the
    shift, its attention over the gathered keys): the CE sums, the hits and every gradient equal one process."""
    from qwenft.models.qwen3_5.mtp import mtp_labels
    from test_context_parallel import _batch

    batch = _batch([7, 30, 1, 2, 24])  # documents straddling span edges at cp2 and cp4, one of 1 token
    targets = mtp_labels(batch["labels"], batch["cu_seqlens"])
    want_stats, want_grads = _mtp_loss_and_grads(_fp64_model(), batch, batch["labels"], targets)
    for stats, grads in run_distributed(_mtp_cp_rank, cp, batch, targets):
        # the CE sums run in fp32 (the head's CE), over the spans in another order: ~100 terms at 6e-8 each
        assert torch.allclose(stats[:2], want_stats[:2], rtol=1e-5, atol=0), (stats, want_stats)
        assert stats[2] == want_stats[2]
        for name, ref in want_grads.items():
            err = (grads[name] - ref).abs().max() / ref.abs().max().clamp(min=1e-30)
            assert err < 1e-10, f"{name}: relative error {err:.3e}"


def _mtp_tp_rank(rank, world_size, batch, targets, sequence_parallel):
    from torch.distributed.device_mesh import init_device_mesh

    from qwenft.distributed.tensor_parallel import apply_tp

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    model = _fp64_model(ce_kernel="fused", shard=lambda m: apply_tp(m, mesh, vocab_parallel=True,
                                                                     sequence_parallel=sequence_parallel))
    assert model.mtp.layers["0"].self_attn.q_proj.weight.to_local().shape[0] * world_size == \
        model.mtp.layers["0"].self_attn.q_proj.weight.shape[0]  # the head's attention really split
    stats, grads = _mtp_loss_and_grads(model, batch, batch["labels"], targets)
    return stats, {n: g.full_tensor() if hasattr(g, "full_tensor") else g for n, g in grads.items()}


@pytest.mark.distributed
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_tensor_parallel_head_equals_one_process_in_fp64(sequence_parallel):
    """tp2 with a vocab-parallel head and the fused CE (sequence parallel too): the head's attention and MLP cut
    like the trunk's, its fc and norms replicated; the CE sums, the hits and every gradient equal one process."""
    from qwenft.models.qwen3_5.mtp import mtp_labels
    from test_context_parallel import _batch

    batch = _batch([7, 30, 1, 2, 24])
    targets = mtp_labels(batch["labels"], batch["cu_seqlens"])
    want_stats, want_grads = _mtp_loss_and_grads(_fp64_model(ce_kernel="fused"), batch, batch["labels"], targets)
    for stats, grads in run_distributed(_mtp_tp_rank, 2, batch, targets, sequence_parallel):
        assert torch.allclose(stats[:2], want_stats[:2], rtol=1e-5, atol=0), (stats, want_stats)
        assert stats[2] == want_stats[2]
        for name, ref in want_grads.items():
            err = (grads[name] - ref).abs().max() / ref.abs().max().clamp(min=1e-30)
            assert err < 1e-10, f"{name}: relative error {err:.3e}"


def test_lora_targets_the_head(tmp_path):
    """peft=lora with model.mtp=train: the head's linears (fc and its layer's projections) get adapters, trained."""
    result = train_alone(tiny_overrides(tmp_path, "train.max_steps=1", "peft=lora", "model.mtp=train",
                                        "checkpoint.export_hf=false"), return_state=True)
    adapted = {k.rpartition(".lora_")[0] for k in result.state_dict if k.startswith("mtp.") and ".lora_" in k}
    assert {"mtp.fc", "mtp.layers.0.self_attn.q_proj", "mtp.layers.0.mlp.down_proj"} <= adapted


@pytest.mark.slow
def test_moe_head_loads_per_expert_and_exports_the_trained_head(tmp_path):
    """An MoE checkpoint whose head stores one tensor per expert (transformers' layout), model.mtp=train at lr 1e-30
    (a step below every weight's rounding): the loader stacks the head's experts, and the export writes the trained head (its experts fused, as the
    trunk's) in place of the kept copy, equal to the source's tensors."""
    from safetensors import safe_open

    from helpers import make_hf_moe_model
    from qwenft.models.loader import checkpoint_files
    from test_export_mtp import ONE_STEP, _give_head, _model_cfg

    src, run_dir = tmp_path / "src", tmp_path / "run"
    cfg = _model_cfg("tiny_moe")
    make_hf_moe_model(cfg).save_pretrained(src)
    head = _give_head(src, shards=True)
    train_alone(tiny_overrides(run_dir, f"model.path={src}", *ONE_STEP, "model.kernels.moe=loop", "model.mtp=train",
                               "optim.lr=1e-30", "optim.weight_decay=0", "checkpoint.export_hf=true"))
    files = checkpoint_files(run_dir / "hf")
    out = {}
    for key, path in files.items():
        if key.startswith("mtp."):
            with safe_open(path, "pt") as f:
                out[key] = f.get_tensor(key)
    experts = "mtp.layers.0.mlp.experts."
    assert not any(k.startswith(experts) and k.split(".")[5].isdigit() for k in out)
    stacked = {"gate_up_proj": torch.stack([torch.cat([head[f"{experts}{j}.gate_proj.weight"],
                                                       head[f"{experts}{j}.up_proj.weight"]])
                                            for j in range(cfg.text.num_experts)]),
               "down_proj": torch.stack([head[f"{experts}{j}.down_proj.weight"] for j in range(cfg.text.num_experts)])}
    for name, want in stacked.items():
        assert torch.equal(out[experts + name].to(want.dtype), want), name
    for key, want in head.items():
        if not key.startswith(experts):
            assert torch.equal(out[key].to(want.dtype), want), key
    config = json.loads((run_dir / "hf" / "config.json").read_text())
    assert config["mtp_num_hidden_layers"] == 1 and config["mtp_use_dedicated_embeddings"] is False


@pytest.mark.slow
@pytest.mark.distributed
def test_moe_head_under_expert_parallel_trains_as_one_process(tmp_path):
    """tiny_moe with a trained head: the head's MoE block shares out its experts over ep like the trunk's (dp2 x
    ep2); losses, parameters and last gradients as one process."""
    moe = ("model.name=tiny_moe", "model.kernels.moe=loop", "model.mtp=train")
    (reference,) = run_distributed(train_with_grads, 1, parity_overrides(tmp_path / "ref", *moe))
    assert any(k.startswith("mtp.layers.0.mlp.experts.") for k in reference.state_dict)
    for result in run_distributed(train_with_grads, 2, parity_overrides(tmp_path / "ep2", *moe, "mesh.dp=2",
                                                                        "mesh.ep=2")):
        assert_same_training(result, reference)


def test_qwenft_export_of_a_checkpoint_writes_the_trained_head(tmp_path, capfd):
    """`qwenft export` of a model.mtp=train run's checkpoint writes the head from the checkpoint (equal to the
    run's final parameters) and mtp_num_hidden_layers, and says so."""
    from safetensors import safe_open

    from helpers import qwenft_alone

    run_dir, out = tmp_path / "run", tmp_path / "out"
    result = train_alone(tiny_overrides(run_dir, "train.max_steps=2", "model.mtp=train", "checkpoint.every_steps=2",
                                        "checkpoint.export_hf=false"), return_state=True)
    capfd.readouterr()
    assert qwenft_alone("export", f"run_dir={run_dir}", f"out={out}", "dtype=float32") == 0
    assert "with the MTP head the run trained (model.mtp=train, 15 tensors)" in capfd.readouterr().out
    head = {k: v for k, v in result.state_dict.items() if k.startswith("mtp.")}
    with safe_open(out / "model.safetensors", "pt") as f:
        assert {k for k in f.keys() if k.startswith("mtp.")} == set(head)
        for name, value in head.items():
            assert torch.equal(f.get_tensor(name), value.float()), name
    assert json.loads((out / "config.json").read_text())["mtp_num_hidden_layers"] == 1


@pytest.mark.slow
def test_lora_on_the_head_merges_the_same_at_the_end_of_the_run_and_in_qwenft_export(tmp_path, capfd):
    """peft=lora with model.mtp=train on a checkpoint with a head: the run's merged export and `qwenft export
    merged=true` of its checkpoint write the same head, its adapters merged (not the kept source tensors); its
    adapters alone (no merged=true) are refused."""
    from safetensors import safe_open

    from helpers import qwenft_alone
    from qwenft.models.loader import checkpoint_files
    from test_export_mtp import ONE_STEP, _give_head, _model_cfg

    src, run_dir = tmp_path / "src", tmp_path / "run"
    make_hf_model(_model_cfg("tiny")).save_pretrained(src)
    source = _give_head(src, shards=False)
    train_alone(tiny_overrides(run_dir, f"model.path={src}", *ONE_STEP, "peft=lora", "model.mtp=train",
                               "optim.lr=1e-2", "checkpoint.every_steps=1", "checkpoint.export_hf=merged"))
    assert qwenft_alone("export", f"run_dir={run_dir}", f"out={tmp_path / 'out'}", "merged=true") == 0

    def head(out):
        found = {}
        for key, path in checkpoint_files(out).items():
            if key.startswith("mtp."):
                with safe_open(path, "pt") as f:
                    found[key] = f.get_tensor(key)
        return found

    ran, exported = head(run_dir / "hf"), head(tmp_path / "out")
    assert set(ran) == set(exported) == set(source)
    for key in source:
        assert torch.equal(ran[key], exported[key]), key
    q_proj = "mtp.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(ran[q_proj], source[q_proj].to(ran[q_proj].dtype))
    capfd.readouterr()
    assert qwenft_alone("export", f"run_dir={run_dir}", f"out={tmp_path / 'adapter'}") == 2
    assert "trained the MTP head with peft=lora (model.mtp=train), which a peft adapter dir cannot carry; export it " \
           "with merged=true" in capfd.readouterr().err
    assert not (tmp_path / "adapter").exists()


@pytest.mark.parametrize("before, after", [("keep", "train"), ("head", "keep")])
def test_resuming_with_the_head_switched_on_or_off_fails_in_one_line(tmp_path, before, after):
    """A checkpoint holds a trained head exactly when its run had model.mtp=train or head: a resume that would lose
    it, or look for one that is not there, is refused before anything is loaded; train <-> head resumes."""
    from helpers import raised_line, train

    run_dir = tmp_path / "run"
    common = ("checkpoint.every_steps=1", "checkpoint.export_hf=false")
    train_alone(tiny_overrides(run_dir, "train.max_steps=1", f"model.mtp={before}", *common))
    with pytest.raises(RuntimeError) as info:
        run_distributed(train, 1, tiny_overrides(run_dir, "train.max_steps=2", f"model.mtp={after}", *common))
    there = ("a trained MTP head (model.mtp=train or head)" if before != "keep" else "no MTP head (model.mtp=keep)")
    assert raised_line(info) == (f"ValueError: checkpoint.resume=auto: {run_dir / 'checkpoints' / 'step-000001'} "
                                 f"holds {there}, this run has model.mtp={after}; resume with the model.mtp it was "
                                 f"trained with, or start afresh with checkpoint.resume=none in a new run_dir")
    if before == "head":
        train_alone(tiny_overrides(run_dir, "train.max_steps=2", "model.mtp=train", *common))
