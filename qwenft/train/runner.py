"""The training loop over a built `Job` (qwenft.train.build): step -> log -> validate -> checkpoint or stop."""

import logging
import math
import os
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.profiler import record_function

from qwenft.checkpoint import mtp
from qwenft.checkpoint.dcp import free_bytes, size_text
from qwenft.checkpoint.hf_export import export_hf, export_merged_hf, export_peft_adapter, full_state_dict
from qwenft.conf.schema import Config
from qwenft.distributed.tensor_parallel import clip_grad_norm_
from qwenft.launch import signals
from qwenft.train.build import Job, build_job
from qwenft.train.optim import LowPrecisionAdamW
from qwenft.train.peft_setup import lora_config
from qwenft.train.step import moe_step_metrics, mtp_step_metrics, span_labels, with_mtp_labels
from qwenft.models.loss import count_label_tokens
from qwenft.models.weight_grad import prepare_grads
from qwenft.train.metrics import peak_memory_gib
from qwenft.transfer import copy_to_device, read_later

log = logging.getLogger("qwenft")


@dataclass
class RunResult:
    run_dir: Path
    losses: list[float] = field(default_factory=list)
    state_dict: dict | None = None  # full (unsharded) parameters after training, when asked for
    val_losses: dict[int, float] = field(default_factory=dict)  # step -> validation loss (eval.every_steps)
    skipped_steps: int = 0  # steps skipped for a non-finite loss or grad norm (train.on_nonfinite=skip), resumes included
    preempted: str | None = None  # the signal that stopped the run after a checkpoint (docs/checkpointing.md)


@dataclass
class StepStats:
    loss: float
    grad_norm: float
    label_tokens: int
    lr: float  # the rate this step trained with
    moe: dict = field(default_factory=dict)  # an MoE model's aux loss and expert load (step.moe_step_metrics)
    mtp: dict = field(default_factory=dict)  # a trained MTP head's loss and accuracy (step.mtp_step_metrics)
    stop_signal: str | None = None  # the signal every rank agreed to stop on (signals.StopOnSignal), or None


def run(cfg: Config, return_state: bool = False, on_step=None, command_args: list[str] | None = None) -> RunResult:
    """Train as `qwenft train` does; `on_step(step)`, if given, runs after each step (scripts/bench.py's profiler).
    `command_args`: the `qwenft train` arguments, for the resume command a stopped run prints. A second Ctrl-C
    raises signals.Interrupted, its message the line to print, after the checkpoint being written is removed."""
    torchrun = "TORCHELASTIC_RUN_ID" in os.environ and cfg.launcher.nproc_per_node <= 1  # the user's own torchrun
    with signals.StopOnSignal(command_args, torchrun) as stop, ExitStack() as cleanup:  # cleanup: the run dir's lock
        job = build_job(cfg, save_config=lambda run_dir: _save_config(cfg, run_dir), cleanup=cleanup)
        try:
            return train(job, stop, return_state, on_step)
        except BaseException as e:
            if not stop.interrupted:
                raise
            job.checkpointer.abandon()
            latest = job.checkpointer.latest()
            raise signals.Interrupted(
                "stopped at once by a second Ctrl-C, without a checkpoint of this step (nothing half-written kept); "
                + (f"the newest complete checkpoint is {latest}; resume with: {stop.resume_command(job.run_dir)}"
                   if latest else "there is no checkpoint to resume (the same command starts afresh)")) from e


def _save_config(cfg: Config, run_dir: Path) -> None:
    from qwenft.conf import to_yaml

    (run_dir / "config.yaml").write_text(to_yaml(cfg, run_dir=str(run_dir)))


