"""Step time of VLM video batches made by data.num_workers threads, against the same batches made before the run.

    python scripts/bench.py data_workers [--workers 0 2 4] [--videos 24] [--frames 16] [--size 360 640] \
        [--text 0.8b] [--vision-depth 12] [overrides ...]

Writes a JSONL of frame-list videos (JPEG frames: noise with a moving square) into a temp dir, then trains the
runner on it from random init once per `--workers` value and once with every micro batch made before the run
(`premade`: the step only takes it), and prints each run's median step time over the steps after the first two
(metrics.jsonl's step_time_s, which includes waiting for the step's micro batches) against premade's. The model
is tiny_vlm's tokenizer and token ids with `--text`'s decoder and a vision tower of `--vision-depth` blocks.
`overrides` go to every run (e.g. train.max_steps=12 model.kernels.gdn=torch).
"""

import argparse
import json
import statistics
import tempfile
from collections import deque
from itertools import islice
from pathlib import Path

import numpy as np
from PIL import Image

from qwenft.conf import compose
from qwenft.train.metrics import read_metrics_rows


def write_videos(root: Path, videos: int, frames: int, height: int, width: int) -> Path:
    rng = np.random.RandomState(0)
    with open(root / "rows.jsonl", "w") as rows:
        for v in range(videos):
            (root / f"v{v}").mkdir()
            for i in range(frames):
                frame = rng.randint(100, 255, (height, width, 3)).astype(np.uint8)
                x = i * (width - 48) // max(1, frames - 1)
                frame[height // 3:height // 3 + 48, x:x + 48] = (200, 30, 30)
                Image.fromarray(frame).save(root / f"v{v}" / f"{i}.jpg", quality=90)
            parts = [{"type": "video", "video": [f"v{v}/{i}.jpg" for i in range(frames)]},
                     {"type": "text", "text": "Where does the square go?"}]
            rows.write(json.dumps({"messages": [{"role": "user", "content": parts},
                                                {"role": "assistant", "content": "To the right."}]}) + "\n")
    return root / "rows.jsonl"


def use_model(text: str, vision_depth: int) -> None:
    """model.name=tiny_vlm builds `text`'s decoder with a `vision_depth`-block vision tower (tiny_vlm's token ids)."""
    import dataclasses

    from qwenft.models.qwen3_5 import configs

    def bench_vlm(tiny):
        decoder = configs._named()[text]
        vision = {"model_type": "qwen3_5_vision", "depth": vision_depth, "hidden_size": 768,
                  "hidden_act": "gelu_pytorch_tanh", "intermediate_size": 3072, "num_heads": 12, "in_channels": 3,
                  "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                  "out_hidden_size": decoder.text.hidden_size, "num_position_embeddings": 2304}
        return dataclasses.replace(decoder, vision=vision, image_token_id=5, video_token_id=6, vision_start_token_id=3,
                                   vision_end_token_id=4)

    configs._tiny_vlm = bench_vlm


def premade(build_data, count: int):
    """`build_data` whose stream hands out its first `count` micro batches made before the run starts."""
    from qwenft.data.vlm import VLMData

    class Premade(VLMData):
        def __next__(self):
            plan, batch = self.premade.popleft()
            self._hand_out(plan)
            return batch

    def build_premade(*args, **kwargs):
        tokenizer, data, preprocessors = build_data(*args, **kwargs)
        data.premade = deque((plan, data.make_batch(plan)) for plan in islice(data.plans(0, 0), count))
        data.__class__ = Premade
        return tokenizer, data, preprocessors

    return build_premade


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="bench.py data_workers", description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2, 4])
    parser.add_argument("--videos", type=int, default=24)
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--size", type=int, nargs=2, default=[360, 640])
    parser.add_argument("--text", default="0.8b")
    parser.add_argument("--vision-depth", type=int, default=12)
    args, overrides = parser.parse_known_args(argv)
    from qwenft.train.runner import run

    use_model(args.text, args.vision_depth)
    root = Path(tempfile.mkdtemp())
    rows = write_videos(root, args.videos, args.frames, *args.size)
    height, width = args.size
    base = ["recipe=tiny_vlm", f"data.path={rows}", "data.seq_len=8192", "train.max_steps=10",
            "train.global_batch_size=4", "train.micro_batch_size=1", "lr_scheduler.warmup_steps=0",
            "checkpoint.every_steps=0", "checkpoint.export_hf=false", "train.progress_bar=false",
            f"data.video.max_pixels={args.frames * height * width}", f"data.video.max_frames={args.frames}", *overrides]
    from qwenft.train import build

    made_here = build.build_data
    results = {}
    for name in ["premade", *[f"workers={n}" for n in args.workers]]:
        cfg = compose([*base, f"data.num_workers={0 if name == 'premade' else name.split('=')[1]}",
                       f"run_dir={root / name.replace('=', '')}"])
        count = cfg.train.max_steps * cfg.train.global_batch_size // cfg.train.micro_batch_size
        build.build_data = premade(made_here, count) if name == "premade" else made_here
        run(cfg)
        steps = [r for r in read_metrics_rows(root / name.replace('=', '') / "metrics.jsonl") if "step_time_s" in r]
        results[name] = statistics.median(r["step_time_s"] for r in steps[2:])
    for name, seconds in results.items():
        print(f"{name:>10}: {seconds:.3f} s/step ({seconds / results['premade'] - 1:+.1%} against premade)")
