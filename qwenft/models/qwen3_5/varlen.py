"""What every layer needs to know about a packed batch's documents, computed once per batch.

Each GDN layer calls its conv and fla's chunk kernels with the batch's `cu_seqlens`. Given only those, fla derives
the chunk indices (which document and which chunk of it each 64-token block is) and reads the offsets back
from the GPU for it: a host sync per kernel call. `varlen_info` hands every layer one shared `Varlen` per
`cu_seqlens` tensor, with the offsets' host copy and the chunk indices built from it on the host and copied to
the GPU without waiting: no device->host copy at all for a batch whose offsets were put on the device by
`to_device`, which keeps the host copy they came from. A device->host copy, or a copy from pageable host memory
to the device, waits for every kernel queued before it, so the host could not run ahead of the GPU from one
microbatch into the next.

The recurrent layers (GatedDeltaNet's conv and delta rule) walk each document's blocks one after another, so a
row's padding tail of thousands of tokens, one piece of the batch's offsets, would be the longest walk of the
batch, which a tensor-parallel rank's few heads leave too little other work to hide. What the tail computes is never
read (its labels are ignored, and no document sees it), so where `to_device` is told the rows' padding, those
layers take the tails in FLA_CHUNK-token pieces (`Varlen.recurrent`), each a block of its own. Attention keeps
the batch's offsets: its kernel choice and its by-piece path count pieces.
"""

import functools
from dataclasses import dataclass

import torch

from qwenft.transfer import copy_to_device

_ATTR = "_qwenft_varlen"  # the attribute of an offsets tensor that holds its Varlen
FLA_CHUNK = 64  # the token block of fla's chunked delta rule and of its causal conv (their default chunk_size)


@dataclass
class Varlen:
    cu_seqlens: torch.Tensor  # int64, on the batch's device
    cu_seqlens_cpu: torch.Tensor  # int64 copy on the CPU
    max_len: int  # longest document
    recurrent_cpu: torch.Tensor | None = None  # host offsets with the padding tails in pieces; None: the same

    @functools.cached_property
    def recurrent_offsets(self) -> torch.Tensor | None:
        """`recurrent_cpu` on the batch's device, holding its own Varlen (`varlen_info`); None where nothing is
        cut."""
        if self.recurrent_cpu is None:
            return None
        on_device = copy_to_device(self.recurrent_cpu, self.cu_seqlens.device)
        _remember(on_device, self.recurrent_cpu)
        return on_device

    @property
    def recurrent(self) -> "Varlen":
        """The documents as the recurrent layers take them: the padding tails cut in FLA_CHUNK-token pieces
        (`padding_pieces`); itself where nothing is cut."""
        return self if self.recurrent_cpu is None else varlen_info(self.recurrent_offsets)

    @functools.cached_property
    def offsets(self) -> list[int]:
        """`cu_seqlens_cpu` as a list (what attention's kernel choice and cuDNN's pieces read per layer)."""
        return self.cu_seqlens_cpu.tolist()

    @functools.cached_property
    def mean_piece(self) -> float:
        """Tokens per non-empty document (attention.mean_piece of `offsets`): once per batch, not per layer."""
        from .attention import mean_piece

        return mean_piece(self.offsets)

    @functools.cached_property
    def blocks(self) -> int:
        """`count_blocks` of the offsets: once per batch, not per layer."""
        return count_blocks(self.cu_seqlens_cpu)

    @functools.cached_property
    def chunk_indices(self) -> torch.Tensor:
        """[blocks, 2] int64 on the batch's device: (document, block within it) of every FLA_CHUNK-token block
        of every document, in order (what fla's `prepare_chunk_indices` computes), built on the host."""
        return copy_to_device(chunk_indices(self.cu_seqlens_cpu), self.cu_seqlens.device)


