"""model.compile=true (per-layer torch.compile, inductor on the CPU) trains the same numbers as eager, and a
batch with another number of packed documents reuses the compiled graphs.

The first run on a machine compiles the graphs (inductor + g++, about 30 s on the 2-core CI box); later
runs read them from inductor's on-disk cache."""

import pytest
import torch

from distributed import run_distributed
from helpers import (ConfigError, assert_same_tensors, assert_same_training, assert_within, compose, fp32_rtol,
                     parity_overrides, train_with_grads, train_with_state)


def _train(rank, world_size, overrides):
    """The run's result and the graphs torch.compile built in this rank."""
    from torch._dynamo.utils import counters

    return train_with_state(rank, world_size, overrides), counters["stats"]["unique_graphs"]


LR = 2e-4


def _overrides(tmp_path, name, *extra):
    """test_memory_options' 3 steps at lr 2e-4, not 5e-4: GDN's decay gradients are ill-conditioned (eager fp32
    is 5.6e-6 from fp64 on A_log / dt_bias, compiled fp32 as far from eager), and AdamW turns that rounding
    noise into parameter differences of 1.05e-5 after 3 steps at lr 5e-4; at 2e-4 the updates, and the noise,
    are smaller (fp32_rtol's bounds take this lr)."""
    return parity_overrides(tmp_path / name, "checkpoint.export_hf=false", f"optim.lr={LR}", *extra)


def _assert_compiled_losses_equal_eager(eager_overrides, compiled_overrides, graphs):
    """One process eager and one compiled, 3 steps each: every step's loss within fp32_rtol of eager's for the AdamW
    steps before it (the eager loss moved), `graphs` graphs compiled (no recompile), none in the eager run."""
    ((eager, eager_graphs),) = run_distributed(_train, 1, eager_overrides)
    ((result, compiled),) = run_distributed(_train, 1, compiled_overrides)
    assert len(result.losses) == len(eager.losses) == 3 and eager.losses[0] != eager.losses[-1]
    for step, (a, b) in enumerate(zip(result.losses, eager.losses)):
        assert_within(f"step {step + 1}'s loss", abs(a - b) / abs(b), fp32_rtol(step, lr=LR))
    assert eager_graphs == 0
    assert compiled == graphs, f"{compiled} graphs compiled; expected {graphs} (a recompile?)"


@pytest.fixture(scope="module")
def eager(tmp_path_factory):
    (result,) = run_distributed(_train, 1, _overrides(tmp_path_factory.mktemp("eager"), "eager"))
    return result


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """One process, model.compile=true with activation checkpointing, its kernels compiled into a fresh
    model.kernels.cache_dir: (result, graphs compiled, that dir). The data-parallel and pipeline runs below compile
    the same layer graphs (the MoE run GatedDeltaNet's) and take them from this dir, as a later run of a user's
    would, instead of compiling them again (inductor + g++: most of a cold run's time on the 2-core CI box)."""
    tmp = tmp_path_factory.mktemp("compiled")
    caches = tmp / "kernels"
    ((result, graphs),) = run_distributed(_train, 1, _overrides(tmp, "compiled", "model.compile=true",
                                                                "model.activation_checkpointing=true",
                                                                f"model.kernels.cache_dir={caches}"))
    return result, graphs, caches


@pytest.mark.distributed
@pytest.mark.slow
def test_compiled_layers_train_like_eager(eager, compiled):
    """3 steps of 4 packed microbatches each (documents per microbatch vary), activation checkpointing on:
    losses and every parameter within fp32_rtol of eager. 6 graphs, compiled once for all 4 layers and 12
    microbatches: attention in/out, GDN in/decay/out (a layer's output graph runs the MLP too) and the final norm.
    Its kernels land in model.kernels.cache_dir, where a later run finds them."""
    result, graphs, caches = compiled
    assert_same_training(result, eager[0], lr=LR)
    assert eager[1] == 0
    assert graphs == 6, f"{graphs} graphs compiled; expected 6 (a recompile?)"
    assert sorted(p.name for p in caches.iterdir()) == ["inductor", "tilelang", "triton"]
    assert any(p.is_file() for p in (caches / "inductor").rglob("*"))  # inductor's compiled code, not /tmp's