def train(job: Job, stop: signals.StopOnSignal, return_state: bool = False, on_step=None) -> RunResult:
    """Steps from job.start_step to job.max_steps, or until a signal stops the run after a checkpoint."""
    cfg = job.cfg
    result = RunResult(run_dir=job.run_dir, skipped_steps=job.checkpointer.skipped_steps)
    progress = None
    if job.is_main and cfg.train.progress_bar:
        from tqdm import tqdm

        progress = tqdm(total=job.max_steps, desc="train", dynamic_ncols=True)
        progress.update(job.start_step - 1)
    if cfg.checkpoint.every_steps:
        warn_low_disk(job)
    batches = iter(job.data)
    stream = seed_stream(job.mesh)
    for m in job.model_parts:
        m.train()
    try:  # a failure's line (train.on_nonfinite=error, a failed save, a Ctrl-C) on its own, not after the bar
        for step in range(job.start_step, job.max_steps + 1):
            start = time.perf_counter()
            seed_step(cfg.seed, step, stream)
            with record_function("qwenft.next_batches"):
                micro_batches = [next(batches) for _ in range(job.spec.batching.num_microbatches)]
            stats = train_step(job, micro_batches, step, result, stop, make_ahead=step < job.max_steps)
            elapsed = time.perf_counter() - start
            result.losses.append(stats.loss)
            if step % cfg.train.log_every == 0 or step == job.max_steps:
                with record_function("qwenft.log_step"):
                    log_step(job, step, stats, elapsed, result.skipped_steps)
            if job.validate is not None and (step % cfg.eval.every_steps == 0 or step == job.max_steps):
                validate(job, step, result)
            if progress is not None:
                progress.update(1)
                progress.set_postfix(loss=f"{stats.loss:.4f}", lr=f"{stats.lr:.2e}")
            if on_step is not None:
                on_step(step)
            if checkpoint_or_stop(job, step, stats.stop_signal, stop, result):
                break
        job.checkpointer.wait()
    finally:
        job.data.close()  # the data worker threads (data.num_workers), also after an error or a stop signal
        if progress is not None:
            progress.close()
    job.metrics.close()
    if result.preempted:
        return result
    finish(job, result, return_state)
    return result


def warn_low_disk(job: Job) -> None:
    """One line at start when the disk under checkpoints/ has less room than one checkpoint (collective)."""
    needed = job.checkpointer.bytes_needed()
    free = free_bytes(job.checkpointer.root)
    if free < needed:
        log.warning("checkpoints: %s free under %s, less than one checkpoint (about %s): saves will fail; free space, "
                    "or use a run_dir on a disk with room", size_text(free), job.checkpointer.root, size_text(needed))


def train_step(job: Job, micro_batches: list[dict], step: int, result: RunResult,
               stop: signals.StopOnSignal, make_ahead: bool = False) -> StepStats:
    """Forward + backward of one step's microbatches, gradient clipping, then the optimizer and lr steps unless
    the loss or grad norm is not finite (train.on_nonfinite); the stop signal agreed on (`stop`), read with the
    loss. `make_ahead`: make the next step's micro batches while the GPU finishes this one (`data.make_ahead`)."""
    cfg = job.cfg
    micro_batches, label_tokens = step_inputs(job, micro_batches)
    with record_function("qwenft.forward_backward"):
        step_loss = job.step(micro_batches, label_tokens)
    moe, mtp_metrics = moe_step_metrics(job), mtp_step_metrics(job)
    grad_norm, head_norm = clip_step_grads(job)
    lr = job.scheduler.get_last_lr()[0]
    stop_flag = stop.ask(job.device)
    # the step's one wait for the GPU (a dense model's; an MoE's routing metrics and the MTP head's read theirs
    # above): the loss, the norms, the token count and the stop signal, copied before the optimizer's kernels are
    # queued. LowPrecisionAdamW queues them now, skipped on the GPU if the loss or a norm is not finite, so they
    # run while the host reads and prepares the next step; another optimizer steps once the host has read them
    norms = [grad_norm] + ([] if head_norm is None else [head_norm])
    reading = read_later([step_loss, label_tokens, stop_flag, *norms])
    on_device = isinstance(job.optimizer, LowPrecisionAdamW)
    if on_device:
        finite = torch.stack([torch.isfinite(t.reshape(())) for t in (step_loss, *norms)]).all()
        with record_function("qwenft.optimizer_step"):
            job.optimizer.step(skip_if=~finite)
    if make_ahead:  # host work that would otherwise keep the GPU idle between this step's optimizer and the next
        with record_function("qwenft.make_ahead"):
            job.data.make_ahead(job.spec.batching.num_microbatches)
    with record_function("qwenft.wait_for_step"):
        loss_value, token_count, signum, *norm_values = reading()
    norm_value, token_count, stop_signal = norm_values[0], int(token_count), signals.agreed_signal(int(signum))
    norms_text = f"grad_norm={norm_value}"
    if head_norm is not None:  # model.mtp=head: the head's own norm, which the trunk's leaves out
        mtp_metrics["mtp_grad_norm"] = norm_values[1]
        norms_text += f", mtp_grad_norm={norm_values[1]}"
    # the loss and the norms are reduced over every rank, so all ranks take the same branch
    if all(math.isfinite(v) for v in (loss_value, *norm_values)):
        if not on_device:
            with record_function("qwenft.optimizer_step"):
                job.optimizer.step()
        job.scheduler.step()
    else:
        if on_device:  # its kernels changed nothing: its step counts go back
            job.optimizer.unstep()
        if cfg.train.on_nonfinite == "error":
            job.checkpointer.wait()  # checkpoint.async_save: publish the save in flight (every rank is here)
            raise ValueError(f"non-finite loss/grad norm at step {step} (loss={loss_value}, {norms_text}); "
                             "lower optim.lr, keep optim.max_grad_norm > 0, or set train.on_nonfinite=skip to skip "
                             "such steps")
        result.skipped_steps += 1
        log.warning("step %d skipped: non-finite loss=%s or %s (train.on_nonfinite=skip, %d skipped so far)", step,
                    loss_value, norms_text, result.skipped_steps)
    with record_function("qwenft.zero_grad"):
        job.optimizer.zero_grad(set_to_none=True)
    return StepStats(loss_value, norm_value, token_count, lr, moe, mtp_metrics, stop_signal)


