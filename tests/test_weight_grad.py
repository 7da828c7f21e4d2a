"""model.kernels.weight_grad=in_matmul (qwenft.models.weight_grad): the weight gradients are added into `.grad` by
the kernels that form them, never formed apart and added by autograd. The same gradients as autograd's (fp64,
eager and compiled), no weight-sized add in the backward, the same training as autograd's, and where it runs."""

import contextlib
import copy
import types

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from distributed import run_distributed
from helpers import (assert_same_grads, assert_same_training, assert_within, compose, fp32_rtol, parity_overrides,
                     train_job, train_with_grads)


class _Ops(TorchDispatchMode):
    """The aten ops run under it, with their first argument."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append((str(func), args[0] if args else None))
        return func(*args, **(kwargs or {}))


def _adds_into(ops, tensors) -> list[str]:
    """The in-place adds (autograd's accumulation; a tensor-parallel rank's `_LocalParams` adds a list of them at
    once) whose destination is one of `tensors` or a view of one (a DTensor `.grad`'s local tensor)."""
    def storages(ts):
        return {t.untyped_storage().data_ptr() for t in ts if isinstance(t, torch.Tensor)}

    into = storages(tensors)
    return [name for name, first in ops if name.startswith(("aten.add_", "aten._foreach_add_"))
            and into & storages(first if isinstance(first, (list, tuple)) else [first])]


def _buffers_in(into, buffers) -> int:
    """How many of `buffers` an in-place op's destination (a tensor or a list) covers: each one, or the rows of
    each that lie in it."""
    def span(t):
        start = t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size()
        return t.untyped_storage().data_ptr(), start, start + t.numel() * t.element_size()

    spans = [span(t) for t in (into if isinstance(into, (list, tuple)) else [into])]
    return sum(any(s == b[0] and lo <= b[1] and b[2] <= hi for s, lo, hi in spans) for b in map(span, buffers))


class _Net(nn.Module):
    """An embedding tied to a fused-CE head, a linear with a bias and one without, the head's MTP-style second
    loss through the same weight: every path of weight_grad in one model."""

    def __init__(self, mtp_weight: float = 0.3):
        super().__init__()
        from qwenft.models.linear_ce import LMHead

        self.mtp_weight = mtp_weight
        self.embed = nn.Embedding(50, 16)
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16, bias=False)
        self.head = LMHead(16, 50, ce_kernel="fused", ce_chunk_tokens=16)
        self.head.weight = self.embed.weight

    def forward(self, ids, labels):
        h = self.down(torch.tanh(self.up(self.embed(ids))))
        ce, mtp_ce, _ = self.head(h, labels, mtp=(0.5 * h, labels.flip(-1), False))
        return ce + self.mtp_weight * mtp_ce


@pytest.mark.parametrize("head_scales", [False, True], ids=["head-scaled-in-backward", "head-scaled-in-forward"])
def test_eager_gradients_equal_autograds_without_its_adds(head_scales):
    """Three microbatches in fp64, ids repeated within each: every `.grad` equals autograd's path to fp64 rounding;
    it is the module's buffer, and no op of the backward adds into it (autograd's accumulation would). Given the
    loss's factors on the head's two CE sums (`head_scales`, as the runner gives them), the head adds its gradient
    in its forward matmuls and its backward touches no buffer at all; else its backward scales it in (one
    addcmul, the CPU's form of `scale_add_`)."""
    from qwenft.models import weight_grad

    torch.manual_seed(0)
    reference = _Net().double()
    model = copy.deepcopy(reference)
    model.head.weight = model.embed.weight
    assert weight_grad.enable(model) == ["embed", "up", "down", "head"]
    scales = dict(ce_scale=1 / 48, mtp_scale=0.3 / 48) if head_scales else {}
    weight_grad.prepare_grads([model], **scales)
    buffers = [model.embed.weight_grad, model.up.weight_grad, model.down.weight_grad]
    assert model.head.weight_grad is model.embed.weight_grad  # tied: one buffer
    for step in range(3):
        ids = torch.randint(0, 50, (2, 24), generator=torch.Generator().manual_seed(step))
        labels = ids.roll(-1, dims=1)
        (reference(ids, labels) / 48).backward()
        loss = model(ids, labels) / 48
        with _Ops() as ops:
            loss.backward()
        assert _adds_into(ops.ops, buffers) == [], ops.ops
        head_adds = [name for name, first in ops.ops if name == "aten.addcmul_.default" and first is buffers[0]]
        assert len(head_adds) == (0 if head_scales else 2), ops.ops
    for (name, ref), (_, p) in zip(reference.named_parameters(), model.named_parameters()):
        # the head's weight: autograd's path scales by the fp32 loss's gradient, 1/48 rounded to fp32 (the fused
        # CE's loss is fp32), the forward path by the exact factor: they differ by fp32's rounding of it
        tol = 1e-7 if head_scales and name == "embed.weight" else 1e-13
        assert ((p.grad - ref.grad).norm() / ref.grad.norm()).item() < tol, name
    assert model.up.weight.grad is model.up.weight_grad and model.embed.weight.grad is model.embed.weight_grad
    # a step later: .grad dropped by zero_grad(set_to_none) comes back as the same buffer, zeroed
    model.zero_grad(set_to_none=True)
    weight_grad.prepare_grads([model])
    assert model.up.weight.grad is buffers[1] and not buffers[1].any()


