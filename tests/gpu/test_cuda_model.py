"""The tiny model and its training runs on CUDA: against the same run on the CPU (fp32), compiled against eager, and
the multi-rank code paths (tensor parallel, the per-microbatch gradient reduce) as rank 0 of a fake world."""

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers import (CUDA_FP32, assert_same_training, compose, logged_losses, parity_overrides, rel_err,
                     run_qwenft, save_random_checkpoint, train_alone)
from qwenft.distributed.fake_pg import fake_process_group
from qwenft.models.loader import build_model, init_random_weights
from qwenft.models.qwen3_5.configs import named_config

pytestmark = pytest.mark.gpu


def test_tiny_forward_on_cuda_equals_cpu():
    """A row of two packed documents through the tiny model (3 GatedDeltaNet layers, 1 attention layer; torch
    kernels, SDPA): CUDA's logits within 1e-4 of the CPU's. fp32 on both; torch's CUDA matmuls default to
    full fp32, not TF32."""
    cfg = named_config("tiny")
    cpu, cuda = (init_random_weights(build_model(cfg, kernels="torch"), seed=0, device="cpu", dtype=torch.float32)
                 for _ in range(2))
    cuda.to("cuda")
    ids = torch.randint(0, cfg.text.vocab_size, (1, 128), generator=torch.Generator().manual_seed(0))
    cu_seqlens = torch.tensor([0, 70, 128], dtype=torch.int32)  # the first document crosses a GDN chunk (64)
    with torch.no_grad():
        ref = cpu(input_ids=ids, cu_seqlens=cu_seqlens)
        out = cuda(input_ids=ids.cuda(), cu_seqlens=cu_seqlens.cuda())
    assert out.device.type == "cuda"
    assert rel_err(out.cpu(), ref) < 1e-4


@pytest.mark.timeout(300, method="signal")  # fla's bf16 kernels at the tiny shapes autotune, cold
def test_a_microbatch_never_makes_the_host_wait():
    """The tiny model in bf16 on the CUDA kernels training picks (fla's GDN, varlen flash attention, the fused
    cross-entropy): a packed microbatch's transfer (`device_batch`), forward and backward under torch.cuda's
    sync debug mode, which warns at every op that makes the host wait for the GPU, from the Python line that
    ran it (for a sync inside the backward's C++ formulas: torch's autograd, after the backward). A step whose
    microbatches sync lets the host queue only one microbatch's kernels ahead. fla's kernels get the chunk
    indices built on the host (`varlen.Varlen.chunk_indices`): fla's own build copies them from pageable memory,
    which waits. Every sync's place and count are printed. After one pass of the same shapes outside the mode
    (kernels compile and autotune)."""
    import warnings
    from collections import Counter

    from qwenft.train.evaluate import device_batch, forward_batch

    cfg = named_config("tiny")
    model = init_random_weights(build_model(cfg, kernels="auto", attention_kernel="auto", ce_kernel="fused"),
                                seed=0, device="cuda", dtype=torch.bfloat16)
    T = 256
    mb = {"input_ids": torch.randint(0, cfg.text.vocab_size, (1, T), generator=torch.Generator().manual_seed(0)),
          "position_ids": torch.cat([torch.arange(100), torch.arange(T - 100)]).view(1, T),
          "cu_seqlens": torch.tensor([0, 100, T], dtype=torch.int32)}
    mb["labels"] = mb["input_ids"].roll(-1, dims=1)
    for debug_mode in ("default", "warn"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode(debug_mode)
            try:
                on_device = device_batch(mb, torch.device("cuda"))
                loss = forward_batch(model, on_device, labels=on_device["labels"])
                loss.backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
    syncs = Counter(f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))
    print("host syncs:", dict(syncs))
    assert not syncs, f"the host waits for the GPU at {dict(syncs)}"
    assert math.isfinite(loss.item())
    assert all(p.grad is not None for p in model.parameters())


def _exported(run_dir) -> dict:
    """The parameters of run_dir's HF export (every safetensors file of run_dir/hf), on the CPU."""
    from safetensors.torch import load_file

    state = {}
    for path in sorted((Path(run_dir) / "hf").glob("*.safetensors")):
        state.update(load_file(path))
    assert state, f"no safetensors in {run_dir}/hf"
    return state


