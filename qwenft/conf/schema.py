"""Typed schema of a qwenft run: every key a recipe or an override may set.

Plain dataclasses, so components can take them without importing Hydra or OmegaConf. The CLI merges the
composed YAML into `Config`, which rejects unknown keys and wrong types before anything is built. Each
section is an `*Options` class (`ModelOptions` is what a user sets for `model.*`; the architecture itself is
qwenft.models.qwen3_5.configs.ModelConfig).
"""

import re
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class MeshOptions:
    tp: int = 1  # tensor parallel degree
    pp: int = 1  # pipeline parallel degree
    dp: int = -1  # data parallel degree (FSDP2); -1 = world size / (tp * pp * cp)
    # expert parallel degree (MoE models): each group of ep data-parallel ranks shares out the routed experts,
    # tokens travel to their experts by all-to-all; must divide mesh.dp and the number of experts
    ep: int = 1
    # context parallel degree: each microbatch's packed stream split into cp contiguous spans, one per rank, for
    # sequences longer than one rank's activations hold (docs/parallelism.md, "Context parallel")
    cp: int = 1
    # cp > 1: full attention's queries computed by halves, each rank one early and one late half of the stream,
    # so that every rank sees as many keys (contiguous spans load the last rank most for long documents);
    # false = each rank its own span's queries; no effect at cp = 1
    cp_balanced_attention: bool = True
    backend: str = "auto"  # auto = nccl on CUDA, gloo on CPU
    vocab_parallel: bool = True  # tp > 1: shard embeddings and lm_head by vocab, with a vocab-parallel loss
    sequence_parallel: bool = False  # tp > 1: norms and residual stream sharded over the sequence
    # 0 = FSDP2's implicit prefetching only; N > 0 = each FSDP unit, when its forward starts, all-gathers the
    # next N units (set_modules_to_forward_prefetch), and in the backward the N units before it
    fsdp_prefetch: int = 0


@dataclass
class KernelsOptions:
    gdn: str = "auto"  # auto = fla on CUDA when importable, else torch
    # packed full attention: auto = on CUDA in bf16/fp16, cudnn for rows of long documents (2048+ tokens on average)
    # and flash_varlen (torch >= 2.10) for the rest; else sdpa (dense block mask)
    attention: str = "auto"
    # the lm_head's cross-entropy: fused = gradients formed in the forward, no fp32 logits, a vocab-parallel head
    # too (qwenft.models.linear_ce); auto = fused on CUDA, else torch
    ce: str = "auto"
    # an MoE model's routed experts: grouped_mm (torch._grouped_mm, one kernel for all experts), loop (one
    # matmul pair per expert); auto = grouped_mm for bf16 on CUDA, else loop
    moe: str = "auto"
    # the weight gradients: in_matmul = each added into .grad by the matmul that forms it (cuBLAS's beta = 1; the
    # embedding's and the fused head's likewise), autograd = formed as new tensors, then added by autograd;
    # auto = in_matmul on CUDA where each rank's weights (tp shards included) are its own: no FSDP2 or pp (CUDA
    # graphs included); else autograd (qwenft.models.weight_grad)
    weight_grad: str = "auto"
    # where compiled kernels persist between runs: torch.compile's (inductor/), Triton's, fla's among them
    # (triton/), TileLang's (tilelang/); null = each library's default (inductor's is under /tmp, which a SLURM
    # job's node may not keep). A second run of the same shapes then skips the compile (docs/slurm.md)
    cache_dir: Optional[str] = None