def test_a_head_scale_the_loss_did_not_give_fails_the_backward():
    """The head added its gradient in the forward with the factor the runner promised; a loss that gives its CE
    sum another factor fails the backward instead of training on a wrong gradient."""
    from qwenft.models import weight_grad

    model = _Net().double()
    model.head.weight = model.embed.weight
    weight_grad.enable(model)
    weight_grad.prepare_grads([model], ce_scale=1 / 48, mtp_scale=0.3 / 48)
    ids = torch.randint(0, 50, (2, 24), generator=torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="another scale than the loss gave it"):
        (model(ids, ids.roll(-1, dims=1)) / 47).backward()


def test_a_zero_mtp_weight_is_a_scale_like_any_other():
    """model.mtp_loss_weight=0 (allowed): the MTP loss's factor 0 is checked as given, and the gradients are the
    CE's alone, as autograd's."""
    from qwenft.models import weight_grad

    torch.manual_seed(0)
    reference = _Net(mtp_weight=0.0).double()
    model = copy.deepcopy(reference)
    model.head.weight = model.embed.weight
    weight_grad.enable(model)
    weight_grad.prepare_grads([model], ce_scale=1 / 48, mtp_scale=0.0)
    ids = torch.randint(0, 50, (2, 24), generator=torch.Generator().manual_seed(0))
    for net in (reference, model):
        (net(ids, ids.roll(-1, dims=1)) / 48).backward()
    for (name, ref), (_, p) in zip(reference.named_parameters(), model.named_parameters()):
        assert ((p.grad - ref.grad).norm() / ref.grad.norm()).item() < 1e-7, name


def test_compiled_backward_adds_in_its_matmuls():
    """A compiled MLP (as model.compile's layer graphs hold the linears): its backward calls the in-place matmul
    op for every weight and adds into no `.grad`, and the gradients over two microbatches equal the eager
    autograd path's (fp32: the compiled graph sums as eager does)."""
    from qwenft.models import weight_grad

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate, self.up, self.down = nn.Linear(16, 32, False), nn.Linear(16, 32, False), nn.Linear(32, 16, False)

        def forward(self, x):
            return self.down(nn.functional.silu(self.gate(x)) * self.up(x))

    torch.manual_seed(0)
    reference = MLP()
    model = copy.deepcopy(reference)
    weight_grad.enable(model)
    weight_grad.prepare_grads([model])
    compiled = torch.compile(model.forward, dynamic=False, fullgraph=True)
    for step in range(2):
        x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(step))
        reference(x).square().sum().backward()
        loss = compiled(x.requires_grad_()).square().sum()
        with _Ops() as ops:
            loss.backward()
        names = [name for name, _ in ops.ops]
        assert names.count("qwenft.addmm_weight_grad_.default") == 3, names
        assert _adds_into(ops.ops, [m.weight_grad for m in (model.gate, model.up, model.down)]) == [], names
    for (name, ref), (_, p) in zip(reference.named_parameters(), model.named_parameters()):
        assert ((p.grad - ref.grad).norm() / ref.grad.norm()).item() < 1e-6, name


