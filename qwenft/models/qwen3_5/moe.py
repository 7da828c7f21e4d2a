"""The feed-forward blocks: the dense SwiGLU `MLP` and Qwen3.5-MoE's sparse `MoE`.

`MoE` follows transformers' `Qwen3_5MoeSparseMoeBlock`: a softmax router picks `num_experts_per_tok` experts
per token and renormalises their probabilities to sum to 1 (always: Qwen3.5-MoE has no `norm_topk_prob`);
the routed experts are SwiGLU MLPs stored fused as transformers keeps them (`experts.gate_up_proj [E, 2I, H]`,
gate rows first, `experts.down_proj [E, H, I]`); a shared expert (a SwiGLU MLP of its own width) sees every
token and is scaled by `sigmoid(shared_expert_gate(x))`. The router's logits and softmax are at least fp32
(transformers takes the logits in the compute dtype, then a fp32 softmax; in fp32 the two are the same).

The routed experts run on tokens permuted (sorted) by expert, so each expert's tokens are one contiguous
slice: `kernel="loop"` is the reference (one matmul pair per expert, any device and dtype), `"grouped_mm"`
is `torch._grouped_mm` over the same slices (one kernel for all experts; `"auto"` picks it for bf16 on CUDA).

Expert parallelism (`MoE.ep_group`, set by qwenft.distributed.expert_parallel): each of the group's ranks holds
E/ep experts (the fused weights are DTensors sharded on dim 0 over the group, so checkpoints and exports see the
whole [E, ...] tensors). Routing stays local; the routed pairs go to the rank of their expert by one all-to-all
and come back by another (`dispatch_combine`), whose backward is the reverse all-to-all.

Shape suffixes: n tokens (B*T), h hidden, e experts, k experts per token, m = n*k routed (token, expert)
pairs, i expert intermediate width; under expert parallelism p pairs a rank received for its experts, r ep ranks,
l experts on one rank.
"""

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from qwenft.models.weight_grad import stacked_projections

from .configs import TextConfig

KERNELS = ("auto", "grouped_mm", "loop")


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    @property
    def weight_grad_stack(self) -> tuple[str, ...]:
        """gate and up as one matmul (`weight_grad.stacked_linear`) on a tensor-parallel rank, whose shards read the
        whole (gathered) input: x's gradient is then one matmul's rather than a sum of two, which sequence
        parallelism would write out for its reduce-scatter. Whole, the two stay apart."""
        return ("gate_proj", "up_proj") if getattr(self.gate_proj, "output_shard", False) else ()

    def forward(self, x):
        gate, up = stacked_projections(self, x) or (self.gate_proj(x), self.up_proj(x))
        return self.down_proj(F.silu(gate) * up)


class RouterStats(NamedTuple):
    """One MoE layer's routing over the tokens it counts (all, or those of `router_mask`)."""

    load_e: torch.Tensor  # int64 [E]: tokens routed to each expert (with a mask: of the counted tokens)
    prob_sum_e: torch.Tensor  # fp32 (fp64 in an fp64 model) [E]: router probability summed over tokens; has grad
    tokens: torch.Tensor  # scalar in prob_sum_e's dtype: tokens counted


def load_balancing_loss(stats: list[RouterStats]) -> torch.Tensor:
    """transformers' `load_balancing_loss_func` (Switch Transformer's aux loss) over the layers of `stats`:
    `E * sum_e f_e * P_e`, f_e = assignments to expert e per token, P_e = mean router probability of e, both
    pooled over every layer and token before the product (not a per-layer loss averaged). f sums to top_k.

    Sums of `load_e`, `prob_sum_e` and `tokens` over ranks give the same pooled value; only `prob_sum_e` carries
    a gradient."""
    load_e = torch.stack([s.load_e for s in stats]).sum(0).float()
    prob_sum_e = torch.stack([s.prob_sum_e for s in stats]).sum(0)
    tokens = torch.stack([s.tokens for s in stats]).sum()
    return load_e.numel() * ((load_e / tokens) * (prob_sum_e / tokens)).sum()