@dataclass
class ModelOptions:
    name: str = "tiny"  # named size from qwenft.models.qwen3_5.configs; ignored when path is set
    path: Optional[str] = None  # HF checkpoint dir: config.json, weights and tokenizer come from it
    dtype: str = "auto"  # auto = bf16 params on CUDA (or with optim.master_dtype=bfloat16), fp32 on CPU
    kernels: KernelsOptions = field(default_factory=KernelsOptions)
    # recompute decoder layers in the backward: true = every layer, linear_attention / full_attention = only
    # layers of that kind, selective = every layer keeping matmul outputs; auto = the cheapest of these (off
    # first) that the memory plan fits under 90% of the GPU's memory (qwenft.train.auto_ac); docs/performance.md
    activation_checkpointing: str = "false"
    num_layers: Optional[int] = None  # keep only the first N decoder layers (benchmarks, debugging)
    freeze_vision: bool = False  # VLM: no gradient for the vision tower
    freeze_projector: Optional[bool] = None  # VLM: the tower's merger; null = follow freeze_vision
    freeze_language: bool = False  # VLM: no gradient for the text decoder (adapter-style runs)
    vision_activation_checkpointing: bool = False
    # CE of the lm_head over this many tokens at a time, so the [tokens, vocab] logits never exist whole (with
    # kernels.ce=torch, recomputed in the backward: not on a vocab-parallel head); 0 = off (docs/performance.md,
    # "Memory options")
    ce_chunk_tokens: int = 0
    # torch.compile each decoder layer's norms, MLP and the mixers' fixed-shape pieces around their kernels, and
    # the final norm
    # (docs/performance.md, "torch.compile per block")
    compile: bool = False
    # replay model.compile's graphs as CUDA graphs (torch.compile's reduce-overhead mode): one launch a graph
    # instead of its kernels, for host-bound layouts such as tp4 (at tp2 compile alone is faster); CUDA, no FSDP2,
    # no activation checkpointing, mesh.pp=1 (docs/parallelism.md, "Tensor parallelism")
    cuda_graphs: bool = False
    # the multi-token-prediction head (docs/models.md, "The MTP head"): keep = pass the checkpoint's through to
    # every export untouched; train = loss + mtp_loss_weight x its loss, into the trunk too; head = train the head
    # alone on the trunk's detached output
    mtp: str = "keep"
    mtp_loss_weight: float = 0.1
    # FP8 matmuls for the decoder layers' large linears through torchao (pip install 'qwenft[fp8]'): off,
    # rowwise, rowwise_with_gw_hp or tensorwise (docs/performance.md, "FP8")
    fp8: str = "off"


@dataclass
class ImageOptions:
    min_pixels: Optional[int] = None  # resize bounds per image; null = the processor's own
    max_pixels: Optional[int] = None
    max_image_bytes: int = 32 * 2**20  # larger image files are bad rows (data.on_bad_row)


@dataclass
class VideoOptions:
    """Video parts (docs/data.md, "Videos"); null = the checkpoint's video processor's value."""
    min_pixels: Optional[int] = None  # bounds on t * h * w over all of a video's frames after resizing
    max_pixels: Optional[int] = None  # (over it even at the smallest frame size: a bad row, video_too_large)
    fps: Optional[float] = None  # frames a second sampled from a video file; a frame list's default rate
    min_frames: Optional[int] = None  # frames sampled from a file: at least (if it has them) ...
    max_frames: Optional[int] = None  # ... and at most; a longer frame list is a bad row
    max_video_bytes: int = 512 * 2**20  # larger video files are bad rows (data.on_bad_row)


@dataclass
class SourceOptions:
    """One dataset of a mixture (data.sources)."""
    path: str = "???"  # like data.path
    weight: float = 1.0  # share of the mixture's tokens, relative to the other sources' weights
    format: Optional[str] = None  # row format; null = data.format's


@dataclass
class DataOptions:
    path: str = "tiny"  # JSONL / Parquet / datasets dir; "tiny" = the chat set shipped in the package
    # a mixture instead of data.path: [{path, weight, format}], each source's token share ~ its weight
    sources: list[SourceOptions] = field(default_factory=list)
    tokenizer: Optional[str] = None  # tokenizer dir; default: model.path, else "tiny" (trained at first use)
    seq_len: int = 256
    packing: str = "pack"  # pack documents into rows, or pad one document per row
    train_on: str = "assistant"  # labels on assistant turns, those after the last user turn, or all tokens
    truncation: str = "truncate_right"  # documents longer than seq_len: cut, or drop them
    on_bad_row: str = "skip"  # skip (and count) bad rows, or error on the first
    format: str = "auto"  # rows as messages, sharegpt or alpaca; auto = the format of most rows, by their columns
    cache: bool = True  # tokenize once into a memory-mapped token cache; false = in memory on every rank
    cache_dir: Optional[str] = None  # where the token cache goes; null = .qwenft-cache beside the data
    num_proc: Optional[int] = None  # processes tokenizing into the cache; null = this machine's cores
    # VLM: threads decoding and processing images and video frames ahead of the step; 0 = in the training loop
    num_workers: int = 2
    image: ImageOptions = field(default_factory=ImageOptions)
    video: VideoOptions = field(default_factory=VideoOptions)


