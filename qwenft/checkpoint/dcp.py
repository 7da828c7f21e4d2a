"""Sharded training checkpoints (torch.distributed.checkpoint) and exact resume.

Layout under <run_dir>/checkpoints/:
    step-000010/        model + optimizer, one DCP shard file per rank plus `.metadata`; extra.pt (rank 0):
                        step, scheduler, data stream position and RNG state
    latest              the name of the newest complete step dir, written last

DCP stores each tensor by its parameter name with its global shape, so a checkpoint saved on one mesh
loads on another (dp2 -> dp1); DCP reshards on load.
"""

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

EXTRA = "extra.pt"


def _model_for_dcp(modules: list[torch.nn.Module]) -> torch.nn.Module:
    """get_state_dict takes one module. Several pipeline stages on one rank go in a ModuleList, which
    prefixes their names with the local stage index: such a checkpoint resumes only on the same pipeline
    layout."""
    return modules[0] if len(modules) == 1 else torch.nn.ModuleList(modules)


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def save(ckpt_root: Path, step: int, modules: list[torch.nn.Module], optimizer, scheduler, data,
         keep: int) -> Path:
    """Write step-<step> (collective): to a temp dir, renamed when complete; then `latest`; then prune to
    the newest `keep` dirs. A crash at any point leaves `latest` naming a complete checkpoint."""
    name = f"step-{step:06d}"
    tmp, final = ckpt_root / f".{name}.tmp", ckpt_root / name
    if dist.get_rank() == 0:
        if tmp.exists():  # left by a crash mid-save
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(_model_for_dcp(modules), optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    if dist.get_rank() == 0:
        torch.save({"step": step, "scheduler": scheduler.state_dict(), "data": data.state_dict(),
                    "rng": _rng_state()}, tmp / EXTRA)
        if final.exists():  # the same step saved before a requeue: replace it whole
            shutil.rmtree(final)
        tmp.rename(final)
        latest_tmp = ckpt_root / ".latest.tmp"
        latest_tmp.write_text(name + "\n")
        os.replace(latest_tmp, ckpt_root / "latest")
        for old in sorted(p for p in ckpt_root.glob("step-*") if p.is_dir())[:-keep]:
            shutil.rmtree(old)
    dist.barrier()
    return final


def find(resume: str, ckpt_root: Path) -> Path | None:
    """The checkpoint dir that `checkpoint.resume` names, or None to start fresh."""
    if resume == "none":
        return None
    if resume == "auto":
        latest = ckpt_root / "latest"
        if not latest.exists():
            return None
        path = ckpt_root / latest.read_text().strip()
    else:
        path = Path(resume)
        if not path.is_dir():
            raise ValueError(f"checkpoint.resume={resume} does not exist; give a step-NNNNNN dir, auto or none")
    if not (path / ".metadata").is_file() or not (path / EXTRA).is_file():
        raise ValueError(f"checkpoint {path} is incomplete or corrupt (no .metadata or {EXTRA}); "
                         f"point checkpoint.resume at another step dir or set checkpoint.resume=none")
    return path


def load(path: Path, modules: list[torch.nn.Module], optimizer, scheduler, data) -> int:
    """Restore model, optimizer, scheduler, data position and RNG from `path` (collective); returns the
    step the checkpoint was taken after."""
    model = _model_for_dcp(modules)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    extra = torch.load(path / EXTRA, weights_only=True)
    scheduler.load_state_dict(extra["scheduler"])
    data.load_state_dict(extra["data"])
    torch.set_rng_state(extra["rng"]["cpu"])
    if "cuda" in extra["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state(extra["rng"]["cuda"])
    return extra["step"]
