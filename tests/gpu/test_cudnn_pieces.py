"""Document pieces through cuDNN's attention with log-sum-exps (qwenft.models.qwen3_5.piece_attention) against
fp32 masked SDPA of the same pieces, at head_dim 256 in bf16: output and every gradient as close to the fp32
reference as the varlen flash kernel's (FlashAttention 2) on the same inputs."""

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _mask(cu_q, cu_k, lq, lk):
    mask = torch.zeros(lq, lk, dtype=torch.bool, device="cuda")
    for q0, q1, k0, k1 in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:]):
        n = q1 - q0
        rows = torch.arange(n, device="cuda")[:, None]
        cols = torch.arange(k1 - k0, device="cuda")[None, :]
        mask[q0:q1, k0:k1] = cols <= rows + (k1 - k0 - n)
    return mask


@pytest.mark.parametrize("cu_q,cu_k", [
    ([0, 2048], [0, 2048]),                       # one whole document
    ([0, 1000, 1001, 2048], [0, 3000, 3001, 4048]),  # a span: a piece of a document begun before it, 1 token, a whole one
])
def test_cudnn_pieces_match_fp32_as_flash_does(cu_q, cu_k):
    from qwenft.models.qwen3_5.attention import flash_varlen
    from qwenft.models.qwen3_5.piece_attention import attend_pieces

    heads, kv_heads, dim, scale = 8, 2, 256, 256**-0.5
    lq, lk = cu_q[-1], cu_k[-1]
    gen = torch.Generator(device="cuda").manual_seed(0)
    make = lambda h, n: torch.randn(1, h, n, dim, device="cuda", generator=gen).bfloat16().requires_grad_()  # noqa: E731
    q, k, v = make(heads, lq), make(kv_heads, lk), make(kv_heads, lk)
    dout = torch.randn(1, lq, heads, dim, device="cuda", generator=gen).bfloat16()

    def grads(out):
        return [out, *torch.autograd.grad(out, (q, k, v), dout)]

    ref_in = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_in, attn_mask=_mask(cu_q, cu_k, lq, lk), scale=scale,
                                         enable_gqa=True).transpose(1, 2)
    reference = [ref, *torch.autograd.grad(ref, ref_in, dout.float())]
    cudnn = grads(attend_pieces(q, k, v, scale, cu_q, cu_k, kernel="cudnn"))
    offsets = [torch.tensor(c, dtype=torch.int32, device="cuda") for c in (cu_q, cu_k)]
    longest = [max(b - a for a, b in zip(c[:-1], c[1:])) for c in (cu_q, cu_k)]
    flash_out = flash_varlen(*(t[0].transpose(0, 1) for t in (q, k, v)), scale, *offsets, *longest).unsqueeze(0)
    flash = grads(flash_out)
    for name, ours, fa2, want in zip(("out", "dq", "dk", "dv"), cudnn, flash, reference):
        err, fa2_err = _rel(ours, want), _rel(fa2, want)
        assert err < max(2 * fa2_err, 5e-3), (name, err, fa2_err)


def _against_fp32(run, inputs, dout):
    """`run(kernel, q, k, v)`'s output and input gradients for cudnn and flash_varlen on the bf16 `inputs`, and
    for sdpa on fp32 copies: the relative errors of cudnn and of flash_varlen against fp32."""
    def grads(kernel, tensors):
        out = run(kernel, *tensors)
        return [out, *torch.autograd.grad(out, tensors, dout.to(out.dtype))]

    ref = grads("sdpa", [t.detach().float().requires_grad_() for t in inputs])
    return [(_rel(a, want), _rel(b, want)) for a, b, want in zip(grads("cudnn", inputs), grads("flash_varlen", inputs),
                                                                   ref)]


def test_model_attention_by_pieces_matches_fp32_as_flash_does():
    """attention.attend and context_parallel.attend_span with model.kernels.attention=cudnn, on the layouts a
    model hands them (q, k, v transposed from [B, T, H, D]): a packed row with a 1-token and a 40-token document
    (masked SDPA's pieces) beside long ones, and the ranges a cp4 rank attends under attention by halves, as
    close to fp32 as the varlen flash kernel."""
    from qwenft.models.qwen3_5.attention import attend
    from qwenft.models.qwen3_5.context_parallel import CPShard, attend_span
    from qwenft.models.qwen3_5.varlen import to_device

    heads, kv_heads, dim, scale, T = 8, 2, 256, 256**-0.5, 8192
    gen = torch.Generator(device="cuda").manual_seed(1)
    make = lambda h, n: (torch.randn(1, n, h, dim, device="cuda", generator=gen).bfloat16()  # noqa: E731
                         .transpose(1, 2).requires_grad_())
    cu = to_device(torch.tensor([0, 3000, 3001, 3041, T]), torch.device("cuda"))
    inputs = [make(heads, T), make(kv_heads, T), make(kv_heads, T)]
    dout = torch.randn(1, T, heads, dim, device="cuda", generator=gen)
    for name, (err, fa2_err) in zip(("out", "dq", "dk", "dv"), _against_fp32(
            lambda kernel, q, k, v: attend(q, k, v, scale, cu, kernel), inputs, dout)):
        assert err < max(2 * fa2_err, 5e-3), ("packed", name, err, fa2_err)
    shard = CPShard(None, 3, 4, T, torch.tensor([0, 5000, 5001, T]), torch.device("cuda"), balanced=True)
    keys = [make(kv_heads, T), make(kv_heads, T)]
    for h in shard.computes(3):
        start, end = shard.half(h)
        q = make(heads, end - start)
        dout = torch.randn(1, end - start, heads, dim, device="cuda", generator=gen)
        for name, (err, fa2_err) in zip(("out", "dq", "dk", "dv"), _against_fp32(
                lambda kernel, q, k, v: attend_span(q, k, v, scale, shard, start, end, kernel), [q, *keys], dout)):
            assert err < max(2 * fa2_err, 5e-3), ("cp half", h, name, err, fa2_err)
