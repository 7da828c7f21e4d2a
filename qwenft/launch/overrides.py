"""The overrides a launcher passes on to the `qwenft train` it starts (`qwenft slurm`'s script, `qwenft train
launcher.nproc_per_node=N`): the user's as typed (Hydra has read them once already), less the keys the launcher
sets itself, which it writes so that Hydra reads back exactly the value it means."""

import re

# characters Hydra reads as part of a bare value; the value must still read back as this string (not 1e3, null)
_BARE = re.compile(r"[A-Za-z0-9_/.@%+:-]+")


def key(override: str) -> str:
    """The key an override sets or deletes: `+a.b=1`, `++a.b=1`, `~a.b` -> `a.b`."""
    return override.lstrip("+~").split("=", 1)[0]


def without(overrides: list[str], *keys: str) -> list[str]:
    """`overrides` less those that set or delete one of `keys`."""
    return [o for o in overrides if key(o) not in keys]


def sets(overrides: list[str], name: str) -> bool:
    """Whether `overrides` set the key `name` (the command line, not the recipe)."""
    return any(key(o) == name and not o.startswith("~") for o in overrides)


def hydra_value(value: str) -> str:
    """`value` as an override's value that Hydra reads back as this very string: bare where Hydra reads it so (a
    plain path, `auto`), else single-quoted. Hydra splits a bare value at spaces, parentheses, brackets, commas
    and quotes; inside quotes it takes `\\'` for a quote and a doubled backslash only before a quote or at the
    end. OmegaConf would resolve a `${...}` in either form: it is written `\\${`, with the backslashes before it
    doubled."""
    if _BARE.fullmatch(value) and _reads_back(value):
        return value
    body = re.sub(r"(\\*)\$\{", lambda m: m[1] * 2 + "\\${", value)
    body = re.sub(r"(\\*)('|$)", lambda m: m[1] * 2 + ("\\'" if m[2] else ""), body)
    return f"'{body}'"


def _reads_back(bare: str) -> bool:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        return OverridesParser.create().parse_override(f"k={bare}").value() == bare
    except HydraException:
        return False
