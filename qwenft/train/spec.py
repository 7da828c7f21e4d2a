"""Every decision a config implies for a run, computed once into small frozen specs that building, training
and `qwenft plan` share: how a step's batch is split (`Batching`), the dtypes (`Dtypes`), the pipeline
placement and FSDP's resharding (`ParallelSpec`), all of it with the layout in a `RunSpec`.

    spec = resolve_spec(cfg, layout, model_cfg, "cuda")      # no process group, no weights

Raises `ValueError` naming the config keys for a config the layout cannot run.
"""

import itertools
from dataclasses import dataclass

import torch

from qwenft.conf.schema import Config
from qwenft.conf.layout import Layout
from qwenft.distributed.expert_parallel import validate_ep
from qwenft.distributed.pipeline.split import V_SHAPED
from qwenft.distributed.tensor_parallel import validate_tp


@dataclass(frozen=True)
class Batching:
    """One step's sequences and how a dp rank splits them; the same split serves pipeline microbatches
    (pp > 1) and gradient accumulation (pp = 1)."""
    microbatch_size: int  # sequences per microbatch on one dp rank
    num_microbatches: int  # microbatches per step on one dp rank
    global_batch_size: int  # sequences per step over all dp ranks
    seq_len: int

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len


@dataclass(frozen=True)
class Dtypes:
    """What weights, their compute copies, gradients and AdamW state are held in."""
    compute: torch.dtype  # FSDP's param_dtype: what forward and backward run in
    master: torch.dtype  # trained weights are stored and updated in it (optim.master_dtype); GDN's decay stays fp32
    reduce: torch.dtype  # gradients are reduced and kept in it: the master dtype (bf16: 8 bytes a parameter)
    state: torch.dtype  # AdamW moments (optim.state_dtype)

    @property
    def optim_names(self) -> dict:
        """optim.state_dtype and optim.master_dtype as a checkpoint records them."""
        name = lambda dtype: str(dtype).removeprefix("torch.")  # noqa: E731
        return {"state_dtype": name(self.state), "master_dtype": name(self.master)}


@dataclass(frozen=True)
class ParallelSpec:
    """Where the layers run and how FSDP gathers, reduces and reshards them."""
    schedule: str  # pipeline.schedule (1f1b when pp = 1)
    virtual_stages: int  # pipeline stages per pp rank (1 when pp = 1)
    stage_layers: tuple[tuple[int, ...], ...]  # layer indices of every stage; one stage of all layers when pp = 1
    reduce_grad_per_microbatch: bool  # the knob (pipeline.reduce_grad_per_microbatch)
    single_pass: bool  # pp = 1 with one microbatch a step: its backward reduces at once, nothing is kept gathered
    reshard_after_forward: bool  # FSDP reshards between microbatches (pipeline.stage.reshard_policy, or single_pass)
    ce_kernel: str  # model.kernels.ce resolved: torch | fused
    ce_in_model: bool  # chunked or fused CE: the head returns the CE sum, never the whole logits
    activation_checkpointing: str  # model.activation_checkpointing's mode
    compile: bool  # model.compile: per-layer torch.compile
    cuda_graphs: bool  # model.cuda_graphs: the compiled graphs replayed as CUDA graphs
    weight_grad: str  # model.kernels.weight_grad resolved: in_matmul | autograd
    fsdp: bool  # FSDP2 wraps the model: dp > 1, or weights stored in another dtype than they compute in
    mtp_weight: float | None  # model.mtp_loss_weight where the MTP head trains (model.mtp=train|head), else None

    @property
    def num_stages(self) -> int:
        return len(self.stage_layers)


@dataclass(frozen=True)
class RunSpec:
    """All of a run's specs, on its layout."""
    layout: Layout
    batching: Batching
    dtypes: Dtypes
    parallel: ParallelSpec

    def stage_ids(self, pp_rank: int) -> list[int]:
        """The pipeline stages a pp rank runs ([0] when pp = 1)."""
        from qwenft.distributed.pipeline import split as pp_split

        if self.layout.pp == 1:
            return [0]
        v_shaped = self.parallel.schedule in pp_split.V_SHAPED
        return pp_split.stage_ids_for_rank(pp_rank, self.layout.pp, self.parallel.virtual_stages, v_shaped)


