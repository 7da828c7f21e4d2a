"""Multimodal SFT data: parts parsing, equality with transformers' Qwen3-VL processor, label masking, packing
with images (logits per document against the native VLM run on each document alone), bad images, freezing
and vision activation checkpointing, and a short training run on the generated tiny_vlm set. CPU, fp32."""

import base64
import dataclasses
import functools
import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from qwenft.constants import IGNORE_INDEX
from qwenft.data.loader import load_rows
from qwenft.data.vlm import (VLMProcessor, build_vlm_data, load_processor, parse_row,
                             split_microbatches, tokenize_vlm_row, tokenize_vlm_rows)
from qwenft.models.freeze import freeze
from qwenft.models.loader import build_model, init_random_weights
from qwenft.models.qwen3_5.configs import named_config
from qwenft.train.evaluate import forward_batch


def picture(height, width, seed=0) -> Image.Image:
    return Image.fromarray(np.random.RandomState(seed).randint(0, 255, (height, width, 3), dtype=np.uint8))


def png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("qwenft_cache")


@pytest.fixture(scope="module")
def proc(cache) -> VLMProcessor:
    return load_processor("tiny_vlm", cache_dir=cache)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A dataset dir with pictures of varied sizes (below min_pixels, within, above max_pixels)."""
    root = tmp_path_factory.mktemp("vlm_data")
    (root / "img").mkdir()
    for name, (h, w) in {"small": (20, 30), "wide": (50, 170), "big": (200, 150), "mid": (64, 96),
                         "dot": (8, 8)}.items():
        picture(h, w, seed=h + w).save(root / "img" / f"{name}.png")
    (root / "img" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    return root


def conversation(*first_user_parts, reply="It is a picture."):
    return {"messages": [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": list(first_user_parts)},
        {"role": "assistant", "content": reply},
        {"role": "user", "content": [{"type": "text", "text": "And this one?"},
                                     {"type": "image", "image": "img/dot.png"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Also a picture."}]},
    ]}


def text(s):
    return {"type": "text", "text": s}


def image(src):
    return {"type": "image", "image": src}


def hf_processor(proc, min_pixels, max_pixels):
    """transformers' own Qwen3-VL processor class (what AutoProcessor gives for Qwen3.5) over a freshly built
    Qwen2-VL image processor. Images only: the class insists on a video processor, which needs torchvision
    (absent here), so this subclass drops that one constructor argument; the processing is transformers'."""
    from transformers import Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    class ImageOnlyQwen3VLProcessor(Qwen3VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    image_processor = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2,
                                               min_pixels=min_pixels, max_pixels=max_pixels)
    return ImageOnlyQwen3VLProcessor(image_processor, proc.tokenizer, chat_template=proc.tokenizer.chat_template)