class _Stack(nn.Module):
    """Three bias-free linears of one input that a layer multiplies stacked (`weight_grad_stack`), as
    GatedDeltaNet does its projections."""

    weight_grad_stack = ("p", "q", "r")

    def __init__(self):
        super().__init__()
        self.p, self.q, self.r = (nn.Linear(16, n, bias=False) for n in (3, 5, 2))

    def forward(self, x, groups=None, stacked=True):
        from qwenft.models import weight_grad

        mods = [self.p, self.q, self.r]
        if not stacked:
            outs = [m(x) for m in mods]
            return outs if groups is None else (torch.cat(outs[:2], dim=-1), outs[2])
        grad = getattr(self, "weight_grad_stack_buffer", (None,))[0]
        return weight_grad.stacked_linears(x, mods, groups=groups, grad=grad) or [m(x) for m in mods]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_stacked_linears_equal_each_linear(compiled):
    """`stacked_linears` (a layer's projections of one input as one matmul): in fp64 over two steps of two
    microbatches, the outputs and every gradient equal each linear's own call, on plain linears (autograd's path,
    which splits the stacked weight's gradient), on switched ones (`in_matmul`) whose buffers `prepare_grads`
    made rows of one (the owner's `weight_grad_stack`: one `addmm_weight_grad_` into that buffer) and on switched
    ones without (`addmm_weight_grads_` over their buffers), with and without `groups` (the first two modules'
    outputs one view), eager and compiled, with no other add into a buffer; a bias, a forward hook (LoRA's
    adapter) or two kinds of module give None (called one by one), and a stack with a hooked module gets a buffer
    each at the next `prepare_grads`, its one buffer dropped."""
    from qwenft.models import weight_grad

    torch.manual_seed(0)
    reference = _Stack().double()
    plain, stacked, apart = (copy.deepcopy(reference) for _ in range(3))
    for model in (stacked, apart):
        weight_grad.enable(model)
    apart.weight_grad_stack = ()  # a buffer each
    run = (lambda model, x, groups: model(x, groups)) if not compiled else torch.compile(
        lambda model, x, groups: model(x, groups), dynamic=False, fullgraph=True)
    for step in range(2):
        for model in (stacked, apart):
            weight_grad.prepare_grads([model])
        for micro, groups in enumerate((None, (2, 1))):
            x = torch.randn(2, 7, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2 * step + micro))
            sizes = (3, 5, 2) if groups is None else (8, 2)
            probes = [torch.randn(2, 7, n, dtype=torch.float64) for n in sizes]
            loss = lambda outs: sum((o * p).sum() for o, p in zip(outs, probes))  # noqa: E731
            xs = [x.clone().requires_grad_() for _ in range(4)]
            loss(reference(xs[0], groups, stacked=False)).backward()
            loss(run(plain, xs[1], groups)).backward()
            for model, got, op in ((stacked, xs[2], "addmm_weight_grad_"), (apart, xs[3], "addmm_weight_grads_")):
                out = run(model, got, groups)
                with _Ops() as ops:
                    loss(out).backward()
                names = [name for name, _ in ops.ops]
                assert [n for n in names if n.startswith("qwenft.")] == [f"qwenft.{op}.default"], names
                assert _adds_into(ops.ops, [m.weight_grad for m in (model.p, model.q, model.r)]) == [], names
            for got in xs[1:]:
                assert ((got.grad - xs[0].grad).norm() / xs[0].grad.norm()).item() < 1e-13
        for model in (plain, stacked, apart):
            for ref, p in zip(reference.parameters(), model.parameters()):
                assert ((p.grad - ref.grad).norm() / ref.grad.norm()).item() < 1e-13
            model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
    weight_grad.prepare_grads([stacked])
    whole = stacked.weight_grad_stack_buffer[0]
    assert stacked.p.weight.grad is stacked.p.weight_grad and all(
        m.weight_grad.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
        for m in (stacked.p, stacked.q, stacked.r))
    assert not hasattr(apart, "weight_grad_stack_buffer")
    with_bias = [nn.Linear(16, 3), nn.Linear(16, 5, bias=False)]
    hooked = copy.deepcopy(reference)
    hooked.q.register_forward_hook(lambda module, args, out: out + 1)
    for mods in (with_bias, [hooked.p, hooked.q], [reference.p, stacked.q]):
        assert weight_grad.stacked_linears(torch.zeros(1, 16, dtype=torch.float64), tuple(mods)) is None
    for model in (stacked, reference):
        model.q.register_forward_hook(lambda module, args, out: out * 2)
    weight_grad.prepare_grads([stacked])
    assert not hasattr(stacked, "weight_grad_stack_buffer")
    assert len({m.weight_grad.untyped_storage().data_ptr() for m in (stacked.p, stacked.q, stacked.r)}) == 3
    reference.zero_grad(set_to_none=True)
    for micro in range(2):  # each linear's own in-place add into its own buffer, saved inputs intact
        x = torch.randn(2, 7, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(10 + micro))
        for model in (reference, stacked):
            sum(o.square().sum() for o in model(x, stacked=model is stacked)).backward()
    for ref, p in zip(reference.parameters(), stacked.parameters()):
        assert ((p.grad - ref.grad).norm() / ref.grad.norm()).item() < 1e-13


