"""Sharded checkpoints resume exactly: a run stopped at step 2 and resumed trains steps 3-4 to the same
losses as a run that never stopped (fp32, CPU), on the same mesh and on others (pp and tp included)."""

import json
import shutil

import pytest

from distributed import run_distributed
from helpers import (assert_within, compose, fp32_rtol, logged_losses, parity_overrides, raised_line, read_metrics,
                     tiny_overrides, train, train_with_state)


def _overrides(run_dir, max_steps, *extra):
    # warmup over all 4 steps with a constant tail: every step has its own lr, and the schedule does not
    # depend on max_steps, so the 2-step run and the 4-step run follow the same one
    return parity_overrides(run_dir, f"train.max_steps={max_steps}", "checkpoint.export_hf=false",
                            "lr_scheduler.warmup_steps=4", "lr_scheduler.decay=constant", "checkpoint.every_steps=2",
                            *extra)


def _assert_steps_3_and_4(losses, uninterrupted):
    """A run resumed at step 2 on another mesh or optimizer implementation: steps 3 and 4's losses within fp32_rtol
    of the uninterrupted run's, for the steps since the two parted (the sums of step 3 are the first taken in
    another order)."""
    for steps_apart, (got, step) in enumerate(zip(losses, (3, 4))):
        want = uninterrupted[step]
        assert_within(f"step {step}'s loss", abs(got - want) / abs(want), fp32_rtol(steps_apart))


@pytest.fixture(scope="module")
def uninterrupted_run(tmp_path_factory):
    """dp2, 4 steps, checkpoints after steps 2 and 4. Tests copy what they break."""
    run_dir = tmp_path_factory.mktemp("a") / "run"
    run_distributed(train, 2, _overrides(run_dir, 4))
    return run_dir


@pytest.fixture(scope="module")
def uninterrupted(uninterrupted_run):
    return logged_losses(uninterrupted_run)


@pytest.mark.distributed
@pytest.mark.slow
def test_resume_on_the_same_mesh_is_bit_identical(tmp_path, uninterrupted):
    run_dir = tmp_path / "run"
    run_distributed(train, 2, _overrides(run_dir, 2, "checkpoint.keep=1"))
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-000002"
    results = run_distributed(train, 2, _overrides(run_dir, 4, "checkpoint.keep=1", "checkpoint.resume=auto"))
    assert len(results[0].losses) == 2  # only steps 3 and 4 ran
    logged = logged_losses(run_dir)
    assert sorted(logged) == [1, 2, 3, 4]  # appended to the first run's metrics
    assert logged[3] == uninterrupted[3] and logged[4] == uninterrupted[4], (logged, uninterrupted)
    assert uninterrupted[3] != uninterrupted[4]
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step-000004"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step-000004"]


@pytest.mark.distributed
@pytest.mark.slow
def test_resume_on_another_mesh(tmp_path, uninterrupted):
    """Saved by 2 FSDP ranks, loaded by one: DCP reshards; only the reduction order differs."""
    run_dir = tmp_path / "run"
    run_distributed(train, 2, _overrides(run_dir, 2))
    (result,) = run_distributed(train, 1, _overrides(run_dir, 4))
    _assert_steps_3_and_4(result.losses, uninterrupted)


def _train_adamw(rank, world_size, overrides, settings):
    """A run whose torch AdamW is built with `settings` (foreach=False, fused=True: choices build_optimizer does
    not make on CPU), or by build_optimizer when None; its losses and the optimizer's foreach/fused at the end.
    The patch lives and dies with this forked rank."""
    import torch

    from qwenft.train import build as build_lib, runner

    build_optimizer, built = build_lib.build_optimizer, []

    def build(params, lr, weight_decay, betas, eps, fused, **kwargs):
        if settings is None:
            optimizer = build_optimizer(params, lr, weight_decay, betas, eps, fused, **kwargs)
        else:
            optimizer = torch.optim.AdamW([p for p in params if p.requires_grad], lr=lr, betas=tuple(betas),
                                          eps=eps, weight_decay=weight_decay, **settings)
        built.append(optimizer)
        return optimizer

    build_lib.build_optimizer = build
    losses = runner.run(compose(overrides)).losses
    return losses, {key: built[0].param_groups[0][key] for key in ("foreach", "fused")}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("saved, resumed", [
    ({"foreach": False}, None),  # a for-loop AdamW's checkpoint resumed by build_optimizer's (foreach on CPU)
    (None, {"fused": True}),  # build_optimizer's checkpoint resumed with fused AdamW (as on GPU; CPU has one too)
])
def test_resume_keeps_this_runs_optimizer_implementation(tmp_path, uninterrupted_run, uninterrupted, saved, resumed):
    """foreach/fused say how this run's AdamW computes, not what it has trained: the resumed optimizer keeps its
    own whatever the checkpoint's were, and steps 3-4 match the run that never stopped (only the
    implementations' rounding may differ)."""
    run_dir, checkpoint = tmp_path / "run", uninterrupted_run / "checkpoints" / "step-000002"
    if saved is not None:
        checkpoint = run_dir / "checkpoints" / "step-000002"
        run_distributed(_train_adamw, 2, _overrides(run_dir, 2), saved)
    (losses, settings), _ = run_distributed(_train_adamw, 2, _overrides(run_dir, 4, f"checkpoint.resume={checkpoint}"),
                                            resumed)
    assert settings == ({"foreach": True, "fused": None} if resumed is None else {"foreach": None, **resumed})
    assert len(losses) == 2
    _assert_steps_3_and_4(losses, uninterrupted)


