"""Context parallelism: a microbatch's packed stream split into contiguous spans, one per cp rank.

Shape legend: T the padded stream (B x data.seq_len tokens flattened, then padded to a multiple of cp),
L = T / cp the tokens of one span, C channels, H heads, Dk / Dv key / value head dims.

Every cp rank receives the whole microbatch, embeds it (and runs the vision tower on all of its images), and
computes positions and the global document offsets before the split (`CPShard.split` at one seam in
`Qwen3_5Model.forward`); from there a rank holds only its span's hidden states. What crosses spans:

- GatedDeltaNet's causal conv reads the previous span's last kernel-1 rows (`gdn_mix`), masked at document
  starts by the global positions in document, so a document starting at a span edge reads nothing before it.
- GatedDeltaNet's recurrent state. The delta rule maps a span's incoming state S to M S + E (M [Dk, Dk], the
  product of the decays and Householder factors; E [Dk, Dv], the end state from zero). One all-gather of the
  (M, E) pairs and a fold over the earlier spans give a span's incoming state. Pairs compose associatively,
  (M2, E2) o (M1, E1) = (M2 M1, M2 E1 + E2), so the fold is exact. A span whose last document starts inside it
  has M = 0: no state reaches its end from before. A document that starts inside a span never sees an incoming
  state.
- Full attention: keys and values are all-gathered over cp, each span's queries attend causally within their
  own document over the gathered keys; the gather's backward returns dK, dV to their owners. Causal attention
  makes the later spans' queries see more keys (the last of cp spans does (2 cp - 1) / cp times the mean work for
  one long document). `balanced` (mesh.cp_balanced_attention) evens that out: each span is cut in two halves,
  and rank r computes the queries of halves r and 2 cp - 1 - r of the stream's 2 cp, one early and one late
  (`attend_balanced`); an all-to-all takes the queries there and brings the outputs back.

The backward mirrors each exchange through autograd (`_Gather`). Every rank takes part in each exchange's
backward: where a rank's output does not read what was gathered (the first span reads no incoming state),
`_tie` makes it depend on it anyway, so no rank waits on a collective the others never start.
"""

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from qwenft.constants import IGNORE_INDEX
from qwenft.transfer import copy_to_device


