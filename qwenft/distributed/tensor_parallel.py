"""Tensor parallelism for the native Qwen3.5 decoder: every projection sharded by head over the "tp" mesh.

| module                         | placement                                                             |
|--------------------------------|-----------------------------------------------------------------------|
| full attention q/k/v_proj      | column-parallel (q_proj rows are [head, query|gate], so heads stay whole) |
| full attention o_proj          | row-parallel (all-reduce of the output)                              |
| q_norm / k_norm weight         | replicated; grad summed over tp (`attention.local`)                    |
| GDN q/k/v/z/a/b_proj           | column-parallel: a contiguous split of key heads and of value heads keeps each key head's value heads on its rank |
| GDN conv_q/conv_k/conv_v, A_log, dt_bias | Shard(0) (per channel / per value head)                      |
| GDN gated norm weight          | replicated; grad summed over tp                                        |
| LoRA lora_A / lora_B (peft=lora) | column-parallel projection: A replicated (grad summed over tp), B Shard(0); row-parallel: A Shard(1), B replicated (grad summed over tp) |
| GDN out_proj, MLP down_proj    | row-parallel                                                           |
| MLP gate/up_proj               | column-parallel                                                        |
| MoE block (router, experts, shared expert) | plain, replicated: each tp rank routes and computes the whole block on the replicated residual stream (experts may be sharded over ep instead) |
| embed_tokens / lm_head         | vocab_parallel: Shard(0) over vocab (masked lookup + all-reduce; logits a DTensor sharded on vocab, `qwenft.models.loss.token_ce_sum` takes it; model.kernels.ce=fused: the head's CE on its local rows, all-reducing three fp32 numbers per token and the hidden gradient); else plain, replicated |
| layer norms, final norm, vision tower | plain, replicated (identical compute and grads on every tp rank); with sequence_parallel the layer norms' weights are replicated DTensors run on T/tp tokens |

Without sequence_parallel the residual stream between blocks is replicated on every tp rank.

The decoder layers do not run on DTensors. Their projections become `ShardedLinear`s: the parameters stay
DTensors (for FSDP2, the loader and checkpoints), and the forward multiplies their local shards as plain
tensors. Each attention / GatedDeltaNet block and each MLP communicates once each way, as Megatron-LM does:
`_ToBlock` on its input (forward: nothing, or all-gather the tokens under sequence parallelism; backward:
all-reduce, or reduce-scatter, the input gradients its column-parallel projections left on each rank) and
`_FromBlock` on its row-parallel output (the reverse). torch's ColwiseParallel / RowwiseParallel, which ran
every projection's ops and the hooks' redistributions through DTensor's dispatch, had made a tp2 layer's host
work 3.5-4.6x tp1's (docs/performance.md, host time). The vocab-parallel embedding runs on its local rows
too (`VocabParallelEmbedding`), and so does the vocab-parallel head with the fused cross-entropy
(`qwenft.models.linear_ce.fused_linear_ce_sum`); with model.kernels.ce=torch the head keeps torch's
ColwiseParallel, whose logits stay a DTensor for the vocab-parallel cross-entropy.

Every gradient has its parameter's placement, so with one data-parallel rank the model trains without FSDP2
(qwenft.train.spec.uses_fsdp): DTensor parameters next to plain ones, stepped on their local shards.
"""

import functools
import math
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from qwenft.models import weight_grad
from qwenft.models.qwen3_5.attention import local, shard_extent
from qwenft.models.qwen3_5.configs import FULL_ATTENTION, LINEAR_ATTENTION, TextConfig
from qwenft.models.qwen3_5.moe import MoE


