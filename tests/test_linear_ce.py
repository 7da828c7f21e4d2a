"""Chunked linear cross-entropy (model.ce_chunk_tokens) against the whole-logits CE (fp32, CPU)."""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard

from distributed import run_distributed
from helpers import rel_err
from qwenft.models.linear_ce import chunked_linear_ce_sum
from qwenft.models.loader import build_model, init_random_weights
from qwenft.models.qwen3_5.configs import named_config
from qwenft.models.loss import token_ce_sum


def _inputs(n=37, hidden=24, vocab=1000, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=gen)
    w = torch.randn(vocab, hidden, generator=gen) * 0.3
    labels = torch.randint(0, vocab, (n,), generator=gen)
    labels[::3] = -100  # tokens without a label
    return h, w, labels


@pytest.mark.parametrize("chunk", [1, 8, 37, 64])
def test_loss_and_grads_equal_whole_logits(chunk):
    h, w, labels = _inputs()
    h_ref, w_ref = h.clone().requires_grad_(), w.clone().requires_grad_()
    ref = F.cross_entropy((h_ref @ w_ref.t()).float(), labels, ignore_index=-100, reduction="sum")
    (ref * 0.7).backward()  # a non-unit upstream gradient (the runner divides by the label count)

    h_c, w_c = h.clone().requires_grad_(), w.clone().requires_grad_()
    out = chunked_linear_ce_sum(h_c, w_c, labels, chunk)
    (out * 0.7).backward()

    assert abs(out.item() - ref.item()) <= 1e-6 * abs(ref.item())
    assert rel_err(h_c.grad, h_ref.grad) < 1e-6
    assert rel_err(w_c.grad, w_ref.grad) < 1e-6
    assert (h_c.grad[::3] == 0).all()  # no gradient from unlabelled tokens


def test_all_tokens_ignored_gives_zero_loss_and_grads():
    h, w, labels = _inputs()
    labels[:] = -100
    h.requires_grad_()
    w.requires_grad_()
    out = chunked_linear_ce_sum(h, w, labels, 8)
    out.backward()
    assert out.item() == 0 and not h.grad.any() and not w.grad.any()


@pytest.mark.parametrize("tied", [False, True])
def test_model_labels_path_equals_logits_path(tied):
    """Qwen3_5Model(ce_chunk_tokens=N)(..., labels=) gives the CE sum and every parameter's gradient of the
    logits path (full logits + token_ce_sum). In fp64, so that the comparison of the deepest parameters is not
    drowned in fp32 noise (in fp32 GDN's A_log grads of the two paths differ by up to 8e-5 from rounding)."""
    import dataclasses

    cfg = dataclasses.replace(named_config("tiny"), tie_word_embeddings=tied)
    ref_model, model = (init_random_weights(build_model(cfg, kernels="torch", device="meta", ce_chunk_tokens=chunk),
                                            seed=3, device="cpu", dtype=torch.float64) for chunk in (0, 48))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.text.vocab_size, (2, 80), generator=gen)
    labels = torch.randint(0, cfg.text.vocab_size, (2, 80), generator=gen)
    labels[:, :20] = -100

    ref = token_ce_sum(ref_model(input_ids=ids), labels)
    ref.backward()
    out = model(input_ids=ids, labels=labels)
    out.backward()
    assert out.dtype == torch.float32  # the CE is fp32 like token_ce_sum's, whatever the compute dtype
    assert abs(out.item() - ref.item()) <= 1e-6 * abs(ref.item())
    ref_grads = dict(ref_model.named_parameters())
    for name, p in model.named_parameters():
        assert rel_err(p.grad, ref_grads[name].grad) < 1e-6, name


def _tiny_batch(cfg):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.text.vocab_size, (2, 80), generator=gen)
    labels = torch.randint(0, cfg.text.vocab_size, (2, 80), generator=gen)
    labels[:, :20] = -100
    return ids, labels