def chunk_indices(cu_seqlens_cpu: torch.Tensor) -> torch.Tensor:
    """[blocks, 2] int64 on the host: (document, block within it) of every FLA_CHUNK-token block of every
    document of the offsets `cu_seqlens_cpu`, in order. An empty document has no block."""
    blocks = (cu_seqlens_cpu.diff() + FLA_CHUNK - 1) // FLA_CHUNK
    doc = torch.repeat_interleave(torch.arange(len(blocks)), blocks)
    first = blocks.cumsum(0) - blocks  # each document's first block
    return torch.stack([doc, torch.arange(len(doc)) - first[doc]], dim=1)


DOC_BUCKET = 64  # document buckets: powers of two up to this, then its multiples
PAD_TOKENS = FLA_CHUNK  # a fixed layout's pad tokens after the stream: room for 1 to FLA_CHUNK pad blocks
BLOCK_STEP = 32  # a new layout's block count: the batch's blocks and one pad block, rounded up to this


def doc_bucket(docs: int) -> int:
    """The smallest document bucket that holds `docs` documents."""
    if docs <= DOC_BUCKET:
        return 1 << max(0, docs - 1).bit_length()
    return -(-docs // DOC_BUCKET) * DOC_BUCKET


def count_blocks(cu_seqlens_cpu: torch.Tensor) -> int:
    """FLA_CHUNK-token blocks of the documents `cu_seqlens_cpu` (each document's own, its last one partial)."""
    return int(((cu_seqlens_cpu.diff() + FLA_CHUNK - 1) // FLA_CHUNK).sum())


def layout_holds(bucket: int, blocks: int, docs: int, real_blocks: int) -> bool:
    """Whether a fixed layout of `bucket` documents and `blocks` blocks holds `docs` documents of `real_blocks`
    blocks: its pad tokens make 1 to PAD_TOKENS pad blocks."""
    return docs <= bucket and 1 <= blocks - real_blocks <= PAD_TOKENS


@dataclass(frozen=True)
class FixedLayout:
    """A packed stream's documents with padding appended so that its shapes depend only on the stream's length,
    a document bucket (`bucket`, at least the document count) and a block count (`blocks`, more than the
    documents' own): `tokens` (the stream and `pad` pad tokens after it), `cu_seqlens` (int64 offsets: the real
    documents, pad documents over the pad tokens, then empty documents up to a fixed count) and `chunk_indices`
    (as `chunk_indices`, `blocks` long). fla's kernels size their grids from those shapes alone, so one CUDA
    graph serves every batch laid out in one (bucket, blocks); the pad documents restart the conv and the
    recurrent state, so the real tokens' outputs are unchanged."""
    tokens: int
    pad: int
    bucket: int
    blocks: int
    cu_seqlens: torch.Tensor
    chunk_indices: torch.Tensor


def fixed_layout(cu_seqlens_cpu: torch.Tensor, bucket: int | None = None, blocks: int | None = None) -> FixedLayout:
    """`FixedLayout` of the host offsets `cu_seqlens_cpu` (S tokens in N documents of b blocks) for `bucket` >= N
    documents (default `doc_bucket(N)`) and `blocks` blocks, b + 1 to b + PAD_TOKENS (default b + 1 rounded up
    to BLOCK_STEP, or ceil(S/C) + `bucket` where that is fewer: the most any `bucket` documents of S tokens
    take, ceil(S/C) + `bucket` - 1, and a pad block, so that a few long documents get one pad block).

    The fla kernels' work grows with the blocks, so a layout adds only the k = `blocks` - b blocks it needs:
    P = PAD_TOKENS pad tokens in k pad documents, k - 1 of one token and one of the rest (at most FLA_CHUNK
    tokens, one block). Empty documents then fill the offsets up to `bucket` + P."""
    cu = cu_seqlens_cpu.to(torch.long)
    total, docs, real = int(cu[-1]), len(cu) - 1, count_blocks(cu)
    bucket = doc_bucket(docs) if bucket is None else bucket
    if blocks is None:
        blocks = min(-(-(real + 1) // BLOCK_STEP) * BLOCK_STEP, -(-total // FLA_CHUNK) + bucket)
    if bucket < docs:
        raise ValueError(f"a layout for {bucket} documents cannot hold {docs}")
    if not layout_holds(bucket, blocks, docs, real):
        raise ValueError(f"a layout of {blocks} blocks cannot hold documents of {real} blocks: it adds 1 to "
                         f"{PAD_TOKENS} pad blocks")
    k = blocks - real
    lengths = [1] * (k - 1) + [PAD_TOKENS - (k - 1)]
    offsets = torch.tensor(lengths, dtype=torch.long).cumsum(0) + total
    empty = torch.full((bucket + PAD_TOKENS - docs - k,), total + PAD_TOKENS, dtype=torch.long)
    fixed = torch.cat([cu, offsets, empty])
    return FixedLayout(total + PAD_TOKENS, PAD_TOKENS, bucket, blocks, fixed, chunk_indices(fixed))


def padding_pieces(cu_seqlens_cpu: torch.Tensor, padding: torch.Tensor) -> torch.Tensor | None:
    """The host offsets `cu_seqlens_cpu` of a `[B, T]` batch whose rows end in `padding` (`[B, T]` bool, true on
    each row's padding tail) with every tail cut where it starts and every FLA_CHUNK tokens after that; None
    where that adds no offset. A row's tail is its last run of true (a true before a document's token is not
    padding that can be cut): the documents' tokens come before the cuts, so their outputs stay the same."""
    B, T = padding.shape
    tails = padding.flip(1).to(torch.int32).cumprod(1).sum(1).tolist()  # each row's last run of true
    if B * T != int(cu_seqlens_cpu[-1]):
        raise ValueError(f"padding of {B}x{T} tokens for offsets of {int(cu_seqlens_cpu[-1])}")
    cuts = [torch.arange((b + 1) * T - n, (b + 1) * T, FLA_CHUNK) for b, n in enumerate(tails) if n]
    if not cuts:
        return None
    pieces = torch.cat([cu_seqlens_cpu.to(torch.long), *cuts]).unique(sorted=True)
    return None if len(pieces) == len(cu_seqlens_cpu) else pieces


def _remember(cu_seqlens: torch.Tensor, cpu: torch.Tensor, recurrent_cpu: torch.Tensor | None = None) -> Varlen:
    """The Varlen of `cu_seqlens` (`cpu`: its values on the host), held by the tensor itself for as long as it
    lives: a layer recomputed under activation checkpointing, however many microbatches later, finds the same
    one. The Varlen holds copies, never the tensor, so the two make no reference cycle (which only Python's
    rare full collections would free, with the GPU memory of the batch's offsets)."""
    cpu = cpu.to("cpu", torch.long, copy=True)
    info = Varlen(cu_seqlens.to(torch.long, copy=True), cpu, int((cpu[1:] - cpu[:-1]).max()), recurrent_cpu)
    setattr(cu_seqlens, _ATTR, info)
    return info


def to_device(cu_seqlens: torch.Tensor, device: torch.device, padding: torch.Tensor | None = None) -> torch.Tensor:
    """The host offsets `cu_seqlens` on `device`, copied without waiting for the GPU, and known to
    `varlen_info` (which then needs no copy back). `padding` (`[B, T]` bool on the host, the batch's
    `padding_mask`): the recurrent layers take the rows' padding tails in pieces (`Varlen.recurrent`)."""
    on_device = copy_to_device(cu_seqlens, device)
    cpu = cu_seqlens.to("cpu", torch.long)
    _remember(on_device, cpu, None if padding is None else padding_pieces(cpu, padding.cpu()))
    return on_device


@torch.compiler.disable  # a Python attribute and a host copy: never traced into a graph (model.compile)
def varlen_info(cu_seqlens: torch.Tensor) -> Varlen:
    info = getattr(cu_seqlens, _ATTR, None)
    return info if info is not None else _remember(cu_seqlens, cu_seqlens)


@torch.compiler.disable
def recurrent_offsets(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The offsets the recurrent layers take for the batch's `cu_seqlens` (`Varlen.recurrent`): `cu_seqlens`
    itself where no padding tail is cut."""
    info = varlen_info(cu_seqlens)
    return cu_seqlens if info.recurrent_cpu is None else info.recurrent_offsets
