"""The CUDA kernels on packed rows against qwenft's torch references, one layer on the same weights, forward and
backward: flash-linear-attention's GatedDeltaNet (`model.kernels.gdn=fla`) against the torch delta rule, and
torch's varlen flash attention (`model.kernels.attention=flash_varlen`) against SDPA with the block-diagonal
causal mask.

One row of 256 tokens holds four documents (cu_seqlens 0, 70, 71, 200, 256): one crosses fla's 64-token chunk,
one is a single token, and no boundary sits on a chunk edge. The reference is always the torch path in fp32 on
the very weights and inputs of the run checked (bf16 runs: their bf16 values, upcast). Errors are the norm of the
difference over the reference's norm.
"""

import dataclasses
import importlib.util

import pytest
import torch

from helpers import rel_err
from qwenft.models.qwen3_5.attention import GatedAttention, RotaryEmbedding, resolve_attention_kernel
from qwenft.models.qwen3_5.configs import named_config
from qwenft.models.qwen3_5.gdn import GatedDeltaNet, param_dtype, positions_in_document

pytestmark = pytest.mark.gpu

BOUNDS = [0, 70, 71, 200, 256]


def _packed_row(hidden: int, dtype: torch.dtype, seed: int):
    """Input [1, 256, hidden] in `dtype`, a probe of the same shape (the backward's incoming gradient) and the
    row's cu_seqlens (int32, as the data loader makes them), on CUDA."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    T = BOUNDS[-1]
    x, probe = (torch.randn(1, T, hidden, device="cuda", generator=gen).to(dtype) for _ in range(2))
    return x, probe, torch.tensor(BOUNDS, dtype=torch.int32, device="cuda")


def _cast_(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Parameters to `dtype`, GDN's A_log / dt_bias kept in fp32, as the model's to_dtype does."""
    for sub in module.modules():
        for name, p in sub.named_parameters(recurse=False):
            p.data = p.data.to(param_dtype(name, dtype))
    return module


def _forward_backward(layer, x, probe, *args):
    """The layer's output and the gradients of (output * probe).sum() for the input and every parameter, fp32."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    out = layer(x, *args)
    (out.float() * probe.float()).sum().backward()
    grads = {"input": x.grad.float(), **{name: p.grad.float() for name, p in layer.named_parameters()}}
    return out.detach().float(), grads


def _check(name, out, grads, ref_out, ref_grads, tols, same_dtype_torch=None):
    """Every tensor within its tolerance of the reference: tols["output"] for the output, tols[suffix] for the
    gradient of a parameter whose name ends in a key of tols, else tols["grad"]. `same_dtype_torch`: (out, grads)
    of the torch path run in the checked dtype; a tensor may also sit up to twice as far off as that run's
    (rounding to bf16 alone moves some gradients by ~1e-2)."""
    errors = {"output": (rel_err(out, ref_out), tols["output"])}
    for key, ref in ref_grads.items():
        tol = next((t for suffix, t in tols.items() if key.endswith(suffix)), tols["grad"])
        errors[key] = (rel_err(grads[key], ref), tol)
    if same_dtype_torch is not None:
        t_out, t_grads = same_dtype_torch
        torch_errs = {"output": rel_err(t_out, ref_out)}
        torch_errs.update({k: rel_err(t_grads[k], r) for k, r in ref_grads.items()})
        errors = {k: (err, max(tol, 2 * torch_errs[k])) for k, (err, tol) in errors.items()}
    bad = {k: f"{err:.2e} > {tol:.1e}" for k, (err, tol) in errors.items() if not err <= tol}
    assert not bad, f"{name}: {bad}"


# ---------------------------------------------------------------- GatedDeltaNet: fla against torch

def _fla_missing() -> str | None:
    """Why fla's GatedDeltaNet kernels cannot run here, or None. On Hopper with Triton >= 3.4 and < 3.7.1 fla's
    own Triton backward is miscompiled and fla raises unless tilelang is installed; the GPU kit
    (../shared/gpu/build-kit.sh) brings both."""
    if importlib.util.find_spec("fla") is None:
        return "flash-linear-attention (fla) is not installed: pip install -e '.[gpu]' or the GPU kit"
    from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1

    if (IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1
            and importlib.util.find_spec("tilelang") is None):
        return "fla's GDN backward on Hopper with Triton < 3.7.1 needs tilelang: install tilelang (the GPU kit has it)"
    return None


def _gdn_config():
    """The tiny model's GDN at the head dims of every published Qwen3.5 (128), 2 key heads serving 4 value heads."""
    return dataclasses.replace(named_config("tiny").text, hidden_size=256, linear_num_key_heads=2,
                               linear_num_value_heads=4, linear_key_head_dim=128, linear_value_head_dim=128)


