"""Chat SFT data for the runner: read rows, tokenize once, pack per epoch, hand out dp-sharded micro batches.

API (what the runner uses):

    data = build_sft_data(path, tokenizer, seq_len, micro_batch_size, dp_rank=0, dp_size=1, seed=0,
                          packing="pack", train_on="assistant", truncation="truncate_right",
                          on_bad_row="skip", data_format="auto")   # -> SFTData
    batch = next(data)       # infinite over epochs; `for batch in data:` works too
    batch["input_ids"]       # [B, T] long          B = micro_batch_size, T = seq_len
    batch["labels"]          # [B, T] long, IGNORE_INDEX = ignored, PRE-SHIFTED: loss = CE(logits[:, t], labels[:, t])
    batch["position_ids"]    # [B, T] long, restart at 0 for every document and for the padding tail
    batch["cu_seqlens"]      # [n_segments + 1] int32 offsets of segment starts over the flattened B*T
    batch["padding_mask"]    # [B, T] bool, true on each row's padding tail (no document's token)
    data.epoch, data.epoch_progress   # epoch of the next row; epochs done as a float, for logging
    data.skipped             # {reason: count} of rows not trained on (log it once at start)
    data.format              # the rows' format (formats.FORMATS), data_format or what `auto` found
    data.num_documents, data.rows_in_epoch(e)
    data.state_dict() / data.load_state_dict(sd)   # resume continues exactly (same for every rank)
    data.eval_batches()      # one finite pass (for validation), last micro batch padded with empty rows

Sharding. Each epoch's documents are shuffled with (seed, epoch) and packed into rows; this depends on
neither dp_rank nor dp_size. The epochs are concatenated into one global stream of rows, consumed in
lockstep by all ranks: each call to `next` on every rank together consumes the next `B * dp_size` rows,
rank r taking rows `pos + j * dp_size + r` for j < B. So with grad accumulation A, microbatch i of
optimizer step s on rank r holds global rows `(s*A + i)*B*dp + j*dp + r`, and step s of any mesh covers
global rows [s*G, (s+1)*G) for G = A*B*dp: dp=2 (or any dp) sees the same global batches as dp=1 with
the same G. A micro batch may straddle an epoch boundary; no row is dropped.

The state is the global position (epoch, row within epoch), identical on every rank, so a checkpoint
restores exactly — also with another dp_size or micro_batch_size, which then continue the same stream.
"""

import json
import os
import random
from collections import Counter
from pathlib import Path

from qwenft.data.chat import Document, UnreadableRow, check_choice, tokenize_rows
from qwenft.data.formats import resolve_format
from qwenft.data.packing import PACKING, build_row, collate, pack_documents


def load_rows(path: str | os.PathLike) -> list:
    """Rows from a `.jsonl`/`.json` file, a `.parquet` file or a `datasets.save_to_disk` directory.

    A JSONL line that is not UTF-8 or not JSON becomes an `UnreadableRow`, which the data pipeline
    treats as a bad row (skipped and counted, or an error), so one broken line does not stop a run.
    """
    p = Path(path)
    if p.is_dir():
        if not any((p / name).exists() for name in ("dataset_info.json", "state.json", "dataset_dict.json")):
            raise ValueError(f"data.path={str(path)!r} is a directory but not a datasets.save_to_disk "
                             "directory (no dataset_info.json / dataset_dict.json)")
        import datasets

        ds = datasets.load_from_disk(str(p))
        if isinstance(ds, datasets.DatasetDict):
            if len(ds) != 1:
                raise ValueError(f"data.path={str(path)!r} holds splits {sorted(ds)}; point data.path at "
                                 f"one split's directory, e.g. {str(p / sorted(ds)[0])!r}")
            ds = next(iter(ds.values()))
        return ds.to_list()
    if not p.is_file():
        raise ValueError(f"data.path={str(path)!r} does not exist")
    if p.suffix == ".parquet":
        import pyarrow.parquet

        return pyarrow.parquet.read_table(p).to_pylist()
    if p.suffix in (".jsonl", ".json"):
        return _read_json_lines(p)
    raise ValueError(f"data.path={str(path)!r} has an unknown format; expected a .jsonl, .json or .parquet "
                     "file or a datasets.save_to_disk directory")


FINGERPRINT_BYTES = 1 << 16


def fingerprint(path: str | os.PathLike) -> dict[str, dict]:
    """What a resume checks the data files against (qwenft.train.resume): each file's name (relative to the
    data dir, or its own for a file), size, and a SHA-256 of its first and last 64 KiB, which hold its first
    and last rows. Reads 128 KiB a file, so a large set costs little; a change inside a file that keeps its
    size and both ends goes unseen."""
    import hashlib

    p = Path(path)
    files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    found = {}
    for f in files:
        size = f.stat().st_size
        with open(f, "rb") as stream:
            ends = stream.read(FINGERPRINT_BYTES)
            if size > FINGERPRINT_BYTES:
                stream.seek(max(FINGERPRINT_BYTES, size - FINGERPRINT_BYTES))
                ends += stream.read()
        name = str(f.relative_to(p)) if p.is_dir() else f.name
        found[name] = {"bytes": size, "ends_sha256": hashlib.sha256(ends).hexdigest()}
    return found