def check_mesh_keys(cfg: Config, layout: Layout) -> None:
    """Mesh and pipeline keys that contradict the layout; raised before anything is built."""
    if cfg.mesh.sequence_parallel and layout.tp == 1:
        raise ValueError("mesh.sequence_parallel=true needs mesh.tp > 1 (it shards over the tensor parallel ranks)")
    if cfg.mesh.sequence_parallel and cfg.data.seq_len % layout.tp:
        raise ValueError(f"mesh.sequence_parallel=true splits each row's data.seq_len={cfg.data.seq_len} tokens over "
                         f"mesh.tp={layout.tp} ranks; set data.seq_len to a multiple of {layout.tp}")
    if layout.pp > 1 and cfg.eval.every_steps and cfg.pipeline.schedule in V_SHAPED:
        raise ValueError(f"eval.every_steps={cfg.eval.every_steps} with pipeline.schedule={cfg.pipeline.schedule}: "
                         f"torch's V-shaped schedules ({', '.join(V_SHAPED)}) cannot run a forward-only pass; use "
                         f"another pipeline.schedule (e.g. interleaved_zb) or eval.every_steps=0")


def checked_batching(cfg: Config, layout: Layout, packages_here: bool = True) -> Batching:
    """The batching of a run on `layout`, after the checks of the keys it depends on (the mesh's pipeline keys,
    model.fp8): the first decisions of every run, before anything is built. `packages_here`: whether this
    machine's packages are the run's (false for `qwenft slurm`, whose job may run in a container of its own), so
    that a package missing here is refused."""
    check_mesh_keys(cfg, layout)
    batching = resolve_batching(cfg, layout.dp)
    check_fp8(cfg, layout, batching, packages_here)
    return batching


def resolve_batching(cfg: Config, dp: int) -> Batching:
    """train.global_batch_size split over `dp` ranks into microbatches of train.micro_batch_size (which
    pipeline.microbatch_size, when set, equals: `schema.validate`)."""
    size = cfg.train.micro_batch_size
    per_step = size * dp
    if cfg.train.global_batch_size % per_step:
        raise ValueError(
            f"train.global_batch_size={cfg.train.global_batch_size} is not a multiple of "
            f"train.micro_batch_size={size} x dp={dp} = {per_step}")
    count = cfg.train.global_batch_size // per_step
    if cfg.pipeline.num_microbatches is not None and cfg.pipeline.num_microbatches != count:
        raise ValueError(
            f"pipeline.num_microbatches={cfg.pipeline.num_microbatches} but train.global_batch_size="
            f"{cfg.train.global_batch_size} / dp={dp} / train.micro_batch_size={size} = {count}; set it to {count} "
            f"or null")
    return Batching(size, count, cfg.train.global_batch_size, cfg.data.seq_len)


def resolve_dtypes(cfg: Config, device: str) -> Dtypes:
    """model.dtype=auto computes in bf16 on CUDA or with bf16 master weights, else in fp32."""
    if cfg.model.dtype == "auto":
        bf16 = device == "cuda" or cfg.optim.master_dtype == "bfloat16"
        compute = torch.bfloat16 if bf16 else torch.float32
    else:
        compute = getattr(torch, cfg.model.dtype)
    master = getattr(torch, cfg.optim.master_dtype)
    return Dtypes(compute=compute, master=master, reduce=master, state=getattr(torch, cfg.optim.state_dtype))


def resolve_ce_kernel(cfg: Config, layout: Layout, device: str) -> str:
    """model.kernels.ce: auto = fused on CUDA (no fp32 logits, less memory, faster; a vocab-parallel head too),
    else torch. Raises for model.ce_chunk_tokens with the torch kernel on a vocab-parallel head, whose chunked
    recompute needs the whole weight."""
    kernel = cfg.model.kernels.ce
    if kernel == "auto":
        kernel = "fused" if device == "cuda" else "torch"
    if kernel == "torch" and cfg.model.ce_chunk_tokens and layout.tp > 1 and cfg.mesh.vocab_parallel:
        auto = " (model.kernels.ce=auto off CUDA)" if cfg.model.kernels.ce == "auto" else ""
        raise ValueError(f"model.ce_chunk_tokens={cfg.model.ce_chunk_tokens} with model.kernels.ce=torch{auto} needs "
                         f"the whole lm_head on each rank, but mesh.vocab_parallel=true shards it over "
                         f"mesh.tp={layout.tp}; set model.kernels.ce=fused, mesh.vocab_parallel=false or "
                         f"model.ce_chunk_tokens=0")
    return kernel


