"""Video parts of chat rows: where the frames are, which frames to take, the patch grid, the timestamp text
and the pixels, by the rules of transformers' Qwen3-VL video processor and processor (what Qwen3.5 uses).

    settings = VideoSettings.from_processor(transformers_video_processor, fps=..., max_pixels=...)
    video = check_video(spec, settings)     # VideoSpec (from the row) -> Video, or BadRow
    pixel_values_videos, video_grid_thw = video_pixels([video, ...], settings)

A video part is `{"type": "video", "video": SRC}` with SRC a file path (decoded by PyAV, the `qwenft[video]`
extra) or a list of frame images (each anything an image part takes; no decoder needed), plus optionally
`fps` (frames per second the model sees: the rate a file is sampled at, or the rate a frame list was taken
at) or, for a frame list, `timestamps` (seconds, one per frame).

Rules, as transformers applies them:
- A file is sampled at `fps` (default the checkpoint's, 2): `n = int(total_frames / video_fps * fps)`, clamped
  to [min_frames, max_frames] and to the file's frame count; the frames `linspace(0, total - 1, n).round()`.
  A frame list is taken whole (transformers does not sample lists) and must hold at most max_frames frames.
- Frames are resized together to one size (`smart_resize` of Qwen3-VL: a multiple of patch * merge px a
  side, with `t * h * w` of all frames within [min_pixels, max_pixels]), bicubic with antialiasing as
  torchvision does on the CPU, normalized, padded to an even count by repeating the last frame, and cut into
  `(t, h, w)` patches of 2 frames each.
- Text: the template's `<|video_pad|>` becomes, per temporal patch, `<{s:.1f} seconds>` (the mean time of
  its two frames) then `<|vision_start|>`, `h * w / merge**2` video tokens, `<|vision_end|>`.

Everything here is a pure function of the row and the settings, so it can run in a DataLoader worker.
"""

import math
import os
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from qwenft.data.chat import BadRow
from qwenft.data.images import image_source

DEFAULT_MAX_VIDEO_BYTES = 512 * 1024 * 1024
DECODER_HINT = "pip install 'qwenft[video]' (PyAV), or give the video as a list of frame images"


class MissingVideoDecoder(ValueError):
    """A file-path video with PyAV not installed: a setup problem, not a bad row, so it stops the run."""


@dataclass(frozen=True)
class VideoSettings:
    """The numbers of the checkpoint's video processor, with the `data.video.*` overrides applied."""
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int  # bounds on t * h * w over all of a video's frames after resizing
    max_pixels: int
    fps: float  # frames per second sampled from a file; a frame list's default rate
    min_frames: int
    max_frames: int
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    rescale_factor: float
    cap_pixels_per_frame: bool = False  # qwen-vl-utils' per-frame cap (a checkpoint setting)
    max_video_tokens: int = 768
    max_video_bytes: int = DEFAULT_MAX_VIDEO_BYTES

    @classmethod
    def from_processor(cls, vp, **overrides) -> "VideoSettings":
        """From transformers' `Qwen3VLVideoProcessor` (its config; it is never called), then `overrides` (the
        `data.video.*` keys; None = the processor's own)."""
        if not (vp.do_resize and vp.do_rescale and vp.do_normalize) or int(vp.resample) != 3:
            raise ValueError(f"video processor with do_resize={vp.do_resize}, do_rescale={vp.do_rescale}, "
                             f"do_normalize={vp.do_normalize}, resample={vp.resample}: qwenft processes videos "
                             "as Qwen3-VL's does (resize bicubic = resample 3, rescale, normalize)")
        settings = cls(
            patch_size=vp.patch_size, merge_size=vp.merge_size, temporal_patch_size=vp.temporal_patch_size,
            min_pixels=vp.size["shortest_edge"], max_pixels=vp.size["longest_edge"], fps=float(vp.fps),
            min_frames=vp.min_frames, max_frames=vp.max_frames, image_mean=tuple(vp.image_mean),
            image_std=tuple(vp.image_std), rescale_factor=vp.rescale_factor,
            cap_pixels_per_frame=bool(vp.cap_pixels_per_frame), max_video_tokens=vp.max_video_tokens)
        return with_overrides(settings, **overrides)

    @property
    def patch_dim(self) -> int:
        return 3 * self.temporal_patch_size * self.patch_size ** 2


