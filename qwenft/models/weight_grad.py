"""Weight gradients added into `.grad` by the kernels that form them (`model.kernels.weight_grad=in_matmul`).

Autograd forms each microbatch's weight gradient as a new tensor and then adds it into `.grad` (its
AccumulateGrad node): for a step of n microbatches, n - 1 passes that read two weight-sized tensors and write
one, memory-bound work as large as the weights themselves each time. Here the kernels add into `.grad` themselves:

- a linear's weight-gradient matmul is `grad.addmm_(dy^T, x)`: cuBLAS's beta = 1 reads the old gradient as part
  of the matmul (compute-bound, so about free), forms the sum in fp32 and rounds once;
- the embedding's backward adds each microbatch's token gradients into their rows of `.grad` (a token's repeats
  summed in fp32, each row rounded once: `add_token_rows_`) instead of writing a dense [vocab, hidden] gradient
  and adding it;
- the fused cross-entropy's weight gradient, formed in its forward, is added into `.grad` by its matmuls there,
  scaled by the loss's factor on the CE sum (known on the host before the step: `prepare_grads`' scales), or
  else scaled into `.grad` by one kernel in its backward (`ce_kernel.scale_add_`), instead of a scale pass and
  then autograd's add.

So `.grad` must exist before the step's first backward: `prepare_grads` makes it each module's `weight_grad`
buffer, zeroed, and every microbatch adds. Each buffer lives with its module for the run (a fixed address, no
allocation per step); `.grad` is set to it again at every step after `zero_grad(set_to_none=True)`. The linears
a layer multiplies as one matmul (`stacked_linears`, its `weight_grad_stack`) get rows of one buffer, which
that matmul adds into whole.

It needs each parameter's gradient to go from `.grad` straight to the optimizer: no FSDP2 (which reduce-scatters
a gradient it takes from autograd) and no pipeline parallelism (its schedules split the weight gradients off
through autograd). Under CUDA graphs (`model.cuda_graphs`) a compiled layer's backward graph adds into the
buffers at the addresses it was recorded with: the forward saves each buffer, so the backward takes it as a
static input (as it takes the weights), which a replay may write in place; the buffers live for the run, at one
address. Tensor parallelism without FSDP2 runs it: a tp-sharded weight (a DTensor whose rank multiplies its local
shard, qwenft.distributed.tensor_parallel) gets a buffer the size of its shard, and `.grad` is a DTensor over that
buffer with the weight's placements; each rank's shard gradient is whole on its rank, so nothing is summed over tp.
`spec.resolve_weight_grad` says where it runs.

Only the text model's `nn.Linear` and `nn.Embedding` themselves are switched, and the modules whose class adds
into the buffer itself (`takes_weight_grad`: the lm_head, tensor parallelism's sharded linears and vocab-parallel
embedding): each of those runs once a microbatch and every step. Float8 linears (subclasses) and parameters read
outside their module's forward (the MoE router's weight, LoRA's adapters, both through `F.linear`) keep autograd's
path, which then adds into the buffer in place; a frozen weight has no gradient. The vision tower keeps autograd's
path whole: it runs twice in a microbatch of images and videos, and not at all in a text-only step, where its
weights must keep no gradient (AdamW then leaves them alone).
"""

import itertools

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from qwenft.models.linear_ce import LMHead
from qwenft.models.qwen3_5.attention import local


def _addmm_weight_grad_(grad: torch.Tensor, dy: torch.Tensor, x: torch.Tensor) -> None:
    grad.addmm_(dy.reshape(-1, dy.shape[-1]).t(), x.reshape(-1, x.shape[-1]))