def check_tied_stages(cfg: Config, layout: Layout) -> None:
    """Tied embeddings under pipeline parallelism: embed_tokens sits on the first stage, lm_head on the last. A
    frozen tied matrix (peft=lora without train_embeddings / train_head) is simply held by both, each stage
    loading it from the checkpoint's one tensor; a trained one would need its two stages' gradients summed and
    its updates kept equal, which qwenft does not do, so the run fails here."""
    model = cfg.model.path or cfg.model.name
    if cfg.peft.method == "none":
        raise ValueError(f"model {model} ties lm_head to the embeddings, which mesh.pp={layout.pp} puts on "
                         f"different stages; use mesh.pp=1 (or peft=lora, which keeps the tied matrix frozen)")
    flag = next((f for f in ("train_embeddings", "train_head") if getattr(cfg.peft, f)), None)
    if flag is not None:
        raise ValueError(f"peft.{flag}=true trains the matrix that model {model} ties between embed_tokens and "
                         f"lm_head, which mesh.pp={layout.pp} puts on different stages; use mesh.pp=1, or "
                         f"peft.train_embeddings=false and peft.train_head=false")


def uses_fsdp(layout: Layout, dtypes: Dtypes, peft) -> bool:
    """Whether FSDP2 wraps the model. With one data-parallel rank it has nothing to shard or reduce, yet its
    all-gather still copies every unit's parameters into a buffer of their own (a second copy of the weights
    while they are gathered) and its hooks run around every unit; it is left out then, with or without tensor
    and pipeline parallelism, unless it is needed to cast weights stored in optim.master_dtype to the compute
    dtype (without it autograd accumulates gradients in the weights' own dtype, the master dtype, as FSDP
    would). Tensor parallelism then leaves DTensor parameters next to plain ones (optim.build_optimizer keeps
    them in groups of their own), each gradient with its parameter's placement.

    With peft=lora the frozen base is stored in the compute dtype and the adapters cast themselves
    (lora._add_adapter), so only trained embeddings or head (`peft` options) need FSDP's cast."""
    if layout.dp * layout.cp > 1:  # with context parallel, FSDP2 also sums the gradients over the spans
        return True
    if peft.method == "lora":
        return dtypes.master != dtypes.compute and (peft.train_embeddings or peft.train_head)
    return dtypes.master != dtypes.compute


