"""LowPrecisionAdamW (optim.state_dtype / optim.master_dtype) against torch.optim.AdamW, and build_optimizer's weight
decay against AdamW's formula in fp64, on CPU."""

import pytest
import torch

from qwenft.models.loader import build_model, init_random_weights
from qwenft.models.qwen3_5.configs import named_config
from qwenft.train.optim import LowPrecisionAdamW, build_optimizer, stochastic_round_

HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _params(seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(33, 17), (5,), (1000,), (4, 3, 7)]
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]


def _grads(params, step, dtype=None):
    gen = torch.Generator().manual_seed(1000 + step)
    # gradients of very different sizes per tensor, as in a model
    return [(torch.randn(p.shape, generator=gen) * 10.0**-i).to(dtype or p.dtype) for i, p in enumerate(params)]


def _run(opt, params, steps, grad_dtype=None):
    for step in range(steps):
        for p, g in zip(params, _grads(params, step, grad_dtype)):
            p.grad = g
        opt.step()


def test_fp32_state_equals_torch_adamw_exactly():
    """Chunked into 64-element views so the foreach batching and the chunk split are both exercised."""
    ref, ours = _params(), _params()
    _run(torch.optim.AdamW(ref, foreach=True, **HYPER), ref, 5)
    _run(LowPrecisionAdamW(ours, state_dtype=torch.float32, stochastic_rounding=False, chunk_numel=64, **HYPER),
         ours, 5)
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)


def test_bf16_moments_stay_within_bf16_tolerance_of_fp32_adamw():
    """bf16 moments round each step to 8 significant bits (relative error up to 2^-8 = 3.9e-3); over 20 steps the parameters'
    change stays within 1% of fp32 AdamW's (measured at most 3.1e-3 with stochastic, 2.3e-3 with nearest
    rounding)."""
    start = _params()
    ref = _params()
    _run(torch.optim.AdamW(ref, foreach=True, **HYPER), ref, 20)
    for rounding in (True, False):
        ours = _params()
        opt = LowPrecisionAdamW(ours, state_dtype=torch.bfloat16, stochastic_rounding=rounding, **HYPER)
        _run(opt, ours, 20)
        assert all(s["exp_avg"].dtype == torch.bfloat16 for s in opt.state.values())
        for a, b, s in zip(ours, ref, start):
            assert a.dtype == torch.float32
            err = ((a - b).norm() / (b - s).norm()).item()
            assert err < 1e-2, (rounding, err)


def test_stochastic_rounding_is_unbiased_and_nearest_loses_tiny_updates():
    """1 + 1e-4 is below half a bf16 ulp at 1 (the ulp is 2^-7, half of it 3.9e-3): round to nearest gives 1
    every time, the update is lost; stochastic rounding gives 1 or 1 + 2^-7 with odds that make the mean of
    many roundings 1 + 1e-4."""
    n = 200_000
    src = torch.full((n,), 1.0 + 1e-4)
    dst = torch.empty(n, dtype=torch.bfloat16)
    assert torch.all(src.to(torch.bfloat16) == 1.0)  # nearest: the update is lost
    stochastic_round_(dst, src.clone(), torch.Generator().manual_seed(0))
    assert set(dst.float().unique().tolist()) == {1.0, 1.0 + 2**-7}
    mean = dst.double().mean().item() - 1.0
    # binomial, p = 1e-4 / 2^-7 = 0.0128: std of the mean = 2^-7 sqrt(p (1 - p) / n) = 2e-6; allow 7 std
    assert abs(mean - 1e-4) < 1.5e-5, mean
    # negative values round symmetrically
    stochastic_round_(dst, -torch.full((n,), 1.0 + 1e-4), torch.Generator().manual_seed(1))
    assert abs(-dst.double().mean().item() - 1.0 - 1e-4) < 1.5e-5


def test_bf16_weights_follow_fp32_adamw_with_stochastic_rounding():
    """bf16 parameters, tiny lr (each update ~1e-4 relative, under half a bf16 ulp): with stochastic rounding
    the average over many parameters moves like fp32 AdamW (measured -9.92e-4 vs -1.01e-3 after 10 steps);
    with round to nearest they do not move at all."""
    lr = 1e-4
    gen = torch.Generator().manual_seed(0)
    start = torch.ones(100_000)
    grad = torch.ones(100_000) + 0.1 * torch.randn(100_000, generator=gen)  # every update ~ -lr
    ref = torch.nn.Parameter(start.clone())
    ref_opt = torch.optim.AdamW([ref], lr=lr, betas=(0.9, 0.95), foreach=True)
    results = {}
    for rounding in (True, False):
        p = torch.nn.Parameter(start.to(torch.bfloat16))
        opt = LowPrecisionAdamW([p], lr=lr, betas=(0.9, 0.95), state_dtype=torch.bfloat16, stochastic_rounding=rounding)
        for _ in range(10):
            p.grad = grad.to(torch.bfloat16)
            opt.step()
        results[rounding] = p.double().mean().item()
    for _ in range(10):
        ref.grad = grad.clone()
        ref_opt.step()
    moved = ref.double().mean().item() - 1.0  # about -10 lr = -1e-3
    assert results[False] == 1.0  # every update lost
    assert abs((results[True] - 1.0) - moved) < 0.02 * abs(moved), (results[True] - 1.0, moved)