# An operator of its own, so that inside a compiled layer's backward the compiler keeps the in-place matmul (it
# would otherwise form the product and then add it). Defined through torch.library.Library rather than
# torch.library.custom_op, whose Python wrapper costs several times the call's own host time (docs/performance.md),
# once per switched linear and microbatch, eager or from a compiled graph.
_LIB = torch.library.Library("qwenft", "DEF")
_LIB.define("addmm_weight_grad_(Tensor(a!) grad, Tensor dy, Tensor x) -> ()")
_LIB.impl("addmm_weight_grad_", _addmm_weight_grad_, "CompositeExplicitAutograd")
torch.library.register_fake("qwenft::addmm_weight_grad_", lambda grad, dy, x: None, lib=_LIB)
# grad += dy^T @ x over all leading dimensions: [out, in] += [N, out]^T @ [N, in], in one matmul
addmm_weight_grad_ = torch.ops.qwenft.addmm_weight_grad_.default


def _addmm_weight_grads_(grads: list[torch.Tensor], dy: torch.Tensor, x: torch.Tensor) -> None:
    whole = torch.cat(grads)
    _addmm_weight_grad_(whole, dy, x)
    for grad, part in zip(grads, whole.split([g.shape[0] for g in grads])):
        grad.copy_(part)


_LIB.define("addmm_weight_grads_(Tensor(a!)[] grads, Tensor dy, Tensor x) -> ()")
_LIB.impl("addmm_weight_grads_", _addmm_weight_grads_, "CompositeExplicitAutograd")
torch.library.register_fake("qwenft::addmm_weight_grads_", lambda grads, dy, x: None, lib=_LIB)
# the same for weights stacked along their outputs: each grad_i += dy[..., rows of i]^T @ x, one matmul for all
# (the stacked sum formed in fp32 and rounded once, as each alone), into a copy of them stacked that is copied
# back: buffers made rows of one (`prepare_grads`' stacks) take `addmm_weight_grad_` on the whole instead
addmm_weight_grads_ = torch.ops.qwenft.addmm_weight_grads_.default


def _own(weight: torch.Tensor) -> torch.Tensor:
    """The tensor a rank multiplies: a tp-sharded DTensor weight's local shard, else the weight itself."""
    # the local tensor itself, as `attention.local` takes it: `to_local()` would add an autograd node in grad mode
    return weight._local_tensor if isinstance(weight, DTensor) else weight


def linear(x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """x @ weight^T, weight's gradient added into `grad` (its own tensor's shape: a DTensor's local shard) by the
    backward's matmul; autograd gets none for `weight`."""
    return _Linear.apply(x, weight, grad)


def embedding(ids: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor,
              zero: torch.Tensor | None = None) -> torch.Tensor:
    """weight[ids] (a DTensor's local rows), the rows' gradients put into `grad` by the backward. `zero`: the
    tokens whose output is zeros (a vocab-parallel rank's ids outside its shard), which the backward skips."""
    return _Embedding.apply(ids, weight, grad, zero)


class _Linear(torch.autograd.Function):
    """y = x @ weight^T; the backward returns x's gradient and adds weight's into `grad` (returning none for it).
    `weight` itself is the input, DTensor or not, so that the output needs a gradient whenever the weight does."""

    @staticmethod
    def forward(ctx, x, weight, grad):
        weight = _own(weight)
        # `grad` saved like x: each switched linear runs once a microbatch (`enable`), so nothing changes the buffer
        # between this forward and its backward (a compiled layer's backward takes it as a graph input)
        ctx.save_for_backward(x, weight, grad)
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, dy):
        x, weight, grad = ctx.saved_tensors
        addmm_weight_grad_(grad, dy, x)
        return (dy @ weight if ctx.needs_input_grad[0] else None), None, None


def stacked_linears(x: torch.Tensor, modules, groups: tuple[int, ...] | None = None,
                    grad: torch.Tensor | None = None, weight: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, ...] | None:
    """`stacked_linear`'s output split into each module's, as its own call gives it, or with `groups` (counts of
    consecutive modules) into each group's outputs side by side, views of one tensor; None where that is None."""
    y = stacked_linear(x, modules, grad, weight)
    if y is None:
        return None
    sizes = iter(_own(m.weight).shape[0] for m in modules)
    return y.split([sum(itertools.islice(sizes, n)) for n in groups or (1,) * len(modules)], dim=-1)


