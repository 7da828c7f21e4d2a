"""Image+text chat rows -> documents with expanded image placeholders -> packed micro batches with pixels.

API (what the runner uses for a model with a vision tower):

    processor = load_processor(cfg.data.tokenizer or cfg.model.path or "tiny_vlm",
                               min_pixels=..., max_pixels=...)          # -> VLMProcessor
    data = build_vlm_data(path, processor, seq_len, micro_batch_size, dp_rank, dp_size, seed, packing,
                          train_on, truncation, on_bad_row, max_image_bytes=..., data_format="auto")   # -> VLMData
    batch = next(data)   # input_ids, labels [B, T]; position_ids [3, B, T] (M-RoPE, per document);
                         # cu_seqlens; padding_mask [B, T]; pixel_values [n_patches, C*t*p*p] float32;
                         # image_grid_thw [n_images, 3]

A row's `messages[i].content` is a string or a list of parts: `{"type": "text", "text": ...}`,
`{"type": "image", "image": SRC}` (or OpenAI's `{"type": "image_url", "image_url": {"url": SRC}}`), where
SRC is a path (relative to the dataset file, or absolute), a `data:image/...;base64,` URI, raw bytes, a
`{"bytes", "path"}` dict (a `datasets` Image column read back as rows) or a PIL image. An image part with
no SRC takes the next entry of the row's `images` column (TRL's layout).

Rendering uses the checkpoint's own chat template (which turns an image part into
`<|vision_start|><|image_pad|><|vision_end|>`), labels come from `chat.tokenize_messages` (assistant
replies only, found on the rendered text), then each `<|image_pad|>` token is repeated
`t*h*w / merge**2` times for its image's grid, as transformers' Qwen3-VL processor does to the text
before tokenizing (a special token is one token, so both give the same ids: tested). Image tokens are
never targets. The grid comes from the image's size alone (Qwen's `smart_resize` within min/max pixels),
so at start-up every image is decoded once to check it and read its size; pixels are produced per micro
batch by the checkpoint's image processor, in the order the image tokens appear in the batch.
"""

import base64
import binascii
import io
import math
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from PIL import Image

from qwenft.constants import IGNORE_INDEX
from qwenft.data.chat import (ON_BAD_ROW, ROLES, TRAIN_ON, TRUNCATION, BadRow, Document,
                              UnreadableRow, check_choice, parse_rows, shift_labels, tokenize_messages)
from qwenft.data.formats import as_messages_row, resolve_format
from qwenft.data.loader import SFTData, fingerprint, load_rows
from qwenft.data.packing import build_row, cu_seqlens_from_position_ids, padding_mask
from qwenft.mrope import document_mrope_position_ids

DEFAULT_MAX_IMAGE_BYTES = 32 * 1024 * 1024
IMAGE_PART_TYPES = ("image", "image_url")


@dataclass
class VLMProcessor:
    """The checkpoint's tokenizer (with its chat template) and image processor, plus the numbers the data
    pipeline needs from them. `min_pixels` / `max_pixels` bound the resized image area."""
    tokenizer: object
    image_processor: object
    min_pixels: int
    max_pixels: int
    image_token: str = "<|image_pad|>"

    def __post_init__(self):
        ip = self.image_processor
        self.patch_size, self.merge_size = ip.patch_size, ip.merge_size
        self.temporal_patch_size = ip.temporal_patch_size
        self.image_token_id = self.tokenizer.convert_tokens_to_ids(self.image_token)
        self.vision_start_token_id = self.tokenizer.convert_tokens_to_ids("<|vision_start|>")
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


def load_processor(path_or_name: str, min_pixels: int | None = None, max_pixels: int | None = None,
                   cache_dir=None) -> VLMProcessor:
    """`"tiny_vlm"` -> the generated tiny processor; a dir -> its tokenizer, chat template, image processor.

    Loads the tokenizer and image processor separately (not `AutoProcessor`): transformers' Qwen3-VL
    processor class also builds a video processor, which needs torchvision; images need only these two.
    `min_pixels` / `max_pixels` (None = the checkpoint's `size.shortest_edge` / `size.longest_edge`).
    """
    from transformers import AutoImageProcessor, AutoTokenizer

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
    return VLMProcessor(tokenizer, image_processor,
                        min_pixels if min_pixels is not None else size["shortest_edge"],
                        max_pixels if max_pixels is not None else size["longest_edge"])