@pytest.mark.distributed
@pytest.mark.slow
def test_compiled_layers_under_dp2_train_like_eager(tmp_path, eager, compiled):
    """FSDP2 over 2 ranks: the graphs run inside each layer's unshard/reshard hooks."""
    results = run_distributed(_train, 2, _overrides(tmp_path, "dp2", "model.compile=true",
                                                    "pipeline.reduce_grad_per_microbatch=true",
                                                    f"model.kernels.cache_dir={compiled[2]}"))
    for result, graphs in results:
        assert_same_training(result, eager[0], lr=LR)
        assert graphs == 6


def _train_recording_grads(rank, world_size, overrides):
    """The run's losses and last step's gradients (helpers.train_with_grads), and the graphs built in this rank."""
    from torch._dynamo.utils import counters

    return train_with_grads(rank, world_size, overrides), counters["stats"]["unique_graphs"]


@pytest.mark.distributed
@pytest.mark.slow
def test_compiled_layers_under_cp2_train_like_one_process(tmp_path, compiled):
    """Context parallel over 2 ranks with activation checkpointing (the 128K recipes' setting), against one eager
    process: each rank's graphs take its span, the span exchanges (the conv halo, the state fold, attention by
    halves) run eagerly between them, and again, in the forward's order, when the backward recomputes a layer.
    Rows of 256 tokens make each span the 128 tokens of the `compiled` run, whose graphs (6, the same code and
    shapes) come from its kernel cache instead of inductor and g++. Every step's loss and the last step's gradients
    within fp32_rtol; parameters are not compared: as in tests/test_context_parallel.py, the spans' rounding in
    near-zero a_proj gradient elements becomes full AdamW updates (1.6e-4 relative after 3 steps)."""
    def overrides(name, *extra):
        return _overrides(tmp_path, name, "data.seq_len=256", "model.activation_checkpointing=true", *extra)

    ((reference, _),) = run_distributed(_train_recording_grads, 1, overrides("one"))
    results = run_distributed(_train_recording_grads, 2, overrides("cp2", "model.compile=true", "mesh.cp=2",
                                                                    f"model.kernels.cache_dir={compiled[2]}"))
    for result, graphs in results:
        for step, (a, b) in enumerate(zip(result.losses, reference.losses, strict=True)):
            assert_within(f"step {step + 1}'s loss", abs(a - b) / abs(b), fp32_rtol(step, lr=LR))
        assert_same_tensors(result.grads, reference.grads, fp32_rtol(len(reference.losses) - 1, lr=LR), "gradients")
        assert graphs == 6, f"{graphs} graphs compiled; expected 6 (a recompile?)"


@pytest.mark.distributed
@pytest.mark.slow
def test_compiled_layers_under_tp2_train_like_eager(tmp_path, eager):
    """Head-sharded projections and a vocab-parallel embedding: the TP hooks of the norms and the row-parallel
    projections are traced into the graphs, which take the DTensor parameters' local tensors, and layer 0's
    input may arrive as an AsyncCollectiveTensor (model._compile clones it: given one, the graph's backward
    gives the embedding a wrong gradient)."""
    results = run_distributed(_train, 2, _overrides(tmp_path, "tp2", "model.compile=true", "mesh.tp=2"))
    for result, graphs in results:
        assert_same_training(result, eager[0], lr=LR)
        assert graphs == 6


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("schedule, graphs", [("1f1b", [3, 6]), ("zbv", [6, 3])])
def test_compiled_layers_under_pp2_train_like_eager(tmp_path, eager, compiled, schedule, graphs):
    """Two pipeline ranks with the knob on and activation checkpointing: 1F1B (the 27B recipes' schedule) and
    ZBV, whose weight-gradient step differentiates the compiled layers a second time, towards their parameters.
    Each rank compiles the graphs of its own layers (GatedDeltaNet's in/decay/out: 3; with the attention layer
    and the final norm: 6; 1F1B puts layers 0-1 on rank 0, ZBV layers 0 and 3 and the head), which run inside the
    schedule's forward and backward of each microbatch."""
    results = run_distributed(_train, 2, _overrides(tmp_path, f"pp2-{schedule}", "model.compile=true", "mesh.pp=2",
                                                    f"pipeline.schedule={schedule}",
                                                    "pipeline.reduce_grad_per_microbatch=true",
                                                    "model.activation_checkpointing=true",
                                                    f"model.kernels.cache_dir={compiled[2]}"))
    for result, _ in results:
        assert_same_training(result, eager[0], lr=LR)
    assert [n for _, n in results] == graphs


