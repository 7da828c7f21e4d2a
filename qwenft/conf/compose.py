"""Hydra composition of a run's config (recipe + group options + overrides -> a validated `Config`) and its
YAML I/O. Components never import this: they take plain values."""

import contextlib
import difflib
import os
import re
import tempfile
from dataclasses import fields, is_dataclass
from pathlib import Path

from qwenft.conf.schema import CHOICES, Config, SourceOptions, validate

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


# a data.sources entry's place, as an error names it: data.sources[2]
_SOURCE_ENTRY = r"data\.sources\[\d+\]"


def _unknown_key_error(key: str) -> ConfigError:
    if re.fullmatch(_SOURCE_ENTRY + r"\.\w+", key):
        return ConfigError(f"unknown config key '{key}'; a data.sources entry takes path, weight and format")
    valid = _schema_keys(Config)
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f"; did you mean '{close[0]}'?" if close else "; `qwenft show` lists the valid keys"
    return ConfigError(f"unknown config key '{key}'{hint}")


def _source_key(raw, key: str) -> str | None:
    """A `data.sources` entry's key as OmegaConf names it in an error (by its own name alone), with the place of
    the first entry that does not merge into the schema: `data.sources[i].key`; None if every entry merges."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    for i, source in enumerate(raw.get("data", {}).get("sources") or ()):
        try:
            OmegaConf.merge(OmegaConf.structured(SourceOptions), source)
        except OmegaConfBaseException:
            return f"data.sources[{i}].{key}"
    return None


def _expected(key: str) -> str | None:
    """What the schema's key `key` takes, for a value of the wrong type (`data.sources[i].key`: a mixture entry's
    key); None for a key the schema does not have."""
    from omegaconf import DictConfig, OmegaConf

    if re.fullmatch(_SOURCE_ENTRY, key):
        return "expected a mapping, e.g. {path: a.jsonl, weight: 1.0}"
    parent, _, leaf = key.rpartition(".")
    schema = OmegaConf.structured(Config)
    if re.fullmatch(_SOURCE_ENTRY, parent):
        holder = OmegaConf.structured(SourceOptions)
    else:
        holder = OmegaConf.select(schema, parent, default=None) if parent else schema
    if not isinstance(holder, DictConfig) or leaf not in holder:
        return None
    node = holder._get_node(leaf)
    kind = type(node).__name__
    if kind == "AnyNode":  # takes any value
        return None
    optional = " (or null)" if node._is_optional() else ""
    expected = {"FloatNode": "expected a number", "IntegerNode": "expected an integer",
                "BooleanNode": "expected true or false", "StringNode": "expected a string",
                "ListConfig": "expected a list, e.g. [a,b]", "DictConfig": "expected a mapping, e.g. {a: 1}"}
    return expected.get(kind, f"expected a {kind.removesuffix('Node').lower()}") + optional


def _parsed(overrides: list[str]) -> list[tuple]:
    """(override as typed, Hydra's parse of it or the HydraException its grammar raised), recipe= aside."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    parsed = []
    for o in overrides:
        if o.startswith("recipe="):
            continue
        try:
            parsed.append((o, parser.parse_override(o)))
        except HydraException as e:
            parsed.append((o, e))
    return parsed


def _readable(overrides: list[str]) -> list[tuple]:
    """`_parsed`'s pairs when every override parses; none otherwise (the error reported is then the parser's)."""
    parsed = _parsed(overrides)
    return [] if any(isinstance(override, Exception) for _, override in parsed) else parsed


def _unparsable(overrides: list[str]) -> ConfigError | None:
    """The first override Hydra's grammar cannot read, with the parser's words."""
    for o, override in _parsed(overrides):
        if isinstance(override, Exception):
            return ConfigError(f"{o}: cannot be read as key=value ({str(override).splitlines()[0]}); quote a value "
                               f"that holds brackets, braces, commas or spaces")
    return None


def _check_override_forms(overrides: list[str]) -> None:
    """Before Hydra composes: a comma-separated value (Hydra's sweep, which a training run does not do) and a
    config group given anything but one option's name (a number, a mapping, or a list, which Hydra would merge
    option by option) each raise one line naming the override and what to write instead."""
    for o, override in _readable(overrides):
        key = override.key_or_group
        if override.is_delete():
            continue
        if key in GROUPS and (override.is_sweep_override() or not isinstance(override.value(), str)):
            raise ConfigError(f"{o}: {key} takes the name of one of its options: {', '.join(group_options()[key])}")
        if override.is_sweep_override():
            raise ConfigError(f"{o}: a comma makes a sweep, which a training run does not do; write a list as "
                              f"{key}=[{o.split('=', 1)[1]}], or quote a string that holds a comma")


def _container_mismatch(overrides: list[str]) -> ConfigError | None:
    """The first override that gives a mapping or list key a value of the other kind, or a scalar (or a scalar key
    a mapping or list), as one line naming it: Hydra's and OmegaConf's own errors for these name neither key nor
    value. None when every override parses and none is such (the caller then reports the error it has)."""
    for o, override in _readable(overrides):
        key, typed = override.key_or_group, o.split("=", 1)[1] if "=" in o else ""
        if override.is_delete() or key in GROUPS or "${" in typed:
            continue
        value, expected = override.value(), _expected(key)
        if expected is None or value is None and "(or null)" in expected:
            continue
        if ("a mapping" in expected and not isinstance(value, dict)
                or "a list" in expected and not isinstance(value, list)
                or isinstance(value, (dict, list)) and "a mapping" not in expected and "a list" not in expected):
            return ConfigError(f"{key}={typed} is not valid; {expected}")
    return None


def _yaml_error(e) -> ConfigError:
    """A YAML syntax error (PyYAML's MarkedYAMLError) as one line: the file, line and column where the parser
    stopped, and what it found (with where the construct it was reading began)."""
    problem, context = getattr(e, "problem_mark", None), getattr(e, "context_mark", None)
    if problem is None:
        return ConfigError(f"YAML syntax error: {' '.join(str(e).split())}")
    what = e.problem or "invalid YAML"
    if e.context and context is not None:
        what = f"{what} ({e.context} that began at line {context.line + 1}, column {context.column + 1})"
    return ConfigError(f"{problem.name}, line {problem.line + 1}, column {problem.column + 1}: YAML syntax error: "
                       f"{what}")


@contextlib.contextmanager
def _config_dir():
    """CONF_DIR; with $QWENFT_RECIPES_DIR set, for the block, a mirror of it whose `recipe/` links the built-in
    recipes' entries and then the user dir's (sub-dirs of shared files too), which replace built-in ones of the same
    name. (Hydra reads its primary config dir before any search-path entry, so a search path could add recipes but
    never shadow one.) Made for each compose, so recipes added to the dir meanwhile count, and removed after it."""
    if not os.environ.get(RECIPES_ENV):
        yield CONF_DIR
        return
    with tempfile.TemporaryDirectory(prefix="qwenft-recipes-") as root:
        for entry in CONF_DIR.iterdir():
            if entry.name != "recipe":
                (Path(root) / entry.name).symlink_to(entry)
        recipes = Path(root) / "recipe"
        recipes.mkdir()
        for directory in reversed(recipe_dirs()):  # built-in first
            for path in directory.iterdir():
                (recipes / path.name).unlink(missing_ok=True)
                (recipes / path.name).symlink_to(path)
        yield Path(root)


def _keep_recipe_missing(raw, recipe: str, overrides: list[str]) -> None:
    """A key the recipe file writes as ??? (required) stays so unless an override sets it (or a mapping or list above
    it, not a config group's choice): Hydra's merge keeps the value a group option put under it (`data.path: tiny`
    of the default data group), so a `qwenft show` printout saved as a recipe would otherwise train on that value."""
    from omegaconf import OmegaConf

    path = next(d / f"{recipe}.yaml" for d in recipe_dirs() if (d / f"{recipe}.yaml").is_file())
    set_here = [o.lstrip("+~").split("=", 1)[0] for o in overrides]
    for key in _written_missing(OmegaConf.to_container(OmegaConf.load(path), resolve=False)):
        # a group's choice (model=qwen3_5_0_8b) sets none of the recipe's keys under it
        covered = any(key == s or s not in GROUPS and key.startswith((f"{s}.", f"{s}[")) for s in set_here)
        if not covered and OmegaConf.select(raw, key, default=_ABSENT, throw_on_missing=False) is not _ABSENT:
            OmegaConf.update(raw, key, "???")


_ABSENT = object()


def _written_missing(node, prefix: str = "") -> list[str]:
    """The keys a loaded YAML file (its container, interpolations unresolved) writes as ???."""
    if isinstance(node, dict):
        items = [(f"{prefix}.{k}" if prefix else str(k), v) for k, v in node.items() if k != "defaults"]
    elif isinstance(node, list):
        items = [(f"{prefix}[{i}]", v) for i, v in enumerate(node)]
    else:
        return [prefix] if node == "???" else []
    return [key for k, v in items for key in _written_missing(v, k)]


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
    import yaml
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    recipes = list_recipes()
    for o in overrides:
        if o.startswith("recipe=") and o.split("=", 1)[1] not in recipes:
            name = o.split("=", 1)[1]
            raise ConfigError(f"recipe={name!r} not found; available: {', '.join(recipes)}")
        if ("=" not in o and not o.startswith("~")) or o.lstrip("+~").startswith("="):
            raise ConfigError(f"override {o!r} is not of the form key=value (or ~key to reset it)")
    # the defaults list places the recipe at the top level (`recipe@_global_`), and Hydra names its choice so
    hydra_overrides = [f"recipe@_global_={o.split('=', 1)[1]}" if o.startswith("recipe=") else o for o in overrides]
    _check_override_forms(overrides)
    _store_schema_defaults()
    try:
        with _config_dir() as config_dir, initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
            raw = hydra_compose("config", overrides=hydra_overrides)
    except yaml.YAMLError as e:
        raise _yaml_error(e) from None
    except HydraException as e:
        override = re.search(r"Could not override '([^']+)'\.\nTo append", str(e))
        if override:  # the key itself, or a key inside the mapping it was given (`model.kernels={bad: 1}`)
            inner = getattr(e.__cause__, "full_key", None) if "not in struct" in str(e.__cause__) else None
            raise _unknown_key_error(inner or override.group(1)) from None
        option = re.search(r"Could not (?:find|load) '(\w+)/([^']+)'", str(e))
        if option and option.group(1) in GROUPS:
            group, name = option.groups()
            valid = ", ".join(group_options()[group])
            raise ConfigError(f"{group}={name!r} is not a {group} option; choose one of {valid}") from None
        missing = re.search(r"Could not delete from config\. '([^']+)' does not exist", str(e))
        if missing:
            key = missing.group(1)
            if key in _schema_keys(Config):
                raise ConfigError(f"~{key}: the recipe does not set {key}, so there is nothing to reset (its default "
                                  f"applies)") from None
            raise _unknown_key_error(key) from None
        present = re.search(r"Could not append to config\. An item is already at '([^']+)'", str(e))
        if present:
            key = present.group(1)
            given = next((o for o in overrides if o.startswith(f"+{key}=")), f"+{key}=...")
            raise ConfigError(f"{given}: {key} is already in the config (+ adds a new key); set it with "
                              f"{given[1:]}") from None
        tilde = next((o for o in overrides if "=~" in o), None)
        if tilde is not None:  # Hydra's lexer takes a leading ~ for its reset syntax
            key, value = tilde.split("=", 1)
            raise ConfigError(f"{tilde}: Hydra cannot read a value starting with ~; write the full path, e.g. "
                              f"{key}={os.path.expanduser(value)}") from None
        raise _unparsable(overrides) or _container_mismatch(overrides) or ConfigError(
            str(e).splitlines()[0] if str(e) else type(e).__name__) from None
    # The recipe chosen is the `recipe` group's choice; record it as a plain key.
    # the last recipe= wins, as Hydra composes it (and as any key given twice)
    raw_recipe = next((o.split("=", 1)[1] for o in reversed(overrides) if o.startswith("recipe=")), "tiny")
    OmegaConf.set_struct(raw, False)
    raw.recipe = raw_recipe
    _keep_recipe_missing(raw, raw_recipe, overrides)
    _check_interpolations(raw)
    _bool_choices_as_strings(raw)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config), raw)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        if key and getattr(e, "object_type", None) is SourceOptions:
            key = _source_key(raw, key) or key  # a mixture entry's key, named by OmegaConf alone
        if "not in struct" in str(e) or "Key '" in str(e) and "not in" in str(e):
            raise _unknown_key_error(key or str(e)) from None
        expected = _expected(key) if key and hasattr(e, "value") else None
        if expected:
            raise ConfigError(f"{key}={e.value!r} is not valid; {expected}") from None
        if key:
            raise ConfigError(f"{key}: {str(e).splitlines()[0]}") from None
        raise _container_mismatch(overrides) or ConfigError(str(e).splitlines()[0]) from None
    for key in OmegaConf.missing_keys(raw):  # merging ??? onto the schema's default keeps the default
        OmegaConf.update(merged, key, "???")
    try:
        missing = OmegaConf.missing_keys(merged)  # resolves every interpolation
    except OmegaConfBaseException as e:  # one whose value the key's type does not take
        raise ConfigError(f"{getattr(e, 'full_key', '') or 'config'}: {str(e).splitlines()[0]}") from None
    required = missing - {"data.path"} if merged.data.sources else missing  # a mixture replaces data.path
    if required and not missing_ok:
        raise ConfigError(f"required key(s) not set: {', '.join(sorted(required))} (set them as key=value)")
    for key in missing:
        OmegaConf.update(merged, key, "")
    cfg = OmegaConf.to_object(merged)
    for key in missing:  # to_yaml prints "???" as OmegaConf's missing marker again
        *parents, leaf = re.findall(r"[^.\[\]]+", key)  # data.path, data.sources[0].path, launcher.env.HF_TOKEN
        node = cfg
        for part in parents:
            node = node[int(part) if isinstance(node, list) else part] if isinstance(node, (list, dict)) else \
                getattr(node, part)
        if isinstance(node, (list, dict)):
            node[int(leaf) if isinstance(node, list) else leaf] = "???"
        else:
            setattr(node, leaf, "???")
    validate(cfg)
    # what config.yaml writes for each interpolated value (see as_written); not a schema field, so a copy made
    # by dataclasses.replace holds the resolved values alone
    cfg._as_written = _interpolations(raw)
    return cfg


