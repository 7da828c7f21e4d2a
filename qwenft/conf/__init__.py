"""A run's configuration: the typed schema (schema.py), Hydra composition and YAML I/O (compose.py)."""

from qwenft.conf.compose import (CONF_DIR, GROUPS, RECIPES_ENV, ConfigError, as_written, compose, group_options,
                                 list_recipes, load_run_config, recipe_dirs, to_yaml)

__all__ = ["CONF_DIR", "GROUPS", "RECIPES_ENV", "ConfigError", "as_written", "compose", "group_options",
           "list_recipes", "load_run_config", "recipe_dirs", "to_yaml"]
