"""Tokenize a chat dataset once into a memory-mapped cache that every rank, node and later run reads.

On disk, one directory per (data, tokenizer, settings), named `<data stem>-<key>`:

    tokens.npy    int32 [n_tokens]       every document's ids, one after another
    offsets.npy   int64 [n_docs + 1]     document d is tokens[offsets[d]:offsets[d+1]]
    targets.npy   uint8 [n_tokens]       1 where labels[t] = tokens[t+1] (pre-shifted), 0 where IGNORE_INDEX
    meta.json     documents, tokens, rows read, skipped rows per reason, the first bad row per reason,
                  and everything the key was computed from

About 5 bytes a token. A rank reads the documents it packs with positioned reads (`CachedDocuments`), so
its resident data memory does not grow with the dataset. The key is a sha256 over everything
that changes the tokens: the data files (path, size, mtime and a hash of the first and last MiB), the
tokenizer (its full serialization, special tokens and chat template), seq_len, truncation, train_on, the
row format (`data.format`; `auto` resolved from the first AUTO_SAMPLE_ROWS rows) and CACHE_VERSION.
`on_bad_row` is not in the key: rows are always tokenized in skip mode and the first bad row of each
reason is stored, so `on_bad_row=error` raises the same one-line error from the cache.

Build: whichever process creates `<dir>.lock` with O_EXCL builds (the others poll for the finished
directory), tokenizing row shards in `num_proc` worker processes into a temp directory that is renamed
into place when complete, so a half-written cache is never read. The builder touches the lock every 30 s
while it builds; a lock untouched for STALE_LOCK_S (its builder was killed) is taken over.
"""

import contextlib
import hashlib
import json
import logging
import os
import shutil
import socket
import threading
import time
import weakref
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from qwenft.constants import IGNORE_INDEX
from qwenft.data.chat import (TRAIN_ON, TRUNCATION, BadRow, Document, SkipCounts, check_choice, row_tokens,
                              shift_labels)
from qwenft.data.formats import arrow_rows, resolve_format

log = logging.getLogger("qwenft")

# 2: rows read by data.format (sharegpt, alpaca) with their `tools` column; 3: reasoning_content, rewritten
# replies, Arrow's null keys dropped, `last_turn`; 4: a reply ends after its tool calls' arguments; 5: a reply
# starts after its whole generation prompt header, and the text is tokenized in pieces cut at each reply's start
CACHE_VERSION = 5
STALE_LOCK_S = 600.0
SHARD_BYTES = 8 << 20  # JSONL bytes per worker task: ~10k chat rows, a few seconds of tokenizing
SHARD_ROWS = 10_000  # rows per task for Parquet row groups split further, JSON arrays and datasets dirs
FINGERPRINT_BYTES = 1 << 20
CACHE_DIRNAME = ".qwenft-cache"
AUTO_SAMPLE_ROWS = 1000  # data.format=auto is decided from this many first rows, not the whole set
DEFAULT_FALLBACK = Path("~/.cache/qwenft/data")
LENGTH_REASONS = ("too_long", "no_target_left")  # follow data.truncation, not data.on_bad_row


# ---------------------------------------------------------------- where and under which key

def default_cache_root(data_path: Path) -> Path:
    """`.qwenft-cache/` beside the data: the cache is as large as the data's tokens, so it belongs on the
    data's filesystem, which every node that reads the data sees. Falls back to ~/.cache/qwenft/data when
    that directory is not writable, or is inside the qwenft package (the shipped tiny set)."""
    parent = (data_path if data_path.is_dir() else data_path.parent).resolve()
    package = Path(__file__).resolve().parents[1]
    if os.access(parent, os.W_OK) and not parent.is_relative_to(package):
        return parent / CACHE_DIRNAME
    return DEFAULT_FALLBACK.expanduser()


def file_fingerprint(path: Path) -> dict:
    stat = path.stat()
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        digest.update(f.read(FINGERPRINT_BYTES))
        if stat.st_size > FINGERPRINT_BYTES:
            f.seek(max(FINGERPRINT_BYTES, stat.st_size - FINGERPRINT_BYTES))
            digest.update(f.read())
    return {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "head_tail_sha256": digest.hexdigest()}


def data_files(path: Path, cache_dir: str | os.PathLike | None = None) -> list[Path]:
    """The data's files: `path` itself, or a directory's files but its token caches (`.qwenft-cache/`, and
    `cache_dir` when it lies inside), which are not data."""
    if not path.is_dir():
        return [path]
    inside = Path(cache_dir).expanduser().resolve() if cache_dir else None
    if inside is not None and (inside == path.resolve() or not inside.is_relative_to(path.resolve())):
        inside = None  # only a cache dir strictly inside the data dir holds files that are not data
    return sorted(p for p in path.rglob("*") if p.is_file() and CACHE_DIRNAME not in p.relative_to(path).parts
                  and not (inside and p.resolve().is_relative_to(inside)))