def _interpolations(raw) -> dict[str, object]:
    """Dotted key -> value as written, for every value of the composed (unresolved) config that holds an
    interpolation (`${oc.env:WANDB_PROJECT}`, `${data.path}`); a list holding one is kept whole."""
    from omegaconf import OmegaConf

    def walk(node, prefix):
        if isinstance(node, dict):
            for key, value in node.items():
                yield from walk(value, f"{prefix}{key}.")
        elif "${" in str(node):
            yield prefix[:-1], node

    return dict(walk(OmegaConf.to_container(raw, resolve=False), ""))


def as_written(cfg: Config, run_dir: str | None = None, interpolations: bool = True) -> dict:
    """The config as a run dir's config.yaml holds it, a nested dict: interpolated values as the recipe or
    override wrote them, not their values (a secret read from the environment stays there; `interpolations=False`
    gives the values); keys whose valid values are the strings 'true' and 'false' as booleans (YAML's own, as a
    recipe writes them); `run_dir` in place of cfg.run_dir when given."""
    from omegaconf import OmegaConf

    container = OmegaConf.to_container(OmegaConf.structured(cfg))
    if run_dir is not None:
        container["run_dir"] = run_dir
    for key, valid in CHOICES.items():
        section, leaf = _parent(container, key)
        if section[leaf] in ("true", "false") and {"true", "false"} <= set(valid):
            section[leaf] = section[leaf] == "true"
    for key, value in (getattr(cfg, "_as_written", {}) if interpolations else {}).items():
        section, leaf = _parent(container, key)
        section[leaf] = value
    return container