def test_parts_parsing_reads_every_image_source(files):
    data_uri = "data:image/png;base64," + base64.b64encode((files / "img/small.png").read_bytes()).decode()
    pil = picture(40, 40)
    row = {"messages": [
        {"role": "user", "content": [image("img/wide.png"), text("A "), text("question?"),
                                     image(str(files / "img/big.png")), image(data_uri),
                                     {"type": "image_url", "image_url": {"url": "img/mid.png"}},
                                     {"type": "image", "image": {"bytes": png(pil), "path": None}},
                                     image(pil), {"type": "image"}]},
        {"role": "assistant", "content": [text("An "), text("answer.")]},
    ], "images": [pil]}
    messages, sources, videos = parse_row(row, files)
    assert videos == []
    assert messages[1] == {"role": "assistant", "content": "An answer."}
    assert [p["type"] for p in messages[0]["content"]] == ["image", "text", "text"] + ["image"] * 6
    assert sources[0].path == str(files / "img/wide.png") and sources[1].path == str(files / "img/big.png")
    assert sources[2].data == (files / "img/small.png").read_bytes()
    assert sources[3].path == str(files / "img/mid.png") and sources[4].data == png(pil)
    assert sources[5].image is pil and sources[6].image is pil
    assert [s.open().size for s in sources] == [(170, 50), (150, 200), (30, 20), (96, 64), (40, 40), (40, 40),
                                                (40, 40)]
    text_only, none, _ = parse_row({"messages": [{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": "hello"}]}, files)
    assert text_only[0]["content"] == "hi" and none == []


@pytest.mark.parametrize("min_pixels, max_pixels", [(None, None), (32 * 32, 32 * 32 * 6)])
def test_ids_and_pixels_equal_transformers_processor(proc, cache, files, min_pixels, max_pixels):
    mine = load_processor("tiny_vlm", min_pixels=min_pixels, max_pixels=max_pixels, cache_dir=cache)
    row = conversation(image("img/small.png"), text("What is in "), image("img/wide.png"), text("and here?"),
                       image("img/big.png"))
    ids, _, sources, grids, _, _ = tokenize_vlm_row(row, mine, files, "assistant", 1 << 20)
    pixel_values, grid = mine.pixels([s.open() for s in sources])

    hf = hf_processor(proc, mine.min_pixels, mine.max_pixels)
    messages = json.loads(json.dumps(row["messages"]))
    for m in messages:
        for part in m["content"] if isinstance(m["content"], list) else []:
            if part["type"] == "image":
                part["image"] = Image.open(files / part["image"])
    ref = hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt")
    assert ids == ref["input_ids"][0].tolist()
    assert torch.equal(grid, ref["image_grid_thw"]) and grid.tolist() == [list(g) for g in grids]
    assert torch.equal(pixel_values, ref["pixel_values"])
    if max_pixels:  # the override took effect: the big picture is capped at 6 merged 32x32 cells
        assert grids[2][1] * grids[2][2] <= 6 * 4 < 9 * 4


def test_labels_are_replies_only_never_image_tokens(proc, files):
    row = conversation(text("Look: "), image("img/wide.png"), reply="A noisy picture.")
    docs, skipped = tokenize_vlm_rows([row], proc, 512, files)
    (doc,) = docs
    labels = torch.tensor(doc.labels)
    assert not skipped
    assert proc.tokenizer.decode(labels[labels != IGNORE_INDEX]) == "A noisy picture.<|im_end|>Also a picture.<|im_end|>"
    for t, label in enumerate(doc.labels[:-1]):  # pre-shifted: the label is the next token
        assert label in (IGNORE_INDEX, doc.input_ids[t + 1])
    assert doc.labels[-1] == IGNORE_INDEX
    (all_doc,), _ = tokenize_vlm_rows([row], proc, 512, files, train_on="all")
    image_next = [t for t in range(len(all_doc.input_ids) - 1) if all_doc.input_ids[t + 1] == proc.image_token_id]
    assert image_next and all(all_doc.labels[t] == IGNORE_INDEX for t in image_next)
    assert sum(label != IGNORE_INDEX for label in all_doc.labels) == len(all_doc.input_ids) - 1 - len(image_next)


def test_reasoning_reaches_the_template_and_last_turn_learns_the_final_reply(proc, files):
    """An image row's final reply with reasoning_content: the tiny VLM template has no thinking branch, so the row is
    a `template` bad row rather than a reply trained without its reasoning; `last_turn` learns the final reply."""
    row = conversation(text("Look: "), image("img/wide.png"))
    row["messages"][-1]["reasoning_content"] = "Another dot."
    docs, skipped = tokenize_vlm_rows([row], proc, 512, files)
    assert not docs and skipped == {"template": 1} and "reasoning of assistant message 4" in skipped.describe()
    del row["messages"][-1]["reasoning_content"]
    (doc,), _ = tokenize_vlm_rows([row], proc, 512, files, train_on="last_turn")
    labels = torch.tensor(doc.labels)
    assert proc.tokenizer.decode(labels[labels != IGNORE_INDEX]) == "Also a picture.<|im_end|>"


def small_vlm(seed):
    """tiny_vlm cut to one GatedDeltaNet + one attention layer: the same code paths at half the CPU time."""
    cfg = named_config("tiny_vlm")
    cfg.text = dataclasses.replace(cfg.text, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    return init_random_weights(build_model(cfg, kernels="torch"), seed=seed, device="cpu")


@pytest.fixture(scope="module")
def model():
    return small_vlm(seed=0).eval()


def _rows(files):
    return [conversation(image("img/small.png"), text("What?")),
            {"messages": [{"role": "user", "content": "No picture here."}, {"role": "assistant", "content": "OK."}]},
            conversation(text("Two: "), image("img/wide.png"), image("img/big.png")),
            conversation(image("img/mid.png"), text("Hm?"), reply="Squares and dots."),
            conversation(text("Describe "), image("img/big.png"))]


@pytest.mark.parametrize("packing", ["pack", "pad"])
def test_packed_rows_equal_each_document_alone(proc, files, model, packing):
    """Each document's logits inside the micro batch (images, M-RoPE positions, cu_seqlens from the data
    pipeline) equal the model run on that document alone, with transformers' processor making its pixels."""
    data = build_vlm_data(_rows(files), proc, seq_len=160 if packing == "pack" else 96, micro_batch_size=2,
                          packing=packing, base_dir=files)
    assert data.num_documents == 5
    hf = hf_processor(proc, proc.min_pixels, proc.max_pixels)
    batch = next(data)
    assert batch["position_ids"].shape == (3, 2, batch["input_ids"].shape[1])
    B, T = batch["input_ids"].shape
    rows = data.epoch_rows(0)[:B]
    starts = []  # expected segment starts: each document, then the row's padding tail
    for r, row in enumerate(rows):
        offset = r * T
        for d in row:
            starts.append(offset)
            offset += len(data.docs[d].input_ids)
        if offset < (r + 1) * T:
            starts.append(offset)
    assert batch["cu_seqlens"].tolist() == starts + [B * T]
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                       cu_seqlens=batch["cu_seqlens"], pixel_values=batch["pixel_values"],
                       image_grid_thw=batch["image_grid_thw"]).flatten(0, 1)
        checked = 0
        for r, row in enumerate(rows):
            a = r * T
            for d in row:
                doc = data.docs[d]
                b = a + len(doc.input_ids)
                images = [s.open() for s in doc.images]
                kw = {}
                if images:
                    ref = hf.image_processor(images=images, return_tensors="pt")
                    kw = {"pixel_values": ref["pixel_values"], "image_grid_thw": ref["image_grid_thw"]}
                alone = model(input_ids=torch.tensor([doc.input_ids]), **kw)[0]  # the model computes positions
                torch.testing.assert_close(logits[a:b], alone, rtol=1e-5, atol=1e-5)
                checked, a = checked + 1, b
    assert checked >= (3 if packing == "pack" else 2)


def test_split_microbatches_gives_each_its_rows_images(proc, files, model):
    data = build_vlm_data(_rows(files) * 2, proc, seq_len=96, micro_batch_size=4, packing="pad", base_dir=files)
    batch = next(data)
    parts = split_microbatches(batch, 2, proc.image_token_id, proc.merge_size)
    assert torch.equal(torch.cat([p["pixel_values"] for p in parts]), batch["pixel_values"])
    assert torch.equal(torch.cat([p["image_grid_thw"] for p in parts]), batch["image_grid_thw"])
    with torch.no_grad():
        full = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], cu_seqlens=batch["cu_seqlens"],
                     pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"])
        for i, p in enumerate(parts):
            assert p["position_ids"].shape == (3, 2, 96)
            has_images = len(p["image_grid_thw"]) > 0
            out = model(input_ids=p["input_ids"], position_ids=p["position_ids"], cu_seqlens=p["cu_seqlens"],
                        pixel_values=p["pixel_values"] if has_images else None,
                        image_grid_thw=p["image_grid_thw"] if has_images else None)
            torch.testing.assert_close(out, full[2 * i:2 * i + 2], rtol=1e-5, atol=1e-5)


def test_truncation_never_splits_an_image(proc, files):
    row = conversation(text("Look at this long question " * 3), image("img/big.png"), text("?"))
    (whole,), _ = tokenize_vlm_rows([row], proc, 1024, files)
    start = whole.input_ids.index(proc.image_token_id)
    (cut,), _ = tokenize_vlm_rows([row], proc, start + 3, files, train_on="all")  # inside the first image
    assert cut.input_ids == whole.input_ids[:start - 1] and cut.images == [] and cut.grids == []
    docs, skipped = tokenize_vlm_rows([row], proc, start + 3, files, truncation="drop")
    assert docs == [] and skipped == {"too_long": 1}


BAD = [
    ("image_missing", [image("img/nope.png")], "does not exist"),
    ("image_undecodable", [image("img/broken.png")], "cannot be decoded"),
    ("image_too_large", [image("img/big.png")], "data.image.max_image_bytes=5000"),
    ("image_source", [image("https://example.com/a.png")], "is a URL"),
]


def test_bad_images_are_skipped_and_counted(proc, files):
    rows = [conversation(*parts) for _, parts, _ in BAD] + [conversation(image("img/small.png"))]
    rows.append({"messages": [{"role": "user", "content": [{"type": "image"}]},
                              {"role": "assistant", "content": "x"}]})  # no 'images' column to take it from
    docs, skipped = tokenize_vlm_rows(rows, proc, 512, files, max_image_bytes=5000)
    assert len(docs) == 1 and skipped == {reason: 1 for reason, _, _ in BAD} | {"image_count": 1}


def test_sharegpt_rows_read_as_their_messages(proc):
    """data.format applies to the image pipeline too (tests/test_data_formats.py has the formats); a tool call
    is text-only: a bad row here."""
    from test_data_formats import ALPACA, SHAREGPT, SHAREGPT_MESSAGES, TOOL_ROW

    data = build_vlm_data([SHAREGPT, ALPACA[0][0], TOOL_ROW], proc, seq_len=256, micro_batch_size=1)
    assert data.format == "sharegpt" and data.skipped == {"format": 1, "bad_tool_call": 1}
    reference = build_vlm_data([{"messages": SHAREGPT_MESSAGES}], proc, seq_len=256, micro_batch_size=1)
    assert data.docs == reference.docs and reference.format == "messages"


def test_image_placeholders_in_text_take_the_images_column(proc, files):
    """LLaMA-Factory's layout: each `<image>` in a turn's text takes the next entry of the row's `images` column,
    in sharegpt rows as in messages rows; the text pipeline counts such a row as `image_content`."""
    from qwenft.data.chat import tokenize_rows

    question = {"from": "human", "value": "<image>What is this? And <image>?"}
    sharegpt = {"conversations": [question, {"from": "gpt", "value": "Two shapes."}],
                "images": ["img/small.png", "img/wide.png"]}
    parts = {"messages": [{"role": "user", "content": [image("img/small.png"), text("What is this? And "),
                                                        image("img/wide.png"), text("?")]},
                          {"role": "assistant", "content": "Two shapes."}]}
    data = build_vlm_data([sharegpt], proc, seq_len=512, micro_batch_size=1, base_dir=files)
    reference = build_vlm_data([parts], proc, seq_len=512, micro_batch_size=1, base_dir=files)
    assert data.format == "sharegpt" and not data.skipped and data.num_documents == 1
    assert data.docs == reference.docs
    docs, skipped = tokenize_rows([sharegpt], proc.tokenizer, seq_len=512, data_format="sharegpt")
    assert not docs and skipped == {"image_content": 1} and "'images'" in skipped.describe()


def test_more_image_parts_than_placeholders(proc, files):
    """A template that drops image parts renders no placeholder: the row is bad, not silently misaligned."""
    tok = proc.tokenizer
    saved = tok.chat_template
    try:
        tok.chat_template = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' }}{%- if m.content is string %}"
                             "{{- m.content }}{%- else %}{%- for p in m.content %}{%- if p.type == 'text' %}{{- p.text }}"
                             "{%- endif %}{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}")
        docs, skipped = tokenize_vlm_rows([conversation(image("img/small.png"), text("?"))], proc, 512, files)
        assert docs == [] and skipped == {"image_count": 1}
        with pytest.raises(ValueError, match=r"^data row 0: the row has 2 image\(s\) but the chat template "
                                             r"rendered 0 <\|image_pad\|> placeholder"):
            tokenize_vlm_rows([conversation(image("img/small.png"))], proc, 512, files, on_bad_row="error")
    finally:
        tok.chat_template = saved


@pytest.mark.parametrize("reason, parts, message", BAD)
def test_bad_image_error_mode_names_the_row(proc, files, reason, parts, message):
    rows = [conversation(image("img/small.png")), conversation(*parts)]
    with pytest.raises(ValueError, match=rf"^data row 1: .*{message}.*data.on_bad_row=skip") as e:
        tokenize_vlm_rows(rows, proc, 512, files, on_bad_row="error", max_image_bytes=5000)
    assert "\n" not in str(e.value)


def test_readers_parquet_bytes_and_datasets_image_column(proc, files, tmp_path):
    import datasets

    pil = picture(60, 60, seed=3)
    user = [{"type": "image", "image": None, "text": None}, {"type": "text", "image": None, "text": "Hm?"}]
    rows = [{"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": [
        {"type": "text", "image": None, "text": "A square."}]}], "images": [pil]}]
    ds = datasets.Dataset.from_list(rows, features=datasets.Features({
        "messages": [{"role": datasets.Value("string"),
                      "content": [{"type": datasets.Value("string"), "image": datasets.Value("string"),
                                   "text": datasets.Value("string")}]}],
        "images": [datasets.Image()]}))
    ds.save_to_disk(tmp_path / "ds")
    ds.to_parquet(tmp_path / "rows.parquet")
    for path in (tmp_path / "ds", tmp_path / "rows.parquet"):
        docs, skipped = tokenize_vlm_rows(load_rows(path), proc, 512, tmp_path)
        assert not skipped and len(docs) == 1
        assert docs[0].grids == [proc.grid(60, 60)] and docs[0].images[0].open().tobytes() == pil.tobytes()


