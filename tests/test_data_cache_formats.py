"""data.format through the token cache: ShareGPT rows cached give the documents of the same conversations as
messages rows, and the stream of the in-memory pipeline; `auto` is decided from the first rows and its result
keys the cache; rows of another format are counted through the cache; mixtures of formats; the resume
fingerprint of cached and mixed data."""

import json

import pytest
import torch

from qwenft.data import cache as cache_lib
from qwenft.data.chat import tokenize_rows
from qwenft.data.loader import build_sft_data, fingerprint, load_rows
from qwenft.data.mixture import Source, build_mixture_data
from qwenft.data.tiny_chat import TRAIN_PATH
from qwenft.data.tokenizer import load_tokenizer

ROLE_TO_FROM = {"user": "human", "assistant": "gpt"}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer("tiny", tmp_path_factory.mktemp("tok"))


def as_sharegpt(row: dict) -> dict:
    """A tiny-set messages row written as ShareGPT: a leading system turn as the `system` column."""
    messages = row["messages"]
    out = {}
    if messages[0]["role"] == "system":
        out["system"], messages = messages[0]["content"], messages[1:]
    out["conversations"] = [{"from": ROLE_TO_FROM[m["role"]], "value": m["content"]} for m in messages]
    return out


def sharegpt_file(tmp_path, n=None):
    """The tiny set as ShareGPT JSONL, with an alpaca row (line 6) and a messages row (line 12) among them."""
    rows = [as_sharegpt(r) for r in load_rows(TRAIN_PATH)[:n]]
    rows.insert(5, {"instruction": "Reverse the word.", "input": "cat", "output": "tac"})
    rows.insert(11, {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})
    path = tmp_path / "sharegpt.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_sharegpt_file_through_the_cache_equals_the_in_memory_pipeline(tok, tmp_path, monkeypatch):
    monkeypatch.setattr(cache_lib, "SHARD_BYTES", 4096)  # many shards
    path = sharegpt_file(tmp_path)
    kwargs = dict(seq_len=96, micro_batch_size=3, seed=5)
    reference = build_sft_data(path, tok, cache=False, **kwargs)
    cached = build_sft_data(path, tok, cache_dir=tmp_path / "c", num_proc=1, **kwargs)
    assert cached.format == reference.format == "sharegpt" and "built here" in cached.cache_note
    # the same conversations as the shipped messages rows, in order; the two rows of other formats skipped
    want, _ = tokenize_rows(load_rows(TRAIN_PATH), tok, 96)
    cached_docs = [cached.docs[d] for d in range(cached.num_documents)]  # the cache's hold int64 arrays
    assert [(d.input_ids.tolist(), d.labels.tolist()) for d in cached_docs] == [
        (d.input_ids, d.labels) for d in want] == [(d.input_ids, d.labels) for d in reference.docs]
    assert cached.skipped == reference.skipped == {"format": 2}
    assert cached.docs.meta["skipped"] == {"format": 2}
    assert cached.fingerprint == reference.fingerprint == fingerprint(path)
    for _ in range(50):  # past the epoch boundary
        x, y = next(reference), next(cached)
        assert all(torch.equal(x[k], y[k]) for k in x)
    # the key holds the resolved format: naming it reuses the cache auto built
    named = build_sft_data(path, tok, cache_dir=tmp_path / "c", data_format="sharegpt", **kwargs)
    assert named.docs.directory == cached.docs.directory and "reused" in named.cache_note
    # on_bad_row=error: the first row of another format, named as the in-memory pipeline names it
    with pytest.raises(ValueError) as in_memory:
        build_sft_data(path, tok, on_bad_row="error", cache=False, **kwargs)
    with pytest.raises(ValueError) as from_cache:
        build_sft_data(path, tok, on_bad_row="error", cache_dir=tmp_path / "c", **kwargs)
    assert str(from_cache.value) == str(in_memory.value)
    assert str(in_memory.value).startswith("data row 5: row has columns ['input', 'instruction', 'output'], not "
                                           "the 'conversations' of data.format=sharegpt")


def test_auto_is_decided_from_the_first_rows(tok, tmp_path, monkeypatch):
    """Through the cache `auto` reads only the first AUTO_SAMPLE_ROWS rows: here 3 messages rows before 5
    ShareGPT rows, so the cache reads messages rows while the in-memory pipeline (all rows) reads ShareGPT."""
    rows = load_rows(TRAIN_PATH)[:8]
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r if i < 3 else as_sharegpt(r)) + "\n" for i, r in enumerate(rows)))
    monkeypatch.setattr(cache_lib, "AUTO_SAMPLE_ROWS", 3)
    cached = build_sft_data(path, tok, 96, 2, cache_dir=tmp_path / "c", num_proc=1)
    assert (cached.format, cached.num_documents, cached.skipped) == ("messages", 3, {"format": 5})
    in_memory = build_sft_data(path, tok, 96, 2, cache=False)
    assert (in_memory.format, in_memory.num_documents, in_memory.skipped) == ("sharegpt", 5, {"format": 3})


