"""Chat SFT data for the runner: read rows, tokenize once, pack per epoch, hand out dp-sharded micro batches.

API (what the runner uses):

    data = build_sft_data(path, tokenizer, seq_len, micro_batch_size, dp_rank=0, dp_size=1, seed=0,
                          packing="pack", train_on="assistant", truncation="truncate_right",
                          on_bad_row="skip", data_format="auto", cache=True, cache_dir=None,
                          num_proc=None)   # -> SFTData
                             # a path's documents come from its token cache (qwenft.data.cache), memory-mapped
    batch = next(data)       # infinite over epochs; `for batch in data:` works too
    batch["input_ids"]       # [B, T] long          B = micro_batch_size, T = seq_len
    batch["labels"]          # [B, T] long, IGNORE_INDEX = ignored, PRE-SHIFTED: loss = CE(logits[:, t], labels[:, t])
    batch["position_ids"]    # [B, T] long, restart at 0 for every document and for the padding tail
    batch["cu_seqlens"]      # [n_segments + 1] int32 offsets of segment starts over the flattened B*T
    batch["padding_mask"]    # [B, T] bool, true on each row's padding tail (no document's token)
    data.epoch, data.epoch_progress   # epoch of the next row; epochs done as a float, for logging
    data.skipped             # {reason: count} of rows not trained on (log it once at start)
    data.format              # the rows' format (formats.FORMATS), data_format or what `auto` found
    data.fingerprint         # of the data files read (`fingerprint`, checked on resume); None for rows in memory
    data.num_documents, data.rows_in_epoch(e), data.cache_note (where the documents came from)
    data.source_tokens()     # {source: tokens consumed} of a mixture (qwenft.data.mixture), else {}
    data.state_dict() / data.load_state_dict(sd)   # resume continues exactly (same for every rank)
    data.eval_batches()      # one finite pass (for validation), last micro batch padded with empty rows
    data.make_ahead(n)       # make the next n micro batches now (no workers), handed out by `next`
    data.close()             # stop the worker threads (num_workers > 0; the VLM data's); `next` restarts them

Sharding. Each epoch's documents are shuffled with (seed, epoch) and packed into rows (a numpy plan
computed from the documents' lengths alone); this depends on neither dp_rank nor dp_size. The epochs are concatenated into one global stream of rows, consumed in
lockstep by all ranks: each call to `next` on every rank together consumes the next `B * dp_size` rows,
rank r taking rows `pos + j * dp_size + r` for j < B. So with grad accumulation A, microbatch i of
optimizer step s on rank r holds global rows `(s*A + i)*B*dp + j*dp + r`, and step s of any mesh covers
global rows [s*G, (s+1)*G) for G = A*B*dp: dp=2 (or any dp) sees the same global batches as dp=1 with
the same G. A micro batch may straddle an epoch boundary; no row is dropped.

The state is the global position (epoch, row within epoch), identical on every rank, so a checkpoint
restores exactly — also with another dp_size or micro_batch_size, which then continue the same stream.

Workers. `num_workers > 0` makes micro batches ahead in that many threads (qwenft.data.workers): `next`
plans the micro batch here (`plan`: which documents) and hands out a batch a worker made from the same plan
(`make_batch`), in order; the position moves when a batch is handed out, so batches, position and counts
are those of `num_workers=0`. The text builders leave it at 0 (a text batch is a slice of token arrays);
the VLM data (qwenft.data.vlm) decodes and processes pixels there. Without workers, `make_ahead(n)` makes the
next n micro batches at once in the calling thread, also without moving the position (the runner calls it
while the GPU finishes a step, instead of after).
"""

import json
import os
import random
from collections import Counter, deque
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from qwenft.data.cache import data_files, open_cache
from qwenft.data.chat import ON_BAD_ROW, Document, SkipCounts, UnreadableRow, check_choice, tokenize_rows
from qwenft.data.formats import arrow_rows, resolve_format
from qwenft.data.packing import PACKING, Plan, build_row, collate, pack_plan, pad_plan
from qwenft.data.workers import Prefetcher