def data_fingerprint(path: Path, cache_dir: str | os.PathLike | None = None) -> list[dict]:
    return [file_fingerprint(p) for p in data_files(path, cache_dir)]


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of what the tokenizer does: its full serialization (fast tokenizers) or vocabulary, its special
    tokens and chat template."""
    digest = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        digest.update(backend.to_str().encode())
    else:
        digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    digest.update(json.dumps([type(tokenizer).__name__, tokenizer.chat_template, tokenizer.eos_token,
                              tokenizer.pad_token, sorted(map(str, tokenizer.all_special_tokens))]).encode())
    return digest.hexdigest()


def cache_key(path: Path, tokenizer, seq_len: int, train_on: str, truncation: str, fmt: str,
              cache_dir: str | os.PathLike | None = None) -> dict:
    """Everything that changes the cached tokens; its sha256 names the cache directory."""
    return {"version": CACHE_VERSION, "files": data_fingerprint(path, cache_dir),
            "tokenizer": tokenizer_fingerprint(tokenizer),
            "seq_len": seq_len, "train_on": train_on, "truncation": truncation, "format": fmt}


def cache_dir_for(path: Path, key: dict, cache_root: Path) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root / f"{path.stem if path.is_file() else path.name}-{digest}"


# ---------------------------------------------------------------- reading the cache

class CachedDocuments:
    """The cached documents as a read-only sequence of `chat.Document`.

    A document is read with positioned reads (`os.pread`) from the token and target files, so its bytes
    come from the OS page cache that all ranks of a node share, and nothing stays mapped into the process:
    a memory map's pages would count in a rank's resident memory as it touches them, growing to the whole
    token file over an epoch. The offsets (8 bytes a document) are read into memory."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._files = {}
        try:
            self.meta = json.loads((directory / "meta.json").read_text())
            self.offsets = np.load(directory / "offsets.npy")
            for name in ("tokens", "targets"):
                self._files[name] = _open_npy(directory / f"{name}.npy")
                weakref.finalize(self, self._files[name][0].close)
            self._check()
        except (OSError, ValueError, KeyError, EOFError) as e:  # json's and numpy's errors are ValueErrors
            raise ValueError(f"the token cache {directory} is damaged ({e}); delete that directory and the run "
                             "builds it again") from None
        self.lengths = np.diff(self.offsets)

    def _check(self) -> None:
        """Raise when the files do not hold what meta.json says (a cache cut short by a full disk or a crash)."""
        documents, tokens = self.meta["documents"], self.meta["tokens"]
        if self.offsets.shape != (documents + 1,) or self.offsets[-1] != tokens:
            raise ValueError(f"offsets.npy has shape {list(self.offsets.shape)}, meta.json {documents} documents of "
                             f"{tokens} tokens")
        for name, (file, data_at, dtype) in self._files.items():
            size = os.fstat(file.fileno()).st_size
            if size != data_at + tokens * dtype.itemsize:
                raise ValueError(f"{name}.npy has {size} bytes, not the {data_at + tokens * dtype.itemsize} of "
                                 f"{tokens} tokens")

    @property
    def tokens(self) -> np.ndarray:
        """All token ids, memory-mapped (for inspection; training reads documents one by one)."""
        return np.load(self.directory / "tokens.npy", mmap_mode="r")

    @property
    def targets(self) -> np.ndarray:
        return np.load(self.directory / "targets.npy", mmap_mode="r")

    def _read(self, name: str, start: int, end: int) -> np.ndarray:
        file, data_at, dtype = self._files[name]
        size = dtype.itemsize
        return np.frombuffer(os.pread(file.fileno(), (end - start) * size, data_at + start * size), dtype=dtype)

    @property
    def skipped(self) -> SkipCounts:
        return SkipCounts(self.meta["skipped"], self.meta["first_bad"])

    @property
    def format(self) -> str:
        """The row format the documents were read as (`auto` already resolved)."""
        return self.meta["key"]["format"]

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, d: int) -> Document:
        start, end = int(self.offsets[d]), int(self.offsets[d + 1])
        ids = self._read("tokens", start, end).astype(np.int64)
        labels = np.full(end - start, IGNORE_INDEX, dtype=np.int64)
        target = self._read("targets", start, end - 1).astype(bool)
        labels[:-1][target] = ids[1:][target]
        return Document(ids, labels)  # int64 arrays: rows are built in numpy (packing.build_row)

    def raise_first_bad_row(self) -> None:
        """`data.on_bad_row=error`: the one-line error of the first bad row, as the in-memory pipeline gives."""
        bad = [(index, detail) for reason, (index, detail) in self.meta["first_bad"].items()
               if reason not in LENGTH_REASONS]
        if bad:
            index, detail = min(bad)
            raise ValueError(f"data row {index}: {detail} (set data.on_bad_row=skip to skip such rows)")


