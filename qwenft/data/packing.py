"""Documents -> fixed-length rows -> micro batches.

A row is `seq_len` tokens holding one or more whole documents followed by padding. Every document and
the padding tail restart `position_ids` at 0, so a row's segments — and `cu_seqlens`, the offsets of
segment starts over the flattened `[B*T]` micro batch — follow from `position_ids` alone
(`cu_seqlens_from_position_ids`), which is how a pipeline stage can recompute them for a slice of rows.
Labels are pre-shifted by `chat.tokenize_rows` (each document's last label is IGNORE_INDEX), so concatenating
documents never makes one predict into the next.
"""

from typing import NamedTuple

import numpy as np
import torch

from qwenft.constants import IGNORE_INDEX
from qwenft.data.chat import Document

PACKING = ("pack", "pad")


class Plan(NamedTuple):
    """An epoch's rows: row `r` holds documents `docs[starts[r]:starts[r+1]]`, in that order."""
    docs: np.ndarray  # int64 document indices, row after row
    starts: np.ndarray  # int64 [n_rows + 1]

    def __len__(self) -> int:
        return len(self.starts) - 1

    def __getitem__(self, r):
        if isinstance(r, slice):
            return [self[i] for i in range(*r.indices(len(self)))]
        return self.docs[self.starts[r]:self.starts[r + 1]].tolist()


def pad_plan(order: np.ndarray) -> Plan:
    """One document per row."""
    return Plan(np.asarray(order, dtype=np.int64), np.arange(len(order) + 1, dtype=np.int64))


def pack_plan(order: np.ndarray, lengths: np.ndarray, seq_len: int, open_rows: int = 64) -> Plan:
    """Documents `order` (in that order) packed first fit over the `open_rows` newest unfilled rows.

    Each document goes into the first row, oldest first, of the `open_rows` most recently opened ones that
    has room, else opens a row; opening a row beyond the bound closes the oldest. Rows come out in the
    order they were opened, documents within a row in `order`'s order. Deterministic for given lengths;
    O(n * open_rows) in the worst case (1 M documents: about 3 s on one CPU core).
    """
    order = np.asarray(order, dtype=np.int64)
    doc_lengths = lengths[order]
    assert len(order) == 0 or (doc_lengths.min() > 0 and doc_lengths.max() <= seq_len), seq_len
    row_of = np.empty(len(order), dtype=np.int64)
    space, first, n_rows = [], 0, 0  # space[j]: free tokens in open row first + j
    for k, length in enumerate(doc_lengths.tolist()):
        for j, free in enumerate(space):
            if free >= length:
                space[j] = free - length
                row_of[k] = first + j
                break
        else:
            space.append(seq_len - length)
            row_of[k] = n_rows
            n_rows += 1
            if len(space) > open_rows:
                del space[0]
                first += 1
    by_row = np.argsort(row_of, kind="stable")  # stable: a row's documents keep their order
    return Plan(order[by_row], np.searchsorted(row_of[by_row], np.arange(n_rows + 1)).astype(np.int64))


class Row(NamedTuple):
    """One row of `seq_len` tokens: its documents, then `padding` tokens of the pad id (label IGNORE_INDEX);
    each column a 1-D int64 array."""
    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray
    padding: int


def build_row(docs: list[Document], seq_len: int, pad_id: int) -> Row:
    """The `Row` holding `docs` then padding. Filled in numpy (a document's tokens are a list, or an array from
    the token cache): a long row is one copy per document, not a Python list of its tokens."""
    input_ids = np.full(seq_len, pad_id, dtype=np.int64)
    labels = np.full(seq_len, IGNORE_INDEX, dtype=np.int64)
    position_ids = np.empty(seq_len, dtype=np.int64)
    at = 0
    for doc in docs:
        n = len(doc.input_ids)
        assert at + n <= seq_len, (at + n, seq_len)
        input_ids[at:at + n] = doc.input_ids
        labels[at:at + n] = doc.labels
        position_ids[at:at + n] = np.arange(n)
        at += n
    position_ids[at:] = np.arange(seq_len - at)
    return Row(input_ids, labels, position_ids, seq_len - at)


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """int32 offsets of segment starts over the flattened `[B, T]` positions, plus the end `B*T`."""
    flat = position_ids.reshape(-1)
    starts = torch.nonzero(flat == 0).flatten()
    return torch.cat([starts, torch.tensor([flat.numel()], device=flat.device)]).to(torch.int32)


def padding_mask(padding: list[int], seq_len: int) -> torch.Tensor:
    """`[B, T]` bool, true on each row's padding tail (`padding[b]` tokens)."""
    return torch.arange(seq_len) >= seq_len - torch.tensor(padding, dtype=torch.long)[:, None]


def collate(rows: list[Row]) -> dict[str, torch.Tensor]:
    """Rows from `build_row` -> a micro batch: `input_ids`, `labels`, `position_ids` `[B, T]` long, `cu_seqlens`,
    `padding_mask` `[B, T]` bool."""
    input_ids, labels, position_ids = (torch.from_numpy(np.stack(column)) for column in list(zip(*rows))[:3])
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids,
            "cu_seqlens": cu_seqlens_from_position_ids(position_ids),
            "padding_mask": padding_mask([row.padding for row in rows], input_ids.shape[1])}
