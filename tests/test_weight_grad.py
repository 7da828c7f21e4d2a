"""model.kernels.weight_grad=in_matmul (qwenft.models.weight_grad): the weight gradients are added into `.grad` by
the kernels that form them, never formed apart and added by autograd. The same gradients as autograd's (fp64,
eager and compiled), no weight-sized add in the backward, the same training as autograd's, and where it runs."""

import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from distributed import run_distributed
from helpers import assert_same_grads, assert_same_training, compose, parity_overrides, train_with_grads


class _Ops(TorchDispatchMode):
    """The aten ops run under it, with their first argument."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append((str(func), args[0] if args else None))
        return func(*args, **(kwargs or {}))


def _adds_into(ops, tensors) -> list[str]:
    """The in-place adds (autograd's accumulation) whose destination is one of `tensors`."""
    ids = {id(t) for t in tensors}
    return [name for name, first in ops if name.startswith("aten.add_") and id(first) in ids]


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


def test_frozen_float8_and_parameterless_uses_keep_autograd():
    """Only the exact nn.Linear / nn.Embedding classes and LMHead switch, and only with a trained weight: a frozen
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
    ([], (1, 1, 2, 2), "cuda", "autograd"),
    ([], (2, 1, 1, 2), "cuda", "autograd"),
    (["model.compile=true", "model.cuda_graphs=true"], (1, 1, 1, 1), "cuda", "autograd"),
    (["model.kernels.weight_grad=in_matmul"], (1, 2, 1, 2), "cuda", "FSDP2 reduces the gradients"),
    (["model.kernels.weight_grad=in_matmul"], (1, 1, 2, 2), "cuda", "mesh.tp=2: a tensor-parallel rank's"),
    (["model.kernels.weight_grad=in_matmul"], (2, 1, 1, 2), "cuda", "mesh.pp=2: pipeline schedules"),
    (["model.kernels.weight_grad=in_matmul", "model.compile=true", "model.cuda_graphs=true"], (1, 1, 1, 1), "cuda",
     "model.cuda_graphs=true: a CUDA graph"),
])
def test_where_it_runs(overrides, layout, device, expected):
    """auto: in_matmul on CUDA with one rank holding plain weights in the compute dtype, else autograd; asked for
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