def _open_npy(path: Path) -> tuple:
    """(open binary file, byte offset of the data, dtype) of a 1-d `.npy` file."""
    f = open(path, "rb")
    try:
        version = np.lib.format.read_magic(f)
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read_header(f)
        if fortran or len(shape) != 1:
            raise ValueError(f"{path.name} is not a 1-d array")
        return f, f.tell(), dtype
    except BaseException:
        f.close()
        raise


def _write_npy(path: Path, parts: list[str], dtype, n: int) -> None:
    """Concatenate 1-d `.npy` files into one of `n` items by streaming their bytes (not through a memory
    map, whose written pages would count in the builder's resident memory), deleting each part."""
    with open(path, "wb") as out:
        np.lib.format.write_array_header_1_0(out, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
                                                  "fortran_order": False, "shape": (n,)})
        for part in parts:
            out.write(np.load(part).tobytes())
            os.unlink(part)


# ---------------------------------------------------------------- building it

@dataclass(frozen=True)
class Shard:
    """A slice of the source rows: a JSONL byte range, a Parquet row group's row range, or rows in hand."""
    kind: str  # "jsonl" | "parquet" | "dataset" | "rows"
    path: str
    start: int = 0
    end: int = 0
    group: int = 0  # the Parquet row group; for JSONL the 1-based number of the shard's first line
    rows: tuple = ()


def plan_shards(path: Path) -> list[Shard]:
    """Shards of the source in row order. A JSONL file is split at line ends by bytes; a `.json` array is
    read here (it has to be parsed whole) and handed out in row slices."""
    if path.is_dir():
        from qwenft.data.loader import load_dataset_dir

        n = len(load_dataset_dir(path))
        return [Shard("dataset", str(path), a, min(a + SHARD_ROWS, n)) for a in range(0, n, SHARD_ROWS)]
    if path.suffix == ".parquet":
        import pyarrow.parquet

        meta = pyarrow.parquet.ParquetFile(path).metadata
        return [Shard("parquet", str(path), a, min(a + SHARD_ROWS, meta.row_group(g).num_rows), group=g)
                for g in range(meta.num_row_groups) for a in range(0, meta.row_group(g).num_rows, SHARD_ROWS)]
    from qwenft.data.loader import is_json_array, load_rows

    if is_json_array(path):
        rows = load_rows(path)
        return [Shard("rows", str(path), rows=tuple(rows[a:a + SHARD_ROWS])) for a in range(0, len(rows), SHARD_ROWS)]
    with open(path, "rb") as f:
        # one pass: cut at the first line end after every SHARD_BYTES, counting lines for the error messages
        shards, start, first_line, lines = [], 0, 1, 0
        while block := f.read(SHARD_BYTES):
            rest = f.readline()  # to the end of the line the cut falls in
            lines += block.count(b"\n") + rest.count(b"\n")
            end = f.tell()
            shards.append(Shard("jsonl", str(path), start, end, group=first_line))
            start, first_line = end, lines + 1
    return shards


def shard_rows(shard: Shard) -> list:
    if shard.kind == "rows":
        return list(shard.rows)
    if shard.kind == "dataset":
        from qwenft.data.loader import load_dataset_dir

        return arrow_rows(load_dataset_dir(Path(shard.path)).select(range(shard.start, shard.end)).to_list())
    if shard.kind == "parquet":
        import pyarrow.parquet

        # Streamed in batches to the shard's rows, not the row group read whole: pandas writes up to a million
        # rows as one group, which each of its shards' workers would otherwise hold at once (a shard still reads
        # the group's batches before its own, which are cheap next to tokenizing them: 0.1 s for 400k rows).
        batches = pyarrow.parquet.ParquetFile(shard.path).iter_batches(batch_size=SHARD_ROWS, row_groups=[shard.group])
        rows, at = [], 0
        for batch in batches:
            if at + batch.num_rows > shard.start:
                first = max(shard.start - at, 0)
                rows += batch.slice(first, shard.end - at - first).to_pylist()
            at += batch.num_rows
            if at >= shard.end:
                break
        return arrow_rows(rows)
    from qwenft.data.loader import parse_json_lines

    with open(shard.path, "rb") as f:
        f.seek(shard.start)
        raw = f.read(shard.end - shard.start)
    return parse_json_lines(raw, Path(shard.path).name, first_line=shard.group)


