"""Pipeline parallelism: split the decoder into stages, place them on pp ranks, run a torch schedule.

    layers = split_layers(64, 4, ...)                 # [[0..15], [16..31], ...], balanced with embed/head cost
    ids = stage_ids_for_rank(pp_rank, pp, virtual, v_shaped)
    module = build_stage_model(cfg, layers[i], embed=i == 0, head=i == last)   # meta; then TP/AC/FSDP, load
    stages = [ReduceGradStage(module, i, n_stages, device, pp_group, reduce_grad_per_microbatch)]
    schedule = build_schedule("1f1b", stages, n_microbatches, loss_fn)
    loss = train_step(schedule, stages, batch, loss_fn, label_tokens)

Microbatches have fixed shapes ([microbatch_size, seq_len]); cu_seqlens (document boundaries, variable
length) never travels between stages: every stage gets `position_ids` as a kwarg and rebuilds cu_seqlens
from it (positions restart at 0 at each packed document).
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules

from qwenft.data.packing import cu_seqlens_from_position_ids
from qwenft.distributed.fsdp import param_groups
from qwenft.models.loss import count_label_tokens, token_ce_sum
from qwenft.models.qwen3_5.model import Qwen3_5Model

# config name -> torch class name (torch.distributed.pipelining.schedules, torch 2.13)
SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "looped_bfs": "ScheduleLoopedBFS",
    "interleaved_zb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
SINGLE_STAGE = ("gpipe", "1f1b")  # one stage per rank
V_SHAPED = ("zbv", "dualpipev")  # exactly two stages per rank: r and 2*pp-1-r
SPLIT_BACKWARD = ("interleaved_zb", "zbv", "dualpipev")  # input and weight gradients in separate steps

# Stage cost in layer-equivalents of the parts that are not decoder layers (see docs/parallelism.md).
EMBED_COST = 1.0  # embedding lookup: little compute, but a vocab x hidden table with its grads + Adam state
VISION_COST = 1.0  # the vision tower, when the model has one
HEAD_COST = 1.0  # final norm + lm_head + loss: a vocab x hidden matmul and the CE over the vocabulary


def default_virtual_stages(schedule: str) -> int:
    return 1 if schedule in SINGLE_STAGE else 2


def check_virtual_stages(schedule: str, virtual: int) -> None:
    if schedule in SINGLE_STAGE and virtual != 1:
        raise ValueError(f"pipeline.virtual_stages={virtual} but pipeline.schedule={schedule} runs one stage per "
                         f"rank; set pipeline.virtual_stages=1 or pick a multi-stage schedule")
    if schedule in V_SHAPED and virtual != 2:
        raise ValueError(f"pipeline.virtual_stages={virtual} but pipeline.schedule={schedule} needs exactly 2 "
                         f"stages per rank (V-shaped placement)")
    if virtual < 1:
        raise ValueError(f"pipeline.virtual_stages={virtual} must be >= 1")


def _balanced_split(num_layers: int, num_stages: int, first_cost: float, last_cost: float) -> list[int]:
    """Layers per stage, contiguous, each >= 1: minimal max stage cost, then the most even costs, then the most
    even layer counts (so 64 layers on 4 stages with 1 + 1 extra cost gives 16 each)."""
    def cost(stage: int, n: int) -> float:
        return n + (first_cost if stage == 0 else 0.0) + (last_cost if stage == num_stages - 1 else 0.0)

    # smallest achievable max stage cost: try candidates in increasing order
    candidates = sorted({cost(s, n) for s in range(num_stages) for n in range(1, num_layers + 1)})

    def best_under(limit: float):
        # dp[s][i]: (sum of squared costs, sum of squared layer counts, split) for the first i layers in s stages
        inf = (float("inf"), float("inf"), None)
        dp = [[inf] * (num_layers + 1) for _ in range(num_stages + 1)]
        dp[0][0] = (0.0, 0, [])
        for s in range(num_stages):
            for i in range(num_layers + 1):
                if dp[s][i][2] is None:
                    continue
                for n in range(1, num_layers - i + 1):
                    c = cost(s, n)
                    if c > limit:
                        break
                    ss, sn, split = dp[s][i]
                    cand = (ss + c * c, sn + n * n, split + [n])
                    if cand[:2] < dp[s + 1][i + n][:2]:
                        dp[s + 1][i + n] = cand
        return dp[num_stages][num_layers][2]

    for limit in candidates:
        split = best_under(limit)
        if split is not None:
            return split
    raise AssertionError("no split found")  # unreachable when num_layers >= num_stages


def split_layers(num_layers: int, num_stages: int, has_vision: bool = False, layers_per_stage=None,
                 stage_layers=None) -> list[list[int]]:
    """Layer indices of each pipeline stage (stage 0 also owns embeddings + vision, the last the head + loss)."""
    if layers_per_stage is not None and stage_layers is not None:
        raise ValueError("pipeline.layers_per_stage and pipeline.stage_layers are both set; set one of them")
    if stage_layers is not None:
        stage_layers = [list(map(int, s)) for s in stage_layers]
        if len(stage_layers) != num_stages:
            raise ValueError(f"pipeline.stage_layers has {len(stage_layers)} stages but the pipeline has "
                             f"{num_stages} (mesh.pp x pipeline.virtual_stages)")
        flat = [i for s in stage_layers for i in s]
        if sorted(flat) != list(range(num_layers)) or flat != sorted(flat) or any(not s for s in stage_layers):
            raise ValueError(f"pipeline.stage_layers={stage_layers} must list every layer 0..{num_layers - 1} "
                             f"once, in order, with at least one layer per stage")
        return stage_layers
    if layers_per_stage is not None:
        counts = [int(n) for n in layers_per_stage]
        if len(counts) != num_stages or sum(counts) != num_layers or min(counts) < 1:
            raise ValueError(f"pipeline.layers_per_stage={counts} must have {num_stages} entries "
                             f"(mesh.pp x pipeline.virtual_stages), each >= 1, summing to {num_layers} layers")
    else:
        if num_layers < num_stages:
            raise ValueError(f"the model has {num_layers} layers, fewer than the {num_stages} pipeline stages "
                             f"(mesh.pp x pipeline.virtual_stages)")
        counts = _balanced_split(num_layers, num_stages, EMBED_COST + (VISION_COST if has_vision else 0.0),
                                 HEAD_COST)
    starts = [sum(counts[:s]) for s in range(num_stages)]
    return [list(range(start, start + n)) for start, n in zip(starts, counts)]


def stage_ids_for_rank(pp_rank: int, pp: int, virtual: int, v_shaped: bool) -> list[int]:
    """Stages a pp rank runs: looped (r, r + pp, ...) or, for V schedules, r and 2*pp-1-r."""
    if v_shaped:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + v * pp for v in range(virtual)]


class StageModel(Qwen3_5Model):
    """A `Qwen3_5Model` holding one stage, with the calling convention torch pipelining uses: the activation
    arrives positionally (token ids on the first stage, hidden states after), everything else as kwargs.

    cu_seqlens is rebuilt from `position_ids` on each stage, since its length varies per microbatch and
    pipelining only sends fixed-shape activations. M-RoPE position ids arrive batch-first, `[B, 3, T]`, so the
    schedule's dim-0 split cuts batch rows, and are turned back into `[3, B, T]` here. Images travel padded to
    a fixed size (`stack_images`): `image_grid_thw` rows of zeros and `pixel_values` rows past the last real
    patch are dropped here, and a microbatch left without images gives the model `pixel_values=None`.
    `labels` reach every stage when the head computes the loss itself (`ce_chunk_tokens`); only the last
    stage uses them.
    """

    def forward(self, x, position_ids, pixel_values=None, image_grid_thw=None, labels=None):
        if position_ids.dim() == 3:  # M-RoPE travels as [B, 3, T] (`PipelineBatch`); the model takes [3, B, T]
            position_ids = position_ids.transpose(0, 1).contiguous()
        positions = position_ids[0] if position_ids.dim() == 3 else position_ids  # M-RoPE: temporal row
        cu_seqlens = cu_seqlens_from_position_ids(positions).to(x.device)
        if self.embed_tokens is None:
            return super().forward(hidden_states=x, position_ids=position_ids, cu_seqlens=cu_seqlens, labels=labels)
        if image_grid_thw is not None:
            image_grid_thw = image_grid_thw[image_grid_thw.prod(-1) > 0]
            pixel_values = pixel_values[: int(image_grid_thw.prod(-1).sum())] if len(image_grid_thw) else None
            image_grid_thw = image_grid_thw if len(image_grid_thw) else None
        return super().forward(input_ids=x, position_ids=position_ids, cu_seqlens=cu_seqlens,
                               pixel_values=pixel_values, image_grid_thw=image_grid_thw, labels=labels)


def build_stage_model(cfg, layer_ids, embed: bool, head: bool, kernels: str, ce_chunk_tokens: int = 0,
                      attention_kernel: str = "auto") -> StageModel:
    """Like `qwenft.models.loader.build_model`, on meta, as a `StageModel` (same parameter names)."""
    with torch.device("meta"):
        return StageModel(cfg, layer_ids=layer_ids, embed=embed, head=head, kernels=kernels,
                          ce_chunk_tokens=ce_chunk_tokens, attention_kernel=attention_kernel)


def stack_images(pixel_values: list, image_grid_thw: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-microbatch images -> two tensors whose dim 0 splits evenly into microbatches (zero padding),
    so a schedule can chunk them like the token tensors. `StageModel` drops the padding again. At least
    one (padding) row per microbatch, since torch's splitter refuses a dim 0 smaller than the chunk count."""
    max_patches = max(1, max(p.shape[0] for p in pixel_values))
    max_images = max(1, max(g.shape[0] for g in image_grid_thw))
    pv = torch.cat([torch.cat([p, p.new_zeros(max_patches - p.shape[0], *p.shape[1:])]) for p in pixel_values])
    grid = torch.cat([torch.cat([g, g.new_zeros(max_images - g.shape[0], 3)]) for g in image_grid_thw])
    return pv, grid