def load_rows(path: str | os.PathLike) -> list:
    """Rows from a `.jsonl`/`.json` file, a `.parquet` file or a `datasets.save_to_disk` directory.

    A JSONL line that is not UTF-8 or not JSON becomes an `UnreadableRow`, which the data pipeline
    treats as a bad row (skipped and counted, or an error), so one broken line does not stop a run.
    """
    p = Path(path)
    if p.is_dir():
        return arrow_rows(load_dataset_dir(p).to_list())
    if not p.is_file():
        raise ValueError(f"data.path={str(path)!r} does not exist")
    if p.suffix == ".parquet":
        import pyarrow.parquet

        return arrow_rows(pyarrow.parquet.read_table(p).to_pylist())
    if p.suffix in (".jsonl", ".json"):
        return _read_json_lines(p)
    raise ValueError(f"data.path={str(path)!r} has an unknown format; expected a .jsonl, .json or .parquet "
                     "file or a datasets.save_to_disk directory")


FINGERPRINT_BYTES = 1 << 16


def fingerprint(path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> dict[str, dict]:
    """What a resume checks the data files against (qwenft.train.resume): each file's name (relative to the
    data dir, or its own for a file), size, and a SHA-256 of its first and last 64 KiB, which hold its first
    and last rows; a token cache inside a data dir (`.qwenft-cache/`, or `cache_dir` there) is not data. Reads
    128 KiB a file, so a large set costs little; a change inside a file that keeps its size and both ends goes
    unseen."""
    import hashlib

    p = Path(path)
    found = {}
    for f in data_files(p, cache_dir):
        size = f.stat().st_size
        with open(f, "rb") as stream:
            ends = stream.read(FINGERPRINT_BYTES)
            if size > FINGERPRINT_BYTES:
                stream.seek(max(FINGERPRINT_BYTES, size - FINGERPRINT_BYTES))
                ends += stream.read()
        name = str(f.relative_to(p)) if p.is_dir() else f.name
        found[name] = {"bytes": size, "ends_sha256": hashlib.sha256(ends).hexdigest()}
    return found


def check_source(path: str | os.PathLike) -> None:
    """The one-line error `load_rows` would give for a path it cannot read, without reading the rows."""
    p = Path(path)
    if p.is_dir():
        load_dataset_dir(p)
    elif not p.is_file():
        raise ValueError(f"data.path={str(path)!r} does not exist")
    elif p.suffix not in (".parquet", ".jsonl", ".json"):
        raise ValueError(f"data.path={str(path)!r} has an unknown format; expected a .jsonl, .json or .parquet "
                         "file or a datasets.save_to_disk directory")


def load_dataset_dir(p: Path):
    """The `datasets.Dataset` of a `save_to_disk` directory (memory-mapped Arrow), or a one-line error."""
    if not any((p / name).exists() for name in ("dataset_info.json", "state.json", "dataset_dict.json")):
        raise ValueError(f"data.path={str(p)!r} is a directory but not a datasets.save_to_disk "
                         "directory (no dataset_info.json / dataset_dict.json)")
    import datasets

    ds = datasets.load_from_disk(str(p))
    if isinstance(ds, datasets.DatasetDict):
        if len(ds) != 1:
            raise ValueError(f"data.path={str(p)!r} holds splits {sorted(ds)}; point data.path at "
                             f"one split's directory, e.g. {str(p / sorted(ds)[0])!r}")
        ds = next(iter(ds.values()))
    return ds


UTF8_BOM = b"\xef\xbb\xbf"  # some editors and exporters start a UTF-8 file with one


def is_json_array(path: Path) -> bool:
    """Whether `path` is a `.json` file holding one JSON array (else its lines are JSONL)."""
    with open(path, "rb") as f:
        return path.suffix == ".json" and f.read(1024).removeprefix(UTF8_BOM).lstrip()[:1] == b"["


def json_array_head(path: Path, n: int, chunk: int = 1 << 20) -> list:
    """The first `n` rows of a `.json` array, parsed as the file is read, not the whole file (every rank reads
    them at every start, `cache.source_format`). A malformed head gives `load_rows`' one-line error."""
    import codecs

    decoder, text_of = json.JSONDecoder(), codecs.getincrementaldecoder("utf-8-sig")()  # drops a BOM
    rows, text, pos, eof = [], "", 0, False
    with open(path, "rb") as f:
        def more() -> None:
            nonlocal text, pos, eof
            data = f.read(chunk)
            eof = not data
            text = text[pos:] + text_of.decode(data, final=eof)
            pos = 0

        def skip_space() -> str:  # the next character that is not white space ("" at the end)
            nonlocal pos
            while True:
                while pos < len(text) and text[pos] in " \t\r\n":
                    pos += 1
                if pos < len(text) or eof:
                    return text[pos:pos + 1]
                more()

        try:
            more()
            if skip_space() != "[":
                return load_rows(path)[:n]
            pos += 1
            while len(rows) < n:
                if skip_space() == "]":
                    break
                if rows:
                    if text[pos:pos + 1] != ",":
                        return load_rows(path)[:n]
                    pos += 1
                    skip_space()
                while True:  # a row, complete once something follows it (or the file ends)
                    try:
                        row, end = decoder.raw_decode(text, pos)
                        if (end < len(text) and text[end] in " \t\r\n,]") or eof:  # not a number cut short
                            break
                    except json.JSONDecodeError:
                        if eof:
                            return load_rows(path)[:n]
                    more()
                rows.append(row)
                pos = end
        except UnicodeDecodeError:
            return load_rows(path)[:n]
    return rows


def _read_json_lines(path: Path) -> list:
    raw = path.read_bytes().removeprefix(UTF8_BOM)
    if path.suffix == ".json" and raw.lstrip()[:1] == b"[":
        try:
            return json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"data.path={str(path)!r} is not a valid JSON array: {e}") from None
    return parse_json_lines(raw, path.name)