@dataclass
class OptimOptions:
    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: list = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    fused: str = "auto"  # auto = fused AdamW on CUDA
    max_grad_norm: float = 1.0  # global-norm clipping; 0 = off
    state_dtype: str = "float32"  # AdamW moments; bfloat16 = 4 bytes per parameter less
    # trained weights (and their gradients); bfloat16 = no fp32 master copy, stochastically rounded updates
    # (6 bytes per parameter less); docs/performance.md, "Memory options"
    master_dtype: str = "float32"


@dataclass
class LRSchedulerOptions:
    warmup_steps: int = 0
    decay: str = "cosine"  # after the warmup
    min_lr_ratio: float = 0.0  # final lr = lr * min_lr_ratio


@dataclass
class TrainOptions:
    max_steps: Optional[int] = 100  # optimizer steps; null = run `epochs` epochs
    epochs: Optional[float] = None
    global_batch_size: int = 8  # sequences per optimizer step, over all data parallel ranks
    micro_batch_size: int = 1  # sequences per forward on one rank
    log_every: int = 1
    progress_bar: bool = True
    on_nonfinite: str = "error"  # non-finite loss or grad norm; skip = drop the step, counted as skipped_steps


@dataclass
class PipelineOptions:
    schedule: str = "1f1b"  # torch.distributed.pipelining schedule
    microbatch_size: Optional[int] = None  # sequences per microbatch; null = train.micro_batch_size
    num_microbatches: Optional[int] = None  # derived: global batch / dp / microbatch_size; if set, must agree
    virtual_stages: Optional[int] = None  # stages per pp rank; null = 1 (gpipe, 1f1b) or 2 (the others)
    layers_per_stage: Optional[list] = None  # e.g. [15, 17, 17, 15]; null = balanced (embed, head ~1 layer each)
    stage_layers: Optional[list] = None  # e.g. [[0, 1], [2, 3]]: explicit layer indices of each stage
    reduce_grad_per_microbatch: bool = False  # reduce-scatter FSDP grads every microbatch (see docs)


@dataclass
class CheckpointOptions:
    # At the end of training, write the trained model as an HF checkpoint (safetensors + index + config.json
    # + tokenizer files) to <run_dir>/hf, loadable by transformers' from_pretrained. peft=lora: true writes the
    # adapters in peft's format to <run_dir>/adapter, merged the base with the adapters merged in to <run_dir>/hf.
    export_hf: str = "true"
    export_dtype: str = "bfloat16"
    # Sharded training checkpoints (model, optimizer, scheduler, data position, RNG) in <run_dir>/checkpoints
    every_steps: int = 0  # save after every N optimizer steps and after the last; 0 = no training checkpoints
    keep: int = 2  # keep the newest N checkpoints
    keep_best: bool = False  # also keep the checkpoint with the lowest val_loss (`best`); needs eval.every_steps
    async_save: bool = False  # write checkpoints in the background while training continues
    resume: str = "auto"  # auto = the newest checkpoint in run_dir, if any | none | path to a step-NNNNNN dir


@dataclass
class EvalOptions:
    every_steps: int = 0  # validation loss after every N optimizer steps and at the end; 0 = never
    dataset: Optional[str] = None  # chat data like data.path; "tiny" = the shipped tiny_chat_val.jsonl
    max_batches: Optional[int] = None  # micro batches per rank per validation; null = the whole set


@dataclass
class LoggerOptions:
    wandb: bool = False
    wandb_project: str = "qwenft"
    wandb_mode: Optional[str] = None  # online | offline | disabled; default: WANDB_MODE or online