def _assert_unchanged(root, before: dict) -> None:
    """Every file as it was; train.log may only have grown (the failed attempt logs its start)."""
    after = _files(root)
    log = root / "train.log"
    assert after.pop(log).startswith(before[log])
    assert after == {p: b for p, b in before.items() if p != log}


def _files(root) -> dict:
    return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.distributed
def test_corrupt_checkpoint_is_a_one_line_error(tmp_path, uninterrupted_run):
    """Every step dir lacks .metadata (a crash mid-copy, a deleted file): one line naming the key, the paths
    and what to do; the run dir, its config.yaml included, is left exactly as it was."""
    run_dir = tmp_path / "run"
    shutil.copytree(uninterrupted_run, run_dir)
    for step in (run_dir / "checkpoints").glob("step-*"):
        (step / ".metadata").unlink()
    before = _files(run_dir)
    with pytest.raises(RuntimeError) as info:
        run_distributed(train, 1, _overrides(run_dir, 6))
    line = raised_line(info)
    assert f"checkpoint.resume=auto: no complete checkpoint in {run_dir / 'checkpoints'}: " \
           f"{run_dir / 'checkpoints' / 'step-000004'} is incomplete or corrupt (.metadata is missing)" in line \
           and "or give a new run_dir" in line, line
    _assert_unchanged(run_dir, before)
    with pytest.raises(RuntimeError, match="does not exist; give a step-NNNNNN dir, or auto or none"):
        run_distributed(train, 1, _overrides(tmp_path / "other", 2, f"checkpoint.resume={tmp_path / 'nope'}"))


@pytest.mark.distributed
@pytest.mark.parametrize("override, expected", [
    ("model.num_layers=2", ("checkpoint.resume=auto: ", "was saved from another model (",
                            "text.num_hidden_layers=4 there, 2 here",
                            "or start afresh with checkpoint.resume=none in a new run_dir")),
    ("optim.state_dtype=bfloat16", ("was saved with optim.master_dtype=float32, optim.state_dtype=float32, this run has ",
                                    "optim.state_dtype=bfloat16",
                                    "or start afresh with checkpoint.resume=none in a new run_dir")),
], ids=["another_model", "other_optimizer_dtypes"])
def test_incompatible_checkpoint_is_refused_before_loading(tmp_path, uninterrupted_run, override, expected):
    run_dir = tmp_path / "run"
    shutil.copytree(uninterrupted_run, run_dir)
    _assert_refused(run_dir, override, expected)


def _assert_refused(run_dir, override: str, expected) -> dict:
    """A resume of `run_dir` to step 6 with `override` fails in one line holding every part of `expected`, and
    leaves every file as it was; the files before it (`_files`)."""
    before = _files(run_dir)
    with pytest.raises(RuntimeError) as info:
        run_distributed(train, 1, _overrides(run_dir, 6, override))
    line = raised_line(info)
    assert all(part in line for part in expected), line
    _assert_unchanged(run_dir, before)
    return before