def check_cp(cfg: Config, layout: Layout, model_cfg, device: str, microbatch_size: int,
             packages_here: bool = True) -> None:
    """mesh.cp > 1 with what context parallel does not run with yet; raised before anything is built."""
    if layout.cp == 1:
        return
    from qwenft.models.qwen3_5.configs import LINEAR_ATTENTION
    from qwenft.models.qwen3_5.gdn import resolve_kernel

    text = model_cfg.text
    span = -(-microbatch_size * cfg.data.seq_len // layout.cp)  # the stream is padded to a multiple of cp
    halo = text.linear_conv_kernel_dim - 1  # the rows GatedDeltaNet's conv reads from the previous span
    why = None
    if LINEAR_ATTENTION in text.layer_types and span < halo:
        least = (halo - 1) * layout.cp // microbatch_size + 1
        why = (f"data.seq_len={cfg.data.seq_len}: a span of {span} tokens (train.micro_batch_size x data.seq_len / "
               f"mesh.cp) is shorter than the {halo} rows GatedDeltaNet's conv reads from the span before; valid: "
               f"data.seq_len >= {least}")
    elif cfg.mesh.sequence_parallel:
        why = "mesh.sequence_parallel=true splits the same tokens again over tp; set it to false"
    elif packages_here and resolve_kernel(cfg.model.kernels.gdn) == "fla" and device == "cuda" and not _fla_has_cp():
        why = ("this flash-linear-attention has no context-parallel kernels (fla.ops.cp, fla >= 0.5); upgrade it "
               "or set model.kernels.gdn=torch (the reference kernels, slower)")
    if why is not None:
        raise ValueError(f"mesh.cp={layout.cp} with {why} (or mesh.cp=1)")


def _fla_has_cp() -> bool:
    try:
        import fla.ops.cp  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_parallel(cfg: Config, layout: Layout, model_cfg, batching: Batching, device: str,
                     dtypes: Dtypes, packages_here: bool = True) -> ParallelSpec:
    """The pipeline placement and FSDP's resharding; raises on head counts, expert counts, a schedule, a stage
    split or a model that the layout cannot run."""
    from qwenft.distributed.pipeline import split as pp_split, stage as pp_stage

    validate_tp(model_cfg.text, layout.tp, cfg.mesh.sequence_parallel)
    validate_ep(model_cfg.text, layout.ep)
    check_cp(cfg, layout, model_cfg, device, batching.microbatch_size, packages_here)
    name, knob = cfg.pipeline.schedule, cfg.pipeline.reduce_grad_per_microbatch
    num_layers = model_cfg.text.num_hidden_layers
    virtual, layers = 1, [list(range(num_layers))]
    if layout.pp > 1:
        virtual = cfg.pipeline.virtual_stages or pp_split.default_virtual_stages(name)
        pp_split.check_virtual_stages(name, virtual)
        check_microbatches(cfg, layout, batching, virtual)
        if model_cfg.tie_word_embeddings:
            check_tied_stages(cfg, layout)
        layers = pp_split.split_layers(num_layers, layout.pp * virtual, model_cfg.vision is not None,
                                       cfg.pipeline.layers_per_stage, cfg.pipeline.stage_layers)
    single_pass = layout.pp == 1 and batching.num_microbatches == 1
    fsdp = uses_fsdp(layout, dtypes, cfg.peft)
    cuda_graphs = check_cuda_graphs(cfg, layout, device, fsdp, dtypes)
    weight_grad = resolve_weight_grad(cfg, layout, device, fsdp, dtypes)
    return ParallelSpec(
        schedule=name, virtual_stages=virtual, stage_layers=tuple(tuple(stage) for stage in layers),
        reduce_grad_per_microbatch=knob, single_pass=single_pass,
        reshard_after_forward=pp_stage.reshard_policy(name, knob) or single_pass,
        ce_kernel=(ce_kernel := resolve_ce_kernel(cfg, layout, device)),
        ce_in_model=cfg.model.ce_chunk_tokens > 0 or ce_kernel == "fused",
        activation_checkpointing=cfg.model.activation_checkpointing,
        compile=cfg.model.compile, cuda_graphs=cuda_graphs,
        weight_grad=weight_grad, fsdp=fsdp, mtp_weight=check_mtp(cfg, layout, ce_kernel))


def check_microbatches(cfg: Config, layout: Layout, batching: Batching, virtual_stages: int) -> None:
    """The step's microbatches against what the pipeline schedule takes (it validates its eval too: the same count)."""
    from qwenft.distributed.pipeline.schedule import microbatch_rule

    name, n = cfg.pipeline.schedule, batching.num_microbatches
    why = microbatch_rule(name, n, layout.pp, virtual_stages)
    if why is None:
        return
    fits = next(m for m in itertools.count(n + 1) if microbatch_rule(name, m, layout.pp, virtual_stages) is None)
    per = batching.microbatch_size * layout.dp
    raise ValueError(f"pipeline.schedule={name} with mesh.pp={layout.pp}: train.global_batch_size="
                     f"{cfg.train.global_batch_size} makes {n} microbatch{'es' if n > 1 else ''} a step "
                     f"(train.micro_batch_size={batching.microbatch_size}, mesh.dp={layout.dp}), and {why}; set "
                     f"train.global_batch_size={fits * per}, or another pipeline.schedule")


def check_fp8(cfg: Config, layout: Layout, batching: Batching, packages_here: bool = True) -> None:
    """model.fp8 (one of its choices: `schema.validate`); raises where the run cannot take float8 linears."""
    recipe = cfg.model.fp8
    if recipe == "off":
        return
    if packages_here:
        try:
            import torchao.float8  # noqa: F401
        except ImportError:
            raise ValueError(f"model.fp8={recipe} needs torchao: pip install 'qwenft[fp8]' (or model.fp8=off)"
                             ) from None
    if cfg.peft.method != "none":
        raise ValueError(f"model.fp8={recipe} with peft={cfg.peft.method}: float8 linears do not take LoRA adapters "
                         f"yet; use peft=none or model.fp8=off")

    def rank_tokens(seq_len: int) -> int:  # cp pads the stream to a multiple of cp
        return -(-batching.microbatch_size * seq_len // layout.cp)

    if rank_tokens(cfg.data.seq_len) % 16:
        fits = next(n for n in itertools.count(cfg.data.seq_len + 1) if rank_tokens(n) % 16 == 0)
        raise ValueError(f"model.fp8={recipe}: a microbatch holds {rank_tokens(cfg.data.seq_len)} tokens a rank "
                         f"(train.micro_batch_size x data.seq_len / mesh.cp, rounded up), and float8 GEMMs need a "
                         f"multiple of 16; set data.seq_len={fits} (or another train.micro_batch_size)")


def check_mtp(cfg: Config, layout: Layout, ce_kernel: str) -> float | None:
    """model.mtp_loss_weight where the MTP head trains, else None; raises where the layout cannot run it."""
    if cfg.model.mtp == "keep":
        return None
    if layout.tp > 1 and cfg.mesh.vocab_parallel and ce_kernel != "fused":
        raise ValueError(f"model.mtp={cfg.model.mtp} with mesh.tp={layout.tp} and mesh.vocab_parallel=true needs "
                         f"model.kernels.ce=fused (its loss runs on the vocab-parallel lm_head's local rows); set it, "
                         f"or mesh.vocab_parallel=false")
    return cfg.model.mtp_loss_weight


def resolve_weight_grad(cfg: Config, layout: Layout, device: str, fsdp: bool, dtypes: Dtypes) -> str:
    """model.kernels.weight_grad: in_matmul needs each trained weight's `.grad` to go straight to the optimizer
    (qwenft.models.weight_grad): no FSDP2 or pipeline; a tensor-parallel rank's shards and CUDA graphs qualify (a
    graph adds into each buffer at the address it was recorded with: the buffers live for the run). auto takes it
    there on CUDA, else autograd. Raises where in_matmul was asked for and the layout cannot run it."""
    mode = cfg.model.kernels.weight_grad
    if mode == "autograd":
        return mode
    why = None
    if fsdp:
        why = f"FSDP2 reduces the gradients that autograd gives it, and {fsdp_cause(cfg, layout, dtypes)}"
    elif layout.pp > 1:
        why = f"mesh.pp={layout.pp}: pipeline schedules take the weight gradients from autograd"
    if why is None:
        return "in_matmul" if mode == "in_matmul" or device == "cuda" else "autograd"
    if mode == "auto":
        return "autograd"
    raise ValueError(f"model.kernels.weight_grad=in_matmul: {why}; use model.kernels.weight_grad=auto or autograd")


def fsdp_cause(cfg: Config, layout: Layout, dtypes: Dtypes) -> str:
    """Why FSDP2 wraps the model (`uses_fsdp`), naming the keys and what to set for a run without it."""
    compute = str(dtypes.compute).removeprefix("torch.")
    if layout.dp * layout.cp > 1:
        return (f"mesh.dp={layout.dp} x mesh.cp={layout.cp} shard them; set mesh.dp=1 and mesh.cp=1"
                if layout.cp > 1 else f"mesh.dp={layout.dp} shards them; set mesh.dp=1")
    if cfg.peft.method == "lora":
        return (f"peft.train_embeddings / peft.train_head with optim.master_dtype={cfg.optim.master_dtype} "
                f"need its cast to {compute}; set optim.master_dtype={compute} or train neither")
    return (f"optim.master_dtype={cfg.optim.master_dtype} needs its cast to the compute dtype; set "
            f"optim.master_dtype={compute}")


def check_cuda_graphs(cfg: Config, layout: Layout, device: str, fsdp: bool, dtypes: Dtypes) -> bool:
    """model.cuda_graphs; raises where the compiled graphs cannot be replayed as CUDA graphs. A CUDA graph reads
    its weights at the addresses it was recorded with, and its outputs live in a pool that its next replay
    overwrites: so no FSDP2 (it gathers the weights into new buffers every step), no activation checkpointing
    (the recompute replays a layer's forward graphs while its backward is pending) and no pipeline schedule
    (several microbatches' forwards before their backwards)."""
    if not cfg.model.cuda_graphs:
        return False
    if device != "cuda":
        why = f"it needs CUDA, and this run is on {device}"
    elif not cfg.model.compile:
        why = "it replays model.compile's graphs; set model.compile=true"
    elif fsdp:
        why = f"the weights must stay at fixed addresses, which FSDP2 does not keep: {fsdp_cause(cfg, layout, dtypes)}"
    elif cfg.model.activation_checkpointing not in ("false", "auto"):  # auto chooses off under CUDA graphs
        why = (f"model.activation_checkpointing={cfg.model.activation_checkpointing} recomputes the graphs "
               f"inside the backward; set it to false")
    elif layout.pp > 1:
        why = f"mesh.pp={layout.pp}: pipeline schedules are not supported; set mesh.pp=1"
    else:
        return True
    raise ValueError(f"model.cuda_graphs=true: {why} (or model.cuda_graphs=false)")


def resolve_spec(cfg: Config, layout: Layout, model_cfg, device: str, packages_here: bool = True) -> RunSpec:
    """Every spec of a run on `layout` whose model is `model_cfg`, for `device` ("cuda" or "cpu");
    `packages_here` as `checked_batching`'s."""
    validate_ep(model_cfg.text, layout.ep)  # before the batch split over dp, which expert parallelism sets
    batching = checked_batching(cfg, layout, packages_here)
    dtypes = resolve_dtypes(cfg, device)
    return RunSpec(layout, batching, dtypes,
                   resolve_parallel(cfg, layout, model_cfg, batching, device, dtypes, packages_here))