MASTER_PORT_BASE = 20000  # launcher.master_port's default: MASTER_PORT_BASE + SLURM_JOB_ID % MASTER_PORT_BASE


@dataclass
class LauncherOptions:
    nproc_per_node: int = 1  # `qwenft train` starts this many local workers; SLURM: procs per node without GPUs
    # `qwenft slurm` (docs/slurm.md): one sbatch task per node, torchrun on each with c10d rendezvous
    nodes: int = 1
    gpus_per_node: int = 8  # 0 = CPU nodes: launcher.nproc_per_node processes per node, gloo
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    time: Optional[str] = None  # SLURM time limit, e.g. "24:00:00"; null = the partition's default
    job_name: Optional[str] = None  # default qwenft-<recipe>
    cpus_per_task: Optional[int] = None  # CPUs per node task (the node's torchrun and its workers)
    container_image: Optional[str] = None  # pyxis: srun --container-image
    container_mounts: list = field(default_factory=list)  # pyxis: srun --container-mounts, "src:dst" each
    env: Optional[dict] = None  # exported in the job; secrets (SECRET_NAME) by name only (null)
    setup: list = field(default_factory=list)  # shell lines before srun: module load, source .venv/bin/activate
    sbatch_extra: list = field(default_factory=list)  # extra #SBATCH options, e.g. "--exclusive"
    python: Optional[str] = None  # interpreter on the nodes; default: this one (or `python` in a container)
    master_port: Optional[int] = None  # c10d rendezvous port on the first node; default 20000 + job id % 20000
    signal_seconds: int = 120  # SIGUSR1 to the workers this long before the time limit: checkpoint and stop
    requeue: bool = True  # sbatch --requeue: SLURM may requeue the job after preemption or node failure
    max_requeues: int = 10  # a preempted job (checkpoint saved) requeues itself while SLURM_RESTART_COUNT < this


@dataclass
class PlanOptions:
    """`qwenft plan` (docs/performance.md, "Memory planner")."""
    gpu_memory_gib: float = 139.0  # flag ranks whose planned peak is above this (H200: about 139 GiB usable)
    json: Optional[str] = None  # also write the plan as JSON to this path
    image_patches: Optional[int] = None  # VLM: image patches per sequence; null (and videos 0) = every token an image's
    videos: int = 0  # VLM: videos per sequence, each at its pixel budget (data.video.max_pixels, else the checkpoint's)


@dataclass
class PeftOptions:
    """Parameter-efficient finetuning (docs/lora.md): `peft=lora` trains LoRA adapters, the base stays frozen."""
    method: str = "none"  # none = full finetuning | lora
    rank: int = 16  # r: the adapters' inner dimension
    alpha: float = 32.0  # the adapter's output is scaled by alpha / rank
    dropout: float = 0.0  # dropout on the adapter's input
    # all-linear = every linear layer of the language model (GatedDeltaNet's in_proj_* and out_proj included, not
    # lm_head); else a list of transformers' module names (q_proj, in_proj_qkv, ...) or regexes on names like
    # layers.3.mlp.down_proj
    target_modules: Any = "all-linear"
    vision: bool = False  # also adapt the vision tower's linears (else it stays frozen)
    train_embeddings: bool = False  # train embed_tokens whole (fp32 master copy and AdamW state)
    train_head: bool = False  # train lm_head whole; with tied embeddings either flag trains the one shared matrix


@dataclass
class Config:
    recipe: str = "tiny"
    description: str = ""
    run_dir: Optional[str] = None  # default outputs/<recipe>/<timestamp>
    seed: int = 0
    mesh: MeshOptions = field(default_factory=MeshOptions)
    model: ModelOptions = field(default_factory=ModelOptions)
    data: DataOptions = field(default_factory=DataOptions)
    optim: OptimOptions = field(default_factory=OptimOptions)
    lr_scheduler: LRSchedulerOptions = field(default_factory=LRSchedulerOptions)
    train: TrainOptions = field(default_factory=TrainOptions)
    pipeline: PipelineOptions = field(default_factory=PipelineOptions)
    checkpoint: CheckpointOptions = field(default_factory=CheckpointOptions)
    eval: EvalOptions = field(default_factory=EvalOptions)
    logger: LoggerOptions = field(default_factory=LoggerOptions)
    launcher: LauncherOptions = field(default_factory=LauncherOptions)
    plan: PlanOptions = field(default_factory=PlanOptions)
    peft: PeftOptions = field(default_factory=PeftOptions)