def check_settings(s: VideoSettings) -> None:
    """One-line errors naming the `data.video.*` key, its value and what is valid."""
    for key in ("min_pixels", "max_pixels", "min_frames", "max_frames", "max_video_bytes"):
        if getattr(s, key) < 1:
            raise ValueError(f"data.video.{key}={getattr(s, key)} must be >= 1")
    if not s.fps > 0:
        raise ValueError(f"data.video.fps={s.fps} must be > 0")
    if s.min_pixels > s.max_pixels:
        raise ValueError(f"data.video.min_pixels={s.min_pixels} is above data.video.max_pixels={s.max_pixels}")
    if s.min_frames > s.max_frames:
        raise ValueError(f"data.video.min_frames={s.min_frames} is above data.video.max_frames={s.max_frames}")
    if s.max_frames < s.temporal_patch_size:
        raise ValueError(f"data.video.max_frames={s.max_frames} must be >= {s.temporal_patch_size} (the frames "
                         "of one temporal patch)")


# ---------------------------------------------------------------- rows -> checked videos

@dataclass(frozen=True)
class VideoSpec:
    """A video part as the row gives it (nothing opened yet): a file path, or frame sources (`ImageSource`)."""
    path: str | None = None
    frames: tuple = ()
    fps: float | None = None
    timestamps: tuple[float, ...] | None = None

    def describe(self) -> str:
        return repr(self.path) if self.path is not None else f"of {len(self.frames)} frames"


@dataclass(frozen=True)
class Video:
    """A checked video: which frames to take (indices into the file's frames, or into the frame list), its
    `(t, h, w)` patch grid, its frame size, and the time in seconds of each temporal patch (t of them)."""
    spec: VideoSpec
    indices: tuple[int, ...]
    grid: tuple[int, int, int]
    size: tuple[int, int]  # (height, width) of the frames as decoded
    times: tuple[float, ...]


def video_spec(part: dict, value, base_dir: Path, max_image_bytes: int, where: str) -> VideoSpec:
    """A video part's value and options -> VideoSpec; bad values, missing files and over-size files are BadRows."""
    fps, timestamps = part.get("fps"), part.get("timestamps")
    if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float)) or not fps > 0):
        raise BadRow("video_source", f"{where} has fps={fps!r}; expected a number > 0")
    if isinstance(value, str) and value:
        if "://" in value:
            raise BadRow("video_source", f"video {value!r} is a URL; qwenft reads local files only")
        if timestamps is not None:
            raise BadRow("video_source", f"{where} gives timestamps for the video file {value!r}; timestamps "
                                         "are for a list of frames (a file is sampled at fps)")
        path = Path(value) if os.path.isabs(value) else base_dir / value
        if not path.is_file():
            raise BadRow("video_missing", f"video file {str(path)!r} does not exist")
        return VideoSpec(path=str(path), fps=None if fps is None else float(fps))
    if not isinstance(value, (list, tuple)) or not value:
        raise BadRow("video_source", f"{where} holds {type(value).__name__}; expected a video file path or a "
                                     "non-empty list of frame images")
    frames = []
    for frame in value:
        try:
            frames.append(image_source(frame, base_dir, max_image_bytes))
        except BadRow as e:  # a frame is an image: report it as the video's problem
            raise BadRow(e.reason.replace("image_", "video_", 1), f"video frame: {e}") from None
    if timestamps is not None:
        if fps is not None:
            raise BadRow("video_source", f"{where} gives both fps and timestamps; give one")
        ok = isinstance(timestamps, (list, tuple)) and len(timestamps) == len(frames) and all(
            isinstance(t, (int, float)) and not isinstance(t, bool) and t >= 0 for t in timestamps)
        if not ok or any(b < a for a, b in zip(timestamps, timestamps[1:])):
            raise BadRow("video_source", f"{where} has timestamps {str(timestamps)[:60]}; expected "
                                         f"{len(frames)} non-decreasing seconds >= 0, one per frame")
        timestamps = tuple(float(t) for t in timestamps)
    return VideoSpec(frames=tuple(frames), fps=None if fps is None else float(fps), timestamps=timestamps)


