"""The embedded VLM default: a generated picture-question set and a small Qwen-style processor for it.

Both are built at first use (well under a second) and cached like the tiny tokenizer, under a directory
named by a hash of everything that determines them, so `recipe=tiny_vlm` needs no download:

    tiny_vlm_data_dir()        # .../tiny_vlm-data-<hash>/{train.jsonl, val.jsonl, images/*.png, frames/*/*.png}
    tiny_vlm_processor_dir()   # .../tiny_vlm-processor-<hash>/ tokenizer + image processor + template

The pictures are coloured circles, squares and triangles on a light background, of varied sizes (48..96
px a side); the questions ask for the shape, its colour, how many shapes there are, or whether two
pictures show the same shape. The rules are simple enough that a tiny random-init VLM's loss falls within
~100 steps on a CPU. Generation is deterministic (fixed seed, no hash-order dependence). Most rows point at
their image by a path relative to the JSONL file; every 8th embeds it as a base64 data URI, so both
reader paths are exercised.

Every other row is a video instead: 4 frames of 64x64 px (`frames/<n>/<i>.png`, a frame-list video at 2 fps)
with a question its first frame cannot answer. "Which way does the <shape> move?": one black shape starts at
the centre (within 2 px) and steps 8 px a frame left, right, up or down ("It moves left."). "Which colour appears
first?": the first frame is empty, one shape appears in the second, a second shape of another colour in the
third ("The red one."). So a model that sees only the first frame is at chance (ln 4, ln 6 nats an answer);
one that sees the frames in order is not (`tests/test_tiny_vlm_video.py`).
"""

import base64
import hashlib
import io
import json
import os
import random
from pathlib import Path

from PIL import Image, ImageDraw

from qwenft.data.tiny_tokenizer import SPECIAL_TOKENS, cached_dir, train_tiny_tokenizer

VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
# ids 0..6: <|endoftext|>, <|im_start|>, <|im_end|>, then these (named_config("tiny_vlm") relies on it)
VLM_SPECIAL_TOKENS = SPECIAL_TOKENS + [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]

# Qwen3-VL's rendering of content parts, without tools/thinking: an image part is
# <|vision_start|><|image_pad|><|vision_end|>, a video part the same with <|video_pad|> (the processor expands
# it into timestamps and frames), text parts are concatenated.
TINY_VLM_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' or 'image' in part %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'video' or 'video' in part %}{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# patch 16, merge 2: images resize to multiples of 32 px, 64x64 .. 96x96 -> 4 .. 9 image tokens each.
IMAGE_PROCESSOR = {"patch_size": 16, "merge_size": 2, "temporal_patch_size": 2,
                   "min_pixels": 64 * 64, "max_pixels": 96 * 96}
# Qwen3-VL's video processor, small: a video's frames together within 4,096 .. 16 x 64 x 64 pixels (at most
# 32 video tokens), sampled at 2 frames a second, 4 .. 16 frames; the image processor's mean and std.
VIDEO_PROCESSOR = {"patch_size": 16, "merge_size": 2, "temporal_patch_size": 2, "fps": 2, "min_frames": 4,
                   "max_frames": 16, "size": {"shortest_edge": 64 * 64, "longest_edge": 16 * 64 * 64},
                   "image_mean": [0.48145466, 0.4578275, 0.40821073],
                   "image_std": [0.26862954, 0.26130258, 0.27577711]}
_VERSION = "2"  # bump when the data or processor recipe changes, to invalidate old caches
DEFAULT_CACHE_DIR = Path("~/.cache/qwenft")

SHAPES = ["circle", "square", "triangle"]
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (230, 200, 30),
           "purple": (140, 60, 170), "black": (20, 20, 20)}
NUMBER_WORDS = ["zero", "one", "two", "three"]
SYSTEM_PROMPT = "You look at pictures and answer briefly."


