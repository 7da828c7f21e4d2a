"""Token cache, numpy packing plan and mixtures: the cached stream against the in-memory pipeline, the cache
key, racing builders, resume across dp sizes, bad rows through the cache, mixture token shares."""

import json
import multiprocessing
import os
import random
import shutil
import time

import numpy as np
import pytest
import torch

from qwenft.data import cache as cache_lib
from qwenft.data.chat import tokenize_rows
from qwenft.data.loader import build_sft_data, fingerprint, load_rows
from qwenft.data.mixture import Source, build_mixture_data
from qwenft.data.packing import pack_plan
from qwenft.data.tiny_chat import TRAIN_PATH
from qwenft.data.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer("tiny", tmp_path_factory.mktemp("tok"))


@pytest.fixture
def small_shards(monkeypatch):
    """Many shards from the tiny set (72 KB), so shard offsets and the concatenation are exercised."""
    monkeypatch.setattr(cache_lib, "SHARD_BYTES", 4096)
    monkeypatch.setattr(cache_lib, "SHARD_ROWS", 37)


def assert_same_batches(a, b, n):
    for _ in range(n):
        x, y = next(a), next(b)
        assert x.keys() == y.keys()
        for key in x:
            assert torch.equal(x[key], y[key]), key


def first_fit_reference(lengths, seq_len, open_rows=64):
    """The list-based first-fit packer the plan must reproduce (documents by index, rows in opening order)."""
    rows, space, first_open = [], [], 0
    for doc, length in enumerate(lengths):
        for k in range(first_open, len(rows)):
            if space[k] >= length:
                rows[k].append(doc)
                space[k] -= length
                break
        else:
            rows.append([doc])
            space.append(seq_len - length)
            first_open = max(first_open, len(rows) - open_rows)
    return rows


def test_pack_plan_is_first_fit_over_the_newest_open_rows():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 200, 5000)
    order = rng.permutation(5000)
    plan = pack_plan(order, lengths, 256)
    want = first_fit_reference(lengths[order].tolist(), 256)
    assert [row for row in plan[:]] == [[int(order[k]) for k in row] for row in want]


@pytest.mark.parametrize("packing", ["pack", "pad"])
def test_cached_stream_equals_the_in_memory_pipeline(tok, tmp_path, small_shards, packing):
    kwargs = dict(seq_len=96, micro_batch_size=3, seed=5, packing=packing)
    reference = build_sft_data(TRAIN_PATH, tok, cache=False, **kwargs)
    cached = build_sft_data(TRAIN_PATH, tok, cache_dir=tmp_path, num_proc=1, **kwargs)
    assert cached.num_documents == reference.num_documents == 400
    assert cached.cache_note.startswith(f"token cache {tmp_path}") and "built here" in cached.cache_note
    # past an epoch boundary: the tiny set is ~130 packed rows (400 padded rows) at seq_len 96
    assert_same_batches(reference, cached, 160 if packing == "pad" else 60)
    assert cached.epoch >= 1


def test_parquet_row_groups_cut_into_shards_give_the_rows_in_order(tmp_path, small_shards):
    import pyarrow.parquet

    path = tmp_path / "chat.parquet"
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(load_rows(TRAIN_PATH)), path, row_group_size=150)
    shards = cache_lib.plan_shards(path)
    assert [s.group for s in shards] == [0] * 5 + [1] * 5 + [2] * 3  # 150, 150, 100 rows in shards of 37
    assert [row for shard in shards for row in cache_lib.shard_rows(shard)] == load_rows(path)


