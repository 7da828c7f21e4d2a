"""Dataset mixtures (`data.sources`): several datasets in one stream, each holding a weighted share of the tokens.

An epoch of a mixture holds as many tokens as all its sources together (the size of their concatenation);
source i contributes `weight_i / sum(weights)` of them. The order is drawn document by document: the next
document comes from the source furthest below its share so far (tokens drawn / weight, lowest first; ties
to the earlier source), and each source hands out its documents in its own shuffle, seeded by
(seed, epoch, source, pass); a source drawn past its end starts a new pass with a new shuffle (upsampled),
one drawn less sees only the first part of its shuffle that epoch (downsampled). So every source's token
share is within one document of its weight at every point of the stream, with no randomness beyond the
shuffles, and the order depends only on the data, the weights and `seed`, never on the mesh. Packing,
sharding and resume are `SFTData`'s.
"""

import heapq
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from qwenft.data.chat import Document
from qwenft.data.loader import SFTData, fingerprint, load_documents


@dataclass(frozen=True)
class Source:
    name: str  # for the start log and the metrics (`tokens/<name>`)
    path: str
    weight: float
    format: str  # data.format's values; `auto` is resolved per source


class ConcatDocuments:
    """Several sources' documents as one sequence; source s holds indices `starts[s]:starts[s+1]`."""

    def __init__(self, parts: list):
        self.parts = parts
        self.starts = np.cumsum([0] + [len(p) for p in parts])
        self.lengths = np.concatenate([np.asarray(p.lengths, dtype=np.int64) for p in parts])
        self.source_of = np.repeat(np.arange(len(parts)), np.diff(self.starts))

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, d: int) -> Document:
        s = int(self.source_of[d])
        return self.parts[s][d - int(self.starts[s])]


def source_names(paths: list[str]) -> list[str]:
    """Each source's file stem, made unique with its index where two share one (and again with `_index` where
    that meets another's stem: `a.jsonl`, `a.jsonl`, `a1.jsonl` -> a0, a1_1, a1_2)."""
    stems = [Path(p).stem if Path(p).suffix else Path(p).name for p in paths]
    names = [stem if stems.count(stem) == 1 else f"{stem}{i}" for i, stem in enumerate(stems)]
    while len(set(names)) < len(names):
        names = [name if names.count(name) == 1 else f"{name}_{i}" for i, name in enumerate(names)]
    return names


