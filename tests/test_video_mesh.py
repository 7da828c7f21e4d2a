"""Video rows train the same numbers on every mesh as in one process (fp32, CPU, gloo ranks), as image rows do:
tp2, pp2 with pipeline.reduce_grad_per_microbatch, dp2, and activation checkpointing with compile; the pipeline
schedule hands each microbatch exactly its own videos; LoRA on the vision tower trains on videos.

The data: frame-list videos (PNG frames of a square moving across a noisy background, made here) in chat rows,
some with an image beside the video, some with an image only, under recipe=tiny_vlm.
"""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from distributed import run_distributed
from helpers import (assert_same_training, assert_within, build_data, compose, fp32_rtol, model_config,
                     train_with_state)


def _frames(n, height, width, seed):
    """`n` frames `uint8 [height, width, 3]`: a dark square stepping right across a noisy light background."""
    rng = np.random.RandomState(seed)
    out = []
    for i in range(n):
        frame = rng.randint(150, 255, (height, width, 3)).astype(np.uint8)
        x = 4 + i * (width - 20) // max(1, n - 1)
        frame[height // 3: height // 3 + 14, x: x + 14] = (30, 60, 200)
        out.append(frame)
    return out


@pytest.fixture(scope="module")
def video_rows(tmp_path_factory):
    """A JSONL of 16 chat rows: 4-frame (every 3rd: 6-frame) videos; every 4th row also an image; 2 rows an image
    only. Paths relative to the file."""
    root = tmp_path_factory.mktemp("video_rows")
    rows = []
    for r in range(16):
        n, (h, w) = (6 if r % 3 == 2 else 4), [(64, 64), (64, 96), (96, 64)][r % 3]
        content = []
        if r % 8 != 5:
            names = []
            for i, frame in enumerate(_frames(n, h, w, seed=r)):
                names.append(f"v{r}/{i}.png")
                (root / f"v{r}").mkdir(exist_ok=True)
                Image.fromarray(frame).save(root / names[-1])
            content.append({"type": "video", "video": names, "fps": 2})
        if r % 4 == 1:
            Image.fromarray(_frames(1, 64, 96, seed=100 + r)[0]).save(root / f"i{r}.png")
            content.append({"type": "image", "image": f"i{r}.png"})
        content.append({"type": "text", "text": "Which way does the square move?"})
        rows.append({"messages": [{"role": "user", "content": content},
                                  {"role": "assistant", "content": "It moves right."}]})
    path = root / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _overrides(path, run_dir, *extra):
    """3 steps at lr 5e-4 without warm-up, a global batch of 4 rows as microbatches of 1, 256-token rows."""
    return ["recipe=tiny_vlm", f"data.path={path}", "train.max_steps=3", "data.seq_len=256", "optim.lr=5e-4",
            "lr_scheduler.warmup_steps=0", "train.global_batch_size=4", "train.micro_batch_size=1",
            "model.kernels.gdn=torch", "train.progress_bar=false", "checkpoint.export_hf=false",
            f"run_dir={run_dir}", *extra]


@pytest.fixture(scope="module")
def reference(video_rows, tmp_path_factory):
    (result,) = run_distributed(train_with_state, 1, _overrides(video_rows, tmp_path_factory.mktemp("ref")))
    assert any(name.startswith("visual.") for name in result.state_dict)
    return result


def test_the_rows_mix_videos_and_images(video_rows):
    """The runner's data reads the rows as written: 14 documents with a video, batches with both kinds."""
    cfg = compose(_overrides(video_rows, "unused"))
    _, data, _ = build_data(cfg, model_config(cfg), 1, 0, 1)
    assert data.num_video_documents == 14 and len(data.docs) == 16
    batch = next(iter(data))
    assert len(batch["video_grid_thw"]) and batch["video_grid_thw"][:, 0].tolist()[0] in (2, 3)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("mesh", [["mesh.tp=2"], ["mesh.pp=2", "pipeline.reduce_grad_per_microbatch=true"],
                                  ["mesh.dp=2"]], ids=["tp2", "pp2-knob", "dp2"])
def test_video_batches_train_as_one_process(video_rows, reference, tmp_path, mesh):
    """Every rank (pp2: both stages' parameters, gathered) within fp32_rtol of one process after 3 steps."""
    results = run_distributed(train_with_state, 2, _overrides(video_rows, tmp_path / "run", *mesh))
    for result in results:
        assert_same_training(result, reference)


@pytest.mark.distributed
@pytest.mark.slow
def test_video_batches_train_as_one_process_checkpointed_and_compiled(video_rows, reference, tmp_path):
    """model.activation_checkpointing=true with model.compile=true (the vision tower eager, its video embeddings
    scattered into the compiled layers' input, the layers recomputed with the videos' M-RoPE positions): every step's loss
    within fp32_rtol of the eager run's. The parameters are left to tests/test_compile.py: after AdamW steps
    compiled rounding shows in near-zero gradient elements."""
    (result,) = run_distributed(train_with_state, 1, _overrides(video_rows, tmp_path / "run", "model.compile=true",
                                                                 "model.activation_checkpointing=true"))
    assert len(result.losses) == len(reference.losses) == 3
    for step, (a, b) in enumerate(zip(result.losses, reference.losses)):
        assert_within(f"step {step + 1}'s loss", abs(a - b) / abs(b), fp32_rtol(step))


def test_pipeline_microbatches_carry_their_own_videos(video_rows):
    """PipelineBatch + the schedule's dim-0 split + StageModel give each microbatch exactly its own videos and
    images (padded per microbatch, the padding dropped in the stage): the same logits as the model on that
    microbatch alone, also for a microbatch without videos (pixel_values_videos=None)."""
    from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks

    from qwenft.distributed.pipeline.schedule import PipelineBatch
    from qwenft.distributed.pipeline.stage import build_stage_model
    from qwenft.models.loader import init_random_weights
    from qwenft.models.qwen3_5.model import Qwen3_5Model
    from qwenft.train.evaluate import forward_batch

    cfg = compose(_overrides(video_rows, "unused", "data.seq_len=128"))
    model_cfg = model_config(cfg)
    _, data, _ = build_data(cfg, model_cfg, 2, 0, 1)
    batches = iter(data)
    mbs = [next(batches) for _ in range(3)]
    assert len({len(mb["video_grid_thw"]) for mb in mbs}) > 1  # microbatches pad to different video counts
    ids = mbs[0]["input_ids"].clone()
    ids[ids == model_cfg.video_token_id] = 100
    no_video = {**mbs[0], "input_ids": ids,
                "pixel_values_videos": mbs[0]["pixel_values_videos"][:0],
                "video_grid_thw": mbs[0]["video_grid_thw"][:0]}
    mbs.insert(1, no_video)
    batch = PipelineBatch.from_microbatches(mbs, "cpu")
    _, kwarg_chunks = split_args_kwargs_into_chunks((), batch.kwargs(), len(mbs))
    stage = build_stage_model(model_cfg, range(model_cfg.text.num_hidden_layers), True, True, "torch")
    init_random_weights(stage, seed=0, device="cpu", dtype=torch.float32)
    with torch.no_grad():
        for mb, ids, kw in zip(mbs, batch.input_ids.chunk(len(mbs)), kwarg_chunks):
            ref = forward_batch(lambda **kw: Qwen3_5Model.forward(stage, **kw), mb)
            assert torch.equal(stage(ids, **kw), ref)


@pytest.mark.distributed
@pytest.mark.slow
def test_lora_on_the_vision_tower_trains_on_videos(video_rows, tmp_path):
    """peft=lora peft.vision=true on rows whose only pixels are videos: every adapter of the tower (the merger's
    included) gets a gradient, so the videos ran through the adapted tower, forward and backward."""
    from helpers import train_with_grads

    rows = []
    for line in video_rows.read_text().splitlines():
        row = json.loads(line)
        content = row["messages"][0]["content"]
        row["messages"][0]["content"] = [p for p in content if p["type"] != "image"]
        if any(p["type"] == "video" for p in content):
            rows.append(row)
    path = video_rows.parent / "videos_only.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (result,) = run_distributed(train_with_grads, 1, _overrides(path, tmp_path / "lora", "peft=lora",
                                                                "peft.vision=true", "train.max_steps=2"))
    vision = {n: g for n, g in result.grads.items() if n.startswith("visual.")}
    assert any(".merger." in n for n in vision) and any(".blocks." in n for n in vision)
    assert vision and all("lora_" in n and g.norm() > 0 for n, g in vision.items()), sorted(vision)