@pytest.mark.slow
def test_parallel_build_equals_one_process(tok, tmp_path, small_shards):
    serial, _ = cache_lib.open_cache(TRAIN_PATH, tok, 128, cache_dir=tmp_path / "one", num_proc=1)
    parallel, built = cache_lib.open_cache(TRAIN_PATH, tok, 128, cache_dir=tmp_path / "two", num_proc=2)
    assert built and parallel.meta["num_proc"] == 2
    for name in ("tokens", "targets", "offsets"):
        assert np.array_equal(getattr(serial, name), getattr(parallel, name)), name
    docs, _ = tokenize_rows(load_rows(TRAIN_PATH), tok, 128)
    assert [(parallel[d].input_ids.tolist(), parallel[d].labels.tolist()) for d in range(len(parallel))] == [
        (d.input_ids, d.labels) for d in docs]  # the cache's documents hold int64 arrays


def test_cache_hit_miss_and_invalidation_per_key(tok, tmp_path):
    data = tmp_path / "chat.jsonl"
    shutil.copy(TRAIN_PATH, data)
    root = tmp_path / "cache"
    base = dict(seq_len=128, train_on="assistant", truncation="truncate_right", fmt="auto")

    def open_(tokenizer=tok, **change):
        docs, built = cache_lib.open_cache(data, tokenizer, cache_dir=root, num_proc=1, **{**base, **change})
        return docs.directory, built

    first, built = open_()
    assert built and (first / "meta.json").is_file()
    assert open_() == (first, False)  # hit
    dirs = {first}
    assert open_(fmt="messages") == (first, False)  # the key holds the format auto resolves to
    for change in ({"seq_len": 64}, {"train_on": "all"}, {"truncation": "drop"}, {"fmt": "sharegpt"}):
        directory, built = open_(**change)
        assert built and directory not in dirs, change
        dirs.add(directory)
    other_template = load_tokenizer("tiny", tmp_path / "tok2")
    other_template.chat_template = other_template.chat_template.replace("<|im_start|>", "<|im_start|> ")
    directory, built = open_(other_template)
    assert built and directory not in dirs
    dirs.add(directory)
    os.utime(data, ns=(data.stat().st_atime_ns, data.stat().st_mtime_ns + 10**9))  # touched: same bytes
    directory, built = open_()
    assert built and directory not in dirs
    dirs.add(directory)
    with open(data, "a") as f:
        f.write(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                         {"role": "assistant", "content": "hello"}]}) + "\n")
    directory, built = open_()
    assert built and directory not in dirs
    docs = cache_lib.CachedDocuments(directory)
    assert len(docs) == 401 and docs.meta["rows"] == 401
    assert not list(root.glob("*.tmp-*")) and not list(root.glob("*.lock"))


def _race(path, tok_dir, root, start, out):
    tokenizer = load_tokenizer("tiny", tok_dir)
    start.wait()
    docs, built = cache_lib.open_cache(path, tokenizer, 128, cache_dir=root, num_proc=1, poll_s=0.02)
    out.put((str(docs.directory), built, len(docs)))


@pytest.mark.slow
def test_two_racing_builders_make_one_build(tmp_path):
    load_tokenizer("tiny", tmp_path / "tok")  # trained once, before the race
    ctx = multiprocessing.get_context("spawn")
    start, out = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_race, args=(TRAIN_PATH, tmp_path / "tok", tmp_path / "cache", start, out))
             for _ in range(2)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert sorted(built for _, built, _ in results) == [False, True]
    assert len({directory for directory, _, _ in results}) == 1 and {n for _, _, n in results} == {400}
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [os.path.basename(results[0][0])]


def test_a_stale_lock_is_taken_over(tok, tmp_path, monkeypatch):
    key = cache_lib.cache_key(TRAIN_PATH, tok, 128, "assistant", "truncate_right", "messages")
    final = cache_lib.cache_dir_for(TRAIN_PATH, key, tmp_path)
    lock = final.with_name(final.name + ".lock")
    lock.write_text("a builder that was killed\n")
    os.utime(lock, (0, 0))
    docs, built = cache_lib.open_cache(TRAIN_PATH, tok, 128, cache_dir=tmp_path, num_proc=1)
    assert built and docs.directory == final and not lock.exists()