def reshard_policy(schedule: str, reduce_grad_per_microbatch: bool) -> bool:
    """Whether FSDP reshards parameters between microbatches (after forward and after backward).

    Knob off: no. Parameters stay unsharded from a stage's first forward to the step's one reduce-scatter
    (torch pipelining keeps them unsharded after backward anyway; resharding after forward would only add an
    all-gather per microbatch). Knob on: yes, memory first, except under the zero-bubble schedules: their
    deferred weight-gradient step looks up the stage's parameters by identity, so it needs the same
    unsharded parameters the forward used (measured: resharding there trains wrong numbers).
    At pp = 1 (schedule 1f1b) the same holds: knob off, each unit all-gathers once per step instead of in the
    first forward and again in every backward (runner.build_modules reshards anyway when a step has one
    microbatch).
    """
    return reduce_grad_per_microbatch and schedule not in SPLIT_BACKWARD


class ReduceGradStage(PipelineStage):
    """PipelineStage whose FSDP gradient reduction follows `pipeline.reduce_grad_per_microbatch`.

    torch's `backward_maybe_with_nosync` (2.13) always turns FSDP's gradient sync and reshard-after-backward
    off for every microbatch and reduces once in `perform_reduce_grad`: a full-size unsharded gradient
    accumulator per stage. With `reduce_grad_per_microbatch=True` this override keeps sync on, so each
    microbatch's backward reduce-scatters layer by layer into the sharded gradients and drops the unsharded
    ones. Zero-bubble schedules split the backward into an input part and a deferred weight part: the input
    part runs as torch has it (sync off), and the weight part ends with an explicit reduce-scatter.
    `reshard` (see `reshard_policy`) says whether parameters are resharded after each backward too.
    Can go when torch exposes this choice on PipelineStage.

    `record_grad_bytes=True` records, after the first microbatch's backward, the bytes of unsharded
    (full-size) and sharded gradients this stage holds (`first_backward_grad_bytes`), for tests.
    """

    def __init__(self, *args, reduce_grad_per_microbatch: bool = False, reshard: bool = False,
                 record_grad_bytes: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.reduce_grad_per_microbatch = reduce_grad_per_microbatch
        self.reshard = reshard
        self.record_grad_bytes = record_grad_bytes
        self.first_backward_grad_bytes: dict[str, int] | None = None

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        fsdp = self.submod if isinstance(self.submod, FSDPModule) else None
        if fsdp is None or not self.reduce_grad_per_microbatch or backward_type == "input":
            result = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        elif backward_type == "full":
            # What the parent does, with sync on: FSDP's post-backward hooks reduce-scatter per layer.
            from torch.distributed.pipelining._backward import stage_backward

            fsdp.set_is_last_backward(False)
            fsdp.set_requires_gradient_sync(True)
            fsdp.set_reshard_after_backward(self.reshard)
            result = (stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"],
                                     bwd_kwargs["input_values"]), None)
        else:  # "weight": gradients landed in the unsharded parameters with sync off; reduce-scatter them now
            result = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
            reduce_scatter_now(fsdp, self.reshard)
        if self.record_grad_bytes and self.first_backward_grad_bytes is None and backward_type != "input":
            self.first_backward_grad_bytes = grad_bytes(self.submod)
        return result


