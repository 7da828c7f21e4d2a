"""`qwenft plan`: GPU memory per rank of a recipe, from every rank's real share of the model; no GPU needed.

    plans = predict(cfg)                  # one RankPlan per rank of mesh.tp x mesh.pp x mesh.dp
    print(format_table(plans, cfg))

Each rank's share is built the way `qwenft train` builds it (`build.build_model_parts`: pipeline stage split,
tensor parallel plan, activation checkpointing, FSDP2 `fully_shard`), on the meta device, in this one process
playing every rank in turn on a fake process group. Parameters, gradients and optimizer state are read from
those modules: local DTensor shards, FSDP's padded shards, its units and its mixed-precision dtypes.
With peft=lora only the adapters are trained: the frozen base counts its compute-dtype shards and their gathered
copies, with no gradient and no optimizer state. Activations and logits are estimated per token from the model's
dims (qwenft.train.activations), times the microbatches a rank holds under the schedule (`microbatches_in_flight`).
docs/performance.md ("Memory planner") says what is counted, how it compares with measured peaks, and where it
is approximate.
"""

import dataclasses
import math
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from qwenft.conf.schema import Config
from qwenft.models.qwen3_5.configs import FULL_ATTENTION
from qwenft.train.activations import (layer_activation_bytes, layer_matmul_output_bytes, logits_bytes,
                                      microbatches_in_flight, vision_activation_bytes)
from qwenft.train.spec import RunSpec

GIB = 2**30


@dataclass
class RankPlan:
    """Bytes one rank holds at its peak, by kind. Both settings of the gradient knob
    (pipeline.reduce_grad_per_microbatch) and of activation checkpointing are given; `total` is the peak for
    the config's own settings (the larger of the loss moment and the end of a backward, see `_rank_plan`)."""
    rank: int
    pp_rank: int
    dp_rank: int
    tp_rank: int
    stages: list[int]
    layers: int
    params: int  # elements of the parameter shards this rank stores
    params_owned: int  # the same, counting tensor-parallel replicas on tp rank 0 only (sums to the model's size)
    expert_params: int  # of `params`, the MoE layers' routed experts (experts.gate_up_proj, experts.down_proj)
    trainable: int
    param_bytes: int  # sharded parameters in their storage dtype, FSDP's padding included
    unsharded_bytes: dict  # compute-dtype parameters FSDP holds all-gathered: knob_off (all), knob_on (in flight:
    # the root + the largest run of adjacent units, the one running and the 1 or mesh.fsdp_prefetch prefetched)
    grad_bytes: dict  # knob_off: full-size unsharded accumulator (reduce dtype); knob_on: sharded gradients
    grad_in_flight_bytes: dict  # compute-dtype gradients alive during a backward (FSDP root + its largest unit)
    optimizer_bytes: int
    activation_bytes: dict  # ac_off, ac_on (`ac_mode`): all microbatches in flight (+ one layer's recompute with AC)
    logits_bytes: int  # lm_head logits + cross-entropy (the rank holding the last stage)
    microbatches_in_flight: int
    peaks: dict = field(default_factory=dict)  # {"knob_off"|"knob_on": {"ac_off"|"ac_on": bytes}}
    total_bytes: int = 0
    # the peak at the config's knob for each model.activation_checkpointing mode, cheapest first (AC_BY_COST)
    ac_mode_peaks: dict = field(default_factory=dict)


# ---------------------------------------------------------------- activation estimate (per token)

@dataclass
class _Param:
    """One FSDP-managed parameter of a rank as FSDP holds it (sizes in elements)."""
    unit: tuple  # (stage, "root" | "embed_tokens" | "layers.<i>" | "head"): the FSDP unit that all-gathers it
    storage: torch.dtype
    compute: torch.dtype
    reduce: torch.dtype
    local: int  # this rank's shard
    padded: int  # the shard with FSDP's dim-0 padding: what is allocated
    unsharded: int  # after the all-gather (tensor-parallel local); padded_unsharded with FSDP's padding
    padded_unsharded: int
    unsharded_grad: int  # the gradient autograd gives the unsharded parameter
    trainable: bool
    tp_replica: bool  # the same values on every tp rank
    expert: bool  # a routed-expert weight of an MoE layer ([experts, ...])