def validate_tp(text: TextConfig, tp: int, sequence_parallel: bool = False) -> None:
    """Raise before anything is built when a head count of `text` cannot be split evenly over `tp` ranks, or
    when an MoE model asks for sequence parallelism (its replicated block would see T/tp tokens a rank, and its
    parameters' gradients would differ between tp ranks)."""
    if tp < 1:
        raise ValueError(f"mesh.tp={tp}; it must be >= 1")
    if tp > 1 and text.is_moe and sequence_parallel:
        raise ValueError(f"mesh.sequence_parallel=true with mesh.tp={tp} is not supported for an MoE model "
                         f"(num_experts={text.num_experts}); set mesh.sequence_parallel=false")
    counts = [("num_attention_heads", text.num_attention_heads, "full attention query heads"),
              ("num_key_value_heads", text.num_key_value_heads, "full attention key/value heads"),
              ("linear_num_key_heads", text.linear_num_key_heads, "GatedDeltaNet key heads"),
              ("linear_num_value_heads", text.linear_num_value_heads, "GatedDeltaNet value heads")]
    kinds = set(text.layer_types)
    counts = [c for c in counts if (FULL_ATTENTION if c[0].startswith("num_") else LINEAR_ATTENTION) in kinds]
    for key, n, what in counts:
        if n % tp:
            valid = [d for d in range(1, n + 1) if all(c % d == 0 for _, c, _ in counts)]
            raise ValueError(f"mesh.tp={tp} does not divide {key}={n} ({what}); valid mesh.tp: {valid}")


def shard_param(module: nn.Module, name: str, mesh: DeviceMesh, placement) -> None:
    """Replace `module.<name>` by a DTensor parameter of `placement` over `mesh`, cut from the full tensor."""
    p = getattr(module, name)
    # src_data_rank=None: every rank already holds the same (meta or loaded) tensor; no communication
    dt = distribute_tensor(p.data, mesh, [placement], src_data_rank=None)
    module.register_parameter(name, nn.Parameter(dt, requires_grad=p.requires_grad))


@dataclass(frozen=True)
class BlockPlan:
    """How tensor parallelism cuts one block of a decoder layer (the table in the module docstring): the norm
    in front of it carries the block's input hook, the column-parallel projections split their output rows by
    head, the row-parallel one its input columns, and `params` places the block's other parameters (dotted
    paths inside the block)."""
    norm: str
    block: str
    columns: tuple[str, ...]
    row: str
    params: tuple[tuple[str, object], ...] = ()


_MLP = BlockPlan("post_attention_layernorm", "mlp", ("gate_proj", "up_proj"), "down_proj")

# per layer type, its blocks in order; an MoE block in the MLP's place stays replicated
TP_PLAN = {
    FULL_ATTENTION: (
        BlockPlan("input_layernorm", "self_attn", ("q_proj", "k_proj", "v_proj"), "o_proj",
                  (("q_norm.weight", Replicate()), ("k_norm.weight", Replicate()))),
        _MLP),
    LINEAR_ATTENTION: (
        BlockPlan("input_layernorm", "linear_attn", tuple(f"{p}_proj" for p in "qkvzab"), "out_proj",
                  (("conv_q", Shard(0)), ("conv_k", Shard(0)), ("conv_v", Shard(0)),  # per channel
                   ("decay.A_log", Shard(0)), ("decay.dt_bias", Shard(0)),  # per value head
                   ("norm.weight", Replicate()))),
        _MLP),
}


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, vocab_parallel: bool = True,
             sequence_parallel: bool = False) -> None:
    """Shard `model` (a `Qwen3_5Model` or one pipeline stage of it, usually on the meta device) over `tp_mesh`.

    Call `validate_tp` first. Weights are not moved: loading afterwards (`qwenft.models.loader`) reads each
    rank's rows only.

    sequence_parallel: inside the layer stack the residual stream and the two norms of each layer hold only
    T/tp tokens per rank (the sequence must divide by tp). Each mixer and MLP all-gathers its input tokens
    and reduce-scatters its output (instead of one all-reduce); the stack's input is split on entry and its
    output gathered on exit, so embeddings, vision tower, final norm, head and pipeline stage boundaries
    see full sequences.
    """
    block_in = functools.partial(_block_input, mesh=tp_mesh, seq=sequence_parallel)
    block_out = functools.partial(_block_output, mesh=tp_mesh, seq=sequence_parallel)
    for layer in model.decoder_layers():  # the MTP head's full-attention layer too
        for plan in TP_PLAN[layer.layer_type]:
            block = getattr(layer, plan.block)
            if isinstance(block, MoE):  # the MoE block stays replicated (table above)
                continue
            for path, placement in plan.params:
                owner, _, name = f"{plan.block}.{path}".rpartition(".")
                shard_param(layer.get_submodule(owner), name, tp_mesh, placement)
            # a block's input is the output of the norm before it: the hook sits there, so that model.compile's
            # graphs, which run a norm and the block's projections together, trace it (model.compile_layer)
            getattr(layer, plan.norm).register_forward_hook(block_in)
            for name in plan.columns:
                _local_linear(getattr(block, name), tp_mesh, Shard(0))
            _local_linear(getattr(block, plan.row), tp_mesh, Shard(1))
            getattr(block, plan.row).register_forward_hook(block_out)
            if sequence_parallel:  # the norm sees T/tp tokens
                shard_param(getattr(layer, plan.norm), "weight", tp_mesh, Replicate())
    if sequence_parallel:  # each stack's input is split and its output gathered: the trunk's, the MTP head's
        for stack in (list(model.layers.values()), [] if model.mtp is None else list(model.mtp.layers.values())):
            if stack:
                stack[0].register_forward_pre_hook(functools.partial(_split_tokens, mesh=tp_mesh))
                stack[-1].register_forward_hook(functools.partial(_gather_tokens, mesh=tp_mesh))
    if vocab_parallel:
        if model.embed_tokens is not None:
            shard_param(model.embed_tokens, "weight", tp_mesh, Shard(0))
            model.embed_tokens.__class__ = VocabParallelEmbedding
        if model.lm_head is not None and model.lm_head.ce_kernel == "fused":
            # the fused CE multiplies the local rows itself (linear_ce.fused_linear_ce_sum): plain tensors, no hooks
            shard_param(model.lm_head, "weight", tp_mesh, Shard(0))
        elif model.lm_head is not None:
            # logits stay a DTensor sharded on vocab: token_ce_sum runs a vocab-parallel cross-entropy on it
            parallelize_module(model, tp_mesh, {"lm_head": ColwiseParallel(output_layouts=Shard(-1),
                                                                           use_local_output=False)})
        if hasattr(model, "tie_weights"):  # both now Shard(0) over vocab: share the one DTensor again
            model.tie_weights()