def stacked_projections(owner: nn.Module, x: torch.Tensor, groups: tuple[int, ...] | None = None
                        ) -> tuple[torch.Tensor, ...] | None:
    """`stacked_linears` over `owner.weight_grad_stack` with the owner's stacked weight (`stack_weights`) and
    gradient buffer (`prepare_grads`) where it has them; None where it has neither, or no stack: the caller runs
    its linears one by one (concatenating large weights at every call would cost more than the one matmul
    saves)."""
    names = owner.weight_grad_stack
    if not names:
        return None
    weight = owner.__dict__.get("weight_stack", (None,))[0]
    grad = owner.__dict__.get("weight_grad_stack_buffer", (None,))[0]
    if weight is None and grad is None:
        return None
    return stacked_linears(x, [getattr(owner, name) for name in names], groups, grad, weight)


def stacked_linear(x: torch.Tensor, modules, grad: torch.Tensor | None = None,
                   weight: torch.Tensor | None = None) -> torch.Tensor | None:
    """`x` through bias-free linears of one kind (`nn.Linear`, `GradInMatmulLinear`, or a class marked `stackable`:
    tensor parallelism's `ShardedLinear`) as one matmul of their weights (local shards) stacked: the modules'
    outputs side by side in the last dimension. None where one has a bias, a forward hook (LoRA's adapter) or
    another kind: call them one by one then. Each matmul of a projection with few outputs reads the whole input,
    as a large one does (GatedDeltaNet's `a` and `b`: one output per value head, 12 on a tp4 rank of the 27B);
    stacked, the input is read once forward and twice backward, not once per projection each time, and x's
    gradient is one matmul's, not a sum of one per projection. Under `model.kernels.weight_grad=in_matmul` (each
    module's `weight_grad` buffer set) one matmul adds the stacked weight gradient into the buffers, in place
    given `grad`, the buffer whose rows they are (the owner's `weight_grad_stack_buffer`, `prepare_grads`), else
    through a stacked copy. `weight`: the tensor whose rows the weights (local shards) are (the owner's
    `weight_stack`), which the matmuls read as it is; else the weights are concatenated into a copy, which the
    backward forms again rather than saving it. Without buffers autograd splits the stacked weight's gradient (and
    keeps the stacked copy for the backward)."""
    if not _stackable(modules):
        return None
    weights = [m.weight for m in modules]
    grads = [getattr(m, "weight_grad", None) for m in modules]
    if torch.is_grad_enabled() and all(g is not None for g in grads):
        # one buffer for all, not their views: inputs of a compiled graph that alias each other and are written
        # would take AOTAutograd's synthetic-base path
        rows = sum(g.shape[0] for g in grads)
        grads = [grad] if grad is not None and grad.shape == (rows, *grads[0].shape[1:]) else grads
        # the stacked tensor needs no gradient of its own: the output needs one through x, else (an input that needs
        # none) the weights go in themselves, so that the backward still runs and adds their gradients
        weights = [weight] if weight is not None and x.requires_grad else weights
        return _StackedLinear.apply(x, len(weights), *weights, *grads)
    if weight is not None and not torch.is_grad_enabled():
        return F.linear(x, weight)
    # autograd's own nodes, which a pipeline schedule's input-only backward runs without the weights' matmul
    return F.linear(x, torch.cat([local(w) for w in weights]))


def _stackable(modules) -> bool:
    """Whether `stacked_linear` multiplies `modules` as one matmul: bias-free, without forward hooks, of one kind
    that it knows."""
    kind = type(modules[0])
    return ((kind in (nn.Linear, GradInMatmulLinear) or getattr(kind, "stackable", False))
            and not any(type(m) is not kind or m.bias is not None or m._forward_hooks or m._forward_pre_hooks
                        for m in modules))


