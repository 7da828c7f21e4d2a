"""Context parallelism (mesh.cp): a packed stream split into contiguous spans over gloo ranks gives one process's
loss and gradients.

The model tests run in fp64 on the torch kernels: the reference and the split runs differ only by the order of
sums (the fold over spans, the gradients summed over ranks), a few ulps of fp64 (observed: 1e-13 relative), so
a bound of 1e-10 relative on every gradient is far above rounding and far below any real mistake (a lost state
or a conv reset at a span edge moves outputs at the 1e-2 level; the summaries rounded to fp32 alone gave 1e-8).
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from distributed import run_distributed
from helpers import assert_same_tensors, assert_within, fp32_rtol, parity_overrides, train_with_grads
from qwenft.constants import IGNORE_INDEX

pytestmark = pytest.mark.distributed

T = 96  # stream tokens: spans of 48 (cp2) and 24 (cp4)

# documents (lengths) of one packed stream of T tokens, each a case the split must get right
LAYOUTS = {
    "straddling": [30, 40, 26],  # 30 | 40 crosses 48 (cp2) and 24, 48, 72 (cp4)
    "three_ranks": [5, 80, 11],  # one document over spans 0..3 at cp4
    "edge": [24, 24, 48],  # boundaries exactly at the span edges of cp4 (and 48: cp2)
    "tiny_at_edge": [23, 2, 22, 1, 24, 24],  # 1-2 token documents at span edges
    "many_short": [7, 5, 9, 3, 8, 6, 4, 10, 5, 7, 9, 3, 8, 12],
    "single": [96],
}


def _model(seed: int = 0, slow_decay: bool = False):
    from qwenft.models.loader import build_model, init_random_weights
    from qwenft.models.qwen3_5.configs import named_config

    cfg = named_config("tiny")
    cfg.text.vocab_size = 128
    model = build_model(cfg, kernels="torch", device="meta", dtype=torch.float64)
    init_random_weights(model, seed=seed, device="cpu", dtype=torch.float64)
    if slow_decay:  # decay close to 1: a state leaking across documents would carry far
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.data.fill_(-8.0)
    return model


def _batch(lengths: list[int], rows: int = 1, seed: int = 0) -> dict:
    """A microbatch of `rows` rows, each packed with documents of `lengths` (the last row's last document cut
    to fit: rows x T tokens)."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths) * rows
    ids = torch.randint(0, 128, (total,), generator=g)
    labels = torch.randint(0, 128, (total,), generator=g)
    labels[torch.rand(total, generator=g) < 0.2] = IGNORE_INDEX
    cu = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0)
    cu = torch.cat([cu[:-1] + r * sum(lengths) for r in range(rows)] + [cu[-1:] * rows]).to(torch.int32)
    pos = torch.cat([torch.arange(n) for n in lengths] * rows)
    seq = total // rows
    return {"input_ids": ids.view(rows, seq), "labels": labels.view(rows, seq), "position_ids": pos.view(rows, seq),
            "cu_seqlens": cu}


def _loss_and_grads(model, batch: dict, labels: torch.Tensor):
    from qwenft.models.loss import token_ce_sum

    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], cu_seqlens=batch["cu_seqlens"])
    loss = token_ce_sum(logits, labels)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _reference(batch: dict, slow_decay: bool = False):
    return _loss_and_grads(_model(slow_decay=slow_decay), batch, batch["labels"])


def _cp_rank(rank, world_size, batch, balanced=False):
    """This cp rank's loss and gradients, summed over the cp ranks (`balanced`: attention by halves)."""
    from qwenft.models.qwen3_5.context_parallel import split_labels

    model = _model()
    model.cp_group, model.cp_balanced = dist.group.WORLD, balanced
    loss, grads = _loss_and_grads(model, batch, split_labels(batch["labels"], rank, world_size))
    dist.all_reduce(loss)
    for g in grads.values():
        dist.all_reduce(g)
    return loss, grads


