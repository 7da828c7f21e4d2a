"""The training loop a recipe runs: mesh -> data -> model -> parallelize -> load -> steps -> metrics."""

import dataclasses
import logging
import math
import os
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import torch
import torch.distributed as dist

from qwenft.checkpoint import dcp as ckpt_lib
from qwenft.checkpoint.hf_export import export_hf, full_state_dict
from qwenft.conf.schema import Config
from qwenft.distributed.fsdp import set_microbatch_grad_sync
from qwenft.distributed.mesh import build_mesh, device_type, init_process_group, resolve_layout
from qwenft.distributed.tensor_parallel import clip_grad_norm_, validate_tp
from qwenft.launch import signals
from qwenft.train.evaluate import (build_eval_schedule, ce_sum, eval_loss_pipelined, eval_loss_unpipelined,
                                   val_micro_batches)
from qwenft.train.loss import count_label_tokens
from qwenft.train import metrics as metrics_lib
from qwenft.train.metrics import MetricsLogger, peak_memory_gib
from qwenft.train.optim import build_optimizer, build_scheduler

log = logging.getLogger("qwenft")


@dataclass
class RunResult:
    run_dir: Path
    losses: list[float] = field(default_factory=list)
    state_dict: dict | None = None  # full (unsharded) parameters after training, when asked for
    val_losses: dict[int, float] = field(default_factory=dict)  # step -> validation loss (eval.every_steps)
    skipped_steps: int = 0  # steps skipped for a non-finite loss or grad norm (train.on_nonfinite=skip)
    preempted: str | None = None  # the signal that stopped the run after a checkpoint (docs/checkpointing.md)


def default_run_dir(recipe: str) -> str:
    return str(Path("outputs") / recipe / datetime.now().strftime("%Y%m%d-%H%M%S"))


def _agree_run_dir(cfg: Config) -> Path:
    """Every rank must write to the same dir; rank 0's timestamp wins."""
    choice = [cfg.run_dir or default_run_dir(cfg.recipe)]
    dist.broadcast_object_list(choice, src=0)
    return Path(choice[0])


def _setup_logging(run_dir: Path, is_main: bool) -> None:
    log.setLevel(logging.INFO if is_main else logging.WARNING)
    for handler in log.handlers:  # an earlier run in this process (tests) left its log file open
        handler.close()
    log.handlers.clear()
    log.propagate = False
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S")
    console = logging.StreamHandler()
    console.setFormatter(fmt)
    log.addHandler(console)
    if is_main:
        file = logging.FileHandler(run_dir / "train.log")
        file.setFormatter(fmt)
        log.addHandler(file)


def _param_dtype(cfg: Config, device: torch.device) -> torch.dtype:
    """Compute dtype (FSDP's param_dtype); auto = bf16 on CUDA or with bf16 master weights, else fp32."""
    if cfg.model.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" or cfg.optim.master_dtype == "bfloat16" else torch.float32
    return getattr(torch, cfg.model.dtype)


def _master_dtype(cfg: Config) -> torch.dtype:
    """Dtype the trained weights are stored and updated in (optim.master_dtype); GDN's A_log/dt_bias stay fp32.
    Their gradients are reduced and kept in it too: fp32, or bf16 for 8 bytes per parameter with bf16 state."""
    return getattr(torch, cfg.optim.master_dtype)


def _optim_dtypes(cfg: Config) -> dict:
    return {"state_dtype": cfg.optim.state_dtype, "master_dtype": cfg.optim.master_dtype}


def _model_config(cfg: Config):
    from qwenft.models.qwen3_5.configs import config_from_hf_dir, named_config

    model_cfg = config_from_hf_dir(cfg.model.path) if cfg.model.path else named_config(cfg.model.name)
    n = cfg.model.num_layers
    if n is not None:
        t = model_cfg.text
        if n > t.num_hidden_layers:
            raise ValueError(f"model.num_layers={n} but the model has {t.num_hidden_layers} layers")
        model_cfg.text = dataclasses.replace(t, num_hidden_layers=n, layer_types=t.layer_types[:n])
    return model_cfg


def _fit_vocab(cfg: Config, model_cfg, tokenizer_size: int) -> None:
    """Random init makes room for the tokenizer's vocabulary; a checkpoint must already have it."""
    if tokenizer_size <= model_cfg.text.vocab_size:
        return
    if cfg.model.path:
        raise ValueError(f"the tokenizer has {tokenizer_size} tokens but model.path={cfg.model.path} has "
                         f"vocab_size={model_cfg.text.vocab_size}; point data.tokenizer at the model's tokenizer")
    model_cfg.text.vocab_size = tokenizer_size