def _split_tokens(layer, args, mesh):
    """Sequence parallel entry: keep this rank's contiguous T/tp tokens of every row (backward: all-gather)."""
    h, *rest = args
    if h.shape[1] % mesh.size():
        raise ValueError(f"sequence parallelism needs the sequence length to divide by mesh.tp: {h.shape[1]} "
                         f"tokens per row, tp={mesh.size()}; pick data.seq_len as a multiple of {mesh.size()}")
    return (_StackTokens.apply(h, mesh, False), *rest)


def _gather_tokens(layer, args, output, mesh):
    """Sequence parallel exit: all-gather the tokens (backward: keep this rank's slice of the gradient)."""
    return _StackTokens.apply(output, mesh, True)


def _own_tokens(x: torch.Tensor, mesh) -> torch.Tensor:
    """This rank's contiguous T/tp tokens of every row of [B, T, ...]."""
    t = x.shape[1] // mesh.size()
    start = mesh.get_local_rank() * t
    return x[:, start:start + t].contiguous()


class _StackTokens(torch.autograd.Function):
    """The sequence-parallel stack's entry (`gather=False`: keep this rank's tokens; backward: all-gather) or exit
    (`gather=True`: all-gather; backward: keep this rank's slice), through the blocks' own collectives on plain
    tensors (DTensor's redistribute costs host time in its dispatch at every microbatch). Every rank computes the
    stack's input and, after the exit, the head on whole rows alike, so each rank's gradient at the exit is whole."""

    @staticmethod
    def forward(ctx, x, mesh, gather):
        ctx.mesh, ctx.gather = mesh, gather
        return (_all_gather_tokens if gather else _own_tokens)(x, mesh)

    @staticmethod
    def backward(ctx, grad):
        return (_own_tokens if ctx.gather else _all_gather_tokens)(grad, ctx.mesh), None, None