class _StackedLinear(torch.autograd.Function):
    """y = x @ [w_1; w_2; ...]^T; the backward adds each weight's gradient into its buffer (or the one buffer whose
    rows they are) from one matmul, returning none for the weights, as `_Linear` does for one."""

    @staticmethod
    def forward(ctx, x, n, *weights_and_grads):
        weights = [_own(w) for w in weights_and_grads[:n]]
        ctx.save_for_backward(x, *weights, *weights_and_grads[n:])
        ctx.n = n
        return F.linear(x, _stacked(weights))

    @staticmethod
    def backward(ctx, dy):
        x, *saved = ctx.saved_tensors
        weights, grads = saved[:ctx.n], saved[ctx.n:]
        if len(grads) == 1:
            addmm_weight_grad_(grads[0], dy, x)
        else:
            addmm_weight_grads_(grads, dy, x)
        dx = dy @ _stacked(weights) if ctx.needs_input_grad[0] else None
        return dx, None, *(None,) * (ctx.n + len(grads))


def _stacked(weights: list[torch.Tensor]) -> torch.Tensor:
    """The weights as one [rows, in] tensor: the one given itself (`stack_weights`' tensor), else their copy."""
    return weights[0] if len(weights) == 1 else torch.cat(weights)


class _Embedding(torch.autograd.Function):
    """weight[ids]; the backward puts each token's gradient into `grad` (returning none for the weight)."""

    @staticmethod
    def forward(ctx, ids, weight, grad, zero):
        out = F.embedding(ids, _own(weight))
        if zero is not None:  # those tokens' rows -1: no gradient to add
            out.masked_fill_(zero.unsqueeze(-1), 0)
            ids = ids.masked_fill(zero, -1)
        ctx.save_for_backward(ids)
        ctx.grad = grad  # not saved: a tied lm_head adds into it first, which autograd's version check would refuse
        return out

    @staticmethod
    def backward(ctx, dy):
        (ids,), grad = ctx.saved_tensors, ctx.grad
        add_token_rows_(grad, ids.reshape(-1), dy.reshape(-1, dy.shape[-1]))
        return None, None, None, None


def add_token_rows_(grad: torch.Tensor, ids: torch.Tensor, dy: torch.Tensor) -> None:
    """grad[ids[i]] += dy[i] for every token i whose id is not negative (-1: a token with no gradient to add), a
    token's repeats summed in fp32 and each row rounded once. On CUDA without a host sync: the ids sorted
    (stably, so a repeat's rows are summed in a fixed order: the same bits every run), then one kernel sums each
    run of one id and adds it into its row (`ce_kernel.add_sorted_rows_`, whose programs at a negative id return
    at once); `index_put_` into bf16 `grad` would round after every repeat. Elsewhere `index_put_` (the CPU runs
    in fp32)."""
    if not grad.is_cuda:
        keep = ids >= 0
        grad.index_put_((ids[keep],), dy[keep].to(grad.dtype), accumulate=True)
        return
    from qwenft.models.ce_kernel import add_sorted_rows_

    sorted_ids, order = ids.sort(stable=True)
    add_sorted_rows_(grad, sorted_ids, order, dy.contiguous())


class GradInMatmulLinear(nn.Linear):
    """nn.Linear whose weight gradient its backward matmul adds into `weight_grad` (the weight's `.grad` during
    a step, `prepare_grads`). The bias, if any, keeps autograd's path."""

    takes_weight_grad = True

    def forward(self, x):
        if not torch.is_grad_enabled() or self.weight_grad is None:
            return super().forward(x)
        y = linear(x, self.weight, self.weight_grad)
        return y if self.bias is None else y + self.bias


class GradInPlaceEmbedding(nn.Embedding):
    """nn.Embedding whose backward puts the token gradients into `weight_grad` (the weight's `.grad`)."""

    takes_weight_grad = True

    def forward(self, ids):
        if not torch.is_grad_enabled() or self.weight_grad is None or self.padding_idx is not None or self.max_norm:
            return super().forward(ids)
        return embedding(ids, self.weight, self.weight_grad)