def reduce_scatter_now(fsdp: FSDPModule, reshard: bool) -> None:
    """Reduce-scatter every unsharded gradient of `fsdp` (and its sub-FSDP modules) into the sharded
    gradients: the post-backward that torch's `perform_reduce_grad` runs at the end of a step."""
    from torch.distributed.fsdp import fully_shard

    fsdp.set_requires_gradient_sync(True)
    fsdp.set_reshard_after_backward(reshard)
    for state in fully_shard.state(fsdp)._state_ctx.all_states:
        for group in param_groups(state):
            group.post_backward()
    fsdp.set_requires_gradient_sync(False)
    fsdp.set_reshard_after_backward(False)


def grad_bytes(module: nn.Module) -> dict[str, int]:
    """Bytes of gradients a module holds: `unsharded` = plain full-size tensors (FSDP's accumulator while
    parameters stay unsharded), `sharded` = the local shards of DTensor gradients; and how many tensors of
    each (`unsharded_tensors`, `sharded_tensors`)."""
    from torch.distributed.tensor import DTensor

    out = {"unsharded": 0, "sharded": 0, "unsharded_tensors": 0, "sharded_tensors": 0}
    for p in module.parameters():
        if p.grad is None:
            continue
        kind = "sharded" if isinstance(p.grad, DTensor) else "unsharded"
        local = p.grad.to_local() if kind == "sharded" else p.grad
        out[kind] += local.numel() * local.element_size()
        out[f"{kind}_tensors"] += 1
    return out