# ---------------------------------------------------------------- rows -> messages + image sources

@dataclass
class ImageSource:
    """Where an image's bytes are: a file path, encoded bytes, or a PIL image already in memory."""
    path: str | None = None
    data: bytes | None = None
    image: Image.Image | None = None

    def open(self) -> Image.Image:
        """The decoded RGB image (raises BadRow `image_undecodable` / `image_too_large`)."""
        try:
            if self.image is not None:
                image = self.image
            else:
                image = Image.open(self.path if self.path is not None else io.BytesIO(self.data))
            image.load()
            return image.convert("RGB")
        except Image.DecompressionBombError as e:
            raise BadRow("image_too_large", f"image {self.describe()} is too large to decode ({e})") from None
        except (OSError, ValueError, SyntaxError) as e:
            raise BadRow("image_undecodable", f"image {self.describe()} cannot be decoded ({e})") from None

    def describe(self) -> str:
        if self.path is not None:
            return repr(self.path)
        return f"of {len(self.data)} bytes" if self.data is not None else "(PIL image)"


def image_source(value, base_dir: Path, max_image_bytes: int) -> ImageSource:
    """An image part's value -> ImageSource; missing files, bad URIs and over-size images are BadRows."""
    if isinstance(value, Image.Image):
        return ImageSource(image=value)
    if isinstance(value, dict):  # datasets' Image feature as a row: {"bytes": ..., "path": ...}
        value = value.get("bytes") or value.get("path")
    if isinstance(value, (bytes, bytearray)):
        data = bytes(value)
    elif isinstance(value, str) and value.startswith("data:"):
        header, _, payload = value.partition(",")
        if not header.endswith(";base64"):
            raise BadRow("image_source", f"image data URI {value[:40]!r}... is not base64")
        if len(payload) * 3 // 4 > max_image_bytes:
            raise BadRow("image_too_large", f"image data URI holds over {max_image_bytes} bytes "
                                            "(data.image.max_image_bytes)")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise BadRow("image_undecodable", f"image data URI is not valid base64 ({e})") from None
    elif isinstance(value, str) and value:
        if "://" in value:
            raise BadRow("image_source", f"image {value!r} is a URL; qwenft reads local files and data URIs only")
        path = Path(value) if os.path.isabs(value) else base_dir / value
        try:
            size = path.stat().st_size
        except OSError:
            raise BadRow("image_missing", f"image file {str(path)!r} does not exist") from None
        if size > max_image_bytes:
            raise BadRow("image_too_large", f"image file {str(path)!r} has {size} bytes, over "
                                            f"data.image.max_image_bytes={max_image_bytes}")
        return ImageSource(path=str(path))
    else:
        raise BadRow("image_source", f"image part holds {type(value).__name__}; expected a path, a data URI, "
                                     "bytes or a PIL image")
    if len(data) > max_image_bytes:
        raise BadRow("image_too_large", f"image of {len(data)} bytes is over "
                                        f"data.image.max_image_bytes={max_image_bytes}")
    return ImageSource(data=data)


