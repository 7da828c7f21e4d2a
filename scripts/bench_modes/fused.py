"""The elementwise pieces of a Qwen3.5 layer, each as qwenft runs it (eager, and `torch.compile` as
`model.compile=true` does) against the fused Triton modules of liger-kernel and flash-linear-attention, on one
GPU at the 27B shape's sizes (4096 tokens, bf16):

    python scripts/bench.py fused [--model qwen3_5_27b] [--tokens 4096] [--json out.json]

| piece | qwenft | fused candidates |
|---|---|---|
| rmsnorm: zero-centred RMSNorm `norm(x) * (1 + w)` | `RMSNorm` | liger `LigerRMSNormFunction` (offset 1, gemma casting: all in fp32) |
| add_rmsnorm: residual add, then the norm (both outputs used) | `h + x`, `RMSNorm` | liger `LigerFusedAddRMSNormFunction` |
| swiglu: `silu(gate) * up` | `F.silu(g) * u` | liger `LigerSiLUMulFunction` |
| gated_rmsnorm: GatedDeltaNet's per-head `w * norm(x) * silu(z)` | `GatedRMSNorm` | fla `rms_norm_gated` |
| gdn_gate: `-exp(A_log) * softplus(a + dt_bias)` (fp32 out) | `Decay` | fla `fused_gdn_gate` |

Each variant runs forward + backward (one upstream gradient per output) 20 times after 5 warm-up calls; the
report gives the median ms per call and the error of the output and of every input gradient against the same
piece in fp32 (relative norm), one JSON line per variant as it finishes, then a summary. A candidate whose
package is missing or that raises is reported with its error and skipped.
"""

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.func import functional_call

from qwenft.models.qwen3_5.attention import RMSNorm
from qwenft.models.qwen3_5.configs import named_config
from qwenft.models.qwen3_5.gdn import Decay, GatedRMSNorm


def fwd_bwd(fn, inputs, grads) -> tuple:
    """fn(*inputs) and its backward, `grads` the outputs' gradients; the outputs."""
    for t in inputs:
        t.grad = None
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    torch.autograd.backward(outs, grads)
    return outs


def fwd_bwd_ms(fn, inputs, grads, repeat=20, warmup=5) -> float:
    """Median ms of `fwd_bwd`."""
    times = []
    for i in range(warmup + repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fwd_bwd(fn, inputs, grads)
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def run_once(fn, inputs, grads):
    """Outputs and the inputs' gradients of one forward + backward, detached."""
    return [o.detach() for o in fwd_bwd(fn, inputs, grads)] + [t.grad.detach() for t in inputs]


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def module_fn(module):
    """fn(x..., *params) = module(x...) with the module's parameters (in registration order) passed in last."""
    names = [n for n, _ in module.named_parameters()]

    def fn(*args):
        inputs, params = args[:len(args) - len(names)], args[len(args) - len(names):]
        return functional_call(module, dict(zip(names, params)), inputs)
    return fn


def pieces(cfg, tokens: int):
    """{piece: (inputs, output grads, reference fn (run on fp32 copies), {variant: fn or the import error})};
    every fn takes the inputs in order. qwenft's variants are its own modules (`RMSNorm`, `GatedRMSNorm`,
    `Decay`) and the MLP's `F.silu(gate) * up`."""
    t = cfg.text
    dev, bf16 = "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    eps = t.rms_norm_eps

    def randn(*shape, dtype=bf16, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=gen, device=dev) * scale + shift).to(dtype).requires_grad_()

    def with_compiled(fn):
        return {"qwenft eager": fn, "qwenft compiled": torch.compile(fn, dynamic=False)}

    out = {}
    norm = module_fn(RMSNorm(t.hidden_size, eps))
    x, w = randn(tokens, t.hidden_size), randn(t.hidden_size, scale=0.1)
    out["rmsnorm"] = ([x, w], [torch.randn_like(x)], norm, {**with_compiled(norm), **_liger_rmsnorm(eps)})

    def add_norm(h, x, w):
        s = h + x
        return norm(s, w), s

    h, x, w = randn(tokens, t.hidden_size), randn(tokens, t.hidden_size), randn(t.hidden_size, scale=0.1)
    out["add_rmsnorm"] = ([h, x, w], [torch.randn_like(h), torch.randn_like(h)], add_norm,
                          {**with_compiled(add_norm), **_liger_add_rmsnorm(eps)})

    def swiglu(g, u):
        return F.silu(g) * u

    g, u = randn(tokens, t.intermediate_size), randn(tokens, t.intermediate_size)
    out["swiglu"] = ([g, u], [torch.randn_like(g)], swiglu, {**with_compiled(swiglu), **_liger_swiglu()})

    gated = module_fn(GatedRMSNorm(t.linear_value_head_dim, eps))
    rows = tokens * t.linear_num_value_heads
    x, z = randn(rows, t.linear_value_head_dim), randn(rows, t.linear_value_head_dim)
    w = randn(t.linear_value_head_dim, scale=0.1, shift=1.0)
    out["gated_rmsnorm"] = ([x, z, w], [torch.randn_like(x)], gated,
                            {**with_compiled(gated), **_fla_gated_rmsnorm(eps)})

    decay = module_fn(Decay(t.linear_num_value_heads))  # parameters A_log, dt_bias (fp32)
    a = randn(tokens, t.linear_num_value_heads)
    a_log = torch.empty(t.linear_num_value_heads, device=dev).uniform_(1, 16, generator=gen).log_().requires_grad_()
    dt_bias = torch.ones(t.linear_num_value_heads, device=dev, requires_grad=True)
    out["gdn_gate"] = ([a, a_log, dt_bias], [torch.randn(tokens, t.linear_num_value_heads, device=dev)], decay,
                       {**with_compiled(decay), **_fla_gdn_gate()})
    return out