def _gdn_state(cfg, seed=0) -> dict:
    """Seeded fp32 weights: projections at std fan_in^-1/2, conv taps at std 1/2, the gated norm's weight near 1,
    decay rates A in [0.05, 8] and dt_bias near -4 (softplus about 0.02): per-token decays from near 1 to 0.7,
    so some heads carry their state across chunks and documents, where a missed reset shows."""
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, p in GatedDeltaNet(cfg, "torch").named_parameters():
        if name.endswith("A_log"):
            value = torch.empty(p.shape).uniform_(0.05, 8, generator=gen).log()
        elif name.endswith("dt_bias"):
            value = -4 + 0.5 * torch.randn(p.shape, generator=gen)
        elif name == "norm.weight":
            value = 1 + 0.1 * torch.randn(p.shape, generator=gen)
        else:
            value = torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5
        state[name] = value
    return state


def _gdn(cfg, kernel, dtype, state):
    layer = GatedDeltaNet(cfg, kernel)
    layer.load_state_dict(state)
    return _cast_(layer.cuda(), dtype)


# fp32: fla's Triton dots take fp32 operands at TF32 precision (10-bit mantissa; its solve_tril asks for tf32
# outright), so fp32 fla is held to fla's own tolerances for fp16 inputs, the same mantissa (its
# tests/ops/test_gated_delta.py: output 5e-3, dq/dk/dv 8e-3, dbeta/dg 2e-2), not to fp32's ~1e-6. The decay
# gradient dg reaches A_log, dt_bias and a_proj, dbeta reaches b_proj.
# bf16: 8x coarser rounding than TF32, and fla keeps its chunk states in the input dtype. At the 27B layer shape
# fla in bf16 sat 1.1e-2 (output) and 2.4e-2 (worst gradient) from torch in fp32, as far as the torch path in
# bf16 itself (docs/performance.md, "fla (bf16) against the torch reference (fp32)").
_DECAY_AND_BETA = ("A_log", "dt_bias", "a_proj.weight", "b_proj.weight")
GDN_TOLERANCES = {
    torch.float32: {"output": 5e-3, "grad": 1e-2, **dict.fromkeys(_DECAY_AND_BETA, 2e-2)},
    torch.bfloat16: {"output": 2e-2, "grad": 4e-2, **dict.fromkeys(_DECAY_AND_BETA, 8e-2)},
}


@pytest.mark.timeout(500, method="signal")  # a cold machine compiles fla's kernels for the dtype: over 240 s in fp32
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fla_gated_delta_net_equals_torch_on_packed_rows(dtype):
    """qwenft's GatedDeltaNet layer with kernels=fla (qwenft's causal conv, fla's chunk_gated_delta_rule, cu_seqlens)
    against kernels=torch in fp32 on the same weights: output and the gradients of the input and every parameter
    (q/k/v/z/a/b projections, conv taps, A_log, dt_bias, norm, out_proj). The reference differs from the same
    row run unpacked by far more than any tolerance, so a state or conv tap carried over a document boundary
    shows."""
    if (reason := _fla_missing()) is not None:
        pytest.skip(reason)
    cfg = _gdn_config()
    state = _gdn_state(cfg)
    # the weights as the checked dtype holds them, upcast, for the fp32 reference
    ref_state = {k: v.to(param_dtype(k.rsplit(".", 1)[-1], dtype)).float() for k, v in state.items()}
    x, probe, cu_seqlens = _packed_row(cfg.hidden_size, dtype, seed=1)
    reference = _gdn(cfg, "torch", torch.float32, ref_state)
    ref_out, ref_grads = _forward_backward(reference, x.float(), probe, cu_seqlens)
    unpacked, _ = _forward_backward(reference, x.float(), probe, None)
    assert rel_err(unpacked, ref_out) > 0.1, "the documents barely interact: the test could not see a missed reset"

    out, grads = _forward_backward(_gdn(cfg, "fla", dtype, state), x, probe, cu_seqlens)
    same_dtype_torch = None
    if dtype != torch.float32:
        same_dtype_torch = _forward_backward(_gdn(cfg, "torch", dtype, state), x, probe, cu_seqlens)
    _check(f"fla GDN, {dtype}", out, grads, ref_out, ref_grads, GDN_TOLERANCES[dtype], same_dtype_torch)


