"""Sharded training checkpoints (torch.distributed.checkpoint) and exact resume, on any mesh.

The checkpoint dir's layout and its readers are in files.py.

Every tensor is stored under the whole model's parameter name (`layers.17.mlp.up_proj.weight`, and
`state.<name>.exp_avg` for AdamW) with its global shape, whatever the mesh: pipeline stages keep the
model's layer indices, TP/FSDP shards are DTensors DCP reassembles, and the optimizer state is flattened by
name. So a checkpoint saved on one mesh (tp2 x pp2, interleaved stages, ...) loads on any other. A LoRA run's
(`peft`) holds only the trained parameters and their optimizer state: the frozen base is rebuilt from model.path
or the seed on resume.
"""

import contextlib
import dataclasses
import json
import logging
import math
import os
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from qwenft.checkpoint.files import (EXTRA, MANIFEST, META, damage, file_records, read_meta, read_pointer,
                                     rotated_away, step_dirs, step_number, write_pointer)

_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)  # keyed by parameter name, not position
# peft runs: only the trained parameters (the frozen base comes from model.path or the seed, as at the start)
_TRAINABLE_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True, ignore_frozen_params=True, strict=False)
# Param-group keys of torch's AdamW that say how this run computes, not what it has trained: on resume the
# run's own values win (a CPU checkpoint resumed on GPU runs fused AdamW; a fused GPU one resumes on CPU).
# lr, betas, eps, weight_decay and the step counts come from the checkpoint.
_IMPLEMENTATION_KEYS = ("foreach", "fused", "capturable", "differentiable")
log = logging.getLogger("qwenft")


