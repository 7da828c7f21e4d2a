"""Video micro batches' tokens/s against image micro batches' of the same token counts, and the vision tower's share.

    python scripts/bench.py media [--rows 8] [--frames 16] [--size 360 640] [--text 0.8b] [--vision-depth 12] \
        [--repeat 3] [--json out.json] [--profile PATH] [overrides ...]

Writes two datasets of `--rows` rows each into a temp dir: video rows (frame-list videos of `--frames` JPEG frames
of `--size` px, data_workers' rows) and image rows of `--frames / 2` different pictures of that size (the video's
even frames). A video's two frames make one temporal patch with the token count of one picture (a picture's frame
is doubled into its patch), and the image rows' text is padded to the video rows' timestamp tokens: so a row of
either kind holds the same vision tokens and the same tokens in all. The built micro batches are checked for it
(vision tokens and tokens outside padding, micro batch by micro batch); the run stops if they differ.

Each kind trains the same model from random init for the same steps, its micro batches made before the run
(data_workers' `premade`: the data pipeline is not timed). Reported per kind: the median step time over the steps
after the first two, tokens/s (all tokens of a step, padding included, from metrics.jsonl), and the vision
tower's forward + backward over one step's micro batches (the model's own `visual` module called as the model
calls it, median of `--repeat`) against the step time. `--profile PATH` also records each kind's last step with
torch.profiler (PATH.image.txt, PATH.video.txt: bench.py train's tables; the last two steps are then left out of
the median). The model is tiny_vlm's tokenizer and token ids with `--text`'s decoder and a vision tower of
`--vision-depth` blocks (data_workers' `use_model`). `overrides` go to both runs (e.g. train.max_steps=12).
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench_modes.data_workers import premade, use_model, write_videos
from bench_modes.train import kernel_breakdown, kernel_times, profiled_run, write_profile_table
from qwenft.conf import compose
from qwenft.train.metrics import read_metrics_rows

KINDS = ("image", "video")


def image_row(video_row: dict, filler: int) -> dict:
    """data_workers' video row with its video's even frames as pictures, its question `filler` words longer."""
    (user, answer), (video, question) = video_row["messages"], video_row["messages"][0]["content"]
    parts = [{"type": "image", "image": f} for f in video["video"][::2]]
    parts.append({"type": "text", "text": question["text"] + " the" * filler})
    return {"messages": [{**user, "content": parts}, answer]}


def write_image_rows(root: Path, videos: Path, processor, max_image_bytes: int) -> Path:
    """Next to data_workers' video rows `videos`, one image row per video row: the video's even frames as pictures,
    the question padded with filler words until the row has the video row's token count (its timestamps)."""
    from qwenft.data.vlm import tokenize_vlm_row

    def tokens(row) -> int:
        return len(tokenize_vlm_row(row, processor, root, "assistant", max_image_bytes)[0])

    rows = [json.loads(line) for line in videos.read_text().splitlines()]
    target, shortest = tokens(rows[0]), tokens(image_row(rows[0], 0))
    filler = max(0, target - shortest) // (tokens(image_row(rows[0], 1)) - shortest)
    if tokens(image_row(rows[0], filler)) != target:
        raise ValueError(f"no filler text makes an image row {target} tokens long, the video row's (it has "
                         f"{shortest} without filler)")
    path = root / "images.jsonl"
    path.write_text("".join(json.dumps(image_row(row, filler)) + "\n" for row in rows))
    return path


def batch_tokens(mb: dict, token_id: int) -> tuple[int, int]:
    """(vision tokens `token_id`, tokens outside padding) of a micro batch."""
    return int((mb["input_ids"] == token_id).sum()), int((~mb["padding_mask"]).sum())


def check_same_tokens(batches: dict[str, list[dict]], token_ids: dict[str, int]) -> list[tuple[int, int]]:
    """Each image micro batch's (vision tokens, tokens) equal the video micro batch's at the same place; returns
    them. Raises ValueError naming the first micro batch where they differ."""
    counts = {kind: [batch_tokens(mb, token_ids[kind]) for mb in batches[kind]] for kind in KINDS}
    for i, (image, video) in enumerate(zip(counts["image"], counts["video"])):
        if image != video or not image[0]:
            raise ValueError(f"micro batch {i}: the image batch holds {image[0]} image tokens of {image[1]} tokens, "
                             f"the video batch {video[0]} video tokens of {video[1]}; the comparison needs them equal "
                             "and above 0 (check data.video.* and data.image.* against --frames and --size)")
    return counts["image"]