def test_frozen_float8_and_parameterless_uses_keep_autograd():
    """Only the exact nn.Linear / nn.Embedding classes and those that take the buffer themselves (LMHead, the tp
    shards') switch, and only with a trained weight: a frozen
    linear, a subclass (torchao's float8 linear is one) and a parameter read outside its module's forward keep
    autograd's path (the last with `.grad` as the buffer, which autograd's accumulation adds into in place)."""
    from qwenft.models import weight_grad

    class Sub(nn.Linear):
        pass

    model = nn.ModuleDict({"frozen": nn.Linear(4, 4), "sub": Sub(4, 4), "router": nn.Linear(4, 3, bias=False)})
    model["frozen"].weight.requires_grad_(False)
    assert weight_grad.enable(model) == ["router"]
    weight_grad.prepare_grads([model])
    x = torch.randn(5, 4)
    nn.functional.linear(x, model["router"].weight).sum().backward()
    nn.functional.linear(x, model["router"].weight).sum().backward()
    assert model["router"].weight.grad is model["router"].weight_grad
    assert torch.allclose(model["router"].weight_grad, 2 * x.sum(0).expand(3, 4))


def _tp_rank(rank, world_size, sequence_parallel, compile_layers, tied_odd_vocab):
    """tiny in fp64 with the fused head, tp2 (vocab-parallel; `sequence_parallel` or not; its layers compiled or
    not; `tied_odd_vocab`: the head tied to the embedding, one DTensor of uneven vocab shards), switched to in_matmul,
    its projection stacks' weights made rows of one tensor as the runner makes them, two microbatches against the
    whole model's autograd in the same process: the full gradients, the adds into the buffers the backward made, its
    in-place matmuls, the switched modules, the `.grad` objects, the stacks' rows, the concatenations that read a
    weight, the no-grad forward's loss gaps and whether a stack's output needs a gradient for an input that needs
    none."""
    from torch.distributed.device_mesh import init_device_mesh

    from qwenft.distributed.parallelize import apply_compile
    from qwenft.distributed.tensor_parallel import apply_tp
    from qwenft.models import weight_grad
    from qwenft.models.loader import build_model, init_random_weights
    from qwenft.models.qwen3_5.configs import named_config
    from qwenft.models.qwen3_5.gdn import positions_in_document

    torch.manual_seed(0)
    cfg = named_config("tiny")
    if tied_odd_vocab:
        cfg.text.vocab_size, cfg.tie_word_embeddings = 511, True
    reference = build_model(cfg, kernels="torch", ce_kernel="fused")
    init_random_weights(reference, seed=0, device="cpu")
    reference.double()
    for name, p in reference.named_parameters():  # zero-initialised norms would hide a norm's missing gradient
        if name.endswith("norm.weight"):
            p.data.normal_(0, 0.1)
    model = copy.deepcopy(reference)
    apply_tp(model, init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",)), vocab_parallel=True,
             sequence_parallel=sequence_parallel)
    if compile_layers:
        apply_compile(model)
    switched = weight_grad.enable(model)
    stacks = weight_grad.stack_weights([model])  # as the runner does, once the weights are loaded
    # with sequence parallelism the head is given the loss's factor, as the runner gives it, and adds its rows'
    # gradient in its forward matmuls; else it scales it into its buffer in its backward
    weight_grad.prepare_grads([model], **(dict(ce_scale=1 / 60) if sequence_parallel else {}))
    buffers = [m.weight_grad for m in weight_grad.switched_modules([model])]
    # an input that needs no gradient: the stack's weights still get theirs (the output needs one)
    no_grad_input = weight_grad.stacked_projections(model.layers["0"].mlp, torch.ones(1, 2, cfg.text.hidden_size,
                                                                                   dtype=torch.float64))
    cu = torch.tensor([0, 5, 16, 23, 32], dtype=torch.int32)
    gen = torch.Generator().manual_seed(1)
    adds, matmuls, weight_cats, evals = [], [], [], []
    for _ in range(2):
        ids = torch.randint(1, 500, (2, 16), generator=gen)
        batch = dict(input_ids=ids, labels=ids.roll(-1, dims=1), cu_seqlens=cu,
                     position_ids=positions_in_document(cu, 32).view(2, 16))
        evals.append(_eval_gap(model, reference, batch))  # before the first backward, then with the buffers made
        (reference(**batch) / 60).backward()
        # a dispatch mode makes torch.compile skip the frame: compiled, the forward runs outside one
        with contextlib.nullcontext(types.SimpleNamespace(ops=[])) if compile_layers else _Ops() as forward:
            loss = model(**batch) / 60
        with _Ops() as ops:
            loss.backward()
        adds += _adds_into(ops.ops, buffers)
        weight_cats += _cats_of(forward.ops + ops.ops, [m.weight for m in weight_grad.switched_modules([model])])
        # the weights each matmul adds into: one, or a GatedDeltaNet layer's six stacked (`stacked_linears`), given
        # the buffer whose rows theirs are or their buffers
        into = [first for name, first in ops.ops if name in ("qwenft.addmm_weight_grad_.default",
                                                             "qwenft.addmm_weight_grads_.default")]
        matmuls.append((len(into), sum(_buffers_in(first, buffers) for first in into)))
    grads = {n: (getattr(p.grad, "full_tensor", p.grad.clone)(), ref.grad)
             for (n, p), ref in zip(model.named_parameters(), reference.parameters())}
    own = [n for n, m in model.named_modules() if hasattr(m, "weight_grad")
           and m.weight.grad.to_local().data_ptr() == m.weight_grad.data_ptr()
           and m.weight.grad.to_local().shape == m.weight_grad.shape == m.weight.to_local().shape
           and m.weight.grad.placements == m.weight.placements]
    from torch._dynamo.utils import counters

    return dict(switched=switched, adds=adds, matmuls=matmuls, grads=grads, own=own, stacks=stacks,
                rows=_stacks_rows([model]), weight_cats=weight_cats, evals=evals,
                compiled=counters["frames"]["ok"], no_grad_input=[t.requires_grad for t in no_grad_input])


