"""Hydra composition of a run's config (recipe + group options + overrides -> a validated `Config`) and its
YAML I/O. Components never import this: they take plain values."""

import difflib
import os
import re
import tempfile
from dataclasses import fields, is_dataclass
from pathlib import Path

from qwenft.conf.schema import CHOICES, Config, validate

CONF_DIR = Path(__file__).resolve().parent
GROUPS = ("mesh", "model", "data", "optim", "lr_scheduler", "train", "pipeline", "checkpoint", "eval", "logger", "launcher",
          "plan", "peft")
RECIPES_ENV = "QWENFT_RECIPES_DIR"


class ConfigError(ValueError):
    """A user mistake in the recipe or the overrides; printed as one line."""


def recipe_dirs() -> list[Path]:
    dirs = [CONF_DIR / "recipe"]
    extra = os.environ.get(RECIPES_ENV)
    if extra:
        if not Path(extra).is_dir():
            raise ConfigError(f"{RECIPES_ENV}={extra!r} is not a directory")
        dirs.insert(0, Path(extra).resolve())
    return dirs


def list_recipes() -> dict[str, str]:
    """Recipe name -> its description line, user dir first so it shadows built-in names."""
    found = {}
    for d in recipe_dirs():
        for path in sorted(d.glob("*.yaml")):
            match = re.search(r"^description:\s*(.+)$", path.read_text(), re.M)
            found.setdefault(path.stem, match.group(1).strip() if match else "")
    return found


def group_options() -> dict[str, list[str]]:
    return {g: sorted(p.stem for p in (CONF_DIR / g).glob("*.yaml")) for g in GROUPS}


def _schema_keys(cls, prefix="") -> list[str]:
    keys = []
    for f in fields(cls):
        default = f.default_factory() if callable(f.default_factory) else f.default
        if is_dataclass(default):
            keys += _schema_keys(type(default), f"{prefix}{f.name}.")
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


def _unknown_key_error(key: str) -> ConfigError:
    valid = _schema_keys(Config)
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f"; did you mean '{close[0]}'?" if close else "; `qwenft show` lists the valid keys"
    return ConfigError(f"unknown config key '{key}'{hint}")


def _user_search_path(extra: Path) -> str:
    # Hydra finds groups as sub-folders of a search-path entry; give the user's flat dir a `recipe/` name.
    root = Path(tempfile.mkdtemp(prefix="qwenft-recipes-"))
    (root / "recipe").symlink_to(extra)
    return f"hydra.searchpath=[file://{root}]"


def _bool_choices_as_strings(raw) -> None:
    """An unquoted true/false (`optim.fused=true` on the command line, `fused: true` in a recipe) reaches the
    config as a bool, which a str key would hold as 'True'; where the valid values are the strings 'true' and
    'false', the bool means that string."""
    from omegaconf import OmegaConf

    for key, valid in CHOICES.items():
        value = OmegaConf.select(raw, key, default=None)
        if isinstance(value, bool) and {"true", "false"} <= set(valid):
            OmegaConf.update(raw, key, str(value).lower())


def _store_schema_defaults() -> None:
    """Every schema key at its dataclass default, as the base config.yaml composes first: a group option's
    YAML then holds only what differs, and an override may set any key. Untyped, so the schema's types and
    choices are checked once, by the merge into `Config` below."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    defaults = OmegaConf.to_container(OmegaConf.structured(Config))
    del defaults["recipe"]  # the `recipe` group's choice, recorded after composing
    # data=chat makes data.path required (???), and merging ??? onto a value keeps the value: every data
    # option sets data.path itself
    del defaults["data"]["path"]
    ConfigStore.instance().store(name="schema_defaults", node=defaults)


def compose(overrides: list[str], missing_ok: bool = False) -> Config:
    """Recipe YAML + overrides -> a validated `Config` (raises ConfigError with one line on any mistake).

    missing_ok (for `show`): required keys left at ??? stay the string "???" instead of raising."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    recipes = list_recipes()
    for o in overrides:
        if o.startswith("recipe=") and o.split("=", 1)[1] not in recipes:
            name = o.split("=", 1)[1]
            raise ConfigError(f"recipe={name!r} not found; available: {', '.join(recipes)}")
        if "=" not in o and not o.startswith("~"):
            raise ConfigError(f"override {o!r} is not of the form key=value (or ~key to reset it)")
    hydra_overrides = list(overrides)
    extra = os.environ.get(RECIPES_ENV)
    if extra:
        hydra_overrides.insert(0, _user_search_path(Path(extra).resolve()))
    _store_schema_defaults()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            raw = hydra_compose("config", overrides=hydra_overrides)
    except HydraException as e:
        override = re.search(r"Could not override '([^']+)'\.\nTo append", str(e))
        if override:
            raise _unknown_key_error(override.group(1)) from None
        option = re.search(r"Could not find '(\w+)/([^']+)'", str(e))
        if option and option.group(1) in GROUPS:
            group, name = option.groups()
            valid = ", ".join(group_options()[group])
            raise ConfigError(f"{group}={name!r} is not a {group} option; choose one of {valid}") from None
        tilde = next((o for o in overrides if "=~" in o), None)
        if tilde is not None:  # Hydra's lexer takes a leading ~ for its reset syntax
            key, value = tilde.split("=", 1)
            raise ConfigError(f"{tilde}: Hydra cannot read a value starting with ~; write the full path, e.g. "
                              f"{key}={os.path.expanduser(value)}") from None
        raise ConfigError(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
    # The recipe chosen is the `recipe` group's choice; record it as a plain key.
    raw_recipe = next((o.split("=", 1)[1] for o in overrides if o.startswith("recipe=")), "tiny")
    OmegaConf.set_struct(raw, False)
    raw.recipe = raw_recipe
    _bool_choices_as_strings(raw)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config), raw)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        if "not in struct" in str(e) or "Key '" in str(e) and "not in" in str(e):
            raise _unknown_key_error(key or str(e)) from None
        raise ConfigError(f"{key}: {str(e).splitlines()[0]}" if key else str(e).splitlines()[0]) from None
    for key in OmegaConf.missing_keys(raw):  # merging ??? onto the schema's default keeps the default
        OmegaConf.update(merged, key, "???")
    missing = OmegaConf.missing_keys(merged)
    required = missing - {"data.path"} if merged.data.sources else missing  # a mixture replaces data.path
    if required and not missing_ok:
        raise ConfigError(f"required key(s) not set: {', '.join(sorted(required))} (set them as key=value)")
    for key in missing:
        OmegaConf.update(merged, key, "")
    cfg = OmegaConf.to_object(merged)
    for key in missing:  # to_yaml prints "???" as OmegaConf's missing marker again
        *parents, leaf = key.split(".")
        node = cfg
        for part in parents:
            node = getattr(node, part)
        setattr(node, leaf, "???")
    validate(cfg)
    return cfg


def to_yaml(cfg: Config) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def load_run_config(run_dir: Path) -> Config:
    """The resolved config a `qwenft train` run wrote to its run dir."""
    from omegaconf import OmegaConf

    path = run_dir / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"run_dir={run_dir} has no config.yaml; give the run dir of a qwenft train run")
    raw = OmegaConf.load(path)
    _bool_choices_as_strings(raw)  # a run written when the key was a bool
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), raw))