def load_preprocessors(cfg: Config, vision: bool, source: str | None = None) -> tuple:
    """(tokenizer, VLM processor or None, what an HF export saves next to the weights) from `source`; default
    data.tokenizer, else model.path, else the built-in tiny tokenizer (tiny_vlm's processor for a VLM)."""
    source = source or cfg.data.tokenizer or cfg.model.path or ("tiny_vlm" if vision else "tiny")
    if vision:
        from qwenft.data.vlm import load_processor

        processor = load_processor(source, min_pixels=cfg.data.image.min_pixels, max_pixels=cfg.data.image.max_pixels)
        return processor.tokenizer, processor, [processor.tokenizer, processor.image_processor]
    from qwenft.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(source)
    return tokenizer, None, [tokenizer]


def _build_data(cfg: Config, model_cfg, microbatch_size: int, dp_rank: int, dp_size: int, path=None):
    """(tokenizer, data stream, files to export with the model): chat text, or chat with images when the
    model has a vision tower. `path` (default data.path) lets the validation set be read the same way."""
    from qwenft.data.tiny_chat import TRAIN_PATH

    path = path or (TRAIN_PATH if cfg.data.path == "tiny" else cfg.data.path)
    common = dict(seq_len=cfg.data.seq_len, micro_batch_size=microbatch_size, dp_rank=dp_rank, dp_size=dp_size,
                  seed=cfg.seed, packing=cfg.data.packing, train_on=cfg.data.train_on,
                  truncation=cfg.data.truncation, on_bad_row=cfg.data.on_bad_row)
    tokenizer, processor, preprocessors = load_preprocessors(cfg, model_cfg.vision is not None)
    if processor is not None:
        from qwenft.data.vlm import build_vlm_data

        data = build_vlm_data(path, processor, max_image_bytes=cfg.data.image.max_image_bytes, **common)
    else:
        from qwenft.data.loader import build_sft_data

        data = build_sft_data(path, tokenizer, **common)
    return tokenizer, data, preprocessors


def _freeze(module: torch.nn.Module, cfg: Config) -> dict[str, int]:
    from qwenft.models.freeze import checkpoint_vision, freeze

    frozen = freeze(module, vision=cfg.model.freeze_vision, language=cfg.model.freeze_language,
                    projector=cfg.model.freeze_projector)
    if cfg.model.vision_activation_checkpointing and getattr(module, "visual", None) is not None:
        checkpoint_vision(module)
    return frozen


def _microbatching(cfg: Config, dp: int) -> tuple[int, int]:
    """(sequences per microbatch, microbatches per step) on one data parallel rank; the same split serves
    pipeline microbatches (pp > 1) and gradient accumulation (pp = 1)."""
    key = "pipeline.microbatch_size" if cfg.pipeline.microbatch_size else "train.micro_batch_size"
    size = cfg.pipeline.microbatch_size or cfg.train.micro_batch_size
    per_step = size * dp
    if cfg.train.global_batch_size % per_step:
        raise ValueError(
            f"train.global_batch_size={cfg.train.global_batch_size} is not a multiple of "
            f"{key}={size} x dp={dp} = {per_step}")
    count = cfg.train.global_batch_size // per_step
    if cfg.pipeline.num_microbatches is not None and cfg.pipeline.num_microbatches != count:
        raise ValueError(
            f"pipeline.num_microbatches={cfg.pipeline.num_microbatches} but train.global_batch_size="
            f"{cfg.train.global_batch_size} / dp={dp} / {key}={size} = {count}; set it to {count} or null")
    return size, count


def _parallelize(module: torch.nn.Module, cfg: Config, mesh, device, reshard_after_forward: bool = True):
    """One model or pipeline stage, in the fixed order TP -> activation checkpointing -> compile -> FSDP2."""
    from qwenft.distributed.parallelize import parallelize

    parallelize(module, mesh, param_dtype=_param_dtype(cfg, device), reduce_dtype=_master_dtype(cfg),
                activation_checkpointing=cfg.model.activation_checkpointing,
                vocab_parallel=cfg.mesh.vocab_parallel, sequence_parallel=cfg.mesh.sequence_parallel,
                reshard_after_forward=reshard_after_forward, compile_layers=cfg.model.compile,
                fsdp_prefetch=cfg.mesh.fsdp_prefetch)