def test_resume_gives_the_same_batches_with_pixels(proc, files):
    data = build_vlm_data(_rows(files), proc, seq_len=160, micro_batch_size=1, base_dir=files)
    next(data)
    state = data.state_dict()
    expected = next(data)
    again = build_vlm_data(_rows(files), proc, seq_len=160, micro_batch_size=1, base_dir=files)
    again.load_state_dict(state)
    got = next(again)
    assert set(got) == set(expected)
    assert all(torch.equal(got[k], expected[k]) for k in got)


def _step(model, batch, lr=1e-2, weight_decay=0.1):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=weight_decay)
    logits = forward_batch(model, batch)  # the tiny_vlm set's images and videos
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()).backward()
    opt.step()


@pytest.fixture(scope="module")
def tiny_batch(proc, cache):
    from qwenft.data.tiny_vlm import tiny_vlm_data_dir

    return next(build_vlm_data(tiny_vlm_data_dir(cache) / "train.jsonl", proc, seq_len=128, micro_batch_size=2))


@pytest.mark.parametrize("vision, language, projector", [(True, False, False), (False, True, None)])
def test_frozen_parts_get_no_grad_and_stay_bit_identical(tiny_batch, vision, language, projector):
    model = small_vlm(seed=1)
    frozen = freeze(model, vision=vision, language=language, projector=projector)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _step(model, tiny_batch)
    projector = vision if projector is None else projector
    for name, p in model.named_parameters():
        part = ("projector" if ".merger." in name else "vision") if name.startswith("visual.") else "language"
        is_frozen = {"vision": vision, "projector": projector, "language": language}[part]
        assert p.requires_grad is not is_frozen, name
        if is_frozen:
            assert p.grad is None and torch.equal(p, before[name]), name
        elif p.grad is not None and p.grad.abs().sum() > 0:
            assert not torch.equal(p, before[name]), name
    assert frozen["vision"] > 0 if vision else frozen["language"] > 0
    by_default = freeze(small_vlm(seed=1), vision=True)  # the merger follows the tower unless told otherwise
    assert by_default["projector"] > 0 and by_default["language"] == 0