def tower_seconds(model, micro_batches: list[dict], device, repeat: int) -> float:
    """Median over `repeat` rounds (after one untimed) of the vision tower's forward + backward over `micro_batches`:
    `model.visual` called on each micro batch's pixels and grids as the model's forward calls it, then a backward
    from its output embeddings.

    Under FSDP (one GPU too, when the weights are stored in another dtype than they compute in) the tower's
    weights belong to the root unit, which only the model's own forward gathers: here the root is gathered
    (in the compute dtype) before the rounds and released after them, so its gather is not timed, nor the
    reduction of its gradients, which land in the gathered copies and are dropped."""
    from torch.distributed.fsdp import FSDPModule

    from qwenft.train.evaluate import device_batch

    batches = [device_batch(mb, device) for mb in micro_batches]
    sharded = isinstance(model, FSDPModule)
    if sharded:
        model.unshard()
    with torch.no_grad():
        embeds = [model.embed_tokens(mb["input_ids"]) for mb in batches]

    def pixels(mb: dict, kind: str) -> tuple:
        grid = mb[f"{kind}_grid_thw"]
        values = mb["pixel_values_videos" if kind == "video" else "pixel_values"]
        return (values, grid) if len(grid) else (None, None)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    times = []
    for _ in range(repeat + 1):
        sync()
        start = time.perf_counter()
        for mb, embed in zip(batches, embeds):
            out = model.visual(mb["input_ids"], embed, *pixels(mb, "image"), *pixels(mb, "video"))
            out.backward(torch.ones_like(out))
        sync()
        times.append(time.perf_counter() - start)
    model.visual.zero_grad(set_to_none=True)
    if sharded:
        model.reshard()
    return statistics.median(times[1:])


def label_forward(module, name: str) -> None:
    """`module`'s forward as the range `name` in torch.profiler's tables (its backward has no range of its own)."""
    ranges = []
    module.register_forward_pre_hook(lambda *_: ranges.append(torch.profiler.record_function(name).__enter__()))
    module.register_forward_hook(lambda *_: ranges.pop().__exit__(None, None, None))