def test_state_dict_round_trip_keeps_state_dtype():
    """torch's load_state_dict casts state to the parameter dtype; bf16 moments of fp32 weights stay bf16 and
    fp32 moments of bf16 weights stay fp32 (and exact)."""
    for param_dtype, state_dtype in ((torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)):
        params = _params(dtype=param_dtype)
        opt = LowPrecisionAdamW(params, state_dtype=state_dtype, **HYPER)
        _run(opt, params, 2)
        saved = opt.state_dict()
        fresh = LowPrecisionAdamW(params, state_dtype=state_dtype, **HYPER)
        fresh.load_state_dict(saved)
        for p in params:
            for key in ("exp_avg", "exp_avg_sq"):
                assert fresh.state[p][key].dtype == state_dtype
                assert torch.equal(fresh.state[p][key], opt.state[p][key])
            assert fresh.state[p]["step"].item() == 2


def test_a_step_skipped_by_its_flag_changes_nothing_once_unstepped():
    """step(skip_if=True), the runner's step whose loss or norm is not finite, then `unstep`: weights, moments and
    step counts as they were, through both of the torch ops' flushes (chunk_numel below the tensors' sizes); the
    step after it is bit for bit the one a run without the skipped step takes (its seeds follow the step count). A
    flag that is false steps as no flag does."""
    def state(opt, params):
        return [(p.detach().clone(), *(opt.state[p][k].clone() for k in ("exp_avg", "exp_avg_sq", "step")))
                for p in params]

    runs = []
    for skipped in (False, True):
        params = _params(dtype=torch.bfloat16)
        opt = LowPrecisionAdamW(params, **HYPER, state_dtype=torch.bfloat16, chunk_numel=256)
        _run(opt, params, 1)
        if skipped:
            before = state(opt, params)
            for p, g in zip(params, _grads(params, 7)):
                p.grad = g
            opt.step(skip_if=torch.tensor(True))
            opt.unstep()
            for a, b in zip(state(opt, params), before):
                assert all(torch.equal(x, y) for x, y in zip(a, b))
        for p, g in zip(params, _grads(params, 1)):
            p.grad = g
        opt.step(skip_if=torch.tensor(False))
        runs.append(state(opt, params))
    for a, b in zip(*runs):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_build_optimizer_picks_the_optimizer():
    fp32 = _params()
    assert type(build_optimizer(fp32, 1e-3, 0.0, (0.9, 0.95), 1e-8, "auto")) is torch.optim.AdamW
    assert isinstance(build_optimizer(fp32, 1e-3, 0.0, (0.9, 0.95), 1e-8, "auto", state_dtype="bfloat16"),
                      LowPrecisionAdamW)
    assert isinstance(build_optimizer(_params(dtype=torch.bfloat16), 1e-3, 0.0, (0.9, 0.95), 1e-8, "false"),
                      LowPrecisionAdamW)
    with pytest.raises(ValueError, match="optim.fused=true .* set optim.fused=auto"):
        build_optimizer(fp32, 1e-3, 0.0, (0.9, 0.95), 1e-8, "true", state_dtype="bfloat16")