# launcher.env names whose values never go into a file (script, config): they travel by name from the
# submitting shell (sbatch --export=ALL). HF_TOKEN, WANDB_API_KEY, AWS_SECRET_ACCESS_KEY, DB_PASSWORD, ...
SECRET_NAME = re.compile(r"(_KEY|_TOKEN)$|SECRET|PASSWORD", re.IGNORECASE)

# Every key that takes one of a fixed set of values, with that set: validate() checks it, docs/cli.md lists
# it (tests/test_cli.py checks that the docs name every value).
CHOICES = {
    "mesh.backend": ("auto", "nccl", "gloo"),
    "model.dtype": ("auto", "float32", "bfloat16"),
    "model.kernels.gdn": ("auto", "fla", "torch"),
    "model.kernels.attention": ("auto", "sdpa", "flash_varlen", "cudnn"),
    "model.kernels.ce": ("auto", "torch", "fused"),
    "model.kernels.moe": ("auto", "grouped_mm", "loop"),
    "model.kernels.weight_grad": ("auto", "in_matmul", "autograd"),
    "model.fp8": ("off", "rowwise", "rowwise_with_gw_hp", "tensorwise"),
    "model.mtp": ("keep", "train", "head"),
    "model.activation_checkpointing": ("false", "true", "linear_attention", "full_attention", "selective", "auto"),
    "data.packing": ("pack", "pad"),
    "data.train_on": ("assistant", "last_turn", "all"),
    "data.truncation": ("truncate_right", "drop"),
    "data.on_bad_row": ("skip", "error"),
    "data.format": ("auto", "messages", "sharegpt", "alpaca"),
    "optim.fused": ("auto", "true", "false"),
    "optim.state_dtype": ("float32", "bfloat16"),
    "optim.master_dtype": ("float32", "bfloat16"),
    "lr_scheduler.decay": ("cosine", "linear", "constant"),
    "checkpoint.export_hf": ("true", "false", "merged"),
    "checkpoint.export_dtype": ("bfloat16", "float32"),
    "train.on_nonfinite": ("error", "skip"),
    "peft.method": ("none", "lora"),
    "pipeline.schedule": ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zb", "zbv", "dualpipev"),
}


SOURCE_FORMATS = (None, *CHOICES["data.format"])  # a source's row format; null = data.format's