@pytest.mark.parametrize("dp_before,dp_after", [(1, 2), (2, 3)])
def test_resume_across_dp_sizes(tok, tmp_path, dp_before, dp_after):
    global_rows, seq_len = 6, 96
    kwargs = dict(seed=11, cache_dir=tmp_path, num_proc=1)
    reference = build_sft_data(TRAIN_PATH, tok, seq_len, global_rows, cache=False, seed=11)
    want = [next(reference) for _ in range(40)]  # past the epoch boundary
    before = [build_sft_data(TRAIN_PATH, tok, seq_len, global_rows // dp_before, dp_rank=r, dp_size=dp_before,
                             **kwargs) for r in range(dp_before)]
    for step in range(17):
        for data in before:
            next(data)
    state = json.loads(json.dumps(before[0].state_dict()))
    assert all(data.state_dict() == before[0].state_dict() for data in before)
    after = [build_sft_data(TRAIN_PATH, tok, seq_len, global_rows // dp_after, dp_rank=r, dp_size=dp_after,
                            **kwargs) for r in range(dp_after)]
    for data in after:
        data.load_state_dict(state)
    for batch in want[17:]:
        got = [next(data) for data in after]
        for r in range(dp_after):
            for key in ("input_ids", "labels", "position_ids", "padding_mask"):
                assert torch.equal(got[r][key], batch[key][r::dp_after]), (r, key)


def bad_rows_file(tmp_path):
    good = load_rows(TRAIN_PATH)[:30]
    bad = [{"messages": []}, {"messages": [{"role": "robot", "content": "x"}]},
           {"messages": [{"role": "user", "content": "only a question"}]},
           {"messages": [{"role": "user", "content": " "}, {"role": "assistant", "content": "x"}]},
           {"messages": [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "one " * 80}]}]
    lines = [json.dumps(r) for r in good]
    for i, row in enumerate(bad):
        lines.insert(7 * i + 3, json.dumps(row))
    lines.insert(20, "{not json")
    lines.insert(25, "")  # blank lines are not rows
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_bad_rows_are_counted_through_the_cache(tok, tmp_path, small_shards):
    path = bad_rows_file(tmp_path)
    _, want = tokenize_rows(load_rows(path), tok, 64, truncation="drop")
    assert set(want) == {"no_messages", "bad_role", "no_assistant", "empty_content", "unreadable", "too_long"}
    data = build_sft_data(path, tok, 64, 2, truncation="drop", cache_dir=tmp_path / "c", num_proc=1)
    assert data.skipped == dict(want)
    assert json.loads((cache_lib.CachedDocuments(data.docs.directory).directory / "meta.json").read_text())[
        "skipped"] == dict(want)
    # on_bad_row=error: the in-memory pipeline's message, read from the cache (no rebuild)
    with pytest.raises(ValueError) as in_memory:
        build_sft_data(path, tok, 64, 2, truncation="drop", on_bad_row="error", cache=False)
    with pytest.raises(ValueError) as cached:
        build_sft_data(path, tok, 64, 2, truncation="drop", on_bad_row="error", cache_dir=tmp_path / "c")
    assert str(cached.value) == str(in_memory.value) and str(cached.value).startswith("data row 3: ")
    unreadable = [(i, d) for r, (i, d) in data.docs.meta["first_bad"].items() if r == "unreadable"]
    assert unreadable == [(20, "line 21 of bad.jsonl is not valid JSON (Expecting property name enclosed "
                                "in double quotes)")]


def source_files(tmp_path):
    rows = load_rows(TRAIN_PATH)
    random.Random(0).shuffle(rows)
    # two sources of different document lengths: long two-turn chats and short ones
    long_rows = [r for r in rows if len(r["messages"]) > 3]
    short_rows = [r for r in rows if len(r["messages"]) <= 3]
    paths = []
    for name, part in (("long", long_rows), ("short", short_rows)):
        paths.append(tmp_path / f"{name}.jsonl")
        paths[-1].write_text("".join(json.dumps(r) + "\n" for r in part))
    return paths