@pytest.mark.distributed
@pytest.mark.slow
def test_compiled_mtp_head_trains_like_eager(tmp_path, compiled):
    """model.mtp=train, compiled: the head's full-attention layer runs the trunk's attention graphs and its three
    norms the final norm's graph (one code, the same shapes), so no graph beyond the 6 of the run without a head
    and no recompile; every step's loss and every parameter, the head's included, within fp32_rtol of eager."""
    mtp = ("model.mtp=train", f"model.kernels.cache_dir={compiled[2]}")
    ((eager, eager_graphs),) = run_distributed(_train, 1, _overrides(tmp_path, "mtp-eager", *mtp))
    ((result, graphs),) = run_distributed(_train, 1, _overrides(tmp_path, "mtp-compiled", *mtp, "model.compile=true"))
    assert any(name.startswith("mtp.") for name in eager.state_dict)
    assert_same_training(result, eager, lr=LR)
    assert eager_graphs == 0
    assert graphs == 6, f"{graphs} graphs compiled; expected 6 (a recompile?)"


def test_the_norms_outside_the_layers_compile():
    """apply_compile compiles the final norm and the MTP head's three norms (`model.compile_norms`) as it does the
    layers' pieces: each module's `forward` is the compiled call; a pipeline stage without the head has none."""
    from qwenft.distributed.parallelize import apply_compile
    from qwenft.models.qwen3_5.configs import named_config
    from qwenft.models.qwen3_5.model import Qwen3_5Model

    cfg = named_config("tiny")
    cfg.text.mtp_num_hidden_layers = 1  # a random-init run's head, as model.mtp=train builds it
    model = Qwen3_5Model(cfg, kernels="torch", mtp="train")
    apply_compile(model)
    norms = [model.norm, model.mtp.pre_fc_norm_embedding, model.mtp.pre_fc_norm_hidden, model.mtp.norm]
    assert all("forward" in vars(norm) for norm in norms)
    stage = Qwen3_5Model(cfg, kernels="torch", layer_ids=[0, 1], head=False, mtp="train")
    apply_compile(stage)
    assert stage.norm is None and stage.mtp is None


def _vlm_overrides(tmp_path, name, *extra):
    """tiny_vlm, 3 steps of 4 microbatches of one 256-token row (an image or two and text), lr 2e-4 as above."""
    return ["recipe=tiny_vlm", "model.kernels.gdn=torch", "train.progress_bar=false", "train.max_steps=3",
            f"optim.lr={LR}", "lr_scheduler.warmup_steps=0", "train.global_batch_size=4", "train.micro_batch_size=1",
            "checkpoint.export_hf=false", f"run_dir={tmp_path / name}", *extra]


@pytest.mark.distributed
@pytest.mark.slow
def test_compiled_vlm_trains_like_eager(tmp_path):
    """tiny_vlm through the runner: the language model's layers compile as for text (6 graphs, no recompile over
    12 microbatches of other images and documents), the vision tower stays eager; every step's loss within
    fp32_rtol of eager. Parameters are compared as gradients (`test_compiled_vlm_gradients_equal_eager`): after
    AdamW steps, rounding in near-zero gradient elements shows as parameter differences of up to 2.9e-5 (norm
    weights and vision biases), as for the MoE model above."""
    _assert_compiled_losses_equal_eager(_vlm_overrides(tmp_path, "vlm-eager"),
                                        _vlm_overrides(tmp_path, "vlm-compiled", "model.compile=true"), graphs=6)