def test_head_rows_reads_the_first_rows_of_every_source_kind(tmp_path):
    import datasets

    rows = [as_sharegpt(r) for r in load_rows(TRAIN_PATH)[:30]]
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) + ("\n" if i == 2 else "") for i, r in enumerate(rows)) + "\n")
    array = tmp_path / "a.json"
    array.write_text(json.dumps(rows))
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "a.parquet"))
    ds.save_to_disk(str(tmp_path / "dir"))
    for path in (jsonl, array, tmp_path / "a.parquet", tmp_path / "dir"):
        assert cache_lib.head_rows(path, 7) == load_rows(path)[:7], path
        assert cache_lib.source_format(path, "auto") == "sharegpt"
    with pytest.raises(ValueError, match="data.format='csv' is not valid"):
        cache_lib.source_format(jsonl, "csv")


def test_a_mixture_of_formats_and_its_fingerprint(tok, tmp_path):
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps(r) + "\n" for r in load_rows(TRAIN_PATH)[200:]))
    sources = [Source("sharegpt", str(sharegpt_file(tmp_path, 200)), 1.0, "auto"),
               Source("chat", str(chat), 2.0, "messages")]
    cached = build_mixture_data(sources, tok, 128, 4, seed=3, cache_dir=tmp_path / "c", num_proc=1)
    reference = build_mixture_data(sources, tok, 128, 4, seed=3, cache=False)
    assert cached.format == reference.format == "sharegpt, messages"
    assert {k: s["format"] for k, s in cached.source_summary.items()} == {"sharegpt": "sharegpt", "chat": "messages"}
    assert cached.skipped == reference.skipped == {"format": 2}
    for _ in range(20):
        x, y = next(reference), next(cached)
        assert all(torch.equal(x[k], y[k]) for k in x)
    assert cached.fingerprint == reference.fingerprint == {
        "sharegpt/sharegpt.jsonl": fingerprint(sources[0].path)["sharegpt.jsonl"],
        "chat/chat.jsonl": fingerprint(chat)["chat.jsonl"]}


def test_the_fingerprint_of_a_datasets_dir_leaves_its_token_cache_out(tok, tmp_path):
    import datasets

    directory = tmp_path / "ds"
    datasets.Dataset.from_list(load_rows(TRAIN_PATH)[:40]).save_to_disk(str(directory))
    before = fingerprint(directory)
    data = build_sft_data(directory, tok, 96, 2, num_proc=1)  # the cache goes inside the directory
    assert (directory / cache_lib.CACHE_DIRNAME).is_dir() and data.num_documents == 40
    assert data.fingerprint == before == fingerprint(directory)


def test_build_data_reads_a_mixture_with_each_sources_format(tmp_path):
    """`data.sources` through the trainer's `build_data`: a source's `format` (null: data.format's) reaches it."""
    from qwenft.conf import compose
    from qwenft.train.build import model_config
    from qwenft.train.data_setup import build_data

    path = sharegpt_file(tmp_path, 100)
    cfg = compose(["recipe=tiny", f"data.cache_dir={tmp_path / 'c'}", "data.num_proc=1", "data.seq_len=128",
                   f"data.sources=[{{path: {path}, format: sharegpt}}, {{path: tiny, weight: 2}}]"])
    _, data, _ = build_data(cfg, model_config(cfg), 2, 0, 1)
    assert data.format == "sharegpt, messages"
    assert {name: s["format"] for name, s in data.source_summary.items()} == {"sharegpt": "sharegpt",
                                                                              "tiny_chat": "messages"}
    assert data.skipped == {"format": 2} and set(data.fingerprint) == {"sharegpt/sharegpt.jsonl",
                                                                       "tiny_chat/tiny_chat.jsonl"}
    cfg = compose(["recipe=tiny", f"data.cache_dir={tmp_path / 'c'}", "data.num_proc=1", "data.seq_len=128",
                   "data.format=alpaca", f"data.sources=[{{path: {path}}}]"])
    _, data, _ = build_data(cfg, model_config(cfg), 2, 0, 1)
    assert data.format == "alpaca" and data.num_documents == 1  # the one alpaca row among the sharegpt rows