@pytest.mark.timeout(500, method="signal")  # in a worker of its own (gpu_tests_kernels): over 400 s cold in fp32
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fla_kernels_replayed_as_cuda_graphs_equal_eager(dtype):
    """The GatedDeltaNet layer with its fla kernels captured as CUDA graphs on fixed layouts (`GraphedMix`, what
    model.cuda_graphs=true installs at tp > 1) against the same layer eager, on six batches: 4 documents in 7
    blocks (a layout of bucket 4 and 8 blocks: a capture), 5 in 6 (bucket 8, 12 blocks: another), the first
    batch again (replayed with new offsets), 80 documents in 80 blocks (bucket 128, 96 blocks), 3 documents in 6
    blocks (the layout in use with the fewest blocks and documents that holds them: the first) and one unpacked
    row. Output and the gradients of the input and every parameter, each batch; the graphs differ only in the
    order of the conv weight gradient's sum over blocks (pad blocks add zeros)."""
    if (reason := _fla_missing()) is not None:
        pytest.skip(reason)
    from qwenft.models.qwen3_5 import gdn_graph

    gdn_graph._LAYOUTS.clear()  # no bucket in use from earlier tests
    cfg = _gdn_config()
    state = _gdn_state(cfg)
    eager, graphed = _gdn(cfg, "fla", dtype, state), _gdn(cfg, "fla", dtype, state)
    graphed.graphs = gdn_graph.GraphedMix(graphed.fla_kernels)
    x, probe, _ = _packed_row(cfg.hidden_size, dtype, seed=3)
    many = list(range(0, 80 * 3, 3)) + [256]  # 79 three-token documents, then one of 19
    batches = [BOUNDS, [0, 5, 64, 128, 129, 256], BOUNDS, many, [0, 100, 101, 256], None]
    for i, bounds in enumerate(batches):
        cu = None if bounds is None else torch.tensor(bounds, dtype=torch.int32, device="cuda")
        ref_out, ref_grads = _forward_backward(eager, x, probe, cu)
        out, grads = _forward_backward(graphed, x, probe, cu)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        errors = {k: rel_err(grads[k], ref) for k, ref in ref_grads.items()} | {"output": rel_err(out, ref_out)}
        assert all(e <= tol for e in errors.values()), (i, bounds, errors)
    assert sorted((b, k) for _, _, b, k in gdn_graph._LAYOUTS) == [(4, 8), (8, 12), (128, 96)]
    assert len(graphed.graphs.graphs) == 4  # a pair per layout, and one for the unpacked row


# ---------------------------------------------------------------- attention: varlen flash against SDPA

def _attention_config():
    """The tiny model's attention at Qwen3.5's head_dim 256 (rotary 64, M-RoPE sections 11/11/10), 4 query heads
    over 2 key-value heads."""
    return dataclasses.replace(named_config("tiny").text, hidden_size=256, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=256, mrope_section=[11, 11, 10])


def _attention(cfg, kernel, dtype, state):
    layer = GatedAttention(cfg, kernel)
    layer.load_state_dict(state)
    return layer.cuda().to(dtype)


# bf16 inputs, fp32 accumulation in both kernels; the flash kernel also rounds its softmax probabilities to bf16
# before the PV product (SDPA's math / efficient kernels in bf16 do likewise), so both sit a few bf16 ulps
# (2^-8 = 3.9e-3) from the fp32 reference.
ATTENTION_TOLERANCES = {"output": 2e-2, "grad": 3e-2}