def _fsdp_chunked_grads(rank, world_size):
    """FSDP2 over 2 ranks with lm_head as its own unit: the head's forward all-gathers its weight, so the
    chunked CE sees the whole vocabulary. Same batch on both ranks: FSDP's mean of the grads is the grad."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    cfg = named_config("tiny")
    mesh = init_device_mesh("cpu", (world_size,))
    model = build_model(cfg, kernels="torch", device="meta", dtype=torch.float64, ce_chunk_tokens=48)
    fully_shard(model.lm_head, mesh=mesh)
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    init_random_weights(model, seed=3, device="cpu", dtype=torch.float64)
    ids, labels = _tiny_batch(cfg)
    out = model(input_ids=ids, labels=labels)
    out.backward()
    return out.item(), {n: p.grad.full_tensor() for n, p in model.named_parameters()}


@pytest.mark.distributed
def test_fsdp_sharded_head_equals_one_process():
    cfg = named_config("tiny")
    ref_model = init_random_weights(build_model(cfg, kernels="torch", device="meta"), seed=3, device="cpu",
                                    dtype=torch.float64)
    ids, labels = _tiny_batch(cfg)
    ref = token_ce_sum(ref_model(input_ids=ids), labels)
    ref.backward()
    for loss, grads in run_distributed(_fsdp_chunked_grads, 2):
        assert abs(loss - ref.item()) <= 1e-6 * abs(ref.item())
        for name, p in ref_model.named_parameters():
            assert rel_err(grads[name], p.grad) < 1e-6, name


@pytest.mark.distributed
def test_vocab_sharded_weight_is_refused_by_the_chunked_torch_ce():
    """A DTensor lm_head (vocab_parallel TP) is refused by the chunked recompute, with the keys to change."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    def body(rank, world):
        mesh = init_device_mesh("cpu", (world,))
        h, w, labels = _inputs()
        w = distribute_tensor(w, mesh, [Shard(0)])
        with pytest.raises(ValueError, match="mesh.vocab_parallel=false or model.ce_chunk_tokens=0"):
            chunked_linear_ce_sum(h, w, labels, 8)
        return True

    assert run_distributed(body, 1) == [True]


def _vocab_parallel_inputs(vocab, rows):
    """`_inputs`, with labels on the first and last id and on both sides of every shard edge (`rows` a rank)."""
    h, w, labels = _inputs(vocab=vocab)
    edges = torch.tensor(rows).cumsum(0)[:-1]
    ids = [0, vocab - 1] + [i for e in edges.tolist() for i in (e - 1, e)]
    labelled = [i for i in range(len(labels)) if i % 3][:len(ids)]  # every third token has no label
    labels[labelled] = torch.tensor(ids)
    return h, w, labels


def _vocab_parallel_fused_rank(rank, world, vocab, chunk, rows):
    """The fused CE and LMHead on `world` ranks, the head's weight Shard(0) over the vocabulary (fp32): the CE sum
    (with and without grad), the gradients of hidden and (gathered) weight, and the logits path's."""
    from torch.distributed.device_mesh import init_device_mesh

    from qwenft.distributed.tensor_parallel import shard_param
    from qwenft.models.linear_ce import LMHead, fused_linear_ce_sum

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    h, w, labels = _vocab_parallel_inputs(vocab, rows)
    head = LMHead(h.shape[1], vocab, ce_chunk_tokens=chunk, ce_kernel="fused")
    head.weight.data.copy_(w)
    shard_param(head, "weight", mesh, Shard(0))
    weight = head.weight
    out = {"local_rows": weight.to_local().shape[0]}
    h_c = h.clone().requires_grad_()
    loss = fused_linear_ce_sum(h_c, weight, labels, chunk)
    (loss * 0.7).backward()
    out.update(loss=loss.item(), grad_hidden=h_c.grad, grad_weight=weight.grad.full_tensor(),
               grad_placements=(weight.grad.placements, weight.grad.to_local().shape) ==
               (weight.placements, weight.to_local().shape))
    with torch.no_grad():  # evaluation: the loss alone
        out["eval_loss"] = fused_linear_ce_sum(h, weight, labels, chunk).item()
    hits, top = torch.zeros((), dtype=torch.long), _argmax_labels(h, w, labels)
    fused_linear_ce_sum(h.clone().requires_grad_(), weight, top, chunk, hits)
    out["hits"] = (hits.item(), _hits(h, w, top))
    # LMHead on [B, T, H]: labels give the CE sum; without, the logits as a DTensor sharded on the vocabulary
    weight.grad = None
    h_c = h.clone().view(1, *h.shape).requires_grad_()
    out["head_loss"] = head(h_c, labels.view(1, -1)).item()
    logits = head(h_c)
    out["logits_placements"] = logits.placements
    (token_ce_sum(logits, labels.view(1, -1)) * 0.7).backward()
    out.update(logits=logits.full_tensor().detach()[0], logits_grad_hidden=h_c.grad[0],
               logits_grad_weight=weight.grad.full_tensor())
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("vocab, chunk, rows", [(1000, 0, [500, 500]), (999, 8, [500, 499]),
                                               (1000, 37, [334, 334, 332]), (999, 64, [500, 499])])