def routing_rows(stats: dict[int, RouterStats], num_layers: int, num_experts: int,
                 like: torch.Tensor) -> torch.Tensor:
    """`stats` ({layer id: RouterStats}) as one tensor `[num_layers, 3, E]` in the router dtype: per layer the
    router probability summed over tokens (row 0, with grad), the tokens routed to each expert (row 1) and the
    tokens counted (row 2, in every column); zeros for layers not in `stats`. Summing such tensors over pipeline
    stages gives the whole model's routing of a microbatch (`routing_aux_loss`); `like` gives device and dtype."""
    dtype = torch.promote_types(like.dtype, torch.float32)
    zeros = torch.zeros(3, num_experts, dtype=dtype, device=like.device)
    rows = [zeros] * num_layers
    for i, s in stats.items():
        rows[i] = torch.stack([s.prob_sum_e.to(dtype), s.load_e.to(dtype), s.tokens.to(dtype).expand(num_experts)])
    return torch.stack(rows)


def routing_aux_loss(routing_l3e: torch.Tensor) -> torch.Tensor:
    """`load_balancing_loss` of a `routing_rows` tensor (pooled over its layers); the gradient flows through
    the probability row only."""
    load_e, prob_sum_e = routing_l3e[:, 1].detach().sum(0), routing_l3e[:, 0].sum(0)
    tokens = routing_l3e[:, 2, 0].detach().sum().clamp(min=1)
    return load_e.numel() * ((load_e / tokens) * (prob_sum_e / tokens)).sum()


def resolve_kernel(kernel: str, x: torch.Tensor) -> str:
    if kernel not in KERNELS:
        raise ValueError(f"model.kernels.moe={kernel!r}; valid: {list(KERNELS)}")
    if kernel != "auto":
        return kernel
    # torch's CUDA grouped GEMM takes bf16 only (torch 2.11-2.13); fp32 on CUDA and the CPU loop over experts
    use_grouped = x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
    return "grouped_mm" if use_grouped else "loop"


class Experts(nn.Module):
    """The routed experts' weights, fused as transformers stores them (rows of dim 0 = experts)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x_mh: torch.Tensor, load_e: torch.Tensor, kernel: str) -> torch.Tensor:
        """Expert outputs for tokens sorted by expert (`load_e[e]` consecutive rows each), in the same order.
        Under expert parallelism the weights are DTensors and `load_e` counts this rank's experts only."""
        gate_up, down = (w.to_local() if isinstance(w, DTensor) else w for w in (self.gate_up_proj, self.down_proj))
        if x_mh.shape[0] == 0:
            # No rows (an expert-parallel rank nobody routed to): the output still depends on the input and the
            # weights, so the backward runs this rank's side of the all-to-all that brought the rows (every ep
            # rank must) and the weights get a (zero) gradient (FSDP reduces the parameters that have one, and
            # every rank must reduce the same ones)
            return x_mh * 0 + 0 * (gate_up.sum() + down.sum())
        if kernel == "grouped_mm":
            return grouped_experts(x_mh, load_e, gate_up, down)
        return looped_experts(x_mh, load_e, gate_up, down)


def looped_experts(x_mh, load_e, gate_up_eih, down_ehi) -> torch.Tensor:
    """Reference: one SwiGLU per expert on its slice of the sorted tokens (one host sync for the counts)."""
    out, start = [], 0
    for e, count in enumerate(load_e.tolist()):
        if count == 0:
            continue
        gate_mi, up_mi = F.linear(x_mh[start:start + count], gate_up_eih[e]).chunk(2, dim=-1)
        out.append(F.linear(F.silu(gate_mi) * up_mi, down_ehi[e]))
        start += count
    return torch.cat(out)