@pytest.mark.timeout(300, method="signal")  # a cold machine compiles fla's bf16 kernels
def test_fla_kernels_take_a_padding_tail_in_pieces_with_the_documents_unchanged():
    """fla's GatedDeltaNet layer in bf16 on a row of three documents (324 tokens) and a 700-token padding tail,
    its offsets registered with the row's padding (`varlen.to_device`: the tail in 64-token pieces) and without
    (one segment), a probe read on the documents alone: the documents' outputs and input gradients are the same
    bits (each depends on its own document only, and the tail's blocks start at the same tokens either way), the
    tail's input gradients are zero both ways, and every parameter's gradient agrees to within two bf16 steps: the
    same rows reach each sum, and the bound leaves room for a kernel whose reduction order is not fixed."""
    from qwenft.models.qwen3_5 import varlen

    cfg = _gdn_config()
    layer = _gdn(cfg, "fla", torch.bfloat16, _gdn_state(cfg))
    T, real = 1024, 324
    bounds = torch.tensor([0, 100, 101, real, T], dtype=torch.int32)
    padding = (torch.arange(T) >= real)[None]
    gen = torch.Generator(device="cuda").manual_seed(5)
    x, probe = (torch.randn(1, T, cfg.hidden_size, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(2))
    probe[:, real:] = 0
    told = varlen.to_device(bounds, torch.device("cuda"), padding)
    assert varlen.recurrent_offsets(told).tolist() == [0, 100, 101, *range(real, T, 64), T]
    out, grads = _forward_backward(layer, x, probe, told)
    ref_out, ref_grads = _forward_backward(layer, x, probe, varlen.to_device(bounds, torch.device("cuda")))
    assert torch.equal(out[:, :real], ref_out[:, :real])
    assert torch.equal(grads["input"][:, :real], ref_grads["input"][:, :real])
    assert not grads["input"][:, real:].any() and not ref_grads["input"][:, real:].any()
    for name, ref in ref_grads.items():
        assert rel_err(grads[name], ref) <= 2 ** -7, name


@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=["bf16"])
def test_varlen_flash_attention_equals_sdpa_on_packed_rows(dtype):
    """qwenft's GatedAttention layer with kernel=flash_varlen (torch.nn.attention.varlen.varlen_attn, what
    kernel=auto picks on CUDA in bf16) against kernel=sdpa in fp32 (dense block-diagonal causal mask) on the same
    weights, with rotary positions restarting at each document: output and the gradients of the input and every
    parameter (q/k/v/o projections, q/k norms). The reference differs from the row attended as one document by
    far more than any tolerance. The flash kernel takes no fp32, so bf16 only."""
    if resolve_attention_kernel("auto", True, torch.device("cuda"), dtype) != "flash_varlen":
        pytest.skip(f"torch {torch.__version__} has no torch.nn.attention.varlen (torch >= 2.10 needed)")
    cfg = _attention_config()
    gen = torch.Generator().manual_seed(0)
    state = {name: (1 + 0.1 * torch.randn(p.shape, generator=gen)) if p.ndim == 1
             else torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5
             for name, p in GatedAttention(cfg, "sdpa").named_parameters()}
    x, probe, cu_seqlens = _packed_row(cfg.hidden_size, dtype, seed=2)
    positions = positions_in_document(cu_seqlens, x.shape[1]).view(1, -1)
    rotary = RotaryEmbedding(cfg).cuda()

    def run(kernel, run_dtype, bounds=cu_seqlens):
        layer = _attention(cfg, kernel, run_dtype, {k: v.to(dtype) for k, v in state.items()})
        return _forward_backward(layer, x.to(run_dtype), probe, rotary(positions, run_dtype), bounds)

    ref_out, ref_grads = run("sdpa", torch.float32)
    one_document, _ = run("sdpa", torch.float32, cu_seqlens[[0, -1]])
    assert rel_err(one_document, ref_out) > 0.1, "the mask barely matters: the test could not see a leak"
    out, grads = run("flash_varlen", dtype)
    _check(f"varlen flash attention, {dtype}", out, grads, ref_out, ref_grads, ATTENTION_TOLERANCES,
           same_dtype_torch=run("sdpa", dtype))