def _eval_gap(model, reference, batch) -> float:
    """The loss's relative gap between `model` and `reference` on `batch` under torch.no_grad (validation's path:
    a stack's no-grad matmul reads its stacked weight as it is)."""
    with torch.no_grad():
        got, want = model(**batch), reference(**batch)
    return (abs(got - want) / abs(want)).item()


def _cats_of(ops, weights) -> list[str]:
    """The concatenations (`aten.cat`) that read one of `weights` (a DTensor's local tensor, or rows of the tensor
    that holds it)."""
    into = {w.to_local().untyped_storage().data_ptr() for w in weights}
    return [name for name, first in ops if name.startswith("aten.cat") and isinstance(first, (list, tuple))
            and into & {t.untyped_storage().data_ptr() for t in first if isinstance(t, torch.Tensor)}]


def _stacks_rows(model_parts) -> dict[str, bool]:
    """{owner: whether its stacked linears' weights (local shards) are still consecutive rows of its `weight_stack`}
    for each owner that has one."""
    rows = {}
    for part in model_parts:
        for name, owner in part.named_modules():
            whole = owner.__dict__.get("weight_stack", (None,))[0]
            if whole is None:
                continue
            offset, kept = 0, True
            for linear in (getattr(owner, n) for n in owner.weight_grad_stack):
                shard = linear.weight.to_local()
                kept &= (shard.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
                         and shard.storage_offset() == whole.storage_offset() + offset and shard.is_contiguous())
                offset += shard.numel()
            rows[name] = kept and offset == whole.numel()
    return rows


@pytest.mark.distributed
@pytest.mark.parametrize("sequence_parallel, compile_layers, tied_odd_vocab", [
    (False, False, True), (True, False, False), pytest.param(True, True, False, marks=pytest.mark.slow)],
    ids=["tp2-tied-odd-vocab", "tp2-sp", "tp2-sp-compiled"])