def _fsdp_params(stage: int, module: torch.nn.Module) -> list[_Param]:
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.tensor import Replicate

    from qwenft.distributed.fsdp import param_groups
    from qwenft.models.qwen3_5.moe import Experts

    experts = {id(p) for m in module.modules() if isinstance(m, Experts) for p in m.parameters()}
    out, seen, managed = [], set(), set()
    for name, m in module.named_modules():
        # fully_shard([norm, lm_head]) (fsdp.edge_units) makes both FSDPModules of one state: count it once
        if not isinstance(m, FSDPModule) or id(state := fully_shard.state(m)) in seen:
            continue
        seen.add(id(state))
        unit = (stage, _unit_name(name))
        for group in param_groups(state):
            policy, dp = group.mp_policy, group.mesh_info.shard_mesh_size
            for fp in group.fsdp_params:
                p = fp.sharded_param
                compute = policy.param_dtype if policy.param_dtype and p.dtype.is_floating_point else p.dtype
                names = p.device_mesh.mesh_dim_names or ()
                tp_replica = "tp" not in names or isinstance(p.placements[names.index("tp")], Replicate)
                padded, unsharded = math.prod(fp.padded_sharded_param_size), math.prod(fp._orig_size)
                out.append(_Param(unit, p.dtype, compute, policy.reduce_dtype or compute, p.to_local().numel(),
                                  padded, unsharded, padded * dp, unsharded, p.requires_grad, tp_replica,
                                  id(p) in experts))
                managed.add(id(p))
    # what FSDP leaves out (all of it on one rank, spec.uses_fsdp; the experts of a one-rank expert group,
    # fsdp.apply_fsdp) is held as without FSDP
    return out + [_plain_param(stage, name, p, id(p) in experts) for name, p in module.named_parameters()
                  if id(p) not in managed]


def _plain_param(stage: int, name: str, p: torch.nn.Parameter, expert: bool) -> _Param:
    """A parameter without FSDP: stored, computed and its gradient accumulated in its own dtype, never
    gathered (no second copy: `padded_unsharded` 0), its gradient the size of this rank's (tensor parallel) shard."""
    from torch.distributed.tensor import DTensor, Replicate

    local = p.to_local().numel() if isinstance(p, DTensor) else p.numel()
    tp_replica = not isinstance(p, DTensor) or all(isinstance(pl, Replicate) for pl in p.placements)
    return _Param((stage, _unit_name(name.rsplit(".", 1)[0])), p.dtype, p.dtype, p.dtype, local, local, local, 0,
                  local, p.requires_grad, tp_replica, expert)


def _unit_name(module_name: str) -> str:
    """The FSDP unit of an FSDP module, by its name: a decoder layer (GDN's fp32 decay units inside a layer
    count as the layer's), the embedding, the head (final norm + lm_head, `fsdp.edge_units`) or the root. The MTP
    head's units (model.mtp=train|head) count as the head's: they are gathered around the loss, as it is."""
    if module_name.startswith("mtp"):
        return "head"
    if module_name.startswith("layers."):
        return ".".join(module_name.split(".")[:2])
    return {"embed_tokens": "embed_tokens", "norm": "head", "lm_head": "head"}.get(module_name, "root")


def _nbytes(n: int, dtype: torch.dtype) -> int:
    return n * dtype.itemsize


# ---------------------------------------------------------------- one rank

