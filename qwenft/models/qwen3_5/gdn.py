"""GatedDeltaNet (Qwen3.5's linear attention) with head-shardable projections and explicit kernels.

Kernels (`kernels` argument, config `model.kernels.gdn`):
  torch  fp32 chunked delta rule written here; the reference. Packed input (cu_seqlens) restarts the conv
         and the recurrent state at every document boundary.
  fla    flash-linear-attention's Triton kernels for the delta rule (CUDA only), same semantics via their
         `cu_seqlens`; the causal conv beside it is qwenft's Triton kernel (conv_kernel.py).
  auto   fla when CUDA is available and `fla` imports, else torch; decided per call, never at import time
         (importing Triton kernels on a machine without a GPU breaks every forward: "0 active drivers").
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from qwenft.models.weight_grad import stacked_linears, stacked_projections

from .attention import local, local_all
from .configs import TextConfig
from .varlen import FLA_CHUNK, recurrent_offsets, varlen_info

KERNELS = ("auto", "fla", "torch")
# Parameters kept in fp32 whatever the model dtype: the decay exp(-exp(A_log) * softplus(a + dt_bias)) is
# sensitive to rounding. The loader and `Qwen3_5Model.to_dtype` honour this set; a plain `model.to(bf16)`
# would not.
FP32_PARAM_NAMES = ("A_log", "dt_bias")


def param_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype a parameter called `name` (leaf name) gets in a model of `dtype`."""
    return torch.promote_types(dtype, torch.float32) if name in FP32_PARAM_NAMES else dtype


def check_kernel(kernels: str) -> None:
    """Refuse, before anything is built, `fla` where it cannot run (not installed, or no CUDA)."""
    if kernels != "fla":
        return
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except ImportError as e:
        raise ValueError(f"model.kernels.gdn=fla but flash-linear-attention does not import ({e}); "
                         f"pip install -e '.[gpu]', or set model.kernels.gdn=auto (torch kernels without it)") from None
    if not torch.cuda.is_available():
        raise ValueError("model.kernels.gdn=fla needs CUDA (flash-linear-attention's kernels are Triton); set "
                         "model.kernels.gdn=torch or auto on this machine")


def resolve_kernel(kernels: str) -> str:
    if kernels not in KERNELS:
        raise ValueError(f"model.kernels.gdn={kernels!r}; valid: {list(KERNELS)}")
    if kernels != "auto":
        return kernels
    if not torch.cuda.is_available():
        return "torch"
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except ImportError:
        return "torch"
    return "fla"


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm then SiLU gate: `weight * norm(x) * silu(z)` (weight initialised to 1, not 1+w)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.to(torch.promote_types(dtype, torch.float32))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = local(self.weight) * xf.to(dtype)
        return (out * F.silu(z.to(xf.dtype))).to(dtype)


