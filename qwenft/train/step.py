"""One training step's forward and backward, as the built `Job` runs it (qwenft.train.build): the microbatches of a
step accumulated on one model, or run through the pipeline schedule, with their loss summed over dp x cp; an
MoE model's routing metrics; the labels cut to a context-parallel rank's span."""

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from qwenft.distributed.fsdp import set_microbatch_grad_sync
from qwenft.distributed.mesh import batch_mesh, cp_size
from qwenft.train.evaluate import device_batch, forward_batch
from qwenft.train.spec import RunSpec


def span_labels(mb: dict, mesh) -> dict:
    """The microbatch with its labels (and the MTP head's) cut to this rank's span of the stream under context
    parallel (the model cuts everything else after its embedding, `context_parallel.CPShard`); as it is at
    mesh.cp=1."""
    if cp_size(mesh) == 1:
        return mb
    from qwenft.models.qwen3_5.context_parallel import split_labels

    cp = mesh["cp"]
    return {**mb, **{key: split_labels(mb[key], cp.get_local_rank(), cp.size())
                     for key in ("labels", "mtp_labels") if key in mb}}


def with_mtp_labels(mb: dict) -> dict:
    """The microbatch with the MTP head's targets (`mtp.mtp_labels`), from the whole rows, before any cp split."""
    from qwenft.models.qwen3_5.mtp import mtp_labels

    return {**mb, "mtp_labels": mtp_labels(mb["labels"], mb["cu_seqlens"])}


StepFn = Callable[[list[dict], torch.Tensor], torch.Tensor]


def accumulate(model: nn.Module, micro_batches: list[dict], label_tokens: torch.Tensor, device,
               reduce_grad_per_microbatch: bool, ce_in_model: bool, loss_fn=None) -> torch.Tensor:
    """Forward + backward of one step's microbatches without pipelining; returns this rank's summed loss.
    `loss_fn`: a `pipeline.schedule.TokenCE` (default: token CE alone); an MoE model's aux loss joins it
    when `loss_fn.aux_weight` is set, over the tokens outside the microbatch's `padding_mask`."""
    from qwenft.distributed.pipeline.schedule import TokenCE

    loss_fn = loss_fn or TokenCE(ce_in_model=ce_in_model)
    loss_fn.label_tokens = label_tokens
    loss_fn.reset()
    for i, mb in enumerate(micro_batches):
        set_microbatch_grad_sync(model, i == len(micro_batches) - 1, reduce_grad_per_microbatch)
        mb = device_batch(mb, device)
        labels = mb["labels"]
        moe = {}
        if model.cfg.text.is_moe:
            padding = mb.get("padding_mask")
            moe = {"return_routing": True, "router_mask": None if padding is None else ~padding}
        mtp = {"mtp_labels": mb["mtp_labels"]} if "mtp_labels" in mb else {}
        output = forward_batch(model, mb, **({"labels": labels} if ce_in_model else {}), **moe, **mtp)
        loss = loss_fn(output, labels)
        loss.backward()
    return loss_fn.main_sum


def token_loss(spec: RunSpec, model_cfg):
    """The step's loss function: token CE, plus router_aux_loss_coef x the aux loss averaged over the global
    batch's microbatches for an MoE model (docs/models.md, "Training an MoE model")."""
    from qwenft.distributed.pipeline.schedule import TokenCE

    t, b = model_cfg.text, spec.batching
    # every cp rank computes the aux loss of the whole stream's routing (summed over the spans), so a cp rank's
    # share is 1/cp of it
    layout = spec.layout
    aux_weight = t.router_aux_loss_coef / (b.num_microbatches * layout.dp * layout.cp) if t.is_moe else 0.0
    return TokenCE(ce_in_model=spec.parallel.ce_in_model, aux_weight=aux_weight, mtp_weight=spec.parallel.mtp_weight)


def accumulation_step(model: nn.Module, spec: RunSpec, loss_fn, loss_group, device) -> StepFn:
    def step(micro_batches: list[dict], label_tokens: torch.Tensor) -> torch.Tensor:
        loss = accumulate(model, micro_batches, label_tokens, device, spec.parallel.reduce_grad_per_microbatch,
                          spec.parallel.ce_in_model, loss_fn)
        dist.all_reduce(loss, group=loss_group)
        return loss
    return step


