"""Building a run: the parts its specs (qwenft.train.spec) describe, gathered in a `Job` that
`qwenft.train.runner` loops over.

    model_cfg = model_config(cfg)
    spec = resolve_spec(cfg, layout, model_cfg, "cuda")          # qwenft.train.spec: no process group
    parts = build_model_parts(cfg, model_cfg, spec, mesh)        # meta, frozen, parallelized, not loaded
    job = build_job(cfg)                                          # all of it, loaded, with its step and validation

`qwenft plan` stops at `build_model_parts` on a fake process group; `qwenft train` builds the whole job.
"""

import dataclasses
import importlib.util
import logging
import math
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from qwenft.checkpoint import dcp as ckpt_lib, files as ckpt_files, mtp
from qwenft.conf.compose import as_written
from qwenft.conf.schema import Config
from qwenft.conf.layout import resolve_layout
from qwenft.distributed.mesh import batch_mesh, build_mesh, device_type, init_process_group
from qwenft.distributed.pipeline.split import SPLIT_BACKWARD
from qwenft.launch import signals
from qwenft.models.qwen3_5.gdn import resolve_kernel as resolve_gdn_kernel
from qwenft.models.weight_grad import stack_weights
from qwenft.train import auto_ac, metrics as metrics_lib, resume
from qwenft.train.evaluate import (build_eval_schedule, eval_loss_pipelined, eval_loss_unpipelined,
                                   val_micro_batches)
from qwenft.train.metrics import MetricsLogger
from qwenft.train.moot import moot_settings
from qwenft.train.optim import build_optimizer, build_scheduler
from qwenft.train.peft_setup import lora_config, peft_meta
from qwenft.train.rundir import (agree_run_dir, input_file, make_run_dir, on_rank0,
                                 refuse_fresh_start_over_checkpoints, set_cpu_threads, set_kernel_caches,
                                 setup_logging)
from qwenft.train.data_setup import as_eval_error, build_data, eval_path
from qwenft.train.spec import RunSpec, checked_batching, resolve_dtypes, resolve_parallel
from qwenft.train.step import (StepFn, accumulation_step, pipeline_stages, pipeline_step, span_labels,
                               token_loss)

log = logging.getLogger("qwenft")


HF_DIR_HINT = "give a Hugging Face Qwen3.5 checkpoint dir (config.json + *.safetensors, as from_pretrained reads)"


# ---------------------------------------------------------------- model

def model_config(cfg: Config):
    """The model's ModelConfig: model.path's config.json, else model.name's; model.num_layers keeps the first n."""
    from qwenft.models.qwen3_5.configs import config_from_hf_dir, named_config

    if cfg.model.path:
        with input_file("model.path", cfg.model.path, HF_DIR_HINT):
            model_cfg = config_from_hf_dir(cfg.model.path)
    else:
        model_cfg = named_config(cfg.model.name)
    n = cfg.model.num_layers
    if n is not None:
        t = model_cfg.text
        if n > t.num_hidden_layers:
            raise ValueError(f"model.num_layers={n} but the model has {t.num_hidden_layers} layers")
        model_cfg.text = dataclasses.replace(t, num_hidden_layers=n, layer_types=t.layer_types[:n])
    _check_mtp(cfg, model_cfg)
    return model_cfg


def _check_mtp(cfg: Config, model_cfg) -> None:
    """model.mtp and model.mtp_loss_weight; a random init trains a fresh one-layer head."""
    from qwenft.models.qwen3_5.mtp import MODES

    mode = cfg.model.mtp
    if mode not in MODES:
        raise ValueError(f"model.mtp={mode!r} is not valid; choose one of {', '.join(MODES)}")
    if not 0 <= cfg.model.mtp_loss_weight < float("inf"):
        raise ValueError(f"model.mtp_loss_weight={cfg.model.mtp_loss_weight} must be a finite number >= 0")
    if mode == "keep":
        return
    if cfg.peft.method != "none" and cfg.checkpoint.export_hf == "true":
        raise ValueError(f"model.mtp={mode} with peft={cfg.peft.method} and checkpoint.export_hf=true: a peft adapter "
                         f"dir cannot carry the trained MTP head (peft and vLLM load adapters onto the trunk alone); "
                         f"set checkpoint.export_hf=merged, or false")
    if cfg.model.path is None:
        model_cfg.text.mtp_num_hidden_layers = 1
    elif model_cfg.text.mtp_num_hidden_layers == 0:
        raise ValueError(f"model.mtp={mode}: model.path={cfg.model.path} has no MTP head (no mtp_num_hidden_layers "
                         f"in its config.json); use model.mtp=keep")


