"""Gated full attention, Qwen3.5's RMSNorm and (M-)RoPE.

Packed batches (cu_seqlens) attend block-diagonally: on CUDA in bf16/fp16 through torch's varlen flash
kernel, which never forms a mask, or, for rows of few long documents, cuDNN's attention one document piece at a
time (piece_attention: faster than FlashAttention 2 at head_dim 256, one kernel call pair a piece); elsewhere
(fp32, CPU, `model.kernels.attention=sdpa`) through SDPA with a dense block-diagonal causal mask.
"""

import functools
import inspect

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from .configs import TextConfig
from .varlen import varlen_info

ATTENTION_KERNELS = ("auto", "sdpa", "flash_varlen", "cudnn")
# auto takes cuDNN by pieces where a call's document pieces average at least this many queries: there the kernel's
# speed outweighs a kernel call pair per piece; shorter documents go to the varlen flash kernel's single call
LONG_PIECES = 2048


def local(p: torch.Tensor) -> torch.Tensor:
    """A parameter as a plain tensor for use on TP-local activations (a no-op without tensor parallelism).

    qwenft.distributed.tensor_parallel makes projection weights, per-head parameters (GDN conv weights, A_log,
    dt_bias) Shard DTensors and per-head-shared norm weights Replicate DTensors. A replicated weight applied to
    head-sharded activations gets only this rank's heads' share of its gradient: the local gradient is summed
    over the tp ranks in the backward, so every rank's `.grad` is the full gradient. Every gradient has its
    parameter's placement.
    """
    if not isinstance(p, DTensor):
        return p
    return _LocalParams.apply(p)[0]


def local_all(params: list[DTensor]) -> tuple[torch.Tensor, ...]:
    """`local` of several DTensor parameters at once: one autograd node for all of them."""
    return _LocalParams.apply(*params)


def shard_extent(t: DTensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offset) of this rank's shard of the DTensor `t`. Cached per shape, mesh, this rank's
    place in the mesh and placements (meshes compare equal across ranks): torch's computation builds index
    tensors on the host at every call, on the hot path of a vocab-parallel embedding and loss. Cleared with
    DTensor's own caches (`fake_pg.forget_meshes`)."""
    return _shard_extent(t.shape, t.device_mesh, tuple(t.device_mesh.get_coordinate() or ()), tuple(t.placements))


@functools.cache
def _shard_extent(shape: torch.Size, mesh, coordinate: tuple, placements: tuple) -> tuple[tuple[int, ...],
                                                                                          tuple[int, ...]]:
    # No public equivalent yet (torch 2.13); the loader and DCP's planner use it too.
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
    return tuple(local_shape), tuple(offset)


class _LocalParams(torch.autograd.Function):
    """DTensor parameters' local tensors, their gradients accumulated straight into the parameters' `.grad`.

    Eager, `DTensor.to_local()`'s backward wraps each gradient in a new DTensor and autograd then adds it to
    `.grad` through DTensor's dispatch: host work per weight and microbatch, a large share of a tensor-parallel
    layer's backward (docs/performance.md, "Host time per decoder layer"). Here the backward sums a replicated
    parameter's local gradient over the ranks it is replicated on and, in a `backward()`, adds it to the local
    tensor of `.grad` (or makes `.grad` once, with the parameter's placements) and hands autograd no gradient
    to accumulate. Under
    `torch.autograd.grad` towards the parameters (the pipeline schedules that split the weight gradients from
    the input gradients) it returns the gradient as a DTensor, for the caller to take. A parameter whose local
    tensor got no gradient is left alone.

    Its node does not get AccumulateGrad's first place in autograd's queue; it still runs before FSDP2's
    post-backward of the module because `local()` is called inside the module's forward, after FSDP2's
    pre-forward: a `local()` hoisted out of the forward would leave FSDP2 reading `.grad` too early.
    """

    @staticmethod
    def forward(ctx, *params):
        ctx.params = params
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None, not zeros to all-reduce
        # new tensor objects: autograd writes its metadata on them
        return tuple(p._local_tensor.view_as(p._local_tensor) for p in params)

    @staticmethod
    def backward(ctx, *grads):
        params, ctx.params = ctx.params, None
        into, adds = [], []  # the `.grad` local tensors to add to, and what: one foreach add for the node
        out = tuple(None if grad is None else _param_grad(ctx, i, p, grad, into, adds)
                    for i, (p, grad) in enumerate(zip(params, grads)))
        if into:
            torch._foreach_add_(into, adds)
        return out