def moe_step_metrics(job: "Job") -> dict:
    """An MoE model's routing in the step just run, summed over dp ranks (a collective: every rank calls it):
    `aux_loss`, the load-balancing loss averaged over the global batch's microbatches (before
    router_aux_loss_coef), and `expert_load_max_over_mean`, per layer the tokens of its busiest expert over the
    mean per expert (1.0 = balanced). {} for a dense model."""
    t, loss_fn = job.model_cfg.text, job.loss_fn
    if not t.is_moe:
        return {}
    totals = torch.zeros(1 + t.num_hidden_layers * t.num_experts, device=job.device, dtype=torch.float64)
    if loss_fn.aux_sum is not None:  # the rank that computed the loss (the last pipeline stage's)
        totals[0] = loss_fn.aux_sum
        totals[1:] = loss_fn.load_le.flatten()
    dist.all_reduce(totals, group=job.loss_group)
    if job.spec.layout.pp > 1:
        dist.all_reduce(totals, group=job.pp_group)
    load_le = totals[1:].view(t.num_hidden_layers, t.num_experts)
    ratio = load_le.amax(dim=1) / load_le.mean(dim=1).clamp(min=1)
    # summed over dp x cp: each cp rank holds its microbatches' whole routing (model.forward sums it over cp)
    microbatches = job.spec.batching.num_microbatches * job.spec.layout.dp * job.spec.layout.cp
    return {"aux_loss": totals[0].item() / microbatches,
            "expert_load_max_over_mean": [round(r, 3) for r in ratio.tolist()]}


def mtp_step_metrics(job: "Job") -> dict:
    """The MTP head's numbers in the step just run (a collective: every rank calls it): `mtp_loss`, its CE per
    target token over the global batch, and `mtp_accuracy`, the share of those targets that are the head's top-1
    (teacher-forced: the acceptance rate one draft token would see). {} without a trained head."""
    loss_fn = job.loss_fn
    if loss_fn.mtp_weight is None:
        return {}
    totals = torch.zeros(2, device=job.device, dtype=torch.float64)
    if loss_fn.mtp_sum is not None:  # the rank that computed the loss (the last pipeline stage's)
        totals[0], totals[1] = loss_fn.mtp_sum, loss_fn.mtp_hits
    dist.all_reduce(totals, group=job.loss_group)
    if job.spec.layout.pp > 1:
        dist.all_reduce(totals, group=job.pp_group)
    tokens = max(int(loss_fn.mtp_tokens.item()), 1)
    return {"mtp_loss": totals[0].item() / tokens, "mtp_accuracy": totals[1].item() / tokens}


def pipeline_stages(parts: list[tuple[int, nn.Module]], spec: RunSpec, mesh, device) -> list:
    from qwenft.distributed.pipeline import stage as pp_stage

    par = spec.parallel
    return [pp_stage.ReduceGradStage(module, i, par.num_stages, device, group=mesh["pp"].get_group(),
                                     reduce_grad_per_microbatch=par.reduce_grad_per_microbatch,
                                     reshard=par.reshard_after_forward)
            for i, module in parts]


def pipeline_step(stages: list, spec: RunSpec, loss_fn, mesh, device) -> StepFn:
    from qwenft.distributed.pipeline import schedule as pp_schedule

    name, n = spec.parallel.schedule, spec.batching.num_microbatches
    try:
        schedule = pp_schedule.build_schedule(name, stages, n, loss_fn)
    except ValueError as e:
        raise ValueError(f"pipeline.schedule={name} with {n} microbatches per step and {spec.parallel.num_stages} "
                         f"stages: {str(e).splitlines()[0]}") from None
    loss_group, pp_group = batch_mesh(mesh).get_group(), mesh["pp"].get_group()

    def step(micro_batches: list[dict], label_tokens: torch.Tensor) -> torch.Tensor:
        batch = pp_schedule.PipelineBatch.from_microbatches(micro_batches, device)
        return pp_schedule.train_step(schedule, stages, batch, loss_fn, label_tokens, loss_group, pp_group)
    return step
