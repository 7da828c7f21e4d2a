"""Image/video+text chat rows -> documents with expanded vision placeholders -> packed micro batches with pixels.

API (what the runner uses for a model with a vision tower):

    processor = load_processor(cfg.data.tokenizer or cfg.model.path or "tiny_vlm",
                               min_pixels=..., max_pixels=..., video={"fps": ..., ...})   # -> VLMProcessor
    data = build_vlm_data(path, processor, seq_len, micro_batch_size, dp_rank, dp_size, seed, packing,
                          train_on, truncation, on_bad_row, max_image_bytes=..., data_format="auto",
                          num_workers=2)   # -> VLMData; pixels made ahead in 2 threads (qwenft.data.workers)
    batch = next(data)   # input_ids, labels [B, T]; position_ids [3, B, T] (M-RoPE, per document);
                         # cu_seqlens; padding_mask [B, T]; pixel_values [n_patches, C*t*p*p] float32;
                         # image_grid_thw [n_images, 3]; pixel_values_videos; video_grid_thw [n_videos, 3]

A row's `messages[i].content` is a string or a list of parts: `{"type": "text", "text": ...}`,
`{"type": "image", "image": SRC}` (or OpenAI's `{"type": "image_url", "image_url": {"url": SRC}}`), where
SRC is a path (relative to the dataset file, or absolute), a `data:image/...;base64,` URI, raw bytes, a
`{"bytes", "path"}` dict (a `datasets` Image column read back as rows) or a PIL image, and
`{"type": "video", "video": a file path or a list of frame SRCs, "fps"?: ..., "timestamps"?: [...]}`
(`qwenft.data.video`). An image (video) part with no value takes the next entry of the row's `images`
(`videos`) column (TRL's layout).

Rendering uses the checkpoint's own chat template (which turns an image part into
`<|vision_start|><|image_pad|><|vision_end|>`, a video part into the same with `<|video_pad|>`), labels
come from `chat.tokenize_messages` (assistant replies only, found on the rendered text), then each
`<|image_pad|>` token is repeated `t*h*w / merge**2` times for its image's grid and each `<|video_pad|>`
becomes its timestamps and frames, as transformers' Qwen3-VL processor does to the text before tokenizing
(a special token is one token, so both give the same ids: tested). Vision tokens are never targets. A grid
comes from the image's size alone (Qwen's `smart_resize` within min/max pixels), or the video's frame
count and size, so at start-up every image and video is decoded once to check it and size it; pixels are
produced per micro batch (images by the checkpoint's image processor, videos by `qwenft.data.video`), in
the order their tokens appear in the batch, by `num_workers` threads ahead of the training step.
"""

import math
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from qwenft.constants import IGNORE_INDEX
from qwenft.data.chat import (ON_BAD_ROW, ROLES, TRAIN_ON, TRUNCATION, BadRow, Document,
                              SkipCounts, UnreadableRow, check_choice, parse_rows, reasoning_of, shift_labels,
                              tokenize_messages)
from qwenft.data.formats import as_messages_row, resolve_format
from qwenft.data.images import DEFAULT_MAX_IMAGE_BYTES, ImageSource, image_source
from qwenft.data.loader import SFTData, fingerprint, load_rows
from qwenft.data.packing import build_row, cu_seqlens_from_position_ids, padding_mask
from qwenft.data.video import (Video, VideoSettings, VideoSpec, check_video, video_pixels, video_spec,
                               video_tokens)
from qwenft.mrope import document_mrope_position_ids, split_video_grids

IMAGE_PART_TYPES = ("image", "image_url")
VIDEO_PART_TYPES = ("video",)