@pytest.fixture(scope="module")
def video_batch(proc, cache):
    """A micro batch of the tiny set's first picture row and first video row."""
    from qwenft.data.tiny_vlm import tiny_vlm_data_dir

    data = tiny_vlm_data_dir(cache)
    rows = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]
    kinds = [any(p.get("type") == "video" for m in r["messages"] if isinstance(m["content"], list)
                 for p in m["content"]) for r in rows]
    picked = [rows[kinds.index(False)], rows[kinds.index(True)]]
    return next(build_vlm_data(picked, proc, seq_len=128, micro_batch_size=2, base_dir=data))


@pytest.mark.parametrize("peft", ["none", "lora"])
def test_vision_activation_checkpointing_gives_the_same_grads(video_batch, peft):
    """The tower's blocks checkpointed (model.vision_activation_checkpointing, as the run builds a stage: after
    LoRA's adapters, peft.vision=true): the same tower grads, on a micro batch with a picture and a video."""
    from qwenft.conf import compose
    from qwenft.models.lora import apply_lora
    from qwenft.train.build import _freeze
    from qwenft.train.peft_setup import lora_config

    assert len(video_batch["video_grid_thw"]) >= 1 and len(video_batch["image_grid_thw"]) >= 1
    grads = []
    for ac in (False, True):
        cfg = compose(["recipe=tiny_vlm", f"peft={peft}", "peft.vision=true",
                       f"model.vision_activation_checkpointing={str(ac).lower()}"])
        model = small_vlm(seed=2)
        if peft == "lora":
            torch.manual_seed(0)  # the adapters' init
            apply_lora(model, lora_config(cfg), adapter_dtype=torch.float32)
        names = [n for n, _ in model.named_parameters()]
        _freeze(model, cfg)
        assert all(isinstance(b.forward, functools.partial) == ac for b in model.visual.blocks)
        assert [n for n, _ in model.named_parameters()] == names  # checkpoint keys unchanged
        b = video_batch
        logits = forward_batch(model, b)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), b["labels"].flatten()).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()
                      if n.startswith("visual.") and p.grad is not None})
    assert grads[0] and grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7)


