"""The arms file: which runs an experiment makes, as config overrides on one base recipe.

An arms file (``experiments/tiny_arms.yaml``) is YAML with these keys::

    threshold: 0.86            # the tail every claim is judged against (the paper's)
    outcome: train_accuracy_last   # the accuracy that says whether a run "trains like dense" (analysis.OUTCOMES)
    degrade_margin: 0.05       # accuracy below dense by more than this (or 2 standard errors) = degraded
    min_bin_tokens: 100        # bins with fewer tokens (all steps, all seeds) are left out of the tail tables
    rules: paper               # which claim rules decide: paper (claims.py) | tolerant (tolerant_claims.py)
    equivalence_margin: 0.05   # tolerant rules: equivalence with dense at +- this (held-out accuracy)
    common: [KEY=VALUE, ...]   # overrides for every arm
    arms:
      - name: dense            # folder name: letters, digits, . _ -
        role: dense            # dense | fixed | schedule | distill | inject
        seeds: 8               # optional: this arm runs more seeds than the command's (0 .. 7)
        label: dense rollout   # free text for the report (default: the name)
        baseline: fixed_24     # distill arms only: the same schedule without the adapter
        overrides: [sparsity.schedule=dense]
    smoke:                     # the cut-down pipeline check (`--smoke`)
      arms: [dense, fixed_16]
      overrides: [trainer.max_steps=2, ...]

Overrides are the command line's ``key=value`` strings (quote a value with ``: `` in it, and write
``control.scheduler.adapt='off'`` so YAML keeps it a string). The run of arm A with seed S is the base recipe, then
``common``, then A's overrides, then the command line's, then the smoke overrides, then ``rollout.seed=S``:
every arm gets the same seeds, and an arm may not set the seed or the step count itself.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparrow_nemo.config import ConfigError
from sparrow_nemo.config.yaml_io import YamlProblem, load_yaml
from sparrow_nemo.grpo.recipe import SparrowConfig, load_config

__all__ = ["OUTCOMES", "ROLES", "RULES", "Arm", "ArmsError", "ArmsSpec", "arm_config", "load_arms"]

#: What an arm stands for in the claims: the dense reference, a constant budget, a length-dependent
#: (calibrated) schedule, a schedule with the DistillSparse adapter, or dense decoding with mismatch
#: injected (``rollout.inject_mismatch``).
ROLES: tuple[str, ...] = ("dense", "fixed", "schedule", "distill", "inject")
#: Claim rules an arms file may name (``rules``): the earlier grids' (:mod:`.claims`) or the tolerant
#: miniature's (:mod:`.tolerant_claims`).
RULES: tuple[str, ...] = ("paper", "tolerant")
#: Keys an arm may not override: they must be equal in every arm (the runner sets the seed).
_SHARED_KEYS: tuple[str, ...] = ("trainer.max_steps", "trainer.seed", "rollout.seed")
#: Accuracies that can decide "trains like dense": the training rollouts' accuracy over the last 5 steps
#: (sparse rollouts, the same prompts in every arm: the most samples), or the held-out accuracy at the end
#: with the arm's own rollout schedule or decoded dense.
OUTCOMES: tuple[str, ...] = ("train_accuracy_last", "accuracy_end", "accuracy_end_dense")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class ArmsError(ValueError):
    """The arms file is invalid; the message is one line naming the file and the key."""


@dataclass(frozen=True)
class Arm:
    """One arm: a name, its role in the claims and its overrides (``key=value`` strings)."""

    name: str
    role: str
    overrides: tuple[str, ...]
    label: str = ""
    baseline: str | None = None
    seeds: int | None = None

    @property
    def title(self) -> str:
        """The label, or the name when there is none."""
        return self.label or self.name

    def seeds_for(self, seeds: Sequence[int], smoke: bool = False) -> list[int]:
        """The arm's seeds: the command's, continued (largest + 1, ...) up to ``self.seeds`` (not in a smoke)."""
        out = list(seeds)
        extra = 0 if smoke or self.seeds is None else self.seeds - len(out)
        start = max(out, default=-1) + 1
        return out + list(range(start, start + max(extra, 0)))


@dataclass(frozen=True)
class ArmsSpec:
    """A parsed arms file (see the module docstring for the keys)."""

    path: Path
    threshold: float
    outcome: str
    degrade_margin: float
    min_bin_tokens: int
    common: tuple[str, ...]
    arms: tuple[Arm, ...]
    smoke_arms: tuple[str, ...]
    smoke_overrides: tuple[str, ...]
    rules: str = "paper"
    equivalence_margin: float = 0.05

    @property
    def prefix(self) -> str:
        """Output name stem: ``tiny_arms.yaml`` -> ``tiny`` (report ``tiny_report.md``, ``tiny_runs/``)."""
        stem = self.path.stem
        return stem.removesuffix("_arms") or stem

    def arm(self, name: str) -> Arm:
        """The arm called ``name`` (ArmsError listing the names otherwise)."""
        for arm in self.arms:
            if arm.name == name:
                return arm
        raise ArmsError(f"{self.path}: no arm '{name}'; arms: {', '.join(a.name for a in self.arms)}")

    def selected(self, smoke: bool) -> tuple[Arm, ...]:
        """All arms, or the smoke subset in file order."""
        if not smoke:
            return self.arms
        return tuple(a for a in self.arms if a.name in self.smoke_arms)


def _strings(value: Any, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ArmsError(f"{where}: expected a list of 'key=value' strings, got {value!r}")
    return tuple(value)


def _number(data: dict[str, Any], key: str, default: float, path: Path, lo: float, hi: float) -> float:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
        raise ArmsError(f"{path}: {key}={value!r} - expected a number in [{lo:g}, {hi:g}]")
    return float(value)


def _parse_arm(entry: Any, index: int, path: Path) -> Arm:
    where = f"{path}: arms[{index}]"
    if not isinstance(entry, dict):
        raise ArmsError(f"{where}: expected a mapping with name, role and overrides")
    unknown = set(entry) - {"name", "role", "label", "baseline", "overrides", "seeds"}
    if unknown:
        raise ArmsError(
            f"{where}: unknown keys {sorted(unknown)}; allowed: name, role, label, baseline, overrides, seeds"
        )
    seeds = entry.get("seeds")
    if seeds is not None and (isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1):
        raise ArmsError(f"{where}: seeds={seeds!r} - expected an integer >= 1")
    name = entry.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ArmsError(f"{where}: name={name!r} - expected letters, digits, . _ - (a folder name)")
    role = entry.get("role")
    if role not in ROLES:
        raise ArmsError(f"{where} ({name}): role={role!r} - expected one of {', '.join(ROLES)}")
    overrides = _strings(entry.get("overrides"), f"{where} ({name}).overrides")
    for text in overrides:
        key = text.lstrip("+").split("=", 1)[0]
        if key in _SHARED_KEYS:
            raise ArmsError(
                f"{where} ({name}): overrides {key}, which must be equal in every arm "
                "(set it in 'common' or on the command line)"
            )
    baseline = entry.get("baseline")
    if (role == "distill") != (baseline is not None):
        raise ArmsError(
            f"{where} ({name}): 'baseline' (an arm name) is required for role distill and only there"
        )
    return Arm(name, role, overrides, str(entry.get("label") or ""), baseline, seeds)


def load_arms(path: str | Path) -> ArmsSpec:
    """Parse and check an arms file; ArmsError (one line) on any problem."""
    path = Path(path)
    try:  # the recipes' YAML: 1.2 booleans (true/false only), bounded nesting and size, no duplicate keys
        data = load_yaml(path.read_text())
    except OSError as exc:
        raise ArmsError(f"cannot read arms file {path}: {exc.strerror}") from None
    except YamlProblem as problem:
        raise ArmsError(f"invalid YAML in arms file {path}{problem.where()}: {problem.problem}") from None
    if not isinstance(data, dict):
        raise ArmsError(f"{path}: expected a mapping with 'arms' at the top level")
    allowed = {"threshold", "outcome", "degrade_margin", "min_bin_tokens", "common", "arms", "smoke"}
    allowed |= {"rules", "equivalence_margin"}
    unknown = set(data) - allowed
    if unknown:
        raise ArmsError(f"{path}: unknown keys {sorted(unknown)}; allowed: {', '.join(sorted(allowed))}")
    entries = data.get("arms")
    if not isinstance(entries, list) or not entries:
        raise ArmsError(f"{path}: 'arms' must be a non-empty list of arms")
    arms = tuple(_parse_arm(e, i, path) for i, e in enumerate(entries))
    names = [a.name for a in arms]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ArmsError(f"{path}: arm names must be unique, repeated: {', '.join(duplicates)}")
    for arm in arms:
        if arm.baseline is not None and arm.baseline not in names:
            raise ArmsError(f"{path}: arm {arm.name}: baseline '{arm.baseline}' is not an arm")
    outcome = data.get("outcome", "train_accuracy_last")
    if outcome not in OUTCOMES:
        raise ArmsError(f"{path}: outcome={outcome!r} - expected one of {', '.join(OUTCOMES)}")
    smoke = data.get("smoke") or {}
    if not isinstance(smoke, dict) or set(smoke) - {"arms", "overrides"}:
        raise ArmsError(f"{path}: 'smoke' must be a mapping with 'arms' (names) and 'overrides'")
    smoke_arms = _strings(smoke.get("arms"), f"{path}: smoke.arms")
    missing = [n for n in smoke_arms if n not in names]
    if missing:
        raise ArmsError(f"{path}: smoke.arms names unknown arms: {', '.join(missing)}")
    rules = data.get("rules", "paper")
    if rules not in RULES:
        raise ArmsError(f"{path}: rules={rules!r} - expected one of {', '.join(RULES)}")
    min_tokens = data.get("min_bin_tokens", 100)
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 1:
        raise ArmsError(f"{path}: min_bin_tokens={min_tokens!r} - expected an integer >= 1")
    return ArmsSpec(
        path=path,
        threshold=_number(data, "threshold", 0.86, path, 0.0, 1.0),
        outcome=outcome,
        degrade_margin=_number(data, "degrade_margin", 0.05, path, 0.0, 1.0),
        min_bin_tokens=min_tokens,
        common=_strings(data.get("common"), f"{path}: common"),
        arms=arms,
        smoke_arms=smoke_arms or names,
        smoke_overrides=_strings(smoke.get("overrides"), f"{path}: smoke.overrides"),
        rules=rules,
        equivalence_margin=_number(data, "equivalence_margin", 0.05, path, 0.0, 1.0),
    )


def arm_config(
    recipe: str | Path | None,
    spec: ArmsSpec,
    arm: Arm,
    seed: int,
    extra: Sequence[str] = (),
    smoke: bool = False,
) -> SparrowConfig:
    """The resolved config of one arm/seed run (override order in the module docstring).

    Raises ArmsError naming the arm when an override is invalid.
    """
    layers = [
        *spec.common,
        *arm.overrides,
        *extra,
        *(spec.smoke_overrides if smoke else ()),
        f"rollout.seed={seed}",
    ]
    try:
        return load_config(recipe, [*layers, f"name={arm.name}"])
    except ConfigError as exc:
        raise ArmsError(f"{spec.path}: arm {arm.name}: {exc}") from None