def _read_json_lines(path: Path) -> list:
    raw = path.read_bytes()
    if path.suffix == ".json" and raw.lstrip()[:1] == b"[":
        try:
            return json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"data.path={str(path)!r} is not a valid JSON array: {e}") from None
    rows = []
    for number, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line.decode("utf-8")))
        except UnicodeDecodeError:
            rows.append(UnreadableRow(f"line {number} of {path.name} is not valid UTF-8"))
        except json.JSONDecodeError as e:
            rows.append(UnreadableRow(f"line {number} of {path.name} is not valid JSON ({e.msg})"))
    return rows


class SFTData:
    """Infinite, resumable, dp-sharded stream of fixed-shape micro batches over tokenized documents."""

    def __init__(self, docs: list[Document], seq_len: int, micro_batch_size: int, pad_id: int,
                 dp_rank: int = 0, dp_size: int = 1, seed: int = 0, packing: str = "pack",
                 skipped: Counter | None = None):
        check_choice("data.packing", packing, PACKING)
        if not docs:
            raise ValueError(f"no usable documents (skipped: {dict(skipped or {})}); check data.path, "
                             "data.seq_len and data.truncation")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} is outside [0, dp_size={dp_size})")
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size={micro_batch_size} must be >= 1")
        self.docs, self.seq_len, self.micro_batch_size, self.pad_id = docs, seq_len, micro_batch_size, pad_id
        self.dp_rank, self.dp_size, self.seed, self.packing = dp_rank, dp_size, seed, packing
        self.skipped = dict(skipped or {})
        self.fingerprint: dict | None = None  # of the files read (`fingerprint`); None for rows given in memory
        self._epoch, self._row = 0, 0  # global position of the next unconsumed row
        self._rows_cache: tuple[int, list[list[int]]] | None = None

    @property
    def num_documents(self) -> int:
        return len(self.docs)

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def epoch_progress(self) -> float:
        return self._epoch + self._row / self.rows_in_epoch(self._epoch)

    def epoch_rows(self, epoch: int) -> list[list[int]]:
        """The epoch's global row order, each row a list of document indices; independent of dp."""
        if self._rows_cache is None or self._rows_cache[0] != epoch:
            order = list(range(len(self.docs)))
            random.Random(f"qwenft-data-{self.seed}-{epoch}").shuffle(order)
            if self.packing == "pad":
                rows = [[d] for d in order]
            else:
                packed = pack_documents([len(self.docs[d].input_ids) for d in order], self.seq_len)
                rows = [[order[k] for k in row] for row in packed]
            self._rows_cache = (epoch, rows)
        return self._rows_cache[1]

    def rows_in_epoch(self, epoch: int) -> int:
        return len(self.epoch_rows(epoch))

    def _row_tokens(self, doc_ids: list[int]):
        return build_row([self.docs[d] for d in doc_ids], self.seq_len, self.pad_id)

    def _collate(self, rows) -> dict:
        return collate(rows)

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        mine = []
        for k in range(self.micro_batch_size * self.dp_size):
            if k % self.dp_size == self.dp_rank:
                mine.append(self._row_tokens(self.epoch_rows(self._epoch)[self._row]))
            self._row += 1
            if self._row == self.rows_in_epoch(self._epoch):
                self._epoch, self._row = self._epoch + 1, 0
        return self._collate(mine)

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
        self._epoch, self._row = state["epoch"], state["row"]


def build_sft_data(path_or_rows, tokenizer, seq_len: int, micro_batch_size: int, dp_rank: int = 0,
                   dp_size: int = 1, seed: int = 0, packing: str = "pack", train_on: str = "assistant",
                   truncation: str = "truncate_right", on_bad_row: str = "skip",
                   data_format: str = "auto") -> SFTData:
    """Read (a path, or rows already in memory), tokenize through the chat template, and stream."""
    rows = load_rows(path_or_rows) if isinstance(path_or_rows, (str, os.PathLike)) else path_or_rows
    data_format, _ = resolve_format(rows, data_format)
    docs, skipped = tokenize_rows(rows, tokenizer, seq_len, train_on, truncation, on_bad_row, data_format)
    if tokenizer.pad_token_id is None:
        raise ValueError("the tokenizer has no pad token; set one (Qwen's is <|endoftext|>)")
    data = SFTData(docs, seq_len, micro_batch_size, tokenizer.pad_token_id, dp_rank, dp_size, seed,
                   packing, skipped)
    data.format = data_format
    if isinstance(path_or_rows, (str, os.PathLike)):
        data.fingerprint = fingerprint(path_or_rows)
    return data