def test_tiny_vlm_set_is_deterministic_and_processor_reloads(cache, tmp_path):
    from transformers import AutoImageProcessor, AutoTokenizer

    from qwenft.data.tiny_vlm import generate, tiny_vlm_data_dir, tiny_vlm_processor_dir

    generate(tmp_path)
    ours = tiny_vlm_data_dir(cache)
    assert (tmp_path / "train.jsonl").read_bytes() == (ours / "train.jsonl").read_bytes()
    assert sorted(p.name for p in (tmp_path / "images").iterdir()) == sorted(p.name for p in (ours / "images").iterdir())
    frames = sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "frames").rglob("*.png"))
    assert frames == sorted(str(p.relative_to(ours)) for p in (ours / "frames").rglob("*.png")) and len(frames) > 100
    assert (tmp_path / "frames/0/3.png").read_bytes() == (ours / "frames/0/3.png").read_bytes()
    path = tiny_vlm_processor_dir(cache)
    tok, ip = AutoTokenizer.from_pretrained(path), AutoImageProcessor.from_pretrained(path)
    cfg = named_config("tiny_vlm")
    assert tok.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]) == [
        cfg.vision_start_token_id, cfg.vision_end_token_id, cfg.image_token_id, cfg.video_token_id]
    assert len(tok) <= cfg.text.vocab_size and ip.patch_size == cfg.vision["patch_size"]
    assert ip.merge_size == cfg.vision["spatial_merge_size"]
    from qwenft.data.tokenizer import load_tokenizer

    assert load_tokenizer("tiny_vlm", cache).get_vocab() == tok.get_vocab()  # what the runner's data.tokenizer gets