def test_tensor_parallel_shards_add_in_their_matmuls(sequence_parallel, compile_layers, tied_odd_vocab):
    """tp2: every sharded linear, the vocab-parallel embedding and the head (in one case tied to the embedding, one
    buffer over uneven vocab shards) get a buffer their shard's size (a GatedDeltaNet layer's six projections rows
    of one, which one matmul adds into), and `.grad` is a DTensor over it with the weight's placement; the
    backward adds nothing into any buffer (each linear's in-place matmul, the rows' put
    and the head did: in its backward, or with sequence parallelism, given the loss's factor as the runner gives
    it, in its forward; compiled, the matmuls run inside the layers' graphs), and every full gradient equals one
    process's autograd in fp64. Each projection stack (a GatedDeltaNet layer's six, attention's q, k, v, the MLP's
    gate and up) is one matmul over weight shards that are rows of one tensor, which no concatenation reads, and a
    forward under torch.no_grad (validation's) gives the reference's loss, before the first backward and after."""
    for out in run_distributed(_tp_rank, 2, sequence_parallel, compile_layers, tied_odd_vocab):
        switched = out["switched"]
        assert "embed_tokens" in switched and "lm_head" in switched, switched
        for part in ("self_attn.q_proj", "self_attn.o_proj", "linear_attn.q_proj", "linear_attn.out_proj",
                     "mlp.gate_proj", "mlp.down_proj"):
            assert any(n.endswith(part) for n in switched), (part, switched)
        assert set(out["own"]) == set(switched), (out["own"], switched)
        assert out["adds"] == []
        linears = [n for n in switched if n not in ("embed_tokens", "lm_head")]
        # one matmul into one buffer for a GatedDeltaNet layer's six projections, an attention layer's q, k and v,
        # and an MLP's gate and up (their owners' `weight_grad_stack`), whose weights are rows of one tensor that
        # no concatenation reads
        count = lambda part: len([n for n in linears if n.endswith(part)])  # noqa: E731
        owners = count("linear_attn.q_proj") + count("self_attn.q_proj") + count("mlp.gate_proj")
        stacked = 5 * count("linear_attn.q_proj") + 2 * count("self_attn.q_proj") + count("mlp.gate_proj")
        assert out["matmuls"] == [(len(linears) - stacked, len(linears))] * 2, (out["matmuls"], linears)
        assert out["stacks"] == owners == len(out["rows"]) and all(out["rows"].values()), out["rows"]
        assert out["weight_cats"] == [], out["weight_cats"]
        assert max(out["evals"]) < 1e-12, out["evals"]
        assert (out["compiled"] > 0) == compile_layers, out["compiled"]
        assert out["no_grad_input"] == [True, True]
        for name, (got, ref) in out["grads"].items():
            assert ref.norm() > 0, name
            # the head given its factor: autograd's path scales by the fp32 loss's gradient, 1/60 rounded to fp32
            # (the fused CE's loss is fp32), the forward path by the exact factor
            tol = 1e-7 if sequence_parallel and name == "lm_head.weight" else 1e-12
            assert ((got - ref).norm() / ref.norm()).item() < tol, name


def _overrides(tmp_path, name, *extra):
    return parity_overrides(tmp_path / name, "checkpoint.export_hf=false", *extra)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["model.kernels.ce=fused", "model.mtp=train"], ["model.name=tiny_moe"]],
                         ids=["torch-ce", "fused-ce-mtp", "moe"])
def test_training_equals_autograds(tmp_path, extra):
    """The tiny recipe, 3 steps of 4 microbatches, one process: model.kernels.weight_grad=in_matmul against
    autograd, eager; every loss, the last step's gradients and the trained parameters within fp32_rtol (the
    matmuls' sums taken in another order: beta = 1 adds the old gradient inside the matmul's fp32 sum). With the
    fused head and a trained MTP head, the runner's loss factors let the head add its gradient (both losses'
    share) in its forward matmuls. The MoE model: its shared expert's linears switch; the router's weight (read
    outside its module) keeps autograd's add, into its buffer, and the stacked experts autograd's path."""
    (autograd,) = run_distributed(train_with_grads, 1, _overrides(tmp_path, "autograd",
                                                                  "model.kernels.weight_grad=autograd", *extra))
    (in_matmul,) = run_distributed(train_with_grads, 1, _overrides(tmp_path, "in_matmul",
                                                                   "model.kernels.weight_grad=in_matmul", *extra))
    assert_same_grads(in_matmul, autograd)
    assert_same_training(in_matmul, autograd)


@pytest.mark.distributed
@pytest.mark.slow
def test_compiled_checkpointed_training_equals_autograds(tmp_path):
    """As above with model.compile=true and activation checkpointing (the layers' forward run again in the
    backward, their linears inside the compiled graphs) against eager autograd, at the compile tests' lr."""
    lr = 2e-4
    (autograd,) = run_distributed(train_with_grads, 1, _overrides(tmp_path, "autograd", f"optim.lr={lr}",
                                                                  "model.kernels.weight_grad=autograd"))
    (in_matmul,) = run_distributed(train_with_grads, 1, _overrides(
        tmp_path, "in_matmul", f"optim.lr={lr}", "model.kernels.weight_grad=in_matmul", "model.compile=true",
        "model.activation_checkpointing=true"))
    assert_same_grads(in_matmul, autograd, lr=lr)
    assert_same_training(in_matmul, autograd, lr=lr)