def _local_linear(linear: nn.Linear, mesh: DeviceMesh, placement) -> None:
    """Shard `linear`'s weight over `mesh` (placement Shard(0): column-parallel, Shard(1): row-parallel) and run
    it on the local shard. A bias is sharded with a column-parallel weight, replicated with a row-parallel one.

    The parameters stay DTensors (FSDP2 shards them further over dp, the loader and checkpoints read their
    placements); the forward multiplies plain tensors: `attention.local` adds each local gradient to the
    parameter's `.grad`, with the same placement (or, model.kernels.weight_grad=in_matmul, the weight-gradient
    matmul adds into the local tensor of `.grad` itself), so the shards' gradients need no communication. Only
    `_block_input` / `_block_output` communicate, once per block, and the projections' ops skip DTensor's
    dispatch."""
    shard_param(linear, "weight", mesh, placement)
    if linear.bias is not None:  # row-parallel: replicated, added once by `_block_output`
        shard_param(linear, "bias", mesh, Shard(0) if placement == Shard(0) else Replicate())
    column = placement == Shard(0)
    # a plain attribute, not the bias's placement: model.compile's graphs see the bias as its local tensor
    linear.sharded_bias = linear.bias is not None and column
    # column-parallel: 1/tp of the outputs from the whole input (`GatedDeltaNet.weight_grad_stack`)
    linear.output_shard = column
    # LoRA adapters (qwenft.models.lora) follow the weight: column-parallel, A replicated and B split like the
    # output rows; row-parallel, A split like the input columns and B replicated. Each rank's adapter output is
    # then a shard of the rows, or a partial sum, exactly as the base's, and the block's one collective covers it.
    if hasattr(linear, "lora_A"):
        shard_param(linear.lora_A, "weight", mesh, Replicate() if column else Shard(1))
    if hasattr(linear, "lora_B"):
        shard_param(linear.lora_B, "weight", mesh, Shard(0) if column else Replicate())
    # one class for all (compiled graphs guard on the type, not per instance); model.fp8's float8 linears keep
    # their float8 matmul on the local shards
    if type(linear).__name__ == "Float8Linear":
        from qwenft.distributed.float8 import sharded_float8_linear

        linear.__class__ = sharded_float8_linear()
    else:
        linear.__class__ = ShardedLinear


class ShardedLinear(nn.Linear):
    """An nn.Linear whose DTensor weight (and a column-parallel bias) are multiplied as local shards. With
    model.kernels.weight_grad=in_matmul (`weight_grad.enable` gives it a `weight_grad` buffer, its shard's size)
    the backward's matmul adds the weight's gradient into that buffer, the local tensor of the weight's `.grad`."""

    takes_weight_grad = True
    stackable = True  # `weight_grad.stacked_linears`: the local shards stacked, as one matmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a row-parallel bias is replicated: `_block_output` adds it once, to rank 0's partial output
        bias = local(self.bias) if self.sharded_bias else None
        grad = getattr(self, "weight_grad", None)
        if grad is None or not torch.is_grad_enabled():
            return F.linear(x, local(self.weight), bias)
        y = weight_grad.linear(x, self.weight, grad)
        return y if bias is None else y + bias


class VocabParallelEmbedding(nn.Embedding):
    """An nn.Embedding whose weight is a DTensor sharded over the vocabulary (Shard(0)) on the tp mesh. Each rank
    looks the ids up in its own rows (ids outside them give zeros) and one all-reduce sums the ranks' rows; the
    backward gives each rank the gradient of its own rows only, a Shard(0) gradient like the weight (torch's
    RowwiseParallel returns it replicated, the whole vocabulary on every rank, which only FSDP2 cuts back to
    the shard). Plain tensors throughout, as `ShardedLinear`. An id outside the whole vocabulary gives zeros here,
    where nn.Embedding raises: the tokenizer's ids fit the model's vocabulary (checked when a run is built,
    `train.build._fit_vocab`), and a check per forward would cost a device-to-host sync. The ids outside the shard
    look up rows spread over it (each token's position modulo the rows), whose outputs are then zeroed: all on one
    row, they would be one run of (tp - 1) / tp of the tokens in the backward's sorted ids. Under
    model.kernels.weight_grad=in_matmul, where the backward puts the rows' gradients into the `weight_grad` buffer
    (the local tensor of the weight's `.grad`), they are zeroed in place and their gradients skipped (id -1)."""

    takes_weight_grad = True

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mesh = self.weight.device_mesh
        (rows, _), (start, _) = shard_extent(self.weight)
        outside = (ids < start) | (ids >= start + rows)
        own_ids = torch.where(outside, torch.arange(ids.numel(), device=ids.device).view_as(ids) % rows, ids - start)
        grad = getattr(self, "weight_grad", None)
        if grad is None or not torch.is_grad_enabled():
            out = F.embedding(own_ids, local(self.weight)).masked_fill(outside.unsqueeze(-1), 0)
        else:  # the outside tokens zeroed in place, and skipped by the backward's put (no masking of its input)
            out = weight_grad.embedding(own_ids, self.weight, grad, zero=outside)
        return _FromBlock.apply(out, mesh, False)