def parse_json_lines(raw: bytes, name: str, first_line: int = 1) -> list:
    """The rows of JSONL bytes (blank lines skipped); `first_line` numbers the first line in messages."""
    if first_line == 1:
        raw = raw.removeprefix(UTF8_BOM)
    rows = []
    for number, line in enumerate(raw.splitlines(), start=first_line):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line.decode("utf-8")))
        except UnicodeDecodeError:
            rows.append(UnreadableRow(f"line {number} of {name} is not valid UTF-8"))
        except json.JSONDecodeError as e:
            rows.append(UnreadableRow(f"line {number} of {name} is not valid JSON ({e.msg})"))
    return rows


def check_num_workers(num_workers) -> None:
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError(f"data.num_workers={num_workers!r} must be an integer >= 0 (threads making micro "
                         "batches ahead; 0 = make each in the training process when it is needed)")


class MicroBatchPlan(NamedTuple):
    """One micro batch of the global stream: where it starts, every rank's rows in stream order (each a list of
    document indices), this rank's rows, and the position after it (epoch, row)."""
    start: tuple[int, int]
    rows: list[list[int]]
    mine: list[list[int]]
    after: tuple[int, int]


class SFTData:
    """Infinite, resumable, dp-sharded stream of fixed-shape micro batches over tokenized documents."""

    def __init__(self, docs: Sequence[Document], seq_len: int, micro_batch_size: int, pad_id: int,
                 dp_rank: int = 0, dp_size: int = 1, seed: int = 0, packing: str = "pack",
                 skipped: Counter | None = None, num_workers: int = 0, prefetch: int | None = None):
        check_choice("data.packing", packing, PACKING)
        check_num_workers(num_workers)
        if not docs:
            described = skipped.describe() if isinstance(skipped, SkipCounts) else f"skipped: {dict(skipped or {})}"
            raise ValueError(f"no usable documents ({described}); check data.path, data.seq_len and "
                             "data.truncation")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} is outside [0, dp_size={dp_size})")
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size={micro_batch_size} must be >= 1")
        self.docs, self.seq_len, self.micro_batch_size, self.pad_id = docs, seq_len, micro_batch_size, pad_id
        self.dp_rank, self.dp_size, self.seed, self.packing = dp_rank, dp_size, seed, packing
        self.skipped = dict(skipped or {})
        self.fingerprint: dict | None = None  # of the files read (`fingerprint`); None for rows given in memory
        self.format: str | None = None  # the rows' format, `auto` resolved (set by the builders)
        self.cache_note = "tokenized in memory"  # where the documents came from, for the start log
        # documents' token counts: the cache's array, or counted once from documents in memory
        self.lengths = getattr(docs, "lengths", None)
        if self.lengths is None:
            self.lengths = np.array([len(doc.input_ids) for doc in docs], dtype=np.int64)
        self._epoch, self._row = 0, 0  # global position of the next unconsumed row
        self._rows_cache: dict[int, Plan] = {}
        # micro batches made in background threads (qwenft.data.workers), `prefetch` of them ahead; 0 = in `next`
        self.num_workers, self.prefetch = num_workers, prefetch or 2 * num_workers
        self._workers: Prefetcher | None = None
        self._ahead: deque[tuple[MicroBatchPlan, dict]] = deque()  # `make_ahead`'s batches, not yet handed out

    @property
    def num_documents(self) -> int:
        return len(self.docs)

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def epoch_progress(self) -> float:
        return self._epoch + self._row / self.rows_in_epoch(self._epoch)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The epoch's documents in training order: every document once, shuffled with (seed, epoch)."""
        order = list(range(len(self.docs)))
        random.Random(f"qwenft-data-{self.seed}-{epoch}").shuffle(order)
        return np.array(order, dtype=np.int64)

    def epoch_rows(self, epoch: int) -> Plan:
        """The epoch's global rows (`rows[r]`: a list of document indices), computed once from the lengths
        alone, the same on every rank; independent of dp."""
        if epoch not in self._rows_cache:
            order = self.epoch_order(epoch)
            rows = pad_plan(order) if self.packing == "pad" else pack_plan(order, self.lengths, self.seq_len)
            if len(self._rows_cache) == 2:  # two: the epoch handed out and the one the workers may be making
                del self._rows_cache[min(self._rows_cache)]
            self._rows_cache[epoch] = rows
        return self._rows_cache[epoch]

    def rows_in_epoch(self, epoch: int) -> int:
        return len(self.epoch_rows(epoch))

    def _row_tokens(self, doc_ids: list[int]):
        return build_row([self.docs[d] for d in doc_ids], self.seq_len, self.pad_id)

    def _collate(self, rows) -> dict:
        return collate(rows)

    def __iter__(self):
        return self

    def plan(self, epoch: int, row: int) -> MicroBatchPlan:
        """The micro batch whose first global row is `row` of `epoch`."""
        start, rows, mine = (epoch, row), [], []
        for k in range(self.micro_batch_size * self.dp_size):
            doc_ids = self.epoch_rows(epoch)[row]
            rows.append(doc_ids)
            if k % self.dp_size == self.dp_rank:
                mine.append(doc_ids)
            row += 1
            if row == self.rows_in_epoch(epoch):
                epoch, row = epoch + 1, 0
        return MicroBatchPlan(start, rows, mine, (epoch, row))

    def plans(self, epoch: int, row: int):
        """The stream's plans from global position (epoch, row) on."""
        while True:
            plan = self.plan(epoch, row)
            yield plan
            epoch, row = plan.after

    def make_batch(self, plan: MicroBatchPlan) -> dict:
        """The micro batch of `plan.mine`: a pure function of the plan, so a worker thread may run it."""
        return self._collate([self._row_tokens(doc_ids) for doc_ids in plan.mine])

    def make_ahead(self, n: int) -> None:
        """Make the next `n` micro batches now, in this thread, without moving the position: `next` hands them
        out. The runner calls it while the GPU finishes a step, so the next step's batches are ready when the
        host gets back to it. A no-op with workers (`num_workers > 0`), which make batches ahead anyway. A batch
        that fails to be made is left to `next`, which raises its error as it would have without this."""
        if self.num_workers:
            return
        epoch, row = self._ahead[-1][0].after if self._ahead else (self._epoch, self._row)
        while len(self._ahead) < n:
            plan = self.plan(epoch, row)
            try:
                batch = self.make_batch(plan)
            except Exception:
                # `next` makes this batch again in the next step and raises its error there, after this step has
                # stepped, logged and saved
                return
            self._ahead.append((plan, batch))
            epoch, row = plan.after

    def __next__(self) -> dict:
        if self.num_workers == 0:
            if self._ahead:
                plan, batch = self._ahead.popleft()
                self._hand_out(plan)
                return batch
            plan = self.plan(self._epoch, self._row)
            self._hand_out(plan)
            return self.make_batch(plan)
        if self._workers is None:
            self._workers = Prefetcher(self.make_batch, self.plans(self._epoch, self._row), self.num_workers,
                                       self.prefetch)
        plan, batch = self._workers.take()
        self._hand_out(plan)
        return batch.result()  # a worker's error is raised here, as `make_batch` raised it

    def _hand_out(self, plan: MicroBatchPlan) -> None:
        """Move the position (what a checkpoint saves) past `plan`, whose batch is being handed out."""
        assert plan.start == (self._epoch, self._row), (plan.start, self._epoch, self._row)
        for doc_ids in plan.rows:
            self._consume(doc_ids)
        self._epoch, self._row = plan.after

    def close(self) -> None:
        """Stop the worker threads (each finishes the batch it is making; the rest are dropped). The position
        stays; a later `next` starts them again from it. Batches made by `make_ahead` are dropped too."""
        self._ahead.clear()
        if self._workers is not None:
            self._workers.close()
            self._workers = None

    def _consume(self, doc_ids: list[int]) -> None:
        """Called with every row of the global stream as it is consumed (all ranks' rows)."""

    def source_tokens(self) -> dict[str, int]:
        """Tokens consumed so far per mixture source (`MixtureData`); none for one dataset."""
        return {}

    def eval_batches(self):
        """One pass over epoch 0's rows, this rank's share, padded with empty rows to whole micro batches.

        Every rank yields the same number of micro batches. Does not move the training position.
        """
        rows = self.epoch_rows(0)
        stride = self.micro_batch_size * self.dp_size
        for start in range(0, len(rows), stride):
            mine = [rows[k] if k < len(rows) else [] for k in range(start + self.dp_rank, start + stride, self.dp_size)]
            yield self._collate([self._row_tokens(doc_ids) for doc_ids in mine])

    def state_dict(self) -> dict:
        return {"epoch": self._epoch, "row": self._row, "seed": self.seed, "num_documents": len(self.docs),
                "packing": self.packing, "seq_len": self.seq_len}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "num_documents", "packing", "seq_len"):
            if state[key] != getattr(self, key):
                raise ValueError(f"data state was saved with {key}={state[key]!r} but this run has "
                                 f"{key}={getattr(self, key)!r}; resuming would not continue the same stream")
        self.close()  # batches made ahead from the old position
        self._epoch, self._row = state["epoch"], state["row"]