def _vlm_gradients(rank, world_size):
    """Per parameter, the relative difference between a compiled and an eager tiny VLM's gradients of one batch:
    two rows of text and three images (merged into the token embeddings, M-RoPE positions from their grids)."""
    from helpers import IMAGE, PATCH_DIM, tiny_vlm, vlm_row
    from qwenft.models.loader import build_model, init_random_weights
    from qwenft.models.qwen3_5.model import compile_layer

    cfg = tiny_vlm()
    eager = init_random_weights(build_model(cfg, kernels="torch"), seed=3, device="cpu")
    compiled = init_random_weights(build_model(cfg, kernels="torch"), seed=3, device="cpu")
    for layer in compiled.layers.values():
        compile_layer(layer)
    grid = torch.tensor([[1, 4, 4], [1, 2, 6], [1, 6, 2]])
    ids = torch.tensor([vlm_row([3, (1, 4, 4), 5], 24), vlm_row([2, (1, 2, 6), 2, (1, 6, 2), 4], 24)])
    assert (ids == IMAGE).any()
    gen = torch.Generator().manual_seed(1)
    pixels = torch.randn(int(grid.prod(-1).sum()), PATCH_DIM, generator=gen)
    labels = torch.randint(0, 400, ids.shape, generator=gen)
    grads = []
    for model in (eager, compiled):
        logits = model(input_ids=ids, pixel_values=pixels, image_grid_thw=grid)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    return {n: ((grads[1][n] - g).norm() / g.norm()).item() for n, g in grads[0].items()}


@pytest.mark.distributed
@pytest.mark.slow
def test_compiled_vlm_gradients_equal_eager():
    """One image-and-text batch through the tiny VLM, eager and with its language model's layers compiled:
    every parameter's gradient, the vision tower's and the projector's included, within 1e-5; GatedDeltaNet's
    A_log and dt_bias within 1e-4 (their gradients sum over every token with heavy cancellation: fp32 eager
    alone sits 2e-5..6e-5 from fp64, tests/test_model_vlm.py)."""
    [errors] = run_distributed(_vlm_gradients, 1)
    assert any(n.startswith("visual.") for n in errors)
    decay = {n: e for n, e in errors.items() if n.endswith(("A_log", "dt_bias"))}
    rest = {n: e for n, e in errors.items() if n not in decay}
    assert decay and max(decay.values()) < 1e-4, decay
    worst = max(rest, key=rest.get)
    assert rest[worst] < 1e-5, (worst, rest[worst])


@pytest.mark.distributed
@pytest.mark.slow
def test_compiled_moe_layers_train_like_eager(tmp_path, compiled):
    """tiny_moe: the shared expert compiles as the dense MLP does, the routing and the routed experts stay eager
    (`compile_layer`): 7 graphs (the output graphs stop before the MoE block, the shared expert and the final
    norm are two more) and
    no recompile over 12 microbatches, and every step's loss (token CE + aux loss) within fp32_rtol of eager.
    Parameters are compared as gradients (`test_compiled_moe_gradients_equal_eager`), not after AdamW steps:
    AdamW's first steps move each element by about lr whatever its gradient's size, so rounding in near-zero
    gradient elements becomes parameter differences (2.8e-5 on norm weights after 3 steps here), and a router
    tie that the rounding resolves the other way (a token's k-th and (k+1)-th expert within 1e-7) moves whole
    experts."""
    # GatedDeltaNet's graphs are the dense model's: their kernels come from `compiled`'s cache dir
    moe = ("model.name=tiny_moe", "model.kernels.moe=loop", f"model.kernels.cache_dir={compiled[2]}")
    _assert_compiled_losses_equal_eager(_overrides(tmp_path, "moe-eager", *moe),
                                        _overrides(tmp_path, "moe-compiled", *moe, "model.compile=true"), graphs=7)