def run_kind(kind: str, cfg, batches: dict, token_ids: dict[str, int], profile: str | None, repeat: int) -> dict:
    """Train `cfg` on premade micro batches (kept in `batches[kind]`; the video run's are checked against the
    image run's), then time its vision tower; the report."""
    from qwenft.train import build, runner

    jobs = []
    built, made_here = build.build_job, build.build_data
    count = cfg.train.max_steps * cfg.train.global_batch_size // cfg.train.micro_batch_size

    def build_premade(*args, **kwargs):
        tokenizer, data, preprocessors = premade(made_here, count)(*args, **kwargs)
        batches[kind] = [batch for _, batch in data.premade]
        if kind == "video":  # the image run came first
            check_same_tokens(batches, token_ids)
        return tokenizer, data, preprocessors

    def build_job(*args, **kwargs):
        jobs.append(built(*args, **kwargs))
        if profile:
            label_forward(jobs[-1].model_parts[0].visual, "vision tower forward")
        return jobs[-1]

    build.build_data, runner.build_job = build_premade, build_job
    try:
        if profile:
            result, averages, profiled = profiled_run(cfg, cfg.train.max_steps - 1)
            kernels = kernel_times(averages, profiled)
            write_profile_table(averages, f"{profile}.{kind}.txt", kernels)
        else:
            result = runner.run(cfg)
    finally:
        build.build_data, runner.build_job = made_here, built
    job = jobs[0]
    steps = [r for r in read_metrics_rows(result.run_dir / "metrics.jsonl") if "step_time_s" in r]
    timed = steps[2:len(steps) - 2] if profile else steps[2:]
    step_s = statistics.median(r["step_time_s"] for r in timed)
    per_step = job.spec.batching.num_microbatches
    tower_s = tower_seconds(job.model_parts[0], batches[kind][:per_step], job.device, repeat)
    report = {"step_time_s": step_s, "steps_timed": len(timed),
              "tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in timed),
              "micro_batches_per_step": per_step, "vision_tower_fwd_bwd_s_per_step": tower_s,
              "vision_tower_share_of_step": tower_s / step_s, "final_loss": steps[-1]["loss"]}
    if profile:
        report["profiled_step_gpu_ms_by_kernel_kind"] = kernel_breakdown(averages, profiled, kernels)
    return report


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="bench.py media", description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8, help="rows of each kind (the runs go through them in epochs)")
    parser.add_argument("--frames", type=int, default=16, help="frames a video, an even number")
    parser.add_argument("--size", type=int, nargs=2, default=[360, 640], metavar=("HEIGHT", "WIDTH"))
    parser.add_argument("--text", default="0.8b", help="the decoder's size (qwenft.models.qwen3_5.configs)")
    parser.add_argument("--vision-depth", type=int, default=12)
    parser.add_argument("--repeat", type=int, default=3, help="rounds of the vision tower's timing")
    parser.add_argument("--json", default=None)
    parser.add_argument("--profile", default=None, metavar="PATH",
                        help="torch.profiler tables of each kind's last step: PATH.image.txt, PATH.video.txt")
    args, overrides = parser.parse_known_args(argv)
    if args.frames < 2 or args.frames % 2:
        parser.error(f"--frames {args.frames}: a video's frames pair into temporal patches; give an even number >= 2")
    from qwenft.models.qwen3_5.configs import _named

    if args.text not in _named():
        parser.error(f"--text {args.text}: the decoder sizes are {', '.join(_named())}")
    if args.rows < 1 or min(args.size) < 1:
        parser.error(f"--rows {args.rows} --size {args.size[0]} {args.size[1]}: give at least 1 row of at least 1x1 px")
    with tempfile.TemporaryDirectory(prefix="qwenft_media_") as root:
        report = measure(args, overrides, Path(root))
    runs = {kind: report[kind] for kind in KINDS}
    per_step = runs["image"]["micro_batches_per_step"]
    print(f"{per_step} micro batch{'es' if per_step > 1 else ''} a step, each of "
          f"{report['vision_tokens_by_micro_batch'][0]} vision tokens among {report['tokens_by_micro_batch'][0]} "
          f"tokens (seq_len {report['seq_len']}; image and video batches alike, micro batch by micro batch)")
    print(f"{'kind':>6} | {'step s':>8} | {'tokens/s':>10} | {'tower fwd+bwd s':>15} | tower share")
    for kind, r in runs.items():
        print(f"{kind:>6} | {r['step_time_s']:8.3f} | {r['tokens_per_sec']:10.0f} | "
              f"{r['vision_tower_fwd_bwd_s_per_step']:15.3f} | {r['vision_tower_share_of_step']:.1%}")
    print(f"video / image tokens/s: {report['video_over_image_tokens_per_sec']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


def measure(args, overrides: list[str], root: Path) -> dict:
    """Both runs on rows written under `root`; the report (module docstring)."""
    from qwenft.train.data_setup import load_preprocessors

    height, width = args.size
    use_model(args.text, args.vision_depth)
    videos = write_videos(root, args.rows, args.frames, height, width)
    # every frame and picture kept at its size: the budgets allow exactly it
    base = ["recipe=tiny_vlm", "data.seq_len=8192", "train.max_steps=8", "train.global_batch_size=2",
            "train.micro_batch_size=1", "lr_scheduler.warmup_steps=0", "checkpoint.every_steps=0",
            "checkpoint.export_hf=false", f"data.image.max_pixels={height * width}", "data.image.min_pixels=1024",
            f"data.video.max_pixels={args.frames * height * width}", f"data.video.min_frames={args.frames}",
            f"data.video.max_frames={args.frames}",
            "data.video.min_pixels=1024", *overrides, "train.progress_bar=false"]
    cfg = compose([*base, f"data.path={videos}"])
    if cfg.train.max_steps < (5 if args.profile else 3):
        raise ValueError(f"train.max_steps={cfg.train.max_steps}: the median is over the steps after the first two"
                         + (" and, with --profile, before the last two (the profiler's): give 5 or more" if args.profile
                            else ": give 3 or more"))
    processor = load_preprocessors(cfg, vision=True)[1]
    images = write_image_rows(root, videos, processor, cfg.data.image.max_image_bytes)
    token_ids = {"image": processor.image_token_id, "video": processor.video_token_id}
    batches, runs = {}, {}
    for kind in KINDS:
        path = images if kind == "image" else videos
        cfg = compose([*base, f"data.path={path}", "data.num_workers=0", f"run_dir={root / kind}"])
        runs[kind] = run_kind(kind, cfg, batches, token_ids, args.profile, args.repeat)
    vision_tokens, tokens = zip(*check_same_tokens(batches, token_ids))
    return {"overrides": overrides, "rows": args.rows, "frames": args.frames, "size": args.size, "text": args.text,
            "vision_depth": args.vision_depth, "seq_len": cfg.data.seq_len,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
            "vision_tokens_by_micro_batch": list(vision_tokens), "tokens_by_micro_batch": list(tokens), **runs,
            "video_over_image_tokens_per_sec": runs["video"]["tokens_per_sec"] / runs["image"]["tokens_per_sec"]}
