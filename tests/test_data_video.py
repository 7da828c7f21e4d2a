"""Video parts in VLM chat rows against transformers' Qwen3-VL processor and video processor (ids, timestamps,
frame sampling, pixel budget, pixels) and Qwen3.5's `get_rope_index` (positions); packing with images; the
bad video rows; the missing decoder; the data.video keys. CPU.

torchvision's CPU wheels are not on the package index (its PyPI wheels need CUDA torch), so transformers' video
processor runs here with `TV_FUNCTIONAL` standing in for the three `torchvision.transforms.v2.functional` calls it
makes (resize, normalize, grayscale_to_rgb), each the torch operation torchvision performs on a CPU uint8 /
float32 tensor. Everything else in the reference (sampling, smart_resize, patchify, timestamps, the text
expansion, tokenizing, positions) is transformers' own code.
"""

import dataclasses
import enum
import math
import sys
import types
from functools import partial

import numpy as np
import pytest
import torch
from PIL import Image

from qwenft.constants import IGNORE_INDEX
from qwenft.data.video import sample_indices
from qwenft.data.vlm import (build_vlm_data, document_positions, load_processor, split_microbatches,
                             tokenize_vlm_rows)

try:
    import av  # the test extra installs PyAV (.ci/run); only the video-file cases need it
except ImportError:
    av = None
needs_av = pytest.mark.skipif(av is None, reason="PyAV (pip install 'qwenft[video]') is not installed")


class InterpolationMode(enum.Enum):
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    LANCZOS = "lanczos"  # compared against, never used


def _tv_resize(image, size, interpolation=InterpolationMode.BILINEAR, antialias=True):
    """torchvision's `resize_image` on a CPU tensor: bicubic runs natively on uint8, input size = no-op."""
    *lead, c, h, w = image.shape
    if tuple(size) == (h, w):
        return image
    out = torch.nn.functional.interpolate(image.reshape(-1, c, h, w), size=list(size), mode=interpolation.value,
                                          align_corners=False, antialias=antialias)
    return out.reshape(*lead, c, *size)


def _tv_normalize(image, mean, std, inplace=False):
    mean = torch.as_tensor(mean, dtype=image.dtype).view(-1, 1, 1)
    std = torch.as_tensor(std, dtype=image.dtype).view(-1, 1, 1)
    return (image.sub_(mean) if inplace else image.sub(mean)).div_(std)


TV_FUNCTIONAL = types.SimpleNamespace(
    InterpolationMode=InterpolationMode, resize=_tv_resize, normalize=_tv_normalize,
    grayscale_to_rgb=lambda x: x if x.shape[-3] != 1 else x.repeat_interleave(3, dim=-3))


@pytest.fixture(scope="module")
def transformers_video():
    """transformers' video processing with TV_FUNCTIONAL in torchvision's place (see the module docstring)."""
    import transformers.image_processing_backends as backends
    import transformers.models.qwen3_vl.video_processing_qwen3_vl as qwen3_vl
    import transformers.video_processing_utils as video_utils
    from transformers.image_utils import PILImageResampling

    with pytest.MonkeyPatch.context() as mp:
        for module in (backends, video_utils, qwen3_vl):
            mp.setattr(module, "tvF", TV_FUNCTIONAL, raising=False)
        mp.setattr(backends, "pil_torch_interpolation_mapping",
                   {PILImageResampling.BICUBIC: InterpolationMode.BICUBIC}, raising=False)
        yield


def reference_processor(proc, cache, **video_kwargs):
    """transformers' `Qwen3VLProcessor` (what `AutoProcessor` gives for Qwen3.5) over the tiny processor dir's
    image processor and video processor (with `video_kwargs` overriding its config, as data.video.* does)."""
    from transformers import Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    from qwenft.data.tiny_vlm import tiny_vlm_processor_dir

    class Processor(Qwen3VLProcessor):
        def check_argument_for_proper_class(self, name, argument):  # its class lookup needs torchvision
            if name == "video_processor":
                return type(argument)
            return super().check_argument_for_proper_class(name, argument)

    path = tiny_vlm_processor_dir(cache)
    return Processor(Qwen2VLImageProcessorPil.from_pretrained(path), proc.tokenizer,
                     Qwen3VLVideoProcessor.from_pretrained(path, **video_kwargs),
                     chat_template=proc.tokenizer.chat_template)