@dataclass
class VLMProcessor:
    """The checkpoint's tokenizer (with its chat template) and image processor, plus the numbers the data
    pipeline needs from them. `min_pixels` / `max_pixels` bound the resized image area; `video` holds the
    video processor's numbers (None: video parts are bad rows)."""
    tokenizer: object
    image_processor: object
    min_pixels: int
    max_pixels: int
    video: VideoSettings | None = None
    video_processor: object = None  # the checkpoint's transformers video processor, for HF exports (its config)
    image_token: str = "<|image_pad|>"
    video_token: str = "<|video_pad|>"

    def __post_init__(self):
        ip = self.image_processor
        self.patch_size, self.merge_size = ip.patch_size, ip.merge_size
        self.temporal_patch_size = ip.temporal_patch_size
        self.image_token_id = self.tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = self.tokenizer.convert_tokens_to_ids(self.video_token)
        if self.video_token_id == self.tokenizer.unk_token_id:
            self.video_token_id = None
        self.vision_start_token_id = self.tokenizer.convert_tokens_to_ids("<|vision_start|>")
        self.vision_end_token_id = self.tokenizer.convert_tokens_to_ids("<|vision_end|>")
        self._stamp_ids = {}
        if self.image_token_id is None or self.image_token_id == self.tokenizer.unk_token_id:
            raise ValueError(f"the tokenizer has no {self.image_token} token; is this a Qwen3.5 VLM checkpoint?")
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(f"data.image.min_pixels={self.min_pixels} / data.image.max_pixels={self.max_pixels}: "
                             "need 0 < min_pixels <= max_pixels")

    @property
    def patch_dim(self) -> int:
        return 3 * self.temporal_patch_size * self.patch_size ** 2

    def grid(self, height: int, width: int) -> tuple[int, int, int]:
        """(t, h, w) patch grid of one image after the processor's resize (Qwen's `smart_resize`)."""
        factor = self.patch_size * self.merge_size
        if max(height, width) / min(height, width) > 200:
            raise BadRow("image_undecodable", f"image of {width}x{height} px has an aspect ratio over 200")
        h, w = round(height / factor) * factor, round(width / factor) * factor
        if h * w > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h = max(factor, math.floor(height / beta / factor) * factor)
            w = max(factor, math.floor(width / beta / factor) * factor)
        elif h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
        return 1, h // self.patch_size, w // self.patch_size

    def pixels(self, images: list[Image.Image]) -> tuple[torch.Tensor, torch.Tensor]:
        """`pixel_values [n_patches, patch_dim]` float32 and `image_grid_thw [n_images, 3]` of the images."""
        if not images:
            return torch.zeros(0, self.patch_dim), torch.zeros(0, 3, dtype=torch.long)
        out = self.image_processor(images=images, return_tensors="pt",
                                   size={"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels})
        return out["pixel_values"].float(), out["image_grid_thw"].long()

    def video_pixels(self, videos: list[Video]) -> tuple[torch.Tensor, torch.Tensor]:
        """`pixel_values_videos [n_patches, patch_dim]` float32 and `video_grid_thw [n_videos, 3]` of the videos."""
        return video_pixels(videos, self.video)

    def video_ids(self, video: Video) -> list[int]:
        """What the template's one video token becomes: per temporal patch `<{s:.1f} seconds>`, vision-start,
        h * w / merge**2 video tokens, vision-end (transformers' Qwen3-VL processor)."""
        _, h, w = video.grid
        frame = [self.vision_start_token_id] + [self.video_token_id] * (h * w // self.video.merge_size ** 2) + \
            [self.vision_end_token_id]
        ids = []
        for seconds in video.times:
            stamp = f"<{seconds:.1f} seconds>"  # between special tokens, so tokenized alone as in context
            if stamp not in self._stamp_ids:
                self._stamp_ids[stamp] = self.tokenizer(stamp, add_special_tokens=False)["input_ids"]
            ids += self._stamp_ids[stamp] + frame
        return ids


def load_processor(path_or_name: str, min_pixels: int | None = None, max_pixels: int | None = None,
                   cache_dir=None, video: dict | None = None) -> VLMProcessor:
    """`"tiny_vlm"` -> the generated tiny processor; a dir -> its tokenizer, chat template, image processor
    and video processor settings.

    Loads the tokenizer and image processor separately (not `AutoProcessor`): transformers' Qwen3-VL
    processor class also builds a video processor, which needs torchvision to run. qwenft only reads that
    video processor's config (`video_preprocessor_config.json`, else transformers' fallback to
    `preprocessor_config.json`) and processes videos itself (`qwenft.data.video`).
    `min_pixels` / `max_pixels` (None = the checkpoint's `size.shortest_edge` / `size.longest_edge`);
    `video`: overrides by `data.video.*` key name (`min_pixels`, `max_pixels`, `fps`, `min_frames`,
    `max_frames`, `max_video_bytes`; None = the checkpoint's).
    """
    from transformers import AutoImageProcessor, AutoTokenizer
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    if path_or_name == "tiny_vlm":
        from qwenft.data.tiny_vlm import tiny_vlm_processor_dir

        path = tiny_vlm_processor_dir(cache_dir)
    else:
        path = Path(path_or_name)
        if not any((path / f).is_file() for f in ("preprocessor_config.json", "processor_config.json")):
            raise ValueError(f"{str(path)!r} has no preprocessor_config.json (the image processor); set "
                             "data.tokenizer or model.path to a Qwen3.5 VLM checkpoint dir, or to 'tiny_vlm'")
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.chat_template is None and (path / "chat_template.jinja").is_file():
        tokenizer.chat_template = (path / "chat_template.jinja").read_text()
    image_processor = AutoImageProcessor.from_pretrained(path)
    size = image_processor.size
    video_processor = Qwen3VLVideoProcessor.from_pretrained(path)
    return VLMProcessor(tokenizer, image_processor,
                        min_pixels if min_pixels is not None else size["shortest_edge"],
                        max_pixels if max_pixels is not None else size["longest_edge"],
                        VideoSettings.from_processor(video_processor, **(video or {})),
                        video_processor if (path / "video_preprocessor_config.json").is_file() else None)


# ---------------------------------------------------------------- rows -> messages + image and video sources

def _column(row, name: str) -> list:
    column = row.get(name) or []
    return column if isinstance(column, list) else [column]


def _placeholder_parts(text: str, columns: dict[str, list]) -> list[dict]:
    """A user or system turn's text as parts, each `<image>` (`<video>`) in it an image (video) part without a value
    when the row has an `images` (`videos`) column: LLaMA-Factory's layout. Without the column the text is kept as
    it is."""
    tags = [f"<{kind}>" for kind, column in columns.items() if column]
    if not tags:
        return [{"type": "text", "text": text}]
    pieces = re.split(f"({'|'.join(tags)})", text)
    return [{"type": piece[1:-1]} if piece in tags else {"type": "text", "text": piece} for piece in pieces if piece]


def parse_row(row, base_dir: Path, max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
              ) -> tuple[list[dict], list[ImageSource], list[VideoSpec]]:
    """Messages for the chat template (assistant content as a string; a turn with images or videos as a list
    of `{"type": "text"|"image"|"video"}` parts), the images' sources and the videos' specs in reading order;
    or BadRow. An image / video part without a value takes the next entry of the row's `images` / `videos`
    column."""
    if isinstance(row, UnreadableRow):
        raise BadRow("unreadable", row.problem)
    if not isinstance(row, dict) or not isinstance(row.get("messages"), list) or not row["messages"]:
        raise BadRow("no_messages", "row has no non-empty 'messages' list")
    if row.get("tools"):
        raise BadRow("bad_tool_call", "row has a 'tools' column; the image pipeline trains text, image and video "
                                      "turns only")
    columns = {"image": _column(row, "images"), "video": _column(row, "videos")}
    taken = {"image": 0, "video": 0}
    messages, images, videos = [], [], []
    for i, message in enumerate(row["messages"]):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ROLES:
            raise BadRow("bad_role", f"message {i} has role {role!r}; expected one of {', '.join(ROLES)}")
        if message.get("tool_calls"):
            raise BadRow("bad_tool_call", f"message {i} has tool_calls; the image pipeline trains text, image and "
                                          "video turns only")
        content = message.get("content")
        parts = ([{"type": "text", "text": content}] if role == "assistant" else _placeholder_parts(content, columns)
                 ) if isinstance(content, str) else content
        if not isinstance(parts, list):
            raise BadRow("bad_content", f"message {i} content is {type(content).__name__}; expected a string "
                                        "or a list of text/image/video parts")
        rendered, text, n_visual = [], "", 0
        for part in parts:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                rendered.append({"type": "text", "text": part["text"]})
                text += part["text"]
                continue
            if kind in IMAGE_PART_TYPES:
                value = part.get("image") if kind == "image" else part.get("image_url")
                value = value.get("url") if kind == "image_url" and isinstance(value, dict) else value
                kind = "image"
            elif kind in VIDEO_PART_TYPES:
                value = part.get("video")
            else:
                raise BadRow("bad_content", f"message {i} has a content part {str(part)[:60]!r}; expected "
                                            "{'type': 'text', 'text': str}, {'type': 'image', 'image': ...} or "
                                            "{'type': 'video', 'video': ...}")
            if value is None:
                column = columns[kind]
                if taken[kind] >= len(column):
                    raise BadRow(f"{kind}_count", f"message {i} has more {kind} parts than the row's "
                                                  f"'{kind}s' column has {kind}s ({len(column)})")
                value, taken[kind] = column[taken[kind]], taken[kind] + 1
            if kind == "image":
                images.append(image_source(value, base_dir, max_image_bytes))
            else:
                videos.append(video_spec(part, value, base_dir, max_image_bytes, f"message {i}'s video part"))
            rendered.append({"type": kind})
            n_visual += 1
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise BadRow("undecodable", f"message {i} content is not valid text ({e.reason})") from None
        if not text.strip() and not n_visual:
            raise BadRow("empty_content", f"message {i} ({role}) has empty content")
        if role == "assistant" and n_visual:
            raise BadRow("bad_content", f"message {i} is an assistant turn with an image or video; they belong "
                                        "in user or system turns")
        messages.append({"role": role, "content": rendered if n_visual else text, **reasoning_of(message, i)})
    for kind, column in columns.items():
        if taken[kind] < len(column):
            raise BadRow(f"{kind}_count", f"the row's '{kind}s' column has {len(column)} {kind}s but its messages "
                                          f"have {taken[kind]} {kind} parts without a source")
    if not any(m["role"] == "assistant" for m in messages):
        raise BadRow("no_assistant", "conversation has no assistant turn to learn from")
    return messages, images, videos


# ---------------------------------------------------------------- messages -> documents

@dataclass
class VLMDocument(Document):
    images: list[ImageSource] = field(default_factory=list)
    grids: list[tuple[int, int, int]] = field(default_factory=list)  # one (t, h, w) per image, in order
    videos: list[Video] = field(default_factory=list)  # each with its (t, h, w) grid, in order

    @property
    def video_grids(self) -> list[tuple[int, int, int]]:
        return [v.grid for v in self.videos]


def expand_vision_tokens(ids: list[int], is_target: list[bool], grids: list[tuple[int, int, int]],
                         processor: VLMProcessor, videos: list[Video] = ()
                         ) -> tuple[list[int], list[bool], list[tuple[str, int, int]]]:
    """Repeat each image placeholder token t*h*w/merge**2 times and replace each video placeholder by its
    timestamps and frames (`VLMProcessor.video_ids`); none of these is a target. Also returns each image's
    and video's `(kind, start, end)` span in the result, `start` at the template's vision-start before it."""
    for kind, token, name, count in (("image", processor.image_token_id, processor.image_token, len(grids)),
                                     ("video", processor.video_token_id, processor.video_token, len(videos))):
        found = ids.count(token) if token is not None else 0
        if found != count:
            raise BadRow(f"{kind}_count", f"the row has {count} {kind}(s) but the chat template rendered {found} "
                                          f"{name} placeholder(s)")
    out_ids, out_target, spans, k, v = [], [], [], 0, 0
    for token, target in zip(ids, is_target):
        if token == processor.image_token_id:
            t, h, w = grids[k]
            new, kind, k = [token] * (t * h * w // processor.merge_size ** 2), "image", k + 1
        elif token == processor.video_token_id:
            new, kind, v = processor.video_ids(videos[v]), "video", v + 1
        else:
            out_ids.append(token)
            out_target.append(target)
            continue
        start = len(out_ids)
        start -= 1 if start and out_ids[-1] == processor.vision_start_token_id else 0
        out_ids += new
        out_target += [False] * len(new)
        spans.append((kind, start, len(out_ids)))
    return out_ids, out_target, spans


def truncate_at(spans: list[tuple[str, int, int]], seq_len: int) -> tuple[int, int, int]:
    """(cut, images kept, videos kept) for right truncation to `seq_len` that never splits an image or a
    video: one whose tokens do not all fit is dropped together with its vision-start token."""
    kept = {"image": 0, "video": 0}
    for kind, start, end in spans:
        if end > seq_len:
            return min(seq_len, start), kept["image"], kept["video"]
        kept[kind] += 1
    return seq_len, kept["image"], kept["video"]


def tokenize_vlm_row(row, processor: VLMProcessor, base_dir: Path, train_on: str, max_image_bytes: int):
    """(ids, is_target, images, grids, videos, spans) of one row, image and video placeholders expanded
    (`expand_vision_tokens`); or BadRow. Opens every image and video once to check it and size it."""
    messages, sources, specs = parse_row(row, base_dir, max_image_bytes)
    grids = []
    for source in sources:
        image = source.open()
        grids.append(processor.grid(image.height, image.width))
    if specs and (processor.video is None or processor.video_token_id is None):
        raise BadRow("video_count", f"the row has {len(specs)} video(s) but the processor has no "
                                    f"{processor.video_token} token or video settings")
    videos = [check_video(spec, processor.video) for spec in specs]
    ids, is_target = tokenize_messages(processor.tokenizer, messages, train_on)
    ids, is_target, spans = expand_vision_tokens(ids, is_target, grids, processor, videos)
    return ids, is_target, sources, grids, videos, spans


def tokenize_vlm_rows(rows, processor: VLMProcessor, seq_len: int, base_dir: Path, train_on: str = "assistant",
                      truncation: str = "truncate_right", on_bad_row: str = "skip",
                      max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
                      data_format: str = "messages") -> tuple[list[VLMDocument], Counter]:
    """Documents for every usable row and the skip counts, as `chat.tokenize_rows`; extra reasons:
    `image_missing`, `image_undecodable`, `image_too_large`, `image_source`, `image_count`, and the same
    with `video_` plus `video_too_short`. A file-path video without PyAV installed stops with a one-line
    error (`video.MissingVideoDecoder`), whatever `on_bad_row` says."""
    check_choice("data.train_on", train_on, TRAIN_ON)
    check_choice("data.truncation", truncation, TRUNCATION)
    check_choice("data.on_bad_row", on_bad_row, ON_BAD_ROW)
    docs, skipped = [], SkipCounts()

    def tokenize(row):
        return tokenize_vlm_row(as_messages_row(row, data_format), processor, base_dir, train_on, max_image_bytes)

    for index, (ids, is_target, images, grids, videos, spans) in parse_rows(rows, tokenize, on_bad_row, skipped):
        if len(ids) > seq_len:
            if truncation == "drop":
                skipped.add("too_long", index, f"{len(ids)} tokens > data.seq_len={seq_len}")
                continue
            cut, n_images, n_videos = truncate_at(spans, seq_len)
            ids, is_target = ids[:cut], is_target[:cut]
            images, grids, videos = images[:n_images], grids[:n_images], videos[:n_videos]
        labels = shift_labels(ids, is_target)
        if all(label == IGNORE_INDEX for label in labels):
            skipped.add("no_target_left", index, f"truncation to data.seq_len={seq_len} left no learned token")
            continue
        docs.append(VLMDocument(ids, labels, images, grids, videos))
    return docs, skipped


# ---------------------------------------------------------------- documents -> micro batches

class VLMData(SFTData):
    """`SFTData` (same rows, sharding, epochs, state) whose micro batches also carry the images and videos.

    Per micro batch: `position_ids [3, B, T]` (M-RoPE, computed per document here, so pipeline stages after
    the first never need `input_ids`; `position_ids[0]` restarts at 0 exactly at document starts, so
    `cu_seqlens == cu_seqlens_from_position_ids(position_ids[0])`), `pixel_values [n_patches, patch_dim]`
    and `image_grid_thw [n_images, 3]`, `pixel_values_videos [n_video_patches, patch_dim]` and
    `video_grid_thw [n_videos, 3]`, images (videos) in the order their tokens appear in the flattened `B*T`
    (row by row, document by document). A micro batch without images (videos) has 0-row tensors for them;
    pass None to the model then (the vision tower rejects zero images).
    """

    def __init__(self, docs: list[VLMDocument], processor: VLMProcessor, *args, **kwargs):
        super().__init__(docs, *args, **kwargs)
        self.processor = processor
        self.num_video_documents = sum(1 for doc in docs if doc.videos)

    def _row_tokens(self, doc_ids: list[int]):
        docs = [self.docs[d] for d in doc_ids]
        input_ids, labels, _, padding = build_row(docs, self.seq_len, self.pad_id)
        positions = [document_positions(doc, self.processor) for doc in docs]
        tail = self.seq_len - sum(p.shape[1] for p in positions)
        positions.append(torch.arange(tail).expand(3, tail))
        return (input_ids, labels, torch.cat(positions, dim=1), [image for doc in docs for image in doc.images],
                [g for doc in docs for g in doc.grids], [v for doc in docs for v in doc.videos], padding)

    def _collate(self, rows) -> dict[str, torch.Tensor]:
        input_ids, labels, positions, images, grids, videos, padding = zip(*rows)
        position_ids = torch.stack(positions, dim=1)
        grids = [g for row in grids for g in row]
        pixel_values, image_grid_thw = self.processor.pixels([s.open() for row in images for s in row])
        if image_grid_thw.tolist() != [list(g) for g in grids]:  # the image processor resized differently
            raise ValueError(f"image processor grids {image_grid_thw.tolist()} differ from the grids the "
                             f"data pipeline expected {grids}; its resize rule is not Qwen's smart_resize")
        videos = [v for row in videos for v in row]
        if videos:
            pixel_values_videos, video_grid_thw = self.processor.video_pixels(videos)
        else:  # a batch of images alone needs no video settings
            patch_dim = pixel_values.shape[1]
            pixel_values_videos, video_grid_thw = torch.zeros(0, patch_dim), torch.zeros(0, 3, dtype=torch.long)
        return {"input_ids": torch.from_numpy(np.stack(input_ids)), "labels": torch.from_numpy(np.stack(labels)),
                "position_ids": position_ids, "cu_seqlens": cu_seqlens_from_position_ids(position_ids[0]),
                "padding_mask": padding_mask(list(padding), self.seq_len),
                "pixel_values": pixel_values, "image_grid_thw": image_grid_thw,
                "pixel_values_videos": pixel_values_videos, "video_grid_thw": video_grid_thw}


def document_positions(doc: VLMDocument, processor: VLMProcessor) -> torch.Tensor:
    """M-RoPE positions `[3, len(doc)]` of one document, from 0 (transformers' get_rope_index rule): each video
    frame (temporal patch) is positioned as an image of t = 1, its timestamp tokens as text."""
    grids = torch.tensor(doc.grids, dtype=torch.long).reshape(-1, 3)
    frames = split_video_grids(torch.tensor(doc.video_grids, dtype=torch.long).reshape(-1, 3))
    positions, used, used_frames = document_mrope_position_ids(
        torch.tensor(doc.input_ids), grids, processor.image_token_id, processor.merge_size, frames,
        processor.video_token_id)
    assert used == len(doc.grids) and used_frames == len(frames), (used, doc.grids, used_frames, doc.video_grids)
    return positions


def _slices(ids: torch.Tensor, token_id: int | None, grid: torch.Tensor, merge_size: int, num_microbatches: int,
            kind: str) -> list[tuple[slice, slice]]:
    """Per row slice of `ids` (split in `num_microbatches` along rows), the (grid rows, patch rows) of its
    images or videos: they follow the `token_id` tokens in order."""
    size = ids.shape[0] // num_microbatches
    tokens_per = (grid.prod(-1) // merge_size ** 2).tolist()
    patches_per = grid.prod(-1).tolist()
    out, item, patch = [], 0, 0
    for m in range(num_microbatches):
        tokens = int((ids[m * size:(m + 1) * size] == token_id).sum()) if token_id is not None else 0
        first_item, first_patch = item, patch
        while tokens > 0 and item < len(tokens_per):
            tokens -= tokens_per[item]
            patch += patches_per[item]
            item += 1
        if tokens != 0:
            raise ValueError(f"microbatch {m}: {kind} tokens do not line up with {kind}_grid_thw")
        out.append((slice(first_item, item), slice(first_patch, patch)))
    return out


def split_microbatches(batch: dict, num_microbatches: int, image_token_id: int, merge_size: int,
                       video_token_id: int | None = None) -> list[dict]:
    """Split a micro batch (or several concatenated along rows) into `num_microbatches` equal row slices,
    each with exactly its rows' images and videos: `pixel_values` / `image_grid_thw` rows follow the image
    tokens, `pixel_values_videos` / `video_grid_thw` rows the video tokens (`video_token_id`)."""
    rows = batch["input_ids"].shape[0]
    if rows % num_microbatches:
        raise ValueError(f"{rows} rows do not split into {num_microbatches} equal microbatches")
    size = rows // num_microbatches
    kinds = [("pixel_values", "image_grid_thw", image_token_id, "image")]
    if "video_grid_thw" in batch:
        if len(batch["video_grid_thw"]) and video_token_id is None:
            raise ValueError("the batch has videos: split_microbatches needs video_token_id")
        kinds.append(("pixel_values_videos", "video_grid_thw", video_token_id, "video"))
    cuts = {grid_key: _slices(batch["input_ids"], token, batch[grid_key], merge_size, num_microbatches, kind)
            for _, grid_key, token, kind in kinds}
    out = []
    for m in range(num_microbatches):
        lo, hi = m * size, (m + 1) * size
        position_ids = batch["position_ids"][..., lo:hi, :]
        positions = position_ids[0] if position_ids.dim() == 3 else position_ids
        mb = {"input_ids": batch["input_ids"][lo:hi], "labels": batch["labels"][lo:hi],
              "position_ids": position_ids, "cu_seqlens": cu_seqlens_from_position_ids(positions),
              **({"padding_mask": batch["padding_mask"][lo:hi]} if "padding_mask" in batch else {})}
        for pixel_key, grid_key, _, _ in kinds:
            items, patches = cuts[grid_key][m]
            mb[pixel_key], mb[grid_key] = batch[pixel_key][patches], batch[grid_key][items]
        out.append(mb)
    return out


def build_vlm_data(path_or_rows, processor: VLMProcessor, seq_len: int, micro_batch_size: int, dp_rank: int = 0,
                   dp_size: int = 1, seed: int = 0, packing: str = "pack", train_on: str = "assistant",
                   truncation: str = "truncate_right", on_bad_row: str = "skip",
                   max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES, base_dir=None, data_format: str = "auto",
                   num_workers: int = 0, prefetch: int | None = None) -> VLMData:
    """Read (a path, `"tiny_vlm"`, or rows in memory), tokenize through the chat template, stream with images
    and videos (the video settings are the processor's: `load_processor(..., video={"fps": ...})`).
    `num_workers` threads decode and process each micro batch's pixels, `prefetch` micro batches ahead
    (default 2 per worker; `SFTData`'s Workers); 0 = in `next`.

    Relative image and video paths resolve against the dataset file's directory (a `datasets` dir itself), or
    `base_dir` (default: the working directory) for rows in memory.
    """
    if isinstance(path_or_rows, (str, os.PathLike)):
        if str(path_or_rows) == "tiny_vlm":
            from qwenft.data.tiny_vlm import tiny_vlm_data_dir

            path_or_rows = tiny_vlm_data_dir() / "train.jsonl"
        path = Path(path_or_rows)
        rows = load_rows(path)
        base_dir = Path(base_dir) if base_dir is not None else (path if path.is_dir() else path.parent)
    else:
        rows, base_dir, path = path_or_rows, Path(base_dir or os.getcwd()), None
    if max_image_bytes < 1:
        raise ValueError(f"data.image.max_image_bytes={max_image_bytes} must be >= 1")
    data_format, _ = resolve_format(rows, data_format)
    docs, skipped = tokenize_vlm_rows(rows, processor, seq_len, base_dir, train_on, truncation, on_bad_row,
                                      max_image_bytes, data_format)
    pad_id = processor.tokenizer.pad_token_id
    if pad_id is None:
        raise ValueError("the tokenizer has no pad token; set one (Qwen's is <|endoftext|>)")
    data = VLMData(docs, processor, seq_len, micro_batch_size, pad_id, dp_rank, dp_size, seed, packing, skipped,
                   num_workers, prefetch)
    data.format = data_format
    if path is not None:
        data.fingerprint = fingerprint(path)  # the rows' files; the images and videos they name are not
    return data