def head_rows(path: Path, n: int = AUTO_SAMPLE_ROWS) -> list:
    """The first `n` rows of the source, read without the rest."""
    if path.is_dir():
        from qwenft.data.loader import load_dataset_dir

        ds = load_dataset_dir(path)
        return arrow_rows(ds.select(range(min(n, len(ds)))).to_list())
    if path.suffix == ".parquet":
        import pyarrow.parquet

        first = next(pyarrow.parquet.ParquetFile(path).iter_batches(batch_size=n), None)
        return arrow_rows(first.to_pylist()) if first is not None else []
    from qwenft.data.loader import is_json_array, json_array_head, parse_json_lines

    if is_json_array(path):
        return json_array_head(path, n)
    with open(path, "rb") as f:
        lines, rows = [], 0
        for line in f:
            lines.append(line)
            rows += bool(line.strip())  # blank lines are not rows
            if rows == n:
                break
    return parse_json_lines(b"".join(lines), path.name)


def source_format(path: Path, fmt: str) -> str:
    """`fmt` (data.format), with `auto` resolved by `formats.resolve_format` over the source's first
    AUTO_SAMPLE_ROWS rows: the format whose columns most of them have."""
    return resolve_format(head_rows(path, AUTO_SAMPLE_ROWS) if fmt == "auto" else [], fmt)[0]


def tokenize_shard(shard: Shard, tokenizer, seq_len: int, train_on: str, truncation: str, fmt: str,
                   out: str) -> dict:
    """Tokenize one shard (skip mode) into `out`.{tokens,lengths,targets}.npy by `chat.tokenize_rows`'s rules
    (tested equal), each row read as `fmt` through the same `chat.row_tokens`; returns its counts and, per
    skip reason, the first bad row (index within the shard, message)."""
    ids_parts, target_parts, lengths = [], [], []
    skipped, first_bad = Counter(), {}
    rows = shard_rows(shard)
    for index, row in enumerate(rows):
        try:
            ids, is_target = row_tokens(row, tokenizer, train_on, fmt)
        except BadRow as e:
            skipped[e.reason] += 1
            first_bad.setdefault(e.reason, (index, str(e)))
            continue
        if len(ids) > seq_len:
            if truncation == "drop":
                skipped["too_long"] += 1
                first_bad.setdefault("too_long", (index, f"{len(ids)} tokens > data.seq_len={seq_len}"))
                continue
            ids, is_target = ids[:seq_len], is_target[:seq_len]
        labels = shift_labels(ids, is_target)
        targets = np.array(labels, dtype=np.int64) != IGNORE_INDEX
        if not targets.any():
            skipped["no_target_left"] += 1
            first_bad.setdefault("no_target_left", (index, f"truncation to data.seq_len={seq_len} left no learned token"))
            continue
        ids_parts.append(np.array(ids, dtype=np.int32))
        target_parts.append(targets.astype(np.uint8))
        lengths.append(len(ids))
    np.save(out + ".tokens.npy", np.concatenate(ids_parts) if ids_parts else np.zeros(0, np.int32))
    np.save(out + ".targets.npy", np.concatenate(target_parts) if target_parts else np.zeros(0, np.uint8))
    np.save(out + ".lengths.npy", np.array(lengths, dtype=np.int64))
    return {"rows": len(rows), "skipped": dict(skipped), "first_bad": first_bad}