def test_tiny_vlm_loss_falls(proc, cache):
    """The tiny VLM from random init + AdamW on the generated set: the loss falls clearly in a few steps."""
    from qwenft.data.tiny_vlm import tiny_vlm_data_dir

    torch.manual_seed(0)
    data = build_vlm_data(tiny_vlm_data_dir(cache) / "train.jsonl", proc, seq_len=128, micro_batch_size=2)
    model = init_random_weights(build_model(named_config("tiny_vlm"), kernels="torch"), seed=0, device="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))
    losses = []
    for _ in range(10):
        b = next(data)
        logits = forward_batch(model, b)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), b["labels"].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert sum(losses[-3:]) / 3 < 0.6 * losses[0], losses  # measured: 6.28 -> 2.22


def test_a_photo_with_an_exif_orientation_is_read_upright(tmp_path):
    """As transformers' load_image reads it: a 40x20 picture stored with orientation 6 (rotate 90) is 20x40."""
    from transformers.image_utils import load_image

    from qwenft.data.images import ImageSource

    exif = Image.Exif()
    exif[0x0112] = 6
    picture(20, 40).save(tmp_path / "photo.jpg", exif=exif)
    mine = ImageSource(path=str(tmp_path / "photo.jpg")).open()
    assert mine.size == (20, 40)
    assert np.array_equal(np.asarray(mine), np.asarray(load_image(str(tmp_path / "photo.jpg"))))
    assert ImageSource(data=(tmp_path / "photo.jpg").read_bytes()).open().size == (20, 40)