def validate(cfg: Config) -> None:
    """Value checks the type system can't express; one line each, naming key, value and what is valid."""
    for key, valid in CHOICES.items():
        value = cfg
        for part in key.split("."):
            value = getattr(value, part)
        if str(value) not in valid:
            raise ValueError(f"{key}={value!r} is not valid; choose one of {', '.join(valid)}")
    positive = {
        "mesh.tp": cfg.mesh.tp, "mesh.pp": cfg.mesh.pp, "mesh.ep": cfg.mesh.ep, "data.seq_len": cfg.data.seq_len,
        "train.global_batch_size": cfg.train.global_batch_size,
        "train.micro_batch_size": cfg.train.micro_batch_size, "train.log_every": cfg.train.log_every,
        "launcher.nproc_per_node": cfg.launcher.nproc_per_node, "launcher.nodes": cfg.launcher.nodes,
    }
    for key, value in positive.items():
        if value < 1:
            raise ValueError(f"{key}={value} must be >= 1")
    if cfg.mesh.cp < 1:
        raise ValueError(f"mesh.cp={cfg.mesh.cp}; valid: a positive number of context-parallel ranks (1 = no split)")
    for key in ("microbatch_size", "num_microbatches", "virtual_stages"):
        value = getattr(cfg.pipeline, key)
        if value is not None and value < 1:
            raise ValueError(f"pipeline.{key}={value} must be >= 1 (or null)")
    for key in ("gpus_per_node", "signal_seconds", "max_requeues"):
        if getattr(cfg.launcher, key) < 0:
            raise ValueError(f"launcher.{key}={getattr(cfg.launcher, key)} must be >= 0")
    if cfg.launcher.master_port is not None and not 1 <= cfg.launcher.master_port <= 65535:
        raise ValueError(f"launcher.master_port={cfg.launcher.master_port} must be a port, 1..65535 (or null: "
                         f"{MASTER_PORT_BASE} + the job id % {MASTER_PORT_BASE})")
    if cfg.launcher.cpus_per_task is not None and cfg.launcher.cpus_per_task < 1:
        raise ValueError(f"launcher.cpus_per_task={cfg.launcher.cpus_per_task} must be >= 1 (or null)")
    if not isinstance(cfg.launcher.env, (dict, type(None))):  # an interpolation that resolved to a scalar
        raise ValueError(f"launcher.env={cfg.launcher.env!r} is not valid; expected a mapping, e.g. {{A: 1}} (or null)")
    for name, value in (cfg.launcher.env or {}).items():
        if SECRET_NAME.search(str(name)) and value is not None:
            raise ValueError(f"launcher.env.{name} has a value; secrets are passed by name only: export {name} in "
                             f"the shell that runs qwenft and set launcher.env.{name}=null")
    if cfg.mesh.fsdp_prefetch < 0:
        raise ValueError(f"mesh.fsdp_prefetch={cfg.mesh.fsdp_prefetch} must be >= 0 (0 = FSDP2's implicit "
                         f"prefetching, N = all-gather N units ahead)")
    if cfg.mesh.dp == 0 or cfg.mesh.dp < -1:
        raise ValueError(f"mesh.dp={cfg.mesh.dp} must be >= 1, or -1 to infer it from the world size")
    if cfg.train.max_steps is None and cfg.train.epochs is None:
        raise ValueError("train.max_steps and train.epochs are both null; set one of them")
    if cfg.train.max_steps is not None and cfg.train.epochs is not None:
        raise ValueError(f"train.epochs={cfg.train.epochs} has no effect while train.max_steps={cfg.train.max_steps} "
                         f"is set; add train.max_steps=null")
    if cfg.train.epochs is not None and cfg.train.epochs <= 0:
        raise ValueError(f"train.epochs={cfg.train.epochs} must be > 0")
    if cfg.train.max_steps is not None and cfg.train.max_steps < 1:
        raise ValueError(f"train.max_steps={cfg.train.max_steps} must be >= 1 (or null with train.epochs)")
    if cfg.lr_scheduler.warmup_steps < 0:
        raise ValueError(f"lr_scheduler.warmup_steps={cfg.lr_scheduler.warmup_steps} must be >= 0")
    if not 0 <= cfg.lr_scheduler.min_lr_ratio <= 1:  # below 0 the lr turns negative: gradient ascent
        raise ValueError(f"lr_scheduler.min_lr_ratio={cfg.lr_scheduler.min_lr_ratio} must be in [0, 1] (the final lr "
                         "as a fraction of optim.lr)")
    if cfg.model.num_layers is not None and cfg.model.num_layers < 1:
        raise ValueError(f"model.num_layers={cfg.model.num_layers} must be >= 1 (or null for all layers)")
    if cfg.data.num_proc is not None and cfg.data.num_proc < 1:
        raise ValueError(f"data.num_proc={cfg.data.num_proc} must be >= 1 (or null for this machine's cores)")
    if cfg.data.num_workers < 0:
        raise ValueError(f"data.num_workers={cfg.data.num_workers} must be an integer >= 0 (threads making micro "
                         "batches ahead; 0 = make each in the training process when it is needed)")
    if cfg.data.sources and cfg.data.path not in ("???", "tiny"):
        raise ValueError(f"data.path={cfg.data.path} and data.sources are both set; a mixture lists every "
                         f"dataset in data.sources: move data.path into it, or drop data.sources")
    for i, source in enumerate(cfg.data.sources):
        if not source.weight > 0:
            raise ValueError(f"data.sources[{i}].weight={source.weight} must be > 0")
        if source.format not in SOURCE_FORMATS:
            raise ValueError(f"data.sources[{i}].format={source.format!r} is not valid; choose one of "
                             f"{', '.join('null' if f is None else f for f in SOURCE_FORMATS)}")
    image = cfg.data.image
    for key in ("min_pixels", "max_pixels", "max_image_bytes"):
        value = getattr(image, key)
        if value is not None and value < 1:
            raise ValueError(f"data.image.{key}={value} must be >= 1")
    if image.min_pixels and image.max_pixels and image.min_pixels > image.max_pixels:
        raise ValueError(f"data.image.min_pixels={image.min_pixels} is above data.image.max_pixels={image.max_pixels}")
    video = cfg.data.video
    for key in ("min_pixels", "max_pixels", "min_frames", "max_frames"):
        value = getattr(video, key)
        if value is not None and value < 1:
            raise ValueError(f"data.video.{key}={value} must be >= 1 (or null for the checkpoint's)")
    if video.max_video_bytes < 1:
        raise ValueError(f"data.video.max_video_bytes={video.max_video_bytes} must be >= 1")
    if video.fps is not None and not video.fps > 0:
        raise ValueError(f"data.video.fps={video.fps} must be > 0 (or null for the checkpoint's)")
    for low, high in (("min_pixels", "max_pixels"), ("min_frames", "max_frames")):
        a, b = getattr(video, low), getattr(video, high)
        if a and b and a > b:
            raise ValueError(f"data.video.{low}={a} is above data.video.{high}={b}")
    if cfg.checkpoint.every_steps < 0:
        raise ValueError(f"checkpoint.every_steps={cfg.checkpoint.every_steps} must be >= 0 (0 = never)")
    if cfg.checkpoint.keep < 1:
        raise ValueError(f"checkpoint.keep={cfg.checkpoint.keep} must be >= 1")
    if cfg.checkpoint.keep_best:
        ckpt_every, eval_every = cfg.checkpoint.every_steps, cfg.eval.every_steps
        if not ckpt_every or not eval_every or ckpt_every % eval_every:
            raise ValueError(f"checkpoint.keep_best=true needs a val_loss at every checkpoint: checkpoint.every_steps="
                             f"{ckpt_every} must be > 0 and a multiple of eval.every_steps={eval_every} (> 0)")
    if not cfg.checkpoint.resume:
        raise ValueError(f"checkpoint.resume={cfg.checkpoint.resume!r} is not valid; "
                         f"use auto, none or a path to a step-NNNNNN dir")
    if cfg.eval.every_steps < 0:
        raise ValueError(f"eval.every_steps={cfg.eval.every_steps} must be >= 0 (0 = never)")
    if not cfg.eval.every_steps and (cfg.eval.dataset is not None or cfg.eval.max_batches is not None):
        key, value = ("eval.dataset", cfg.eval.dataset) if cfg.eval.dataset is not None else \
            ("eval.max_batches", cfg.eval.max_batches)
        raise ValueError(f"{key}={value} has no effect while eval.every_steps=0 (never); set eval.every_steps=N for a "
                         f"validation loss every N steps and at the end, or {key}=null")
    if cfg.eval.every_steps and cfg.eval.dataset is None:
        raise ValueError(f"eval.every_steps={cfg.eval.every_steps} needs a validation set; set eval.dataset "
                         f"(\"tiny\" or a path like data.path) or eval.every_steps=0")
    if cfg.eval.max_batches is not None and cfg.eval.max_batches < 1:
        raise ValueError(f"eval.max_batches={cfg.eval.max_batches} must be >= 1 (or null for the whole set)")
    if len(cfg.optim.betas) != 2 or not all(isinstance(b, (int, float)) for b in cfg.optim.betas):
        raise ValueError(f"optim.betas={list(cfg.optim.betas)} must be two numbers, e.g. [0.9,0.95]")
    size = cfg.pipeline.microbatch_size
    if size is not None and size != cfg.train.micro_batch_size:
        raise ValueError(f"pipeline.microbatch_size={size} and train.micro_batch_size={cfg.train.micro_batch_size} "
                         f"disagree; they are one setting (sequences per microbatch): set train.micro_batch_size={size} "
                         f"and leave pipeline.microbatch_size=null")
    if not cfg.optim.lr > 0:  # torch refuses it only once the model is built, without naming the key
        raise ValueError(f"optim.lr={cfg.optim.lr} must be > 0")
    if not 0 <= cfg.optim.betas[0] < 1 or not 0 <= cfg.optim.betas[1] < 1:
        raise ValueError(f"optim.betas={list(cfg.optim.betas)} must each be in [0, 1)")
    if not cfg.optim.max_grad_norm >= 0:
        raise ValueError(f"optim.max_grad_norm={cfg.optim.max_grad_norm} must be >= 0 (0 = no clipping)")
    if not cfg.optim.eps >= 0 or not cfg.optim.weight_decay >= 0:
        raise ValueError(f"optim.eps={cfg.optim.eps} and optim.weight_decay={cfg.optim.weight_decay} must be >= 0")
    if cfg.plan.gpu_memory_gib <= 0:
        raise ValueError(f"plan.gpu_memory_gib={cfg.plan.gpu_memory_gib} must be > 0")
    if cfg.plan.image_patches is not None and cfg.plan.image_patches < 1:
        raise ValueError(f"plan.image_patches={cfg.plan.image_patches} must be >= 1 (or null)")
    if cfg.plan.videos < 0:
        raise ValueError(f"plan.videos={cfg.plan.videos} must be >= 0")
    _validate_memory_options(cfg)
    _validate_peft(cfg)


