"""Document pieces through a dense kernel with log-sum-exps (qwenft.models.qwen3_5.piece_attention), on the CPU's
flash kernel in fp64: output and every gradient equal masked SDPA of the same piece (the queries the keys' last)."""

import pytest
import torch
import torch.nn.functional as F

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
