"""Pipeline parallelism trains the same numbers as one process (fp32, CPU, gloo ranks), under every schedule.

seq_len is 128, not 64: at 64, pp2 x dp2 moved layers.0.linear_attn.a_proj (tiny gradients, which Adam
normalizes) to 1.01e-5 of one process from reduction order alone; at 128 the worst parameter is 3e-6.
"""

import os
import subprocess
import sys

import pytest
import torch

from distributed import run_distributed, threads_per_rank
from helpers import (REPO, assert_same_training, assert_within, build_data, compose, fp32_rtol, logged_losses,
                     model_config, parity_overrides, train, train_with_state)
from qwenft.distributed.pipeline.schedule import SCHEDULES
from qwenft.distributed.pipeline.split import split_layers


def _overrides(tmp_path, name, *extra):
    return parity_overrides(tmp_path / name, *extra)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, global batch 4 as 4 microbatches of 1."""
    (result,) = run_distributed(train_with_state, 1, _overrides(tmp_path_factory.mktemp("reference"), "ref"))
    return result


@pytest.mark.distributed
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_pp2_schedule_equals_one_process(tmp_path, reference, schedule):
    """4 layers: 2 stages of 2 layers (gpipe, 1f1b) or 2 ranks x 2 virtual stages of 1 layer (the others)."""
    results = run_distributed(train_with_state, 2, _overrides(tmp_path, schedule, "mesh.pp=2",
                                                              f"pipeline.schedule={schedule}"))
    for result in results:  # every rank returns the gathered state and the broadcast loss
        assert_same_training(result, reference)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("schedule, knob", [("1f1b", "false"), ("1f1b", "true"), ("zbv", "true")])
def test_pp2_dp2_equals_one_process(tmp_path, reference, schedule, knob):
    results = run_distributed(train_with_state, 4, _overrides(
        tmp_path, f"pp2dp2-{schedule}-{knob}", "mesh.pp=2", f"pipeline.schedule={schedule}",
        f"pipeline.reduce_grad_per_microbatch={knob}"))
    assert_same_training(results[0], reference)
    assert_same_training(results[3], reference)


@pytest.mark.distributed
@pytest.mark.slow
def test_pp4_equals_one_process(tmp_path, reference):
    results = run_distributed(train_with_state, 4, _overrides(tmp_path, "pp4", "mesh.pp=4", "pipeline.schedule=gpipe"))
    assert_same_training(results[0], reference)


@pytest.mark.distributed
@pytest.mark.slow
def test_vlm_pp2_equals_one_process(tmp_path):
    """recipe=tiny_vlm under pp2 (1F1B, 4 microbatches of 2 rows): images reach stage 0 per microbatch (padded
    per microbatch, padding dropped in the stage; M-RoPE position ids travel batch-first) and training matches
    one process within fp32_rtol."""
    overrides = ["recipe=tiny_vlm", "train.max_steps=3", "data.seq_len=128", "optim.lr=5e-4",
                 "lr_scheduler.warmup_steps=0", "model.kernels.gdn=torch", "train.progress_bar=false",
                 "checkpoint.export_hf=false"]
    (reference,) = run_distributed(train_with_state, 1, [*overrides, f"run_dir={tmp_path / 'ref'}"])
    results = run_distributed(train_with_state, 2, [*overrides, "mesh.pp=2", f"run_dir={tmp_path / 'pp2'}"])
    assert any(name.startswith("visual.") for name in reference.state_dict)
    for result in results:
        assert_same_training(result, reference)


def test_vlm_microbatch_images_padded_and_dropped():
    """PipelineBatch + the schedule's dim-0 split + StageModel give each microbatch exactly its own images and
    [3, B, T] positions, and a microbatch without images runs with pixel_values=None (same logits as the model)."""
    from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks

    from qwenft.distributed.pipeline.schedule import PipelineBatch
    from qwenft.distributed.pipeline.stage import build_stage_model
    from qwenft.models.loader import init_random_weights

    cfg = compose(["recipe=tiny_vlm", "data.seq_len=128"])
    model_cfg = model_config(cfg)
    _, data, _ = build_data(cfg, model_cfg, 2, 0, 1)
    batches = iter(data)
    mbs = [next(batches) for _ in range(2)]
    vision_ids = max(model_cfg.image_token_id, model_cfg.video_token_id) + 1  # ids below are vision tokens
    text_only = {**mbs[0], "input_ids": mbs[0]["input_ids"].clamp(min=vision_ids),
                 "pixel_values": mbs[0]["pixel_values"][:0], "image_grid_thw": mbs[0]["image_grid_thw"][:0],
                 "pixel_values_videos": mbs[0]["pixel_values_videos"][:0],
                 "video_grid_thw": mbs[0]["video_grid_thw"][:0]}
    mbs.insert(1, text_only)
    batch = PipelineBatch.from_microbatches(mbs, "cpu")
    _, kwarg_chunks = split_args_kwargs_into_chunks((), batch.kwargs(), len(mbs))
    stage = build_stage_model(model_cfg, range(model_cfg.text.num_hidden_layers), True, True, "torch")
    init_random_weights(stage, seed=0, device="cpu", dtype=torch.float32)
    with torch.no_grad():
        for mb, ids, kw in zip(mbs, batch.input_ids.chunk(len(mbs)), kwarg_chunks):
            images = {}
            if len(mb["image_grid_thw"]):
                images = {"pixel_values": mb["pixel_values"], "image_grid_thw": mb["image_grid_thw"]}
            if len(mb["video_grid_thw"]):  # the tiny_vlm set's videos
                images.update(pixel_values_videos=mb["pixel_values_videos"], video_grid_thw=mb["video_grid_thw"])
            ref = super(type(stage), stage).forward(input_ids=mb["input_ids"], position_ids=mb["position_ids"],
                                                    cu_seqlens=mb["cu_seqlens"], **images)
            assert torch.equal(stage(ids, **kw), ref)


@pytest.fixture(scope="module")
def tp2_reference(tmp_path_factory):
    """tp2 without pipelining: the same tensor-parallel reduction order as tp2 x pp2."""
    results = run_distributed(train_with_state, 2, _overrides(tmp_path_factory.mktemp("tp2"), "tp2", "mesh.tp=2"))
    return results[0]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("world_size, knob", [(4, "false"), (8, "true")])
def test_tp2_pp2_dpn_equals_one_process(tmp_path, reference, tp2_reference, world_size, knob):
    """TP inside each stage (tp2 x pp2, and 3D tp2 x pp2 x dp2), within fp32_rtol of one process and of tp2
    without pipelining. tp2 alone sits up to ~3e-5 from one process (a_proj, whose tiny gradients Adam normalises,
    summed in tensor-parallel order), inside the per-tensor bound."""
    results = run_distributed(train_with_state, world_size, _overrides(
        tmp_path, f"tp2pp2-{world_size}", "mesh.tp=2", "mesh.pp=2", f"pipeline.reduce_grad_per_microbatch={knob}"))
    for result in (results[0], results[-1]):
        assert_same_training(result, reference)
        assert_same_training(result, tp2_reference)


# ------------------------------------------------------------------ stages built by hand: memory, eval

def _batch(dp_rank: int, n_microbatches: int, seq_len: int = 32, vocab: int = 512):
    """Two packed documents per row; the same numbers on every pp rank of a dp rank."""
    from qwenft.distributed.pipeline.schedule import PipelineBatch

    g = torch.Generator().manual_seed(100 + dp_rank)
    input_ids = torch.randint(0, vocab, (n_microbatches, seq_len), generator=g)
    split = seq_len // 3
    position_ids = torch.cat([torch.arange(split), torch.arange(seq_len - split)]).expand(n_microbatches, -1)
    labels = torch.randint(0, vocab, (n_microbatches, seq_len), generator=g)
    labels[:, :4] = -100
    return PipelineBatch(input_ids, position_ids.contiguous(), labels)


def _stage(mesh, cfg, knob: bool, record: bool = False):
    from qwenft.distributed.fsdp import apply_fsdp
    from qwenft.distributed.pipeline.stage import ReduceGradStage, build_stage_model, reshard_policy
    from qwenft.models.loader import init_random_weights

    i = mesh["pp"].get_local_rank()
    module = build_stage_model(cfg, split_layers(4, 2)[i], embed=i == 0, head=i == 1, kernels="torch")
    reshard = reshard_policy("1f1b", knob)
    apply_fsdp(module, mesh["dp"], torch.float32, reshard_after_forward=reshard)
    init_random_weights(module, seed=0, device="cpu", dtype=torch.float32)
    stage = ReduceGradStage(module, i, 2, torch.device("cpu"), group=mesh["pp"].get_group(),
                            reduce_grad_per_microbatch=knob, reshard=reshard, record_grad_bytes=record)
    return module, stage


def _grad_bytes_after_first_microbatch(rank, world_size, knob):
    """pp2 x dp(world_size / 2), 1F1B, 2 microbatches: what a stage holds after microbatch 0's backward."""
    from qwenft.conf.layout import Layout
    from qwenft.distributed.mesh import build_mesh
    from qwenft.distributed.pipeline.schedule import TokenCE, build_schedule, train_step
    from qwenft.models.qwen3_5.configs import named_config

    mesh = build_mesh(Layout(pp=2, dp=world_size // 2, tp=1))
    module, stage = _stage(mesh, named_config("tiny"), knob, record=True)
    loss_fn = TokenCE()
    schedule = build_schedule("1f1b", [stage], 2, loss_fn)
    batch = _batch(mesh["dp"].get_local_rank(), 2)
    train_step(schedule, [stage], batch, loss_fn, torch.tensor(100.0), mesh["dp"].get_group(),
               mesh["pp"].get_group())
    full = sum(p.numel() * p.element_size() for p in module.parameters())  # DTensor numel is the global one
    return stage.first_backward_grad_bytes, full, len(list(module.parameters()))


@pytest.mark.distributed
@pytest.mark.parametrize("knob", [False, True])
@pytest.mark.parametrize("dp", [2, 4])
def test_knob_gradient_memory_after_first_microbatch(knob, dp):
    """Knob off: a full-size accumulator (= the stage's parameter bytes, one tensor per parameter) after
    microbatch 0's backward; on: no unsharded gradient at all, only 1/dp shards. dp4 is the reference's
    8-rank validation layout (pp2 x dp4)."""
    results = run_distributed(_grad_bytes_after_first_microbatch, 2 * dp, knob)
    for rank, (grad_bytes, full, tensors) in enumerate(results):
        print(f"pp2 x dp{dp} knob={knob} rank {rank}: stage params {full} B in {tensors} tensors, "
              f"after microbatch 0: {grad_bytes}")
        if knob:
            assert grad_bytes["unsharded"] == grad_bytes["unsharded_tensors"] == 0
            assert 0 < grad_bytes["sharded"] <= full // dp + 4096  # 1/dp, plus uneven-shard rounding
        else:
            assert grad_bytes["unsharded"] == full and grad_bytes["unsharded_tensors"] == tensors


def _eval_vs_one_process(rank, world_size):
    from qwenft.conf.layout import Layout
    from qwenft.distributed.mesh import build_mesh
    from qwenft.distributed.pipeline.schedule import TokenCE, build_schedule, pipeline_eval_loss
    from qwenft.models.loader import build_model, init_random_weights
    from qwenft.models.qwen3_5.configs import named_config
    from qwenft.models.loss import token_ce_sum

    mesh = build_mesh(Layout(pp=2, dp=2, tp=1))
    cfg = named_config("tiny")
    _, stage = _stage(mesh, cfg, knob=False)
    schedule = build_schedule("1f1b", [stage], 2, TokenCE())
    batch = _batch(mesh["dp"].get_local_rank(), 2)
    ce, tokens = pipeline_eval_loss(schedule, [stage], batch, mesh["dp"].get_group(), mesh["pp"].get_group())

    full = init_random_weights(build_model(cfg, kernels="torch"), seed=0, device="cpu", dtype=torch.float32)
    from qwenft.data.packing import cu_seqlens_from_position_ids

    ref_ce, ref_tokens = 0.0, 0
    with torch.no_grad():
        for dp_rank in range(2):
            b = _batch(dp_rank, 2)
            logits = full(input_ids=b.input_ids, position_ids=b.position_ids,
                          cu_seqlens=cu_seqlens_from_position_ids(b.position_ids))
            ref_ce += token_ce_sum(logits, b.labels).item()
            ref_tokens += int((b.labels != -100).sum())
    return ce.item(), int(tokens.item()), ref_ce, ref_tokens


@pytest.mark.distributed
def test_pipeline_eval_loss_equals_one_process():
    for ce, tokens, ref_ce, ref_tokens in run_distributed(_eval_vs_one_process, 4):
        assert tokens == ref_tokens
        assert abs(ce - ref_ce) <= 1e-5 * ref_ce, (ce, ref_ce)


# ------------------------------------------------------------------ stage split, config errors

def test_balanced_split_counts_embeddings_and_head():
    assert [len(s) for s in split_layers(64, 4)] == [16, 16, 16, 16]  # 27B, pp4: 66 layer-equivalents
    assert split_layers(4, 2) == [[0, 1], [2, 3]]
    assert split_layers(4, 4) == [[0], [1], [2], [3]]
    assert [len(s) for s in split_layers(10, 2)] == [5, 5]
    assert [len(s) for s in split_layers(9, 3)] == [3, 3, 3]  # costs 4, 3, 4 beat 3, 4, 4 on even layer counts
    vlm = [len(s) for s in split_layers(64, 4, has_vision=True)]  # stage 0 also carries the vision tower
    assert vlm[0] == 15 and max(vlm[0] + 2, vlm[1], vlm[2], vlm[3] + 1) == 17 and sum(vlm) == 64


def test_split_overrides_and_errors():
    assert split_layers(4, 2, layers_per_stage=[1, 3]) == [[0], [1, 2, 3]]
    assert split_layers(4, 2, stage_layers=[[0, 1, 2], [3]]) == [[0, 1, 2], [3]]
    with pytest.raises(ValueError, match=r"pipeline.layers_per_stage=\[2, 1\] must have 2 entries"):
        split_layers(4, 2, layers_per_stage=[2, 1])
    with pytest.raises(ValueError, match="pipeline.stage_layers"):
        split_layers(4, 2, stage_layers=[[0, 2], [1, 3]])
    with pytest.raises(ValueError, match="fewer than the 8 pipeline stages"):
        split_layers(4, 8)
    for bad, message in (({"stage_layers": [1, 3]}, r"pipeline.stage_layers=\[1, 3\]: expected a list of each stage's "
                                                     r"layer indices, e.g. \[\[0, 1\], \[2, 3\]\]$"),
                         ({"layers_per_stage": [2.5, 1.5]}, r"pipeline.layers_per_stage=\[2.5, 1.5\]: expected a list "
                                                            r"of each stage's layer count, e.g. \[2, 2\]$"),
                         ({"layers_per_stage": ["a", "b"]}, r"pipeline.layers_per_stage=\['a', 'b'\]: expected"),
                         ({"layers_per_stage": [[2], [2]]}, r"pipeline.layers_per_stage=\[\[2\], \[2\]\]: expected")):
        with pytest.raises(ValueError, match=message):
            split_layers(4, 2, **bad)


@pytest.mark.parametrize("schedule, batch, message", [
    ("1f1b", 2, "train.global_batch_size=2 makes 1 microbatch a step (train.micro_batch_size=2, mesh.dp=1), and it "
                "needs at least as many microbatches as stages (2); set train.global_batch_size=4, or another "
                "pipeline.schedule"),
    ("interleaved_1f1b", 10, "train.global_batch_size=10 makes 5 microbatches a step (train.micro_batch_size=2, "
                             "mesh.dp=1), and it needs a multiple of its rounds (microbatches // mesh.pp = 2); set "
                             "train.global_batch_size=12, or another pipeline.schedule"),
    ("dualpipev", 6, "train.global_batch_size=6 makes 3 microbatches a step (train.micro_batch_size=2, mesh.dp=1), and "
                     "it needs at least as many microbatches as stages (4); set train.global_batch_size=8, or another "
                     "pipeline.schedule"),
])
def test_microbatches_a_schedule_refuses_are_refused_at_the_start(capfd, schedule, batch, message):
    """torch's schedules check the microbatch count when the step is built, after the run dir and the model:
    `qwenft plan` (and so train and slurm, through the same spec) refuses it first, naming the batch that fits,
    which then plans."""
    from helpers import qwenft_alone

    args = ["recipe=tiny", "mesh.pp=2", f"pipeline.schedule={schedule}", "train.micro_batch_size=2"]
    assert qwenft_alone("plan", *args, f"train.global_batch_size={batch}") == 2
    assert capfd.readouterr().err.strip() == (f"qwenft: error: pipeline.schedule={schedule} with mesh.pp=2: "
                                              f"{message}")
    fits = message.split("set train.global_batch_size=")[1].split(",")[0]
    assert qwenft_alone("plan", *args, f"train.global_batch_size={fits}") == 0


def test_sequence_parallel_sequence_length_is_checked_at_the_start(capfd):
    from helpers import qwenft_alone

    assert qwenft_alone("plan", "recipe=tiny", "mesh.tp=2", "mesh.sequence_parallel=true", "data.seq_len=127") == 2
    assert capfd.readouterr().err.strip() == ("qwenft: error: mesh.sequence_parallel=true splits each row's "
                                              "data.seq_len=127 tokens over mesh.tp=2 ranks; set data.seq_len to a "
                                              "multiple of 2")


def test_bad_schedule_is_one_line_listing_valid_ones():
    with pytest.raises(ValueError) as e:
        compose(["pipeline.schedule=zb"])
    msg = str(e.value)
    assert "\n" not in msg and "pipeline.schedule='zb' is not valid" in msg
    assert all(name in msg for name in SCHEDULES)


@pytest.mark.distributed
def test_num_microbatches_must_agree(tmp_path):
    with pytest.raises(RuntimeError, match=r"pipeline.num_microbatches=3 but train.global_batch_size=4 / dp=1 "
                                           r"/ train.micro_batch_size=1 = 4"):
        run_distributed(train_with_state, 1, _overrides(tmp_path, "nmb", "pipeline.num_microbatches=3"))


def test_microbatch_size_is_one_setting_under_two_names():
    from qwenft.train.spec import resolve_batching

    assert resolve_batching(compose(["pipeline.microbatch_size=2", "train.micro_batch_size=2"]), 1).microbatch_size == 2
    with pytest.raises(ValueError) as e:
        compose(["recipe=qwen3_5_27b_pp2dp4", "data.path=x.jsonl", "pipeline.microbatch_size=2"])
    assert str(e.value) == ("pipeline.microbatch_size=2 and train.micro_batch_size=1 disagree; they are one setting "
                            "(sequences per microbatch): set train.micro_batch_size=2 and leave "
                            "pipeline.microbatch_size=null")


@pytest.mark.distributed
def test_virtual_stages_must_fit_schedule(tmp_path):
    with pytest.raises(RuntimeError, match="pipeline.virtual_stages=1 but pipeline.schedule=zbv needs exactly 2"):
        run_distributed(train_with_state, 2, _overrides(tmp_path, "vs", "mesh.pp=2", "pipeline.schedule=zbv",
                                              "pipeline.virtual_stages=1"))


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_validation_under_a_v_shaped_schedule_is_refused_at_start(schedule):
    """torch's V-shaped schedules hold backward actions that a forward-only pass has none for (eval() fails
    deep in torch): one line before anything is built."""
    from qwenft.conf.layout import Layout
    from qwenft.train.spec import check_mesh_keys

    cfg = compose(["recipe=tiny", "mesh.pp=2", f"pipeline.schedule={schedule}", "eval.every_steps=5",
                   "eval.dataset=tiny"])
    with pytest.raises(ValueError) as e:
        check_mesh_keys(cfg, Layout(pp=2, dp=1, tp=1))
    assert str(e.value) == (f"eval.every_steps=5 with pipeline.schedule={schedule}: torch's V-shaped schedules "
                            f"(zbv, dualpipev) cannot run a forward-only pass; use another pipeline.schedule "
                            f"(e.g. interleaved_zb) or eval.every_steps=0")
    check_mesh_keys(compose(["recipe=tiny", "mesh.pp=2", f"pipeline.schedule={schedule}"]), Layout(pp=2, dp=1, tp=1))


# ------------------------------------------------------------------ the CLI, as a user runs it

TORCHRUN_ARGS = ["recipe=tiny", "train.max_steps=3", "data.seq_len=128", "train.progress_bar=false", "optim.lr=5e-4",
                 "lr_scheduler.warmup_steps=0", "checkpoint.export_hf=false"]


@pytest.fixture(scope="module")
def torchrun_reference(tmp_path_factory):
    """The losses of TORCHRUN_ARGS in one process (a forked rank, as `qwenft train` runs it alone)."""
    run_dir = tmp_path_factory.mktemp("torchrun-reference") / "one"
    run_distributed(train, 1, [*TORCHRUN_ARGS, f"run_dir={run_dir}"])
    return list(logged_losses(run_dir).values())


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("nproc, mesh", [(2, ["mesh.pp=2"]), (4, ["mesh.tp=2", "mesh.pp=2"])])
def test_torchrun_matches_one_process(tmp_path, torchrun_reference, nproc, mesh):
    """The issue's command, `torchrun --nproc-per-node N -m qwenft train recipe=tiny mesh...`, logs the losses
    of one process."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads_per_rank())}
    pp = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                         "-m", "qwenft", "train", *TORCHRUN_ARGS, *mesh, f"run_dir={tmp_path / 'pp'}"], cwd=REPO,
                        capture_output=True, text=True, timeout=600, env=env)
    assert pp.returncode == 0, pp.stderr[-3000:]
    a, b = list(logged_losses(tmp_path / "pp").values()), torchrun_reference
    assert len(a) == len(b) == 3
    for step, (x, y) in enumerate(zip(a, b)):
        assert_within(f"step {step + 1}'s loss", abs(x - y) / abs(y), fp32_rtol(step))
    tp = 2 if "mesh.tp=2" in mesh else 1
    assert f"pp 2 x dp 1 x tp {tp}" in (tmp_path / "pp" / "train.log").read_text()


# ------------------------------------------------------------------ recipes

PARALLEL_RECIPES = {  # recipe: (world size it is meant for, tp, pp)
    "qwen3_5_27b_tp4pp4": (16, 4, 4), "qwen3_5_27b_pp2dp4": (8, 1, 2), "qwen3_5_27b_tp2pp2dp2": (8, 2, 2),
    "tiny_tp2": (2, 2, 1), "tiny_pp2": (2, 1, 2), "tiny_3d": (8, 2, 2),
    "qwen3_5_35b_a3b": (8, 1, 1), "qwen3_5_122b_a10b": (32, 1, 4), "qwen3_5_397b_a17b": (128, 1, 16),
}


@pytest.mark.parametrize("recipe", list(PARALLEL_RECIPES))
def test_parallel_recipes_show_and_fit_their_mesh(recipe, capsys):
    from qwenft.cli import main
    from qwenft.conf.layout import resolve_layout
    from qwenft.distributed.pipeline.split import default_virtual_stages
    from qwenft.distributed.tensor_parallel import validate_tp
    from qwenft.models.qwen3_5.configs import named_config
    from qwenft.train.spec import resolve_batching

    assert main(["show", f"recipe={recipe}"]) == 0
    out = capsys.readouterr()
    assert f"recipe: {recipe}" in out.out
    world, tp, pp = PARALLEL_RECIPES[recipe]
    cfg = compose([f"recipe={recipe}", "data.path=/data/chats.jsonl"])
    layout = resolve_layout(cfg.mesh.tp, cfg.mesh.pp, cfg.mesh.dp, world)
    assert (layout.tp, layout.pp) == (tp, pp)
    if cfg.mesh.dp != -1:  # a recipe with a fixed mesh asks for exactly its GPUs
        assert cfg.launcher.nodes * cfg.launcher.nproc_per_node == world
    batching = resolve_batching(cfg, layout.dp)
    size, count = batching.microbatch_size, batching.num_microbatches
    assert count >= pp * default_virtual_stages(cfg.pipeline.schedule)  # 1F1B needs >= one microbatch a stage
    model = named_config(cfg.model.name).text
    validate_tp(model, layout.tp)
    layers = split_layers(model.num_hidden_layers, pp)
    if recipe == "qwen3_5_27b_tp4pp4":
        assert [len(s) for s in layers] == [16, 16, 16, 16] and size == 1 and count == 32
        assert cfg.pipeline.reduce_grad_per_microbatch and cfg.model.activation_checkpointing == "auto"
        assert "data.path" in out.err  # required, shown as ???


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("schedule, knob", [("zbv", "false"), ("interleaved_zb", "true"), ("dualpipev", "false")])
def test_tp2_pp2_split_backward_equals_one_process(tmp_path, reference, tp2_reference, schedule, knob):
    """tp2 x pp2 under the schedules that run the input and the weight gradients in separate steps: the weight
    step differentiates towards the parameters themselves, through the tensor-parallel layers' local shards."""
    results = run_distributed(train_with_state, 4, _overrides(
        tmp_path, f"tp2pp2-{schedule}-{knob}", "mesh.tp=2", "mesh.pp=2", f"pipeline.schedule={schedule}",
        f"pipeline.reduce_grad_per_microbatch={knob}"))
    for result in (results[0], results[-1]):
        assert_same_training(result, reference)
        assert_same_training(result, tp2_reference)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("knob", ["false", "true"])
def test_tp2_dp2_accumulation_equals_one_process(tmp_path, reference, tp2_reference, knob):
    """tp2 x dp2 with FSDP2, two microbatches per rank and step: the tensor-parallel layers' local gradients
    accumulate into FSDP2's unsharded parameters across microbatches (knob off) or are reduce-scattered after
    each (knob on)."""
    results = run_distributed(train_with_state, 4, _overrides(
        tmp_path, f"tp2dp2-{knob}", "mesh.tp=2", "mesh.dp=2", f"pipeline.reduce_grad_per_microbatch={knob}"))
    for result in (results[0], results[-1]):
        assert_same_training(result, reference)
        assert_same_training(result, tp2_reference)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("chunk", [0, 16])
def test_tp2_pp2_fused_vocab_parallel_head_equals_one_process(tmp_path, reference, tp2_reference, chunk):
    """The last stage's vocab-parallel head with the fused cross-entropy (model.kernels.ce=fused: the CE and its
    gradients on each rank's vocabulary rows), whole and chunked, against one process and tp2 with the torch CE.
    The fused CE sums its gradients in another order than the torch CE's autograd: a_proj, whose tiny gradients
    Adam normalises, sits 1.05e-5 from tp2 with the torch CE, inside the per-tensor bound."""
    results = run_distributed(train_with_state, 4, _overrides(
        tmp_path, f"tp2pp2-fused-{chunk}", "mesh.tp=2", "mesh.pp=2", "model.kernels.ce=fused",
        f"model.ce_chunk_tokens={chunk}"))
    for result in (results[0], results[-1]):
        assert_same_training(result, reference)
        assert_same_training(result, tp2_reference)


@pytest.mark.parametrize("args, message", [
    (["recipe=tiny_vlm", "mesh.pp=2", "model.freeze_language=true"],
     "pipeline stage 1 of 2 (layers 2-3) has nothing to train with model.freeze_language=true; unfreeze part of it, "
     "or use fewer pipeline stages (mesh.pp)"),
    (["recipe=tiny_lora", "mesh.pp=2", r"peft.target_modules=[layers\.0\..*]"],
     r"pipeline stage 1 of 2 (layers 2-3) has nothing to train: peft.target_modules=['layers\\.0\\..*'] matches no "
     r"linear there; widen peft.target_modules or move layers between stages (pipeline.stage_layers)"),
    (["recipe=tiny_lora", "peft.target_modules=[zzz]"], "peft.target_modules entry 'zzz' matches no module; "),
])
def test_a_stage_with_nothing_to_train_is_refused_at_the_start(capfd, args, message):
    """The optimizer of a rank with no trained parameter would fail after the run dir is written (under a pipeline,
    on that rank alone): `qwenft plan`, and train and slurm through the same check, refuse it first."""
    from helpers import qwenft_alone

    assert qwenft_alone("plan", *args) == 2
    assert capfd.readouterr().err.strip().startswith(f"qwenft: error: {message}")


def test_a_frozen_model_is_refused_before_the_run_dir_has_a_config(tmp_path, capfd):
    from helpers import qwenft_alone, tiny_overrides

    assert qwenft_alone("train", *tiny_overrides(tmp_path, "model.freeze_language=true")) == 2
    assert capfd.readouterr().err.strip().splitlines()[-1] == (
        "qwenft: error: the model has nothing to train with model.freeze_language=true; unfreeze part of it")
    assert not (tmp_path / "config.yaml").exists()


def test_microbatch_rule_is_the_rule_of_torchs_schedules():
    """`microbatch_rule` restates the checks of torch's schedule constructors: on every schedule, 2-4 ranks and
    1-3 stages a rank, it refuses exactly the microbatch counts the installed torch refuses (rank 0's stages, built
    on a group of its own that sends nothing)."""
    import torch.distributed as dist
    import torch.distributed.pipelining.schedules as torch_schedules
    from torch.distributed.pipelining import PipelineStage

    from qwenft.distributed.fake_pg import init_fake_process_group
    from qwenft.distributed.pipeline.schedule import microbatch_rule
    from qwenft.distributed.pipeline.split import SINGLE_STAGE, V_SHAPED, stage_ids_for_rank

    differ = []
    for pp in (2, 3, 4):
        init_fake_process_group(pp, 0)
        try:
            for name, cls in SCHEDULES.items():
                for virtual in (1,) if name in SINGLE_STAGE else (2,) if name in V_SHAPED else (2, 3):
                    stages = [PipelineStage(torch.nn.Linear(2, 2), i, pp * virtual, torch.device("cpu"),
                                            group=dist.group.WORLD)
                              for i in stage_ids_for_rank(0, pp, virtual, name in V_SHAPED)]
                    for n in range(1, 3 * pp * virtual + 2):
                        try:
                            getattr(torch_schedules, cls)(stages[0] if name in SINGLE_STAGE else stages,
                                                          n_microbatches=n, loss_fn=lambda out, target: out.sum())
                            torch_takes = True
                        except ValueError:
                            torch_takes = False
                        if torch_takes != (microbatch_rule(name, n, pp, virtual) is None):
                            differ.append((name, pp, virtual, n, torch_takes))
        finally:
            dist.destroy_process_group()
    assert not differ, differ