def load_documents(path_or_rows, tokenizer, seq_len: int, train_on: str = "assistant",
                   truncation: str = "truncate_right", on_bad_row: str = "skip", cache: bool = True,
                   cache_dir: str | os.PathLike | None = None, num_proc: int | None = None,
                   data_format: str = "auto") -> tuple[Sequence[Document], SkipCounts, str, str]:
    """(documents, skipped rows per reason, where they came from, the rows' format): a path's token cache
    (`qwenft.data.cache`, built on first use; `auto` decided from the first rows), or rows in memory (or a
    path with `cache=False`) tokenized in this process (`auto` decided from all rows)."""
    check_choice("data.on_bad_row", on_bad_row, ON_BAD_ROW)
    if isinstance(path_or_rows, (str, os.PathLike)) and cache:
        check_source(path_or_rows)
        docs, built = open_cache(path_or_rows, tokenizer, seq_len, train_on, truncation, data_format, cache_dir,
                                 num_proc)
        if on_bad_row == "error":
            docs.raise_first_bad_row()
        note = f"token cache {docs.directory} ({'built here' if built else 'reused'})"
        return docs, docs.skipped, note, docs.format
    rows = load_rows(path_or_rows) if isinstance(path_or_rows, (str, os.PathLike)) else path_or_rows
    data_format, _ = resolve_format(rows, data_format)
    docs, skipped = tokenize_rows(rows, tokenizer, seq_len, train_on, truncation, on_bad_row, data_format)
    return docs, skipped, "tokenized in memory", data_format