def checkpoint_dir(cache, tmp_path, **video_config):
    """A copy of the tiny processor dir whose video processor config has `video_config` set: a checkpoint's own
    video settings (which no data.video.* key overrides)."""
    import json
    import shutil

    from qwenft.data.tiny_vlm import tiny_vlm_processor_dir

    path = tmp_path / "checkpoint"
    shutil.copytree(tiny_vlm_processor_dir(cache), path)
    config = path / "video_preprocessor_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), **video_config}))
    return path


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("qwenft_cache")


@pytest.fixture(scope="module")
def proc(cache):
    return load_processor("tiny_vlm", cache_dir=cache)


def moving_square(n, height, width, seed=0) -> np.ndarray:
    """`uint8 [n, height, width, 3]`: a square crossing a noisy background, so frames differ and resizing bites."""
    rng = np.random.RandomState(seed)
    frames = rng.randint(150, 255, (n, height, width, 3)).astype(np.uint8)
    for i in range(n):
        x = i * (width - 12) // max(1, n - 1)
        frames[i, height // 3:height // 3 + 12, x:x + 12] = (200, 30, 30)
    return frames


def write_video(path, frames: np.ndarray, fps: int) -> None:
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Frame lists (PNG files), video files (23 frames at 10 fps; a broken one) and a picture."""
    root = tmp_path_factory.mktemp("video_data")
    shapes = {"walk": (5, 50, 70), "run": (4, 40, 40), "long": (7, 32, 32), "one": (1, 32, 32), "tri": (3, 64, 64)}
    for name, (n, h, w) in shapes.items():
        (root / name).mkdir()
        for i, frame in enumerate(moving_square(n, h, w, seed=n + h)):
            Image.fromarray(frame).save(root / name / f"{i}.png")
    Image.fromarray(moving_square(1, 60, 60)[0]).save(root / "walk" / "odd.png")  # another size
    if av is not None:
        write_video(root / "clip.mp4", moving_square(23, 48, 64, seed=1), fps=10)
    (root / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 certainly not a video")
    Image.fromarray(moving_square(1, 64, 96, seed=5)[0]).save(root / "pic.png")
    return root


def frame_paths(name, n):
    return [f"{name}/{i}.png" for i in range(n)]


def chat(*parts, reply="The square moves right."):
    return {"messages": [{"role": "user", "content": list(parts)}, {"role": "assistant", "content": reply}]}


def text(s):
    return {"type": "text", "text": s}


def video(src, **options):
    return {"type": "video", "video": src, **options}


def image(src):
    return {"type": "image", "image": src}


def rope_index(input_ids, type_ids, image_grid_thw, video_grid_thw):
    """transformers' Qwen3.5 `get_rope_index` (the model built on the meta device: it only reads the config)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model

    from qwenft.models.qwen3_5.configs import named_config, to_hf_config

    with torch.device("meta"):
        model = Qwen3_5Model(to_hf_config(named_config("tiny_vlm")))
    return model.get_rope_index(input_ids, type_ids, image_grid_thw=image_grid_thw,
                                video_grid_thw=video_grid_thw)[0]


# (parts of the user turn, data.video overrides, how transformers gets each video: "frames" + metadata, or "file")
PARITY = {
    "frame_list_fps": ([image("pic.png"), video(frame_paths("walk", 5), fps=1), text("Where does it go?")], {},
                       [("frames", "walk", 5, {"fps": 1.0, "frames_indices": list(range(5))})]),
    "frame_list_default_fps": ([video(frame_paths("run", 4)), text("And here?")], {"fps": 3},
                               [("frames", "run", 4, {"fps": 3.0, "frames_indices": list(range(4))})]),
    # transformers takes a list's times as frames_indices / fps: fps 1 gives the seconds themselves
    "frame_list_timestamps": ([video(frame_paths("run", 4), timestamps=[0.0, 0.4, 1.3, 2.25]), text("When?")], {},
                              [("frames", "run", 4, {"fps": 1.0, "frames_indices": [0.0, 0.4, 1.3, 2.25]})]),
    # 3 frames count as 4 in smart_resize's budget check (rounded to even): 64 px frames stay, over by 4/3
    "frame_list_odd_at_budget": ([video(frame_paths("tri", 3), fps=2), text("?")], {"max_pixels": 3 * 64 * 64},
                                 [("frames", "tri", 3, {"fps": 2.0, "frames_indices": list(range(3))})]),
    # a checkpoint whose video processor caps the pixels per frame (qwen-vl-utils' rule, cap_pixels_per_frame):
    # at max_video_tokens x 32^2 px a frame (2048 here, under the budget's 65536 / 5), 64x64 -> 32x32 px frames
    "frame_list_cap_per_frame": ([video(frame_paths("walk", 5), fps=2), text("Where?")],
                                 {"min_pixels": 1024, "checkpoint": {"cap_pixels_per_frame": True,
                                                                     "max_video_tokens": 2}},
                                 [("frames", "walk", 5, {"fps": 2.0, "frames_indices": list(range(5))})]),
    # the cap's floor (1.05 x min_pixels a frame) lifts the budget over data.video.max_pixels: frames stay 64x64
    "frame_list_cap_floor": ([video(frame_paths("walk", 5), fps=2), text("Where?")],
                             {"max_pixels": 8192, "checkpoint": {"cap_pixels_per_frame": True}},
                             [("frames", "walk", 5, {"fps": 2.0, "frames_indices": list(range(5))})]),
    "file": ([text("Watch: "), video("clip.mp4"), text("Which way?")], {}, [("file", "clip.mp4", 2.0, None)]),
    "file_fps_and_budget": ([video("clip.mp4"), text("Which way?"), image("pic.png")],
                            {"fps": 4, "max_frames": 6, "max_pixels": 6 * 32 * 48},
                            [("file", "clip.mp4", 4.0, None)]),
    "file_part_fps_and_a_list": ([video("clip.mp4", fps=3), video(frame_paths("walk", 5), fps=2), text("Same?")],
                                 {}, [("file", "clip.mp4", 3.0, None),
                                      ("frames", "walk", 5, {"fps": 2.0, "frames_indices": list(range(5))})]),
}


@pytest.mark.parametrize("case", [pytest.param(c, marks=needs_av) if c.startswith("file") else c for c in PARITY])
def test_ids_pixels_and_positions_equal_transformers(case, proc, cache, files, transformers_video, tmp_path):
    from transformers.video_utils import VideoMetadata, load_video

    parts, overrides, videos = PARITY[case]
    overrides = dict(overrides)
    checkpoint = overrides.pop("checkpoint", {})  # video processor config the checkpoint itself holds
    mine = load_processor(checkpoint_dir(cache, tmp_path, **checkpoint) if checkpoint else "tiny_vlm",
                          cache_dir=cache, video=overrides)
    (doc,), skipped = tokenize_vlm_rows([chat(*parts)], mine, 4096, files)
    assert not skipped
    pixel_values_videos, video_grid_thw = mine.video_pixels(doc.videos)

    size = {"shortest_edge": mine.video.min_pixels, "longest_edge": mine.video.max_pixels}
    hf = reference_processor(proc, cache, size=size, **checkpoint,
                             **{k: v for k, v in overrides.items() if k not in ("min_pixels", "max_pixels")})
    clips, metadata = [], []
    for kind, source, n_or_fps, meta in videos:
        if kind == "frames":
            clips.append(np.stack([np.asarray(Image.open(files / p)) for p in frame_paths(source, n_or_fps)]))
            metadata.append(VideoMetadata(total_num_frames=n_or_fps, **meta))
        else:
            clip, meta = load_video(str(files / source), backend="pyav",
                                    sample_indices_fn=partial(hf.video_processor.sample_frames, fps=n_or_fps))
            clips.append(clip)
            metadata.append(meta)
    rendered = [{"role": "user", "content": [{"type": p["type"]} if p["type"] != "text" else p for p in parts]},
                {"role": "assistant", "content": "The square moves right."}]
    prompt = proc.tokenizer.apply_chat_template(rendered, tokenize=False)
    images = [Image.open(files / p["image"]) for p in parts if p["type"] == "image"] or None
    ref = hf(text=[prompt], images=images, videos=clips, video_metadata=metadata, do_sample_frames=False,
             cap_pixels_per_frame=checkpoint.get("cap_pixels_per_frame", False), return_tensors="pt")

    assert doc.input_ids == ref["input_ids"][0].tolist()
    assert torch.equal(video_grid_thw, ref["video_grid_thw"])
    assert torch.equal(pixel_values_videos, ref["pixel_values_videos"])
    if images:
        assert doc.grids == [tuple(g) for g in ref["image_grid_thw"].tolist()]
    positions = rope_index(ref["input_ids"], ref["mm_token_type_ids"], ref.get("image_grid_thw"),
                           ref["video_grid_thw"])
    assert torch.equal(document_positions(doc, mine), positions[:, 0])
    video_positions = (ref["input_ids"][0] == mine.video_token_id).nonzero().flatten()
    assert all(doc.labels[t - 1] == IGNORE_INDEX for t in video_positions.tolist())  # never a target
    if case == "frame_list_odd_at_budget":
        assert doc.videos[0].grid == (2, 4, 4)
    if case == "frame_list_cap_per_frame":
        assert doc.videos[0].grid == (3, 2, 2)  # 32x32 px frames; 64x64 without the cap
    if case == "frame_list_cap_floor":
        assert doc.videos[0].grid == (3, 4, 4)  # 64x64 px frames; 32x32 without the cap
    if case == "file_fps_and_budget":  # sampled at 4 fps (9 frames), capped at 6; shrunk into the budget
        assert doc.videos[0].indices == tuple(sample_indices(23, 10.0, 4, 4, 6)) and len(doc.videos[0].indices) == 6
        assert video_grid_thw.prod().item() * 16 * 16 * 2 <= 6 * 32 * 48


@pytest.mark.parametrize("checkpoint, overrides", [
    ({}, {}), ({}, {"max_pixels": 32768}),
    ({"cap_pixels_per_frame": True, "max_video_tokens": 2}, {"min_pixels": 1024}),  # the cap binds
    ({"cap_pixels_per_frame": True}, {"max_pixels": 8192}),  # its floor lifts the budget
], ids=["budget", "max_pixels", "cap", "cap_floor"])
def test_plan_budget_is_the_most_a_video_makes(cache, tmp_path, checkpoint, overrides):
    """`budget_patches` (what `qwenft plan` counts a video at) is the largest patch count the pipeline makes of
    frame lists of every length up to max_frames and of several frame sizes."""
    from qwenft.data.video import budget_patches

    path = checkpoint_dir(cache, tmp_path, **checkpoint)
    mine = load_processor(str(path), video=overrides)
    for h, w in ((128, 128), (64, 128), (64, 64), (32, 96), (160, 160)):
        (tmp_path / f"{h}x{w}").mkdir()
        for i in range(16):
            Image.fromarray(np.full((h, w, 3), 10 * i, np.uint8)).save(tmp_path / f"{h}x{w}" / f"{i}.png")
    rows = [chat(video(frame_paths(f"{h}x{w}", n)), text("?"))
            for n in range(2, 17) for h, w in ((128, 128), (64, 128), (64, 64), (32, 96), (160, 160))]
    docs, skipped = tokenize_vlm_rows(rows, mine, 8192, tmp_path)
    assert not skipped
    made = max(math.prod(v.grid) for doc in docs for v in doc.videos)
    assert budget_patches(str(path), overrides.get("max_pixels"), overrides.get("min_pixels")) == made


def test_frame_sampling_follows_qwen3_vl(proc, cache):
    """The sampling rule alone, against transformers' `Qwen3VLVideoProcessor.sample_frames` over many lengths."""
    from transformers.video_utils import VideoMetadata

    hf = reference_processor(proc, cache).video_processor
    for total, video_fps in [(23, 10.0), (300, 29.97), (3, 24.0), (1000, 25.0), (17, 2.0)]:
        for fps in (0.5, 2.0, 4.0):
            ref = hf.sample_frames(VideoMetadata(total_num_frames=total, fps=video_fps), fps=fps)
            assert sample_indices(total, video_fps, fps, hf.min_frames, hf.max_frames) == ref.tolist()


@needs_av
def test_a_batch_mixes_two_videos_and_an_image(proc, files, transformers_video):
    """Packed rows with a file video, a frame-list video and an image: each document's positions equal
    transformers' get_rope_index on its ids, the video tensors follow the video tokens, splitting into
    microbatches keeps each row's videos, and the model sees the videos (each document's logits as alone)."""
    from test_data_vlm import small_vlm

    from qwenft.train.evaluate import forward_batch

    rows = [chat(video("clip.mp4"), text("Which way? "), image("pic.png")),
            {"messages": [{"role": "user", "content": "No video."}, {"role": "assistant", "content": "OK."}]},
            chat(text("And "), video(frame_paths("walk", 5), fps=1), reply="Left to right.")]
    data = build_vlm_data(rows * 2, proc, seq_len=200, micro_batch_size=2, packing="pack", base_dir=files)
    assert data.num_video_documents == 4
    batch = next(data)
    B, T = batch["input_ids"].shape
    order = [data.docs[d] for row in data.epoch_rows(0)[:B] for d in row]
    assert batch["video_grid_thw"].tolist() == [list(v.grid) for doc in order for v in doc.videos]
    assert batch["image_grid_thw"].tolist() == [list(g) for doc in order for g in doc.grids]
    assert len(batch["video_grid_thw"]) >= 2 and len(batch["image_grid_thw"]) >= 1
    assert batch["pixel_values_videos"].shape == (int(batch["video_grid_thw"].prod(-1).sum()), proc.video.patch_dim)
    model = small_vlm(seed=0).eval()
    with torch.no_grad():
        logits = forward_batch(model, batch).flatten(0, 1)
    for r, row in enumerate(data.epoch_rows(0)[:B]):
        a = r * T
        for d in row:
            doc = data.docs[d]
            b = a + len(doc.input_ids)
            ids = torch.tensor([doc.input_ids])
            types_ = (ids == proc.image_token_id).int() + 2 * (ids == proc.video_token_id).int()
            grids = torch.tensor(doc.grids).reshape(-1, 3) if doc.grids else None
            video_grids = torch.tensor(doc.video_grids).reshape(-1, 3) if doc.videos else None
            ref = rope_index(ids, types_, grids, video_grids)[:, 0]
            assert torch.equal(batch["position_ids"][:, r, a - r * T:b - r * T], ref)
            kw = {}
            if doc.grids:
                kw.update(zip(("pixel_values", "image_grid_thw"), proc.pixels([s.open() for s in doc.images])))
            if doc.videos:
                kw.update(zip(("pixel_values_videos", "video_grid_thw"), proc.video_pixels(doc.videos)))
            with torch.no_grad():
                alone = model(input_ids=ids, **kw)[0]
            torch.testing.assert_close(logits[a:b], alone, rtol=1e-5, atol=1e-5)
            a = b
    parts = split_microbatches(batch, 2, proc.image_token_id, proc.merge_size, proc.video_token_id)
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
        assert torch.equal(torch.cat([p[key] for p in parts]), batch[key]), key
    for p in parts:
        assert int((p["input_ids"] == proc.video_token_id).sum()) == int(p["video_grid_thw"].prod(-1).sum()) // 4


def test_truncation_never_splits_a_video(proc, files):
    row = chat(text("Look "), video(frame_paths("walk", 5), fps=1), text(" then "), image("pic.png"), text("?"))
    (whole,), _ = tokenize_vlm_rows([row], proc, 1024, files)
    first_video = whole.input_ids.index(proc.video_token_id)
    (cut,), _ = tokenize_vlm_rows([row], proc, first_video + 5, files, train_on="all")
    start = whole.input_ids.index(proc.vision_start_token_id)  # the template's, before the first timestamp
    assert cut.input_ids == whole.input_ids[:start] and cut.videos == [] and cut.images == []
    last = len(whole.input_ids) - 1 - whole.input_ids[::-1].index(proc.video_token_id)
    (kept,), _ = tokenize_vlm_rows([row], proc, last + 3, files, train_on="all")  # the video fits, the image not
    assert len(kept.videos) == 1 and kept.images == [] and proc.image_token_id not in kept.input_ids


BAD = [  # (reason, user parts, message)
    ("video_missing", [video("nope.mp4")], "does not exist"),
    ("video_missing", [video(frame_paths("run", 3) + ["run/9.png"])], "does not exist"),
    ("video_undecodable", [video("broken.mp4")], "cannot be opened"),
    ("video_undecodable", [video(frame_paths("walk", 2) + ["walk/odd.png"])], "differ in size"),
    ("video_too_large", [video("clip.mp4")], "data.video.max_video_bytes=2000"),
    ("video_too_large", [video(frame_paths("long", 7))], "data.video.max_frames=6"),
    ("video_too_large", [video(frame_paths("long", 6))], "at 32x32 px a frame, over data.video.max_pixels=4096"),
    ("video_too_short", [video(frame_paths("one", 1))], "needs at least 2"),
    ("video_source", [video("https://example.com/a.mp4")], "is a URL"),
    ("video_source", [video(frame_paths("run", 4), fps=-1)], "expected a number > 0"),
    ("video_source", [video(frame_paths("run", 4), timestamps=[0, 1])], "one per frame"),
    ("video_source", [video("clip.mp4", timestamps=[0, 1])], "timestamps are for a list of frames"),
    ("video_count", [{"type": "video"}], "more video parts than the row's 'videos' column"),
]


@pytest.fixture(scope="module")
def strict(cache):
    return load_processor("tiny_vlm", cache_dir=cache,
                          video={"max_video_bytes": 2000, "max_frames": 6, "max_pixels": 4 * 32 * 32})


@needs_av
def test_bad_video_rows_are_skipped_and_counted(strict, files):
    rows = [chat(*parts) for _, parts, _ in BAD] + [chat(video(frame_paths("run", 4)), text("?"))]
    docs, skipped = tokenize_vlm_rows(rows, strict, 512, files)
    expected = {}
    for reason, _, _ in BAD:
        expected[reason] = expected.get(reason, 0) + 1
    assert len(docs) == 1 and skipped == expected
    assert docs[0].videos[0].grid == (2, 2, 2)  # 4 frames of 40 px squeezed to 32 px within 4,096 pixels


@needs_av
@pytest.mark.parametrize("reason, parts, message", BAD)
def test_bad_video_error_mode_names_the_row(strict, files, reason, parts, message):
    rows = [chat(video(frame_paths("run", 4))), chat(*parts)]
    with pytest.raises(ValueError, match=rf"^data row 1: .*{message}.*data.on_bad_row=skip") as e:
        tokenize_vlm_rows(rows, strict, 512, files, on_bad_row="error")
    assert "\n" not in str(e.value)


def test_video_file_without_pyav_is_one_line_error(proc, files, monkeypatch):
    (files / "blank.mp4").write_bytes(b"")  # decoding never starts
    monkeypatch.setitem(sys.modules, "av", None)  # `import av` raises ImportError, as without the extra
    docs, _ = tokenize_vlm_rows([chat(video(frame_paths("run", 4)))], proc, 512, files)
    assert len(docs) == 1  # frame lists need no decoder
    with pytest.raises(ValueError) as e:  # whatever data.on_bad_row: every video file would be skipped
        tokenize_vlm_rows([chat(video("blank.mp4"))], proc, 512, files, on_bad_row="skip")
    assert str(e.value) == (f"video {str(files / 'blank.mp4')!r} is a file; decoding it needs PyAV: pip install "
                            "'qwenft[video]' (PyAV), or give the video as a list of frame images")


def test_videos_column_and_datasets_rows(proc, files, tmp_path):
    """A video part without a value takes the row's `videos` column; Parquet rows (every part with every key,
    None where unused) read the same."""
    import datasets

    user = [{"type": "video", "video": None, "text": None, "fps": None},
            {"type": "text", "video": None, "text": "Which way?", "fps": None}]
    reply = [{"type": "text", "video": None, "text": "Right.", "fps": None}]
    row = {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": reply}],
           "videos": [[str(files / p) for p in frame_paths("walk", 5)]]}
    datasets.Dataset.from_list([row]).to_parquet(tmp_path / "rows.parquet")
    from qwenft.data.loader import load_rows

    (doc,), skipped = tokenize_vlm_rows(load_rows(tmp_path / "rows.parquet"), proc, 512, files)
    (same,), _ = tokenize_vlm_rows([chat(video(frame_paths("walk", 5)), text("Which way?"), reply="Right.")],
                                   proc, 512, files)
    assert not skipped and doc.input_ids == same.input_ids and doc.video_grids == same.video_grids


@pytest.mark.parametrize("override, message", [
    ("data.video.fps=0", "data.video.fps=0.0 must be > 0 (or null for the checkpoint's)"),
    ("data.video.max_frames=0", "data.video.max_frames=0 must be >= 1 (or null for the checkpoint's)"),
    ("data.video.max_video_bytes=-5", "data.video.max_video_bytes=-5 must be >= 1"),
    ("data.video.min_pixels=9000", None),  # valid alone ...
])
def test_bad_video_keys_fail_with_one_line(override, message):
    from qwenft.conf import compose

    if message is None:
        assert compose(["recipe=tiny_vlm", override]).data.video.min_pixels == 9000
        with pytest.raises(ValueError, match=r"^data.video.min_pixels=9000 is above data.video.max_pixels=8000$"):
            compose(["recipe=tiny_vlm", override, "data.video.max_pixels=8000"])  # ... not above the max
        return
    with pytest.raises(ValueError) as e:
        compose(["recipe=tiny_vlm", override])
    assert message in str(e.value) and "\n" not in str(e.value)


def test_processor_overrides_are_checked(cache):
    with pytest.raises(ValueError, match=r"^data.video.min_frames=9 is above data.video.max_frames=8$"):
        load_processor("tiny_vlm", cache_dir=cache, video={"min_frames": 9, "max_frames": 8})
    with pytest.raises(ValueError, match=r"^data.video.min_pixels=4096 is above data.video.max_pixels=1024$"):
        load_processor("tiny_vlm", cache_dir=cache, video={"max_pixels": 1024})  # the checkpoint's min
    settings = load_processor("tiny_vlm", cache_dir=cache, video={"fps": 1, "max_frames": None}).video
    assert dataclasses.astuple(settings)[:9] == (16, 2, 2, 4096, 16 * 64 * 64, 1.0, 4, 16,
                                                 (0.48145466, 0.4578275, 0.40821073))


def test_runner_data_reads_videos_under_pipeline_parallel_and_exports_the_video_config(files, tmp_path):
    """Video rows build under mesh.pp > 1 as under pp = 1 (the pipeline schedule carries videos as it carries
    images: tests/test_video_mesh.py). The HF export's preprocessors include the checkpoint's video processor
    config as it is (a data.video.* override is not written)."""
    import json

    from qwenft.conf import compose
    from qwenft.models.qwen3_5.configs import named_config
    from qwenft.train.data_setup import build_data, load_preprocessors

    path = tmp_path / "rows.jsonl"
    rows = [chat(video([str(files / p) for p in frame_paths("run", 4)]), text("?")), chat(text("no video"))]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = compose(["recipe=tiny_vlm", f"data.path={path}", "mesh.pp=2", "data.video.max_frames=8"])
    for pp in (1, 2):
        _, data, _ = build_data(compose(["recipe=tiny_vlm", f"data.path={path}", f"mesh.pp={pp}"]),
                                named_config("tiny_vlm"), 1, 0, 1)
        assert data.num_video_documents == 1 and len(data.docs) == 2
    _, _, exported = load_preprocessors(cfg, vision=True)
    for p in exported:
        p.save_pretrained(tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "video_preprocessor_config.json").read_text())["max_frames"] == 16
    assert load_preprocessors(cfg, vision=True)[1].video.max_frames == 8  # the override trains, is not written