@pytest.mark.parametrize("weights", [(0.7, 0.3), (1.0, 4.0)])
def test_mixture_token_shares_follow_the_weights(tok, tmp_path, weights):
    paths = source_files(tmp_path)
    sources = [Source(p.stem, str(p), w, "auto") for p, w in zip(paths, weights)]
    data = build_mixture_data(sources, tok, 128, 8, seed=2, cache_dir=tmp_path / "c", num_proc=1)
    texts = [{tok.apply_chat_template(r["messages"], tokenize=False) for r in load_rows(p)} for p in paths]
    counted = [0, 0]
    for _ in range(150):  # ~1200 rows, several epochs
        batch = next(data)
        cu, flat = batch["cu_seqlens"].tolist(), batch["input_ids"].reshape(-1)
        for a, b in zip(cu[:-1], cu[1:]):
            text = tok.decode(flat[a:b])
            owner = [text in t for t in texts]
            assert sum(owner) == 1 or set(text.split("<|endoftext|>")) == {""}, text
            if any(owner):
                counted[owner.index(True)] += b - a
    shares = np.array(counted) / sum(counted)
    assert np.abs(shares - np.array(weights) / sum(weights)).max() < 0.01, shares
    assert data.source_tokens() == {"long": counted[0], "short": counted[1]}
    assert data.epoch >= 2
    # the same seed gives the same stream; the position and counts resume
    state = data.state_dict()
    again = build_mixture_data(sources, tok, 128, 8, seed=2, cache_dir=tmp_path / "c")
    again.load_state_dict(json.loads(json.dumps(state)))
    assert again.source_tokens() == data.source_tokens()
    assert_same_batches(data, again, 5)
    with pytest.raises(ValueError, match="data.sources"):
        build_mixture_data(sources[::-1], tok, 128, 8, seed=2, cache_dir=tmp_path / "c").load_state_dict(state)


def test_mixture_epoch_holds_every_source_once_at_equal_token_weights(tok, tmp_path):
    """Weights in proportion to the sources' token counts: each epoch is every document exactly once."""
    paths = source_files(tmp_path)
    docs = [cache_lib.open_cache(p, tok, 128, cache_dir=tmp_path / "c", num_proc=1)[0] for p in paths]
    tokens = [d.meta["tokens"] for d in docs]
    sources = [Source(p.stem, str(p), t, "auto") for p, t in zip(paths, tokens)]
    data = build_mixture_data(sources, tok, 128, 8, seed=4, cache_dir=tmp_path / "c")
    order = data.epoch_order(0)
    assert len(order) == sum(len(d) for d in docs)
    assert sorted(order.tolist()) == list(range(len(order)))
    assert data.source_summary["long"]["tokens"] == tokens[0]