def _validate_peft(cfg: Config) -> None:
    peft = cfg.peft
    frozen = [f"model.{key}={str(getattr(cfg.model, key)).lower()}" for key, default in (
        ("freeze_vision", False), ("freeze_projector", None), ("freeze_language", False))
        if getattr(cfg.model, key) != default]
    if peft.method != "none" and frozen:
        raise ValueError(f"{', '.join(frozen)} with peft={peft.method}: LoRA freezes the whole base and trains the "
                         f"adapters peft.* places (peft.vision for the vision tower's); drop model.freeze_*")
    if peft.rank < 1:
        raise ValueError(f"peft.rank={peft.rank} must be >= 1")
    if peft.alpha <= 0:
        raise ValueError(f"peft.alpha={peft.alpha} must be > 0")
    if not 0 <= peft.dropout < 1:
        raise ValueError(f"peft.dropout={peft.dropout} must be in [0, 1)")
    if peft.method != "none" and peft.dropout and peft.vision and cfg.mesh.cp > 1:
        # dropout's masks are drawn per cp rank, and each cp rank runs the vision tower on all of a row's images
        raise ValueError(f"peft.dropout={peft.dropout} with peft.vision=true and mesh.cp={cfg.mesh.cp}: each cp rank "
                         f"runs the vision tower on every image, and would drop other inputs of it; set "
                         f"peft.dropout=0, peft.vision=false or mesh.cp=1")
    targets = [peft.target_modules] if isinstance(peft.target_modules, str) else peft.target_modules
    if not isinstance(targets, (list, tuple)) or not targets or not all(isinstance(t, str) and t for t in targets):
        raise ValueError(f"peft.target_modules={peft.target_modules!r} must be all-linear or a list of module names "
                         f"or regexes, e.g. [q_proj,in_proj_qkv]")


def _validate_memory_options(cfg: Config) -> None:
    if cfg.model.ce_chunk_tokens < 0:
        raise ValueError(f"model.ce_chunk_tokens={cfg.model.ce_chunk_tokens} must be >= 0 (0 = off)")
    if cfg.optim.master_dtype == "bfloat16" and cfg.model.dtype == "float32":
        raise ValueError("model.dtype='float32' would compute with fp32 copies of the bf16 weights that "
                         "optim.master_dtype=bfloat16 keeps; set model.dtype=auto or bfloat16")
    low = [f"optim.{k}=bfloat16" for k in ("state_dtype", "master_dtype") if getattr(cfg.optim, k) == "bfloat16"]
    if low and cfg.optim.fused == "true":
        raise ValueError(f"optim.fused=true is torch's fused AdamW, which has no bf16 state or stochastic rounding "
                         f"({', '.join(low)}); set optim.fused=auto")
