"""The torch GDN path against a per-token fp64 recurrence written from the definition."""

import pytest
import torch

from qwenft.models.qwen3_5.gdn import chunked_delta_rule, resolve_kernel


def naive_delta_rule(q, k, v, g, beta):
    """S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - (exp(g_t) S_{t-1})^T k_t))^T ; o_t = S_t^T q_t (fp64),
    with q, k l2-normalised and q scaled by Dk^-1/2."""
    l2 = lambda x: x / ((x * x).sum(-1, keepdim=True) + 1e-6).sqrt()  # noqa: E731  (fla's l2norm eps)
    q = l2(q) * q.shape[-1] ** -0.5
    k = l2(k)
    B, T, H, Dk = k.shape
    S = torch.zeros(B, H, Dk, v.shape[-1], dtype=torch.float64)
    outs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None, None]
        pred = torch.einsum("bhkv,bhk->bhv", S, k[:, t])
        S = S + torch.einsum("bhk,bhv->bhkv", k[:, t], beta[:, t, :, None] * (v[:, t] - pred))
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    return torch.stack(outs, dim=1)


def _inputs(T, H=4, Dk=16, Dv=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(2, T, H, Dk, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(2, T, H, Dv, generator=gen, dtype=torch.float64)
    # decay rates as the model produces them: -exp(A_log) * softplus(a + dt_bias), A in [0.01, 16]
    A = torch.empty(H, dtype=torch.float64).uniform_(0.01, 16, generator=gen)
    g = -A * torch.nn.functional.softplus(torch.randn(2, T, H, generator=gen, dtype=torch.float64) - 4)
    beta = torch.rand(2, T, H, generator=gen, dtype=torch.float64)
    return [t.requires_grad_() for t in (q, k, v, g, beta)]


@pytest.mark.parametrize("T", [5, 64, 150])
def test_chunked_matches_recurrence_fp64(T):
    inputs = _inputs(T)
    out = chunked_delta_rule(*inputs)
    ref = naive_delta_rule(*inputs)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-10
    probe = torch.randn_like(ref)
    grads = torch.autograd.grad((out * probe).sum(), inputs)
    ref_grads = torch.autograd.grad((ref * probe).sum(), inputs)
    for name, a, b in zip("q k v g beta".split(), grads, ref_grads):
        assert ((a - b).norm() / b.norm()).item() < 1e-9, name


def test_fp32_path_is_close_to_fp64():
    inputs = _inputs(150)
    ref = naive_delta_rule(*inputs)
    out = chunked_delta_rule(*(t.detach().float() for t in inputs))
    assert out.dtype == torch.float32
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5


def test_kernel_choice_is_explicit():
    assert resolve_kernel("torch") == "torch"
    if not torch.cuda.is_available():
        assert resolve_kernel("auto") == "torch"
    with pytest.raises(ValueError, match="model.kernels.gdn='triton'"):
        resolve_kernel("triton")