def positions_in_document(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """[total] offset of each flattened token inside its packed document."""
    flat = torch.arange(total, device=cu_seqlens.device)
    starts = cu_seqlens.to(torch.long)
    doc = torch.searchsorted(starts, flat, right=True) - 1
    return flat - starts[doc]


def causal_conv(x_btc: torch.Tensor, weight_c1k: torch.Tensor, pos_in_doc: torch.Tensor | None) -> torch.Tensor:
    """Depthwise causal conv + SiLU. With `pos_in_doc` ([T], packed B=1) a tap never reaches into the
    previous document: tap s (s tokens back) is dropped where the token is fewer than s into its document."""
    T, K = x_btc.shape[1], weight_c1k.shape[-1]
    x_bct = x_btc.transpose(1, 2).to(weight_c1k.dtype)
    if pos_in_doc is None:
        out = F.conv1d(x_bct, weight_c1k, padding=K - 1, groups=x_bct.shape[1])[..., :T]
    else:
        w_ck = weight_c1k[:, 0]
        out = x_bct * w_ck[:, K - 1 : K]
        for s in range(1, K):
            shifted = F.pad(x_bct, (s, 0))[..., :T] * (pos_in_doc >= s).to(x_bct.dtype)
            out = out + shifted * w_ck[:, K - 1 - s : K - s]
    return F.silu(out).transpose(1, 2).to(x_btc.dtype)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def chunked_delta_rule(q, k, v, g, beta, chunk_size: int = 64, initial_state: torch.Tensor | None = None,
                       output_final_state: bool = False):
    """Gated delta rule over one sequence batch, fp32, from `initial_state` [B, H, Dk, Dv] (default zero);
    returns the output, or (output, the final state [B, H, Dk, Dv] in the compute dtype) with
    `output_final_state`.

    q, k [B, T, H, Dk] (already one per value head), v [B, T, H, Dv], g (log decay) and beta [B, T, H].
    Recurrence per token: S <- exp(g) S; S <- S + k (beta (v - S^T k))^T; o = S^T q, with q, k l2-normalised
    and q scaled by Dk^-1/2. Within a chunk, u = (I + A)^-1 (beta v - beta exp(G) K S0) with
    A_ij = beta_i exp(G_i - G_j) k_i.k_j (j < i) turns the token loop into triangular solves.
    """
    dtype = v.dtype
    compute = torch.promote_types(dtype, torch.float32)  # fp32, or fp64 when given fp64 (tests)
    B, T, H, Dk = k.shape
    Dv = v.shape[-1]
    q, k, v, g, beta = (t.transpose(1, 2).to(compute) for t in (q, k, v, g, beta))  # [B, H, T, ...]
    q = _l2norm(q) * Dk**-0.5
    k = _l2norm(k)
    C = chunk_size
    pad = (C - T % C) % C
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (T + pad) // C
    q, k, v = (t.reshape(B, H, n, C, -1) for t in (q, k, v))
    g, beta = g.reshape(B, H, n, C), beta.reshape(B, H, n, C)

    G = g.cumsum(-1)  # log decay from chunk start to each position
    lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    decay_ij = (G[..., :, None] - G[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # i >= j
    strict = decay_ij.masked_fill(lower.logical_not().logical_or(torch.eye(C, dtype=torch.bool, device=q.device)), 0)
    A = beta[..., None] * (k @ k.transpose(-1, -2)) * strict
    eye = torch.eye(C, dtype=compute, device=q.device)
    solve = lambda rhs: torch.linalg.solve_triangular(A + eye, rhs, upper=False, unitriangular=True)  # noqa: E731
    u_local = solve(beta[..., None] * v)  # part of u independent of the chunk's initial state
    w = solve(beta[..., None] * G.exp()[..., None] * k)  # u = u_local - w @ S0
    attn_qk = (q @ k.transpose(-1, -2)) * decay_ij
    q_decayed = q * G.exp()[..., None]
    k_to_end = k * (G[..., -1:] - G).exp()[..., None]

    S = q.new_zeros(B, H, Dk, Dv) if initial_state is None else initial_state.to(compute)
    outs = []
    for c in range(n):
        u = u_local[:, :, c] - w[:, :, c] @ S
        outs.append(q_decayed[:, :, c] @ S + attn_qk[:, :, c] @ u)
        S = S * G[:, :, c, -1, None, None].exp() + k_to_end[:, :, c].transpose(-1, -2) @ u
    out = torch.stack(outs, dim=2).reshape(B, H, n * C, Dv)[:, :, :T].transpose(1, 2).to(dtype)
    return (out, S) if output_final_state else out


def _torch_delta_rule(q, k, v, g, beta, cu_seqlens):
    if cu_seqlens is None:
        return chunked_delta_rule(q, k, v, g, beta)
    bounds = cu_seqlens.tolist()
    segs = [
        chunked_delta_rule(*(t[:, s:e] for t in (q, k, v, g, beta))) for s, e in zip(bounds[:-1], bounds[1:]) if e > s
    ]
    return torch.cat(segs, dim=1)


def _fla_varlen_kwargs(cu_seqlens) -> dict:
    if cu_seqlens is None:
        return {"cu_seqlens": None}
    info = varlen_info(cu_seqlens)
    return {"cu_seqlens": info.cu_seqlens, "cu_seqlens_cpu": info.cu_seqlens_cpu, "chunk_indices": info.chunk_indices}


def _fla_delta_rule(q, k, v, g, beta, varlen: dict):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    out, _ = chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False,
                                    use_qk_l2norm_in_kernel=True, chunk_size=FLA_CHUNK, **varlen)
    return out


def _triton_conv(x_btc, weight_c1k, varlen: dict):
    """The conv + SiLU beside fla's delta rule: qwenft's Triton kernels (conv_kernel.py), whose backward takes one
    pass where fla's takes two; fla's under context parallelism (its kernels exchange the taps' reach between
    ranks) and for a conv width other than conv_kernel.TAPS."""
    from .conv_kernel import TAPS, causal_conv_silu

    if "cp_context" in varlen or weight_c1k.shape[-1] != TAPS:
        # fla's conv takes no chunk size: its Triton path cuts FLA_CHUNK-token blocks
        from fla.modules.convolution import causal_conv1d

        out, _ = causal_conv1d(x=x_btc, weight=weight_c1k[:, 0], bias=None, activation="silu", **varlen)
        return out
    return causal_conv_silu(x_btc, weight_c1k[:, 0], varlen.get("cu_seqlens"), varlen.get("chunk_indices"))


class Decay(nn.Module):
    """Per-value-head log decay g = -exp(A_log) * softplus(a + dt_bias), with A_log and dt_bias in fp32.

    A module of its own so FSDP2 can shard the two as a group with an fp32 parameter policy: FSDP casts every
    parameter of a group to that group's param dtype, and in bf16 exp(A_log) is off by up to 1%. Native key
    `linear_attn.decay.A_log` is HF's `linear_attn.A_log` (adapter.py).
    """

    def __init__(self, num_value_heads: int):
        super().__init__()
        self.A_log = nn.Parameter(torch.empty(num_value_heads, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.ones(num_value_heads, dtype=torch.float32))

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        fp = torch.promote_types(a.dtype, torch.float32)
        return -local(self.A_log).to(fp).exp() * F.softplus(a.to(fp) + local(self.dt_bias).to(fp))


class GatedDeltaNet(nn.Module):
    """Qwen3.5 linear attention with separate q/k/v/z/a/b projections and per-part conv weights.

    HF fuses q|k|v into `in_proj_qkv` and `conv1d`; keeping them apart lets TP shard every tensor by head
    (adapter.py splits/fuses). conv_q/conv_k/conv_v are [channels, 1, kernel] like HF's conv1d weight; the
    forward concatenates each rank's local q|k|v and their conv weights for one conv call.
    Head counts are read from weight shapes so TP-local shards run unchanged.
    """

    def __init__(self, cfg: TextConfig, kernels: str = "torch"):
        super().__init__()
        if kernels not in KERNELS:
            raise ValueError(f"model.kernels.gdn={kernels!r}; valid: {list(KERNELS)}")
        self.kernels = kernels
        self.head_k_dim, self.head_v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        key_dim = cfg.linear_num_key_heads * cfg.linear_key_head_dim
        value_dim = cfg.linear_num_value_heads * cfg.linear_value_head_dim
        nv, h, K = cfg.linear_num_value_heads, cfg.hidden_size, cfg.linear_conv_kernel_dim
        self.q_proj = nn.Linear(h, key_dim, bias=False)
        self.k_proj = nn.Linear(h, key_dim, bias=False)
        self.v_proj = nn.Linear(h, value_dim, bias=False)
        self.z_proj = nn.Linear(h, value_dim, bias=False)
        self.a_proj = nn.Linear(h, nv, bias=False)
        self.b_proj = nn.Linear(h, nv, bias=False)
        self.conv_q = nn.Parameter(torch.empty(key_dim, 1, K))
        self.conv_k = nn.Parameter(torch.empty(key_dim, 1, K))
        self.conv_v = nn.Parameter(torch.empty(value_dim, 1, K))
        self.decay = Decay(nv)
        self.norm = GatedRMSNorm(self.head_v_dim, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(value_dim, h, bias=False)
        self.graphs = None  # GraphedMix under model.cuda_graphs (compile_layer): fla's kernels replayed

    @property
    def weight_grad_stack(self) -> tuple[str, ...]:
        """The projections `project` multiplies as one matmul, in order; their weight-gradient buffers
        (`model.kernels.weight_grad=in_matmul`) are then rows of one (`weight_grad.prepare_grads`). A tensor-parallel
        rank's projections have 1/tp of their outputs each but read the whole input: all six there, q|k|v one view
        of the output and x's gradient one matmul's rather than a sum of six, where their gradients are added in
        the matmul (on autograd's path, FSDP2's or a pipeline's, the backward would keep the stacked weights'
        copy). A whole layer's q, k, v and z are large enough alone (stacked, their weights' copy would cost more
        than it saves); beta's and the decay's, one output per value head each, are one matmul everywhere."""
        if getattr(self.q_proj, "output_shard", False):
            return "q_proj", "k_proj", "v_proj", "z_proj", "b_proj", "a_proj"
        return "b_proj", "a_proj"

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        qkv, z, beta, a = self.project(x)
        return self.output(self.mix(qkv, beta, a, cu_seqlens), z)

    # The decoder layer calls the three pieces itself: model.compile compiles project and output into the layer's
    # graphs (qwenft.models.qwen3_5.model.compile_layer); mix (the conv and the delta rule: Triton kernels, qwenft's
    # and fla's, or the reference) stays eager, and is the only piece that reads cu_seqlens.
    def project(self, x: torch.Tensor):
        """q|k|v before their conv [B, T, channels] (one tensor), z [B, T, Hv, Dv], beta [B, T, Hv], decay
        input a [B, T, Hv]."""
        b, t = x.shape[:2]
        stack = [getattr(self, name) for name in self.weight_grad_stack]
        grad = getattr(self, "weight_grad_stack_buffer", (None,))[0]
        parts = stacked_projections(self, x, groups=(3, 1, 1, 1)) if len(stack) == 6 else None
        if parts is not None:
            qkv, z, beta, a = parts
            return qkv, z.reshape(b, t, -1, self.head_v_dim), beta.sigmoid(), a
        z = self.z_proj(x).view(b, t, -1, self.head_v_dim)
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        beta, a = (stacked_linears(x, stack[-2:], grad=grad if len(stack) == 2 else None)
                   or (self.b_proj(x), self.a_proj(x)))
        return qkv, z, beta.sigmoid(), a

    def mix(self, qkv: torch.Tensor, beta: torch.Tensor, a: torch.Tensor,
            cu_seqlens: torch.Tensor | None = None, cp=None) -> torch.Tensor:
        """The decay, the causal conv and the delta rule -> [B, T, Hv, Dv]. `cp`: this rank's
        `context_parallel.CPShard` when the stream is split over context-parallel ranks (inputs [1, L, ...])."""
        B, T = qkv.shape[:2]
        kernel = resolve_kernel(self.kernels)
        if cp is not None:
            return self._cp_kernels(qkv, beta, self.decay(a), cp, kernel)
        if cu_seqlens is not None:  # documents index the flattened B*T stream: run it as one row
            qkv, beta, a = (t.reshape(1, B * T, *t.shape[2:]) for t in (qkv, beta, a))
            cu_seqlens = recurrent_offsets(cu_seqlens)  # the padding tails in short pieces
        g = self.decay(a)
        # one depthwise conv over q|k|v's channels: one kernel launch (forward and backward) instead of three
        weight, sizes = self._conv_weight()
        if kernel == "fla" and self.graphs is not None and torch.is_grad_enabled():
            out = self.graphs(qkv, beta, g, weight, sizes, cu_seqlens).view(B, T, -1, self.head_v_dim)
            # the graphs' output buffer, at one address per layer and layout, holding this output until this
            # microbatch's backward has run: the output step's CUDA graph (compile_layer) reads it there instead of
            # copying it in. A new layout is a new address, so the graphs from this layer's output step on are
            # recorded once more for it (inductor re-records on a static input's new address)
            torch._dynamo.mark_static_address(out)
            return out
        if kernel == "fla":
            out = self.fla_kernels(qkv, beta, g, weight, sizes, **_fla_varlen_kwargs(cu_seqlens))
        else:
            out = self._torch_kernels(qkv, beta, g, weight, sizes, cu_seqlens)
        return out.view(B, T, *out.shape[2:])

    def fla_kernels(self, qkv, beta, g, weight, sizes, **varlen) -> torch.Tensor:
        """The conv over q|k|v (`sizes` channels each; `_triton_conv`) and fla's chunked delta rule, grouped value
        heads in the kernel (value head j reads key head j // (Hv / Hk)); `varlen`: fla's cu_seqlens (and
        chunk_indices, cu_seqlens_cpu, or cp_context) keywords."""
        q, k, v = self._heads(_triton_conv(qkv, weight, varlen).split(sizes, dim=-1))
        return _fla_delta_rule(q, k, v, g, beta, varlen)

    def _conv_weight(self) -> tuple[torch.Tensor, tuple[int, ...]]:
        """conv_q | conv_k | conv_v as one [channels, 1, kernel] weight (this rank's heads), and the sizes."""
        weights = (self.conv_q, self.conv_k, self.conv_v)
        weights = local_all(list(weights)) if isinstance(weights[0], DTensor) else weights
        return torch.cat(weights), tuple(w.shape[0] for w in weights)

    def _cp_kernels(self, qkv, beta, g, cp, kernel: str) -> torch.Tensor:
        from . import context_parallel

        weight, sizes = self._conv_weight()
        if kernel == "fla":  # fla's own context-parallel kernels: the same exchanges, in its Triton kernels
            return self.fla_kernels(qkv, beta, g, weight, sizes, cp_context=cp.fla_context(weight.shape[-1]))
        return context_parallel.gdn_mix(qkv, beta, g, weight, sizes, self._heads, cp)

    def _torch_kernels(self, qkv, beta, g, weight, sizes, cu_seqlens) -> torch.Tensor:
        pos = None if cu_seqlens is None else positions_in_document(cu_seqlens, qkv.shape[1])
        q, k, v = self._heads(causal_conv(qkv, weight, pos).split(sizes, dim=-1))
        rep = v.shape[2] // q.shape[2]  # each key head serves `rep` consecutive value heads
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
        return _torch_delta_rule(q, k, v, g, beta, cu_seqlens)

    def _heads(self, qkv: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        q, k, v = qkv
        b, t = q.shape[:2]
        return q.view(b, t, -1, self.head_k_dim), k.view(b, t, -1, self.head_k_dim), v.view(b, t, -1, self.head_v_dim)

    def output(self, out: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The gated norm and out_proj: [B, T, Hv, Dv] -> [B, T, hidden]."""
        B, T = z.shape[:2]
        return self.out_proj(self.norm(out, z).reshape(B, T, -1))