def mtp_training_line(cfg: Config) -> str:
    """The start-log line of a run that trains the MTP head."""
    source = f"from {cfg.model.path}" if cfg.model.path else "a fresh one-layer head (random init)"
    what = "with the trunk" if cfg.model.mtp == "train" else "alone, on the trunk's detached output"
    return (f"mtp: model.mtp={cfg.model.mtp} trains the MTP head {what}, {source}, loss weight "
            f"{cfg.model.mtp_loss_weight}; every HF export writes the trained head")


def _fit_vocab(cfg: Config, model_cfg, tokenizer_size: int) -> None:
    """Random init makes room for the tokenizer's vocabulary; a checkpoint must already have it."""
    if tokenizer_size <= model_cfg.text.vocab_size:
        return
    if cfg.model.path:
        raise ValueError(f"the tokenizer has {tokenizer_size} tokens but model.path={cfg.model.path} has "
                         f"vocab_size={model_cfg.text.vocab_size}; point data.tokenizer at the model's tokenizer")
    model_cfg.text.vocab_size = tokenizer_size


def _freeze(module: nn.Module, cfg: Config) -> None:
    """What trains of a full finetuning (model.freeze_*; LoRA freezes the base itself), and the vision tower's
    activation checkpointing."""
    from qwenft.models.freeze import checkpoint_vision, freeze

    if cfg.peft.method == "none":
        freeze(module, vision=cfg.model.freeze_vision, language=cfg.model.freeze_language,
               projector=cfg.model.freeze_projector)
    if cfg.model.vision_activation_checkpointing and getattr(module, "visual", None) is not None:
        checkpoint_vision(module)


def _parallelize(module: nn.Module, cfg: Config, spec: RunSpec, mesh) -> None:
    """One model or pipeline stage, in the fixed order TP -> EP -> activation checkpointing -> compile -> FSDP2."""
    from qwenft.distributed.parallelize import parallelize

    par = spec.parallel
    if par.compile and cfg.model.fp8.startswith("rowwise") and par.activation_checkpointing != "false":
        # rowwise float8 under compile and activation checkpointing: the recompute's casts must round as the
        # forward's did, or the backward reads NaN (pytorch#150859)
        torch._inductor.config.emulate_precision_casts = True
    if par.compile and par.schedule in SPLIT_BACKWARD:
        # these schedules run a stage's backward twice (input gradients, then weight gradients, the graph
        # retained between them): a compiled backward may not free its saved tensors in the first
        torch._functorch.config.donated_buffer = False
    parallelize(module, mesh, param_dtype=spec.dtypes.compute, reduce_dtype=spec.dtypes.reduce,
                activation_checkpointing=par.activation_checkpointing,
                vocab_parallel=cfg.mesh.vocab_parallel, sequence_parallel=cfg.mesh.sequence_parallel,
                reshard_after_forward=par.reshard_after_forward, compile_layers=par.compile,
                cuda_graphs=par.cuda_graphs,
                fsdp=par.fsdp, fsdp_prefetch=cfg.mesh.fsdp_prefetch, fp8=cfg.model.fp8,
                cp_balanced_attention=cfg.mesh.cp_balanced_attention)