class _Stages(nn.Module):
    """Several pipeline stages of one rank as one module with the whole model's parameter names: their decoder
    layers (keyed by model-wide index) in one `layers` dict, embeddings/vision/norm/head from the stage that
    has them. Only for state dicts (no forward): a ModuleList would prefix names with the local stage index,
    which ties a checkpoint to its pipeline layout."""

    def __init__(self, stages: list[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleDict()
        for stage in stages:
            assert not list(stage.parameters(recurse=False)), "stage modules hold parameters only in children"
            for name, child in stage.named_children():
                if name == "layers":
                    assert not set(child.keys()) & set(self.layers.keys()), "stages share a layer"
                    self.layers.update(child)
                elif child is not None and next(child.parameters(), None) is not None:
                    assert name not in self._modules, f"two stages hold {name}"
                    self.add_module(name, child)


def _native_view(modules: list[nn.Module]) -> nn.Module:
    return modules[0] if len(modules) == 1 else _Stages(modules)


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


@dataclass
class _Pending:
    name: str
    val_loss: float | None
    future: object = None  # dcp.async_save's future; None once a synchronous save returned


class SaveError(ValueError):
    """A checkpoint could not be written (disk full, quota, permissions): the line `qwenft train` ends with."""


# What a failing write raises: OSError (ENOSPC, EDQUOT, EACCES, EFBIG), RuntimeError from torch's zip writer
# ("[enforce fail at inline_container.cc:...] unexpected pos ..."), CheckpointException from DCP (every rank's).
_WRITE_ERRORS = (OSError, RuntimeError, CheckpointException)


def _on_rank0(fn: Callable[[], None]) -> None:
    """fn on rank 0, its write failure raised on every rank (collective), so no rank waits in the save's next
    collective for one that has stopped."""
    error = [None]
    if dist.get_rank() == 0:
        try:
            fn()
        except _WRITE_ERRORS as e:
            error = [e]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(error, src=0)
    if error[0] is not None:
        raise error[0]


def _interrupted(e: BaseException) -> bool:
    """A Ctrl-C inside DCP's write, which DCP reports as a CheckpointException like a failure."""
    return isinstance(e, CheckpointException) and any(isinstance(exc, KeyboardInterrupt)
                                                      for exc, _ in e.failures.values())


def _cause(e: BaseException) -> str:
    """The write failure in a few words: DCP's first failing rank's error, a file fault with its file."""
    if isinstance(e, CheckpointException):
        _, (e, _) = min(e.failures.items())
    if isinstance(e, OSError):
        return f"{e.strerror or e}" + (f": {e.filename}" if e.filename else "")
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def free_bytes(path: Path) -> int:
    """Free bytes on the filesystem that holds `path` (or would: its nearest existing parent)."""
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def size_text(n: int) -> str:
    for unit, name in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB")):
        if n >= unit:
            return f"{n / unit:.2f} {name}"
    return f"{n} bytes"


class Checkpointer:
    """Saves and loads one run's train state; with `async_save`, a save's files are written in the background
    while training goes on, and `latest` (and `best`) name it only once all of them are on disk. `guard`: a context
    manager around the renames and deletions that publish a checkpoint (the runner's defers a second Ctrl-C)."""

    def __init__(self, root: Path, modules: list[nn.Module], optimizer, scheduler, data, model_config,
                 keep: int, keep_best: bool = False, async_save: bool = False, optim_dtypes: dict | None = None,
                 peft: dict | None = None, data_meta: dict | None = None, guard: Callable = contextlib.nullcontext):
        self.root, self.optimizer, self.scheduler, self.data = root, optimizer, scheduler, data
        self.model = _native_view(modules)
        self.model_config, self.optim_dtypes = model_config, optim_dtypes
        self.peft = peft  # what is trained (checked on resume): None = full finetuning
        self.data_meta = data_meta  # what the data position depends on (checked on resume: qwenft.train.resume)
        self.options = _OPTIONS if peft is None else _TRAINABLE_OPTIONS
        self.keep, self.keep_best, self.guard = keep, keep_best, guard
        self.pending: _Pending | None = None
        self.resumed_step: int | None = None  # `load` from this run's dir: the first save deletes every step above
        self.resumed_here = False  # `load` from a step dir of this run's dir
        self.skipped_steps = 0  # train.on_nonfinite=skip's count up to the checkpoint loaded (`load`)
        self._bytes: int | None = None
        # DCP's background writer runs collectives; on the training group they would interleave with the
        # training step's. A CPU group of its own also serves NCCL runs (async_save needs gloo).
        self.async_group = dist.new_group(backend="gloo") if async_save else None
        if dist.get_rank() == 0:  # what a killed or failed save left: this run holds the run dir
            self.abandon()

    def _state(self) -> dict:
        return {"model": get_model_state_dict(self.model, options=self.options),
                "optim": get_optimizer_state_dict(self.model, self.optimizer, options=self.options)}

    def bytes_needed(self) -> int:
        """About the size of one checkpoint (collective the first time): the saved parameters in their dtype and
        AdamW's two moments in optim.state_dtype, each tensor counted once over the ranks (by its model-wide
        name), plus 26 KiB a trained tensor for what DCP writes beside it (its AdamW param-group entries, a small
        pickle each, and its index entries: 1.77 MB beside the tiny model's 68 tensors, whose checkpoint is 5.20 MB
        to this estimate's 5.23 MB). Known before the optimizer has state, for the warning at start."""
        if self._bytes is None:
            state = torch.empty((), dtype=getattr(torch, (self.optim_dtypes or {}).get("state_dtype", "float32")))
            mine = {}
            for name, p in self.model.named_parameters():
                if p.requires_grad:
                    mine[name] = p.numel() * (p.element_size() + 2 * state.element_size()) + 26 * 1024
                elif self.peft is None:
                    mine[name] = p.numel() * p.element_size() + 1024
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
            self._bytes = sum({name: size for ranks in every for name, size in ranks.items()}.values())
        return self._bytes

    def latest(self) -> Path | None:
        name = read_pointer(self.root, "latest")
        return None if name is None else self.root / name

    def abandon(self) -> None:
        """Remove what an unfinished save writes (its temp dir, a pointer's temp file); not collective."""
        for tmp in self.root.glob(".*.tmp"):
            if tmp.is_dir():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink(missing_ok=True)

    def _failed(self, name: str, e: BaseException) -> None:
        """Every rank, after a write failed on any: the temp dir removed (rank 0), SaveError with the line to print."""
        self.pending = None
        if dist.get_rank() == 0:
            self.abandon()
        latest = read_pointer(self.root, "latest")
        raise SaveError(
            f"checkpoint {self.root / name} could not be written ({_cause(e)}); a checkpoint needs about "
            f"{size_text(self.bytes_needed())}, {size_text(free_bytes(self.root))} free there; the partial save was "
            f"removed and " + (f"`latest` still names {latest}" if latest else "there is no earlier checkpoint")
            + "; free space (or use a run_dir on a disk with room) and rerun to resume") from e

    def save(self, step: int, val_loss: float | None = None, skipped_steps: int = 0) -> Path:
        """Write step-<step> (collective) to a temp dir; `wait` renames it and updates the pointers. Synchronous
        saves wait here; async ones at the next save or `wait()`. Returns the final path. A write that fails on
        any rank raises SaveError on every rank, with the temp dir removed and the pointers untouched."""
        self.wait()
        name = f"step-{step:06d}"
        tmp = self.root / f".{name}.tmp"
        self.bytes_needed()  # collective: done now, not once a rank has failed
        try:
            _on_rank0(lambda: self._begin(tmp, step, val_loss, skipped_steps))
            state = self._state()
            self.pending = _Pending(name, val_loss)
            if self.async_group is not None:
                self.pending.future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self.async_group)
            else:
                dcp.save(state, checkpoint_id=str(tmp))
        except _WRITE_ERRORS as e:
            if _interrupted(e):
                raise
            self._failed(name, e)
        if self.async_group is None:
            self.wait()
        return self.root / name

    def _begin(self, tmp: Path, step: int, val_loss: float | None, skipped_steps: int) -> None:
        """Rank 0: a fresh temp dir with extra.pt and checkpoint.json."""
        if tmp.exists():  # left by a crash mid-save
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        torch.save({"step": step, "scheduler": self.scheduler.state_dict(), "data": self.data.state_dict(),
                    "rng": _rng_state(), "skipped_steps": skipped_steps}, tmp / EXTRA)
        meta = {"step": step, "val_loss": val_loss, "model_config": dataclasses.asdict(self.model_config),
                "optim_dtypes": self.optim_dtypes, "peft": self.peft, "data": self.data_meta}
        (tmp / META).write_text(json.dumps(meta, indent=1))

    def wait(self) -> None:
        """Finish the save in flight (collective): once this rank's shards are written (rank 0's future also
        covers `.metadata`, written after every rank reported its shards), the ranks checksum the files between
        them, rank 0 writes the manifest, renames the temp dir, then writes `latest`, then `best`, then deletes
        checkpoints beyond `keep` (and any of an abandoned timeline: `_publish`)."""
        if self.pending is None:
            return
        pending = self.pending
        try:
            if pending.future is not None:
                pending.future.result()
            dist.barrier()  # every rank's shards written
            tmp = self.root / f".{pending.name}.tmp"
            names = sorted(p.name for p in tmp.iterdir() if p.name != MANIFEST)
            rank, world = dist.get_rank(), dist.get_world_size()
            records = [None] * world
            dist.all_gather_object(records, file_records(tmp, names[rank::world]))
            manifest = {"files": {k: v for r in records for k, v in r.items()}}
            _on_rank0(lambda: (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True)))
            _on_rank0(lambda: _sync(tmp, (EXTRA, META, MANIFEST)))  # DCP syncs its own files
            with self.guard():
                _on_rank0(lambda: self._publish(pending.name, pending.val_loss))
        except _WRITE_ERRORS as e:
            if _interrupted(e):
                raise
            self._failed(pending.name, e)
        self.pending = None

    def _publish(self, name: str, val_loss: float | None) -> None:
        """Rank 0: rename the temp dir to `name`, point `latest` (then `best`) at it, then rotate. A run's steps only
        grow, so a step dir numbered at or above `name` that this save finds is not this run's: a resume from an
        older step abandoned it (or a crash kept it from being published), and so is, at the first save after such
        a resume, every step dir above the one resumed from. They go first, whatever `keep` says: they would
        otherwise outlive this run's own newest checkpoints (or be taken for them by the rotation and by `best`),
        and `best` could name a step this run then overwrites. A val_loss that is not finite never makes `best`."""
        tmp, final = self.root / f".{name}.tmp", self.root / name
        above = step_number(name) - 1 if self.resumed_step is None else min(self.resumed_step, step_number(name) - 1)
        abandoned = [s for s in step_dirs(self.root) if step_number(s) > above]
        self.resumed_step = None
        best = read_pointer(self.root, "best")
        if best in abandoned:
            best = None
            (self.root / "best").unlink()
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        write_pointer(self.root, "latest", name)
        for old in abandoned:
            if old != name:
                shutil.rmtree(self.root / old)
        if self.keep_best:
            if best is None or not (self.root / best).is_dir():  # or rotated away while keep_best was off
                best = self._lowest_val_loss()
            elif _finite(val_loss):
                held = read_meta(self.root / best)["val_loss"]
                best = name if not _finite(held) or val_loss < held else best
            if best is not None:
                write_pointer(self.root, "best", best)
        for old in step_dirs(self.root)[:-self.keep]:
            if old != best or not self.keep_best:
                shutil.rmtree(self.root / old)
                if old == best:  # keep_best off now: the pointer goes with the dir it names
                    (self.root / "best").unlink(missing_ok=True)

    def _lowest_val_loss(self) -> str | None:
        """The step dir with the lowest val_loss among those on disk (the newest of equals; None when none has one),
        when `best` names none of them: the one just published, or an older one of this run's timeline."""
        losses = {s: read_meta(self.root / s).get("val_loss") for s in step_dirs(self.root)
                  if (self.root / s / META).is_file()}
        found = [s for s, v in losses.items() if _finite(v)]
        return min(found, key=lambda s: (losses[s], -step_number(s))) if found else None

    def load(self, path: Path) -> int:
        """Restore model, optimizer, scheduler, data position and RNG from `path` (collective); returns the
        step the checkpoint was taken after. Checkpoints numbered above it in this run's dir are of the timeline
        this resume abandons: see `_resumed_from`."""
        state = self._state()
        optim = state["optim"]
        own = {key: optim.pop(key) for key in list(optim)
               if key.startswith("param_groups.") and key.rsplit(".", 1)[1] in _IMPLEMENTATION_KEYS}
        dcp.load(state, checkpoint_id=str(path))
        optim.update(own)  # before loading: torch places each `step` tensor by the group's fused/capturable
        set_model_state_dict(self.model, state["model"], options=self.options)
        set_optimizer_state_dict(self.model, self.optimizer, state["optim"], options=self.options)
        extra = torch.load(path / EXTRA, weights_only=True)
        self.scheduler.load_state_dict(_per_group(extra["scheduler"], len(self.optimizer.param_groups)))
        self.data.load_state_dict(extra["data"])
        torch.set_rng_state(extra["rng"]["cpu"])
        if "cuda" in extra["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state(extra["rng"]["cuda"])
        self.skipped_steps = extra.get("skipped_steps", 0)
        if path.resolve().parent == self.root.resolve():
            self.resumed_step, self.resumed_here = extra["step"], True
        _on_rank0(lambda: self._resumed_from(path, extra["step"]))
        return extra["step"]

    def _resumed_from(self, path: Path, step: int) -> None:
        """Rank 0, after resuming from `path` (step `step`): `latest` names it, when it is in this run's dir and step
        dirs numbered above it exist (a resume from an older step; `find`'s fallback never goes above `latest`), so
        checkpoint.resume=auto continues this run, not the abandoned one, should it stop before its first save.
        That save deletes them (`_publish`); until then they are left for a user to copy away."""
        newer = [s for s in step_dirs(self.root) if step_number(s) > step]
        if not newer:
            return
        if path.resolve().parent == self.root.resolve() and read_pointer(self.root, "latest") != path.name:
            write_pointer(self.root, "latest", path.name)
        best = read_pointer(self.root, "best")
        log.warning("resume: resuming from %s, older than %s in %s (the checkpoints of the run this one abandons): "
                    "this run's first checkpoint deletes them%s; copy them elsewhere now to keep them", path.name,
                    ", ".join(newer), self.root, f" (`best` among them: {best})" if best in newer else "")


def _sync(directory: Path, names: tuple[str, ...]) -> None:
    """fsync the files `names` of `directory`, then the directory: on disk before a rename publishes it, so that a
    power loss after leaves `latest` naming whole files."""
    for path in [directory / name for name in names] + [directory]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def _per_group(scheduler_state: dict, groups: int) -> dict:
    """The lr scheduler's (a LambdaLR's) state with its per-group lists sized for `groups` parameter groups. How
    many groups an optimizer has depends on the layout (DTensor and plain parameters apart without FSDP2, and
    decaying and not: optim.build_optimizer), and all of them share one learning rate, so a checkpoint's first entry stands for
    every group."""
    return {key: value[:1] * groups if key in _PER_GROUP_KEYS and len(value) != groups else value
            for key, value in scheduler_state.items()}


_PER_GROUP_KEYS = ("base_lrs", "_last_lr", "lr_lambdas")


def load_model_state(path: Path, model_config, dtype: torch.dtype, lora=None,
                     mtp: str = "keep") -> dict[str, torch.Tensor]:
    """The model's parameters from a checkpoint of any mesh, on this one CPU process, in `dtype` (GDN's
    A_log/dt_bias stay fp32): full tensors under their native names, without the optimizer state (DCP reads
    only the keys asked for). With `lora` (a LoRA run's checkpoint) only the trained parameters it holds: the
    adapters, and embeddings / lm_head with peft.train_embeddings / train_head. `mtp`: the run's model.mtp (a
    trained MTP head's `mtp.*` parameters are read too)."""
    from qwenft.models.loader import build_model
    from qwenft.models.lora import apply_lora
    from qwenft.models.qwen3_5.gdn import param_dtype

    meta_model = build_model(model_config, kernels="torch", device="meta", mtp=mtp)
    if lora is not None:
        apply_lora(meta_model, lora, adapter_dtype=dtype)
    state = {name: torch.empty(p.shape, dtype=param_dtype(name.rsplit(".", 1)[-1], dtype))
             for name, p in meta_model.named_parameters() if lora is None or p.requires_grad}
    try:
        # read first: DCP's own read of a missing .metadata logs two tracebacks on the root logger before it fails
        dcp.FileSystemReader(str(path)).read_metadata()
        with warnings.catch_warnings():  # one process without a process group is what `qwenft export` means to do
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({"model": state}, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    except (OSError, CheckpointException) as e:
        problems = damage(path)
        if not problems:
            raise
        raise rotated_away(path, problems) from e
    return state