def test_vocab_parallel_fused_equals_whole_logits(vocab, chunk, rows):
    """The fused CE on a head sharded over the vocabulary (even and uneven shards: 999 = 500 + 499, 1000 = 334 +
    334 + 332), chunked or not, against F.cross_entropy of the whole fp32 logits: the CE sum, d hidden (summed
    over tp) and d weight (each rank its own rows, Shard(0) like the weight); LMHead's logits path too."""
    h, w, labels = _vocab_parallel_inputs(vocab, rows)
    h_ref, w_ref = h.clone().requires_grad_(), w.clone().requires_grad_()
    logits_ref = h_ref @ w_ref.t()
    ref = F.cross_entropy(logits_ref.float(), labels, ignore_index=-100, reduction="sum")
    (ref * 0.7).backward()
    outs = run_distributed(_vocab_parallel_fused_rank, len(rows), vocab, chunk, rows)
    assert [o["local_rows"] for o in outs] == rows
    for out in outs:
        for key in ("loss", "eval_loss", "head_loss"):
            assert abs(out[key] - ref.item()) <= 1e-6 * abs(ref.item()), key
        assert out["grad_placements"]
        assert out["hits"][0] == out["hits"][1] > 0
        assert out["logits_placements"] == (Shard(2),)
        assert rel_err(out["logits"], logits_ref.detach()) < 1e-6
        # fp32: the fused d hidden is 3.9e-7 off the reference's (measured), as on one rank
        for key in ("grad_hidden", "logits_grad_hidden"):
            assert rel_err(out[key], h_ref.grad) < 1e-5, key
            assert (out[key][::3] == 0).all()
        for key in ("grad_weight", "logits_grad_weight"):
            assert rel_err(out[key], w_ref.grad) < 1e-5, key


@pytest.mark.parametrize("chunk", [0, 1, 8, 37, 64])
def test_fused_loss_and_grads_equal_whole_logits(chunk):
    """model.kernels.ce=fused (gradients formed in the forward; its torch ops on the CPU) = the whole-logits CE."""
    from qwenft.models.linear_ce import fused_linear_ce_sum

    h, w, labels = _inputs()
    h_ref, w_ref = h.clone().requires_grad_(), w.clone().requires_grad_()
    ref = F.cross_entropy((h_ref @ w_ref.t()).float(), labels, ignore_index=-100, reduction="sum")
    (ref * 0.7).backward()

    h_c, w_c = h.clone().requires_grad_(), w.clone().requires_grad_()
    out = fused_linear_ce_sum(h_c, w_c, labels, chunk)
    (out * 0.7).backward()

    assert abs(out.item() - ref.item()) <= 1e-6 * abs(ref.item())
    assert rel_err(h_c.grad, h_ref.grad) < 1e-6
    assert rel_err(w_c.grad, w_ref.grad) < 1e-6
    assert (h_c.grad[::3] == 0).all()
    with torch.no_grad():  # evaluation: the loss alone, nothing kept
        assert abs(fused_linear_ce_sum(h, w, labels, chunk).item() - ref.item()) <= 1e-6 * abs(ref.item())