@dataclass(frozen=True)
class CPShard:
    """This cp rank's span of one microbatch's packed stream, and the stream's documents.

    `cu_seqlens_cpu`: the document offsets of the padded stream on the host (a pad document over the padding,
    when there is any); built before the split, the same on every cp rank."""
    group: object  # the cp ranks' ProcessGroup
    rank: int
    size: int
    tokens: int  # B x T before padding
    cu_seqlens_cpu: torch.Tensor  # int64
    device: torch.device
    balanced: bool = False  # attention's queries computed by halves, an early and a late one a rank

    @property
    def total(self) -> int:
        return int(self.cu_seqlens_cpu[-1])

    @property
    def length(self) -> int:
        return self.total // self.size

    @property
    def start(self) -> int:
        return self.rank * self.length

    @property
    def end(self) -> int:
        return self.start + self.length

    @functools.cached_property
    def segments(self) -> list[int]:
        """Offsets, relative to the span's start, of the pieces of documents inside the span: 0, the documents
        starting inside it, L."""
        inside = [int(c) - self.start for c in self.cu_seqlens_cpu.tolist() if self.start < c < self.end]
        return [0, *inside, self.length]

    @functools.cached_property
    def continues(self) -> bool:
        """Whether the span's first token continues a document started on an earlier rank."""
        return self.start not in set(self.cu_seqlens_cpu.tolist())

    @functools.cached_property
    def local_cu_seqlens(self) -> torch.Tensor:
        """`segments` as int64 offsets on the stream's device (the span's own packed layout)."""
        return torch.tensor(self.segments, dtype=torch.long, device=self.device)

    def piece_offsets(self, start: int, end: int) -> tuple[int, list[int], list[int]]:
        """The queries [start, end) of the stream by document piece, on the host: the first stream token that one
        of them sees (the start of the document `start` is in), and each piece's offsets among the queries and
        among the keys [first, end). Only the first piece has fewer queries than keys: its queries are its keys'
        last ones. Once per range."""
        def make():
            cu = self.cu_seqlens_cpu.tolist()
            first = max(c for c in cu if c <= start)
            inside = [c for c in cu if start < c < end]
            return first, [0, *(c - start for c in inside), end - start], [0, *(c - first for c in inside), end - first]
        return self._cached(("pieces", start, end), make)

    def flash_offsets(self, start: int, end: int) -> tuple[int, torch.Tensor, torch.Tensor, int, int]:
        """`piece_offsets` for the flash kernel: the first key, the offsets as int32 on the stream's device, and
        the longest piece's queries and keys. Once per range."""
        def make():
            first, *offsets = self.piece_offsets(start, end)
            longest = (max(b - a for a, b in zip(c[:-1], c[1:])) for c in offsets)
            on_device = (copy_to_device(torch.tensor(c, dtype=torch.int32), self.device) for c in offsets)
            return first, *on_device, *longest
        return self._cached(("flash", start, end), make)

    def half(self, h: int) -> tuple[int, int]:
        """The stream range [start, end) of half `h` of the 2 cp halves (rank h // 2's span, cut at its middle)."""
        span_start = (h // 2) * self.length
        middle = span_start + self.length // 2
        return (span_start, middle) if h % 2 == 0 else (middle, span_start + self.length)

    def computes(self, rank: int) -> tuple[int, int]:
        """The halves whose attention `rank` computes under `balanced`: an early one and its mirror."""
        return rank, 2 * self.size - 1 - rank

    def fla_context(self, kernel_size: int):
        """fla's `FLACPContext` of this span (its documents' local offsets and how many spans each edge document
        crosses), for `causal_conv1d` and `chunk_gated_delta_rule`; once per shard."""
        def make():
            from fla.ops.cp import build_cp_context

            return build_cp_context(copy_to_device(self.cu_seqlens_cpu, self.device), self.group,
                                    conv1d_kernel_size=kernel_size, cu_seqlens_cpu=self.cu_seqlens_cpu)
        return self._cached(("fla", kernel_size), make)

    def _cached(self, key, make):
        """`make()` once per shard and key: every layer of the microbatch asks for the same index tensors."""
        cache = self.__dict__.setdefault("_cache", {})  # a frozen dataclass's own dict, as cached_property uses
        if key not in cache:
            cache[key] = make()
        return cache[key]

    def positions_in_document(self, before: int = 0) -> torch.Tensor:
        """[before + L] offset of each token in its document, for the span and the `before` tokens ahead of it
        (0 where they fall before the stream)."""
        return self._cached(("positions", before), lambda: self._positions_in_document(before))

    def _positions_in_document(self, before: int) -> torch.Tensor:
        cu = self.cu_seqlens_cpu
        flat = torch.arange(self.start - before, self.end).clamp(min=0)
        doc = torch.searchsorted(cu, flat, right=True) - 1
        return (flat - cu[doc]).to(self.device)

    def document_ids(self, first: int, last: int) -> torch.Tensor:
        """[last - first] the document of each stream token in [first, last)."""
        def make():
            flat = torch.arange(first, last)
            return (torch.searchsorted(self.cu_seqlens_cpu, flat, right=True) - 1).to(self.device)
        return self._cached(("documents", first, last), make)

    def split(self, x: torch.Tensor, lead: int = 0, fill=0) -> torch.Tensor:
        """The span of `x` [*lead dims, B, T, *rest] (`lead` dims before B: 1 for M-RoPE's [3, B, T]): (B, T)
        flattened to the stream, padded with `fill` to its length and cut -> [*lead dims, 1, L, *rest]."""
        flat = x.flatten(lead, lead + 1)
        pad = self.total - self.tokens
        if pad:
            shape = list(flat.shape)
            shape[lead] = pad
            flat = torch.cat([flat, flat.new_full(shape, fill)], dim=lead)
        return flat.narrow(lead, self.start, self.length).unsqueeze(lead)


def cp_shard(cu_seqlens: torch.Tensor, group, balanced: bool = False) -> CPShard:
    """This rank's `CPShard` of a microbatch whose documents are `cu_seqlens` (offsets into the flattened B x T
    stream, ending at B x T); the stream is padded to a multiple of the cp size with one pad document.
    `balanced`: attention by halves (`attend_balanced`)."""
    from .varlen import varlen_info

    if cu_seqlens is None:
        raise ValueError("context parallelism splits packed microbatches: cu_seqlens is required")
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    cu = varlen_info(cu_seqlens).cu_seqlens_cpu.to(torch.long)
    tokens = int(cu[-1])
    padded = -(-tokens // size) * size
    if padded != tokens:
        cu = torch.cat([cu, torch.tensor([padded])])
    return CPShard(group, rank, size, tokens, cu, cu_seqlens.device, balanced)


def split_labels(labels: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This cp rank's span of a microbatch's labels [B, T] -> [1, L]: padding labelled IGNORE_INDEX, as
    `CPShard.split` pads the stream."""
    flat = labels.reshape(-1)
    pad = -flat.numel() % size
    if pad:
        flat = torch.cat([flat, flat.new_full((pad,), IGNORE_INDEX)])
    length = flat.numel() // size
    return flat[rank * length:(rank + 1) * length].unsqueeze(0)


# torch 2.13 renamed all_gather_into_tensor (deprecated there) to all_gather_single; older ones have only the first
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _Gather(torch.autograd.Function):
    """All-gather over the cp group -> [cp, *x.shape]; the backward sums each rank's gradient of the gathered
    tensor and hands every rank its own slice (a reduce-scatter where the backend has one)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous()
        out = x.new_empty(dist.get_world_size(group), *x.shape)
        _all_gather(out.flatten(0, 1), x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        group = ctx.group
        grad = grad.contiguous()
        if dist.get_backend(group) == "nccl":
            out = grad.new_empty(grad.shape[1:])
            dist.reduce_scatter_tensor(out, grad.flatten(0, 1), group=group)
            return out, None
        grad = grad.clone()
        dist.all_reduce(grad, group=group)  # gloo has no reduce-scatter
        return grad[dist.get_rank(group)], None


def gather(x: torch.Tensor, shard: CPShard) -> torch.Tensor:
    return _Gather.apply(x, shard.group)


class _AllReduce(torch.autograd.Function):
    """Sum over the cp group; the backward sums the gradients too (every rank's loss reads the sum)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def all_reduce(x: torch.Tensor, shard: CPShard) -> torch.Tensor:
    return _AllReduce.apply(x, shard.group)


class _Tie(torch.autograd.Function):
    """`x` unchanged, made to depend on `others` (their gradient: zeros), so the backward of the collectives
    that produced them runs on this rank too."""

    @staticmethod
    def forward(ctx, x, *others):
        ctx.shapes = [(o.shape, o.dtype, o.device) for o in others]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (grad, *(torch.zeros(s, dtype=d, device=dev) for s, d, dev in ctx.shapes))


def _tie(x: torch.Tensor, *others: torch.Tensor) -> torch.Tensor:
    return _Tie.apply(x, *others) if torch.is_grad_enabled() else x


# ---------------------------------------------------------------- GatedDeltaNet

def conv_with_halo(qkv_1lc: torch.Tensor, weight_c1k: torch.Tensor, shard: CPShard) -> tuple[torch.Tensor,
                                                                                          torch.Tensor]:
    """The causal conv (+ SiLU) over the span, reading the previous span's last kernel-1 rows; taps never reach
    into an earlier document. -> (conv output [1, L, C], the gathered tails, for `_tie`)."""
    from .gdn import causal_conv

    halo = weight_c1k.shape[-1] - 1
    if shard.length < halo:
        raise ValueError(f"a context-parallel span of {shard.length} tokens is shorter than the conv's "
                         f"{halo}-token reach; lower mesh.cp or raise data.seq_len")
    tails = gather(qkv_1lc[:, shard.length - halo:], shard)  # [cp, 1, halo, C]
    before = tails[shard.rank - 1] if shard.rank > 0 else torch.zeros_like(tails[0])
    x = torch.cat([before, qkv_1lc], dim=1)
    out = causal_conv(x, weight_c1k, shard.positions_in_document(halo))
    return out[:, halo:], tails


def _delta_rule(q, k, v, g, beta, initial_state=None):
    from .gdn import chunked_delta_rule

    return chunked_delta_rule(q, k, v, g, beta, initial_state=initial_state, output_final_state=True)


def delta_rule(q, k, v, g, beta, shard: CPShard, tails: torch.Tensor | None = None) -> torch.Tensor:
    """The gated delta rule over this span (q, k [1, L, H, Dk] one per value head, v [1, L, H, Dv], g, beta
    [1, L, H]) with the state carried in from the earlier spans -> [1, L, H, Dv]. `tails`: the conv's gathered
    tensor, tied to the output with the summaries (`_tie`)."""
    bounds = shard.segments
    Dk, Dv = k.shape[-1], v.shape[-1]
    pieces = [(s, e) for s, e in zip(bounds[:-1], bounds[1:]) if e > s]
    outs, carried, end_state, end_map = [], None, None, None
    for i, (s, e) in enumerate(pieces):
        seg = [t[:, s:e] for t in (q, k, v, g, beta)]
        if i == 0 and shard.continues:
            # run with values [v | 0] from the state [0 | I]: outputs and end state from zero in the first Dv
            # columns, q^T M_t and the span's map M in the last Dk (the recurrence is linear in them)
            v_ext = F.pad(seg[2], (0, Dk))
            eye = torch.eye(Dk, dtype=torch.promote_types(v.dtype, torch.float32), device=v.device)
            init = F.pad(eye, (Dv, 0)).expand(1, v.shape[2], Dk, Dv + Dk)
            o_ext, state = _delta_rule(*seg[:2], v_ext, *seg[3:], initial_state=init)
            outs.append(o_ext[..., :Dv])
            carried = o_ext[..., Dv:]  # [1, l, H, Dk]: q_t^T M_t, to be multiplied by the incoming state
            end_state, end_map = state[..., :Dv], state[..., Dv:]
        else:
            o, end_state = _delta_rule(*seg)
            end_map = None
            outs.append(o)
    if end_map is None:  # the span's last document starts inside it
        end_map = end_state.new_zeros(*end_state.shape[:-1], Dk)
    # [cp, 1, H, Dk, Dk + Dv], in the delta rule's compute dtype (fp32, or fp64 when given fp64)
    summaries = gather(torch.cat([end_map, end_state], dim=-1), shard)
    state = None
    for j in range(shard.rank):  # fold the earlier spans' maps: S <- M_j S + E_j, in fp32
        m, e = summaries[j][..., :Dk], summaries[j][..., Dk:]
        state = e if state is None else m @ state + e
    if carried is not None:
        outs[0] = outs[0] + torch.einsum("blhk,bhkv->blhv", carried, state.to(carried.dtype)).to(outs[0].dtype)
    out = torch.cat(outs, dim=1)
    return _tie(out, summaries, *(() if tails is None else (tails,)))


def gdn_mix(qkv_1lc, beta, g, weight_c1k, sizes, heads, shard: CPShard) -> torch.Tensor:
    """GatedDeltaNet's conv and delta rule over this span, in torch (fp32; the reference path): `heads` splits
    the conv output into q, k, v heads ([1, L, heads, dim] each) -> [1, L, Hv, Dv]."""
    conv, tails = conv_with_halo(qkv_1lc, weight_c1k, shard)
    q, k, v = heads(conv.split(sizes, dim=-1))
    rep = v.shape[2] // q.shape[2]  # each key head serves `rep` consecutive value heads
    q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    return delta_rule(q, k, v, g, beta, shard, tails)


# ---------------------------------------------------------------- full attention

def attend(q_bhld, k_bhld, v_bhld, scale: float, shard: CPShard, kernel: str = "auto") -> torch.Tensor:
    """Causal attention of this span's queries over every span's keys and values, within documents ->
    [1, L, H, D]. Keys and values are all-gathered (their gradients go back to their owners)."""
    keys, values = (gather(t, shard) for t in (k_bhld, v_bhld))  # [cp, 1, Hkv, L, D]
    keys, values = (t.permute(1, 2, 0, 3, 4).flatten(2, 3) for t in (keys, values))  # [1, Hkv, T, D]
    if shard.balanced:
        return attend_balanced(q_bhld, keys, values, scale, shard, kernel)
    return attend_span(q_bhld, keys, values, scale, shard, shard.start, shard.end, kernel)


def attend_span(q_bhld, keys, values, scale: float, shard: CPShard, start: int, end: int,
                kernel: str = "auto") -> torch.Tensor:
    """The queries [1, H, l, D] of the stream's tokens [start, end) over the whole stream's keys and values
    [1, Hkv, T, D] -> [1, l, H, D]. `kernel`: model.kernels.attention. The flash kernel takes each document
    piece of the range as a sequence whose keys run from its document's start (the first piece's queries are
    its keys' last ones), cuDNN's takes the same pieces one at a time (piece_attention); masked SDPA, the CPU's
    path, an [l, end] mask."""
    from .attention import flash_varlen, mean_piece, piece_kernel, resolve_attention_kernel
    from .piece_attention import attend_pieces

    first, cu_q, cu_k = shard.piece_offsets(start, end)
    chosen = resolve_attention_kernel(kernel, True, q_bhld.device, q_bhld.dtype, mean_piece(cu_q))
    if chosen == "cudnn":
        return attend_pieces(q_bhld, keys[:, :, first:end], values[:, :, first:end], scale, cu_q, cu_k,
                             piece_kernel(q_bhld.device))
    if chosen == "flash_varlen":
        first, *offsets = shard.flash_offsets(start, end)
        q = q_bhld[0].transpose(0, 1).contiguous()  # [l, H, D]
        k, v = (t[0, :, first:end].transpose(0, 1).contiguous() for t in (keys, values))  # [end - first, Hkv, D]
        return flash_varlen(q, k, v, scale, *offsets).unsqueeze(0)
    keys, values = keys[:, :, :end], values[:, :, :end]  # no query of the range sees a key after it
    q_doc = shard.document_ids(start, end)
    k_doc = shard.document_ids(0, end)
    q_pos = torch.arange(start, end, device=q_doc.device)
    k_pos = torch.arange(end, device=q_doc.device)
    mask = (q_doc[:, None] == k_doc[None, :]) & (k_pos[None, :] <= q_pos[:, None])  # [l, end]
    out = F.scaled_dot_product_attention(q_bhld, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2)


class _AllToAll(torch.autograd.Function):
    """Rows of `x` [n, ...] sent out in consecutive pieces of `send` rows, one per rank in order, and the pieces
    of `recv` rows received from each, concatenated; the backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x, send: list[int], recv: list[int], group):
        ctx.sizes, ctx.group = (send, recv), group
        out = x.new_empty(sum(recv), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        send, recv = ctx.sizes
        out = grad.new_empty(sum(send), *grad.shape[1:])
        dist.all_to_all_single(out, grad.contiguous(), output_split_sizes=send, input_split_sizes=recv,
                               group=ctx.group)
        return out, None, None, None


def attend_balanced(q_bhld, keys, values, scale: float, shard: CPShard, kernel: str = "auto") -> torch.Tensor:
    """`attend_span` by halves: this span's two halves of queries go to the ranks that compute them (half h to
    rank h, or 2 cp - 1 - h for the later ones), this rank computes halves rank and 2 cp - 1 - rank, and the
    outputs come back -> [1, L, H, D]. Every rank's attention then covers one early and one late half: the same
    keys seen, whatever the rank."""
    cp, rank = shard.size, shard.rank
    owner = {h: h if h < cp else 2 * cp - 1 - h for h in range(2 * cp)}  # the inverse of `CPShard.computes`
    mine = (2 * rank, 2 * rank + 1)  # the halves this rank holds, in stream order
    sizes = {h: shard.half(h)[1] - shard.half(h)[0] for h in range(2 * cp)}
    q_lhd = q_bhld[0].transpose(0, 1)  # [L, H, D], the span's queries in stream order
    send = [sum(sizes[h] for h in mine if owner[h] == d) for d in range(cp)]
    order = sorted(mine, key=lambda h: owner[h])  # the send buffer: pieces by destination rank
    pieces = dict(zip(mine, q_lhd.split([sizes[h] for h in mine])))
    computed = sorted(shard.computes(rank), key=lambda h: h // 2)  # received: by source rank
    recv = [sum(sizes[h] for h in computed if h // 2 == s) for s in range(cp)]
    got = _AllToAll.apply(torch.cat([pieces[h] for h in order]), send, recv, shard.group)
    outs, offset = [], 0
    for h in computed:
        start, end = shard.half(h)
        q_half = got[offset:offset + sizes[h]].transpose(0, 1).unsqueeze(0)  # [1, H, l, D]
        outs.append(attend_span(q_half, keys, values, scale, shard, start, end, kernel)[0])  # [l, H, D]
        offset += sizes[h]
    back = _AllToAll.apply(torch.cat(outs), recv, send, shard.group)  # this rank's halves, ordered as `order`
    by_half, offset = {}, 0
    for h in order:
        by_half[h] = back[offset:offset + sizes[h]]
        offset += sizes[h]
    return torch.cat([by_half[h] for h in mine]).unsqueeze(0)