def _liger_rmsnorm(eps):
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except ImportError as e:
        return {"liger": e}
    return {"liger": lambda x, w: LigerRMSNormFunction.apply(x, w, eps, 1.0, "gemma", False)}


def _liger_add_rmsnorm(eps):
    try:
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
    except ImportError as e:
        return {"liger": e}
    return {"liger": lambda h, x, w: LigerFusedAddRMSNormFunction.apply(x, h, w, eps, 1.0, "gemma", False)}


def _liger_swiglu():
    try:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except ImportError as e:
        return {"liger": e}
    return {"liger": lambda g, u: LigerSiLUMulFunction.apply(g, u)}


def _fla_gated_rmsnorm(eps):
    try:
        from fla.modules.norm.fused_norm_gate import rms_norm_gated
    except ImportError as e:
        return {"fla": e}
    return {"fla": lambda x, z, w: rms_norm_gated(x, z, w, None, activation="swish", eps=eps)}


def _fla_gdn_gate():
    try:
        from fla.ops.gated_delta_rule.gate import fused_gdn_gate
    except ImportError as e:
        return {"fla": e}
    return {"fla": lambda a, a_log, dt_bias: fused_gdn_gate(a, a_log, dt_bias)}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="bench.py fused", description="A Qwen3.5 layer's elementwise pieces, eager "
                                     "and compiled, against liger-kernel's and fla's fused modules, on one GPU.")
    parser.add_argument("--model", default="qwen3_5_27b")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    cfg = named_config(args.model.removeprefix("qwen3_5_"))
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens": args.tokens,
              "model": args.model, "pieces": {}}
    for piece, (inputs, grads, reference, variants) in pieces(cfg, args.tokens).items():
        ref_inputs = [t.detach().float().requires_grad_() for t in inputs]
        ref = run_once(reference, ref_inputs, [g.float() for g in grads])
        rows = report["pieces"][piece] = {}
        for name, fn in variants.items():
            if isinstance(fn, Exception):
                rows[name] = {"error": f"{type(fn).__name__}: {fn}"}
            else:
                try:
                    # fresh inputs per variant, errors before the timing: liger's SwiGLU writes its gradients
                    # into its inputs' storage, so reused inputs (and gradients that alias them) change
                    own = [t.detach().clone().requires_grad_() for t in inputs]
                    errors = [round(rel(a, b), 6) for a, b in zip(run_once(fn, own, grads), ref)]
                    rows[name] = {"ms": round(fwd_bwd_ms(fn, own, grads), 4), "rel_err_vs_fp32": errors}
                except Exception as e:  # a candidate that does not run here is a result too
                    rows[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
            print(json.dumps({"piece": piece, "variant": name, **rows[name]}), flush=True)
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))