@pytest.mark.distributed
@pytest.mark.slow
# both at the compile tests' lr: each AdamW step turns the runs' rounding gaps into parameter gaps of order lr,
# and the sequence-parallel run with the fused head and the MTP head carries them furthest into its last gradients
@pytest.mark.parametrize("extra, lr", [
    (["model.kernels.ce=fused", "mesh.sequence_parallel=true", "model.mtp=train"], 2e-4),
    (["model.compile=true"], 2e-4),
], ids=["fused-ce-sp-mtp", "compiled"])
def test_tensor_parallel_training_equals_one_process_with_autograd(tmp_path, extra, lr):
    """The runner at mesh.tp=2 (vocab-parallel, no FSDP2) with in_matmul against one process with autograd, 3 steps
    of 4 microbatches: every loss, the last step's full gradients and the trained parameters within fp32_rtol, on
    both ranks. With the fused head, sequence parallelism and a trained MTP head; and compiled (the sharded
    linears' in-place matmuls inside the layers' graphs)."""
    (autograd,) = run_distributed(train_with_grads, 1, _overrides(
        tmp_path, "autograd", f"optim.lr={lr}", "model.kernels.weight_grad=autograd",
        *[o for o in extra if not o.startswith("mesh.")]))
    for in_matmul in run_distributed(train_with_grads, 2, _overrides(
            tmp_path, "tp2", f"optim.lr={lr}", "mesh.tp=2", "model.kernels.weight_grad=in_matmul", *extra)):
        assert_same_grads(in_matmul, autograd, lr=lr)
        assert_same_training(in_matmul, autograd, lr=lr)


def _tp_stacks_run(rank, world_size, overrides):
    """A runner's rank: its losses, and `_stacks_rows` of its model after training."""
    job, result = train_job(overrides)
    return result.losses, _stacks_rows(job.model_parts)


@pytest.mark.distributed
@pytest.mark.slow
def test_stacked_weights_stay_rows_of_one_tensor_through_training_and_a_resume(tmp_path):
    """mesh.tp=2 with in_matmul (`weight_grad.stack_weights`): a run stopped at step 2 and resumed trains steps 3
    and 4 to the same losses, bit for bit, as one that never stopped, and after the checkpoint's load and AdamW's
    steps each stack's weights are still the rows of their owner's tensor (what its matmuls read), for every
    GatedDeltaNet, attention and MLP layer of the model."""
    def overrides(name, steps, *extra):
        return parity_overrides(tmp_path / name, f"train.max_steps={steps}", "checkpoint.export_hf=false",
                                "lr_scheduler.warmup_steps=4", "lr_scheduler.decay=constant",
                                "checkpoint.every_steps=2", "mesh.tp=2", "model.kernels.weight_grad=in_matmul", *extra)

    whole = run_distributed(_tp_stacks_run, 2, overrides("whole", 4))
    run_distributed(_tp_stacks_run, 2, overrides("stopped", 2))
    resumed = run_distributed(_tp_stacks_run, 2, overrides("stopped", 4, "checkpoint.resume=auto"))
    for (losses, rows), (want, whole_rows) in zip(resumed, whole):
        assert losses == want[2:], (losses, want)
        kinds = {name.rsplit(".", 1)[-1] for name in rows}
        assert kinds == {"linear_attn", "self_attn", "mlp"} and all(rows.values()), rows
        assert rows == whole_rows


@pytest.mark.distributed
@pytest.mark.slow
def test_lora_at_tensor_parallel_trains_as_one_process(tmp_path):
    """peft=lora with the embeddings and the head trained, at mesh.tp=2, compiled, with in_matmul (the
    vocab-parallel embedding and the head add into their buffers; the adapters, read by their base linears' hooks
    through F.linear, take theirs from autograd) against one process with autograd: every loss and the last step's
    gradients, the adapters' among them, within fp32_rtol. LoRA's trained values are not compared
    (tests/test_lora.py says why)."""
    lr, extra = 2e-4, ["peft=lora", "peft.train_embeddings=true", "peft.train_head=true", "model.kernels.ce=fused"]
    (autograd,) = run_distributed(train_with_grads, 1, _overrides(
        tmp_path, "autograd", f"optim.lr={lr}", "model.kernels.weight_grad=autograd", *extra))
    assert any(".lora_A." in name for name in autograd.grads) and "embed_tokens.weight" in autograd.grads
    for in_matmul in run_distributed(train_with_grads, 2, _overrides(
            tmp_path, "tp2", f"optim.lr={lr}", "mesh.tp=2", "model.compile=true", "model.kernels.weight_grad=in_matmul",
            *extra)):
        assert_same_grads(in_matmul, autograd, lr=lr)
        for step, (a, b) in enumerate(zip(in_matmul.losses, autograd.losses)):
            assert_within(f"step {step + 1}'s loss", abs(a - b) / abs(b), fp32_rtol(step, lr=lr))