class TokenCE:
    """Pipeline loss: token CE summed over one microbatch / the label tokens of the whole global batch
    (set `label_tokens` before each step), so schedules run with scale_grads=False.

    `ce_in_model=True` (`model.ce_chunk_tokens`): the last stage was given the labels and returns the CE sum
    itself (chunked, never the whole logits), so only the division is left here.
    """

    def __init__(self, ce_in_model: bool = False):
        self.label_tokens = torch.ones(())
        self.ce_in_model = ce_in_model

    def __call__(self, output, labels):
        ce = output if self.ce_in_model else token_ce_sum(output, labels)
        return ce / self.label_tokens.clamp(min=1)


def build_schedule(name: str, stages: list[PipelineStage], n_microbatches: int, loss_fn):
    cls = getattr(torch_schedules, SCHEDULES[name])
    if name in SINGLE_STAGE:
        (stage,) = stages
        return cls(stage, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)


@dataclass
class PipelineBatch:
    """The microbatches of one step on one dp rank, stacked along dim 0 ([n * microbatch_size, seq_len]).
    M-RoPE `position_ids` are stored batch-first, [n * microbatch_size, 3, seq_len]; images padded per
    microbatch (`stack_images`)."""
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None

    @classmethod
    def from_microbatches(cls, microbatches: list[dict], device) -> "PipelineBatch":
        cat = lambda key: torch.cat([mb[key] for mb in microbatches]).to(device)  # noqa: E731
        images = {}
        if "pixel_values" in microbatches[0]:
            pv, grid = stack_images([mb["pixel_values"] for mb in microbatches],
                                    [mb["image_grid_thw"] for mb in microbatches])
            images = {"pixel_values": pv.to(device), "image_grid_thw": grid.to(device)}
        positions = [mb["position_ids"] for mb in microbatches]
        if positions[0].dim() == 3:  # M-RoPE [3, B, T] -> [B, 3, T]: the schedule splits dim 0 into microbatches
            positions = [p.transpose(0, 1) for p in positions]
        position_ids = torch.cat(positions).contiguous().to(device)
        return cls(cat("input_ids"), position_ids, cat("labels"), **images)

    def kwargs(self, labels: bool = False) -> dict:
        """Stage kwargs; `labels=True` adds the labels, for a last stage that computes the loss itself."""
        kw = {"position_ids": self.position_ids}
        if labels:
            kw["labels"] = self.labels
        if self.pixel_values is not None:
            kw.update(pixel_values=self.pixel_values, image_grid_thw=self.image_grid_thw)
        return kw


