"""Tensor parallelism against one process on the same checkpoint (fp32, CPU gloo on forked ranks).

tp2 (vocab-parallel on and off, with and without FSDP on top), tp2 x dp2 with FSDP2, three AdamW steps with
clipping, and the VLM with an image: logits, loss, grad norm and every parameter's gradient (gathered with
`full_tensor()`) match the unsharded model, which runs in the pytest process with torch's own
`clip_grad_norm_` and the whole logits' CE. With model.kernels.ce=fused (its torch ops on the CPU) the tp ranks'
head returns the CE sum itself, as the runner asks for it, and its logits in a forward of their own.
"""

import math

import pytest
import torch
from torch.distributed.tensor import DTensor

from distributed import run_distributed
from helpers import PATCH_DIM, assert_within, fp32_rtol, save_random_checkpoint, tiny_vlm, vlm_row
from qwenft.models.loader import build_model, load_hf_weights
from qwenft.models.qwen3_5.configs import config_from_hf_dir, named_config
from qwenft.models.qwen3_5.gdn import positions_in_document
from qwenft.models.loss import count_label_tokens, token_ce_sum
from qwenft.train.optim import build_optimizer


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp(min=1e-12)).item()


def _save_checkpoint(cfg, path):
    """Norms perturbed: zero / one initialised norms would hide a sharded-norm mistake."""
    return save_random_checkpoint(cfg, path, seed=0, perturb_norms=True)


@pytest.fixture(scope="module")
def text_ckpt(tmp_path_factory):
    return _save_checkpoint(named_config("tiny"), tmp_path_factory.mktemp("tp_text"))


@pytest.fixture(scope="module")
def tied_odd_vocab_ckpt(tmp_path_factory):
    cfg = named_config("tiny")
    cfg.text.vocab_size = 511  # what a tokenizer-sized vocab can look like: uneven vocab shards
    cfg.tie_word_embeddings = True  # as 0.8b: embed_tokens and lm_head share one vocab-sharded DTensor
    return _save_checkpoint(cfg, tmp_path_factory.mktemp("tp_odd_vocab"))


@pytest.fixture(scope="module")
def attention_bias_ckpt(tmp_path_factory):
    cfg = named_config("tiny")
    cfg.text.attention_bias = True  # q/k/v biases sharded with their heads, o_proj's added once before the sum
    return _save_checkpoint(cfg, tmp_path_factory.mktemp("tp_attention_bias"))


@pytest.fixture(scope="module")
def vlm_ckpt(tmp_path_factory):
    return _save_checkpoint(tiny_vlm(), tmp_path_factory.mktemp("tp_vlm"))


def text_batch(steps=1):
    """Per step: two packed rows of 16 tokens, four documents, a few ignored labels."""
    cu = torch.tensor([0, 5, 16, 23, 32], dtype=torch.int32)
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(steps):
        input_ids = torch.randint(1, 500, (2, 16), generator=gen)
        labels = torch.randint(0, 512, (2, 16), generator=gen)
        labels.view(-1)[cu[1:] - 1] = -100  # each document's last position
        labels[0, 2] = -100
        batches.append(dict(input_ids=input_ids, labels=labels, cu_seqlens=cu,
                            position_ids=positions_in_document(cu, 32).view(2, 16)))
    return batches


def _row(batch, r):
    """Row r of a text batch as its own microbatch (the data-parallel share of rank r)."""
    cu = batch["cu_seqlens"].tolist()
    starts = [c - 16 * r for c in cu if 16 * r <= c <= 16 * (r + 1)]
    return dict(input_ids=batch["input_ids"][r:r + 1], labels=batch["labels"][r:r + 1],
                position_ids=batch["position_ids"][r:r + 1], cu_seqlens=torch.tensor(starts, dtype=torch.int32))


def _forward_kwargs(batch):
    return {k: v for k, v in batch.items() if k != "labels"}