def _load(module: torch.nn.Module, cfg: Config, device) -> None:
    from qwenft.models.loader import init_random_weights, load_hf_weights

    if cfg.model.path:
        load_hf_weights(module, cfg.model.path, device=device, dtype=_master_dtype(cfg))
    else:
        init_random_weights(module, seed=cfg.seed, device=device, dtype=_master_dtype(cfg))


@dataclass
class Pipeline:
    stages: list
    schedule: object
    loss_fn: object


def check_mesh_keys(cfg: Config, layout) -> None:
    """Mesh and pipeline keys that contradict the layout; raised before anything is built."""
    if cfg.mesh.sequence_parallel and layout.tp == 1:
        raise ValueError("mesh.sequence_parallel=true needs mesh.tp > 1 (it shards over the tensor parallel ranks)")
    if layout.pp == 1:
        if cfg.pipeline.schedule != "1f1b":
            raise ValueError(f"pipeline.schedule={cfg.pipeline.schedule} is set but mesh.pp=1 (no pipeline); "
                             f"set mesh.pp > 1 or leave pipeline.schedule at 1f1b")
        for key in ("virtual_stages", "layers_per_stage", "stage_layers"):
            if getattr(cfg.pipeline, key) is not None:
                raise ValueError(f"pipeline.{key}={getattr(cfg.pipeline, key)} is set but mesh.pp=1 (no pipeline); "
                                 f"set mesh.pp > 1 or pipeline.{key}=null")


def stage_split(cfg: Config, model_cfg, layout) -> tuple[int, list[list[int]]]:
    """(pipeline stages per pp rank, layer indices of every stage) for mesh.pp > 1."""
    from qwenft.distributed import pipeline as pp_lib

    name = cfg.pipeline.schedule
    virtual = cfg.pipeline.virtual_stages or pp_lib.default_virtual_stages(name)
    pp_lib.check_virtual_stages(name, virtual)
    if model_cfg.tie_word_embeddings:
        raise ValueError(f"model {cfg.model.path or cfg.model.name} ties lm_head to the embeddings, which "
                         f"mesh.pp={layout.pp} puts on different stages; use mesh.pp=1")
    layers = pp_lib.split_layers(model_cfg.text.num_hidden_layers, layout.pp * virtual, model_cfg.vision is not None,
                                 cfg.pipeline.layers_per_stage, cfg.pipeline.stage_layers)
    return virtual, layers


def build_modules(cfg: Config, model_cfg, mesh, layout, device) -> list[tuple[int, torch.nn.Module]]:
    """This rank's share of the model as (pipeline stage index, module) pairs: the whole model at pp = 1, else
    its stages. Built on meta, frozen and parallelized (TP -> activation checkpointing -> FSDP2), not loaded.
    `qwenft plan` builds every rank's share through here as well (qwenft.train.plan)."""
    from qwenft.distributed import pipeline as pp_lib
    from qwenft.models.loader import build_model

    reshard = pp_lib.reshard_policy(cfg.pipeline.schedule, cfg.pipeline.reduce_grad_per_microbatch)
    if layout.pp == 1:
        # one microbatch a step: its backward reduces at once, nothing to keep parameters gathered for
        reshard = reshard or _microbatching(cfg, layout.dp)[1] == 1
        model = build_model(model_cfg, kernels=cfg.model.kernels.gdn, attention_kernel=cfg.model.kernels.attention,
                            device="meta", dtype=_master_dtype(cfg),
                            ce_chunk_tokens=cfg.model.ce_chunk_tokens)
        _freeze(model, cfg)
        _parallelize(model, cfg, mesh, device, reshard_after_forward=reshard)
        return [(0, model)]
    name = cfg.pipeline.schedule
    virtual, layers = stage_split(cfg, model_cfg, layout)
    out = []
    for i in pp_lib.stage_ids_for_rank(mesh["pp"].get_local_rank(), layout.pp, virtual, name in pp_lib.V_SHAPED):
        module = pp_lib.build_stage_model(model_cfg, layers[i], embed=i == 0, head=i == len(layers) - 1,
                                          kernels=cfg.model.kernels.gdn,
                                          attention_kernel=cfg.model.kernels.attention,
                                          ce_chunk_tokens=cfg.model.ce_chunk_tokens).to_dtype(_master_dtype(cfg))
        _freeze(module, cfg)
        _parallelize(module, cfg, mesh, device, reshard_after_forward=reshard)
        out.append((i, module))
    return out