def check_what_trains(cfg: Config, model_cfg, spec: RunSpec) -> None:
    """LoRA's targets (`lora.check_targets`), and that model.freeze_* or those targets leave no pipeline stage (at
    pp = 1 the model) without a parameter to train, which the optimizer would refuse once the run dir is written;
    each stage built on meta, unparallelized (what trains does not depend on the sharding)."""
    frozen = [f"model.{key}={getattr(cfg.model, key)}".lower() for key in ("freeze_language", "freeze_vision",
                                                                            "freeze_projector")
              if getattr(cfg.model, key)]
    lora = lora_config(cfg)
    if lora is not None:
        from qwenft.models.lora import check_targets

        check_targets(model_cfg, lora, cfg.model.mtp)  # some linear of the model matches: the model trains
        if spec.layout.pp == 1:
            return
    elif not frozen:
        return
    layers = spec.parallel.stage_layers
    for i, stage_layers in enumerate(layers):
        module = _stage_module(cfg, model_cfg, spec, i, torch.float32, torch.float32, kernels="torch",
                               mtp=cfg.model.mtp)
        if any(p.requires_grad for p in module.parameters()):
            continue
        where = ("the model" if spec.layout.pp == 1 else
                 f"pipeline stage {i} of {len(layers)} (layers {stage_layers[0]}-{stage_layers[-1]})")
        if lora is not None:
            raise ValueError(f"{where} has nothing to train: peft.target_modules={list(lora.target_modules)} matches "
                             f"no linear there; widen peft.target_modules or move layers between stages "
                             f"(pipeline.stage_layers)")
        raise ValueError(f"{where} has nothing to train with {', '.join(frozen)}; unfreeze part of it" +
                         ("" if spec.layout.pp == 1 else ", or use fewer pipeline stages (mesh.pp)"))


def _stage_module(cfg: Config, model_cfg, spec: RunSpec, stage: int, dtype: torch.dtype, adapter_dtype: torch.dtype,
                  **model_kwargs) -> nn.Module:
    """Pipeline stage `stage` of the model (at pp = 1 the whole model) on meta in `dtype`, with LoRA's adapters in
    `adapter_dtype` and model.freeze_* applied."""
    from qwenft.distributed.pipeline import stage as pp_stage
    from qwenft.models.loader import build_model

    layers = spec.parallel.stage_layers
    if spec.layout.pp == 1:
        module = build_model(model_cfg, device="meta", dtype=dtype, **model_kwargs)
    else:
        module = pp_stage.build_stage_model(model_cfg, list(layers[stage]), embed=stage == 0,
                                            head=stage == len(layers) - 1, **model_kwargs).to_dtype(dtype)
    if (lora := lora_config(cfg)) is not None:
        from qwenft.models.lora import apply_lora

        apply_lora(module, lora, adapter_dtype=adapter_dtype)
    _freeze(module, cfg)
    return module


def build_model_parts(cfg: Config, model_cfg, spec: RunSpec, mesh) -> list[tuple[int, nn.Module]]:
    """This rank's share of the model as (pipeline stage index, module) pairs: the whole model at pp = 1, else
    its stages. Built on meta, frozen and parallelized (TP -> activation checkpointing -> FSDP2), not loaded.
    With peft=lora the base is built in the compute dtype (frozen: no master copy) and the adapters in the
    master dtype, added before tensor parallelism shards them with their projections."""
    dtype = spec.dtypes.master if cfg.peft.method == "none" else spec.dtypes.compute
    model_kwargs = dict(kernels=cfg.model.kernels.gdn, attention_kernel=cfg.model.kernels.attention,
                        ce_chunk_tokens=cfg.model.ce_chunk_tokens, ce_kernel=spec.parallel.ce_kernel,
                        moe_kernel=cfg.model.kernels.moe, mtp=cfg.model.mtp)
    out = []
    for i in spec.stage_ids(mesh["pp"].get_local_rank()):
        module = _stage_module(cfg, model_cfg, spec, i, dtype, spec.dtypes.master, **model_kwargs)
        _parallelize(module, cfg, spec, mesh)
        if spec.parallel.weight_grad == "in_matmul":
            from qwenft.models import weight_grad

            weight_grad.enable(module)
        out.append((i, module))
    return out


def load_weights(module: nn.Module, cfg: Config, dtype: torch.dtype | None, device) -> None:
    """model.path's weights, or the seed's random init, into this rank's shards of `module`, in `dtype` (None:
    each parameter in the dtype it was built in)."""
    from qwenft.models.loader import init_random_weights, load_hf_weights

    if cfg.model.path:
        with input_file("model.path", cfg.model.path):
            load_hf_weights(module, cfg.model.path, device=device, dtype=dtype, seed=cfg.seed)
    else:
        init_random_weights(module, seed=cfg.seed, device=device, dtype=dtype)