def enable(model: nn.Module) -> list[str]:
    """Switch `model`'s trained plain linears and embeddings (exact classes: nn.Linear, nn.Embedding) to adding
    their weight gradients in place, and give the modules whose class does so itself (`takes_weight_grad`: the
    lm_head, `linear_ce.LMHead`, in its fused cross-entropy; tensor parallelism's sharded linears and
    vocab-parallel embedding) their buffer, all but the vision tower's (`model.visual`); returns the switched
    modules' names. Works on the meta device (no buffer is made yet)."""
    tower = getattr(model, "visual", None)
    skipped = set() if tower is None else {id(m) for m in tower.modules()}
    switched = []
    for name, module in model.named_modules():
        if id(module) in skipped:
            continue
        kind = {nn.Linear: GradInMatmulLinear, nn.Embedding: GradInPlaceEmbedding}.get(type(module))
        if kind is None and not getattr(type(module), "takes_weight_grad", False):
            continue
        if not module.weight.requires_grad:
            continue
        if kind is not None:
            module.__class__ = kind
        module.register_buffer("weight_grad", None, persistent=False)
        switched.append(name)
    return switched


def switched_modules(model_parts) -> list[nn.Module]:
    return [m for part in model_parts for m in part.modules() if hasattr(m, "weight_grad")]


def prepare_grads(model_parts, ce_scale: float | None = None, mtp_scale: float | None = None) -> None:
    """Before a step's first backward: each switched module's weight gets `.grad` = its buffer, zeroed (made at
    the first step; a weight shared by two modules, tied embeddings, one buffer for both; a DTensor weight's
    buffer is its local shard's size and `.grad` a DTensor over it, `_as_grad`). `ce_scale` and
    `mtp_scale`: the step's loss factors on the head's CE sum and on the MTP head's (1 / the step's label tokens;
    the MTP weight / its targets), which let the fused head add its weight gradient inside its forward matmuls
    (`linear_ce.LMHead.grad_scales`); None = the head scales it into the buffer in its backward."""
    every = [m for part in model_parts for m in part.modules()]  # one walk for the stacks and the switched
    by_param, to_zero = {}, []
    stacked = _stack_buffers(every, to_zero)
    for module in (m for m in every if hasattr(m, "weight_grad")):  # switched_modules' test
        if isinstance(module, LMHead):
            module.grad_scales = None if ce_scale is None and mtp_scale is None else (ce_scale, mtp_scale)
        weight = module.weight
        grad = by_param.get(id(weight))
        if grad is None:
            grad = stacked.get(id(weight))  # rows of its stack's buffer, zeroed with it
            if grad is None:
                own, grad = _own(weight), module.weight_grad
                if grad is None or grad.shape != own.shape or grad.device != own.device or grad.dtype != own.dtype:
                    grad = torch.zeros_like(own, memory_format=torch.contiguous_format)
                else:
                    to_zero.append(grad)
            by_param[id(weight)] = grad
            weight.grad = _as_grad(module, weight, grad)
        module.weight_grad = grad
    if to_zero:  # one call for all: a zero_ per buffer is a launch each, host time at the step's start
        torch._foreach_zero_(to_zero)


