"""A training checkpoint dir on disk: the step dirs and the `latest` / `best` pointers, checkpoint.json and the
checks made on it before a resume, the manifest's verification, and which step dir a resume takes (`find`). Reads
and small writes of files only (`find` and the manifest check are collective when a process group exists, each
rank checking its share): nothing here builds or loads a model (dcp.py saves and loads the train state).

Layout under <run_dir>/checkpoints/:
    step-000010/        model + optimizer: one DCP shard file per rank plus `.metadata`;
                        extra.pt (rank 0): step, scheduler, data stream position, RNG state, skipped steps;
                        checkpoint.json: step, val_loss, the model config (checked on resume, read by export),
                                         the global batch size, seq_len and data files' fingerprint (checked on resume);
                        manifest.json: every other file's size and CRC-32, checked before a resume loads
    latest              the name of the newest complete step dir, written last
    best                checkpoint.keep_best: the step dir with the lowest val_loss, never rotated away
"""

import dataclasses
import json
import os
import re
import zlib
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

EXTRA = "extra.pt"
META = "checkpoint.json"
MANIFEST = "manifest.json"


def write_pointer(root: Path, name: str, target: str) -> None:
    """Point `latest` or `best` at the step dir `target`: written to disk before it replaces the old pointer, and
    the replacement synced too, so a node that crashes meanwhile leaves the old pointer or the new, never an empty
    file."""
    tmp = root / f".{name}.tmp"
    with open(tmp, "w") as f:
        f.write(target + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / name)
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def step_number(name: str) -> int:
    return int(name.removeprefix("step-"))


def step_dirs(root: Path) -> list[str]:
    """The names of the step dirs under `root`, oldest first: by number, so step-1000000 sorts after step-999999."""
    return sorted((p.name for p in root.glob("step-*") if p.name[5:].isdigit() and p.is_dir()), key=step_number)


def read_pointer(root: Path, name: str) -> str | None:
    """The step dir name in `latest` or `best`; None when there is no such pointer, or when it holds no step dir name
    (a file cut short by a crash: `pointer_text` has what it holds)."""
    text = pointer_text(root, name)
    return text if text is not None and re.fullmatch(r"step-\d+", text) else None


def pointer_text(root: Path, name: str) -> str | None:
    path = root / name
    return path.read_text(errors="replace").strip() if path.is_file() else None


def read_meta(path: Path) -> dict:
    return json.loads((path / META).read_text())