def test_three_steps_on_cuda_equal_cpu(tmp_path):
    """3 steps of the tiny recipe (4 packed microbatches of 128 tokens each, fp32 weights, activations and AdamW
    state) through the runner on CUDA in this process, against the same run on the CPU: `python -m qwenft
    train` with CUDA hidden, the one way to make the runner pick the CPU on a GPU machine. Each step's loss and
    every parameter of the fp32 HF export within 1e-4. Both start from one checkpoint on disk: the seed's random
    init draws from the device's generator, so a CPU run and a CUDA run of the same seed start apart."""
    checkpoint = save_random_checkpoint(named_config("tiny"), tmp_path / "start", seed=7, tokenizer="tiny")
    extra = (*CUDA_FP32, "checkpoint.export_dtype=float32", f"model.path={checkpoint}")
    cpu_dir, cuda_dir = tmp_path / "cpu", tmp_path / "cuda"
    cpu = run_qwenft("train", *parity_overrides(cpu_dir, *extra), env={"CUDA_VISIBLE_DEVICES": ""})
    assert cpu.returncode == 0, cpu.stderr[-4000:]
    assert "cpu threads:" in (cpu_dir / "train.log").read_text()  # logged by CPU runs only: it ran on the CPU
    torch.cuda.reset_peak_memory_stats()
    result = train_alone(parity_overrides(cuda_dir, *extra))
    assert torch.cuda.max_memory_allocated() > 0  # it ran on CUDA
    losses = logged_losses(cpu_dir)
    reference = SimpleNamespace(losses=[losses[step] for step in sorted(losses)], val_losses={},
                                state_dict=_exported(cpu_dir))
    on_cuda = SimpleNamespace(losses=result.losses, val_losses={}, state_dict=_exported(cuda_dir))
    assert_same_training(on_cuda, reference, rtol=1e-4)


def test_compiled_layers_train_like_eager_on_cuda(tmp_path):
    """model.compile=true (inductor's Triton kernels for each layer's norms, MLP and the mixers' projections)
    against eager, 3 steps of the tiny recipe in fp32 on CUDA: losses and every parameter within 1e-4."""
    eager = train_alone(parity_overrides(tmp_path / "eager", *CUDA_FP32, "checkpoint.export_hf=false"),
                        return_state=True)
    from torch._dynamo.utils import counters

    counters.clear()
    compiled = train_alone(parity_overrides(tmp_path / "compiled", *CUDA_FP32, "checkpoint.export_hf=false",
                                            "model.compile=true"), return_state=True)
    assert counters["stats"]["unique_graphs"] > 0  # it did compile: equal runs would pass otherwise
    assert_same_training(compiled, eager, rtol=1e-4)


@pytest.mark.parametrize("weight_grad", ["in_matmul", "autograd"])
def test_cuda_graphs_train_like_compile_on_cuda(tmp_path, weight_grad):
    """model.cuda_graphs=true (each compiled graph recorded once as a CUDA graph, then replayed) against
    model.compile=true alone, 3 steps of the tiny recipe in fp32 on CUDA (4 microbatches a step, so the graphs
    replay from the first step on), with validation passes after steps 2 and 3 (no-grad graphs of their own,
    then training's again): losses, the validation loss and every parameter within 1e-5. No graph was left out of
    CUDA graphs (inductor counts each one it cannot record). in_matmul: the backward graphs add the weight
    gradients into the buffers they were recorded with, at every replay (a lost add would change the weights).
    Each run compiles afresh, as a run of its own process does: Dynamo's cache, kept in the process, would hand
    one parametrization the graphs an earlier one compiled (counting none)."""
    from torch._dynamo.utils import counters

    common = (*CUDA_FP32, "checkpoint.export_hf=false", "model.compile=true", "model.activation_checkpointing=false",
              "eval.every_steps=2", "eval.dataset=tiny", "eval.max_batches=2",
              f"model.kernels.weight_grad={weight_grad}")
    torch._dynamo.reset()
    compiled = train_alone(parity_overrides(tmp_path / "compiled", *common), return_state=True)
    torch._dynamo.reset()
    counters.clear()
    graphs = train_alone(parity_overrides(tmp_path / "graphs", *common, "model.cuda_graphs=true"), return_state=True)
    assert counters["stats"]["unique_graphs"] > 0 and counters["inductor"]["cudagraph_skips"] == 0, dict(counters)
    assert sorted(compiled.val_losses) == [2, 3]  # after step 2, then after the last
    assert_same_training(graphs, compiled, rtol=1e-5)


@pytest.mark.timeout(300, method="signal")  # fla's bf16 kernels at tp2's shapes and inductor's compile, cold
def test_cuda_graphs_with_fla_at_tp2_train_like_compile_in_a_fake_world(tmp_path):
    """Rank 0 of a fake tp2 world in bf16 with fla's GatedDeltaNet kernels: model.cuda_graphs=true (at tp > 1 fla's
    conv and delta rule are replayed as CUDA graphs of their own on fixed layouts, gdn_graph.py) against
    model.compile=true alone, 3 steps of the tiny recipe on packed rows, validation (fla eager under no_grad)
    after step 2: equal losses to bf16's rounding, and fla's kernels did run as graphs."""
    from qwenft.models.qwen3_5 import gdn_graph
    from qwenft.train.runner import run

    common = ("model.dtype=bfloat16", "model.kernels.gdn=fla", "optim.master_dtype=bfloat16", "mesh.tp=2",
              "checkpoint.export_hf=false", "model.compile=true", "model.activation_checkpointing=false",
              "eval.every_steps=2", "eval.dataset=tiny", "eval.max_batches=2")
    results = []
    for name, extra in (("compiled", ()), ("graphs", ("model.cuda_graphs=true",))):
        gdn_graph._LAYOUTS.clear()
        with fake_process_group(world_size=2):
            results.append(run(compose(parity_overrides(tmp_path / name, *common, *extra))))
    assert gdn_graph._LAYOUTS, "no GatedDeltaNet layer ran its kernels as graphs"
    compiled, graphs = results
    assert len(compiled.losses) == 3 and compiled.losses[0] != compiled.losses[-1]
    losses = lambda result: [*result.losses, *result.val_losses.values()]  # noqa: E731
    for got, want in zip(losses(graphs), losses(compiled)):
        assert abs(got - want) <= 2e-3 * abs(want), (graphs.losses, compiled.losses, graphs.val_losses)