def _assert_close(got, want):
    loss, grads = got
    ref_loss, ref_grads = want
    # the CE is summed in fp32 (token_ce_sum), over the spans in another order: rounding of ~100 terms at
    # 6e-8 each; the per-token CE gradients are elementwise, the same fp32 values in both runs
    assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=0), (loss.item(), ref_loss.item())
    for name, ref in ref_grads.items():
        err = (grads[name] - ref).abs().max() / ref.abs().max().clamp(min=1e-30)
        assert err < 1e-10, f"{name}: relative error {err:.3e}"


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cp_equals_one_process(layout, cp):
    batch = _batch(LAYOUTS[layout])
    want = _reference(batch)
    for got in run_distributed(_cp_rank, cp, batch):
        _assert_close(got, want)


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_balanced_attention_equals_one_process(layout, cp):
    """mesh.cp_balanced_attention: each rank computes the attention of one early and one late half of the stream
    (at cp3 a rank sends both its halves to one rank) and returns the outputs; loss and gradients as one process."""
    batch = _batch(LAYOUTS[layout])
    want = _reference(batch)
    for got in run_distributed(_cp_rank, cp, batch, True):
        _assert_close(got, want)


def test_balanced_attention_sees_the_mean_keys_on_every_rank():
    """The point of the halves: for one document filling the stream, the keys the queries a rank computes see
    (causally) are the same on every rank, where contiguous spans give the last rank (2 cp - 1) x the first's."""
    from qwenft.models.qwen3_5.context_parallel import CPShard

    cp, total = 4, 96
    cu = torch.tensor([0, total])
    for rank in range(cp):
        shard = CPShard(None, rank, cp, total, cu, torch.device("cpu"), balanced=True)
        halves = [shard.half(h) for h in shard.computes(rank)]
        seen = sum(sum(range(s + 1, e + 1)) for s, e in halves)
        assert seen == sum(range(1, total + 1)) // cp, (rank, seen)


def test_cp_pads_rows_and_splits_across_them():
    """Two rows of 47 tokens at cp4: the 94-token stream is padded to 96 with an ignored pad document, and the
    span edges fall inside rows."""
    batch = _batch([20, 19, 8], rows=2)
    want = _reference(batch)
    for got in run_distributed(_cp_rank, 4, batch):
        _assert_close(got, want)


def _cp_logits(rank, world_size, batches):
    model = _model(slow_decay=True)
    model.cp_group = dist.group.WORLD
    with torch.no_grad():
        return [model(input_ids=b["input_ids"], position_ids=b["position_ids"], cu_seqlens=b["cu_seqlens"])
                for b in batches]