def build_sft_data(path_or_rows, tokenizer, seq_len: int, micro_batch_size: int, dp_rank: int = 0,
                   dp_size: int = 1, seed: int = 0, packing: str = "pack", train_on: str = "assistant",
                   truncation: str = "truncate_right", on_bad_row: str = "skip", data_format: str = "auto",
                   cache: bool = True, cache_dir: str | os.PathLike | None = None,
                   num_proc: int | None = None) -> SFTData:
    """Documents from `load_documents` (a path: through its token cache; rows in memory: tokenized here),
    streamed as packed, dp-sharded micro batches."""
    if tokenizer.pad_token_id is None:
        raise ValueError("the tokenizer has no pad token; set one (Qwen's is <|endoftext|>)")
    docs, skipped, note, data_format = load_documents(path_or_rows, tokenizer, seq_len, train_on, truncation,
                                                      on_bad_row, cache, cache_dir, num_proc, data_format)
    data = SFTData(docs, seq_len, micro_batch_size, tokenizer.pad_token_id, dp_rank, dp_size, seed, packing,
                   skipped)
    data.cache_note, data.format = note, data_format
    if isinstance(path_or_rows, (str, os.PathLike)):
        data.fingerprint = fingerprint(path_or_rows, cache_dir if cache else None)
    return data
