"""Running a step's microbatches through the stages: the batch layout a schedule splits, the loss it calls,
training and evaluation steps."""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules

from qwenft.distributed.pipeline.split import SINGLE_STAGE
from qwenft.models.loss import count_label_tokens, token_ce_sum
from qwenft.models.qwen3_5.moe import routing_aux_loss

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


def stack_images(pixel_values: list, image_grid_thw: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-microbatch images (or videos) -> two tensors whose dim 0 splits evenly into microbatches (zero padding),
    so a schedule can chunk them like the token tensors. `StageModel` drops the padding again. At least
    one (padding) row per microbatch, since torch's splitter refuses a dim 0 smaller than the chunk count."""
    max_patches = max(1, max(p.shape[0] for p in pixel_values))
    max_images = max(1, max(g.shape[0] for g in image_grid_thw))
    pv = torch.cat([torch.cat([p, p.new_zeros(max_patches - p.shape[0], *p.shape[1:])]) for p in pixel_values])
    grid = torch.cat([torch.cat([g, g.new_zeros(max_images - g.shape[0], 3)]) for g in image_grid_thw])
    return pv, grid


class TokenCE:
    """The training loss of one microbatch: token CE summed over it / the label tokens of the whole global batch
    (set `label_tokens` before each step), plus for an MoE model `aux_weight` x its load-balancing loss; used
    with and without pipelining, so schedules run with scale_grads=False.

    `ce_in_model=True` (`model.ce_chunk_tokens`): the model's head was given the labels and returns the CE sum
    itself (chunked, never the whole logits), so only the division is left here.

    MoE: the output is `(ce or logits, routing)` (`Qwen3_5Model.forward`'s `return_routing`), routing over every
    layer of the microbatch. The aux loss is transformers' (pooled over layers and this microbatch's tokens),
    one per microbatch; `aux_weight` = router_aux_loss_coef / (microbatches per step x dp) averages it over the
    global batch's microbatches, since the gradients are summed over dp ranks. `aux_sum` and `load_le` collect
    the step's aux losses (without the weight) and tokens per layer and expert on the rank that computes the loss;
    `reset()` them before each step.

    MTP (`mtp_weight` set, model.mtp=train|head): the output ends with the MTP head's CE sum and top-1 hits
    (`Qwen3_5Model.forward`), and `mtp_weight` x that CE / the MTP targets of the whole global batch (`mtp_tokens`,
    set before each step like `label_tokens`) joins the loss. `main_sum` collects the step's loss without that term
    (the logged `loss`, the same as without MTP), `mtp_sum` and `mtp_hits` the head's CE and hits, for its metrics.
    """

    def __init__(self, ce_in_model: bool = False, aux_weight: float = 0.0, mtp_weight: float | None = None):
        self.label_tokens = torch.ones(())
        self.mtp_tokens = torch.ones(())
        self.ce_in_model = ce_in_model
        self.aux_weight = aux_weight
        self.mtp_weight = mtp_weight
        self.reset()

    def reset(self) -> None:
        self.calls: list[dict] = []  # per microbatch: its loss without the MTP term, aux, load_le, mtp_ce, mtp_hits

    def keep_last(self, n: int) -> None:
        """Keep the last `n` calls' records: a pipeline schedule's first step also calls the loss once to infer
        the backward's shapes, before its microbatches."""
        self.calls = self.calls[len(self.calls) - n:] if n else []

    def _total(self, key):
        values = [call[key] for call in self.calls if key in call]
        return sum(values[1:], values[0]) if values else None

    main_sum = property(lambda self: self._total("main"))
    aux_sum = property(lambda self: self._total("aux"))
    load_le = property(lambda self: self._total("load_le"))
    mtp_sum = property(lambda self: self._total("mtp_ce"))
    mtp_hits = property(lambda self: self._total("mtp_hits"))

    def __call__(self, output, labels):
        output, *rest = output if isinstance(output, tuple) else (output,)
        call, mtp = {}, None
        if self.mtp_weight is not None and len(rest) >= 2:
            *rest, mtp, hits = rest
            call.update(mtp_ce=mtp.detach(), mtp_hits=hits)
        ce = output if self.ce_in_model else token_ce_sum(output, labels)
        loss = ce / self.label_tokens.clamp(min=1)
        if rest:
            (routing,) = rest
            aux = routing_aux_loss(routing)
            call.update(aux=aux.detach(), load_le=routing[:, 1].detach())
            loss = loss + self.aux_weight * aux
        call["main"] = loss.detach()
        self.calls.append(call)
        if mtp is None:
            return loss
        return loss + self.mtp_weight * mtp / self.mtp_tokens.clamp(min=1)


def microbatch_rule(name: str, n_microbatches: int, pp: int, virtual_stages: int) -> str | None:
    """Why torch's schedule `name` refuses `n_microbatches` on `pp` ranks of `virtual_stages` stages each, or None:
    the checks of its constructor, restated so that a run refuses them before it builds or writes anything."""
    stages = pp * virtual_stages
    if name in ("1f1b", "dualpipev") and n_microbatches < stages:
        return f"it needs at least as many microbatches as stages ({stages})"
    rounds = max(1, n_microbatches // pp)
    if name in ("interleaved_1f1b", "interleaved_zb") and n_microbatches % rounds:
        return f"it needs a multiple of its rounds (microbatches // mesh.pp = {rounds})"
    return None


def build_schedule(name: str, stages: list[PipelineStage], n_microbatches: int, loss_fn):
    cls = getattr(torch_schedules, SCHEDULES[name])
    if name in SINGLE_STAGE:
        (stage,) = stages
        return cls(stage, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)


@dataclass
class PipelineBatch:
    """The microbatches of one step on one dp rank, stacked along dim 0 ([n * microbatch_size, seq_len]).
    M-RoPE `position_ids` are stored batch-first, [n * microbatch_size, 3, seq_len]; images and videos padded
    per microbatch (`stack_images`); `padding_mask` (the rows' padding tails) reaches every stage, whose MoE layers
    leave those tokens out of the aux loss."""
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    padding_mask: torch.Tensor | None = None
    mtp_labels: torch.Tensor | None = None  # model.mtp=train|head: the MTP head's targets, to the last stage

    @classmethod
    def from_microbatches(cls, microbatches: list[dict], device) -> "PipelineBatch":
        cat = lambda key: torch.cat([mb[key] for mb in microbatches]).to(device)  # noqa: E731
        images = {}
        for pixels, grids in (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw")):
            if pixels in microbatches[0]:
                pv, grid = stack_images([mb[pixels] for mb in microbatches], [mb[grids] for mb in microbatches])
                images.update({pixels: pv.to(device), grids: grid.to(device)})
        positions = [mb["position_ids"] for mb in microbatches]
        if positions[0].dim() == 3:  # M-RoPE [3, B, T] -> [B, 3, T]: the schedule splits dim 0 into microbatches
            positions = [p.transpose(0, 1) for p in positions]
        position_ids = torch.cat(positions).contiguous().to(device)
        optional = {key: cat(key) for key in ("padding_mask", "mtp_labels") if key in microbatches[0]}
        return cls(cat("input_ids"), position_ids, cat("labels"), **images, **optional)

    def kwargs(self, labels: bool = False) -> dict:
        """Stage kwargs; `labels=True` adds the labels, for a last stage that computes the loss itself."""
        kw = {"position_ids": self.position_ids}
        if labels:
            kw["labels"] = self.labels
        if self.pixel_values is not None:
            kw.update(pixel_values=self.pixel_values, image_grid_thw=self.image_grid_thw)
        if self.pixel_values_videos is not None:
            kw.update(pixel_values_videos=self.pixel_values_videos, video_grid_thw=self.video_grid_thw)
        if self.padding_mask is not None:
            kw["padding_mask"] = self.padding_mask
        if self.mtp_labels is not None:
            kw["mtp_labels"] = self.mtp_labels
        return kw


def _summed_loss(stages, losses: list, device) -> torch.Tensor:
    """This rank's summed microbatch losses (zero unless it runs the last stage)."""
    if any(s.is_last for s in stages) and losses:
        return torch.stack([loss.detach().float() for loss in losses]).sum()
    return torch.zeros((), device=device)


def _token_loss(stages, loss_fn: TokenCE, device) -> torch.Tensor:
    """This rank's summed loss of the step without the MTP head's term (zero unless it runs the last stage)."""
    if any(s.is_last for s in stages) and loss_fn.main_sum is not None:
        return loss_fn.main_sum.float()
    return torch.zeros((), device=device)


def _first_stage_args(stages, batch: PipelineBatch) -> tuple:
    """Positional inputs only on the rank that holds stage 0: torch 2.11's PipelineStage refuses positional
    args on later stages ("Can't supply input args for shape inference on non-first stage")."""
    return (batch.input_ids,) if any(stage.is_first for stage in stages) else ()


def train_step(schedule, stages, batch: PipelineBatch, loss_fn: TokenCE, label_tokens: torch.Tensor,
               loss_group, pp_group) -> torch.Tensor:
    """Forward + backward of all microbatches; returns the step loss summed over microbatches and the loss
    group (dp x cp), on every rank (the last stage's value, all-reduced over pp)."""
    loss_fn.label_tokens = label_tokens
    loss_fn.reset()
    losses: list = []
    schedule.step(*_first_stage_args(stages, batch), target=batch.labels, losses=losses, return_outputs=False,
                  **batch.kwargs(labels=loss_fn.ce_in_model))
    loss_fn.keep_last(len(losses))
    loss = _token_loss(stages, loss_fn, label_tokens.device)
    dist.all_reduce(loss, group=loss_group)
    dist.all_reduce(loss, group=pp_group)
    return loss


def pipeline_eval_loss(schedule, stages, batch: PipelineBatch, loss_group, pp_group,
                       ce_in_model: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward-only pass of a batch: (summed token CE, label tokens), both summed over the loss group (dp x cp),
    on every rank.

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
    dist.all_reduce(ce, group=loss_group)
    dist.all_reduce(ce, group=pp_group)
    dist.all_reduce(tokens, group=loss_group)
    return ce, tokens