def _draw(rng: random.Random, shapes: list[tuple[str, str]]) -> Image.Image:
    width, height = rng.choice([48, 64, 80, 96]), rng.choice([48, 64, 80, 96])
    image = Image.new("RGB", (width, height), BACKGROUND)
    draw = ImageDraw.Draw(image)
    for shape, colour in shapes:
        size = rng.randint(min(width, height) // 3, min(width, height) * 2 // 3) // max(1, len(shapes) - 1)
        size = max(size, 10)
        x, y = rng.randint(0, width - size), rng.randint(0, height - size)
        _draw_at(draw, shape, colour, x, y, size)
    return image


def _question(rng: random.Random) -> tuple[list[list[tuple[str, str]]], str, str]:
    """(shapes per picture, question, answer)."""
    kind = rng.choice(["shape", "colour", "count", "same"])
    shape, colour = rng.choice(SHAPES), rng.choice(sorted(COLOURS))
    if kind == "shape":
        return [[(shape, colour)]], "What shape is in the picture?", f"A {colour} {shape}."
    if kind == "colour":
        return [[(shape, colour)]], f"What colour is the {shape}?", f"The {shape} is {colour}."
    if kind == "count":
        n = rng.randint(1, 3)
        word = NUMBER_WORDS[n]
        return ([[(shape, colour)] * n], "How many shapes are in the picture?",
                f"There {'is' if n == 1 else 'are'} {word} {shape}{'' if n == 1 else 's'}.")
    other = rng.choice(SHAPES) if rng.random() < 0.5 else shape
    answer = f"Yes, both are {shape}s." if other == shape else f"No, one is a {shape} and one is a {other}."
    return ([[(shape, colour)], [(other, rng.choice(sorted(COLOURS)))]],
            "Do the two pictures show the same shape?", answer)


VIDEO_EVERY = 2  # every other row is a video
DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
VIDEO_FRAMES, VIDEO_SIDE, VIDEO_STEP, VIDEO_SHAPE = 4, 64, 8, 24  # frames, px a side, px a frame, shape side
BACKGROUND = (235, 235, 225)
# the video processor's mean colour: a background that normalizes to zero, so a frame's features are its shapes
VIDEO_BACKGROUND = (123, 117, 104)
VIDEO_COLOURS = sorted(COLOURS)
# The moving shape is always black: on the zero background every channel of it is negative, so where it is shows
# in the patch embedding linearly. The six colours normalize to both signs: where a shape of any of them is is
# not linear in the pixels, and the tiny tower learns the direction far more slowly (docs/data.md).
MOVING_COLOUR = "black"


def _draw_at(draw: ImageDraw.ImageDraw, shape: str, colour: str, x: int, y: int, size: int) -> None:
    box, fill = (x, y, x + size, y + size), COLOURS[colour]
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([(x + size // 2, y), (x, y + size), (x + size, y + size)], fill=fill)


def _video(rng: random.Random) -> tuple[list[Image.Image], str, str]:
    """(frames, question, answer) of one generated video (module docstring)."""
    frames = [Image.new("RGB", (VIDEO_SIDE, VIDEO_SIDE), VIDEO_BACKGROUND) for _ in range(VIDEO_FRAMES)]
    draws = [ImageDraw.Draw(f) for f in frames]
    shape = rng.choice(SHAPES)
    if rng.random() < 0.5:
        direction = rng.choice(sorted(DIRECTIONS))
        (dx, dy), centre = DIRECTIONS[direction], (VIDEO_SIDE - VIDEO_SHAPE) // 2
        x, y = centre + rng.randint(-2, 2), centre + rng.randint(-2, 2)
        for i, draw in enumerate(draws):
            _draw_at(draw, shape, MOVING_COLOUR, x + dx * VIDEO_STEP * i, y + dy * VIDEO_STEP * i, VIDEO_SHAPE)
        return frames, f"Which way does the {shape} move?", f"It moves {direction}."
    first, second = rng.sample(VIDEO_COLOURS, 2)
    half = VIDEO_SIDE // 2
    spots = rng.sample([(qx, qy) for qx in (0, half) for qy in (0, half)], 2)  # two quadrants
    for colour, (qx, qy), start in ((first, spots[0], 1), (second, spots[1], 2)):
        x, y = qx + rng.randint(0, half - VIDEO_SHAPE), qy + rng.randint(0, half - VIDEO_SHAPE)  # inside it
        for draw in draws[start:]:
            _draw_at(draw, shape, colour, x, y, VIDEO_SHAPE)
    return frames, "Which colour appears first?", f"The {first} one."


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG", optimize=True)
    return buf.getvalue()


def generate(out: Path, train_rows: int = 480, val_rows: int = 96, seed: int = 0) -> None:
    """Write `train.jsonl`, `val.jsonl`, `images/` and `frames/` into `out` (deterministic); every other row
    a video."""
    rng, video_rng = random.Random(seed), random.Random(seed + 1)
    (out / "images").mkdir(parents=True, exist_ok=True)
    n_images = n_videos = 0
    for name, count in (("train.jsonl", train_rows), ("val.jsonl", val_rows)):
        lines = []
        for i in range(count):
            if i % VIDEO_EVERY == VIDEO_EVERY - 1:
                frames, question, answer = _video(video_rng)
                (out / "frames" / str(n_videos)).mkdir(parents=True)
                paths = [f"frames/{n_videos}/{k}.png" for k in range(len(frames))]
                for path, frame in zip(paths, frames):
                    (out / path).write_bytes(_png(frame))
                n_videos += 1
                user = [{"type": "video", "video": paths, "fps": 2}, {"type": "text", "text": question}]
                lines.append(json.dumps({"messages": [{"role": "user", "content": user},
                                                      {"role": "assistant", "content": answer}]}))
                continue
            pictures, question, answer = _question(rng)
            parts = []
            for shapes in pictures:
                png = _png(_draw(rng, shapes))
                if n_images % 8 == 7:
                    source = "data:image/png;base64," + base64.b64encode(png).decode()
                else:
                    source = f"images/{n_images:05d}.png"
                    (out / source).write_bytes(png)
                parts.append({"type": "image", "image": source})
                n_images += 1
            user = parts + [{"type": "text", "text": question}] if rng.random() < 0.8 else \
                [{"type": "text", "text": question + "\n"}] + parts
            messages = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
            if rng.random() < 0.25:
                messages.insert(0, {"role": "system", "content": SYSTEM_PROMPT})
            lines.append(json.dumps({"messages": messages}))
        (out / name).write_text("\n".join(lines) + "\n")


def _digest(*parts) -> str:
    return hashlib.sha256(json.dumps([_VERSION, *parts], sort_keys=True).encode()).hexdigest()[:16]


def _root(cache_dir) -> Path:
    return Path(cache_dir or DEFAULT_CACHE_DIR).expanduser()


def tiny_vlm_data_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """The generated set's directory (built on first use): `train.jsonl`, `val.jsonl`, `images/`, `frames/`."""
    source = Path(__file__).read_bytes()  # the generator itself determines the data
    out = _root(cache_dir) / f"tiny_vlm-data-{_digest(hashlib.sha256(source).hexdigest())}"
    return cached_dir(out, generate)


def _text_rows(path: Path) -> list[dict]:
    """The set's rows with image and video parts dropped: what the tiny BPE is trained on."""
    rows = []
    for line in path.read_text().splitlines():
        messages = json.loads(line)["messages"]
        for m in messages:
            if not isinstance(m["content"], str):
                m["content"] = "".join(p["text"] for p in m["content"] if p["type"] == "text")
        rows.append({"messages": messages})
    return rows


def tiny_vlm_processor_dir(cache_dir: str | os.PathLike | None = None, vocab_size: int = 512) -> Path:
    """A processor dir for the tiny VLM (built on first use): a byte-level BPE trained on the set's text
    with Qwen's vision special tokens (ids 3..6), the template above, transformers' Qwen2-VL image
    processor and Qwen3-VL video processor configured small. `AutoTokenizer`, `AutoImageProcessor` and
    `Qwen3VLVideoProcessor` reload it (so does `AutoProcessor` where torchvision is installed: transformers'
    Qwen3-VL processor class requires it)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    data = tiny_vlm_data_dir(cache_dir)
    train = data / "train.jsonl"
    key = _digest(hashlib.sha256(train.read_bytes()).hexdigest(), vocab_size, VLM_SPECIAL_TOKENS,
                  TINY_VLM_CHAT_TEMPLATE, IMAGE_PROCESSOR, VIDEO_PROCESSOR)

    def write(tmp: Path) -> None:
        tok = train_tiny_tokenizer(_text_rows(train), vocab_size, VLM_SPECIAL_TOKENS, TINY_VLM_CHAT_TEMPLATE)
        tok.save_pretrained(tmp)
        Qwen2VLImageProcessorPil(**IMAGE_PROCESSOR).save_pretrained(tmp)
        Qwen3VLVideoProcessor(**VIDEO_PROCESSOR).save_pretrained(tmp)  # its config only: running it needs torchvision
        (tmp / "chat_template.jinja").write_text(TINY_VLM_CHAT_TEMPLATE)
        (tmp / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen3VLProcessor"}) + "\n")

    return cached_dir(_root(cache_dir) / f"tiny_vlm-processor-{key}", write)


if __name__ == "__main__":
    print(tiny_vlm_data_dir())
    print(tiny_vlm_processor_dir())
