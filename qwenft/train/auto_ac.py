"""`model.activation_checkpointing=auto`: the cheapest mode the memory plan fits on every rank.

Each rank plans its own share (qwenft.train.plan, the numbers `qwenft plan` prints for it) under every mode of
`plan.AC_BY_COST`, from its model parts built on the meta device with checkpointing off; one all-reduce takes the
highest peak per mode over the ranks and the smallest memory limit. The run then builds with the first mode, in
order of recompute cost, whose highest peak stays under (1 - `plan.AC_MARGIN`) of the limit: off when the whole
run fits, else selective, full_attention, linear_attention, every layer. The limit is the smaller of the GPU's
memory and `plan.gpu_memory_gib`; off the GPU (CPU runs, tests) it is `plan.gpu_memory_gib`, which the plan takes
for the GPU it plans for. The plan is always the GPU's (bf16 compute), whatever device this run has.
"""

import copy
import logging

import torch
import torch.distributed as dist

from qwenft.conf.schema import Config
from qwenft.train import plan

log = logging.getLogger("qwenft")

AUTO = "auto"


def with_mode(cfg: Config, mode: str) -> Config:
    """A copy of `cfg` with model.activation_checkpointing=`mode`."""
    out = copy.deepcopy(cfg)
    out.model.activation_checkpointing = mode
    return out


def memory_limit_gib(cfg: Config, device: torch.device) -> tuple[float, str]:
    """(GiB, what it is): the smaller of this GPU's memory and plan.gpu_memory_gib, or the latter off the GPU."""
    if device.type != "cuda":
        return cfg.plan.gpu_memory_gib, f"plan.gpu_memory_gib={cfg.plan.gpu_memory_gib:g} (no GPU here)"
    gpu = torch.cuda.get_device_properties(device).total_memory / plan.GIB
    if gpu < cfg.plan.gpu_memory_gib:
        return gpu, f"this GPU's {gpu:.1f} GiB (below plan.gpu_memory_gib={cfg.plan.gpu_memory_gib:g})"
    return cfg.plan.gpu_memory_gib, f"plan.gpu_memory_gib={cfg.plan.gpu_memory_gib:g} (this GPU has {gpu:.1f} GiB)"


def rank_mode_peaks(cfg: Config, model_cfg, layout, mesh) -> dict[str, int]:
    """This rank's planned peak (bytes) under each mode of AC_BY_COST, from its share built on `mesh` (meta, no
    collective) with checkpointing off: the modes differ only in the activations the plan counts."""
    from qwenft.train.build import build_model_parts
    from qwenft.train.spec import resolve_spec

    plain = with_mode(cfg, "false")
    spec = resolve_spec(plain, layout, model_cfg, "cuda")
    coords = {name: mesh[name].get_local_rank() for name in ("pp", "dp", "tp")}
    parts = build_model_parts(plain, model_cfg, spec, mesh)
    return plan.rank_plan(plain, model_cfg, spec, dist.get_rank(), coords, parts).ac_mode_peaks


def choose(worst: dict[str, int], limit_gib: float, cuda_graphs: bool) -> str | None:
    """The first usable mode whose highest peak stays under (1 - AC_MARGIN) x `limit_gib`, or None."""
    return plan.first_fitting(worst, limit_gib, plan.usable_ac_modes(cuda_graphs))


def fallback(cfg: Config) -> str:
    """The mode when none fits: the least memory there is (off under CUDA graphs, which take nothing else)."""
    return "false" if cfg.model.cuda_graphs else plan.AC_BY_COST[-1]


def planned(cfg: Config) -> tuple[Config, list, str | None]:
    """`qwenft plan`'s prediction of `cfg`; with auto, of the mode a run would choose against
    plan.gpu_memory_gib (the GPU the plan is for), with a line saying which (else None)."""
    if cfg.model.activation_checkpointing != AUTO:
        return cfg, plan.predict(cfg), None
    plans = plan.predict(with_mode(cfg, "false"))
    worst = {m: max(p.ac_mode_peaks[m] for p in plans) for m in plan.AC_BY_COST}
    chosen = choose(worst, cfg.plan.gpu_memory_gib, cfg.model.cuda_graphs)
    mode = chosen or fallback(cfg)
    resolved = with_mode(cfg, mode)
    if mode != "false":
        plans = plan.predict(resolved)
    note = (f"model.activation_checkpointing=auto: a run chooses {mode}" if chosen else
            f"model.activation_checkpointing=auto: {plan.no_mode_fits(cfg.model.cuda_graphs)}; a run would warn and "
            f"use {mode}")
    return resolved, plans, note


def resolve(cfg: Config, model_cfg, layout, mesh, device: torch.device) -> Config:
    """`cfg` with model.activation_checkpointing=auto replaced by the mode the plan chooses, the same on every
    rank; logs the choice and its numbers. Needs the run's process group (one all-reduce of six numbers)."""
    peaks = rank_mode_peaks(cfg, model_cfg, layout, mesh)
    limit, what = memory_limit_gib(cfg, device)
    on = device if device.type == "cuda" else torch.device("cpu")
    worst = torch.tensor([peaks[m] for m in plan.AC_BY_COST], dtype=torch.float64, device=on)
    # one MAX all-reduce: the peaks, and the negated limit for the smallest one
    shared = torch.cat([worst, torch.tensor([-limit], dtype=torch.float64, device=on)])
    dist.all_reduce(shared, op=dist.ReduceOp.MAX)
    worst_by_mode = {m: int(v) for m, v in zip(plan.AC_BY_COST, shared[:-1].tolist())}
    limit = -shared[-1].item()
    chosen = choose(worst_by_mode, limit, cfg.model.cuda_graphs)
    summary = plan.modes_summary(worst_by_mode, limit, what)
    if chosen is None:
        chosen = fallback(cfg)
        log.warning("activation checkpointing: model.activation_checkpointing=auto found no mode %s. Running with "
                    "%s%s, which may run out of memory: see qwenft plan", summary, chosen,
                    " (model.cuda_graphs=true takes no other)" if cfg.model.cuda_graphs else "")
    else:
        log.info("activation checkpointing: model.activation_checkpointing=auto chose %s, the cheapest mode %s%s",
                 chosen, summary, "; model.cuda_graphs=true takes off only" if cfg.model.cuda_graphs else "")
    return with_mode(cfg, chosen)
