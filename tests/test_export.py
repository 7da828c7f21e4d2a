"""An HF export generates on its own: transformers' `generate` stops at the end of the reply, the end and pad
ids are in config.json and generation_config.json, a source checkpoint's generation_config.json is carried
over, and every file has the mode a plain `open` gives."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from distributed import run_distributed
from helpers import save_random_checkpoint, tiny_overrides, train

MAX_NEW_TOKENS = 40


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _assert_export_files(out, tokenizer):
    """The end ids as the tokenizer spells them, and one mode, 0666 less the umask, for every file."""
    im_end, end_of_text = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] == tokenizer.eos_token_id == im_end
    assert config["pad_token_id"] == tokenizer.pad_token_id == end_of_text
    weights = load_file(out / "model.safetensors")
    elements = {dtype: sum(t.numel() for t in weights.values() if t.dtype == dtype) for dtype in
                {t.dtype for t in weights.values()}}
    assert config["dtype"] == str(max(elements, key=elements.get)).removeprefix("torch.")  # what vLLM's auto takes
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
            "chat_template.jinja"} <= set(modes)
    assert set(modes.values()) == {0o666 & ~_umask()}, modes
    return im_end, end_of_text


def _greedy_until_end(model, ids, end_ids):
    """Reference: one full forward per new token, argmax, cut after the first end id (or at MAX_NEW_TOKENS)."""
    out = []
    with torch.no_grad():
        for _ in range(MAX_NEW_TOKENS):
            nxt = model(input_ids=torch.tensor([ids + out])).logits[0, -1].argmax().item()
            out.append(nxt)
            if nxt in end_ids:
                break
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_tiny_export_generates_until_im_end(tmp_path):
    """40 steps of recipe=tiny teach the model to close its replies, if not yet to answer right. Greedy `generate` on the export, with nothing but the export's own files, returns exactly
    the reference greedy tokens cut after the first end id, and on every prompt that end is `<|im_end|>`,
    well before MAX_NEW_TOKENS."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qwenft.data.tiny_chat import VAL_PATH

    run_dir = tmp_path / "run"
    run_distributed(train, 1, tiny_overrides(run_dir, "train.max_steps=40", "checkpoint.export_dtype=float32"))
    out = run_dir / "hf"
    tokenizer = AutoTokenizer.from_pretrained(out)
    im_end, end_of_text = _assert_export_files(out, tokenizer)
    assert json.loads((out / "generation_config.json").read_text()) == {
        "eos_token_id": [im_end, end_of_text], "pad_token_id": end_of_text}
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    model.eval()
    rows = [json.loads(line) for line in VAL_PATH.read_text().splitlines()[:4]]
    for row in rows:
        prompt = row["messages"][:next(i for i, m in enumerate(row["messages"]) if m["role"] == "assistant")]
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)
        ids = list(ids["input_ids"])
        got = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False)[0, len(ids):]
        ref = _greedy_until_end(model, ids, {im_end, end_of_text})
        assert got.tolist() == ref, (tokenizer.decode(got), tokenizer.decode(ref))
        assert ref[-1] == im_end and len(ref) < MAX_NEW_TOKENS, tokenizer.decode(ref)


@pytest.mark.distributed
@pytest.mark.slow
def test_source_generation_config_is_carried_over(tmp_path):
    """A run from a model.path with a generation_config.json: the export keeps its sampling defaults and ids,
    its eos list gains the tokenizer's end ids after its own, and transformers reads the result."""
    from transformers import AutoTokenizer, GenerationConfig

    from qwenft.models.qwen3_5.configs import named_config

    source = save_random_checkpoint(named_config("tiny"), tmp_path / "base", tokenizer="tiny")
    written = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "eos_token_id": [7, 2],
               "pad_token_id": 9, "bos_token_id": 9}
    (source / "generation_config.json").write_text(json.dumps(written))
    run_dir = tmp_path / "run"
    run_distributed(train, 1, tiny_overrides(run_dir, f"model.path={source}", "train.max_steps=1",
                                             "train.global_batch_size=2"))
    out = run_dir / "hf"
    tokenizer = AutoTokenizer.from_pretrained(out)
    im_end, end_of_text = _assert_export_files(out, tokenizer)
    assert im_end == 2  # the tiny tokenizer's <|im_end|>: already in the source's list, kept once
    expected = {**written, "eos_token_id": [7, 2, end_of_text]}
    assert json.loads((out / "generation_config.json").read_text()) == expected
    loaded = GenerationConfig.from_pretrained(out)
    assert (loaded.temperature, loaded.top_k, loaded.top_p, loaded.eos_token_id, loaded.pad_token_id) == (
        0.6, 20, 0.95, [7, 2, end_of_text], 9)


def test_bad_source_generation_config_is_one_line_and_writes_nothing(tmp_path):
    from qwenft.checkpoint.hf_export import write_hf
    from qwenft.data.tokenizer import load_tokenizer
    from qwenft.models.qwen3_5.configs import named_config

    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "generation_config.json").write_text('{"eos_token_id": [1,')
    cfg = named_config("tiny")
    with pytest.raises(ValueError) as info:
        write_hf({}, cfg, [load_tokenizer("tiny")], tmp_path / "out", source_dir=tmp_path / "base")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"model.path={tmp_path / 'base'}: generation_config.json is not valid JSON (")
    assert message.endswith("); fix or remove it")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base"]


def test_an_export_finished_first_into_the_same_out_is_kept(tmp_path):
    """Two exports into one new `out`: the one that renames its temp dir second finds `out` written and removes its
    own, instead of deleting the other's."""
    from qwenft.checkpoint.hf_export import _written_beside

    out = tmp_path / "out"
    with pytest.raises(ValueError, match=f"out={out} was written by another export meanwhile; this export is removed"):
        with _written_beside(out, own_run_dir=False) as tmp:
            tmp.mkdir()
            (tmp / "model.safetensors").write_text("this export's")
            out.mkdir()
            (out / "model.safetensors").write_text("the other's")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert (out / "model.safetensors").read_text() == "the other's"