def _label_tokens(batches):
    """Each step's loss is divided by the label tokens of the whole (global) batch, as the runner does."""
    return [count_label_tokens(b["labels"]) for b in batches]


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _train(model, batches, clip, max_norm, lr, label_tokens, dp_group=None):
    """Forward + backward (+ clip + AdamW step when lr) per batch; returns per-step logits, loss, grad norm,
    grads (of the first step: later steps' grads also carry the last-bit differences of the updated
    parameters) and the final parameters, all unsharded. A fused-CE head computes the loss from the labels (the
    runner's `ce_in_model`); its logits come from a forward without grad."""
    ce_in_model = model.lm_head.ce_kernel == "fused"
    # eps 1e-6, not 1e-8: Adam turns a gradient element at rounding-noise level into a +-lr step, so with
    # 1e-8 one element of embed_tokens whose step-3 grad is 8e-9 (one process) vs -2.6e-8 (tp2; its row's
    # grads are ~1e-2) moved 3e-4 apart. Larger eps keeps that noise from deciding the update's sign.
    # qwenft's optimizer (torch's AdamW, fp32): without FSDP2 it keeps DTensor and plain parameters apart
    opt = build_optimizer(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.999), eps=1e-6,
                          fused="false") if lr else None
    out = dict(logits=[], loss=[], grad_norm=[])
    for batch, n_labels in zip(batches, label_tokens):
        if ce_in_model:
            with torch.no_grad():
                logits = model(**_forward_kwargs(batch))
            loss = model(**_forward_kwargs(batch), labels=batch["labels"]) / n_labels
        else:
            logits = model(**_forward_kwargs(batch))
            loss = token_ce_sum(logits, batch["labels"]) / n_labels
        loss.backward()
        total = loss.detach().clone()
        if dp_group is not None:
            torch.distributed.all_reduce(total, group=dp_group)
        out["loss"].append(total.item())
        out["logits"].append(_full(logits).detach())
        out["logits_type"] = type(logits).__name__
        out["grad_norm"].append(_full(clip(model.parameters(), max_norm)).item())
        out.setdefault("grads", {n: _full(p.grad).detach().clone() for n, p in model.named_parameters()})
        # every rank's own .grad must be the full gradient of what it holds, not a partial sum
        out.setdefault("partial_grads", [n for n, p in model.named_parameters()
                                         if hasattr(p.grad, "placements") and any(pl.is_partial() for pl in p.grad.placements)])
        # ... and have its parameter's placement: without FSDP2 the optimizer steps the local shards of both
        out.setdefault("misplaced_grads", [n for n, p in model.named_parameters() if hasattr(p, "placements")
                                           and (p.grad.placements != p.placements
                                                or p.grad.to_local().shape != p.to_local().shape)])
        if opt:
            opt.step()
            opt.zero_grad()
    out["params"] = {n: _full(p).detach().clone() for n, p in model.named_parameters()}
    return out


def reference(path, batches, max_norm=math.inf, lr=0.0):
    model = load_hf_weights(build_model(config_from_hf_dir(path), kernels="torch"), path, device="cpu")
    return _train(model, batches, torch.nn.utils.clip_grad_norm_, max_norm, lr, _label_tokens(batches))


