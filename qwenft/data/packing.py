"""Documents -> fixed-length rows -> micro batches.

A row is `seq_len` tokens holding one or more whole documents followed by padding. Every document and
the padding tail restart `position_ids` at 0, so a row's segments — and `cu_seqlens`, the offsets of
segment starts over the flattened `[B*T]` micro batch — follow from `position_ids` alone
(`cu_seqlens_from_position_ids`), which is how a pipeline stage can recompute them for a slice of rows.
Labels are pre-shifted by `chat.tokenize_rows` (each document's last label is IGNORE_INDEX), so concatenating
documents never makes one predict into the next.
"""

from typing import NamedTuple

import torch

from qwenft.constants import IGNORE_INDEX
from qwenft.data.chat import Document

PACKING = ("pack", "pad")


def pack_documents(lengths: list[int], seq_len: int, open_rows: int = 64) -> list[list[int]]:
    """Rows as lists of document indices: first fit, in order, over the `open_rows` newest unfilled rows.

    Deterministic for given lengths. Bounding the open rows keeps it O(n) on large data; when a new row
    would exceed the bound, the oldest open row is closed. Rows come out in the order they were opened.
    """
    rows, space = [], []  # space[k] = free tokens in rows[k]
    first_open = 0
    for doc, length in enumerate(lengths):
        assert 0 < length <= seq_len, (length, seq_len)
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


class Row(NamedTuple):
    """One row of `seq_len` tokens: its documents, then `padding` tokens of the pad id (label IGNORE_INDEX)."""
    input_ids: list[int]
    labels: list[int]
    position_ids: list[int]
    padding: int


def build_row(docs: list[Document], seq_len: int, pad_id: int) -> Row:
    """The `Row` holding `docs` then padding."""
    input_ids, labels, position_ids = [], [], []
    for doc in docs:
        input_ids += doc.input_ids
        labels += doc.labels
        position_ids += range(len(doc.input_ids))
    pad = seq_len - len(input_ids)
    assert pad >= 0, (len(input_ids), seq_len)
    return Row(input_ids + [pad_id] * pad, labels + [IGNORE_INDEX] * pad, position_ids + list(range(pad)), pad)


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
    input_ids, labels, position_ids = (torch.tensor(column, dtype=torch.long) for column in list(zip(*rows))[:3])
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids,
            "cu_seqlens": cu_seqlens_from_position_ids(position_ids),
            "padding_mask": padding_mask([row.padding for row in rows], input_ids.shape[1])}