def model_config_from_meta(meta: dict):
    """The qwenft ModelConfig a checkpoint was saved from."""
    from qwenft.models.qwen3_5.configs import ModelConfig, TextConfig

    d = meta["model_config"]
    return ModelConfig(**{**d, "text": TextConfig(**d["text"])})


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def check_model_config(path: Path, model_config, resume: str, optim_dtypes: dict | None = None,
                       peft: dict | None = None, mtp: str | None = None) -> None:
    """Refuse (before anything is loaded) a checkpoint of another model: DCP would fail on the first shape that
    disagrees, or load silently where none does (another layer_types, rope_theta, ...). Also one saved with
    other `optim_dtypes` (optim.state_dtype / master_dtype: another optimizer class and state layout), or with
    other trained parameters (`peft`: full finetuning against LoRA, or LoRA of another rank or targets; `mtp`,
    model.mtp: a trained MTP head in the checkpoint and none in the run, or the other way round)."""
    if mtp is not None:
        saved_head = any(k.startswith("model.mtp.") for k in
                         dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
        if saved_head != (mtp != "keep"):
            there = "a trained MTP head (model.mtp=train or head)" if saved_head else "no MTP head (model.mtp=keep)"
            raise ValueError(f"checkpoint.resume={resume}: {path} holds {there}, this run has model.mtp={mtp}; "
                             f"resume with the model.mtp it was trained with, or {AFRESH}")
    meta = read_meta(path)
    saved_peft, peft = meta.get("peft") or {"method": "none"}, peft or {"method": "none"}
    # the frozen base is compared by train.resume.check_base (files fingerprint); alpha only where it was recorded
    saved_peft = {k: v for k, v in saved_peft.items() if k != "base"}
    peft = {k: v for k, v in peft.items() if k != "base" and (k != "alpha" or k in saved_peft)}
    if saved_peft != peft:
        differ = [k for k in {**saved_peft, **peft} if saved_peft.get(k) != peft.get(k)]
        there = ", ".join(f"peft.{k}={saved_peft.get(k)}" for k in differ)
        here = ", ".join(f"peft.{k}={peft.get(k)}" for k in differ)
        raise ValueError(f"checkpoint.resume={resume}: {path} was saved with {there}, this run has {here}; resume "
                         f"with the peft.* it was trained with, or {AFRESH}")
    saved_dtypes = meta.get("optim_dtypes")
    if optim_dtypes is not None and saved_dtypes is not None and saved_dtypes != optim_dtypes:
        there = ", ".join(f"optim.{k}={v}" for k, v in sorted(saved_dtypes.items()))
        here = ", ".join(f"optim.{k}={v}" for k, v in sorted(optim_dtypes.items()))
        raise ValueError(f"checkpoint.resume={resume}: {path} was saved with {there}, this run has {here}; resume "
                         f"with the same optim.state_dtype and optim.master_dtype, or {AFRESH}")
    saved = _flat(meta["model_config"])
    now = _flat(json.loads(json.dumps(dataclasses.asdict(model_config))))  # lists and tuples as JSON has them
    diff = [f"{k}={saved.get(k)!r} there, {now.get(k)!r} here" for k in sorted(set(saved) | set(now))
            if saved.get(k) != now.get(k)]
    if diff:
        more = f" (+{len(diff) - 3} more)" if len(diff) > 3 else ""
        raise ValueError(f"checkpoint.resume={resume}: {path} was saved from another model ({'; '.join(diff[:3])}"
                         f"{more}); resume with the model.* and data.tokenizer it was trained with, or "
                         f"{AFRESH}")


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def file_records(path: Path, names: list[str]) -> dict[str, dict]:
    return {name: {"bytes": (path / name).stat().st_size, "crc32": _crc32(path / name)} for name in names}


def damage(path: Path, rank: int = 0, world: int = 1) -> list[str]:
    """What is wrong with the step dir `path`, as short phrases (none: complete). Sizes and presence are checked
    by every rank; the CRC-32s of the manifest's files are split over the `world` ranks (this one reads every
    `world`-th from `rank`), so a large checkpoint is read once in all. A checkpoint saved before manifests
    existed is checked for its three fixed files only."""
    if not path.is_dir():
        return ["the dir is missing"]
    if not (path / MANIFEST).is_file():
        return [f"no {f}" for f in (".metadata", EXTRA, META) if not (path / f).is_file()]
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
    except (ValueError, KeyError):
        return [f"{MANIFEST} is unreadable"]
    problems = []
    for i, (name, record) in enumerate(sorted(files.items())):
        file = path / name
        try:
            if file.stat().st_size != record["bytes"]:
                problems.append(f"{name} is {file.stat().st_size} bytes, {record['bytes']} when saved")
            elif i % world == rank and _crc32(file) != record["crc32"]:
                problems.append(f"{name} has another checksum than when saved")
        except FileNotFoundError:  # or deleted while this reads it: a run's rotation
            problems.append(f"{name} is missing")
    return problems


def damage_on_all_ranks(path: Path) -> list[str]:
    """`damage` checked by every rank of the default process group together (each the same answer)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return damage(path)
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, damage(path, dist.get_rank(), dist.get_world_size()))
    return sorted({p for problems in found for p in problems})


def summary(problems: list[str]) -> str:
    return "; ".join(problems[:3]) + (f" (+{len(problems) - 3} more)" if len(problems) > 3 else "")


# how to start afresh instead of a refused resume: valid whichever checkpoint was refused (checkpoint.resume=none is
# refused in a run dir that holds checkpoints)
AFRESH = "start afresh with checkpoint.resume=none in a new run_dir"


def find(value: str, ckpt_root: Path, key: str = "checkpoint.resume",
         valid: str = "auto or none") -> tuple[Path | None, list[str]]:
    """The checkpoint dir that `key=value` names, verified against its manifest before anything loads it;
    collective when a process group exists. `auto`: `latest`, or, when that one is damaged, the newest complete
    step dir older than it (None when the run has saved none yet); `none`: None; else that step dir. Also returns
    one line for each damaged checkpoint passed over. A step dir numbered above `latest` is never taken: it is of a
    timeline a resume from an older step abandoned (Checkpointer.load), or one a crash left unpublished. Reads only
    files: it runs before anything is built or written."""
    if value == "none":
        return None, []
    if value != "auto":
        path = Path(value)
        if not path.is_dir():
            raise ValueError(f"{key}={value} does not exist; give a step-NNNNNN dir, or {valid}")
        problems = damage_on_all_ranks(path)
        if problems:
            raise ValueError(f"{key}={value}: {path} is incomplete or corrupt ({summary(problems)}); give another "
                             f"step-NNNNNN dir, or {valid}")
        return path, []
    latest = read_pointer(ckpt_root, "latest")
    older = [name for name in reversed(step_dirs(ckpt_root))
             if latest is None or step_number(name) < step_number(latest)]
    candidates = ([latest] if latest else []) + older
    passed_over = []
    if latest is None and pointer_text(ckpt_root, "latest") is not None:
        passed_over.append(f"{ckpt_root / 'latest'} names no step dir ({pointer_text(ckpt_root, 'latest')[:40]!r})")
    for name in candidates:
        problems = damage_on_all_ranks(ckpt_root / name)
        if not problems:
            return ckpt_root / name, passed_over
        passed_over.append(f"{ckpt_root / name} is incomplete or corrupt ({summary(problems)})")
    if passed_over:
        raise ValueError(f"{key}={value}: no complete checkpoint in {ckpt_root}: {' | '.join(passed_over)}; "
                         f"delete {ckpt_root} to start afresh in this run_dir, or give a new run_dir")
    return None, []


def rotated_away(path: Path, problems: list[str] | None = None) -> ValueError:
    """The error of an export whose checkpoint, verified when the export began, is gone since: the rotation
    (checkpoint.keep) of the run still training in its run dir deleted it (`problems`: what is missing now)."""
    found = f" ({summary(problems)})" if problems else ""
    return ValueError(f"checkpoint {path} was deleted while it was being exported{found}: the run training in "
                      f"{path.parent.parent} rotated it away (checkpoint.keep); rerun the export (it takes the newest "
                      f"checkpoint then), or export checkpoint=best or a step-NNNNNN dir that run keeps")