def _stack_buffers(modules, to_zero: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """The buffers of each module's `weight_grad_stack` (the names of its linears that it passes to `stacked_linear`
    together, in that order) as consecutive rows of one buffer, which the stack's one matmul adds into in place:
    {id(weight): its rows}. The buffer is made at the first step and kept on the module with its rows
    (`weight_grad_stack_buffer`; `to_zero` gets it at later steps); a stack that `stacked_linear` would not
    multiply as one, whose modules are not all switched, or whose weights differ in columns, dtype or device, or
    share one, keeps a buffer each."""
    rows = {}
    for owner in modules:
        stack = _stack_of(owner)
        if not stack:
            continue
        if not _one_matmul(stack):
            # a buffer each; none of the stack's, which `stacked_linear` would add into, and none of its rows
            # (views of one tensor share its version counter: one's in-place add would void the others' saves)
            if owner.__dict__.pop("weight_grad_stack_buffer", None) is not None:
                for m in stack:
                    if hasattr(m, "weight_grad"):
                        m.weight_grad = None
            continue
        owns = [_own(m.weight) for m in stack]
        first = owns[0]
        shape = (sum(o.shape[0] for o in owns), first.shape[1])
        whole, views = owner.__dict__.get("weight_grad_stack_buffer", (None, None))
        if whole is None or whole.shape != shape or whole.dtype != first.dtype or whole.device != first.device:
            whole = first.new_zeros(shape)
            views = whole.split([o.shape[0] for o in owns])
            owner.weight_grad_stack_buffer = (whole, views)
        else:
            to_zero.append(whole)
        rows.update({id(m.weight): view for m, view in zip(stack, views)})
    return rows


def _stack_of(owner: nn.Module) -> list[nn.Module]:
    """The linears of `owner.weight_grad_stack` in order (none where it has no stack)."""
    # looked up on the class first: a module's own `__getattr__` misses by raising, host time for each
    if not (hasattr(type(owner), "weight_grad_stack") or "weight_grad_stack" in owner.__dict__):
        return []
    return [getattr(owner, name) for name in owner.weight_grad_stack]


def _one_matmul(stack: list[nn.Module]) -> bool:
    """Whether `stacked_linear` multiplies `stack` as one matmul into one buffer: linears it stacks, all switched
    (a `weight_grad` each), no weight shared, their weights (local shards) 2-D of one width, dtype and device."""
    owns = [_own(m.weight) for m in stack]
    first = owns[0]
    return (_stackable(stack) and all(hasattr(m, "weight_grad") for m in stack)
            and len({id(m.weight) for m in stack}) == len(stack) and not any(
                o.dim() != 2 or o.shape[1] != first.shape[1] or o.dtype != first.dtype or o.device != first.device
                for o in owns))


def stack_weights(model_parts) -> int:
    """Each owner's `weight_grad_stack` of tensor-parallel shards (DTensor weights that `stacked_linear` multiplies as
    one matmul, each trained and switched to in_matmul) gets its weights' local shards as consecutive rows of one
    tensor, kept on the owner (`weight_stack`): the stack's matmuls, forward and backward, read that tensor as it
    is, where they would concatenate the shards into a copy at every call (a rank's MLP gate and up shards, 89 MB
    on a tp4 rank of the 27B). Each weight stays a parameter of its own, a DTensor over its rows with its
    placements, so the optimizer, the checkpoints and the exporter see what they saw; AdamW's in-place steps write
    the rows. Called once the weights are loaded and before anything holds the parameters (the optimizer), with
    the weights where they stay (no FSDP2, which owns its parameters' storage: in_matmul does not run there).
    Returns the number of stacks made."""
    made = 0
    for part in model_parts:
        for owner in part.modules():
            stack = _stack_of(owner)
            weights = [m.weight for m in stack]
            if (len(stack) < 2 or not all(isinstance(w, DTensor) and w.requires_grad for w in weights)
                    or not _one_matmul(stack)):
                continue
            owns = [w._local_tensor for w in weights]
            with torch.no_grad():
                whole = torch.cat(owns)
            for m, w, rows in zip(stack, weights, whole.split([o.shape[0] for o in owns])):
                shard = DTensor.from_local(rows, w.device_mesh, w.placements, run_check=False, shape=w.shape,
                                           stride=w.stride())
                m.weight = nn.Parameter(shard, requires_grad=w.requires_grad)
            # read by a CUDA graph at the address it was recorded with, as the parameters' local tensors are
            torch._dynamo.mark_static_address(whole)
            owner.weight_stack = (whole,)
            made += 1
    return made


def _as_grad(module: nn.Module, weight: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """`buffer` as `weight`'s `.grad`: itself, or for a DTensor weight a DTensor over it with the weight's
    placements, made once and kept on the module (a new one each step would be host work per weight)."""
    if not isinstance(weight, DTensor):
        return buffer
    of, grad = getattr(module, "weight_grad_dtensor", (None, None))  # (the buffer it is over, the DTensor)
    if of is not buffer:  # its local tensor is a view of the buffer, not the buffer object itself
        grad = DTensor.from_local(buffer, weight.device_mesh, weight.placements, run_check=False, shape=weight.shape,
                                  stride=weight.stride())
        module.weight_grad_dtensor = (buffer, grad)
    return grad
