"""One pipeline stage: the model slice it runs (`StageModel`) and how FSDP reduces its gradients per
microbatch (`ReduceGradStage`, the `pipeline.reduce_grad_per_microbatch` knob)."""

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage

from qwenft.data.packing import cu_seqlens_from_position_ids
from qwenft.distributed.fsdp import param_groups
from qwenft.distributed.pipeline.split import SPLIT_BACKWARD
from qwenft.models.qwen3_5 import varlen
from qwenft.models.qwen3_5.model import Qwen3_5Model


class StageModel(Qwen3_5Model):
    """A `Qwen3_5Model` holding one stage, with the calling convention torch pipelining uses: the activation
    arrives positionally (token ids on the first stage, hidden states after), everything else as kwargs.

    cu_seqlens is rebuilt from `position_ids` on each stage, since its length varies per microbatch and
    pipelining only sends fixed-shape activations; `padding_mask` cuts the padding tails for the recurrent layers
    there as `device_batch` does. M-RoPE position ids arrive batch-first, `[B, 3, T]`, so the
    schedule's dim-0 split cuts batch rows, and are turned back into `[3, B, T]` here. Images and videos travel
    padded to a fixed size (`stack_images`): grid rows of zeros and pixel rows past the last real patch are
    dropped here (`_unpad`), and a microbatch left without images (videos) gives the model `pixel_values=None`
    (`pixel_values_videos=None`).
    `labels` reach every stage when the head computes the loss itself (chunked or fused CE); only the last
    stage uses them.

    MoE: every stage returns `(output, routing)` and a later stage receives `routing` as its second positional
    input: the router statistics of the layers so far (`Qwen3_5Model.forward`'s `return_routing`), so the last
    stage's loss sees the whole model's routing of the microbatch and the aux loss's gradient reaches every
    stage's router through the pipeline's own backward. `padding_mask` (`[B, T]`, the rows' padding tails) keeps
    those tokens out of the routing statistics.
    """

    def forward(self, x, *carried, position_ids, pixel_values=None, image_grid_thw=None, pixel_values_videos=None,
                video_grid_thw=None, labels=None, padding_mask=None, mtp_labels=None):
        # what an earlier stage returned after its hidden states: the routing so far (MoE), then the next tokens'
        # embeddings (model.mtp=train|head)
        carried = list(carried)
        mtp = {}
        if self.mtp_mode != "keep":
            mtp = {"mtp_labels": mtp_labels, **({"mtp_embeds": carried.pop()} if carried and self.embed_tokens is None
                                                 else {})}
        routing = carried.pop() if carried else None
        if position_ids.dim() == 3:  # M-RoPE travels as [B, 3, T] (`PipelineBatch`); the model takes [3, B, T]
            position_ids = position_ids.transpose(0, 1).contiguous()
        positions = position_ids[0] if position_ids.dim() == 3 else position_ids  # M-RoPE: temporal row
        # built on the host (positions and padding copied back once: the offsets' host copy needs that anyway) and
        # registered with the rows' padding (`varlen.to_device`), so the recurrent layers take the tails in pieces
        cu_seqlens = varlen.to_device(cu_seqlens_from_position_ids(positions.cpu()), x.device,
                                      None if padding_mask is None else padding_mask.cpu())
        moe = {}
        if self.cfg.text.is_moe:
            moe = dict(routing=routing, return_routing=True,
                       router_mask=None if padding_mask is None else ~padding_mask)
        if self.embed_tokens is None:
            return super().forward(hidden_states=x, position_ids=position_ids, cu_seqlens=cu_seqlens, labels=labels,
                                   **moe, **mtp)
        pixel_values, image_grid_thw = _unpad(pixel_values, image_grid_thw)
        pixel_values_videos, video_grid_thw = _unpad(pixel_values_videos, video_grid_thw)
        return super().forward(input_ids=x, position_ids=position_ids, cu_seqlens=cu_seqlens,
                               pixel_values=pixel_values, image_grid_thw=image_grid_thw,
                               pixel_values_videos=pixel_values_videos, video_grid_thw=video_grid_thw, labels=labels,
                               **moe, **mtp)


def _unpad(pixels, grid):
    """A microbatch's images (videos) without `stack_images`' padding; (None, None) when it has none."""
    if grid is None:
        return None, None
    grid = grid[grid.prod(-1) > 0]
    if not len(grid):
        return None, None
    return pixels[: int(grid.prod(-1).sum())], grid


def build_stage_model(cfg, layer_ids, embed: bool, head: bool, kernels: str, ce_chunk_tokens: int = 0,
                      attention_kernel: str = "auto", ce_kernel: str = "torch", moe_kernel: str = "auto",
                      mtp: str = "keep") -> StageModel:
    """Like `qwenft.models.loader.build_model`, on meta, as a `StageModel` (same parameter names)."""
    with torch.device("meta"):
        return StageModel(cfg, layer_ids=layer_ids, embed=embed, head=head, kernels=kernels,
                          ce_chunk_tokens=ce_chunk_tokens, attention_kernel=attention_kernel, ce_kernel=ce_kernel,
                          moe_kernel=moe_kernel, mtp=mtp)


def reshard_policy(schedule: str, reduce_grad_per_microbatch: bool) -> bool:
    """Whether FSDP reshards parameters between microbatches (after forward and after backward).

    Knob off: no. Parameters stay unsharded from a stage's first forward to the step's one reduce-scatter
    (torch pipelining keeps them unsharded after backward anyway; resharding after forward would only add an
    all-gather per microbatch). Knob on: yes, memory first, except under the zero-bubble schedules: their
    deferred weight-gradient step looks up the stage's parameters by identity, so it needs the same
    unsharded parameters the forward used (measured: resharding there trains wrong numbers).
    At pp = 1 (schedule 1f1b) the same holds: knob off, each unit all-gathers once per step instead of in the
    first forward and again in every backward (`qwenft.train.spec.resolve_parallel` reshards anyway when a step
    has one microbatch).
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