# ---------------------------------------------------------------- start notes

# ---------------------------------------------------------------- validation

def _validation(cfg: Config, model_cfg, spec: RunSpec, mesh, device, modules: list[nn.Module]):
    """A function returning the validation loss (eval.dataset), or None without eval.every_steps."""
    if not cfg.eval.every_steps:
        return None
    size, n = spec.batching.microbatch_size, spec.batching.num_microbatches
    path = eval_path(cfg.eval.dataset)
    try:
        _, val_data, _ = build_data(cfg, model_cfg, size, mesh["dp"].get_local_rank(), spec.layout.dp, path=path)
    except ValueError as e:
        raise as_eval_error(e, cfg.eval.dataset, path) from None
    val_batches = [span_labels(mb, mesh) for mb in val_micro_batches(val_data, cfg.eval.max_batches)]
    log.info("validation: %s (%s rows), %d micro batches of %d per rank every %d steps; skipped rows: %s",
             cfg.eval.dataset, val_data.format, len(val_batches), size, cfg.eval.every_steps,
             dict(val_data.skipped) or "none")
    loss_group, ce_in_model = batch_mesh(mesh).get_group(), spec.parallel.ce_in_model
    if spec.layout.pp == 1:
        [model] = modules
        if spec.parallel.cuda_graphs:
            return lambda: _eager_validation(model, val_batches, device, loss_group, ce_in_model)
        return lambda: eval_loss_unpipelined(model, val_batches, device, loss_group, ce_in_model)
    pp_group = mesh["pp"].get_group()
    stage_ids = spec.stage_ids(mesh["pp"].get_local_rank())
    eval_schedule = build_eval_schedule(list(zip(stage_ids, modules)), spec.parallel.num_stages,
                                        spec.parallel.schedule, n, ce_in_model, device, pp_group)
    return lambda: eval_loss_pipelined(eval_schedule, val_batches, n, device, loss_group, pp_group, ce_in_model)


def _eager_validation(*args) -> float:
    """`eval_loss_unpipelined` with the compiled layers run eagerly, under model.cuda_graphs. Inductor's CUDA
    graph trees mishandle no-grad calls of graphs that several layers share (every layer of a kind calls the
    same `mixer_input`): a validation pass recorded that way read a graph output a later replay had already
    overwritten. Training's calls, each with its backward pending, are unaffected."""
    with torch.compiler.set_stance("force_eager"):
        return eval_loss_unpipelined(*args)


# ---------------------------------------------------------------- the job

@dataclass
class Job:
    """A run ready to train from `start_step`: its specs and its built components."""
    cfg: Config
    spec: RunSpec
    model_cfg: object  # qwenft.models.qwen3_5.configs.ModelConfig, vocabulary fitted to the tokenizer
    mesh: object  # the (pp, dp, tp) DeviceMesh
    device: torch.device
    run_dir: Path
    is_main: bool  # rank 0: writes the run dir's files
    data: object  # the training stream (qwenft.data.loader.SFTData or qwenft.data.vlm.VLMData)
    preprocessors: list  # what an HF export saves next to the weights
    model_parts: list[nn.Module]  # this rank's model, or the modules of its pipeline stages
    params: list[nn.Parameter]  # the trained ones, on this rank
    # model.mtp=head: the MTP head's trained parameters, clipped apart from the trunk's (whose norm and clipping stay
    # as without the head); empty otherwise
    head_params: list[nn.Parameter]
    step: StepFn  # forward + backward of one step's microbatches -> the loss summed over them and dp x cp ranks
    loss_fn: object  # the step's pipeline.schedule.TokenCE: token CE (+ MoE aux loss); holds the step's routing
    validate: Callable[[], float] | None  # the validation loss (eval.every_steps), else None
    optimizer: torch.optim.Optimizer
    scheduler: object
    checkpointer: ckpt_lib.Checkpointer
    metrics: MetricsLogger
    max_steps: int
    start_step: int  # 1, or the step after the checkpoint resumed from
    flops_per_token: float
    peak_flops: float | None  # of this device, for MFU

    @property
    def loss_group(self):
        """The ranks over which the loss and the label count are summed: dp x cp (`mesh.batch_mesh`)."""
        return batch_mesh(self.mesh).get_group()

    @property
    def pp_group(self):
        return self.mesh["pp"].get_group()