def _build_pipeline(cfg: Config, model_cfg, mesh, layout, device, num_microbatches: int) -> Pipeline:
    """This rank's stages (built on meta, parallelized, loaded) and the schedule that runs them."""
    from qwenft.distributed import pipeline as pp_lib

    name = cfg.pipeline.schedule
    _, layers = stage_split(cfg, model_cfg, layout)
    num_stages = len(layers)
    log.info("pipeline: %s, %d stages, layers per stage %s", name, num_stages, [len(ls) for ls in layers])
    reshard = pp_lib.reshard_policy(name, cfg.pipeline.reduce_grad_per_microbatch)
    stages = []
    for i, module in build_modules(cfg, model_cfg, mesh, layout, device):
        _load(module, cfg, device)
        stages.append(pp_lib.ReduceGradStage(
            module, i, num_stages, device, group=mesh["pp"].get_group(),
            reduce_grad_per_microbatch=cfg.pipeline.reduce_grad_per_microbatch, reshard=reshard))
    loss_fn = pp_lib.TokenCE(ce_in_model=cfg.model.ce_chunk_tokens > 0)
    try:
        schedule = pp_lib.build_schedule(name, stages, num_microbatches, loss_fn)
    except ValueError as e:
        raise ValueError(f"pipeline.schedule={name} with {num_microbatches} microbatches per step and {num_stages} "
                         f"stages: {str(e).splitlines()[0]}") from None
    return Pipeline(stages, schedule, loss_fn)


def _accumulate(model, micro_batches: list[dict], label_tokens, device, cfg: Config) -> torch.Tensor:
    """Forward + backward of one step's microbatches without pipelining; returns this rank's summed loss."""
    step_loss = torch.zeros((), device=device)
    for i, mb in enumerate(micro_batches):
        set_microbatch_grad_sync(model, i == len(micro_batches) - 1, cfg.pipeline.reduce_grad_per_microbatch)
        loss = ce_sum(model, mb, device, cfg.model.ce_chunk_tokens > 0) / label_tokens.clamp(min=1)
        loss.backward()
        step_loss += loss.detach()
    return step_loss


def run(cfg: Config, return_state: bool = False, on_step=None) -> RunResult:
    """Train as `qwenft train` does; `on_step(step)`, if given, runs after each step (scripts/bench.py's profiler)."""
    with signals.StopOnSignal() as stop:
        return _run(cfg, return_state, stop, on_step)