def test_the_vision_tower_keeps_autograds_path():
    """A VLM's tower runs twice in a microbatch of images and videos and not at all in a text-only step: none of
    its modules switch (the text model's do)."""
    from helpers import tiny_vlm
    from qwenft.models import weight_grad
    from qwenft.models.loader import build_model

    model = build_model(tiny_vlm(), kernels="torch", device="meta")
    names = weight_grad.enable(model)
    assert "embed_tokens" in names and "lm_head" in names and any(".mlp.up_proj" in n for n in names)
    assert not [n for n in names if n.startswith("visual")], names


@pytest.mark.distributed
@pytest.mark.slow
def test_vlm_training_equals_autograds(tmp_path):
    """tiny_vlm (its microbatches of images, videos and text) through the runner, 2 steps: in_matmul against
    autograd, every loss and parameter within fp32_rtol."""
    def overrides(name, mode):
        return ["recipe=tiny_vlm", "model.kernels.gdn=torch", "train.progress_bar=false", "train.max_steps=2",
                "optim.lr=2e-4", "lr_scheduler.warmup_steps=0", "checkpoint.export_hf=false",
                f"run_dir={tmp_path / name}", f"model.kernels.weight_grad={mode}"]

    (autograd,) = run_distributed(train_with_grads, 1, overrides("autograd", "autograd"))
    (in_matmul,) = run_distributed(train_with_grads, 1, overrides("in_matmul", "in_matmul"))
    assert_same_training(in_matmul, autograd, steps=2, lr=2e-4)


@pytest.mark.parametrize("overrides, layout, device, expected", [
    ([], (1, 1, 1, 1), "cpu", "autograd"),
    ([], (1, 1, 1, 1), "cuda", "in_matmul"),
    (["model.kernels.weight_grad=in_matmul"], (1, 1, 1, 1), "cpu", "in_matmul"),
    (["model.kernels.weight_grad=autograd"], (1, 1, 1, 1), "cuda", "autograd"),
    (["optim.master_dtype=float32"], (1, 1, 1, 1), "cuda", "autograd"),  # FSDP2 casts the fp32 weights
    ([], (1, 2, 1, 2), "cuda", "autograd"),
    ([], (1, 1, 2, 2), "cuda", "in_matmul"),  # a tp rank's own shards
    ([], (1, 2, 2, 4), "cuda", "autograd"),  # tp2 x dp2: FSDP2
    ([], (2, 1, 1, 2), "cuda", "autograd"),
    (["model.compile=true", "model.cuda_graphs=true"], (1, 1, 1, 1), "cuda", "in_matmul"),
    (["model.compile=true", "model.cuda_graphs=true"], (1, 1, 2, 2), "cuda", "in_matmul"),
    (["model.kernels.weight_grad=in_matmul", "model.compile=true", "model.cuda_graphs=true"], (1, 1, 1, 1), "cuda",
     "in_matmul"),
    (["model.kernels.weight_grad=in_matmul"], (1, 2, 1, 2), "cuda", "FSDP2 reduces the gradients"),
    (["model.kernels.weight_grad=in_matmul"], (1, 2, 2, 4), "cuda", "FSDP2 reduces the gradients"),
    (["model.kernels.weight_grad=in_matmul"], (2, 1, 1, 2), "cuda", "mesh.pp=2: pipeline schedules"),
])
def test_where_it_runs(overrides, layout, device, expected):
    """auto: in_matmul on CUDA where each rank's weights are its own (one rank, or tp shards) in the compute dtype,
    else autograd; asked for
    where it cannot run: one line naming the key, the value, the cause and what to set."""
    from qwenft.conf.layout import resolve_layout
    from qwenft.train.build import model_config
    from qwenft.train.spec import resolve_spec

    cfg = compose(["recipe=tiny", "optim.master_dtype=bfloat16", *overrides])
    pp, dp, tp, world = layout
    layout = resolve_layout(tp, pp, dp, world)
    if expected in ("in_matmul", "autograd"):
        assert resolve_spec(cfg, layout, model_config(cfg), device).parallel.weight_grad == expected
        return
    with pytest.raises(ValueError) as info:
        resolve_spec(cfg, layout, model_config(cfg), device)
    message = str(info.value)
    assert message.startswith("model.kernels.weight_grad=in_matmul: ") and expected in message, message
    assert message.endswith("use model.kernels.weight_grad=auto or autograd") and "\n" not in message