def _other_data(tmp_path, change: str):
    """A copy of the shipped chat set under its own name, with the same number of rows: `same_size` changes one
    letter of the last row, `longer` adds one to the first."""
    from qwenft.data.tiny_chat import TRAIN_PATH

    lines = TRAIN_PATH.read_text().splitlines()
    index = -1 if change == "same_size" else 0
    row = json.loads(lines[index])
    text = row["messages"][-1]["content"]
    row["messages"][-1]["content"] = ("Z" + text[1:]) if change == "same_size" else text + "!"
    edited = json.dumps(row)
    assert len(edited) == len(lines[index]) + (change == "longer") and edited != lines[index]
    lines[index] = edited
    path = tmp_path / "data" / TRAIN_PATH.name
    path.parent.mkdir()
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.distributed
@pytest.mark.parametrize("change", ["train.global_batch_size=8", "data.seq_len=64", "seed=1", "same_size", "longer"])
def test_resume_refuses_a_change_of_the_data_position(tmp_path, uninterrupted_run, change):
    """A change that would move the data position (the batch size, seq_len, the shuffle's seed, the data files:
    here another file with as many rows) is refused in one line naming the key, before anything is written: the
    run dir, config.yaml included, stays as it was; train.log has each changed key."""
    run_dir = tmp_path / "run"
    shutil.copytree(uninterrupted_run, run_dir)
    step4 = run_dir / "checkpoints" / "step-000004"
    if "=" in change:
        key, value = change.split("=")
        saved = {"train.global_batch_size": "4", "data.seq_len": "128", "seed": "0"}[key]
        override, expected = change, (f"checkpoint.resume=auto: {change}, but {step4} was saved with {key}={saved} (",
                                      f"resume with {key}={saved}, or start afresh with checkpoint.resume=none "
                                      f"in a new run_dir")
        changed_line = f"resume: {key}: {saved} -> {value}"
    else:
        data = _other_data(tmp_path, change)
        what = "tiny_chat.jsonl: the same size, other first or last rows" if change == "same_size" else \
            f"tiny_chat.jsonl: {_size_of_tiny()} bytes then, {data.stat().st_size} now"
        override, expected = f"data.path={data}", (
            f"checkpoint.resume=auto: data.path={data} holds other data than {step4} was trained on ({what}); "
            f"resume with the data it was trained on, or start afresh with checkpoint.resume=none in a new "
            f"run_dir",)
        changed_line = f"resume: data.path: tiny -> {data}"
    before = _assert_refused(run_dir, override, expected)
    log = (run_dir / "train.log").read_text()[len(before[run_dir / "train.log"]):]
    assert changed_line in log and "resume: train.max_steps: 4 -> 6" in log, log


def _size_of_tiny() -> int:
    from qwenft.data.tiny_chat import TRAIN_PATH

    return TRAIN_PATH.stat().st_size


@pytest.mark.distributed
@pytest.mark.slow
def test_resume_logs_each_changed_key_and_takes_the_new_optimizer_options(tmp_path, uninterrupted_run):
    """A resume may change what does not move the data position (the run dir too: this one is a copy); each change
    is one line in train.log, and a new optim.lr is what the resumed steps train with (the
    schedule is constant after its 4-step warm-up, so steps 5 and 6 run at optim.lr)."""
    run_dir = tmp_path / "run"
    shutil.copytree(uninterrupted_run, run_dir)
    run_distributed(train, 1, _overrides(run_dir, 6, "optim.lr=2e-4", "optim.weight_decay=0.1",
                                         "train.log_every=2", "checkpoint.keep=1"))
    log = (run_dir / "train.log").read_text()
    resumed = log[log.rindex("run dir "):]
    changes = [line.split(" INFO ", 1)[1] for line in resumed.splitlines() if " INFO resume: " in line]
    assert changes == [f"resume: run_dir: {uninterrupted_run} -> {run_dir}", "resume: optim.lr: 0.0005 -> 0.0002", "resume: optim.weight_decay: 0.0 -> 0.1",
                       "resume: train.max_steps: 4 -> 6", "resume: train.log_every: 1 -> 2",
                       "resume: checkpoint.keep: 2 -> 1"], changes
    rows = {r["step"]: r for r in read_metrics(run_dir) if "lr" in r}
    assert rows[4]["lr"] == pytest.approx(5e-4) and rows[6]["lr"] == pytest.approx(2e-4)
    assert "max_steps: 6" in (run_dir / "config.yaml").read_text()