def test_no_state_leaks_across_documents():
    """Changing the tail of a document that straddles a span edge leaves the next document's outputs
    bit-identical on every rank, with the decay slowed so that a leaked state would show."""
    lengths = [40, 30, 26]  # document 0 ends at 40, inside span 1 of cp4 (24..48); document 1 crosses 48
    batch = _batch(lengths)
    changed = {k: v.clone() for k, v in batch.items()}
    changed["input_ids"][0, 30:40] = (changed["input_ids"][0, 30:40] + 1) % 128
    per_rank = run_distributed(_cp_logits, 4, [batch, changed])
    logits = [torch.cat([r[i] for r in per_rank], dim=1) for i in range(2)]  # [1, T, V] in stream order
    assert torch.equal(logits[0][:, 40:], logits[1][:, 40:])
    assert not torch.equal(logits[0][:, 30:40], logits[1][:, 30:40])
    # and the split stream is the unsplit one
    with torch.no_grad():
        ref = _model(slow_decay=True)(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                                      cu_seqlens=batch["cu_seqlens"])
    assert torch.allclose(logits[0], ref, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------- training runs

# fp32 runs: the spans sum the same terms in another order (the state fold, the gradients over ranks), so losses
# and gradients differ by rounding, bounded by helpers.fp32_rtol (GatedDeltaNet's decay, whose gradient sums
# products of exponentials over every token and head, is the farthest tensor: 4e-5 observed after 2 steps,
# against a per-tensor bound of 1.9e-4). Parameters after AdamW are not compared: its first steps move an element
# by lr whatever its gradient's size, so rounding in a near-zero gradient element becomes a full update (4.8e-4
# relative on a_proj here). A lost state or halo moves gradients by 1e-2 and more.


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process: the parity run (3 steps, 4 microbatches of 1, fp32), with its last step's gradients."""
    (result,) = run_distributed(train_with_grads, 1, parity_overrides(tmp_path_factory.mktemp("reference") / "ref"))
    return result


def assert_same_run(result, reference, grads_after: int | None = None):
    """Every step's loss, and the recorded gradients, taken after `grads_after` AdamW steps (default: the last
    step's), within fp32 rounding of the reference's."""
    for step, (a, b) in enumerate(zip(result.losses, reference.losses, strict=True)):
        assert_within(f"step {step + 1}'s loss", abs(a - b) / abs(b), fp32_rtol(step))
    steps = len(reference.losses) - 1 if grads_after is None else grads_after
    assert_same_tensors(result.grads, reference.grads, fp32_rtol(steps), "gradients")


@pytest.mark.slow
@pytest.mark.parametrize("extra", [
    # cp4 trains in test_checkpoint_resumes_on_another_cp, and its math is checked above in fp64
    ["mesh.cp=2", "mesh.tp=2"],
    # stages pass a span's hidden states; every stage cuts its positions from the whole microbatch's
    ["mesh.cp=2", "mesh.pp=2", "pipeline.reduce_grad_per_microbatch=true"],
    # zero-bubble: the backward split into input and weight gradients, the exchanges' backward in the first
    ["mesh.cp=2", "mesh.pp=2", "pipeline.schedule=zbv"],
    # the exchanges run again, in the same order on every rank, when the backward recomputes a layer
    ["mesh.cp=2", "mesh.dp=2", "pipeline.reduce_grad_per_microbatch=true", "model.activation_checkpointing=true"],
    # contiguous spans' attention (the others run by halves, the default), under the recompute too
    ["mesh.cp=2", "mesh.cp_balanced_attention=false", "model.activation_checkpointing=true"],
], ids=["cp2-tp2", "cp2-pp2-knob", "cp2-pp2-zbv", "cp2-dp2-knob-ac", "cp2-contiguous-ac"])
def test_training_equals_one_process(tmp_path, reference, extra):
    world = 1
    for key in extra:
        if key.startswith(("mesh.cp=", "mesh.dp=", "mesh.tp=", "mesh.pp=")):
            world *= int(key.split("=")[1])
    results = run_distributed(train_with_grads, world, parity_overrides(tmp_path / "run", *extra))
    for result in results:
        assert_same_run(result, reference)


@pytest.mark.parametrize("extra, message", [
    (["mesh.cp=2", "mesh.tp=2", "mesh.sequence_parallel=true"], "mesh.cp=2 with mesh.sequence_parallel=true"),
    (["mesh.cp=2", "model.kernels.gdn=fla"], "mesh.cp=2 with this flash-linear-attention has no context-parallel"),
    # spans of 2 tokens (8 / 4), the conv reaching 3 rows back; 9 tokens make spans of 3 (the stream padded to 12)
    (["mesh.cp=4", "data.seq_len=8"], "mesh.cp=4 with data.seq_len=8: a span of 2 tokens (train.micro_batch_size x "
                                      "data.seq_len / mesh.cp) is shorter than the 3 rows GatedDeltaNet's conv reads "
                                      "from the span before; valid: data.seq_len >= 9 (or mesh.cp=1)"),
])
def test_unsupported_combinations_fail_in_one_line(tmp_path, monkeypatch, extra, message):
    """Refused before anything is built (the spec a run and `qwenft plan` resolve), as on a CUDA machine whose
    fla predates its context-parallel kernels."""
    from qwenft.conf.layout import resolve_layout
    from qwenft.train import spec
    from qwenft.train.spec import resolve_spec

    from helpers import compose, model_config

    monkeypatch.setattr(spec, "_fla_has_cp", lambda: False)

    cfg = compose(parity_overrides(tmp_path, *extra))
    with pytest.raises(ValueError) as info:
        m = cfg.mesh
        layout = resolve_layout(m.tp, m.pp, 1, m.tp * m.pp * max(m.cp, 1), ep=m.ep, cp=m.cp)
        resolve_spec(cfg, layout, model_config(cfg), "cuda")
    assert len(str(info.value).splitlines()) == 1 and message in str(info.value), str(info.value)


def test_a_step_counts_each_token_once(tmp_path):
    """cp ranks share a row's tokens: a step's tokens (metrics' tokens/s) are the global batch's, and the batch is
    split over dp alone, whatever cp is."""
    from qwenft.conf.layout import resolve_layout
    from qwenft.train.spec import resolve_spec

    from helpers import compose, model_config

    specs = {}
    for cp, dp in ((1, 1), (2, 1), (4, 2)):
        cfg = compose(parity_overrides(tmp_path, f"mesh.cp={cp}", f"mesh.dp={dp}", "train.micro_batch_size=1"))
        specs[cp] = resolve_spec(cfg, resolve_layout(1, 1, dp, cp * dp, cp=cp), model_config(cfg), "cpu")
    for cp, dp in ((1, 1), (2, 1), (4, 2)):
        b = specs[cp].batching
        assert b.tokens_per_step == b.global_batch_size * b.seq_len == specs[1].batching.tokens_per_step
        assert b.microbatch_size * b.num_microbatches * dp == b.global_batch_size, (cp, b)
        assert specs[cp].layout.world_size == cp * dp


@pytest.mark.slow
def test_checkpoint_resumes_on_another_cp(tmp_path):
    """Saved at step 2 by cp2, resumed by cp4: steps 3 and 4 train the losses of one process that never
    stopped (DCP reshards the FSDP shards over dp x cp; every cp rank reads the same data position)."""
    from helpers import logged_losses, train

    def overrides(run_dir, max_steps, *extra):
        # warmup over all 4 steps with a constant tail: the 2-step and the 4-step runs follow one schedule
        return parity_overrides(run_dir, f"train.max_steps={max_steps}", "checkpoint.export_hf=false",
                                "lr_scheduler.warmup_steps=4", "lr_scheduler.decay=constant",
                                "checkpoint.every_steps=2", *extra)

    run_distributed(train, 1, overrides(tmp_path / "alone", 4))
    uninterrupted = logged_losses(tmp_path / "alone")
    run_distributed(train, 2, overrides(tmp_path / "cp", 2, "mesh.cp=2"))
    (result, *_) = run_distributed(train, 4, overrides(tmp_path / "cp", 4, "mesh.cp=4"))
    for got, step in zip(result.losses, (3, 4), strict=True):
        assert_within(f"step {step}'s loss", abs(got - uninterrupted[step]) / abs(uninterrupted[step]),
                      fp32_rtol(step - 1))


@pytest.mark.slow
def test_vlm_equals_one_process(tmp_path):
    """The tiny VLM at cp2 (its set's images and videos): every cp rank runs the vision tower on all of the
    microbatch's images and videos (the split comes after their features are scattered into the embeddings, so one
    crossing a span edge is whole), and its gradients come from each span's loss, summed over the spans."""
    def overrides(name, *extra):
        return ["recipe=tiny_vlm", "train.max_steps=2", "data.seq_len=256", "model.kernels.gdn=torch",
                "train.progress_bar=false", "optim.lr=5e-4", "lr_scheduler.warmup_steps=0",
                "checkpoint.export_hf=false", "train.global_batch_size=2", "train.micro_batch_size=1",
                "seed=4", f"run_dir={tmp_path / name}", *extra]  # seed 4's data order: an image on the edge

    # the first step's gradients: the set's video rows put GDN's A_log / dt_bias (sums with heavy cancellation)
    # at ~1e-5 of one process, which one AdamW step amplifies to ~5e-5 across the model
    (reference,) = run_distributed(_first_step, 1, overrides("alone"))
    assert any(name.startswith("visual.") for name in reference.grads)
    for result in run_distributed(_first_step, 2, overrides("cp2", "mesh.cp=2")):
        assert_same_run(result, reference, grads_after=0)
    # the compared step's microbatches have an image whose tokens cross the span edge (each row's 256 tokens are
    # the stream: spans of 128)
    crossing = [(start, end) for start, end in _media_runs(overrides("batches", "mesh.cp=2"), 2) if start < 128 < end]
    assert crossing, "no image or video crosses the span edge in the first step"


def _media_runs(overrides, microbatches: int) -> list[tuple[int, int]]:
    """[start, end) in the stream of each run of consecutive image or video tokens in the first `microbatches`
    microbatches that a run with these overrides trains on (every cp rank reads them all)."""
    from helpers import build_data, compose, model_config

    cfg = compose(overrides)
    model_cfg = model_config(cfg)
    media_ids = torch.tensor([model_cfg.image_token_id, model_cfg.video_token_id])
    _, data, _ = build_data(cfg, model_cfg, cfg.train.micro_batch_size, 0, 1)
    runs = []
    try:
        for batch, _ in zip(data, range(microbatches)):
            media = torch.isin(batch["input_ids"].flatten(), media_ids).int()
            edges = torch.diff(F.pad(media, (1, 1))).nonzero().flatten().tolist()
            runs += zip(edges[::2], edges[1::2])
    finally:
        data.close()
    return runs


def _first_step(rank, world_size, overrides):
    """Every step's loss and the first step's gradients (before clipping is applied to them: clipping scales by
    the norm, the same on every mesh up to rounding) of a training run on this rank."""
    import types

    from helpers import train_recording_grads

    _, losses, grads, _ = train_recording_grads(overrides)
    return types.SimpleNamespace(losses=losses, grads={k: v.float().cpu() for k, v in grads[0].items()})


@pytest.fixture(scope="module")
def moe_reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("moe") / "ref"
    (result,) = run_distributed(_first_step, 1, parity_overrides(run_dir, "model.name=tiny_moe"))
    return result


@pytest.mark.slow
@pytest.mark.parametrize("extra", [["mesh.cp=2", "mesh.dp=2", "mesh.ep=2"]], ids=["cp2-ep2"])
def test_moe_equals_one_process(tmp_path, moe_reference, extra):
    """The MoE model: each span routes its own tokens, and the router's statistics (probabilities, loads, token
    counts) are summed over the spans before the aux loss, as one process pools them; with ep the all-to-all runs
    within each span's ep group and the experts' FSDP2 unit sums over dp_outer x cp. The first step's gradients
    are compared (taken at equal parameters): at later steps the parameters differ at the rounding level
    AdamW amplifies, and a near-tied top-k choice may then flip (observed 3e-4 on GatedDeltaNet's decay at
    step 2, 2e-5 at dp2); every step's loss within fp32 rounding."""
    results = run_distributed(_first_step, 4, parity_overrides(tmp_path / "run", "model.name=tiny_moe", *extra))
    for result in results:
        assert_same_run(result, moe_reference, grads_after=0)


@pytest.mark.slow
@pytest.mark.parametrize("recipe, dp, cp, ep", [("qwen3_5_27b_128k", 2, 4, 1), ("qwen3_5_35b_a3b_128k", 4, 2, 4)])
def test_long_context_recipes_fit_one_node(recipe, dp, cp, ep):
    """The 128K recipes, chosen with the planner (their comments give the numbers): 8 ranks of dp x cp (x ep),
    rows of 131,072 tokens, every rank planned within plan.gpu_memory_gib, every parameter held once over the
    8 ranks (FSDP over dp x cp; routed experts over ep x the rest)."""
    from qwenft.conf.layout import resolve_layout
    from qwenft.models.loader import build_model
    from qwenft.train import plan as plan_lib

    from helpers import compose, model_config

    cfg = compose([f"recipe={recipe}"], missing_ok=True)
    m = cfg.mesh
    layout = resolve_layout(m.tp, m.pp, m.dp, 8, ep=m.ep, cp=m.cp)
    assert (layout.dp, layout.cp, layout.ep, cfg.data.seq_len) == (dp, cp, ep, 131072)
    plans = plan_lib.predict(cfg)
    assert [p.rank for p in plans] == list(range(8))
    assert all(p.total_bytes < cfg.plan.gpu_memory_gib * plan_lib.GIB for p in plans)
    model = build_model(model_config(cfg), device="meta")
    assert sum(p.params_owned for p in plans) == sum(p.numel() for p in model.parameters())