def test_data_prepare_prints_each_sources_numbers_and_train_reuses_the_cache(tok, tmp_path, capsys):
    from qwenft.cli import main
    from qwenft.data.tokenizer import load_tokenizer as load

    path = bad_rows_file(tmp_path)
    cache_dir = tmp_path / "c"
    args = ["data", "prepare", "recipe=tiny", "data.seq_len=64", "data.truncation=drop", f"data.cache_dir={cache_dir}",
            "data.num_proc=1"]
    assert main(args + [f"data.sources=[{{path: {path}, weight: 1}}, {{path: tiny, weight: 2}}]"]) == 0
    out = capsys.readouterr().out.splitlines()
    tiny_tok = load("tiny")  # the recipe's tokenizer
    want = []
    for p in (path, TRAIN_PATH):
        docs, skipped = tokenize_rows(load_rows(p), tiny_tok, 64, truncation="drop")
        want.append((len(load_rows(p)), len(docs), sum(len(d.input_ids) for d in docs), skipped))
    assert out[0] == f"bad: {path} (messages rows)" and out[3] == f"tiny_chat: {TRAIN_PATH} (messages rows)"
    assert out[1].startswith(f"  cache {cache_dir}/bad-") and out[1].endswith("(built in " + out[1].split("built in ")[1])
    for line, (rows, n_docs, tokens, skipped) in zip((out[2], out[5]), want):
        text = ", ".join(f"{k} {v}" for k, v in sorted(skipped.items())) or "none"
        assert line == f"  {rows} rows: {n_docs} documents, {tokens} tokens; skipped rows: {text}"
    assert out[6] == f"total: {want[0][1] + want[1][1]} documents, {want[0][2] + want[1][2]} tokens"
    # a second prepare, and training, find it built
    assert main(args + [f"data.path={path}"]) == 0
    assert "(already built)" in capsys.readouterr().out
    _, built = cache_lib.open_cache(path, tiny_tok, 64, truncation="drop", cache_dir=cache_dir)
    assert not built
    assert main(args + [f"data.path={path}", "data.on_bad_row=error"]) == 2
    assert "qwenft: error: data row 3: row has no non-empty 'messages' list" in capsys.readouterr().err
    # a run that validates reads its eval.dataset through the cache too: prepared with it
    from qwenft.data.tiny_chat import VAL_PATH

    sources = f"data.sources=[{{path: {path}, weight: 1}}, {{path: tiny, weight: 2}}]"
    assert main(args + [sources, "eval.every_steps=2", "eval.dataset=tiny"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert f"eval.dataset tiny_chat_val: {VAL_PATH} (messages rows)" in out
    assert out[-1] == f"total: {want[0][1] + want[1][1]} documents, {want[0][2] + want[1][2]} tokens"  # training's
    _, built = cache_lib.open_cache(VAL_PATH, tiny_tok, 64, truncation="drop", cache_dir=cache_dir)
    assert not built
    assert main(args + [f"data.path={path}", "eval.every_steps=2", f"eval.dataset={tmp_path / 'nope.jsonl'}"]) == 2
    assert f"qwenft: error: eval.dataset='{tmp_path / 'nope.jsonl'}' does not exist" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.distributed
def test_mixture_run_logs_sources_and_per_source_tokens(tmp_path):
    """Two dp ranks train on a mixture: the start log names each source, and every step's metrics carry the
    tokens each source contributed to the global stream so far, counted here from the decoded batches."""
    from distributed import run_distributed
    from helpers import tiny_overrides, train

    paths = source_files(tmp_path)
    sources = f"data.sources=[{{path: {paths[0]}, weight: 1}}, {{path: {paths[1]}, weight: 3}}]"
    run_dir = tmp_path / "run"
    run_distributed(train, 2, tiny_overrides(run_dir, sources, "train.max_steps=2", "train.global_batch_size=8",
                                             "train.micro_batch_size=2", "checkpoint.export_hf=false",
                                             f"data.cache_dir={tmp_path / 'c'}"))
    log = (run_dir / "train.log").read_text()
    assert f"data source long: {paths[0]}, messages rows, weight 1: " in log
    assert f"data source short: {paths[1]}, messages rows, weight 3: " in log
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # the reference: one process, the whole global batch of 8 rows a step
    tok = load_tokenizer("tiny")
    data = build_mixture_data([Source(p.stem, str(p), w, "auto") for p, w in zip(paths, (1, 3))], tok, 128, 8,
                              cache=False)
    texts = [{tok.apply_chat_template(r["messages"], tokenize=False) for r in load_rows(p)} for p in paths]
    counted = [0, 0]
    for step in (1, 2):
        batch = next(data)
        cu, flat = batch["cu_seqlens"].tolist(), batch["input_ids"].reshape(-1)
        for a, b in zip(cu[:-1], cu[1:]):
            owner = [tok.decode(flat[a:b]) in t for t in texts]
            if any(owner):
                counted[owner.index(True)] += b - a
        line = next(m for m in metrics if m["step"] == step and "loss" in m)
        assert (line["tokens/long"], line["tokens/short"]) == tuple(counted)


@pytest.mark.parametrize("overrides, message", [
    (["data.path=/d/a.jsonl", "data.sources=[{path: /d/b.jsonl}]"],
     "data.path=/d/a.jsonl and data.sources are both set; a mixture lists every dataset in data.sources"),
    (["data.sources=[{path: /d/b.jsonl, weight: 0}]"], "data.sources[0].weight=0.0 must be > 0"),
    (["data.num_proc=0"], "data.num_proc=0 must be >= 1 (or null for this machine's cores)"),
    (["data.sources=[{path: /d/b.jsonl, format: csv}]"],
     "data.sources[0].format='csv' is not valid; choose one of null, auto, messages, sharegpt, alpaca"),
])
def test_bad_data_keys_fail_with_one_line(overrides, message):
    from qwenft.conf import compose

    with pytest.raises(ValueError) as e:
        compose(["recipe=tiny", *overrides])
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_mixture_needs_no_data_path():
    from qwenft.conf import compose

    cfg = compose(["recipe=qwen3_5_27b_lora", "data.sources=[{path: /d/a.jsonl, weight: 2}, {path: /d/b.jsonl}]"])
    assert [(s.path, s.weight) for s in cfg.data.sources] == [("/d/a.jsonl", 2.0), ("/d/b.jsonl", 1.0)]
    with pytest.raises(ValueError, match="required key"):
        compose(["recipe=qwen3_5_27b_lora"])


@pytest.mark.parametrize("damage", ["truncate tokens", "no offsets", "garbled meta", "short offsets"])
def test_a_damaged_cache_is_named_not_read(tok, tmp_path, damage):
    data = tmp_path / "chat.jsonl"
    shutil.copy(TRAIN_PATH, data)
    docs, _ = cache_lib.open_cache(data, tok, 128, cache_dir=tmp_path / "c", num_proc=1)
    directory = docs.directory
    del docs
    if damage == "truncate tokens":
        with open(directory / "tokens.npy", "r+b") as f:
            f.truncate(200)
    elif damage == "no offsets":
        (directory / "offsets.npy").unlink()
    elif damage == "garbled meta":
        (directory / "meta.json").write_text('{"documents": ')
    else:
        np.save(directory / "offsets.npy", np.load(directory / "offsets.npy")[:-5])
    with pytest.raises(ValueError) as e:
        build_sft_data(data, tok, 128, 1, cache_dir=tmp_path / "c", num_proc=1)
    message = str(e.value)
    assert f"the token cache {directory} is damaged" in message and "delete that directory" in message
    assert "\n" not in message


def test_a_cache_dir_inside_a_datasets_dir_is_not_data(tok, tmp_path):
    """data.cache_dir inside the data dir: the second run reuses the first's cache and sees the same data."""
    import datasets

    directory = tmp_path / "ds"
    datasets.Dataset.from_list(load_rows(TRAIN_PATH)[:40]).save_to_disk(str(directory))
    before = fingerprint(directory)
    first = build_sft_data(directory, tok, 96, 2, cache_dir=directory / "mycache", num_proc=1)
    second = build_sft_data(directory, tok, 96, 2, cache_dir=directory / "mycache", num_proc=1)
    assert "built here" in first.cache_note and "reused" in second.cache_note
    assert first.fingerprint == second.fingerprint == before


def test_a_cache_dir_at_or_above_the_data_dir_leaves_its_data_in_the_fingerprint(tmp_path):
    import datasets

    directory = tmp_path / "ds"
    datasets.Dataset.from_list(load_rows(TRAIN_PATH)[:10]).save_to_disk(str(directory))
    plain = fingerprint(directory)
    assert plain and fingerprint(directory, directory) == fingerprint(directory, tmp_path) == plain
    assert cache_lib.data_files(directory, tmp_path) == cache_lib.data_files(directory) != []


def test_the_format_of_a_json_array_is_read_from_its_head(tmp_path, monkeypatch):
    """`auto` reads the first rows of a .json array without parsing the rest: here the rest is not even JSON."""
    rows = load_rows(TRAIN_PATH)[:12]
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(rows, indent=1)[:-1] + ", {oops")
    monkeypatch.setattr(cache_lib, "AUTO_SAMPLE_ROWS", 10)
    assert cache_lib.head_rows(path, 10) == rows[:10]
    assert cache_lib.source_format(path, "auto") == "messages"
    with pytest.raises(ValueError, match="is not a valid JSON array"):
        load_rows(path)
    with pytest.raises(ValueError, match="is not a valid JSON array"):
        cache_lib.head_rows(path, 13)
    from qwenft.data.loader import json_array_head

    scalars = tmp_path / "scalars.json"
    scalars.write_text('[-0.0025, 1e-3, "a,]", [1, [2]], {"b": "]"}, true, null]')
    for chunk in (1, 2, 3, 7, 1 << 20):
        assert json_array_head(scalars, 100, chunk) == json.loads(scalars.read_text()), chunk


def test_no_usable_documents_says_why_with_the_first_row_of_each_reason(tmp_path):
    from qwenft.conf import compose
    from qwenft.train.build import model_config
    from qwenft.train.data_setup import build_data, check_chat_template

    rows = [{"messages": [{"role": "user", "content": "hi"}]}, {"messages": [{"role": "robot", "content": "x"}]}]
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for cache in ("true", "false"):
        cfg = compose(["recipe=tiny", f"data.path={path}", f"data.cache={cache}", f"data.cache_dir={tmp_path / 'c'}"])
        with pytest.raises(ValueError) as e:
            build_data(cfg, model_config(cfg), 1, 0, 1)
        message = str(e.value)
        assert message.startswith("no usable documents (skipped: {") and "\n" not in message, message
        assert ("data row 0 (no_assistant): conversation has no assistant turn to learn from; data row 1 (bad_role): "
                "message 0 has role 'robot'; expected one of") in message, message
    tok = load_tokenizer("tiny", tmp_path / "tok")
    tok.chat_template = None
    cfg = compose(["recipe=tiny", f"data.tokenizer={tmp_path / 'tok'}"])
    with pytest.raises(ValueError, match=f"data.tokenizer='{tmp_path / 'tok'}': its tokenizer has no chat template"):
        check_chat_template(tok, cfg)


def test_mixture_source_names_are_unique():
    from qwenft.data.mixture import source_names

    assert source_names(["/d/a.jsonl", "/d/b.parquet", "/d/dir"]) == ["a", "b", "dir"]
    assert source_names(["/d/x/a.jsonl", "/d/y/a.jsonl"]) == ["a0", "a1"]
    assert source_names(["/d/x/a.jsonl", "/d/y/a.jsonl", "/d/a1.jsonl"]) == ["a0", "a1_1", "a1_2"]


def test_a_builders_lock_stays_fresh_through_a_long_build_step(tmp_path, monkeypatch):
    """The lock is touched on a clock while the cache builds, not between shards only: a step of the build that
    outlasts STALE_LOCK_S (the shards' concatenation on a slow disk) is not taken for a dead builder."""
    monkeypatch.setattr(cache_lib, "STALE_LOCK_S", 0.4)
    lock = tmp_path / "cache.lock"
    lock.write_text("host 1\n")
    os.utime(lock, (0, 0))
    with cache_lib._touched(lock):
        time.sleep(0.5)
        # touched in the block (its mtime was the epoch), by a margin no scheduler delay on a loaded box reaches
        assert lock.stat().st_mtime > time.time() - 60
