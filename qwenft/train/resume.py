"""A resume's checks against the run that saved the checkpoint, made before anything in the run dir is written:
each config key changed since that run is logged on a line of its own, and a change that would move the data
position is refused in one line naming the key (docs/checkpointing.md, "What a resume may change")."""

import logging
from pathlib import Path

import torch

from qwenft.checkpoint.files import AFRESH, EXTRA, read_meta
from qwenft.conf import as_written, load_run_config
from qwenft.conf.schema import Config
from qwenft.train.optim import decays

log = logging.getLogger("qwenft")

# Why each key fixes the data position: the stream's state is (epoch, row), rows are packed from the documents
# of the data files by seq_len and packing in an order shuffled by the seed, and a step takes global_batch_size
# of them.
_POSITION_KEYS = {
    "train.global_batch_size": "a step takes that many rows, so the steps, the lr schedule and train.epochs "
                               "would count other rows than the saved position",
    "data.seq_len": "rows are packed to that length, so the saved row position would point into other rows",
    "data.packing": "rows are built that way, so the saved row position would point into other rows",
    "seed": "it shuffles the data order, so the saved row position would point into another order",
}


def data_meta(cfg: Config, data) -> dict:
    """What the data position depends on beyond the data state itself, saved in each checkpoint."""
    return {"global_batch_size": cfg.train.global_batch_size, "seq_len": cfg.data.seq_len,
            "files": data.fingerprint}


def log_config_changes(path: Path, cfg: Config, run_dir: Path) -> None:
    """Log, one line each, every key of `cfg` (as config.yaml writes it) that differs from the config of the run
    that saved `path`, the config.yaml of its run dir."""
    saved_dir = path.parent.parent
    try:
        saved = load_run_config(saved_dir)
    except ValueError as e:
        log.warning("resume: the config of the run that saved %s is not compared (%s)", path, e)
        return
    old, new = _flat(as_written(saved)), _flat(as_written(cfg, str(run_dir)))
    changed = [key for key in [*new, *(k for k in old if k not in new)] if old.get(key) != new.get(key)]
    if not changed:
        log.info("resume: no config key changed since %s", saved_dir / "config.yaml")
    for key in changed:
        log.info("resume: %s: %s -> %s", key, _text(old.get(key)), _text(new.get(key)))


def check_data_position(path: Path, cfg: Config, data) -> None:
    """Refuse (ValueError, one line) a resume from `path` whose data position would not continue the same stream:
    other data files, another train.global_batch_size, data.seq_len, data.packing, seed or data.sources weights,
    or another number of documents from the same files (data.truncation, data.on_bad_row, the tokenizer). A
    checkpoint saved before checkpoints held the files' fingerprint and batch size is checked for the rest."""
    saved = read_meta(path).get("data") or {}
    now = data_meta(cfg, data)
    prefix = f"checkpoint.resume={cfg.checkpoint.resume}"
    data_key = "data.sources" if cfg.data.sources else f"data.path={cfg.data.path}"
    if saved.get("files") is not None and now["files"] is not None and saved["files"] != now["files"]:
        raise ValueError(f"{prefix}: {data_key} holds other data than {path} was trained on "
                         f"({_files_difference(saved['files'], now['files'])}); resume with the data it was trained "
                         f"on, or {AFRESH}")
    state = torch.load(path / EXTRA, weights_only=True)["data"]
    values = {"train.global_batch_size": (saved.get("global_batch_size"), now["global_batch_size"]),
              "data.seq_len": (state["seq_len"], cfg.data.seq_len), "data.packing": (state["packing"], data.packing),
              "seed": (state["seed"], data.seed)}
    for key, (then, current) in values.items():
        if then is not None and then != current:
            raise ValueError(f"{prefix}: {key}={current}, but {path} was saved with {key}={then} "
                             f"({_POSITION_KEYS[key]}); resume with {key}={then}, or "
                             f"{AFRESH}")
    mixture = [[s.name, s.weight] for s in getattr(data, "sources", [])]
    if state.get("sources") is not None and state["sources"] != mixture:
        raise ValueError(f"{prefix}: data.sources (name, weight) are {mixture}, but {path} was saved with "
                         f"{state['sources']} (the mixture's draws follow them); resume with those, or "
                         f"{AFRESH}")
    if state["num_documents"] != data.num_documents:
        raise ValueError(f"{prefix}: {data_key} gives {data.num_documents} documents, {path} was "
                         f"trained on {state['num_documents']} (another data file, data.truncation, "
                         f"data.on_bad_row or tokenizer); resume with the data and data.* it was trained on, or "
                         f"{AFRESH}")


def check_base(path: Path, cfg: Config, base: dict | None) -> None:
    """Refuse (ValueError, one line) to resume LoRA adapters onto a frozen base other than the one they were
    trained on (`base`: this run's `peft_setup.base_fingerprint`; a checkpoint saved before bases were recorded is not
    checked): the same shapes would load and train on, silently wrong."""
    saved = (read_meta(path).get("peft") or {}).get("base")
    if saved is None or base is None or saved == base:
        return
    seed = saved.get("random_init_seed")
    if seed is not None:
        then = f"a random-init base, seed={seed}"
    elif "random_init_seed" in base:
        then = "a model.path's weights"
    else:
        then = (f"other weights: {saved['tensors']} tensors then, {base['tensors']} now" if saved["tensors"] !=
                base["tensors"] else "other weights: the same tensors' names and shapes, other values")
    now = f"model.path={cfg.model.path}" if cfg.model.path else f"a random init with seed={cfg.seed}"
    raise ValueError(f"checkpoint.resume={cfg.checkpoint.resume}: this run's base, {now}, is not the one the "
                     f"adapters of {path} were trained on ({then}); resume on that base, or start over in a new "
                     f"run_dir")


def apply_optimizer_options(optimizer, scheduler, cfg: Config) -> None:
    """After a checkpoint has loaded: this run's optim.lr, betas, eps and weight_decay, in place of the values the
    checkpoint's parameter groups and scheduler were saved with, from the first resumed step on; the lr follows
    this run's schedule (lr_scheduler.*, train.max_steps) at the resumed step. Without a change, each value is
    the one the checkpoint holds, so an unchanged resume stays exact."""
    for group in optimizer.param_groups:
        group.update(betas=tuple(cfg.optim.betas), eps=cfg.optim.eps,
                     weight_decay=cfg.optim.weight_decay if decays(group["params"][0]) else 0.0)
    scheduler.base_lrs = [cfg.optim.lr] * len(optimizer.param_groups)
    for group, base, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]  # what get_last_lr() reports


def _files_difference(then: dict, now: dict) -> str:
    """The first difference between two `qwenft.data.loader.fingerprint`s, in words."""
    if then.keys() != now.keys():
        return f"files then: {', '.join(sorted(then))}; now: {', '.join(sorted(now))}"
    name = next(name for name in sorted(then) if then[name] != now[name])
    if then[name]["bytes"] != now[name]["bytes"]:
        return f"{name}: {then[name]['bytes']} bytes then, {now[name]['bytes']} now"
    return f"{name}: the same size, other first or last rows"


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in d.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _text(value) -> str:
    """A value as a config file or an override writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)