# renamed *_single in torch 2.13 (the old names warn there); torch 2.11 has only the old ones (the fallbacks go
# with torch 2.11)
_funcol_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_funcol_reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
_c10d_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_c10d_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _wait(t: torch.Tensor) -> torch.Tensor:
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


# Eager, the blocks' collectives are c10d's ops: the functional collectives' dispatch (a custom op, its
# autograd shim and an AsyncCollectiveTensor per call) costs several times c10d's host work, once per block
# input and output. Traced by model.compile, the functional ones, which the graph absorbs.
def _all_reduce(x, mesh):
    if torch.compiler.is_compiling():
        return _wait(funcol.all_reduce(x.contiguous(), "sum", mesh))
    # into a copy, as the functional all-reduce does: `x` may be held elsewhere (selective activation
    # checkpointing keeps the row-parallel matmul's output and hands it to the recompute)
    x = x.contiguous().clone()
    dist.all_reduce(x, group=mesh.get_group())
    return x


# Both token collectives work on dim 0, rank-major, and lay the tokens out themselves, traced or not: given
# another dim, torch 2.11's functional all-gather rearranges its output through a helper that Dynamo does not
# trace, a graph break at every sequence-parallel block input that splits each compiled layer into pieces.
def _all_gather_tokens(x, mesh):
    """[B, t, ...] on each rank -> [B, tp * t, ...], the ranks' tokens in rank order."""
    n = mesh.size()
    if torch.compiler.is_compiling():
        out = _wait(_funcol_all_gather(x.contiguous(), 0, mesh))
    else:
        out = x.new_empty((n * x.shape[0], *x.shape[1:]))
        _c10d_all_gather(out, x.contiguous(), group=mesh.get_group())
    # the ranks' [B, t, ...] one after the other -> [B, tp * t, ...]: a view when B = 1
    return out.view(n, *x.shape).movedim(0, 1).reshape(x.shape[0], n * x.shape[1], *x.shape[2:])


def _reduce_scatter_tokens(x, mesh):
    """[B, T, ...] partial sums on each rank -> this rank's [B, T / tp, ...] of their sum."""
    n = mesh.size()
    b, t = x.shape[0], x.shape[1] // n
    # rank-major [tp * B, t, ...]: no copy when B = 1
    chunks = x.reshape(b, n, t, *x.shape[2:]).movedim(1, 0).reshape(n * b, t, *x.shape[2:])
    if torch.compiler.is_compiling():
        return _wait(_funcol_reduce_scatter(chunks.contiguous(), "sum", 0, mesh))
    out = x.new_empty((b, t, *x.shape[2:]))
    _c10d_reduce_scatter(out, chunks.contiguous(), group=mesh.get_group())
    return out


class _ToBlock(torch.autograd.Function):
    """A block's input, replicated: forward as is (sequence parallel: all-gather the tokens); backward sum the
    gradients that the block's column-parallel projections left on each rank (reduce-scatter the tokens)."""

    @staticmethod
    def forward(ctx, x, mesh, seq):
        ctx.mesh, ctx.seq = mesh, seq
        return _all_gather_tokens(x, mesh) if seq else x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (_reduce_scatter_tokens if ctx.seq else _all_reduce)(grad, ctx.mesh), None, None


class _FromBlock(torch.autograd.Function):
    """A row-parallel projection's output: forward sum the ranks' partial outputs (sequence parallel:
    reduce-scatter the tokens); backward the gradient is already whole on each rank (all-gather the tokens)."""

    @staticmethod
    def forward(ctx, y, mesh, seq):
        ctx.mesh, ctx.seq = mesh, seq
        return (_reduce_scatter_tokens if seq else _all_reduce)(y, mesh)

    @staticmethod
    def backward(ctx, grad):
        return (_all_gather_tokens(grad, ctx.mesh) if ctx.seq else grad), None, None


def _block_input(norm, args, output, mesh, seq):
    return _ToBlock.apply(output, mesh, seq)


def _block_output(linear, args, output, mesh, seq):
    if linear.bias is not None:
        # the replicated bias goes into rank 0's partial output only, so the ranks' sum holds it once and only
        # rank 0's local gradient is nonzero: `local` sums it over tp into the whole gradient on every rank
        output = output + local(linear.bias) * (1.0 if mesh.get_local_rank() == 0 else 0.0)
    return _FromBlock.apply(output, mesh, seq)