def _summed_loss(stages, losses: list, device) -> torch.Tensor:
    """This rank's summed microbatch losses (zero unless it runs the last stage)."""
    if any(s.is_last for s in stages) and losses:
        return torch.stack([loss.detach().float() for loss in losses]).sum()
    return torch.zeros((), device=device)


def _first_stage_args(stages, batch: PipelineBatch) -> tuple:
    """Positional inputs only on the rank that holds stage 0: torch 2.11's PipelineStage refuses positional
    args on later stages ("Can't supply input args for shape inference on non-first stage")."""
    return (batch.input_ids,) if any(stage.is_first for stage in stages) else ()


def train_step(schedule, stages, batch: PipelineBatch, loss_fn: TokenCE, label_tokens: torch.Tensor,
               dp_group, pp_group) -> torch.Tensor:
    """Forward + backward of all microbatches; returns the step loss summed over microbatches and dp ranks,
    on every rank (the last stage's value, all-reduced over pp)."""
    loss_fn.label_tokens = label_tokens
    losses: list = []
    schedule.step(*_first_stage_args(stages, batch), target=batch.labels, losses=losses, return_outputs=False,
                  **batch.kwargs(labels=loss_fn.ce_in_model))
    loss = _summed_loss(stages, losses, label_tokens.device)
    dist.all_reduce(loss, group=dp_group)
    dist.all_reduce(loss, group=pp_group)
    return loss


def pipeline_eval_loss(schedule, stages, batch: PipelineBatch, dp_group, pp_group,
                       ce_in_model: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward-only pass of a batch: (summed token CE, label tokens), both summed over dp ranks, on every rank.

    `schedule` should be one built for evaluation only (its own stages over the same modules, `build_schedule`
    with a `TokenCE` whose label_tokens stays 1): flipping a training schedule between step() and eval()
    makes torch redo its stage set-up on every switch. `ce_in_model` as that TokenCE's.
    """
    losses: list = []
    with torch.no_grad():
        schedule.eval(*_first_stage_args(stages, batch), target=batch.labels, losses=losses, return_outputs=False,
                      **batch.kwargs(labels=ce_in_model))
    for stage in stages:  # FSDP may keep parameters unsharded after a forward without backward
        for m in stage.submod.modules():
            if isinstance(m, FSDPModule):
                m.reshard()
    ce = _summed_loss(stages, losses, batch.labels.device)
    tokens = count_label_tokens(batch.labels).to(ce)
    dist.all_reduce(ce, group=dp_group)
    dist.all_reduce(ce, group=pp_group)
    dist.all_reduce(tokens, group=dp_group)
    return ce, tokens
