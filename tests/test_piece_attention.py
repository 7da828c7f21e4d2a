"""Document pieces through a dense kernel with log-sum-exps (qwenft.models.qwen3_5.piece_attention), on the CPU's
flash kernel in fp64: output and every gradient equal masked SDPA of the same piece (the queries the keys' last)."""

import pytest
import torch
import torch.nn.functional as F

from qwenft.models.qwen3_5 import piece_attention
from qwenft.models.qwen3_5.piece_attention import attend_piece, attend_pieces


def _reference(q, k, v, scale, cu_q, cu_k):
    """Masked SDPA over the whole stream of pieces: query i of piece p sees piece p's keys up to its own."""
    lq, lk = q.shape[2], k.shape[2]
    mask = torch.zeros(lq, lk, dtype=torch.bool)
    for q0, q1, k0, k1 in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:]):
        for i in range(q1 - q0):
            mask[q0 + i, k0:k1 - (q1 - q0) + i + 1] = True
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True).transpose(1, 2)


def _inputs(lq, lk, heads=4, kv_heads=2, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda h, n: torch.randn(1, h, n, dim, generator=g, dtype=torch.float64, requires_grad=True)  # noqa: E731
    return make(heads, lq), make(kv_heads, lk), make(kv_heads, lk)


@pytest.fixture(autouse=True)
def _kernel_for_every_piece(monkeypatch):
    """Small pieces here, so that the kernel pair runs them (they are masked SDPA's in a run)."""
    monkeypatch.setattr(piece_attention, "SMALL_PIECE", 1)


@pytest.mark.parametrize("lq,lk", [(12, 12), (5, 12), (1, 9), (9, 10)])
def test_one_piece_equals_masked_sdpa(lq, lk):
    q, k, v = _inputs(lq, lk)
    scale = 0.3
    got = attend_piece(q, k, v, scale, kernel="cpu_flash")
    ref = _reference(q, k, v, scale, [0, lq], [0, lk])
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    dout = torch.randn_like(got)
    grads = torch.autograd.grad(got, (q, k, v), dout)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11)


def test_pieces_of_a_span_equal_masked_sdpa():
    """A span's pieces: the first document began before the span (fewer queries than keys), a 1-token one,
    then a whole one."""
    cu_q, cu_k = [0, 6, 7, 13], [0, 11, 12, 18]
    q, k, v = _inputs(13, 18, seed=1)
    got = attend_pieces(q, k, v, 0.25, cu_q, cu_k, kernel="cpu_flash")
    ref = _reference(q, k, v, 0.25, cu_q, cu_k)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    dout = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), dout), torch.autograd.grad(ref, (q, k, v), dout)):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11)


def test_small_pieces_take_masked_sdpa(monkeypatch):
    """Under SMALL_PIECE queries a piece is masked SDPA's (cuDNN refuses a 1 x 1 causal block): the same numbers."""
    monkeypatch.setattr(piece_attention, "SMALL_PIECE", 64)
    cu_q, cu_k = [0, 6, 7, 13], [0, 11, 12, 18]
    q, k, v = _inputs(13, 18, seed=2)
    got = attend_pieces(q, k, v, 0.25, cu_q, cu_k, kernel="cudnn")  # never reaches cuDNN: every piece is small
    torch.testing.assert_close(got, _reference(q, k, v, 0.25, cu_q, cu_k), rtol=1e-12, atol=1e-12)


@pytest.fixture
def cudnn_here(monkeypatch):
    """`model.kernels.attention=cudnn` allowed on the CPU: its pieces then run the CPU's flash kernel, the same
    math (`attention.piece_kernel`), so the wiring below runs for real."""
    from qwenft.models.qwen3_5 import attention

    monkeypatch.setattr(attention, "cudnn_ok", lambda device, dtype: True)


def _grads(out, inputs, dout):
    return [out, *torch.autograd.grad(out, inputs, dout)]


def test_packed_rows_by_pieces_equal_the_dense_mask(cudnn_here):
    """attention.attend with cudnn on two packed rows of documents of 1 to 70 tokens (offsets into the flattened
    rows, as batches carry them) equals SDPA with the block-diagonal mask."""
    from qwenft.models.qwen3_5.attention import attend
    from qwenft.models.qwen3_5.varlen import to_device

    B, T, heads, kv_heads, dim = 2, 80, 4, 2, 16
    cu = to_device(torch.tensor([0, 70, 71, 73, 80, 100, 160]), torch.device("cpu"))
    g = torch.Generator().manual_seed(3)
    make = lambda h: torch.randn(B, h, T, dim, generator=g, dtype=torch.float64, requires_grad=True)  # noqa: E731
    q, k, v = make(heads), make(kv_heads), make(kv_heads)
    dout = torch.randn(B, T, heads, dim, generator=g, dtype=torch.float64)
    got = _grads(attend(q, k, v, 0.25, cu, kernel="cudnn"), (q, k, v), dout)
    want = _grads(attend(q, k, v, 0.25, cu, kernel="sdpa"), (q, k, v), dout)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("balanced", [False, True])
def test_context_parallel_ranges_by_pieces_equal_the_dense_mask(cudnn_here, balanced):
    """context_parallel.attend_span with cudnn over every range a cp4 rank attends (its span, or its two halves
    under mesh.cp_balanced_attention), on a stream with a document over three spans, one ending at a span edge
    and 1-2 token ones, equals its masked SDPA path."""
    from qwenft.models.qwen3_5.context_parallel import CPShard, attend_span

    cp, total, heads, kv_heads, dim = 4, 96, 4, 2, 16
    cu = torch.tensor([0, 2, 60, 72, 73, 75, 96])
    g = torch.Generator().manual_seed(4)
    keys, values = (torch.randn(1, kv_heads, total, dim, generator=g, dtype=torch.float64, requires_grad=True)
                    for _ in range(2))
    for rank in range(cp):
        shard = CPShard(None, rank, cp, total, cu, torch.device("cpu"), balanced=balanced)
        ranges = [shard.half(h) for h in shard.computes(rank)] if balanced else [(shard.start, shard.end)]
        for start, end in ranges:
            q = torch.randn(1, heads, end - start, dim, generator=g, dtype=torch.float64, requires_grad=True)
            dout = torch.randn(1, end - start, heads, dim, generator=g, dtype=torch.float64)
            got, want = (_grads(attend_span(q, keys, values, 0.25, shard, start, end, kernel), (q, keys, values), dout)
                         for kernel in ("cudnn", "sdpa"))
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("mode", ["true", "selective"])
def test_pieces_under_activation_checkpointing(cudnn_here, mode):
    """The tiny decoder with attention by pieces on a packed row: under checkpointing (selective keeps the piece
    kernels' outputs and its recompute takes them back in call order) the gradients equal no checkpointing's."""
    from qwenft.distributed.activation_checkpointing import apply_activation_checkpointing
    from qwenft.models.loader import build_model, init_random_weights
    from qwenft.models.qwen3_5.configs import named_config

    cfg = named_config("tiny")
    ids = torch.randint(0, cfg.text.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    cu = torch.tensor([0, 5, 40, 41, 64])
    grads = []
    for checkpointed in (False, True):
        model = init_random_weights(build_model(cfg, kernels="torch", head=False, attention_kernel="cudnn"), seed=1,
                                    device="cpu", dtype=torch.float64)
        if checkpointed:
            apply_activation_checkpointing(model, mode)
        model(input_ids=ids, cu_seqlens=cu).square().mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-12, atol=1e-12, msg=name)