def _param_grad(ctx, i: int, p: DTensor, grad: torch.Tensor, into: list, adds: list) -> DTensor | None:
    """`_LocalParams.backward` for its i-th parameter: None once the gradient is in `p.grad`, or queued in
    (`into`, `adds`) to be added to it."""
    mesh = p.device_mesh
    into_grad = _accumulates_into_grad(ctx, i)
    add_to_grad = into_grad and p.grad is not None
    replicated = [d for d, pl in enumerate(p.placements) if isinstance(pl, Replicate) and mesh.size(d) > 1]
    if not add_to_grad or replicated:
        # a copy of our own to keep (as `.grad`, or handed back) and to sum in place: autograd may hand the
        # same buffer to other inputs too (an add passes one gradient to both)
        grad = grad.contiguous().clone()
    for dim in replicated:
        torch.distributed.all_reduce(grad, group=mesh.get_group(dim))
    if add_to_grad:
        into.append(p.grad._local_tensor)
        adds.append(grad)
        return None
    grad = DTensor.from_local(grad, mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
    if not into_grad:
        return grad
    p.grad = grad
    return None


def _accumulates_into_grad(ctx, i: int) -> bool:
    """Whether this backward pass accumulates into the parameter's `.grad` (`backward()`), rather than capturing
    its gradient (`torch.autograd.grad` with the parameter among its inputs)."""
    # torch has no public way to tell the two apart (2.13): its private check raises for a leaf's node under
    # torch.autograd.grad, which accumulates into no .grad; a public one would replace both
    try:
        return torch._C._will_engine_execute_node(ctx.next_functions[i][0])  # the parameter's AccumulateGrad
    except RuntimeError:
        return False


class RMSNorm(nn.Module):
    """Qwen3.5's zero-centred RMSNorm: `norm(x) * (1 + weight)` in fp32; weight initialised to 0."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))  # fp32 (fp64 stays fp64, for tests)
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + local(self.weight).to(xf.dtype))).type_as(x)


class RotaryEmbedding(nn.Module):
    """Partial, interleaved M-RoPE. `inv_freq` is a non-persistent buffer: call `reset()` after meta init."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.rotary_dim = cfg.rotary_dim
        self.theta = cfg.rope_theta
        self.mrope_section = list(cfg.mrope_section)
        self.register_buffer("inv_freq", self._inv_freq(None), persistent=False)

    def _inv_freq(self, device) -> torch.Tensor:
        exponent = torch.arange(0, self.rotary_dim, 2, dtype=torch.float, device=device) / self.rotary_dim
        return 1.0 / (self.theta**exponent)

    def reset(self):
        self.inv_freq = self._inv_freq(self.inv_freq.device)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [B, T] or [3, B, T] (temporal, height, width) -> cos, sin [B, T, rotary_dim]."""
        if position_ids.ndim == 2:
            position_ids = position_ids.expand(3, -1, -1)
        freqs = position_ids[..., None].float() * self.inv_freq.float()  # [3, B, T, rotary_dim/2], fp32 as HF
        # Interleaved sections as transformers does: frequency i comes from T, except H at i = 1, 4, 7, ...
        # (first mrope_section[1] of them) and W at i = 2, 5, 8, ... (first mrope_section[2]).
        mixed = freqs[0].clone()
        for axis, offset in ((1, 1), (2, 2)):
            idx = slice(offset, self.mrope_section[axis] * 3, 3)
            mixed[..., idx] = freqs[axis, ..., idx]
        emb = torch.cat((mixed, mixed), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x_bhtd: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first rotary_dim channels of each head; the rest pass through (partial rotary)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    r = cos.shape[-1]
    x_rot, x_pass = x_bhtd[..., :r], x_bhtd[..., r:]
    return torch.cat((x_rot * cos + _rotate_half(x_rot) * sin, x_pass), dim=-1)


def document_ids(cu_seqlens: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """[B, T] index of the packed document each token belongs to (cu_seqlens indexes the flattened B*T)."""
    flat = torch.arange(batch * seqlen, device=cu_seqlens.device)
    return (torch.searchsorted(cu_seqlens.to(torch.long), flat, right=True) - 1).view(batch, seqlen)


@functools.cache
def _varlen_attn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.10
        return None
    return varlen_attn


@functools.cache
def _varlen_attn_params() -> frozenset:
    return frozenset(inspect.signature(_varlen_attn()).parameters)


def cudnn_ok(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether cuDNN's attention (with its log-sum-exp, for piece_attention) runs here."""
    return (device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and torch.backends.cudnn.is_available()
            and hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention"))


def resolve_attention_kernel(kernel: str, packed: bool, device: torch.device, dtype: torch.dtype = torch.bfloat16,
                             mean_piece: float | None = None) -> str:
    """The kernel that runs `model.kernels.attention=kernel`: sdpa, flash_varlen or cudnn. `mean_piece`: the
    call's queries per document piece (auto takes cudnn from LONG_PIECES up); None, as at start, never picks it."""
    if kernel not in ATTENTION_KERNELS:
        raise ValueError(f"model.kernels.attention={kernel!r}; valid: {list(ATTENTION_KERNELS)}")
    flash_ok = device.type == "cuda" and _varlen_attn() is not None
    half = dtype in (torch.float16, torch.bfloat16)  # neither kernel takes fp32
    if kernel == "flash_varlen" and not (flash_ok and half):
        raise ValueError(f"model.kernels.attention=flash_varlen needs CUDA, torch >= 2.10 and bf16/fp16 compute "
                         f"(have {device.type}, torch {torch.__version__}, {dtype}); use auto or sdpa")
    if kernel == "cudnn" and not cudnn_ok(device, dtype):
        raise ValueError(f"model.kernels.attention=cudnn needs CUDA with cuDNN and bf16/fp16 compute "
                         f"(have {device.type}, {dtype}); use auto or sdpa")
    if kernel == "auto":
        if packed and mean_piece is not None and mean_piece >= LONG_PIECES and cudnn_ok(device, dtype):
            return "cudnn"
        return "flash_varlen" if packed and flash_ok and half else "sdpa"
    return kernel


def mean_piece(offsets: list[int]) -> float:
    """Queries per non-empty piece of the host offsets `offsets` (a fixed layout's empty documents left out)."""
    pieces = sum(b > a for a, b in zip(offsets[:-1], offsets[1:]))
    return (offsets[-1] - offsets[0]) / max(1, pieces)


def piece_kernel(device: torch.device) -> str:
    """piece_attention's kernel for `model.kernels.attention=cudnn` on `device`: cuDNN's; on the CPU (tests only:
    the choice needs CUDA) its flash kernel, the same math."""
    return "cudnn" if device.type == "cuda" else "cpu_flash"


def _by_pieces(q_bhtd, k_bhtd, v_bhtd, scale: float, offsets: list[int]) -> torch.Tensor:
    """Packed causal attention one document at a time through piece_attention -> [B, T, H, D]."""
    from .piece_attention import attend_pieces

    B, H, T, D = q_bhtd.shape
    q, k, v = (t.transpose(0, 1).reshape(1, t.shape[1], B * T, D) for t in (q_bhtd, k_bhtd, v_bhtd))  # views at B=1
    return attend_pieces(q, k, v, scale, offsets, offsets, piece_kernel(q.device)).view(B, T, H, D)


def _flash_varlen(q_bhtd, k_bhtd, v_bhtd, scale: float, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Packed causal attention with torch's varlen flash kernel -> [B, T, H, D]."""
    B, H, T, D = q_bhtd.shape
    q, k, v = (t.transpose(1, 2).reshape(B * T, t.shape[1], D) for t in (q_bhtd, k_bhtd, v_bhtd))
    info = varlen_info(cu_seqlens)
    cu = cu_seqlens.to(torch.int32)  # the batch's own int32 offsets: no copy
    return flash_varlen(q, k, v, scale, cu, cu, info.max_len, info.max_len).view(B, T, H, D)


def flash_varlen(q_thd, k_thd, v_thd, scale: float, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int,
                 max_k: int) -> torch.Tensor:
    """torch's varlen flash kernel, causal, GQA: q [Tq, H, D], k and v [Tk, Hkv, D] cut into sequences by the
    int32 offsets cu_q and cu_k -> [Tq, H, D]. Where a sequence has fewer queries than keys, its queries are its
    keys' last ones (the causal mask is aligned at the bottom right). Its keywords changed across torch
    2.10-2.12 (is_causal -> window_size, scale, enable_gqa), so they are picked from its signature."""
    varlen_attn = _varlen_attn()
    H, D = q_thd.shape[1:]
    k, v = k_thd, v_thd
    params = _varlen_attn_params()  # looked up once: this runs per attention layer and microbatch
    kwargs = {}
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    else:
        k, v = (t.repeat_interleave(H // t.shape[1], dim=1) for t in (k, v))
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)
    else:
        kwargs["is_causal"] = True
    if "scale" in params:
        kwargs["scale"] = scale
    elif abs(scale - D**-0.5) > 1e-12:
        raise ValueError(f"this torch's varlen_attn takes no scale (need {scale}); use model.kernels.attention=sdpa")
    return varlen_attn(q_thd, k, v, cu_q, cu_k, max_q, max_k, **kwargs)


def attend(q_bhtd, k_bhtd, v_bhtd, scale: float, cu_seqlens: torch.Tensor | None, kernel: str = "auto") -> torch.Tensor:
    """Causal attention (GQA) -> [B, T, H, D]; block-diagonal causal when documents are packed."""
    if cu_seqlens is None:
        out = F.scaled_dot_product_attention(q_bhtd, k_bhtd, v_bhtd, is_causal=True, scale=scale, enable_gqa=True)
        return out.transpose(1, 2)
    info = varlen_info(cu_seqlens)
    chosen = resolve_attention_kernel(kernel, True, q_bhtd.device, q_bhtd.dtype, info.mean_piece)
    if chosen == "flash_varlen":
        return _flash_varlen(q_bhtd, k_bhtd, v_bhtd, scale, cu_seqlens)
    if chosen == "cudnn":
        return _by_pieces(q_bhtd, k_bhtd, v_bhtd, scale, info.offsets)
    B, _, T, _ = q_bhtd.shape
    doc = document_ids(cu_seqlens, B, T)
    causal = torch.ones(T, T, dtype=torch.bool, device=q_bhtd.device).tril()
    mask = (doc[:, :, None] == doc[:, None, :]) & causal  # [B, T, T]
    out = F.scaled_dot_product_attention(q_bhtd, k_bhtd, v_bhtd, attn_mask=mask[:, None], scale=scale, enable_gqa=True)
    return out.transpose(1, 2)


class GatedAttention(nn.Module):
    """Full attention with a sigmoid output gate.

    q_proj emits [query | gate] per head ([H, 2*head_dim] rows, HF layout), so sharding q_proj by head keeps
    each head's query and gate rows together. Head counts come from weight shapes, so TP-local shards work.
    """

    def __init__(self, cfg: TextConfig, kernel: str = "auto"):
        super().__init__()
        if kernel not in ATTENTION_KERNELS:
            raise ValueError(f"model.kernels.attention={kernel!r}; valid: {list(ATTENTION_KERNELS)}")
        self.kernel = kernel
        self.head_dim = cfg.head_dim
        hd, bias = cfg.head_dim, cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_attention_heads * hd * 2, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * hd, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * hd, bias=bias)
        self.o_proj = nn.Linear(cfg.num_attention_heads * hd, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cu_seqlens=None) -> torch.Tensor:
        q, k, v, gate = self.project(x, rope)
        return self.output(self.mix(q, k, v, cu_seqlens), gate)

    # The decoder layer calls the three pieces itself: model.compile compiles project and output into the layer's
    # graphs (qwenft.models.qwen3_5.model.compile_layer); mix, the attention kernel, stays eager, and is the only
    # piece that reads cu_seqlens.
    @property
    def weight_grad_stack(self) -> tuple[str, ...]:
        """q (with the gate), k and v as one matmul on a tensor-parallel rank (as `MLP.weight_grad_stack`)."""
        return ("q_proj", "k_proj", "v_proj") if getattr(self.q_proj, "output_shard", False) else ()

    def project(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        """q, k, v [B, H, T, D] (normed, rotated) and the output gate [B, T, H * D]."""
        B, T, _ = x.shape
        hd = self.head_dim
        stacked = None
        if self.weight_grad_stack:
            from qwenft.models.weight_grad import stacked_projections  # it imports this module

            stacked = stacked_projections(self, x)
        q, k, v = stacked or (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        q_bthd, gate_bthd = q.view(B, T, -1, 2 * hd).chunk(2, dim=-1)
        q = self.q_norm(q_bthd).transpose(1, 2)
        k = self.k_norm(k.view(B, T, -1, hd)).transpose(1, 2)
        v = v.view(B, T, -1, hd).transpose(1, 2)
        cos, sin = rope
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v, gate_bthd.reshape(B, T, -1)

    def mix(self, q_bhtd, k_bhtd, v_bhtd, cu_seqlens=None, cp=None) -> torch.Tensor:
        """The attention kernel -> [B, T, H, D]; `cp`: this rank's `context_parallel.CPShard` when the stream is
        split over context-parallel ranks (inputs [1, H, L, D])."""
        if cp is not None:
            from .context_parallel import attend as attend_cp

            return attend_cp(q_bhtd, k_bhtd, v_bhtd, self.head_dim**-0.5, cp, self.kernel)
        return attend(q_bhtd, k_bhtd, v_bhtd, self.head_dim**-0.5, cu_seqlens, self.kernel)

    def output(self, out_bthd: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """The sigmoid gate and o_proj: [B, T, H, D] -> [B, T, hidden]."""
        B, T = gate.shape[:2]
        return self.o_proj(out_bthd.reshape(B, T, -1) * torch.sigmoid(gate))