def build(path: Path, tokenizer, seq_len: int, train_on: str, truncation: str, key: dict, final: Path,
          num_proc: int) -> None:
    """Tokenize `path` into `final` (through a temp dir renamed into place)."""
    start = time.perf_counter()
    tmp = final.with_name(f"{final.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    tmp.mkdir(parents=True)
    try:
        shards = plan_shards(path)
        outs = [str(tmp / f"shard-{i:06d}") for i in range(len(shards))]
        args = (tokenizer, seq_len, train_on, truncation, key["format"])
        workers = max(1, min(num_proc, len(shards)))
        log.info("data: tokenizing %s (%d shards, %d process%s) into %s", path, len(shards), workers,
                 "es" if workers > 1 else "", final)
        results = []
        if workers == 1:
            for shard, out in zip(shards, outs):
                results.append(tokenize_shard(shard, *args, out))
        else:
            # spawn, not fork: the caller may hold a process group's threads
            with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
                results = list(pool.map(tokenize_shard, shards, *([a] * len(shards) for a in args), outs))
        lengths = [np.load(out + ".lengths.npy") for out in outs]
        n_docs, n_tokens = sum(map(len, lengths)), int(sum(int(x.sum()) for x in lengths))
        offsets = np.zeros(n_docs + 1, dtype=np.int64)
        np.cumsum(np.concatenate(lengths) if lengths else np.zeros(0, np.int64), out=offsets[1:])
        np.save(tmp / "offsets.npy", offsets)
        for name, dtype in (("tokens", np.int32), ("targets", np.uint8)):
            _write_npy(tmp / f"{name}.npy", [f"{out}.{name}.npy" for out in outs], dtype, n_tokens)
        for out in outs:
            os.unlink(out + ".lengths.npy")
        skipped, first_bad, row0 = Counter(), {}, 0
        for result in results:
            skipped.update(result["skipped"])
            for reason, (index, detail) in result["first_bad"].items():
                first_bad.setdefault(reason, (row0 + index, detail))
            row0 += result["rows"]
        meta = {"documents": n_docs, "tokens": n_tokens, "rows": row0, "skipped": dict(sorted(skipped.items())),
                "first_bad": first_bad, "build_seconds": round(time.perf_counter() - start, 2),
                "num_proc": workers, "key": key}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
        _sync(tmp)  # on disk before the rename publishes it: a crash after leaves a whole cache, not empty files
        try:
            os.rename(tmp, final)
        except OSError:  # a builder that took over a stale lock finished first: its cache is as good
            if not (final / "meta.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _touched(lock: Path):
    """The lock's mtime renewed every STALE_LOCK_S / 20 while the block runs, between shards or not (concatenating
    them, syncing): only a builder that died, or one whose single call holds the GIL that long (json's parse of a
    huge `.json` array), leaves it untouched for STALE_LOCK_S."""
    done = threading.Event()

    def touch():
        while not done.wait(STALE_LOCK_S / 20):
            with contextlib.suppress(FileNotFoundError):
                os.utime(lock)

    thread = threading.Thread(target=touch, daemon=True, name="qwenft-cache-lock")
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _sync(directory: Path) -> None:
    """fsync every file of `directory`, then the directory itself."""
    for f in directory.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_cache(path: str | os.PathLike, tokenizer, seq_len: int, train_on: str = "assistant",
               truncation: str = "truncate_right", fmt: str = "auto",
               cache_dir: str | os.PathLike | None = None, num_proc: int | None = None,
               poll_s: float = 0.2) -> tuple[CachedDocuments, bool]:
    """The cache of `path` for these settings (`fmt`: data.format, `auto` resolved by `source_format`), built
    here if no other process is building it, else waited for; returns (documents, whether this call built
    them). `documents.format` is the resolved format."""
    check_choice("data.train_on", train_on, TRAIN_ON)
    check_choice("data.truncation", truncation, TRUNCATION)
    num_proc = num_proc or os.cpu_count() or 1
    if num_proc < 1:
        raise ValueError(f"data.num_proc={num_proc} must be >= 1 (or null for the machine's cores)")
    path = Path(path)
    if not path.exists():
        raise ValueError(f"data.path={str(path)!r} does not exist")
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_root(path)
    key = cache_key(path, tokenizer, seq_len, train_on, truncation, source_format(path, fmt), root)
    final = cache_dir_for(path, key, root)
    lock = final.with_name(final.name + ".lock")
    built, waited = False, False
    while not (final / "meta.json").is_file():
        try:
            root.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            if not waited:
                log.info("data: waiting for another process to build the token cache %s", final)
                waited = True
            try:
                if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
                    log.warning("data: %s was not touched for %.0f s (its builder died?); building here",
                                lock, STALE_LOCK_S)
                    lock.unlink(missing_ok=True)
            except FileNotFoundError:
                pass
            time.sleep(poll_s)
            continue
        except OSError as e:
            raise ValueError(f"data.cache_dir={str(root)!r}: cannot write the token cache there ({e.strerror}); "
                             "set data.cache_dir to a writable directory") from None
        try:
            os.write(fd, f"{socket.gethostname()} {os.getpid()}\n".encode())
            os.close(fd)
            if not (final / "meta.json").is_file():
                with _touched(lock):
                    build(path, tokenizer, seq_len, train_on, truncation, key, final, num_proc)
                built = True
        finally:
            lock.unlink(missing_ok=True)
    return CachedDocuments(final), built