def parse_row(row, base_dir: Path, max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES) -> tuple[list[dict], list[ImageSource]]:
    """Messages for the chat template (assistant content as a string; a turn with images as a list of
    `{"type": "text"|"image"}` parts) and the images' sources in reading order; or BadRow."""
    if isinstance(row, UnreadableRow):
        raise BadRow("unreadable", row.problem)
    if not isinstance(row, dict) or not isinstance(row.get("messages"), list) or not row["messages"]:
        raise BadRow("no_messages", "row has no non-empty 'messages' list")
    if row.get("tools"):
        raise BadRow("bad_tool_call", "row has a 'tools' column; the image pipeline trains text and image turns only")
    column = row.get("images") or []
    column = column if isinstance(column, list) else [column]
    messages, sources, from_column = [], [], 0
    for i, message in enumerate(row["messages"]):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ROLES:
            raise BadRow("bad_role", f"message {i} has role {role!r}; expected one of {', '.join(ROLES)}")
        if message.get("tool_calls"):
            raise BadRow("bad_tool_call", f"message {i} has tool_calls; the image pipeline trains text and image "
                                          "turns only")
        content = message.get("content")
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(parts, list):
            raise BadRow("bad_content", f"message {i} content is {type(content).__name__}; expected a string "
                                        "or a list of text/image parts")
        rendered, text, n_images = [], "", 0
        for part in parts:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                rendered.append({"type": "text", "text": part["text"]})
                text += part["text"]
            elif kind in IMAGE_PART_TYPES:
                value = part.get("image") if kind == "image" else part.get("image_url")
                value = value.get("url") if kind == "image_url" and isinstance(value, dict) else value
                if value is None:
                    if from_column >= len(column):
                        raise BadRow("image_count", f"message {i} has more image parts than the row's "
                                                    f"'images' column has images ({len(column)})")
                    value, from_column = column[from_column], from_column + 1
                sources.append(image_source(value, base_dir, max_image_bytes))
                rendered.append({"type": "image"})
                n_images += 1
            else:
                raise BadRow("bad_content", f"message {i} has a content part {str(part)[:60]!r}; expected "
                                            "{'type': 'text', 'text': str} or {'type': 'image', 'image': ...}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise BadRow("undecodable", f"message {i} content is not valid text ({e.reason})") from None
        if not text.strip() and not n_images:
            raise BadRow("empty_content", f"message {i} ({role}) has empty content")
        if role == "assistant" and n_images:
            raise BadRow("bad_content", f"message {i} is an assistant turn with an image; images belong in "
                                        "user or system turns")
        messages.append({"role": role, "content": rendered if n_images else text})
    if from_column < len(column):
        raise BadRow("image_count", f"the row's 'images' column has {len(column)} images but its messages "
                                    f"have {from_column} image parts without a source")
    if not any(m["role"] == "assistant" for m in messages):
        raise BadRow("no_assistant", "conversation has no assistant turn to learn from")
    return messages, sources


# ---------------------------------------------------------------- messages -> documents

@dataclass
class VLMDocument(Document):
    images: list[ImageSource] = field(default_factory=list)
    grids: list[tuple[int, int, int]] = field(default_factory=list)  # one (t, h, w) per image, in order


def expand_image_tokens(ids: list[int], is_target: list[bool], grids: list[tuple[int, int, int]],
                        processor: VLMProcessor) -> tuple[list[int], list[bool]]:
    """Repeat each image placeholder token t*h*w/merge**2 times (never a target)."""
    found = ids.count(processor.image_token_id)
    if found != len(grids):
        raise BadRow("image_count", f"the row has {len(grids)} image(s) but the chat template rendered {found} "
                                    f"{processor.image_token} placeholder(s)")
    out_ids, out_target, k = [], [], 0
    for token, target in zip(ids, is_target):
        if token == processor.image_token_id:
            t, h, w = grids[k]
            n = t * h * w // processor.merge_size ** 2
            out_ids += [token] * n
            out_target += [False] * n
            k += 1
        else:
            out_ids.append(token)
            out_target.append(target)
    return out_ids, out_target


def truncate_at(ids: list[int], grids: list[tuple[int, int, int]], seq_len: int,
                processor: VLMProcessor) -> tuple[int, int]:
    """(cut, images kept) for right truncation to `seq_len` that never splits an image: an image whose
    placeholders do not all fit is dropped together with its vision-start token."""
    t = 0
    for kept, (gt, gh, gw) in enumerate(grids):
        t = ids.index(processor.image_token_id, t)
        end = t + gt * gh * gw // processor.merge_size ** 2
        if end > seq_len:
            start = t - 1 if t and ids[t - 1] == processor.vision_start_token_id else t
            return min(seq_len, start), kept
        t = end
    return seq_len, len(grids)


def tokenize_vlm_row(row, processor: VLMProcessor, base_dir: Path, train_on: str, max_image_bytes: int):
    """(ids, is_target, images, grids) of one row, image placeholders expanded; or BadRow."""
    messages, sources = parse_row(row, base_dir, max_image_bytes)
    grids = []
    for source in sources:
        image = source.open()
        grids.append(processor.grid(image.height, image.width))
    ids, is_target = tokenize_messages(processor.tokenizer, messages, train_on)
    ids, is_target = expand_image_tokens(ids, is_target, grids, processor)
    return ids, is_target, sources, grids


def tokenize_vlm_rows(rows, processor: VLMProcessor, seq_len: int, base_dir: Path, train_on: str = "assistant",
                      truncation: str = "truncate_right", on_bad_row: str = "skip",
                      max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
                      data_format: str = "messages") -> tuple[list[VLMDocument], Counter]:
    """Documents for every usable row and the skip counts, as `chat.tokenize_rows`; extra reasons:
    `image_missing`, `image_undecodable`, `image_too_large`, `image_source`, `image_count`."""
    check_choice("data.train_on", train_on, TRAIN_ON)
    check_choice("data.truncation", truncation, TRUNCATION)
    check_choice("data.on_bad_row", on_bad_row, ON_BAD_ROW)
    docs, skipped = [], Counter()

    def tokenize(row):
        return tokenize_vlm_row(as_messages_row(row, data_format), processor, base_dir, train_on, max_image_bytes)

    for ids, is_target, images, grids in parse_rows(rows, tokenize, on_bad_row, skipped):
        if len(ids) > seq_len:
            if truncation == "drop":
                skipped["too_long"] += 1
                continue
            cut, kept = truncate_at(ids, grids, seq_len, processor)
            ids, is_target, images, grids = ids[:cut], is_target[:cut], images[:kept], grids[:kept]
        labels = shift_labels(ids, is_target)
        if all(label == IGNORE_INDEX for label in labels):
            skipped["no_target_left"] += 1
            continue
        docs.append(VLMDocument(ids, labels, images, grids))
    return docs, skipped


# ---------------------------------------------------------------- documents -> micro batches

class VLMData(SFTData):
    """`SFTData` (same rows, sharding, epochs, state) whose micro batches also carry the images.

    Per micro batch: `position_ids [3, B, T]` (M-RoPE, computed per document here, so pipeline stages after
    the first never need `input_ids`; `position_ids[0]` restarts at 0 exactly at document starts, so
    `cu_seqlens == cu_seqlens_from_position_ids(position_ids[0])`), `pixel_values [n_patches, patch_dim]`
    and `image_grid_thw [n_images, 3]`, images in the order their tokens appear in the flattened `B*T`
    (row by row, document by document). A micro batch without images has 0-row `pixel_values` and
    `image_grid_thw`; pass `pixel_values=None` to the model then (the vision tower rejects zero images).
    """

    def __init__(self, docs: list[VLMDocument], processor: VLMProcessor, *args, **kwargs):
        super().__init__(docs, *args, **kwargs)
        self.processor = processor

    def _row_tokens(self, doc_ids: list[int]):
        docs = [self.docs[d] for d in doc_ids]
        input_ids, labels, _, padding = build_row(docs, self.seq_len, self.pad_id)
        positions = [document_positions(doc, self.processor) for doc in docs]
        tail = self.seq_len - sum(p.shape[1] for p in positions)
        positions.append(torch.arange(tail).expand(3, tail))
        return (input_ids, labels, torch.cat(positions, dim=1),
                [image for doc in docs for image in doc.images], [g for doc in docs for g in doc.grids], padding)

    def _collate(self, rows) -> dict[str, torch.Tensor]:
        input_ids, labels, positions, images, grids, padding = zip(*rows)
        position_ids = torch.stack(positions, dim=1)
        grids = [g for row in grids for g in row]
        pixel_values, image_grid_thw = self.processor.pixels([s.open() for row in images for s in row])
        if image_grid_thw.tolist() != [list(g) for g in grids]:  # the image processor resized differently
            raise ValueError(f"image processor grids {image_grid_thw.tolist()} differ from the grids the "
                             f"data pipeline expected {grids}; its resize rule is not Qwen's smart_resize")
        return {"input_ids": torch.tensor(input_ids), "labels": torch.tensor(labels),
                "position_ids": position_ids, "cu_seqlens": cu_seqlens_from_position_ids(position_ids[0]),
                "padding_mask": padding_mask(list(padding), self.seq_len),
                "pixel_values": pixel_values, "image_grid_thw": image_grid_thw}


def document_positions(doc: VLMDocument, processor: VLMProcessor) -> torch.Tensor:
    """M-RoPE positions `[3, len(doc)]` of one document, from 0 (transformers' get_rope_index rule)."""
    grids = torch.tensor(doc.grids, dtype=torch.long).reshape(-1, 3)
    positions, used, _ = document_mrope_position_ids(torch.tensor(doc.input_ids), grids, processor.image_token_id,
                                                     processor.merge_size)
    assert used == len(doc.grids), (used, doc.grids)
    return positions


def split_microbatches(batch: dict, num_microbatches: int, image_token_id: int, merge_size: int) -> list[dict]:
    """Split a micro batch (or several concatenated along rows) into `num_microbatches` equal row slices,
    each with exactly its rows' images: `pixel_values` / `image_grid_thw` rows follow the image tokens."""
    rows = batch["input_ids"].shape[0]
    if rows % num_microbatches:
        raise ValueError(f"{rows} rows do not split into {num_microbatches} equal microbatches")
    size = rows // num_microbatches
    grid = batch["image_grid_thw"]
    tokens_per_image = (grid.prod(-1) // merge_size ** 2).tolist()
    patches_per_image = grid.prod(-1).tolist()
    out, image, patch = [], 0, 0
    for m in range(num_microbatches):
        lo, hi = m * size, (m + 1) * size
        tokens = int((batch["input_ids"][lo:hi] == image_token_id).sum())
        first_image, first_patch = image, patch
        while tokens > 0 and image < len(tokens_per_image):
            tokens -= tokens_per_image[image]
            patch += patches_per_image[image]
            image += 1
        if tokens != 0:
            raise ValueError(f"microbatch {m}: image tokens do not line up with image_grid_thw")
        position_ids = batch["position_ids"][..., lo:hi, :]
        positions = position_ids[0] if position_ids.dim() == 3 else position_ids
        out.append({"input_ids": batch["input_ids"][lo:hi], "labels": batch["labels"][lo:hi],
                    "position_ids": position_ids, "cu_seqlens": cu_seqlens_from_position_ids(positions),
                    **({"padding_mask": batch["padding_mask"][lo:hi]} if "padding_mask" in batch else {}),
                    "pixel_values": batch["pixel_values"][first_patch:patch],
                    "image_grid_thw": grid[first_image:image]})
    return out


def build_vlm_data(path_or_rows, processor: VLMProcessor, seq_len: int, micro_batch_size: int, dp_rank: int = 0,
                   dp_size: int = 1, seed: int = 0, packing: str = "pack", train_on: str = "assistant",
                   truncation: str = "truncate_right", on_bad_row: str = "skip",
                   max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES, base_dir=None, data_format: str = "auto") -> VLMData:
    """Read (a path, `"tiny_vlm"`, or rows in memory), tokenize through the chat template, stream with images.

    Relative image paths resolve against the dataset file's directory (a `datasets` dir itself), or
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
    data = VLMData(docs, processor, seq_len, micro_batch_size, pad_id, dp_rank, dp_size, seed, packing, skipped)
    data.format = data_format
    if path is not None:
        data.fingerprint = fingerprint(path)  # the rows' files; the images they name are not fingerprinted
    return data