def _norm_group(grad: torch.Tensor):
    """How `clip_grad_norm_` reduces a gradient's norm: None for a plain tensor; for a DTensor (its mesh, the mesh
    dimensions it is sharded over), or (its mesh, None) where it holds a partial sum."""
    if not isinstance(grad, DTensor):
        return None
    if any(pl.is_partial() for pl in grad.placements):
        return grad.device_mesh, None
    # every placement but a replicated one splits the elements over its dimension (Shard, FSDP2's _StridedShard)
    return grad.device_mesh, tuple(i for i, pl in enumerate(grad.placements) if not pl.is_replicate())


def _local_norm(tensors: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The norm of these tensors' elements, each tensor's norm formed in fp32 at least (a bf16 gradient's too, an
    fp64 one's in fp64); 0 where they hold no element (a rank's empty shard: the neutral value of the sum or max
    it joins)."""
    by_dtype = defaultdict(list)
    for t in tensors:
        if t.numel():
            by_dtype[torch.promote_types(t.dtype, torch.float32)].append(t)
    if not by_dtype:
        return torch.zeros((), device=tensors[0].device)
    norms = [n for dtype, ts in by_dtype.items() for n in torch._foreach_norm(ts, norm_type, dtype=dtype)]
    return torch.linalg.vector_norm(torch.stack(norms), norm_type)


def _reduce_norm(norm: torch.Tensor, norm_type: float, groups) -> torch.Tensor:
    """This rank's norm combined with those of the other ranks of each process group in `groups`: their max for
    the inf-norm, else (sum of norm^p)^(1/p)."""
    inf = math.isinf(norm_type)
    if not inf:
        norm = norm**norm_type
    for group in groups:
        dist.all_reduce(norm, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=group)
    return norm if inf else norm ** (1.0 / norm_type)


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0, pp_group=None, device=None,
                    optimizer=None) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` for parameters on different meshes, optionally over pipeline stages.

    TP + FSDP leaves (dp, tp) DTensors for sharded weights next to dp-only DTensors (or plain tensors) for
    replicated ones, and torch's version refuses to stack norms from different meshes. The gradients are grouped by
    mesh and by the mesh dimensions they are split over; a group's norm is formed from each rank's local shards and
    summed over those dimensions' ranks (replicated copies counted once), then the groups' norms are combined (and
    over `pp_group`, each stage holding its own parameters). Each tensor's norm is formed in fp32 at least. Returns
    the total norm as a plain tensor, equal on all ranks, as one process would compute it. `device`: where the
    norm lives on a rank without gradients (a pipeline stage that holds none of `parameters`).
    `optimizer`: one with `scale_grads(params, coef)` (`LowPrecisionAdamW`) takes the clip coefficient into its
    next step instead of a pass of its own over every gradient here.
    """
    if not norm_type > 0:
        raise ValueError(f"clip_grad_norm_: norm_type={norm_type}; valid: a positive number or inf")
    params = [p for p in parameters if p.grad is not None]
    groups = defaultdict(list)
    for p in params:
        groups[_norm_group(p.grad)].append(p.grad)
    norms = []
    for key, grads in groups.items():  # each group's norm, in fp32
        if key is None:
            norms.append(_local_norm(grads, norm_type))
        elif key[1] is None:  # a partial gradient: DTensor's own reduction
            norms.append(torch.nn.utils.get_total_norm(grads, norm_type).full_tensor().float())
        else:  # from the local shards, without DTensor's dispatch per gradient (host time a step, the GPU waiting)
            mesh, dims = key
            norms.append(_reduce_norm(_local_norm([g._local_tensor for g in grads], norm_type), norm_type,
                                      [mesh.get_group(dim) for dim in dims]))
    device = params[0].device if params else device
    total = torch.linalg.vector_norm(torch.stack(norms), norm_type) if norms else torch.zeros((), device=device)
    if pp_group is not None:
        total = _reduce_norm(total, norm_type, [pp_group])
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    if optimizer is not None:
        optimizer.scale_grads(params, coef)
        return total
    with torch.no_grad():
        for grads in groups.values():
            for g in grads:
                (g.to_local() if isinstance(g, DTensor) else g).mul_(coef.to(g.dtype))
    return total
