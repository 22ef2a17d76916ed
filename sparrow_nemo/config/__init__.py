"""The config layer: how components declare their knobs, and how recipes become typed configs.

- :mod:`.schema`: :func:`knob`, :class:`Section`, value checks, :class:`ConfigError` / :class:`Invalid`;
- :mod:`.yaml_io`: YAML reading with limits (depth, alias expansion, size, duplicate keys, UTF-8);
- :mod:`.compose`: ``defaults:`` inheritance, command-line overrides, the typed build of a root class;
- :mod:`.docs`: the knobs of a class tree and the documented YAML of ``sparrow config show --doc``.

This package imports no component: each component declares its config class next to its code with
these helpers, and the recipe (:mod:`sparrow_nemo.grpo.recipe`) composes them into ``SparrowConfig``.
"""

from sparrow_nemo.config.compose import (
    DEFAULT_RECIPE,
    Override,
    from_dict,
    load,
    recipes_dir,
    resolve_recipe,
)
from sparrow_nemo.config.schema import (
    AT_LEAST_ONE,
    NON_NEGATIVE,
    OPEN_UNIT,
    POSITIVE,
    UNIT,
    ConfigError,
    Invalid,
    Section,
    choices,
    interval,
    knob,
    matching,
    one_of_names,
    suggest,
)

__all__ = [
    "AT_LEAST_ONE",
    "DEFAULT_RECIPE",
    "NON_NEGATIVE",
    "OPEN_UNIT",
    "POSITIVE",
    "UNIT",
    "ConfigError",
    "Invalid",
    "Override",
    "Section",
    "choices",
    "from_dict",
    "interval",
    "knob",
    "load",
    "matching",
    "one_of_names",
    "recipes_dir",
    "resolve_recipe",
    "suggest",
]