def sample_indices(total_frames: int, video_fps: float, fps: float, min_frames: int, max_frames: int) -> list[int]:
    """The frames a file gives at `fps` (Qwen3-VL's rule; see the module docstring)."""
    n = int(total_frames / video_fps * fps)
    n = min(max(n, min_frames), max_frames, total_frames)
    return np.linspace(0, total_frames - 1, n).round().astype(int).tolist()


def patch_times(times: list[float], temporal_patch_size: int) -> list[float]:
    """Seconds of each temporal patch: the mean of its first and last frame's (the last frame repeats to fill)."""
    times = list(times) + [times[-1]] * (-len(times) % temporal_patch_size)
    return [(times[i] + times[i + temporal_patch_size - 1]) / 2 for i in range(0, len(times), temporal_patch_size)]


def frame_budget(num_frames: int, s: VideoSettings) -> int:
    """The bound on t x h x w that Qwen3-VL's video resize applies to `num_frames` frames: data.video.max_pixels,
    or with the checkpoint's `cap_pixels_per_frame` (qwen-vl-utils' rule) num_frames x a frame's share, at most
    max_video_tokens merged patches and at least 1.05 x min_pixels."""
    if not s.cap_pixels_per_frame:
        return s.max_pixels
    factor = s.patch_size * s.merge_size
    share = max(min(s.max_video_tokens * factor * factor, s.max_pixels // num_frames), int(s.min_pixels * 1.05))
    return share * num_frames


def resized_size(num_frames: int, height: int, width: int, s: VideoSettings) -> tuple[int, int]:
    """(height, width) all frames are resized to: Qwen3-VL's video `smart_resize` within the pixel budget."""
    factor, temporal = s.patch_size * s.merge_size, s.temporal_patch_size
    max_pixels = frame_budget(num_frames, s)
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise BadRow("video_undecodable", f"video frames of {width}x{height} px have an aspect ratio over 200")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    t = round(num_frames / temporal) * temporal
    if t * h * w > max_pixels:
        beta = math.sqrt(num_frames * height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif t * h * w < s.min_pixels:
        beta = math.sqrt(s.min_pixels / (num_frames * height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    if min(t, num_frames) * h * w > max_pixels:  # a side at its floor (factor px): the budget cannot hold it
        budget = f"data.video.max_pixels={s.max_pixels}" if max_pixels == s.max_pixels else (
            f"{max_pixels} (the checkpoint's cap_pixels_per_frame, max_video_tokens={s.max_video_tokens})")
        raise BadRow("video_too_large", f"video of {num_frames} frames needs {num_frames * h * w} pixels even at "
                                        f"{w}x{h} px a frame, over {budget}")
    return h, w


def check_video(spec: VideoSpec, s: VideoSettings) -> Video:
    """Open the video once (decode every frame it will give), choose its frames, size and timestamps."""
    if spec.path is not None:
        size = os.path.getsize(spec.path)
        if size > s.max_video_bytes:
            raise BadRow("video_too_large", f"video file {spec.path!r} has {size} bytes, over "
                                            f"data.video.max_video_bytes={s.max_video_bytes}")
        total, video_fps = _probe_file(spec.path)
        indices = sample_indices(total, video_fps, spec.fps or s.fps, s.min_frames, s.max_frames)
        _, (height, width) = _decode_file(spec.path, indices, keep=False)
        times = [i / video_fps for i in indices]
    else:
        if len(spec.frames) > s.max_frames:
            raise BadRow("video_too_large", f"video of {len(spec.frames)} frames is over "
                                            f"data.video.max_frames={s.max_frames}")
        sizes = set()
        for frame in spec.frames:
            try:
                sizes.add(frame.open().size)
            except BadRow as e:
                raise BadRow(e.reason.replace("image_", "video_", 1), f"video frame: {e}") from None
        if len(sizes) > 1:
            raise BadRow("video_undecodable", f"video frames differ in size ({sorted(sizes)}); a video's frames "
                                              "share one size")
        (width, height), = sizes
        indices = list(range(len(spec.frames)))
        times = list(spec.timestamps) if spec.timestamps is not None else [i / (spec.fps or s.fps) for i in indices]
    if len(indices) < s.temporal_patch_size:
        raise BadRow("video_too_short", f"video {spec.describe()} gives {len(indices)} frame(s); a video needs at "
                                        f"least {s.temporal_patch_size} (one temporal patch)")
    h, w = resized_size(len(indices), height, width, s)
    t = -(-len(indices) // s.temporal_patch_size)
    grid = (t, h // s.patch_size, w // s.patch_size)
    return Video(spec, tuple(indices), grid, (height, width), tuple(patch_times(times, s.temporal_patch_size)))


def video_tokens(video: Video, merge_size: int) -> int:
    """Video tokens (features) of the video: t * h * w / merge**2 (timestamps and delimiters not counted)."""
    t, h, w = video.grid
    return t * h * w // merge_size ** 2


# ---------------------------------------------------------------- decoding (PyAV)

def _av(path: str):
    try:
        import av
    except ImportError:
        raise MissingVideoDecoder(f"video {path!r} is a file; decoding it needs PyAV: {DECODER_HINT}") from None
    return av


def _open(path: str):
    av = _av(path)
    try:
        return av.open(path)
    except (av.FFmpegError, OSError, ValueError) as e:
        raise BadRow("video_undecodable", f"video file {path!r} cannot be opened ({e})") from None


def _probe_file(path: str) -> tuple[int, float]:
    """(frames, frames per second) from the file's video stream header, as transformers' PyAV reader takes
    them; a stream that does not state its frame count is counted by decoding."""
    with _open(path) as container:
        if not container.streams.video:
            raise BadRow("video_undecodable", f"video file {path!r} has no video stream")
        stream = container.streams.video[0]
        if not stream.average_rate:
            raise BadRow("video_undecodable", f"video file {path!r} does not state its frame rate")
        total, fps = int(stream.frames), float(stream.average_rate)
    if total == 0:
        total, _ = _decode_file(path, None, keep=False)
    return total, fps


def _decode_file(path: str, indices: list[int] | None, keep: bool):
    """Decode frames in order up to the last of `indices` (all of them when None): their RGB
    `uint8 [n, H, W, 3]` if `keep`, else (how many decoded, (height, width) of the first). A file that ends
    early, or has no frames, is a bad row."""
    av = _av(path)
    wanted = set(indices or ())
    last = max(wanted) if indices else None
    frames, count, size = [], 0, None
    try:
        with _open(path) as container:
            for frame in container.decode(video=0):
                size = size or (frame.height, frame.width)
                if keep and count in wanted:
                    frames.append(frame.to_ndarray(format="rgb24"))
                count += 1
                if last is not None and count > last:
                    break
    except (av.FFmpegError, OSError, ValueError) as e:
        raise BadRow("video_undecodable", f"video file {path!r} cannot be decoded ({e})") from None
    if count == 0 or (last is not None and count <= last):
        raise BadRow("video_undecodable", f"video file {path!r} decodes to {count} frames but its header "
                                          f"promises at least {(last or 0) + 1}")
    return np.stack(frames) if keep else (count, size)


def load_frames(video: Video) -> torch.Tensor:
    """The video's chosen frames, `uint8 [n, 3, H, W]` (RGB)."""
    if video.spec.path is not None:
        frames = _decode_file(video.spec.path, list(video.indices), keep=True)
    else:
        frames = np.stack([np.asarray(video.spec.frames[i].open()) for i in video.indices])
    if frames.shape[1:3] != video.size:
        raise ValueError(f"video {video.spec.describe()} decodes to {frames.shape[2]}x{frames.shape[1]} px frames "
                         f"but was {video.size[1]}x{video.size[0]} when the data was read; did it change?")
    return torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous()


# ---------------------------------------------------------------- frames -> pixel_values_videos

def video_patches(frames: torch.Tensor, s: VideoSettings) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """`uint8 [n, 3, H, W]` frames -> `float32 [t * h * w, patch_dim]` patches and the `(t, h, w)` grid, with
    the operations of transformers' Qwen3-VL video processor on the CPU (torchvision's uint8 bicubic resize
    is `interpolate(..., antialias=True)` on the uint8 tensor; rescale is folded into the normalization)."""
    n, channels, height, width = frames.shape
    h, w = resized_size(n, height, width, s)
    if (h, w) != (height, width):
        frames = torch.nn.functional.interpolate(frames, size=[h, w], mode="bicubic", align_corners=False,
                                                 antialias=True)
    mean = (torch.tensor(s.image_mean) * (1.0 / s.rescale_factor)).view(-1, 1, 1)
    std = (torch.tensor(s.image_std) * (1.0 / s.rescale_factor)).view(-1, 1, 1)
    x = frames.to(torch.float32).sub_(mean).div_(std)
    tp, p, m = s.temporal_patch_size, s.patch_size, s.merge_size
    if pad := -n % tp:
        x = torch.cat([x, x[-1:].expand(pad, -1, -1, -1)])
    gt, gh, gw = x.shape[0] // tp, h // p, w // p
    x = x.view(gt, tp, channels, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(gt * gh * gw, channels * tp * p * p), (gt, gh, gw)


def video_pixels(videos: list[Video], s: VideoSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """`pixel_values_videos [n_patches, patch_dim]` float32 and `video_grid_thw [n_videos, 3]`, videos in order."""
    if not videos:
        return torch.zeros(0, s.patch_dim), torch.zeros(0, 3, dtype=torch.long)
    patches, grids = [], []
    for video in videos:
        x, grid = video_patches(load_frames(video), s)
        if grid != video.grid:
            raise ValueError(f"video {video.spec.describe()} gives grid {list(grid)} but had {list(video.grid)} when "
                             "the data was read; did it change?")
        patches.append(x)
        grids.append(grid)
    return torch.cat(patches), torch.tensor(grids, dtype=torch.long)


def with_overrides(s: VideoSettings, **overrides) -> VideoSettings:
    """`s` with the non-None overrides, checked."""
    s = replace(s, **{k: float(v) if k == "fps" else v for k, v in overrides.items() if v is not None})
    check_settings(s)
    return s


def budget_patches(path_or_name: str, max_pixels: int | None = None, min_pixels: int | None = None,
                   max_frames: int | None = None) -> int:
    """The most vision patches one video can make, for `qwenft plan`. A video of n frames (at most max_frames)
    is resized so that min(t, n) x h x w stays within its budget (`resized_size`; t: n rounded to even, half to
    even) and padded to ceil(n / 2) x 2 frames, so an odd count can exceed the budget (5 frames: 6 frames at a
    quarter each, 1.5x). The budget is `max_pixels` (data.video.max_pixels; None = the checkpoint's
    `size.longest_edge`) or, where the checkpoint caps the pixels per frame (`cap_pixels_per_frame`), n x that cap,
    which its floor of 1.05 x min_pixels a frame can lift above max_pixels. `min_pixels`, `max_frames`:
    data.video.* (None = the checkpoint's). `path_or_name`: a checkpoint dir (its video processor config) or
    "tiny_vlm"."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    if path_or_name == "tiny_vlm":
        from qwenft.data.tiny_vlm import VIDEO_PROCESSOR

        processor = Qwen3VLVideoProcessor(**VIDEO_PROCESSOR)
    else:
        processor = Qwen3VLVideoProcessor.from_pretrained(path_or_name)
    settings = VideoSettings.from_processor(processor, max_pixels=max_pixels, min_pixels=min_pixels,
                                            max_frames=max_frames)
    temporal, area = settings.temporal_patch_size, (settings.patch_size * settings.merge_size) ** 2
    most = 0
    for n in range(temporal, settings.max_frames + 1):
        checked = min(round(n / temporal) * temporal, n)  # frames resized_size holds within the budget
        frame = frame_budget(n, settings) // checked // area * area  # h x w, a multiple of the merged patch
        most = max(most, math.ceil(n / temporal) * temporal * frame)
    return most // (temporal * settings.patch_size ** 2)