def grouped_experts(x_mh, load_e, gate_up_eih, down_ehi) -> torch.Tensor:
    """`torch._grouped_mm` (private; torch >= 2.8): row group g of `x` times `w[g]`, groups ending at the
    int32 cumulative offsets `offs`; weights go in as [E, in, out] views. CUDA takes bf16 only; the CPU
    build also runs fp32. Every stride must be a multiple of 16 bytes (H and I multiples of 8 in bf16)."""
    offs = load_e.cumsum(0).to(torch.int32)
    gate_up_mi = torch._grouped_mm(x_mh, gate_up_eih.transpose(-2, -1), offs=offs)
    gate_mi, up_mi = gate_up_mi.chunk(2, dim=-1)
    return torch._grouped_mm(F.silu(gate_mi) * up_mi, down_ehi.transpose(-2, -1), offs=offs)


class MoE(nn.Module):
    """The sparse MLP of a Qwen3.5-MoE layer. Keys as transformers': `gate.weight` (router), `experts.*`,
    `shared_expert.*`, `shared_expert_gate.weight`.

    Each forward leaves its routing in `self.stats` (`RouterStats`, read it after the forward and before the
    backward: activation checkpointing's recompute overwrites it) for the aux loss and the expert load."""

    def __init__(self, cfg: TextConfig, kernel: str = "auto"):
        super().__init__()
        if kernel not in KERNELS:
            raise ValueError(f"model.kernels.moe={kernel!r}; valid: {list(KERNELS)}")
        self.top_k = cfg.num_experts_per_tok
        self.kernel = kernel
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        self.stats: RouterStats | None = None
        self.ep_group = None  # expert parallelism's process group (its ranks share out the experts), or None

    def forward(self, x_bth: torch.Tensor, router_mask: torch.Tensor | None = None) -> torch.Tensor:
        """`router_mask` [B, T] bool: the tokens `stats` counts (None = all); every token is routed either way."""
        x_nh = x_bth.flatten(0, -2)
        n = x_nh.shape[0]
        router_dtype = torch.promote_types(x_nh.dtype, torch.float32)  # fp32, or fp64 in an fp64 model
        probs_ne = F.linear(x_nh.to(router_dtype), self.gate.weight.to(router_dtype)).softmax(dim=-1)
        top_p_nk, top_e_nk = probs_ne.topk(self.top_k, dim=-1)
        top_w_nk = (top_p_nk / top_p_nk.sum(dim=-1, keepdim=True)).to(x_nh.dtype)

        # permute: (token, expert) pairs sorted by expert, stable so each expert keeps token order
        expert_m = top_e_nk.flatten()
        order_m = expert_m.argsort(stable=True)
        load_e = counts(expert_m, self.gate.out_features)
        x_mh, kernel = _RowsByExpert.apply(x_nh, order_m, self.top_k), resolve_kernel(self.kernel, x_nh)
        if self.ep_group is None:
            y_mh = self.experts(x_mh, load_e, kernel)
        else:
            y_mh = dispatch_combine(self.experts, x_mh, load_e, kernel, self.ep_group)
        # unpermute, then each token's weighted sum over its k experts
        y_nkh = y_mh.new_empty(y_mh.shape).index_copy(0, order_m, y_mh).view(n, self.top_k, -1)
        routed_nh = (y_nkh * top_w_nk.unsqueeze(-1)).sum(dim=1)

        shared_nh = torch.sigmoid(self.shared_expert_gate(x_nh)) * self.shared_expert(x_nh)
        self.stats = self._stats(probs_ne, top_e_nk, load_e, router_mask)
        return (routed_nh + shared_nh).view_as(x_bth)

    def _stats(self, probs_ne, top_e_nk, load_e, router_mask) -> RouterStats:
        if router_mask is None:
            return RouterStats(load_e.detach(), probs_ne.sum(dim=0), probs_ne.new_tensor(float(probs_ne.shape[0])))
        # weights instead of boolean indexing: a masked selection's size is data, which CUDA reads back to the
        # host (a sync per MoE layer, and again in a checkpointed layer's recompute)
        mask_n = router_mask.flatten().to(probs_ne.device)
        w_n = mask_n.to(probs_ne.dtype)
        counted_e = counts(top_e_nk.flatten(), probs_ne.shape[1], mask_n.repeat_interleave(top_e_nk.shape[1]))
        return RouterStats(counted_e, (probs_ne * w_n[:, None]).sum(dim=0), w_n.sum())