@pytest.mark.distributed
def test_keep_best_keeps_the_lowest_val_loss_checkpoint(tmp_path):
    """A checkpoint every step, keep=1, keep_best: what is left is the last one and the one with the lowest
    val_loss in metrics.jsonl (lr 3e-2 overshoots after step 3, so the best is not the last)."""
    run_dir = tmp_path / "run"
    run_distributed(train, 1, tiny_overrides(
        run_dir, "train.max_steps=5", "data.seq_len=64", "checkpoint.export_hf=false", "optim.lr=3e-2",
        "lr_scheduler.warmup_steps=0", "lr_scheduler.decay=constant", "train.global_batch_size=2",
        "train.micro_batch_size=1", "eval.every_steps=1", "eval.dataset=tiny", "eval.max_batches=2",
        "checkpoint.every_steps=1", "checkpoint.keep=1", "checkpoint.keep_best=true"))
    val = {r["step"]: r["val_loss"] for r in read_metrics(run_dir) if "val_loss" in r}
    best = min(val, key=val.get)
    assert sorted(val) == [1, 2, 3, 4, 5] and best not in (1, 5), val
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "best").read_text().strip() == f"step-{best:06d}"
    assert (ckpts / "latest").read_text().strip() == "step-000005"
    assert sorted(p.name for p in ckpts.iterdir()) == ["best", "latest", f"step-{best:06d}", "step-000005"]
    assert json.loads((ckpts / f"step-{best:06d}" / "checkpoint.json").read_text())["val_loss"] == val[best]


def test_keep_best_needs_a_val_loss_at_every_checkpoint():
    for extra in ([], ["eval.every_steps=3", "eval.dataset=tiny"]):
        with pytest.raises(ValueError, match="checkpoint.keep_best=true needs a val_loss at every checkpoint: "
                                             "checkpoint.every_steps=2 must be > 0 and a multiple of eval.every_steps"):
            compose(["checkpoint.keep_best=true", "checkpoint.every_steps=2", *extra])


@pytest.mark.distributed
@pytest.mark.slow
def test_async_save_resumes_identically(tmp_path, uninterrupted):
    """checkpoint.async_save: training is unchanged, both checkpoints complete with `latest` on the last, and
    resuming from step 2 trains steps 3-4 bit-identically to the run that never stopped."""
    run_dir = tmp_path / "run"
    run_distributed(train, 2, _overrides(run_dir, 4, "checkpoint.async_save=true"))
    assert logged_losses(run_dir) == uninterrupted
    ckpts = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step-000002", "step-000004"]
    assert (ckpts / "latest").read_text().strip() == "step-000004"
    resumed = run_distributed(train, 2, _overrides(tmp_path / "resumed", 4, "checkpoint.async_save=true",
                                                   f"checkpoint.resume={ckpts / 'step-000002'}"))[0]
    assert resumed.losses == [uninterrupted[3], uninterrupted[4]]


@pytest.fixture(scope="module")
def tp2_pp2_interleaved(tmp_path_factory):
    """4 steps on tp2 x pp2 with two stages per rank (interleaved 1F1B: rank 0 holds stages 0 and 2), saving
    after steps 2 and 4; the trained parameters for the export test."""
    run_dir = tmp_path_factory.mktemp("tp2pp2") / "run"
    results = run_distributed(train_with_state, 4, _overrides(
        run_dir, 4, "mesh.tp=2", "mesh.pp=2", "pipeline.schedule=interleaved_1f1b", "checkpoint.export_hf=false"))
    return run_dir, logged_losses(run_dir), results[0].state_dict


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("nproc, mesh", [
    (4, ["mesh.dp=4"]),
    (1, []),
    (2, ["mesh.pp=2", "pipeline.schedule=zbv"]),  # V placement: rank 0 holds stages 0 and 3
])
def test_resume_tp2_pp2_checkpoint_on_another_mesh(tmp_path, tp2_pp2_interleaved, nproc, mesh):
    """A checkpoint of tp2 x pp2 (interleaved stages) resumes on dp4, one process and pp2 with another stage
    placement: the steps after it train to the uninterrupted run's losses."""
    run_dir, uninterrupted, _ = tp2_pp2_interleaved
    step2 = run_dir / "checkpoints" / "step-000002"
    losses = run_distributed(train, nproc, _overrides(tmp_path / "run", 4, f"checkpoint.resume={step2}",
                                                      *mesh))[0].losses
    assert len(losses) == 2
    _assert_steps_3_and_4(losses, uninterrupted)


