"""Forward passes outside the training step: a microbatch's summed token CE, and the validation loss with
and without pipeline parallelism."""

import itertools

import torch
import torch.distributed as dist

from qwenft.constants import IGNORE_INDEX
from qwenft.models.qwen3_5 import varlen
from qwenft.models.loss import count_label_tokens, token_ce_sum
from qwenft.transfer import copy_to_device


def device_batch(mb: dict, device) -> dict:
    """A microbatch's tensors on `device`, copied without making the host wait for the GPU (so it queues this
    microbatch's kernels while the last one's still run), its `cu_seqlens` known to the model's kernels with
    the host offsets they came from and the rows' padding tails (`varlen.to_device`)."""
    out = {k: copy_to_device(v, device) for k, v in mb.items() if k != "cu_seqlens"}
    out["cu_seqlens"] = varlen.to_device(mb["cu_seqlens"], device, mb.get("padding_mask"))
    return out


def forward_batch(model, mb: dict, **kwargs):
    """The model's forward on a microbatch from `device_batch`."""
    images = {}
    if "image_grid_thw" in mb and len(mb["image_grid_thw"]):
        images = {"pixel_values": mb["pixel_values"], "image_grid_thw": mb["image_grid_thw"]}
    if "video_grid_thw" in mb and len(mb["video_grid_thw"]):
        images.update(pixel_values_videos=mb["pixel_values_videos"], video_grid_thw=mb["video_grid_thw"])
    return model(input_ids=mb["input_ids"], position_ids=mb["position_ids"], cu_seqlens=mb["cu_seqlens"], **images,
                 **kwargs)


def ce_sum(model, mb: dict, device, ce_in_model: bool) -> torch.Tensor:
    """Token CE summed over a microbatch's labels: from the logits, or (model.ce_chunk_tokens > 0) computed by
    the model's head itself, chunk by chunk, without the whole logits."""
    mb = device_batch(mb, device)
    if ce_in_model:
        return forward_batch(model, mb, labels=mb["labels"])
    return token_ce_sum(forward_batch(model, mb), mb["labels"])


def val_micro_batches(val_data, max_batches: int | None) -> list[dict]:
    """The validation micro batches, the first `max_batches` (all: None) made and no more (a VLM's pixels)."""
    return list(itertools.islice(val_data.eval_batches(), max_batches))


def eval_loss_unpipelined(model, val_batches: list[dict], device, loss_group, ce_in_model: bool) -> float:
    """Mean token CE over the validation batches: CE summed over microbatches and the loss group (dp x cp) /
    label tokens."""
    from torch.distributed.fsdp import FSDPModule

    model.eval()
    ce = torch.zeros((), device=device, dtype=torch.float64)
    tokens = torch.zeros((), dtype=torch.float64)  # counted on the host: no copy to wait for per microbatch
    with torch.no_grad():
        for mb in val_batches:
            ce += ce_sum(model, mb, device, ce_in_model).double()
            tokens += count_label_tokens(mb["labels"])
    for m in model.modules():  # FSDP keeps the root's parameters unsharded after a forward without backward
        if isinstance(m, FSDPModule):
            m.reshard()
    model.train()
    totals = torch.stack([ce, tokens.to(device)])
    dist.all_reduce(totals, group=loss_group)
    return (totals[0] / totals[1].clamp(min=1)).item()


def build_eval_schedule(stage_modules: list[tuple[int, torch.nn.Module]], num_stages: int, schedule: str,
                        num_microbatches: int, ce_in_model: bool, device, pp_group):
    """A forward-only schedule over new PipelineStages of this rank's (stage index, module) pairs, the modules
    training runs (see pipeline_eval_loss)."""
    from qwenft.distributed.pipeline import schedule as pp_schedule
    from torch.distributed.pipelining import PipelineStage

    stages = [PipelineStage(module, i, num_stages, device, group=pp_group) for i, module in stage_modules]
    loss_fn = pp_schedule.TokenCE(ce_in_model=ce_in_model)
    return stages, pp_schedule.build_schedule(schedule, stages, num_microbatches, loss_fn)


def eval_loss_pipelined(eval_schedule, val_batches: list[dict], num_microbatches: int, device, loss_group,
                         pp_group, ce_in_model: bool) -> float:
    """Mean token CE through the pipeline; the last group of microbatches is filled up with label-free copies."""
    from qwenft.distributed.pipeline import schedule as pp_schedule

    stages, schedule = eval_schedule
    for s in stages:
        s.submod.eval()
    ce = torch.zeros((), device=device)
    tokens = torch.zeros((), device=device)
    for start in range(0, len(val_batches), num_microbatches):
        group = val_batches[start:start + num_microbatches]
        filler = dict(group[-1], labels=torch.full_like(group[-1]["labels"], IGNORE_INDEX))
        group = group + [filler] * (num_microbatches - len(group))
        batch = pp_schedule.PipelineBatch.from_microbatches(group, device)
        group_ce, group_tokens = pp_schedule.pipeline_eval_loss(schedule, stages, batch, loss_group, pp_group,
                                                                ce_in_model)
        ce += group_ce
        tokens += group_tokens
    for s in stages:
        s.submod.train()
    return (ce / tokens.clamp(min=1)).item()