@dataclass
class _Context:
    """What every rank of the plan shares: the specs `qwenft train` would run with (qwenft.train.spec)."""
    cfg: Config
    model_cfg: object
    spec: RunSpec

    @property
    def layout(self):
        return self.spec.layout

    @property
    def compute_bytes(self) -> int:  # element size of activations: FSDP's param dtype
        return self.spec.dtypes.compute.itemsize

    @property
    def tokens(self) -> int:
        """A microbatch's tokens on one rank: its span of the stream under context parallel."""
        return -(-self.spec.batching.microbatch_size * self.cfg.data.seq_len // self.layout.cp)


def ac_mode(cfg: Config) -> str:
    """The activation checkpointing mode of the plan's "AC on" numbers: the config's, or true when it has none."""
    return "true" if cfg.model.activation_checkpointing == "false" else cfg.model.activation_checkpointing


# model.activation_checkpointing's modes by the compute their recompute costs: none; the elementwise ops of every
# layer (matmul outputs kept); the full-attention layers (1 in 4); the GatedDeltaNet layers (3 in 4); every layer
AC_BY_COST = ("false", "selective", "full_attention", "linear_attention", "true")


def _stage_activations(ctx: _Context, module, mode: str | None = None) -> tuple[float, float, float]:
    """One microbatch through one stage: (AC off, AC on (`mode`, default `ac_mode`), the biggest checkpointed
    layer's activations, which its recompute holds in the backward)."""
    t, c, tp, sp = ctx.model_cfg.text, ctx.compute_bytes, ctx.layout.tp, ctx.cfg.mesh.sequence_parallel
    mode, tokens = mode or ac_mode(ctx.cfg), ctx.tokens
    layer_input = c * t.hidden_size / (tp if sp else 1)  # what a checkpointed layer keeps
    off = on = recompute = 0.0
    # context parallel: a full-attention layer keeps the keys and values it gathered from the other spans
    gathered = 2 * c * t.num_key_value_heads // tp * t.head_dim * tokens * (ctx.layout.cp - 1)
    for layer in module.decoder_layers():  # the MTP head's layer too
        kind = layer.layer_type
        full = layer_activation_bytes(t, kind, tp, c, sp) * tokens + (gathered if kind == FULL_ATTENTION else 0)
        off += full
        if mode == "selective":
            on += (layer_input + layer_matmul_output_bytes(t, kind, tp, c)) * tokens
        elif mode in ("true", kind):
            on += layer_input * tokens
        else:  # a layer of the kind not checkpointed keeps everything
            on += full
            continue
        recompute = max(recompute, full)
    boundary = 2 * c * t.hidden_size * tokens  # the stage's input and output hidden states
    if getattr(module, "mtp", None) is not None:  # the head's inputs: next-token embeddings, fc's input, three norms
        head = (c * t.hidden_size * 3 + 3 * 8 * t.hidden_size) * tokens
        off, on = off + head, on + head
    vision_off, vision_on = _vision_activations(ctx, module)
    return off + boundary + vision_off, on + boundary + vision_on, recompute


def _vision_activations(ctx: _Context, module) -> tuple[float, float]:
    """(AC off, AC on) vision tower activations of one microbatch; 0 without a tower or when it is frozen.
    Patches per sequence: plan.image_patches + plan.videos x the most patches one video can make (its pixel
    budget, an odd frame count padded, the checkpoint's per-frame cap: `budget_patches`), at most every token a
    vision token (seq_len x merge^2, also the default when neither is set). A video's patches
    cost what an image's do: the same blocks, attention within each frame pair."""
    from qwenft.models.freeze import VISION_PROJECTOR

    visual, vision = getattr(module, "visual", None), ctx.model_cfg.vision
    if visual is None:
        return 0.0, 0.0
    cfg = ctx.cfg
    patches = cfg.data.seq_len * vision["spatial_merge_size"] ** 2
    if cfg.plan.image_patches or cfg.plan.videos:
        from qwenft.data.video import budget_patches

        source = cfg.data.tokenizer or cfg.model.path or "tiny_vlm"
        v = cfg.data.video
        videos = cfg.plan.videos * budget_patches(source, v.max_pixels, v.min_pixels, v.max_frames) \
            if cfg.plan.videos else 0
        patches = min(patches, (cfg.plan.image_patches or 0) + videos)
    patches *= ctx.spec.batching.microbatch_size
    trained = {n.startswith(f"{VISION_PROJECTOR}.") for n, p in visual.named_parameters() if p.requires_grad}
    c = ctx.compute_bytes
    if False in trained:  # the tower's blocks train, not only its merger
        checkpointed = ctx.cfg.model.vision_activation_checkpointing
        return (vision_activation_bytes(vision, c) * patches,
                vision_activation_bytes(vision, c, checkpointing=checkpointed) * patches)
    merger = 3 * c * vision["hidden_size"] * patches if trained else 0.0
    return merger, merger


def _logits(ctx: _Context, modules, chunks: int) -> tuple[int, int, int]:
    """On a rank holding the last stage, (logits + CE at the loss of one microbatch plus what the other
    microbatches in flight keep, what those others keep, the logits as lm_head writes them); else zeros."""
    if not any(m.lm_head is not None for _, m in modules):
        return 0, 0, 0
    cfg, t, tp, pp = ctx.cfg, ctx.model_cfg.text, ctx.layout.tp, ctx.layout.pp
    schedule, n = ctx.spec.parallel.schedule, ctx.spec.batching.num_microbatches
    vocab_parallel = tp > 1 and cfg.mesh.vocab_parallel
    vocab = -(-t.vocab_size // tp) if vocab_parallel else t.vocab_size
    peak, held = logits_bytes(vocab, ctx.tokens, ctx.compute_bytes, vocab_parallel=vocab_parallel,
                              pipelined=pp > 1, ce_chunk_tokens=cfg.model.ce_chunk_tokens,
                              fused_hidden=t.hidden_size if ctx.spec.parallel.ce_kernel == "fused" else 0)
    if pp == 1 or schedule in ("1f1b", "zbv", "dualpipev"):
        head_chunks = 1  # the last stage runs each microbatch's backward right after its forward
    elif schedule in ("gpipe", "looped_bfs"):
        head_chunks = n
    else:
        head_chunks = -(-chunks // ctx.spec.parallel.virtual_stages)
    if any(getattr(m, "mtp", None) is not None for _, m in modules):
        # the MTP head's CE runs after the trunk's in the same forward: the first one's kept bytes sit beside it
        peak, held = peak + held, 2 * held
    others = held * (head_chunks - 1)
    written = 0 if ctx.spec.parallel.ce_in_model else ctx.compute_bytes * vocab * ctx.tokens
    return peak + others, others, written


def rank_plan(cfg: Config, model_cfg, spec: RunSpec, rank: int, coords: dict, modules) -> RankPlan:
    """One rank's plan from its model parts (`build.build_model_parts`, meta) and its mesh coordinates
    (pp, dp, tp)."""
    return _rank_plan(_Context(cfg, model_cfg, spec), rank, coords, modules, _rank_params(modules))


def _rank_params(modules) -> list[_Param]:
    return [p for stage, module in modules for p in _fsdp_params(stage, module)]


def _rank_plan(ctx: _Context, rank: int, coords: dict, modules, params: list[_Param]) -> RankPlan:
    cfg, pp, par = ctx.cfg, ctx.layout.pp, ctx.spec.parallel
    t = ctx.model_cfg.text
    moe_layers = sum(len(m.layers) for _, m in modules) if t.is_moe else 0
    # after FSDP's all-gather a rank holds its ep rank's share (1/mesh.ep) of every MoE layer's experts it runs
    assert sum(p.unsharded for p in params if p.expert) * ctx.layout.ep == (
        moe_layers * t.num_experts * 3 * t.moe_intermediate_size * t.hidden_size), "expert weights not all planned"
    trained = [p for p in params if p.trainable]
    units = defaultdict(lambda: {"params": 0, "grads": 0, "cast_grads": 0})
    for p in params:
        unit = units[p.unit]
        unit["params"] += _nbytes(p.padded_unsharded, p.compute)
        if p.trainable:
            unit["grads"] += _nbytes(p.unsharded_grad, p.compute)
            if p.compute != p.reduce:
                unit["cast_grads"] += _nbytes(p.unsharded_grad, p.compute)
    roots = [u for key, u in units.items() if key[1] == "root"]
    root = {key: sum(u[key] for u in roots) for key in ("params", "grads", "cast_grads")}
    # Per stage, the other units in forward order (embedding, layers, head): the backward runs them in reverse,
    # each prefetching the one before it (FSDP2's implicit backward prefetch), or the mesh.fsdp_prefetch
    # units after it in the forward and before it in the backward (fsdp.set_prefetch).
    chains = [[u for key, u in units.items() if key[0] == stage and key[1] != "root"] for stage, _ in modules]
    window = max(2, cfg.mesh.fsdp_prefetch + 1)  # the unit running and those prefetched
    runs = [sum(u["params"] for u in chain[i:i + window]) for chain in chains for i in range(len(chain))]
    # Knob off: every unit stays all-gathered from its first forward to the step's reduce-scatter. On: the
    # root (vision tower; tied embeddings) while the stage runs, plus the `window` units gathered at once.
    unsharded = {"knob_off": sum(u["params"] for u in units.values()),
                 "knob_on": root["params"] + max(runs, default=0)}
    # Compute-dtype gradients alive in a backward: the root's until its post-backward, one unit's at a time.
    # Knob off with compute == reduce dtype, autograd adds them straight into the accumulator.
    grads_in_flight = {knob: root[key] + max((u[key] for chain in chains for u in chain), default=0)
                       for knob, key in (("knob_off", "cast_grads"), ("knob_on", "grads"))}
    # The head's backward follows the loss at once: its unit, the layers it prefetches, and its gradients.
    # Tied embeddings keep the head in the root.
    heads = [chain[-window:] for (stage, _), chain in zip(modules, chains) if (stage, "head") in units]
    head_gathered = root["params"] + max((sum(u["params"] for u in pair) for pair in heads), default=0)
    head_grads = {knob: root[key] + max((pair[-1][key] for pair in heads), default=0)
                  for knob, key in (("knob_off", "cast_grads"), ("knob_on", "grads"))}
    grads = {"knob_off": sum(_nbytes(p.unsharded_grad, p.reduce) for p in trained),
             "knob_on": sum(_nbytes(p.padded, p.storage) for p in trained)}
    state_dtype = getattr(torch, cfg.optim.state_dtype)
    # AdamW: two moments per trained element in optim.state_dtype and a 4-byte step count per tensor
    optimizer = sum(2 * _nbytes(p.local, state_dtype) + 4 for p in trained)
    param_bytes = sum(_nbytes(p.padded, p.storage) for p in params)

    per_stage = [_stage_activations(ctx, m) for _, m in modules]
    chunk = {"ac_off": sum(s[0] for s in per_stage) / len(per_stage),
             "ac_on": sum(s[1] for s in per_stage) / len(per_stage)}
    recompute = {"ac_off": 0.0, "ac_on": max(s[2] for s in per_stage)}  # AC: one layer re-run in the backward
    chunks = microbatches_in_flight(par.schedule, pp, coords["pp"], par.virtual_stages,
                                    ctx.spec.batching.num_microbatches)
    logits, logits_of_others, logits_written = _logits(ctx, modules, chunks)

    # One microbatch a step at pp = 1 (single_pass): its backward reduce-scatters at once and reshards, so the
    # knob off is the knob on: no accumulator, nothing kept gathered
    single_pass = par.single_pass
    if single_pass:
        for per_knob in (grads, unsharded, grads_in_flight, head_grads):
            per_knob["knob_off"] = per_knob["knob_on"]
    if not par.fsdp:  # no FSDP (spec.uses_fsdp): autograd accumulates into .grad whatever the knob says
        for per_knob in (grads, unsharded, grads_in_flight, head_grads):
            per_knob["knob_on"] = per_knob["knob_off"]
    peaks, at_knob = {}, {}
    for knob in ("knob_off", "knob_on"):
        base = param_bytes + optimizer + grads[knob]
        # Knob off nothing is resharded within a step (pipeline.stage.reshard_policy, pp = 1 too); otherwise FSDP
        # holds the root and `window` units while the forward runs, and the head's unit (with the layers it
        # prefetches and the head's gradients) in the head's backward. With model.ce_chunk_tokens the CE and its backward run inside the
        # head's unit; without, the CE runs on the logits after the head has resharded, and the head's backward
        # then holds the logits' gradient (the logits' size).
        kept = unsharded["knob_off"] if knob == "knob_off" and not single_pass else 0
        forward_gathered = kept or unsharded["knob_on"]
        head = (kept or head_gathered) + head_grads[knob] if logits else kept
        at_loss = (head + logits if par.ce_in_model
                   else max(kept + logits, head + logits_written + logits_of_others))

        def peak(chunk_bytes, recompute_bytes, base=base, knob=knob, forward_gathered=forward_gathered,
                 at_loss=at_loss):
            loss_moment = (base + chunks * chunk_bytes
                           + max(forward_gathered + logits_written + logits_of_others, at_loss))
            backward_end = (base + unsharded[knob] + grads_in_flight[knob] + (chunks - 1) * chunk_bytes
                            + recompute_bytes + logits_of_others)
            return round(max(loss_moment, backward_end))

        peaks[knob] = {ac: peak(chunk[ac], recompute[ac]) for ac in ("ac_off", "ac_on")}
        at_knob[knob] = peak
    knob = "knob_on" if par.reduce_grad_per_microbatch else "knob_off"
    ac_mode_peaks = {}
    for mode in AC_BY_COST:  # the same rank under each mode, for `cheapest_ac_mode`
        stages = [_stage_activations(ctx, m, mode) for _, m in modules]
        ac_mode_peaks[mode] = at_knob[knob](sum(s[1] for s in stages) / len(stages),
                                            max(s[2] for s in stages) if mode != "false" else 0.0)
    return RankPlan(
        rank=rank, pp_rank=coords["pp"], dp_rank=coords["dp"], tp_rank=coords["tp"],
        stages=[s for s, _ in modules], layers=sum(len(m.layers) for _, m in modules),
        params=sum(p.local for p in params),
        params_owned=sum(p.local for p in params if not p.tp_replica or coords["tp"] == 0),
        expert_params=sum(p.local for p in params if p.expert),
        trainable=sum(p.local for p in trained), param_bytes=param_bytes, unsharded_bytes=unsharded,
        grad_bytes=grads, grad_in_flight_bytes=grads_in_flight, optimizer_bytes=optimizer,
        activation_bytes={ac: round(chunks * chunk[ac] + recompute[ac]) for ac in chunk},
        logits_bytes=round(logits), microbatches_in_flight=chunks, peaks=peaks,
        total_bytes=peaks[knob][_settings(cfg)[1]], ac_mode_peaks=ac_mode_peaks)


AC_MARGIN = 0.1  # of plan.gpu_memory_gib kept free by `cheapest_ac_mode`: the plan's error and the allocator's slack


def first_fitting(worst: dict[str, int], limit_gib: float, modes=AC_BY_COST) -> str | None:
    """The first of `modes` whose highest planned peak (`worst`, bytes by mode) stays under (1 - AC_MARGIN) x
    `limit_gib`, or None when none does."""
    return next((mode for mode in modes if worst[mode] <= (1 - AC_MARGIN) * limit_gib * GIB), None)


def usable_ac_modes(cuda_graphs: bool) -> tuple[str, ...]:
    """The model.activation_checkpointing modes a run can take, cheapest first: only off under CUDA graphs (their
    replay cannot recompute)."""
    return ("false",) if cuda_graphs else AC_BY_COST


def cheapest_ac_mode(plans: list[RankPlan], limit_gib: float, cuda_graphs: bool = False
                     ) -> tuple[str | None, dict[str, int]]:
    """The cheapest usable model.activation_checkpointing mode (`usable_ac_modes`) whose planned peak on every rank
    stays under (1 - AC_MARGIN) x `limit_gib`, or None when none does; and each mode's highest peak over the ranks."""
    worst = {mode: max(p.ac_mode_peaks[mode] for p in plans) for mode in AC_BY_COST}
    return first_fitting(worst, limit_gib, usable_ac_modes(cuda_graphs)), worst


def no_mode_fits(cuda_graphs: bool) -> str:
    return ("false, the only mode model.cuda_graphs=true takes, does not fit" if cuda_graphs else "no mode fits")


# ---------------------------------------------------------------- every rank

def resolve_plan_layout(cfg: Config):
    """The layout planned: mesh.tp x mesh.pp x mesh.dp, with mesh.dp=-1 (take what the world leaves) as 1, or as
    mesh.ep with expert parallelism (the fewest dp ranks that hold every expert once)."""
    from qwenft.conf.layout import resolve_layout

    dp = cfg.mesh.ep if cfg.mesh.dp == -1 else cfg.mesh.dp
    return resolve_layout(cfg.mesh.tp, cfg.mesh.pp, dp, cfg.mesh.tp * cfg.mesh.pp * cfg.mesh.cp * dp, ep=cfg.mesh.ep,
                          cp=cfg.mesh.cp)


def predict(cfg: Config, share_stages: bool = True) -> list[RankPlan]:
    """The memory of every rank of `cfg` on GPUs (model.dtype=auto: bf16 compute), in rank order.

    Builds each rank's share through `build.build_model_parts` on a fake process group (fake_pg), one
    rank at a time, in this process; needs no GPU and no process group of its own. With `share_stages` (the
    default) a rank whose every parameter shard has the shape of an already built rank of its pipeline stage
    (`plan_share.StageShare.fits`) is planned from that rank's share with its own mesh coordinates instead of
    built again: the ranks of a stage build the same modules and differ only in which rows their shards hold."""
    from qwenft.distributed.fake_pg import fake_process_group
    from qwenft.distributed.mesh import build_mesh
    from qwenft.train import build
    from qwenft.train.plan_share import MeshCoords, StageShare
    from qwenft.train.spec import resolve_spec

    if dist.is_initialized():
        raise RuntimeError("predict plays every rank on a fake process group of its own; call it outside a "
                           "distributed run")
    if cfg.model.activation_checkpointing == "auto":  # the mode a run would choose (qwenft.train.auto_ac)
        from qwenft.train.auto_ac import planned

        return planned(cfg)[1]
    layout = resolve_plan_layout(cfg)
    model_cfg = build.model_config(cfg)
    spec = resolve_spec(cfg, layout, model_cfg, "cuda")  # what the plan is for; nothing is allocated there
    build.check_what_trains(cfg, model_cfg, spec)
    ctx = _Context(cfg, model_cfg, spec)
    plans, shares, names, where = [], defaultdict(list), ("pp", "dp", "tp"), None  # shares: pp rank -> [StageShare]
    for rank in range(layout.world_size):
        if where is not None:
            coords = {name: where.of(mesh_of[name], rank)[0] for name in names}
            share = next((s for s in shares[coords["pp"]] if s.fits(rank)), None)
            if share is not None:
                plans.append(_rank_plan(ctx, rank, coords, share.modules, share.params))
                continue
        with fake_process_group(layout.world_size, rank):
            mesh = build_mesh(layout, device="cpu")
            coords = {name: mesh[name].get_local_rank() for name in names}
            if where is None:  # the first rank's mesh places every other rank
                where, mesh_of = MeshCoords(mesh.mesh), {name: mesh[name] for name in names}
                for sub in mesh_of.values():
                    where.add(sub)
            modules = build.build_model_parts(cfg, model_cfg, spec, mesh)
            params = _rank_params(modules)
            if share_stages:
                shares[coords["pp"]].append(StageShare(modules, params, where))
        plans.append(_rank_plan(ctx, rank, coords, modules, params))
    return plans


# ---------------------------------------------------------------- output

_NUMBERS = ("layers", "params", "param_bytes", "unsharded_bytes", "grad_bytes", "grad_in_flight_bytes",
            "optimizer_bytes", "activation_bytes", "logits_bytes", "microbatches_in_flight", "peaks", "total_bytes")


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 3, 8] -> "0-3,8"."""
    parts, start = [], ranks[0]
    for prev, cur in zip(ranks, ranks[1:] + [None]):
        if cur != prev + 1:
            parts.append(f"{start}-{prev}" if prev > start else str(start))
            start = cur
    return ",".join(parts)


def _settings(cfg: Config) -> tuple[str, str]:
    return ("knob_on" if cfg.pipeline.reduce_grad_per_microbatch else "knob_off",
            "ac_off" if cfg.model.activation_checkpointing == "false" else "ac_on")


def format_table(plans: list[RankPlan], cfg: Config) -> str:
    """A table of GiB per group of ranks with identical numbers, with a header naming the setup."""
    from qwenft.train.spec import resolve_batching, resolve_dtypes

    layout, limit = resolve_plan_layout(cfg), cfg.plan.gpu_memory_gib
    unit, size = ("GiB", GIB) if max(p.total_bytes for p in plans) >= GIB else ("MiB", 2**20)
    knob, ac = _settings(cfg)
    batching, dtypes = resolve_batching(cfg, layout.dp), resolve_dtypes(cfg, "cuda")
    microbatch_size, n = batching.microbatch_size, batching.num_microbatches
    # peft=lora: the frozen base is built in the compute dtype, only the adapters in the master dtype
    params = (f"params {dtypes.master}" if cfg.peft.method == "none"
              else f"frozen base {dtypes.compute}, {cfg.peft.method} adapters {dtypes.master}")
    dtypes = f"{params}, compute {dtypes.compute}, AdamW state {dtypes.state}".replace("torch.", "")
    dp_note = " (mesh.dp=-1 planned as 1)" if cfg.mesh.dp == -1 else ""
    lines = [
        f"qwenft plan {cfg.recipe}: {layout.world_size} rank{'s' if layout.world_size > 1 else ''} = "
        f"pp {layout.pp} x dp {layout.dp}{f' x cp {layout.cp}' if layout.cp > 1 else ''} x tp {layout.tp}"
        f"{dp_note}; {'schedule ' + cfg.pipeline.schedule + ', ' if layout.pp > 1 else ''}{n} microbatches of "
        f"{microbatch_size} x {cfg.data.seq_len} tokens per step",
        f"{dtypes}; pipeline.reduce_grad_per_microbatch={knob == 'knob_on'}, "
        f"model.activation_checkpointing={cfg.model.activation_checkpointing}; {unit} per rank, "
        f"limit plan.gpu_memory_gib={limit:g}",
        "",
    ]
    head = ["ranks", "stage", "layers", "params", "param", "gathered", "grad knob off", "grad knob on", "optim",
            "act AC off", f"act AC {ac_mode(cfg)}", "logits", "total", ""]
    groups: dict = {}
    for plan in plans:
        key = tuple(str(getattr(plan, k)) for k in _NUMBERS) + (str(plan.stages),)
        groups.setdefault(key, []).append(plan)
    rows = []
    for members in groups.values():
        p = members[0]
        gib = lambda b: f"{b / size:.2f}"  # noqa: E731
        mark = lambda text, on: text + ("*" if on else "")  # noqa: E731
        rows.append([
            _ranges([m.rank for m in members]), ",".join(map(str, p.stages)), str(p.layers),
            f"{p.params / 1e9:.3f}B" if p.params >= 1e8 else f"{p.params / 1e6:.3f}M",
            gib(p.param_bytes), gib(p.unsharded_bytes[knob]),
            mark(gib(p.grad_bytes["knob_off"]), knob == "knob_off"), mark(gib(p.grad_bytes["knob_on"]), knob == "knob_on"),
            gib(p.optimizer_bytes), mark(gib(p.activation_bytes["ac_off"]), ac == "ac_off"),
            mark(gib(p.activation_bytes["ac_on"]), ac == "ac_on"), gib(p.logits_bytes), gib(p.total_bytes),
            "OVER" if p.total_bytes > limit * GIB else ""])
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    for row in [head] + rows:
        lines.append("  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths)))
                     .rstrip())
    worst = max(plans, key=lambda p: p.total_bytes)
    lines += ["", f"* the config's settings; total = its peak: the larger of the loss moment and the end of a "
                  f"backward (docs/performance.md, \"Memory planner\"). Highest: rank {worst.rank}, "
                  f"{worst.total_bytes / size:.2f} {unit} (limit {limit:g} GiB)"
                  + (f"; {sum(p.total_bytes > limit * GIB for p in plans)} rank(s) OVER" if worst.total_bytes > limit * GIB
                     else "")]
    chosen, by_mode = cheapest_ac_mode(plans, limit, cfg.model.cuda_graphs)
    lines.append(f"activation checkpointing: "
                 f"{f'{chosen} is the cheapest mode' if chosen else no_mode_fits(cfg.model.cuda_graphs)} "
                 f"{modes_summary(by_mode, limit, 'the limit')}")
    return "\n".join(lines)


def modes_summary(worst: dict[str, int], limit_gib: float, limit_name: str) -> str:
    """'under <budget> (90% of <limit_name>); highest rank per mode (<unit>), cheapest first: false 1.00, ...', in
    GiB, or MiB when every peak is under 1 GiB."""
    unit, size = ("GiB", GIB) if max(worst.values()) >= GIB else ("MiB", 2**20)
    per_mode = ", ".join(f"{mode} {peak / size:.2f}" for mode, peak in worst.items())
    return (f"under {(1 - AC_MARGIN) * limit_gib * GIB / size:.1f} {unit} ({1 - AC_MARGIN:.0%} of {limit_name}); "
            f"highest rank per mode ({unit}), cheapest first: {per_mode}")


def to_json(plans: list[RankPlan], cfg: Config) -> dict:
    layout = resolve_plan_layout(cfg)
    knob, ac = _settings(cfg)
    return {"recipe": cfg.recipe, "world_size": layout.world_size,
            "layout": {"pp": layout.pp, "dp": layout.dp, "cp": layout.cp, "tp": layout.tp},
            "settings": {"reduce_grad_per_microbatch": knob == "knob_on",
                         "activation_checkpointing": cfg.model.activation_checkpointing, "ac_on_mode": ac_mode(cfg)},
            "gpu_memory_gib": cfg.plan.gpu_memory_gib,
            "over": [p.rank for p in plans if p.total_bytes > cfg.plan.gpu_memory_gib * GIB],
            "cheapest_ac_mode": cheapest_ac_mode(plans, cfg.plan.gpu_memory_gib, cfg.model.cuda_graphs)[0],
            "ranks": [dataclasses.asdict(p) for p in plans]}