def _tiny_qwen3_5(gen):
    """tiny_moe with attention biases: matrices, embeddings, conv kernels and experts (3 dims), norm weights,
    biases, A_log and dt_bias, every value drawn from N(0, 1) (zero / one initialised norms and biases would
    hide a decay)."""
    cfg = named_config("tiny_moe")
    cfg.text.attention_bias = True
    model = init_random_weights(build_model(cfg, kernels="torch"), seed=0, device="cpu", dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return model


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
def test_weight_decay_only_on_parameters_of_two_or_more_dims(state_dtype):
    """One step of build_optimizer's AdamW (torch's foreach one; LowPrecisionAdamW for bf16 moments, fused=false)
    on the tiny Qwen3.5 against AdamW's first step written out in fp64, with weight_decay on every parameter but
    norm weights, biases, A_log and dt_bias, named here, not by shape. The first step computes in fp32 whatever the
    moments' dtype, so the gap is fp32 rounding (measured at 1% of atol 1e-6 + rtol 1e-5), while a decay given
    to the wrong parameters moves them by lr x weight_decay x |p| = 5e-3 |p| (measured 490x the tolerance): the
    same reference with the decay flipped must not match."""
    lr, (beta1, beta2), eps, weight_decay = 1e-2, (0.9, 0.95), 1e-8, 0.5
    gen = torch.Generator().manual_seed(0)
    model = _tiny_qwen3_5(gen)
    named = dict(model.named_parameters())
    not_decayed = {n for n in named if n.endswith(("norm.weight", ".bias", ".A_log", ".dt_bias"))}
    assert {n.rsplit(".", 1)[1] for n in not_decayed} == {"weight", "bias", "A_log", "dt_bias"}
    start = {n: p.detach().double().clone() for n, p in named.items()}
    for p in named.values():
        p.grad = torch.randn(p.shape, generator=gen)
    grads = {n: p.grad.double() for n, p in named.items()}

    opt = build_optimizer(model.parameters(), lr, weight_decay, (beta1, beta2), eps, "false", state_dtype=state_dtype)
    assert type(opt) is (torch.optim.AdamW if state_dtype == "float32" else LowPrecisionAdamW)
    assert [g["weight_decay"] for g in opt.param_groups] == [weight_decay, 0.0]  # plain parameters: 2 groups
    assert {id(p) for p in opt.param_groups[1]["params"]} == {id(named[n]) for n in not_decayed}
    opt.step()

    def adamw_step(name, decay):
        g = grads[name]
        m, v = (1 - beta1) * g, (1 - beta2) * g * g
        return start[name] * (1 - lr * decay) - lr / (1 - beta1) * m / ((v / (1 - beta2)).sqrt() + eps)

    for name, p in named.items():
        decayed = name not in not_decayed
        want = adamw_step(name, weight_decay if decayed else 0.0)
        torch.testing.assert_close(p.double(), want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
        assert not torch.allclose(p.double(), adamw_step(name, 0.0 if decayed else weight_decay), rtol=1e-5,
                                  atol=1e-6), name


def test_build_optimizer_makes_no_empty_group():
    """Only matrices (a LoRA run's adapters): one group, decaying; only 1-D: one group, weight_decay 0."""
    matrices = [torch.nn.Parameter(torch.zeros(4, 3)), torch.nn.Parameter(torch.zeros(3, 4))]
    vectors = [torch.nn.Parameter(torch.zeros(4))]
    assert [g["weight_decay"] for g in build_optimizer(matrices, 1e-3, 0.1, (0.9, 0.95), 1e-8, "false")
            .param_groups] == [0.1]
    assert [g["weight_decay"] for g in build_optimizer(vectors, 1e-3, 0.1, (0.9, 0.95), 1e-8, "false",
                                                       state_dtype="bfloat16").param_groups] == [0.0]


def test_deferred_clip_scale_equals_scaling_the_gradients_first():
    """`scale_grads` (the clip coefficient applied inside the step, in fp32) against the same optimizer on gradients
    multiplied beforehand, fp32 and bf16 weights and gradients: powers of two, so the multiply is exact in either
    dtype and parameters and both moments must agree bit for bit (the moments see a scale even where AdamW's
    normalised update does not). A scale of its own per parameter and per step, two of them in one foreach batch
    (the MTP head is clipped apart from the trunk); `.grad` left as it was; the pending scales gone after the step
    and after `zero_grad`."""
    for dtype in (torch.float32, torch.bfloat16):
        ref, ours = _params(dtype=dtype), _params(dtype=dtype)
        opt_ref, opt = (LowPrecisionAdamW(ps, state_dtype=torch.bfloat16, stochastic_rounding=False, chunk_numel=64,
                                          **HYPER) for ps in (ref, ours))
        for step in range(3):
            scales = [torch.tensor(2.0 ** -(i + step + 1)) for i in range(len(ref))]
            grads = _grads(ref, step)
            for p, q, g, scale in zip(ref, ours, grads, scales):
                p.grad = g * scale.to(dtype)
                q.grad = g.clone()
            for q, scale in zip(ours, scales):
                opt.scale_grads([q], scale)
            opt_ref.step()
            opt.step()
            assert all(torch.equal(q.grad, g) for q, g in zip(ours, grads))
            assert not opt._grad_scales
        for a, b in zip(ours, ref):
            assert torch.equal(a, b), dtype
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(opt.state[a][key], opt_ref.state[b][key]), (dtype, key)
    opt.scale_grads(ours, torch.tensor(0.5))
    opt.scale_grads(ours[:1], torch.tensor(0.25))  # two clips of one parameter compound
    assert opt._grad_scales[id(ours[0])].item() == 0.125 and opt._grad_scales[id(ours[1])].item() == 0.5
    opt.zero_grad()
    assert not opt._grad_scales and all(p.grad is None for p in ours)