@pytest.mark.distributed
@pytest.mark.slow
def test_export_of_tp2_pp2_checkpoint_loads_in_transformers(tmp_path, tp2_pp2_interleaved, capsys):
    """`qwenft export` of the tp2 x pp2 run's last checkpoint, on this one process: transformers loads it, and
    its logits are those of the parameters the run trained."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qwenft.cli import main
    from qwenft.models.loader import build_model
    from qwenft.models.qwen3_5.configs import named_config

    run_dir, _, state = tp2_pp2_interleaved
    out = tmp_path / "hf"
    assert main(["export", f"run_dir={run_dir}", f"out={out}", "dtype=float32"]) == 0, capsys.readouterr().err
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert AutoTokenizer.from_pretrained(out).chat_template
    cfg = named_config("tiny")
    cfg.text.vocab_size = state["embed_tokens.weight"].shape[0]
    native = build_model(cfg, kernels="torch", device="cpu")
    native.load_state_dict(state)
    ids = torch.randint(0, cfg.text.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref, got = native(input_ids=ids), hf(input_ids=ids).logits
    assert ((got - ref).norm() / ref.norm()).item() < 1e-5


@pytest.mark.distributed
def test_export_of_tiny_vlm_checkpoint_loads_in_transformers(tmp_path, capsys):
    """`qwenft export` of a tiny_vlm run's checkpoint: transformers' Qwen3_5ForConditionalGeneration loads every
    key (vision tower included), the tokenizer, image processor and video processor config come along
    (data.tokenizer=tiny_vlm is a built-in name, not a dir), and an image + text batch and a batch with a video
    give the logits of the parameters the run trained."""
    import torch
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen3_5ForConditionalGeneration

    from qwenft.cli import main
    from qwenft.models.loader import build_model
    from qwenft.models.qwen3_5.configs import named_config

    run_dir, out = tmp_path / "run", tmp_path / "hf"
    (result,) = run_distributed(train_with_state, 1, [
        "recipe=tiny_vlm", "train.max_steps=2", "checkpoint.every_steps=2", "checkpoint.export_hf=false",
        "train.global_batch_size=2", "train.micro_batch_size=1", "model.kernels.gdn=torch",
        "train.progress_bar=false", f"run_dir={run_dir}"])
    state = result.state_dict
    assert main(["export", f"run_dir={run_dir}", f"out={out}", "dtype=float32"]) == 0, capsys.readouterr().err
    hf, info = Qwen3_5ForConditionalGeneration.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    assert AutoTokenizer.from_pretrained(out).chat_template
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    from qwenft.data.tiny_vlm import VIDEO_PROCESSOR

    video = Qwen3VLVideoProcessor.from_pretrained(out)  # the video processor's config comes along too
    assert (video.fps, video.max_frames, dict(video.size)) == (2, 16, VIDEO_PROCESSOR["size"])
    patch_dim = AutoImageProcessor.from_pretrained(out).patch_size ** 2 * 3 * 2  # x channels x temporal patch
    cfg = named_config("tiny_vlm")
    cfg.text.vocab_size = state["embed_tokens.weight"].shape[0]
    native = build_model(cfg, kernels="torch", device="cpu")
    native.load_state_dict(state)
    native.eval()
    grid = torch.tensor([[1, 4, 4], [1, 2, 6]])  # 16 and 12 patches -> 4 and 3 image tokens
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(7, cfg.text.vocab_size, (2, 24), generator=gen)
    for row, (start, n) in enumerate(((3, 4), (5, 3))):
        ids[row, start] = cfg.vision_start_token_id
        ids[row, start + 1:start + 1 + n] = cfg.image_token_id
        ids[row, start + 1 + n] = cfg.vision_end_token_id
    pixel_values = torch.randn(int(grid.prod(-1).sum()), patch_dim, generator=gen)
    with torch.no_grad():
        ref = native(input_ids=ids, pixel_values=pixel_values, image_grid_thw=grid)
        got = hf(input_ids=ids, pixel_values=pixel_values, image_grid_thw=grid,
                 mm_token_type_ids=(ids == cfg.image_token_id).int()).logits
    assert ((got - ref).norm() / ref.norm()).item() < 1e-5
    # a batch with a video (2 temporal patches of 2 x 2 tokens, each its own vision_start/end, as the processor
    # lays them out) next to an image
    ids = torch.randint(7, cfg.text.vocab_size, (2, 24), generator=gen)
    ids[0, 3], ids[0, 4:8], ids[0, 8] = cfg.vision_start_token_id, cfg.image_token_id, cfg.vision_end_token_id
    for start in (2, 10):
        ids[1, start], ids[1, start + 5] = cfg.vision_start_token_id, cfg.vision_end_token_id
        ids[1, start + 1:start + 5] = cfg.video_token_id
    video_grid = torch.tensor([[2, 4, 4]])
    pixel_values = torch.randn(16, patch_dim, generator=gen)
    pixel_values_videos = torch.randn(32, patch_dim, generator=gen)
    types = (ids == cfg.image_token_id).int() + 2 * (ids == cfg.video_token_id).int()
    with torch.no_grad():
        ref = native(input_ids=ids, pixel_values=pixel_values, image_grid_thw=grid[:1],
                     pixel_values_videos=pixel_values_videos, video_grid_thw=video_grid)
        got = hf(input_ids=ids, pixel_values=pixel_values, image_grid_thw=grid[:1],
                 pixel_values_videos=pixel_values_videos, video_grid_thw=video_grid, mm_token_type_ids=types).logits
    assert ((got - ref).norm() / ref.norm()).item() < 1e-5


def _fake_run(tmp_path, source_run, **config):
    """A run dir with source_run's config.yaml (keys changed as given) and its checkpoints."""
    from omegaconf import OmegaConf

    run_dir = tmp_path / "fake_run"
    run_dir.mkdir()
    cfg = OmegaConf.load(source_run / "config.yaml")
    for key, value in config.items():
        OmegaConf.update(cfg, key, value)
    OmegaConf.save(cfg, run_dir / "config.yaml")
    (run_dir / "checkpoints").symlink_to(source_run / "checkpoints")
    return run_dir