def _tp_rank(rank, world_size, path, batches, dp, vocab_parallel, fsdp, max_norm=math.inf, lr=0.0,
             sequence_parallel=False, activation_checkpointing=False, ce_kernel="torch", compile_layers=False):
    from torch._dynamo.utils import counters
    from torch.distributed.device_mesh import init_device_mesh

    from qwenft.distributed.parallelize import apply_compile, parallelize
    from qwenft.distributed.tensor_parallel import apply_tp, clip_grad_norm_, validate_tp

    mesh = init_device_mesh("cpu", (1, dp, world_size // dp), mesh_dim_names=("pp", "dp", "tp"))
    cfg = config_from_hf_dir(path)
    validate_tp(cfg.text, mesh["tp"].size())
    model = build_model(cfg, kernels="torch", ce_kernel=ce_kernel)
    if fsdp:
        parallelize(model, mesh, param_dtype=torch.float32, vocab_parallel=vocab_parallel,
                    sequence_parallel=sequence_parallel, activation_checkpointing=activation_checkpointing,
                    compile_layers=compile_layers)
    else:
        apply_tp(model, mesh["tp"], vocab_parallel=vocab_parallel, sequence_parallel=sequence_parallel)
        if compile_layers:
            apply_compile(model)
    sharded = [model.layers["3"].self_attn.q_proj.weight, model.layers["0"].linear_attn.conv_v]
    if vocab_parallel:
        sharded.append(model.lm_head.weight)
    for p in sharded:  # really split over tp (and dp under FSDP), before any weight is read
        assert p.to_local().shape[0] <= -(-p.shape[0] // world_size), p.shape
    tokens_seen = []  # by a norm between blocks: T/tp per rank under sequence parallelism
    model.layers["0"].post_attention_layernorm.register_forward_pre_hook(
        lambda m, args: tokens_seen.append(args[0].shape[1]))
    load_hf_weights(model, path, device="cpu")
    label_tokens = _label_tokens(batches)
    if dp > 1:
        batches = [_row(b, mesh["dp"].get_local_rank()) for b in batches]
    counters.clear()
    out = _train(model, batches, clip_grad_norm_, max_norm, lr, label_tokens, mesh["dp"].get_group())
    seq = batches[0]["input_ids"].shape[1]
    assert set(tokens_seen) == {seq // mesh["tp"].size() if sequence_parallel else seq}, tokens_seen
    out["graph_breaks"] = dict(counters["graph_break"])  # compiled: each layer's pieces traced whole
    return out


def assert_same(out, ref, logits=True):
    """Each step's loss, grad norm and logits within fp32_rtol of one process's for the AdamW steps before it; the
    first step's gradients of every parameter within it too, each tensor on its own."""
    for step, (a, b) in enumerate(zip(out["loss"], ref["loss"])):
        assert_within(f"step {step + 1}'s loss", abs(a - b) / abs(b), fp32_rtol(step))
    for step, (a, b) in enumerate(zip(out["grad_norm"], ref["grad_norm"])):
        assert_within(f"step {step + 1}'s grad norm", abs(a - b) / abs(b), fp32_rtol(step))
    if logits:
        for step, (a, b) in enumerate(zip(out["logits"], ref["logits"])):
            assert_within(f"step {step + 1}'s logits", rel(a, b), fp32_rtol(step))
    assert out["grads"].keys() == ref["grads"].keys()
    assert out["partial_grads"] == []
    assert out["misplaced_grads"] == []
    for name, g in ref["grads"].items():
        assert g.norm() > 0, name
        # GDN's A_log / dt_bias grads sum over every token with heavy cancellation (tests/test_model_vlm.py):
        # a different summation order alone moves them by up to 2.3e-5 (measured, vocab 511)
        tol = fp32_rtol(per_tensor=name.endswith(("A_log", "dt_bias")))
        assert_within(f"step 1's gradient of {name}", rel(out["grads"][name], g), tol)


@pytest.mark.distributed
@pytest.mark.parametrize("vocab_parallel, fsdp, sequence_parallel, ce_kernel, compile_layers", [
    (True, False, False, "torch", False), (False, True, False, "torch", False), (True, True, True, "torch", False),
    (False, False, True, "torch", False), (True, False, False, "fused", False), (True, True, True, "fused", False),
    (False, False, False, "fused", False), (True, True, True, "fused", True)])
def test_tp2_logits_loss_grads(text_ckpt, vocab_parallel, fsdp, sequence_parallel, ce_kernel, compile_layers):
    batches = text_batch()
    ref = reference(text_ckpt, batches)
    # the FSDP cases also recompute each layer (activation checkpointing), as parallelize orders it; compiled:
    # the graphs trace the sequence-parallel block hooks, collectives included, without a graph break, and take
    # the parameters' local tensors under FSDP2
    for out in run_distributed(_tp_rank, 2, text_ckpt, batches, 1, vocab_parallel, fsdp, math.inf, 0.0,
                               sequence_parallel, fsdp, ce_kernel, compile_layers):
        assert_same(out, ref)
        assert out["logits_type"] == ("DTensor" if vocab_parallel else "Tensor")
        assert out["graph_breaks"] == {}, out["graph_breaks"]


@pytest.mark.distributed
@pytest.mark.parametrize("fsdp, sequence_parallel, compile_layers", [
    (False, False, False), (False, True, False), (True, True, False), (False, False, True), (True, True, True)])
def test_tp2_attention_biases(attention_bias_ckpt, fsdp, sequence_parallel, compile_layers):
    """q/k/v biases sharded with their heads; o_proj's replicated and added once, to rank 0's partial output
    before the ranks' outputs are summed (FSDP: with activation checkpointing, so the recompute adds it too).
    model.compile's graphs see the biases as local tensors."""
    batches = text_batch()
    ref = reference(attention_bias_ckpt, batches)
    assert ref["grads"]["layers.3.self_attn.o_proj.bias"].norm() > 0
    for out in run_distributed(_tp_rank, 2, attention_bias_ckpt, batches, 1, True, fsdp, math.inf, 0.0,
                               sequence_parallel, fsdp, "torch", compile_layers):
        assert_same(out, ref)
        assert out["graph_breaks"] == {}, out["graph_breaks"]


@pytest.mark.distributed
@pytest.mark.parametrize("fsdp, ce_kernel", [(True, "torch"), (False, "torch"), (True, "fused"), (False, "fused")])
def test_tp2_vocab_parallel_tied_uneven_vocab(tied_odd_vocab_ckpt, fsdp, ce_kernel):
    """Without FSDP2 the tied matrix's gradient is what the vocab-parallel head and embedding leave on it: both
    this rank's rows (assert_same checks its placement and shape), from ColwiseParallel's DTensor logits or the
    fused CE's local rows."""
    batches = text_batch()
    batches[0]["labels"][0, 3] = 510  # the last id lives in the second, shorter shard
    batches[0]["input_ids"][0, 5] = 510  # and is looked up there too
    ref = reference(tied_odd_vocab_ckpt, batches)
    assert "lm_head.weight" not in ref["grads"]  # tied: one parameter, named embed_tokens.weight
    out = run_distributed(_tp_rank, 2, tied_odd_vocab_ckpt, batches, 1, True, fsdp, math.inf, 0.0, False, False,
                          ce_kernel)[0]
    assert_same(out, ref)


@pytest.mark.distributed
@pytest.mark.parametrize("sequence_parallel, ce_kernel", [(False, "torch"), (True, "torch"), (False, "fused")])
def test_tp2_dp2_fsdp(text_ckpt, sequence_parallel, ce_kernel):
    batches = text_batch()
    ref = reference(text_ckpt, batches)
    out = run_distributed(_tp_rank, 4, text_ckpt, batches, 2, True, True, math.inf, 0.0, sequence_parallel, False,
                          ce_kernel)[0]
    assert_same(out, ref, logits=False)  # each dp rank sees half the rows


@pytest.mark.distributed
@pytest.mark.parametrize("fsdp, sequence_parallel, ce_kernel", [
    (True, False, "torch"), (True, True, "torch"), (False, False, "torch"), (False, False, "fused"),
    (True, True, "fused")])
def test_tp2_three_adamw_steps_with_clipping(text_ckpt, fsdp, sequence_parallel, ce_kernel):
    """Without FSDP2: DTensor and plain parameters in optimizer groups of their own, the plain ones' norms counted
    once in the clip."""
    batches = text_batch(steps=3)
    ref = reference(text_ckpt, batches, max_norm=0.5, lr=5e-4)
    assert min(ref["grad_norm"]) > 0.5  # the clip is active, so a wrong norm would change the update
    out = run_distributed(_tp_rank, 2, text_ckpt, batches, 1, True, fsdp, 0.5, 5e-4, sequence_parallel, False,
                          ce_kernel)[0]
    assert_same(out, ref)
    initial = reference(text_ckpt, [])["params"]
    for name, p in ref["params"].items():
        assert not torch.equal(p, initial[name]), f"{name} did not train"
        assert_within(f"{name} after 3 steps", rel(out["params"][name], p), fp32_rtol(3, per_tensor=True))


@pytest.mark.distributed
@pytest.mark.parametrize("fsdp, sequence_parallel", [(True, False), (True, True), (False, False)])
def test_vlm_tp2_with_image(vlm_ckpt, fsdp, sequence_parallel):
    grid = torch.tensor([[1, 4, 4]])
    input_ids = torch.tensor([vlm_row([3, (1, 4, 4), 5], 16)])
    gen = torch.Generator().manual_seed(1)
    batch = dict(input_ids=input_ids, pixel_values=torch.randn(16, PATCH_DIM, generator=gen),
                 image_grid_thw=grid, labels=torch.randint(0, 400, input_ids.shape, generator=gen))
    ref = reference(vlm_ckpt, [batch])
    assert any(n.startswith("visual.") for n in ref["grads"])
    out = run_distributed(_tp_rank, 2, vlm_ckpt, [batch], 1, True, fsdp, math.inf, 0.0, sequence_parallel)[0]
    assert_same(out, ref)


@pytest.mark.parametrize("field, value, message", [
    ("linear_num_key_heads", 6, "mesh.tp=4 does not divide linear_num_key_heads=6 (GatedDeltaNet key heads)"),
    ("num_key_value_heads", 2, "mesh.tp=4 does not divide num_key_value_heads=2 (full attention key/value heads)"),
])
def test_non_divisible_heads_fail_before_building(field, value, message):
    from qwenft.distributed.tensor_parallel import validate_tp

    text = named_config("tiny").text
    setattr(text, field, value)
    if field == "linear_num_key_heads":
        text.linear_num_value_heads, text.num_key_value_heads = 12, 4
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_tp(text, 4)
    validate_tp(named_config("27b").text, 4)
    with pytest.raises(ValueError, match="num_key_value_heads=4"):
        validate_tp(named_config("27b").text, 8)


def _collectives_rank(rank, world_size, path, sequence_parallel):
    """Collectives of one forward + backward at tp2, vocab replicated: {op name: count}."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    from qwenft.distributed.tensor_parallel import apply_tp

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    model = build_model(config_from_hf_dir(path), kernels="torch")
    apply_tp(model, mesh, vocab_parallel=False, sequence_parallel=sequence_parallel)
    load_hf_weights(model, path, device="cpu")
    batch = text_batch()[0]
    with CommDebugMode() as comm:
        token_ce_sum(model(**_forward_kwargs(batch)), batch["labels"]).backward()
    # eager, the blocks run c10d's in-place collectives (allreduce_, ...); traced, the functional ones: one name
    names = {"allreduce_": "all_reduce", "_allgather_base_": "all_gather_into_tensor",
             "_reduce_scatter_base_": "reduce_scatter_tensor"}
    counts = {}
    for op, n in comm.get_comm_counts().items():
        name = str(op).split(".")[-1]
        counts[names.get(name, name)] = counts.get(names.get(name, name), 0) + n
    return counts


@pytest.mark.distributed
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tp2_one_input_reduction_per_block(text_ckpt, sequence_parallel):
    """A mixer's column-parallel projections (GDN's six, attention's three) and the MLP's two share one input:
    the backward sums their input gradients with one collective per block, as Megatron does, not one per
    projection. Per layer: the two row-parallel outputs (forward), the two block inputs (backward) and the
    replicated per-head norm weights' gradients (GDN: 1, attention: q_norm and k_norm)."""
    layer_types = config_from_hf_dir(text_ckpt).text.layer_types
    per_layer = {"linear_attention": 1, "full_attention": 2}  # the norm weights' all-reduces
    counts = run_distributed(_collectives_rank, 2, text_ckpt, sequence_parallel)[0]
    norms = sum(per_layer[t] for t in layer_types)
    n = len(layer_types)
    if sequence_parallel:
        # per layer: two all-gathers of the block inputs and two reduce-scatters of the row outputs each way;
        # the two layer norms' replicated weights see T/tp tokens (grads all-reduced); the stack's entry split
        # all-gathers in the backward, its exit all-gathers in the forward
        assert counts == {"all_reduce": 2 * n + norms, "reduce_scatter_tensor": 4 * n,
                          "all_gather_into_tensor": 4 * n + 2}, counts
    else:
        assert counts == {"all_reduce": 4 * n + norms}, counts


def _local_params_rank(rank, world_size):
    """Per call of `local` / `local_all`: this rank's .grad (after two backward passes) and torch.autograd.grad's
    result, as (local tensor, placements), with the plain-tensor reference: a Shard(0) weight's gradient is this
    rank's, a Replicate norm weight's is the sum of the ranks' local gradients."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from qwenft.models.qwen3_5.attention import local, local_all

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    weight, norm = torch.randn(4, 3), torch.randn(3)  # the same full tensors on every rank
    x = torch.randn(world_size, 2, 3)[rank]  # head-sharded activations: this rank's own

    def loss(w, n):
        return ((x * n) @ w.T).square().sum()

    plain = [weight.chunk(world_size)[rank].clone().requires_grad_(), norm.clone().requires_grad_()]
    ref_w, ref_n = torch.autograd.grad(loss(*plain), plain)
    torch.distributed.all_reduce(ref_n)
    results = {}
    for name in ("local", "local_all"):
        params = [torch.nn.Parameter(distribute_tensor(weight, mesh, [Shard(0)], src_data_rank=None)),
                  torch.nn.Parameter(distribute_tensor(norm, mesh, [Replicate()], src_data_rank=None))]
        take = (lambda: [local(p) for p in params]) if name == "local" else (lambda: local_all(params))
        for _ in range(2):  # the first makes .grad, the second adds to it
            loss(*take()).backward()
        grads = [(p.grad.to_local(), p.grad.placements) for p in params]
        taken = torch.autograd.grad(loss(*take()), params)  # towards the parameters: returned, .grad untouched
        results[name] = {"grad": grads, "taken": [(g.to_local(), g.placements) for g in taken],
                         "grad_after": [p.grad.to_local().clone() for p in params]}
    return results, (ref_w, ref_n)


@pytest.mark.distributed
def test_local_parameters_take_their_gradients_like_to_local():
    """`attention.local` and `local_all` (model.compile's graphs take their parameters through it): the local
    gradients land in `.grad` with the parameter's placement, a replicated weight's summed over the tp ranks,
    and `torch.autograd.grad` towards the parameters returns them instead (the split-backward schedules)."""
    from torch.distributed.tensor import Replicate, Shard

    for results, (ref_w, ref_n) in run_distributed(_local_params_rank, 2):
        for name, got in results.items():
            (gw, pw), (gn, pn) = got["grad"]
            assert tuple(pw) == (Shard(0),) and tuple(pn) == (Replicate(),), name
            assert rel(gw, 2 * ref_w) < 1e-6 and rel(gn, 2 * ref_n) < 1e-6, name
            (tw, tpw), (tn, tpn) = got["taken"]
            assert tuple(tpw) == (Shard(0),) and tuple(tpn) == (Replicate(),), name
            assert rel(tw, ref_w) < 1e-6 and rel(tn, ref_n) < 1e-6, name
            assert rel(got["grad_after"][0], 2 * ref_w) < 1e-6 and rel(got["grad_after"][1], 2 * ref_n) < 1e-6, name


def test_shard_extent_is_each_ranks_own():
    """attention.shard_extent caches the shard offsets per shape, mesh, rank and placements. Meshes compare equal
    across ranks, so in one process (as `qwenft plan` plays every rank) rank 0 and then rank 1 of a fake world of
    2 must each get their own shard: torch's shape and offset, on an even and an uneven split, without
    forgetting the meshes in between."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from qwenft.distributed.fake_pg import init_fake_process_group
    from qwenft.models.qwen3_5.attention import shard_extent

    seen = []
    for rank in (0, 1):
        init_fake_process_group(2, rank)
        try:
            mesh = init_device_mesh("cpu", (2,))
            for rows, dim in ((10, 0), (11, 0), (7, 1)):
                t = distribute_tensor(torch.zeros(rows, 7), mesh, [Shard(dim)])
                shape, offset = compute_local_shape_and_global_offset(t.shape, mesh, t.placements)
                assert shard_extent(t) == (tuple(shape), tuple(offset)), (rank, rows, dim)
                seen.append(shard_extent(t))
        finally:
            torch.distributed.destroy_process_group()
    assert seen[0] != seen[3]  # rank 1's offset is not rank 0's


def _clip_norm_rank(rank, world_size):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from qwenft.distributed import tensor_parallel
    from qwenft.distributed.tensor_parallel import clip_grad_norm_

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    gen = torch.Generator().manual_seed(0)  # the same full gradients on every rank
    fulls, params = [], []
    for shape, placements, dtype in (
            ((6, 5), [Shard(0), Shard(1)], torch.float64), ((7, 3), [Shard(0), Replicate()], torch.float64),  # uneven
            ((5, 4), [Replicate(), Shard(0)], torch.bfloat16), ((3,), [Replicate(), Replicate()], torch.float64),
            ((4, 2), [Shard(1), Shard(0)], torch.float64),
            ((8, 3), [_StridedShard(0, split_factor=2), Shard(0)], torch.bfloat16),  # FSDP2 over tp's rows
            ((1, 3), [Shard(0), Replicate()], torch.float64)):  # dp rank 1's shard holds no element
        full = torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)
        p = torch.nn.Parameter(distribute_tensor(torch.zeros(shape, dtype=dtype), mesh, placements))
        p.grad = distribute_tensor(full, mesh, placements)
        fulls.append(full.double())
        params.append(p)
    partial = torch.randn(4, generator=gen, dtype=torch.float64)  # tp rank t holds (t + 1) x it: the sum is 3 x it
    p = torch.nn.Parameter(distribute_tensor(torch.zeros(4, dtype=torch.float64), mesh, [Replicate(), Replicate()]))
    p.grad = DTensor.from_local(partial * (rank % 2 + 1), mesh, [Replicate(), Partial()], run_check=False)
    fulls.append(3 * partial)
    params.append(p)
    plain = torch.randn(3, 3, generator=gen, dtype=torch.float64)
    q = torch.nn.Parameter(torch.zeros(3, 3, dtype=torch.float64))
    q.grad = plain.clone()
    fulls.append(plain)
    calls = []
    all_reduce = dist.all_reduce
    tensor_parallel.dist.all_reduce = lambda *a, **k: calls.append(1) or all_reduce(*a, **k)
    out = {}
    try:
        for norm_type in (2.0, float("inf")):
            calls.clear()
            out[norm_type] = clip_grad_norm_(params + [q], max_norm=1e9, norm_type=norm_type).item(), len(calls)
    finally:
        tensor_parallel.dist.all_reduce = all_reduce
    try:
        clip_grad_norm_(params, max_norm=1.0, norm_type=0.0)
    except ValueError as e:
        out["error"] = str(e)
    return out, fulls, rank


@pytest.mark.distributed
def test_clip_grad_norm_from_local_shards():
    """clip_grad_norm_ reduces a DTensor gradient's norm from its local shard over the mesh dimensions it is
    sharded over (2-D mesh, shards on either dimension or both, FSDP2's strided shard, an uneven split, an empty
    shard, bf16 gradients, replicated copies counted once) and a partial one through DTensor: the norm of the full
    gradients, 2-norm and max, on every rank. The split groups take one all-reduce per mesh dimension they are
    split over, not DTensor's dispatch (four: (dp, tp), dp, tp)."""
    for out, fulls, rank in run_distributed(_clip_norm_rank, 4):
        flat = torch.cat([f.flatten() for f in fulls])
        # each tensor's norm is formed in fp32: within a few of its roundings of the fp64 one
        norm, calls = out[2.0]
        assert abs(norm - flat.norm().item()) < 1e-6 * flat.norm().item() and calls == 4, (rank, out)
        norm, calls = out[float("inf")]
        assert norm == flat.abs().max().float().item() and calls == 4, (rank, out)
        assert out["error"] == "clip_grad_norm_: norm_type=0.0; valid: a positive number or inf", out