def _moe_gradients(rank, world_size):
    """Per parameter, the relative difference between a compiled and an eager tiny_moe model's gradients of one
    packed batch's token loss + aux loss, and the smallest gap between a token's k-th and (k+1)-th router
    probability (a tie would let the two pick different experts)."""
    from qwenft.models.qwen3_5.configs import named_config
    from qwenft.models.qwen3_5.model import Qwen3_5Model, compile_layer
    from qwenft.models.qwen3_5.moe import routing_aux_loss

    torch.manual_seed(0)
    cfg = named_config("tiny_moe")
    eager = Qwen3_5Model(cfg, kernels="torch", moe_kernel="loop")
    for p in eager.parameters():
        torch.nn.init.normal_(p, std=0.05)
    eager.init_buffers()
    compiled = Qwen3_5Model(cfg, kernels="torch", moe_kernel="loop")
    compiled.load_state_dict(eager.state_dict())
    compiled.init_buffers()
    for layer in compiled.layers.values():
        compile_layer(layer)
    ids = torch.randint(0, cfg.text.vocab_size, (1, 128))
    cu = torch.tensor([0, 50, 128], dtype=torch.int32)
    k, gaps = cfg.text.num_experts_per_tok, []

    def top_k_gap(block, args, _):
        probs = (args[0].flatten(0, 1) @ block.gate.weight.T).softmax(-1).sort(-1, descending=True).values
        gaps.append((probs[:, k - 1] - probs[:, k]).min().item())

    hooks = [layer.mlp.register_forward_hook(top_k_gap) for layer in eager.layers.values()]
    grads = []
    for model in (eager, compiled):
        logits, routing = model(input_ids=ids, cu_seqlens=cu, return_routing=True)
        (logits.square().mean() + 0.001 * routing_aux_loss(routing)).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for hook in hooks:
        hook.remove()
    return {n: ((grads[1][n] - g).norm() / g.norm()).item() for n, g in grads[0].items()}, min(gaps)


@pytest.mark.distributed
@pytest.mark.slow
def test_compiled_moe_gradients_equal_eager():
    """One packed batch through tiny_moe, eager and compiled: every parameter's gradient of the token loss plus
    the aux loss within 1e-5 (measured: 4.3e-6 at most, GDN's decay path, as in the dense model)."""
    [(errors, gap)] = run_distributed(_moe_gradients, 1)
    assert gap > 1e-5, gap  # no router tie: both models route every token alike
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1e-5, (worst, errors[worst])


def _two_document_counts(rank, world_size):
    from torch._dynamo.utils import counters

    from qwenft.models.qwen3_5.configs import named_config
    from qwenft.models.qwen3_5.model import Qwen3_5Model, compile_layer

    torch.manual_seed(0)
    cfg = named_config("tiny")
    eager = Qwen3_5Model(cfg, kernels="torch")
    for p in eager.parameters():
        torch.nn.init.normal_(p, std=0.05)
    eager.init_buffers()
    compiled = Qwen3_5Model(cfg, kernels="torch")
    compiled.load_state_dict(eager.state_dict())
    compiled.init_buffers()
    for layer in compiled.layers.values():
        compile_layer(layer)
    ids = torch.randint(0, cfg.text.vocab_size, (1, 128))
    graphs, errors = [], []
    for bounds in ([0, 50, 128], [0, 9, 30, 31, 100, 128]):
        cu = torch.tensor(bounds, dtype=torch.int32)
        outs = []
        for model in (eager, compiled):
            model.zero_grad()
            logits = model(input_ids=ids, cu_seqlens=cu)
            logits.square().mean().backward()
            outs.append((logits.detach(), model.layers["0"].mlp.up_proj.weight.grad.clone()))
        (ref, ref_grad), (out, grad) = outs
        errors.append((((out - ref).norm() / ref.norm()).item(), ((grad - ref_grad).norm() / ref_grad.norm()).item()))
        graphs.append(counters["stats"]["unique_graphs"])
    return graphs, errors


@pytest.mark.distributed
@pytest.mark.slow
def test_other_document_count_reuses_graphs():
    """One [1, 128] row packed with 2, then 5 documents (cu_seqlens of 3, then 6 entries): the second forward +
    backward compiles nothing, and both match the eager model (logits, a weight's gradient)."""
    [(graphs, errors)] = run_distributed(_two_document_counts, 1)
    assert graphs == [5, 5], f"graphs compiled after each batch: {graphs}"
    for logits_err, grad_err in errors:
        assert logits_err < 1e-5 and grad_err < 1e-5, errors