@pytest.mark.distributed
def test_export_says_when_model_path_has_moved(tmp_path, uninterrupted_run, capsys):
    """`qwenft export` of a run whose model.path is gone: one note line, and the export is written with the
    tokenizer's end ids (no source generation_config.json to carry over)."""
    from qwenft.cli import main

    moved, out = tmp_path / "moved", tmp_path / "hf"
    run_dir = _fake_run(tmp_path, uninterrupted_run, **{"model.path": str(moved), "data.tokenizer": "tiny"})
    assert main(["export", f"run_dir={run_dir}", f"out={out}"]) == 0
    err = capsys.readouterr().err
    assert err == (f"note: model.path={moved} (from {run_dir / 'config.yaml'}) does not exist; the export's "
                   f"generation_config.json has the tokenizer's end ids but not the base model's sampling "
                   f"defaults\n"), err
    assert json.loads((out / "generation_config.json").read_text()) == {"eos_token_id": [2, 0], "pad_token_id": 0}


EXPORT_ERRORS = {
    "out_not_empty": "out={out} exists and is not empty; give a new or empty directory",
    "out_a_file": "out={out} is a file; give a new or empty directory",
    "no_tokenizer": "data.tokenizer={tokenizer} (from {run_dir}/config.yaml) has no tokenizer files (tokenizer.json, "
                    "tokenizer_config.json, vocab.json, tokenizer.model) to export with the model; pass tokenizer=DIR",
    "no_best": "checkpoint=best: there is no {run_dir}/checkpoints/best (the run saved no such checkpoint; train with "
               "checkpoint.keep_best=true, or give checkpoint=STEP_DIR)",
    "bad_dtype": "dtype='float16' is not valid; choose one of bfloat16, float32",
}


@pytest.mark.distributed
@pytest.mark.parametrize("case", EXPORT_ERRORS)
def test_export_bad_input_is_one_line_and_writes_nothing(tmp_path, uninterrupted_run, capsys, case):
    from qwenft.cli import main

    out, tokenizer, run_dir = tmp_path / "hf", tmp_path / "empty_tokenizer", uninterrupted_run
    if case == "out_not_empty":
        out.mkdir()
        (out / "mine.txt").write_text("keep me")
    if case == "out_a_file":
        out.write_text("keep me")
    if case == "no_tokenizer":
        tokenizer.mkdir()
        run_dir = _fake_run(tmp_path, uninterrupted_run, **{"data.tokenizer": str(tokenizer)})
    args = {"no_best": ["checkpoint=best"], "bad_dtype": ["dtype=float16"]}.get(case, [])
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert main(["export", f"run_dir={run_dir}", f"out={out}", *args]) == 2
    err = capsys.readouterr().err
    message = EXPORT_ERRORS[case]
    assert err.count("\n") == 1 and message.format(out=out, tokenizer=tokenizer, run_dir=run_dir) in err, err
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    assert out.exists() == (case in ("out_not_empty", "out_a_file"))