def test_cuda_graphs_replay_the_compiled_layers():
    """The tiny model's layers compiled with cuda_graphs=True against compiled without: after two passes (a graph
    runs once as is, is recorded at its second call), a third forward + backward launches CUDA graphs
    (cudaGraphLaunch in torch's profiler), and every pass gives the same logits and weight gradients. The
    layers' `.grad` are made before the first backward, as the runner does (`runner.keep_grads`)."""
    from torch.profiler import ProfilerActivity, profile

    from qwenft.distributed.parallelize import apply_compile
    from qwenft.train.runner import keep_grads

    cfg = named_config("tiny")
    models = []
    for cuda_graphs in (False, True):
        model = init_random_weights(build_model(cfg, kernels="torch"), seed=0, device="cuda", dtype=torch.float32)
        apply_compile(model, cuda_graphs=cuda_graphs)
        keep_grads([model])
        models.append(model)
    ids = torch.randint(0, cfg.text.vocab_size, (1, 128), generator=torch.Generator().manual_seed(0)).cuda()
    cu_seqlens = torch.tensor([0, 70, 128], dtype=torch.int32, device="cuda")
    weight = lambda model: model.layers["0"].mlp.up_proj.weight  # noqa: E731
    for attempt in range(3):
        outs = []
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for model in models:
                logits = model(input_ids=ids, cu_seqlens=cu_seqlens)
                logits.square().mean().backward()
                outs.append((logits.detach().clone(), weight(model).grad.clone()))
        (ref, ref_grad), (out, grad) = outs
        assert rel_err(out, ref) < 1e-5 and rel_err(grad, ref_grad) < 1e-5, (attempt, rel_err(out, ref))
    assert any(event.name == "cudaGraphLaunch" for event in prof.events())


def test_cuda_graphs_at_tp2_train_like_compile_in_a_fake_world(tmp_path):
    """Rank 0 of a fake tp2 world, fp32, 3 steps: model.cuda_graphs=true against model.compile=true alone. The
    fake collectives return at once, so both runs' numbers are meaningless but deterministic: equal losses (each
    step's loss depends on every earlier step's update) check what tensor parallelism adds under CUDA graphs: the
    DTensor parameters' local tensors taken at their addresses, the graphs' recorded all-reduces, and the
    gradients added into `.grad` after each replay."""
    from qwenft.train.runner import run

    losses = []
    for name, extra in (("compiled", ()), ("graphs", ("model.cuda_graphs=true",))):
        overrides = parity_overrides(tmp_path / name, *CUDA_FP32, "checkpoint.export_hf=false", "mesh.tp=2",
                                     "model.compile=true", "model.activation_checkpointing=false", *extra)
        with fake_process_group(world_size=2):
            losses.append(run(compose(overrides)).losses)
    compiled, graphs = losses
    assert len(compiled) == 3 and compiled[0] != compiled[-1], compiled
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(graphs, compiled)), (graphs, compiled)


@pytest.mark.parametrize("mesh", [("mesh.tp=2",), ("mesh.dp=2", "pipeline.reduce_grad_per_microbatch=true"),
                                  ("mesh.tp=2", "model.compile=true", "model.cuda_graphs=true",
                                   "optim.master_dtype=bfloat16", "model.activation_checkpointing=false")],
                         ids=["tp2", "dp2_reduce_grad_per_microbatch", "tp2_cuda_graphs"])
def test_multi_rank_path_trains_as_rank_0_of_a_fake_world(tmp_path, mesh):
    """Rank 0 of 2 on the fake process group (qwenft.distributed.fake_pg; collectives return at once), the
    runner's CUDA defaults (bf16, fla's GDN when installed, varlen flash attention, fused AdamW): tp2 (head-sharded
    projections, vocab-parallel embedding and loss), dp2 with FSDP reduce-scattering every microbatch's
    gradients (2 microbatches per step), and tp2 in bf16 on fla's kernels with its compiled layers replayed as
    CUDA graphs each train 3 steps to finite losses. Their numbers are the CPU tier's
    (tests/test_tensor_parallel.py, tests/test_fsdp.py); the fake collectives make these meaningless."""
    from qwenft.train.runner import run

    overrides = parity_overrides(tmp_path / "run", "model.kernels.gdn=auto", "checkpoint.export_hf=false", *mesh)
    with fake_process_group(world_size=2):
        result = run(compose(overrides))
    assert len(result.losses) == 3 and all(math.isfinite(loss) for loss in result.losses), result.losses