def mixture_order(lengths: list[np.ndarray], weights: list[float], seed: int,
                  epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """An epoch's draws (see the module docstring) given each source's document lengths: the source of each
    draw and the document's index within its source."""
    total = sum(int(x.sum()) for x in lengths)
    drawn = [0] * len(lengths)
    shuffles = [[] for _ in lengths]
    cursor = [0] * len(lengths)
    passes = [0] * len(lengths)
    heap = [(0.0, s) for s in range(len(lengths))]
    sources, locals_ = [], []
    done = 0
    while done < total:
        _, s = heapq.heappop(heap)
        if cursor[s] == len(shuffles[s]):
            order = list(range(len(lengths[s])))
            random.Random(f"qwenft-mixture-{seed}-{epoch}-{s}-{passes[s]}").shuffle(order)
            shuffles[s], cursor[s], passes[s] = order, 0, passes[s] + 1
        d = shuffles[s][cursor[s]]
        cursor[s] += 1
        sources.append(s)
        locals_.append(d)
        n = int(lengths[s][d])
        drawn[s] += n
        done += n
        heapq.heappush(heap, (drawn[s] / weights[s], s))
    return np.array(sources, dtype=np.int64), np.array(locals_, dtype=np.int64)


class MixtureData(SFTData):
    """`SFTData` over several sources, each epoch's document order drawn by `mixture_order`.

    `source_tokens()` counts each source's document tokens in the global stream consumed so far (all
    ranks' rows, so the same on every rank; carried in the state across a resume)."""

    def __init__(self, parts: list, sources: list[Source], *args, **kwargs):
        self.sources = sources
        docs = ConcatDocuments(parts)
        super().__init__(docs, *args, **kwargs)
        self._consumed = np.zeros(len(sources), dtype=np.int64)

    def epoch_order(self, epoch: int) -> np.ndarray:
        lengths = [self.docs.lengths[a:b] for a, b in zip(self.docs.starts[:-1], self.docs.starts[1:])]
        sources, local = mixture_order(lengths, [s.weight for s in self.sources], self.seed, epoch)
        return self.docs.starts[sources] + local

    def _consume(self, doc_ids: list[int]) -> None:
        ids = np.asarray(doc_ids, dtype=np.int64)
        self._consumed += np.bincount(self.docs.source_of[ids], weights=self.lengths[ids],
                                      minlength=len(self.sources)).astype(np.int64)

    def source_tokens(self) -> dict[str, int]:
        return {s.name: int(n) for s, n in zip(self.sources, self._consumed)}

    def state_dict(self) -> dict:
        return {**super().state_dict(), "sources": [[s.name, s.weight] for s in self.sources],
                "source_tokens": self._consumed.tolist()}

    def load_state_dict(self, state: dict) -> None:
        mine = [[s.name, s.weight] for s in self.sources]
        if state.get("sources") != mine:
            raise ValueError(f"data state was saved with data.sources (name, weight) {state.get('sources')} but "
                             f"this run has {mine}; resuming would not continue the same stream")
        super().load_state_dict(state)
        self._consumed = np.array(state["source_tokens"], dtype=np.int64)


def build_mixture_data(sources: list[Source], tokenizer, seq_len: int, micro_batch_size: int, dp_rank: int = 0,
                       dp_size: int = 1, seed: int = 0, packing: str = "pack", train_on: str = "assistant",
                       truncation: str = "truncate_right", on_bad_row: str = "skip", cache: bool = True,
                       cache_dir=None, num_proc: int | None = None) -> MixtureData:
    """Each source's documents (`loader.load_documents`: its own token cache, read as its own format), mixed by
    weight. `data.source_summary` holds, per source, its format, documents, tokens and skipped rows;
    `data.format` the sources' formats; `data.fingerprint` every source's files, as `<source>/<file>`."""
    if tokenizer.pad_token_id is None:
        raise ValueError("the tokenizer has no pad token; set one (Qwen's is <|endoftext|>)")
    parts, skipped, summary = [], {}, {}
    for i, source in enumerate(sources):
        if not source.weight > 0:
            raise ValueError(f"data.sources[{i}].weight={source.weight} must be > 0")
        docs, part_skipped, note, fmt = load_documents(source.path, tokenizer, seq_len, train_on, truncation,
                                                       on_bad_row, cache, cache_dir, num_proc, source.format)
        if not len(docs):
            raise ValueError(f"data.sources[{i}] ({source.path}) has no usable documents "
                             f"({part_skipped.describe()}); check its path, data.seq_len and data.truncation")
        lengths = getattr(docs, "lengths", None)
        tokens = int(lengths.sum()) if lengths is not None else sum(len(d.input_ids) for d in docs)
        summary[source.name] = {"path": source.path, "format": fmt, "weight": source.weight,
                                "documents": len(docs), "tokens": tokens, "skipped": dict(part_skipped),
                                "from": note}
        for reason, n in part_skipped.items():
            skipped[reason] = skipped.get(reason, 0) + n
        parts.append(docs if lengths is not None else _InMemory(docs))
    data = MixtureData(parts, sources, seq_len, micro_batch_size, tokenizer.pad_token_id, dp_rank, dp_size, seed,
                       packing, skipped)
    data.source_summary = summary
    data.format = ", ".join(dict.fromkeys(s["format"] for s in summary.values()))
    data.fingerprint = {f"{source.name}/{name}": files for source in sources
                        for name, files in fingerprint(source.path, cache_dir if cache else None).items()}
    data.cache_note = "; ".join(f"{name}: {s['from']}" for name, s in summary.items())
    return data


class _InMemory(list):
    """Documents in memory with their lengths, as `ConcatDocuments` reads them."""

    def __init__(self, docs):
        super().__init__(docs)
        self.lengths = np.array([len(d.input_ids) for d in docs], dtype=np.int64)