def test_fused_bf16_gradients_round_once_from_fp32():
    """In bf16 the fused head's gradients are the fp32 ones rounded once, like the unfused head's backward:
    within bf16 rounding of an fp64 computation, and the upstream gradient (1/3001, not a power of two) is
    applied in fp32, not rounded to bf16 first (that alone would scale every gradient by 1 + 1.7e-3)."""
    from qwenft.models.linear_ce import fused_linear_ce_sum

    h, w, labels = _inputs(n=64, hidden=32, vocab=3000)
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    scale = 1.0 / 3001
    (F.cross_entropy(h64 @ w64.t(), labels, ignore_index=-100, reduction="sum") * scale).backward()
    hb, wb = h.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
    (fused_linear_ce_sum(hb, wb, labels) * torch.tensor(scale)).backward()
    for ours, ref in ((hb.grad, h64.grad), (wb.grad, w64.grad)):
        assert rel_err(ours, ref) < 1e-2
        # no common factor off 1: the least-squares scale between ours and fp64 is 1 to well under a bf16 ulp
        fit = (ours.double() * ref).sum() / (ref * ref).sum()
        assert abs(fit.item() - 1) < 5e-4


@pytest.mark.parametrize("tied", [False, True])
def test_fused_model_labels_path_equals_logits_path(tied):
    """Qwen3_5Model(ce_kernel="fused")(..., labels=): the CE sum and every gradient of the logits path (fp64)."""
    import dataclasses

    cfg = dataclasses.replace(named_config("tiny"), tie_word_embeddings=tied)
    ref_model, model = (init_random_weights(build_model(cfg, kernels="torch", device="meta", ce_kernel=kernel),
                                            seed=3, device="cpu", dtype=torch.float64)
                        for kernel in ("torch", "fused"))
    ids, labels = _tiny_batch(cfg)
    ref = token_ce_sum(ref_model(input_ids=ids), labels)
    ref.backward()
    out = model(input_ids=ids, labels=labels)
    out.backward()
    assert abs(out.item() - ref.item()) <= 1e-6 * abs(ref.item())
    ref_grads = dict(ref_model.named_parameters())
    for name, p in model.named_parameters():
        assert rel_err(p.grad, ref_grads[name].grad) < 1e-6, name


def _argmax_labels(h, w, labels):
    """`labels` with every other labelled token's label set to its logits' argmax, so that top-1 hits exist."""
    out = labels.clone()
    labelled = (labels != -100).nonzero()[::2, 0]
    out[labelled] = (h @ w.t())[labelled].argmax(-1)
    return out


def _hits(h, w, labels) -> int:
    return int((((h @ w.t()).argmax(-1) == labels) & (labels != -100)).sum())


@pytest.mark.parametrize("kernel, chunk", [("torch", 0), ("torch", 8), ("fused", 0), ("fused", 37)])
def test_every_head_ce_counts_the_top1_hits(kernel, chunk):
    """`LMHead.ce_sum`'s `hits` (the MTP head's accuracy) on each CE path, with and without grad: the labelled
    tokens whose label is the logits' argmax; its CE sum as the whole-logits CE."""
    from qwenft.models.linear_ce import LMHead

    h, w, labels = _inputs()
    labels = _argmax_labels(h, w, labels)
    head = LMHead(h.shape[1], w.shape[0], ce_chunk_tokens=chunk, ce_kernel=kernel)
    head.weight.data.copy_(w)
    ref = F.cross_entropy((h @ w.t()).float(), labels, ignore_index=-100, reduction="sum")
    for grad in (True, False):
        hits = torch.zeros((), dtype=torch.long)
        with torch.set_grad_enabled(grad):
            loss = head.ce_sum(h.clone().requires_grad_(grad), labels, head.weight, hits)
        assert abs(loss.item() - ref.item()) <= 1e-6 * abs(ref.item())
        assert hits.item() == _hits(h, w, labels) > 0