@record_function("qwenft.step_inputs")
def step_inputs(job: Job, micro_batches: list[dict]) -> tuple[list[dict], torch.Tensor]:
    """The step's micro batches with their labels as this rank trains on them (the MTP head's targets, a cp rank's
    span) and the label tokens summed over the loss group, on the device; the gradient buffers that the step's
    backward adds into (model.kernels.weight_grad=in_matmul, model.cuda_graphs) made or zeroed."""
    trains_head = job.spec.parallel.mtp_weight is not None
    if trains_head:  # the MTP head's targets from the whole rows, before a cp rank cuts its span
        micro_batches = [with_mtp_labels(mb) for mb in micro_batches]
    micro_batches = [span_labels(mb, job.mesh) for mb in micro_batches]
    label_count = sum(count_label_tokens(mb["labels"]) for mb in micro_batches)  # this rank's, on the host
    label_tokens = copy_to_device(label_count, job.device, fresh=True)  # summed over the ranks in place next
    dist.all_reduce(label_tokens, group=job.loss_group)
    mtp_count = None
    if trains_head:
        mtp_count = sum(count_label_tokens(mb["mtp_labels"]) for mb in micro_batches)
        job.loss_fn.mtp_tokens = copy_to_device(mtp_count, job.device, fresh=True)
        dist.all_reduce(job.loss_fn.mtp_tokens, group=job.loss_group)
    if job.spec.parallel.weight_grad == "in_matmul":
        # one batch shard (no FSDP2: dp = cp = 1, nothing to sum the counts over): the loss's factors on the CE sums
        # are known on the host
        mtp_weight = job.spec.parallel.mtp_weight
        prepare_grads(job.model_parts, ce_scale=1.0 / max(int(label_count), 1),
                      mtp_scale=None if mtp_count is None else mtp_weight / max(int(mtp_count), 1))
    if job.spec.parallel.cuda_graphs:
        keep_grads(job.model_parts)  # the parameters that prepare_grads gave no buffer
    return micro_batches, label_tokens