class _RowsByExpert(torch.autograd.Function):
    """`x_nh[order_m // k]`: each token's row once per expert it was routed to, in the pairs' expert order. The
    backward puts the pairs' gradients back in token order (each row written once) and sums each token's k of
    them in a fixed order, where indexing's backward accumulates them with CUDA atomics, in an order that can
    change from run to run: the tensor-parallel ranks that each run this replicated block must get bit-equal
    gradients, or their copies of the replicated parameters drift apart."""

    @staticmethod
    def forward(ctx, x_nh, order_m, k: int):
        ctx.save_for_backward(order_m)
        ctx.k = k
        return x_nh[order_m // k]

    @staticmethod
    def backward(ctx, grad_mh):
        (order_m,) = ctx.saved_tensors
        grad_nkh = grad_mh.new_empty(grad_mh.shape).index_copy_(0, order_m, grad_mh)
        return grad_nkh.view(-1, ctx.k, grad_mh.shape[-1]).sum(dim=1), None, None


class _AllToAll(torch.autograd.Function):
    """`all_to_all_single` of rows: `in_splits[r]` rows go to rank r, `out_splits[r]` come from it. The backward
    sends the gradients back the same way (the reverse all-to-all)."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        grad_in = grad.new_empty(sum(in_splits), *grad.shape[1:])
        dist.all_to_all_single(grad_in, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return grad_in, None, None, None


def counts(ids: torch.Tensor, n: int, keep: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [n]: how often each of 0..n-1 occurs in `ids` (where `keep`, if given). torch.bincount does this but
    reads the largest id back to the host first (a sync on CUDA); a scatter-add needs no sync."""
    ones = torch.ones_like(ids) if keep is None else keep.to(ids.dtype)
    return torch.zeros(n, dtype=ids.dtype, device=ids.device).scatter_add_(0, ids, ones)


def dispatch_combine(experts: Experts, x_mh: torch.Tensor, load_e: torch.Tensor, kernel: str, group) -> torch.Tensor:
    """Expert outputs of this rank's (token, expert) pairs sorted by expert (`load_e[e]` rows each, all E experts)
    when `group`'s ep ranks each hold E/ep consecutive experts: the rows of rank r's experts go to r, which runs
    its experts on what every rank sent, and the outputs come back in the rows' order. One host sync (the
    split sizes, which all_to_all_single takes as lists) per call."""
    ep = dist.get_world_size(group)
    send_rl = load_e.view(ep, -1)  # rows for each destination rank's local experts
    recv_rl = torch.empty_like(send_rl)  # rows from each source rank for this rank's experts
    dist.all_to_all_single(recv_rl, send_rl, group=group)
    send_splits, recv_splits = torch.stack([send_rl.sum(1), recv_rl.sum(1)]).tolist()
    x_ph = _AllToAll.apply(x_mh, recv_splits, send_splits, group)
    # received rows come by source rank, each source's rows by expert: sort them by expert (stable: sources in order)
    local_experts = torch.arange(recv_rl.shape[1], device=recv_rl.device).repeat(ep)
    order_p = torch.repeat_interleave(local_experts, recv_rl.flatten(), output_size=sum(recv_splits))
    order_p = order_p.argsort(stable=True)
    y_ph = experts(x_ph[order_p], recv_rl.sum(0), kernel)
    y_ph = y_ph.new_empty(y_ph.shape).index_copy(0, order_p, y_ph)
    return _AllToAll.apply(y_ph, send_splits, recv_splits, group)