def test_bad_compile_value_is_one_line():
    with pytest.raises(ConfigError) as e:
        compose(["recipe=tiny", "model.compile=maybe"])
    assert "model.compile" in str(e.value) and "maybe" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("overrides, layout, device, expected", [
    (["model.activation_checkpointing=false"], (1, 1, 1, 1), "cpu", "it needs CUDA, and this run is on cpu"),
    (["model.compile=false"], (1, 1, 1, 1), "cuda", "it replays model.compile's graphs; set model.compile=true"),
    (["optim.master_dtype=bfloat16"], (1, 2, 1, 2), "cuda", "FSDP2 does not keep: mesh.dp=2 shards them; set "
     "mesh.dp=1"),
    ([], (1, 1, 1, 1), "cuda", "optim.master_dtype=float32 needs its cast to the compute dtype; set "
     "optim.master_dtype=bfloat16"),
    (["peft=lora", "peft.train_head=true"], (1, 1, 1, 1), "cuda", "peft.train_embeddings / peft.train_head with "
     "optim.master_dtype=float32 need its cast to bfloat16; set optim.master_dtype=bfloat16 or train neither"),
    (["peft=lora"], (1, 1, 1, 1), "cuda", None),
    (["optim.master_dtype=bfloat16", "model.activation_checkpointing=selective"], (1, 1, 1, 1), "cuda",
     "model.activation_checkpointing=selective recomputes the graphs inside the backward; set it to false"),
    (["optim.master_dtype=bfloat16", "mesh.pp=2"], (2, 1, 1, 2), "cuda",
     "mesh.pp=2: pipeline schedules are not supported; set mesh.pp=1"),
    (["optim.master_dtype=bfloat16", "mesh.tp=2"], (1, 1, 2, 2), "cuda", None),
    (["optim.master_dtype=bfloat16"], (1, 1, 1, 1), "cuda", None),
])
def test_cuda_graphs_where_they_can_replay(overrides, layout, device, expected):
    """model.cuda_graphs=true needs model.compile, CUDA, weights at fixed addresses (no FSDP2: one data-parallel
    rank and weights stored in the compute dtype), no activation checkpointing and no pipeline: one line naming
    the key, the value and what to set, before the model is built. LoRA's frozen base in the compute dtype needs
    no FSDP2, its trained head in fp32 does."""
    from qwenft.conf.layout import resolve_layout
    from qwenft.train.build import model_config
    from qwenft.train.spec import resolve_spec

    cfg = compose(["recipe=tiny", "model.compile=true", "model.cuda_graphs=true", *overrides])
    pp, dp, tp, world = layout
    layout = resolve_layout(tp, pp, dp, world)
    if expected is None:
        assert resolve_spec(cfg, layout, model_config(cfg), device).parallel.cuda_graphs
        return
    with pytest.raises(ValueError) as info:
        resolve_spec(cfg, layout, model_config(cfg), device)
    message = str(info.value)
    assert message.startswith("model.cuda_graphs=true: ") and expected in message and "\n" not in message, message


def test_keep_grads_makes_the_layers_gradients_only():
    """runner.keep_grads (model.cuda_graphs): zeros `.grad` for every trained parameter of the decoder layers
    that has none, before the first backward; it leaves the embedding and head (eager, outside the graphs),
    frozen parameters and a `.grad` that already exists alone."""
    from qwenft.models.loader import build_model, init_random_weights
    from qwenft.models.qwen3_5.configs import named_config
    from qwenft.train.runner import keep_grads

    model = init_random_weights(build_model(named_config("tiny"), kernels="torch"), seed=0, device="cpu",
                                dtype=torch.float32)
    frozen = model.layers["0"].input_layernorm.weight
    frozen.requires_grad_(False)
    held = model.layers["1"].mlp.up_proj.weight
    held.grad = torch.ones_like(held)
    keep_grads([model])
    for name, p in model.named_parameters():
        if p is frozen or not name.startswith("layers."):
            assert p.grad is None, name
        elif p is held:
            assert torch.equal(p.grad, torch.ones_like(p)), name
        else:
            assert p.grad is not None and not p.grad.any(), name


@pytest.mark.parametrize("model, compiled", [("tiny", False), ("qwen3_5_0_8b", True), ("qwen3_5_9b", True),
                                             ("qwen3_5_27b", True), ("qwen3_5_35b_a3b", False)])
def test_the_real_size_dense_model_groups_compile_by_default(model, compiled):
    """The dense Qwen3.5 sizes train compiled unless told otherwise (model.compile=false); the tiny model (CPU
    runs, where compiling costs more than it saves) and the MoE groups stay eager."""
    assert compose(["recipe=tiny", f"model={model}"]).model.compile is compiled
    assert compose(["recipe=tiny", f"model={model}", "model.compile=false"]).model.compile is False