def build_job(cfg: Config, save_config: Callable[[Path], None] | None = None, cleanup: ExitStack | None = None) -> Job:
    """Join the process group and build everything a run of `cfg` needs, resumed when checkpoint.resume says
    so. `save_config(run_dir)` runs on rank 0 once the config has passed its checks against the data and any
    checkpoint, before the model is built (so a failed resume leaves the run dir as it was). Rank 0 locks the
    run dir (qwenft.launch.run_lock) until `cleanup` closes, or else until the process exits."""
    init_process_group(cfg.mesh.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = resolve_layout(cfg.mesh.tp, cfg.mesh.pp, cfg.mesh.dp, world, ep=cfg.mesh.ep, cp=cfg.mesh.cp)
    batching = checked_batching(cfg, layout)
    mesh = build_mesh(layout)
    dp_rank = mesh["dp"].get_local_rank()
    device = torch.device(device_type(), torch.cuda.current_device() if device_type() == "cuda" else None)

    caches = set_kernel_caches(cfg.model.kernels.cache_dir)  # before anything compiles; a bad dir fails here
    run_dir = agree_run_dir(cfg)
    is_main = rank == 0
    ckpt_root = run_dir / "checkpoints"
    on_rank0(is_main, lambda: make_run_dir(run_dir, cleanup))
    dist.barrier()
    setup_logging(run_dir, is_main, cfg.train.progress_bar)
    log.info("run dir %s | world %d = pp %d x dp %d%s x tp %d | %d microbatches of %d per step",
             run_dir, world, layout.pp, layout.dp, f" x cp {layout.cp}" if layout.cp > 1 else "", layout.tp,
             batching.num_microbatches, batching.microbatch_size)
    # verified before anything in the run dir is rewritten; a damaged `latest` gives way to an older complete one
    resume_from, passed_over = ckpt_files.find(cfg.checkpoint.resume, ckpt_root)
    on_rank0(is_main, lambda: refuse_fresh_start_over_checkpoints(run_dir, resume_from, cfg.checkpoint.resume))
    if device.type == "cpu":
        set_cpu_threads()
    log.info(caches)
    for damaged in passed_over:
        log.warning("checkpoint.resume=auto: %s; resuming from %s instead", damaged, resume_from)
    if resume_from is not None:
        resume.log_config_changes(resume_from, cfg, run_dir)

    from qwenft.models.loader import checkpoint_files
    from qwenft.models.qwen3_5.attention import LONG_PIECES, cudnn_ok, resolve_attention_kernel
    from qwenft.models.qwen3_5.gdn import check_kernel

    torch.manual_seed(cfg.seed)
    check_kernel(cfg.model.kernels.gdn)
    if cfg.logger.wandb and importlib.util.find_spec("wandb") is None:
        raise ValueError("logger.wandb=true but wandb is not installed; pip install 'qwenft[wandb]' or set "
                         "logger.wandb=false")
    model_cfg = model_config(cfg)
    if cfg.model.path:  # every weight file's header and size, before config.yaml is written
        with input_file("model.path", cfg.model.path):
            checkpoint_files(Path(cfg.model.path))
    dtypes = resolve_dtypes(cfg, device.type)
    spec = RunSpec(layout, batching, dtypes, resolve_parallel(cfg, layout, model_cfg, batching, device.type, dtypes))
    check_what_trains(cfg, model_cfg, spec)
    attention = resolve_attention_kernel(cfg.model.kernels.attention, True, device, dtypes.compute)  # fails at start
    if not spec.parallel.fsdp:
        moot = [f"{key}={str(value).lower()}" for key, value in (
            ("mesh.fsdp_prefetch", cfg.mesh.fsdp_prefetch),
            ("pipeline.reduce_grad_per_microbatch", cfg.pipeline.reduce_grad_per_microbatch)) if value]
        log.info("FSDP2: not applied (one data-parallel rank, weights in the compute dtype %s or LoRA adapters: "
                 "nothing to shard, reduce or cast)%s", str(dtypes.compute).removeprefix("torch."),
                 f"; {' and '.join(moot)} {'change' if len(moot) > 1 else 'changes'} nothing" if moot else "")
    tokenizer, data, preprocessors = build_data(cfg, model_cfg, batching.microbatch_size, dp_rank, layout.dp,
                                                num_microbatches=batching.num_microbatches)
    _fit_vocab(cfg, model_cfg, len(tokenizer))
    if cfg.checkpoint.export_hf != "false":  # a bad source generation_config.json fails now, not after training
        from qwenft.checkpoint.hf_export import generation_config

        generation_config(tokenizer, cfg.model.path)
    peft = peft_meta(cfg)
    if resume_from is not None:
        ckpt_files.check_model_config(resume_from, model_cfg, cfg.checkpoint.resume, spec.dtypes.optim_names,
                                      peft=peft, mtp=cfg.model.mtp)
        resume.check_base(resume_from, cfg, peft and peft["base"])
        resume.check_data_position(resume_from, cfg, data)
    if is_main:  # the run dir is rewritten only past every check: a refused resume leaves it as it was
        signals.clear_marker(run_dir)
        if save_config is not None:
            save_config(run_dir)
    # the source's MTP head, copied now so that every export has it even once model.path is gone (a trained head,
    # model.mtp=train|head, replaces its tensors in the exports; its config keys stay)
    kept = []
    on_rank0(is_main, lambda: kept.append(mtp.keep(cfg.model.path, run_dir, resumed=resume_from is not None)))
    if kept:
        log.info(kept[0] if cfg.model.mtp == "keep" else mtp_training_line(cfg))
    max_steps = cfg.train.max_steps
    if max_steps is None:
        max_steps = max(1, math.ceil(cfg.train.epochs * data.rows_in_epoch(0) / cfg.train.global_batch_size))
    for note in moot_settings(cfg, max_steps, spec, model_cfg.vision is not None) if is_main else ():
        log.warning("config: %s", note)  # once: every rank's console shows warnings
    log.info("data: %s rows%s; %d documents, %d packed rows of %d tokens per epoch; skipped rows: %s; %s",
             data.format, " (data.format=auto, found by their columns)" if cfg.data.format == "auto" else "",
             data.num_documents, data.rows_in_epoch(0), cfg.data.seq_len, dict(data.skipped) or "none",
             data.cache_note)
    for name, source in getattr(data, "source_summary", {}).items():
        log.info("data source %s: %s, %s rows, weight %g: %d documents, %d tokens; skipped rows: %s", name,
                 source["path"], source["format"], source["weight"], source["documents"], source["tokens"],
                 source["skipped"] or "none")

    if layout.pp > 1:
        log.info("pipeline: %s, %d stages, layers per stage %s", spec.parallel.schedule, spec.parallel.num_stages,
                 [len(ls) for ls in spec.parallel.stage_layers])
    if cfg.model.activation_checkpointing == auto_ac.AUTO:  # the plan's choice, the same on every rank
        cfg = auto_ac.resolve(cfg, model_cfg, layout, mesh, device)
        spec = dataclasses.replace(spec, parallel=dataclasses.replace(
            spec.parallel, activation_checkpointing=cfg.model.activation_checkpointing))
    parts = build_model_parts(cfg, model_cfg, spec, mesh)
    for _, module in parts:
        load_weights(module, cfg, spec.dtypes.master if cfg.peft.method == "none" else None, device)
    modules = [module for _, module in parts]
    if spec.parallel.weight_grad == "in_matmul" and layout.tp > 1:
        stacks = stack_weights(modules)  # before the optimizer takes the parameters
        log.info("tensor parallel: %d projection stacks (a layer's projections of one input as one matmul) read "
                 "their weight shards as rows of one tensor", stacks)
    loss_fn = token_loss(spec, model_cfg)
    if layout.pp > 1:
        step = pipeline_step(pipeline_stages(parts, spec, mesh, device), spec, loss_fn, mesh, device)
    else:
        step = accumulation_step(modules[0], spec, loss_fn, batch_mesh(mesh).get_group(), device)
    params = [p for m in modules for p in m.parameters() if p.requires_grad]
    head_params = [p for m in modules if getattr(m, "mtp", None) is not None and cfg.model.mtp == "head"
                   for p in m.mtp.parameters() if p.requires_grad]
    n_params = sum(p.numel() for m in modules for p in m.parameters())
    log.info("model: %s, %.2fM parameters on this rank's stage(s), %.2fM trained", cfg.model.path or cfg.model.name,
             n_params / 1e6, sum(p.numel() for p in params) / 1e6)
    if cfg.model.fp8 != "off":
        from torchao.float8.float8_linear import Float8Linear

        from qwenft.distributed.float8 import describe

        log.info(describe([fqn for m in modules for fqn, mod in m.named_modules() if isinstance(mod, Float8Linear)],
                          cfg.model.fp8))

    optimizer = build_optimizer(params, cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.betas,
                                cfg.optim.eps, cfg.optim.fused, state_dtype=cfg.optim.state_dtype, seed=cfg.seed)
    fused = getattr(optimizer, "fused", None) or optimizer.defaults.get("fused")
    from qwenft.distributed.parallelize import gdn_graphs

    gdn = resolve_gdn_kernel(cfg.model.kernels.gdn)
    if gdn == "fla" and gdn_graphs(spec.parallel.cuda_graphs, spec.layout.tp):
        gdn += ", replayed as CUDA graphs (model.cuda_graphs, mesh.tp > 1)"
    if cfg.model.kernels.attention == "auto" and attention == "flash_varlen" and cudnn_ok(device, dtypes.compute):
        attention += f" (cuDNN by document piece where a row's documents average {LONG_PIECES}+ tokens)"
    log.info("kernels: GatedDeltaNet %s (model.kernels.gdn=%s); attention %s (model.kernels.attention=%s); "
             "cross-entropy %s (model.kernels.ce=%s); weight gradients %s (model.kernels.weight_grad=%s); "
             "optimizer %s, %s (optim.fused=%s)", gdn, cfg.model.kernels.gdn, attention, cfg.model.kernels.attention,
             spec.parallel.ce_kernel, cfg.model.kernels.ce, spec.parallel.weight_grad, cfg.model.kernels.weight_grad,
             type(optimizer).__name__, "fused" if fused else "foreach", cfg.optim.fused)
    scheduler = build_scheduler(optimizer, cfg.lr_scheduler.warmup_steps, max_steps, cfg.lr_scheduler.decay,
                                cfg.lr_scheduler.min_lr_ratio)
    wandb_config = as_written(cfg) if cfg.logger.wandb else None  # interpolated secrets by name, as in config.yaml
    metrics = MetricsLogger(run_dir, is_main, wandb_config, cfg.logger.wandb_project,
                            cfg.logger.wandb_mode, run_name=run_dir.name, fresh=resume_from is None)
    checkpointer = ckpt_lib.Checkpointer(ckpt_root, modules, optimizer, scheduler, data, model_cfg,
                                         cfg.checkpoint.keep, keep_best=cfg.checkpoint.keep_best,
                                         async_save=cfg.checkpoint.async_save, optim_dtypes=spec.dtypes.optim_names,
                                         peft=peft, data_meta=resume.data_meta(cfg, data),
                                         guard=signals.uninterruptible)
    start_step = 1
    if resume_from is not None:
        start_step = checkpointer.load(resume_from) + 1
        resume.apply_optimizer_options(optimizer, scheduler, cfg)
        metrics.cut_after(start_step - 1)
        log.info("resumed from %s; continuing at step %d", resume_from, start_step)

    return Job(cfg=cfg, spec=spec, model_cfg=model_cfg, mesh=mesh, device=device, run_dir=run_dir, is_main=is_main,
               data=data, preprocessors=preprocessors, model_parts=modules, params=params,
               head_params=head_params, step=step, loss_fn=loss_fn,
               validate=_validation(cfg, model_cfg, spec, mesh, device, modules), optimizer=optimizer,
               scheduler=scheduler, checkpointer=checkpointer, metrics=metrics, max_steps=max_steps,
               start_step=start_step, flops_per_token=metrics_lib.flops_per_token(model_cfg.text, cfg.data.seq_len,
                                                                            mtp=cfg.model.mtp != "keep"),
               peak_flops=metrics_lib.peak_flops(device))