@record_function("qwenft.clip")
def clip_step_grads(job: Job) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Clip the step's gradients to optim.max_grad_norm; their norm and, with model.mtp=head, the MTP head's,
    which is clipped alone (the trunk's norm and clipping as without it). 0-dim tensors on the device."""
    max_norm = job.cfg.optim.max_grad_norm if job.cfg.optim.max_grad_norm > 0 else float("inf")
    pp_group = job.pp_group if job.spec.layout.pp > 1 else None
    params = job.params
    # LowPrecisionAdamW applies the clip coefficient inside its step (no pass of its own over the gradients)
    deferred = job.optimizer if isinstance(job.optimizer, LowPrecisionAdamW) else None
    head_norm = None
    if job.cfg.model.mtp == "head":
        head = {id(p) for p in job.head_params}
        params = [p for p in params if id(p) not in head]
        head_norm = clip_grad_norm_(job.head_params, max_norm, pp_group=pp_group, device=job.device,
                                    optimizer=deferred)
    grad_norm = clip_grad_norm_(params, max_norm, pp_group=pp_group, device=job.device, optimizer=deferred)
    return grad_norm, head_norm


def seed_stream(mesh) -> int:
    """`seed_step`'s stream of this rank: the first rank of its tensor-parallel group."""
    return dist.get_global_rank(mesh["tp"].get_group(), 0)


def seed_step(seed: int, step: int, stream: int) -> None:
    """Seed the step's random draws (LoRA's dropout masks) from (seed, step, stream), `stream` the first rank of this
    rank's tensor-parallel group: the ranks of one group draw alike, so what tp replicates (an input, the vision
    tower) stays equal on them, and each data, context or pipeline rank draws its own. A resumed run draws what the
    uninterrupted one did, whatever state the ranks' generators had at the checkpoint."""
    entropy = np.random.SeedSequence([seed % (1 << 64), step, stream])
    torch.manual_seed(int(entropy.generate_state(1, np.uint64)[0]))


def keep_grads(model_parts) -> None:
    """model.cuda_graphs: `.grad` (zeros) for each trained plain-tensor parameter of the decoder layers before
    the step's first backward. Their gradients come out of CUDA graphs, in the graph's pool, which the next
    replay overwrites: autograd must add each into a buffer of the parameter's own, never keep it as `.grad`.
    (A DTensor parameter's gradient is copied into `.grad` by `attention.local_all`'s backward.) Every decoder
    layer parameter gets a gradient at every step (an MoE layer's experts are stacked tensors), so AdamW steps
    the same parameters as without; with one microbatch a step the gradients exist during its forward too. A
    weight whose backward matmul adds into its buffer (model.kernels.weight_grad=in_matmul) already has that buffer
    as `.grad` (`weight_grad.prepare_grads`, called first): the graph adds into it at its fixed address."""
    from torch.distributed.tensor import DTensor

    from qwenft.models.qwen3_5.model import DecoderLayer

    for part in model_parts:
        for layer in part.modules():
            if isinstance(layer, DecoderLayer):
                for p in layer.parameters():
                    if p.requires_grad and p.grad is None and not isinstance(p, DTensor):
                        p.grad = torch.zeros_like(p)


def log_step(job: Job, step: int, stats: StepStats, elapsed: float, skipped_steps: int) -> None:
    """One line of metrics.jsonl (and wandb) with the step's numbers and its throughput, and one in train.log
    (and on the console when there is no progress bar)."""
    tokens, world = job.spec.batching.tokens_per_step, job.spec.layout.world_size
    flops = job.flops_per_token * tokens / elapsed / world
    mtp = (" | mtp_loss %.4f | mtp_accuracy %.3f" % (stats.mtp["mtp_loss"], stats.mtp["mtp_accuracy"])
           if stats.mtp else "")
    logging.getLogger("qwenft.steps").info(
        "step %d/%d | loss %.4f%s | lr %.3e | grad_norm %.3f | %.2f s | %.0f tokens/s/GPU | peak %.2f GiB",
        step, job.max_steps, stats.loss, mtp, stats.lr, stats.grad_norm, elapsed, tokens / elapsed / world,
        peak_memory_gib(job.device))
    job.metrics.log({
        "step": step, "loss": stats.loss, "lr": stats.lr, "grad_norm": stats.grad_norm,
        "label_tokens": stats.label_tokens, "epoch": job.data.epoch_progress,
        "step_time_s": elapsed, "tokens_per_sec": tokens / elapsed,
        "tokens_per_sec_per_gpu": tokens / elapsed / world,
        "tflops_per_gpu": flops / 1e12,
        "mfu": flops / job.peak_flops if job.peak_flops else None,
        "peak_memory_gib": peak_memory_gib(job.device), "skipped_steps": skipped_steps, **stats.moe, **stats.mtp,
        **{f"tokens/{name}": n for name, n in job.data.source_tokens().items()},
    })


def validate(job: Job, step: int, result: RunResult) -> None:
    result.val_losses[step] = val_loss = job.validate()
    job.metrics.log({"step": step, "val_loss": val_loss})
    log.info("step %d: val_loss %.4f", step, val_loss)


def checkpoint_or_stop(job: Job, step: int, stop_signal: str | None, stop: signals.StopOnSignal,
                       result: RunResult) -> bool:
    """Save on checkpoint.every_steps and at the last step; after a stop signal (`stop_signal`, the one the step
    agreed on), save (if not just saved), write the preemption marker and return True."""
    cfg = job.cfg
    # a run resumed from its own run dir saves at its end even without checkpoint.every_steps: the checkpoint it
    # resumed from (one a stop signal wrote) would otherwise stay `latest`, and the same command, run again (a
    # requeue), would train its steps again
    last = step == job.max_steps and (cfg.checkpoint.every_steps or job.checkpointer.resumed_here)
    saved = last or cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0
    if saved:
        path = job.checkpointer.save(step, result.val_losses.get(step), result.skipped_steps)
        log.info("%s checkpoint %s", "saving (async)" if cfg.checkpoint.async_save else "saved", path)
    result.preempted = stop_signal
    if not result.preempted:
        return False
    if not saved:
        path = job.checkpointer.save(step, result.val_losses.get(step), result.skipped_steps)
    job.checkpointer.wait()  # checkpoint.async_save: complete before the marker names it
    if job.is_main:
        signals.write_marker(job.run_dir, step, result.preempted, path)
    dist.barrier()  # no rank exits (and lets torchrun stop the others) before the marker exists
    log.info("%s: stopped after step %d with checkpoint %s; exit code %d; resume with: %s", result.preempted, step,
             path, signals.EXIT_PREEMPTED, stop.resume_command(job.run_dir))
    return True


def finish(job: Job, result: RunResult, return_state: bool) -> None:
    """The end of a run that was not stopped: final log line, HF export, the full state when asked for."""
    cfg = job.cfg
    if result.losses:
        log.info("done: %d steps, final loss %.4f; metrics in %s", job.max_steps, result.losses[-1],
                 job.run_dir / "metrics.jsonl")
    else:
        log.info("nothing to train: the checkpoint is at step %d >= train.max_steps=%d", job.start_step - 1,
                 job.max_steps)
    lora, export, dtype = lora_config(cfg), cfg.checkpoint.export_hf, getattr(torch, cfg.checkpoint.export_dtype)
    if lora is not None and export == "true":
        export_peft_adapter(job.model_parts, job.model_cfg, lora, cfg.model.path or cfg.model.name,
                            job.run_dir / "adapter", job.mesh, dtype)
        log.info("exported the LoRA adapters (peft format) to %s", job.run_dir / "adapter")
    elif lora is not None and export == "merged":
        export_merged_hf(job.model_parts, job.model_cfg, job.preprocessors, lora, job.run_dir / "hf", job.mesh, dtype,
                         cfg.model.path, mtp.read(job.run_dir) if job.is_main else None)
        log.info("exported the model with the LoRA adapters merged (HF layout) to %s", job.run_dir / "hf")
    elif export != "false":
        export_hf(job.model_parts, job.model_cfg, job.preprocessors, job.run_dir / "hf", job.mesh, dtype,
                  cfg.model.path, mtp.read(job.run_dir) if job.is_main else None)
        log.info("exported the trained model (HF layout) to %s", job.run_dir / "hf")
    if return_state:
        result.state_dict = full_state_dict(job.model_parts, job.pp_group)
    if "TORCHELASTIC_RUN_ID" in os.environ or job.spec.layout.world_size > 1:
        dist.barrier()