def _parent(container: dict, key: str) -> tuple[dict, str]:
    """The dict that holds dotted `key` in a nested dict, and the key's last part."""
    *parents, leaf = key.split(".")
    for part in parents:
        container = container[part]
    return container, leaf


def _check_interpolations(raw, where: str = "") -> None:
    """Every interpolation of `raw` resolves; one that cannot (an unset environment variable, a missing key) is
    one line naming the key and what it holds."""
    from omegaconf import OmegaConf
    from omegaconf.errors import InterpolationResolutionError

    try:
        OmegaConf.to_container(raw, resolve=True)
    except InterpolationResolutionError as e:
        key = getattr(e, "full_key", None) or "?"
        written = _interpolations(raw).get(key, "")
        reason = str(e).splitlines()[0].removeprefix("KeyError raised while resolving interpolation: ")
        raise ConfigError(f"{key}={written}{where} cannot be resolved: {reason}") from None


def to_yaml(cfg: Config, run_dir: str | None = None, interpolations: bool = True) -> str:
    """The config as YAML, as `as_written` gives it."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.create(as_written(cfg, run_dir, interpolations)))


def load_run_config(run_dir: Path) -> Config:
    """The config a `qwenft train` run wrote to its run dir, its interpolations resolved (and recorded as
    written, as `compose` does)."""
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    path = run_dir / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"run_dir={run_dir} has no config.yaml; give the run dir of a qwenft train run")
    try:
        raw = OmegaConf.load(path)
    except yaml.YAMLError as e:
        raise _yaml_error(e) from None
    _check_interpolations(raw, where=f" (in {path})")
    _bool_choices_as_strings(raw)  # true/false of a key whose valid values are those strings
    try:  # a key this qwenft does not have (a file of another version, or edited), or a value of the wrong type
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), raw))
    except OmegaConfBaseException as e:
        raise ConfigError(f"{path}: {getattr(e, 'full_key', None) or 'config'}: {str(e).splitlines()[0]}") from None
    cfg._as_written = _interpolations(raw)
    return cfg