def _run(cfg: Config, return_state: bool, stop: signals.StopOnSignal, on_step=None) -> RunResult:
    from qwenft.distributed import pipeline as pp_lib

    init_process_group(cfg.mesh.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = resolve_layout(cfg.mesh.tp, cfg.mesh.pp, cfg.mesh.dp, world)
    microbatch_size, num_microbatches = _microbatching(cfg, layout.dp)
    check_mesh_keys(cfg, layout)
    mesh = build_mesh(layout)
    dp_mesh = mesh["dp"]
    dp_rank = dp_mesh.get_local_rank()
    pp_group = mesh["pp"].get_group()
    device = torch.device(device_type(), torch.cuda.current_device() if device_type() == "cuda" else None)

    run_dir = _agree_run_dir(cfg)
    is_main = rank == 0
    ckpt_root = run_dir / "checkpoints"
    resume_from = ckpt_lib.find(cfg.checkpoint.resume, ckpt_root)  # a bad checkpoint fails before any write
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        signals.clear_marker(run_dir)
    dist.barrier()
    _setup_logging(run_dir, is_main)
    log.info("run dir %s | world %d = pp %d x dp %d x tp %d | %d microbatches of %d per step",
             run_dir, world, layout.pp, layout.dp, layout.tp, num_microbatches, microbatch_size)

    torch.manual_seed(cfg.seed)
    model_cfg = _model_config(cfg)
    validate_tp(model_cfg.text, layout.tp)
    tokenizer, data, preprocessors = _build_data(cfg, model_cfg, microbatch_size, dp_rank, layout.dp)
    _fit_vocab(cfg, model_cfg, len(tokenizer))
    if resume_from is not None:
        ckpt_lib.check_model_config(resume_from, model_cfg, cfg.checkpoint.resume, _optim_dtypes(cfg))
    if is_main:  # after the checks, so a failed resume leaves the run's config.yaml as it was
        from qwenft.conf import to_yaml

        (run_dir / "config.yaml").write_text(to_yaml(dataclasses.replace(cfg, run_dir=str(run_dir))))
    max_steps = cfg.train.max_steps
    if max_steps is None:
        max_steps = max(1, math.ceil(cfg.train.epochs * data.rows_in_epoch(0) / cfg.train.global_batch_size))
    log.info("data: %d documents, %d packed rows of %d tokens per epoch; skipped rows: %s",
             data.num_documents, data.rows_in_epoch(0), cfg.data.seq_len, dict(data.skipped) or "none")

    pipe = None
    if layout.pp > 1:
        pipe = _build_pipeline(cfg, model_cfg, mesh, layout, device, num_microbatches)
        modules = [stage.submod for stage in pipe.stages]
    else:
        [(_, model)] = build_modules(cfg, model_cfg, mesh, layout, device)
        _load(model, cfg, device)
        modules = [model]
    params = [p for m in modules for p in m.parameters() if p.requires_grad]
    n_params = sum(p.numel() for m in modules for p in m.parameters())
    log.info("model: %s, %.2fM parameters on this rank's stage(s), %.2fM trained", cfg.model.path or cfg.model.name,
             n_params / 1e6, sum(p.numel() for p in params) / 1e6)
    flops_per_token = metrics_lib.flops_per_token(model_cfg.text, cfg.data.seq_len)
    peak = metrics_lib.peak_flops(device)

    optimizer = build_optimizer(params, cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.betas,
                                cfg.optim.eps, cfg.optim.fused, state_dtype=cfg.optim.state_dtype, seed=cfg.seed)
    scheduler = build_scheduler(optimizer, cfg.lr_scheduler.warmup_steps, max_steps, cfg.lr_scheduler.decay,
                                cfg.lr_scheduler.min_lr_ratio)
    wandb_config = dataclasses.asdict(cfg) if cfg.logger.wandb else None
    metrics = MetricsLogger(run_dir, is_main, wandb_config, cfg.logger.wandb_project,
                            cfg.logger.wandb_mode, run_name=run_dir.name)
    progress = None
    if is_main and cfg.train.progress_bar:
        from tqdm import tqdm

        progress = tqdm(total=max_steps, desc="train", dynamic_ncols=True)

    checkpointer = ckpt_lib.Checkpointer(ckpt_root, modules, optimizer, scheduler, data, model_cfg,
                                         cfg.checkpoint.keep, keep_best=cfg.checkpoint.keep_best,
                                         async_save=cfg.checkpoint.async_save, optim_dtypes=_optim_dtypes(cfg))
    start_step = 1
    if resume_from is not None:
        start_step = checkpointer.load(resume_from) + 1
        log.info("resumed from %s; continuing at step %d", resume_from, start_step)
        if progress is not None:
            progress.update(start_step - 1)

    val_batches, eval_schedule = None, None
    if cfg.eval.every_steps:
        from qwenft.data.tiny_chat import VAL_PATH

        val_path = VAL_PATH if cfg.eval.dataset == "tiny" else cfg.eval.dataset
        _, val_data, _ = _build_data(cfg, model_cfg, microbatch_size, dp_rank, layout.dp, path=val_path)
        val_batches = val_micro_batches(val_data, cfg.eval.max_batches)
        log.info("validation: %s, %d micro batches of %d per rank every %d steps",
                 cfg.eval.dataset, len(val_batches), microbatch_size, cfg.eval.every_steps)
        if pipe is not None:
            eval_schedule = build_eval_schedule(pipe, cfg, device, pp_group, num_microbatches)

    def validate() -> float:
        if pipe is not None:
            return eval_loss_pipelined(eval_schedule, val_batches, num_microbatches, device, dp_mesh.get_group(),
                                        pp_group, cfg.model.ce_chunk_tokens > 0)
        return eval_loss_unpipelined(model, val_batches, device, dp_mesh.get_group(), cfg.model.ce_chunk_tokens > 0)

    result = RunResult(run_dir=run_dir)
    batches = iter(data)
    for m in modules:
        m.train()
    max_norm = cfg.optim.max_grad_norm if cfg.optim.max_grad_norm > 0 else float("inf")
    for step in range(start_step, max_steps + 1):
        start = time.perf_counter()
        micro_batches = [next(batches) for _ in range(num_microbatches)]
        label_tokens = sum(count_label_tokens(mb["labels"]) for mb in micro_batches).to(device)
        dist.all_reduce(label_tokens, group=dp_mesh.get_group())
        if pipe is not None:
            batch = pp_lib.PipelineBatch.from_microbatches(micro_batches, device)
            step_loss = pp_lib.train_step(pipe.schedule, pipe.stages, batch, pipe.loss_fn, label_tokens,
                                          dp_mesh.get_group(), pp_group)
        else:
            step_loss = _accumulate(model, micro_batches, label_tokens, device, cfg)
            dist.all_reduce(step_loss, group=dp_mesh.get_group())
        grad_norm = clip_grad_norm_(params, max_norm, pp_group=pp_group if layout.pp > 1 else None)
        lr = scheduler.get_last_lr()[0]
        loss_value = step_loss.item()
        # loss and grad norm are reduced over every rank, so all ranks take the same branch
        if math.isfinite(loss_value) and math.isfinite(grad_norm.item()):
            optimizer.step()
            scheduler.step()
        elif cfg.train.on_nonfinite == "error":
            raise ValueError(f"non-finite loss/grad norm at step {step} (loss={loss_value}, grad_norm="
                             f"{grad_norm.item()}); lower optim.lr, keep optim.max_grad_norm > 0, or set "
                             f"train.on_nonfinite=skip to skip such steps")
        else:
            result.skipped_steps += 1
            log.warning("step %d skipped: non-finite loss=%s or grad_norm=%s (train.on_nonfinite=skip, %d skipped "
                        "so far)", step, loss_value, grad_norm.item(), result.skipped_steps)
        optimizer.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - start
        result.losses.append(loss_value)
        tokens = cfg.train.global_batch_size * cfg.data.seq_len
        if step % cfg.train.log_every == 0 or step == max_steps:
            metrics.log({
                "step": step, "loss": loss_value, "lr": lr, "grad_norm": grad_norm.item(),
                "label_tokens": int(label_tokens.item()), "epoch": data.epoch_progress,
                "step_time_s": elapsed, "tokens_per_sec": tokens / elapsed,
                "tokens_per_sec_per_gpu": tokens / elapsed / world,
                "tflops_per_gpu": flops_per_token * tokens / elapsed / world / 1e12,
                "mfu": flops_per_token * tokens / elapsed / world / peak if peak else None,
                "peak_memory_gib": peak_memory_gib(device), "skipped_steps": result.skipped_steps,
            })
        if val_batches is not None and (step % cfg.eval.every_steps == 0 or step == max_steps):
            result.val_losses[step] = val_loss = validate()
            metrics.log({"step": step, "val_loss": val_loss})
            log.info("step %d: val_loss %.4f", step, val_loss)
        if progress is not None:
            progress.update(1)
            progress.set_postfix(loss=f"{loss_value:.4f}", lr=f"{lr:.2e}")
        if on_step is not None:
            on_step(step)
        saved = cfg.checkpoint.every_steps and (step % cfg.checkpoint.every_steps == 0 or step == max_steps)
        if saved:
            path = checkpointer.save(step, result.val_losses.get(step))
            log.info("%s checkpoint %s", "saving (async)" if cfg.checkpoint.async_save else "saved", path)
        result.preempted = stop.agreed(device)
        if result.preempted:
            if not saved:
                path = checkpointer.save(step)
            checkpointer.wait()  # checkpoint.async_save: complete before the marker names it
            if is_main:
                signals.write_marker(run_dir, step, result.preempted, path)
            dist.barrier()  # no rank exits (and lets torchrun stop the others) before the marker exists
            log.info("%s: stopped after step %d with checkpoint %s; exit code %d, resume with "
                     "checkpoint.resume=auto", result.preempted, step, path, signals.EXIT_PREEMPTED)
            break
    checkpointer.wait()
    if progress is not None:
        progress.close()
    metrics.close()
    if result.preempted:
        return result
    if result.losses:
        log.info("done: %d steps, final loss %.4f; metrics in %s", max_steps, result.losses[-1],
                 run_dir / "metrics.jsonl")
    else:
        log.info("nothing to train: the checkpoint is at step %d >= train.max_steps=%d", start_step - 1, max_steps)
    if cfg.checkpoint.export_hf:
        export_hf(modules, model_cfg, preprocessors, run_dir / "hf", mesh, getattr(torch, cfg.checkpoint.export_dtype))
        log.info("exported the trained model (HF layout) to %s", run_dir / "hf")
    if return_state:
        result.state_dict = full_state_dict(modules, pp_group)
    if "TORCHELASTIC_RUN_ID" in os.environ or world > 1:
        dist.barrier()
    return result
