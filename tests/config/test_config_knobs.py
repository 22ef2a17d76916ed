"""One knob, one place: every recipe key is exactly one documented field of a component's config class."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
from pathlib import Path
from typing import Any, get_origin

import pytest
import yaml

import sparrow_nemo
from sparrow_nemo.cli import main
from sparrow_nemo.config import recipes_dir
from sparrow_nemo.config.docs import Knob, documented_yaml, knobs
from sparrow_nemo.config.schema import Section, field_hints, non_null
from sparrow_nemo.grpo.recipe import SparrowConfig, load_config

KNOBS: dict[str, list[Knob]] = {}
for _knob in knobs(SparrowConfig):
    KNOBS.setdefault(_knob.key, []).append(_knob)


def _free_form(knob: Knob) -> bool:
    """A dict / Any field: the keys below it are the user's (reward options, shape overrides)."""
    tp = non_null(field_hints(knob.owner)[knob.field.name])
    return tp is Any or get_origin(tp) is dict


def _recipe_keys(data: Any, prefix: str = "") -> list[str]:
    """Dotted keys of a recipe file (``defaults`` and list items excluded; the keys below a free-form field
    are checked by the recipe loader, not here)."""
    out = []
    for key, value in data.items():
        if not prefix and key == "defaults":
            continue
        dotted = prefix + str(key)
        out.append(dotted)
        knob = KNOBS.get(dotted, [None])[0]
        if isinstance(value, dict) and not (knob is not None and _free_form(knob)):
            out.extend(_recipe_keys(value, dotted + "."))
    return out


@pytest.mark.parametrize("recipe", sorted(p.name for p in recipes_dir().glob("*.yaml")))
def test_every_recipe_key_is_exactly_one_component_field(recipe: str) -> None:
    data = yaml.safe_load((recipes_dir() / recipe).read_text()) or {}
    for key in _recipe_keys(data):
        found = KNOBS.get(key, [])
        assert len(found) == 1, f"{recipe}: key {key} maps to {len(found)} config fields"


def test_every_knob_is_declared_once_with_its_doc() -> None:
    for key, found in KNOBS.items():
        assert len(found) == 1, key
        assert found[0].doc.strip(), f"{key} has no doc string"


def _config_classes() -> set[type]:
    """Every Section subclass in the package (each module imported)."""
    for info in pkgutil.walk_packages(sparrow_nemo.__path__, "sparrow_nemo."):
        if info.name.startswith(("sparrow_nemo.rollout.trtllm", "sparrow_nemo.kernels")):
            continue  # the TensorRT-LLM modules import their library lazily; they declare no config
        importlib.import_module(info.name)
    seen, todo = set(), [Section]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub.__module__.startswith("sparrow_nemo.") and sub not in seen:
                seen.add(sub)
                todo.append(sub)
    return seen


def test_config_classes_live_with_their_components_not_in_the_config_layer() -> None:
    classes = _config_classes()
    assert not [c for c in classes if c.__module__.startswith("sparrow_nemo.config")]
    owners = {k.owner for k in knobs(SparrowConfig)} | {SparrowConfig}
    # every config class is part of the recipe (no second, mirrored settings class on the side)
    unused = sorted(
        f"{c.__module__}.{c.__qualname__}" for c in classes - owners if not _is_base_of(c, owners)
    )
    assert not unused, f"config classes the recipe does not use: {unused}"


def _is_base_of(cls: type, owners: set[type]) -> bool:
    return any(issubclass(o, cls) for o in owners)


def test_no_field_name_is_declared_twice_along_an_inheritance_chain() -> None:
    for cls in _config_classes():
        own = [f.name for f in dataclasses.fields(cls)]
        assert len(own) == len(set(own)), cls
        for base in cls.__mro__[1:]:
            if dataclasses.is_dataclass(base) and base is not cls:
                redeclared = set(base.__dataclass_fields__) & set(inspect.get_annotations(cls))
                assert not redeclared, f"{cls.__name__} redeclares {redeclared} of {base.__name__}"


def test_documented_yaml_is_the_recipe_with_every_doc_string() -> None:
    config = load_config("tiny_cpu_short")
    text = documented_yaml(config)
    assert yaml.safe_load(text) == config.to_dict()
    for key, (knob,) in KNOBS.items():
        assert f"# {knob.doc}" in text, key


def test_config_show_doc_prints_the_doc_strings(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show", "--doc", "trainer.seed=3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# sparrow config 'tiny_cpu', hash ")
    assert "# global seed (data order, initialisation)\n  seed: 3\n" in out
    assert yaml.safe_load(out) == load_config("tiny_cpu", ["trainer.seed=3"]).to_dict()


def test_registries_name_their_members_and_accept_registrations() -> None:
    from sparrow_nemo.rewards.registry import _REGISTERED, register_reward, reward_names

    assert {"chain", "math", "code"} <= set(reward_names())
    assert "synthetic" not in reward_names()

    @register_reward("test_only_reward")
    def mine(completion: str, answer: str) -> float:
        return float(completion == answer)

    try:
        config = load_config(
            "tiny_cpu_short",
            ["reward.type=test_only_reward", "data.train_path=d/t.jsonl", "control.calibrate=false"],
        )
        assert config.reward.type == "test_only_reward"
    finally:
        _REGISTERED.pop("test_only_reward")
    with pytest.raises(ValueError, match="expected a registered name"):
        load_config(
            "tiny_cpu_short",
            ["reward.type=test_only_reward", "data.train_path=d/t.jsonl", "control.calibrate=false"],
        )


@pytest.mark.parametrize(
    ("entry", "built_by"),
    [
        ("sparrow_nemo.control.SparrowCallback", "control section"),
        ("sparrow_nemo.control.callback.SparrowCallback", "control section"),
        ("sparrow_nemo.grpo.distill.DistillSparse", "distill section"),
    ],
)
def test_a_built_in_callback_under_callbacks_is_an_error(entry: str, built_by: str) -> None:
    with pytest.raises(ValueError) as info:
        load_config("tiny_cpu_short", [f"callbacks=[{{_target_: {entry}}}]"])
    message = str(info.value)
    assert message.startswith(
        f"config error: callbacks.0._target_={entry} (from command line) - expected a user callback: the trainer "
        f"builds {entry.rsplit('.', 1)[1]} itself from the {built_by}"
    )
    assert message.endswith("; remove it from callbacks") and "\n" not in message


def test_a_callback_target_must_import() -> None:
    with pytest.raises(
        ValueError, match=r"callbacks\.0\._target_=my_pkg\.Cb .* expected an importable class"
    ):
        load_config("tiny_cpu_short", ["callbacks=[{_target_: my_pkg.Cb}]"])


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (
            "sparsity.adapt=raise",
            "unknown key 'sparsity.adapt' (from command line) - it moved: control.scheduler.adapt",
        ),
        (
            "sparsity.collapse_guard=false",
            "unknown key 'sparsity.collapse_guard' (from command line) - it moved: control.scheduler.collapse_guard",
        ),
        (
            "sparsity.calibrate=true",
            "unknown key 'sparsity.calibrate' (from command line) - it moved: control.calibrate",
        ),
        (
            "sparsity.calibration.num_prompts=4",
            "unknown key 'sparsity.calibration' (from command line) - it moved: control.calibration",
        ),
        (
            "tail_scheduler.adapt=raise",
            "unknown key 'tail_scheduler' (from command line) - it moved: control.scheduler",
        ),
        (
            "rollout.speculative.draft_tokens=2",
            "unknown key 'rollout.speculative' (from command line) - it moved: control.speculative",
        ),
        (
            "logging.log_every_n_steps=5",
            "unknown key 'logging.log_every_n_steps' (from command line) - it was removed (never read: every step "
            "is logged)",
        ),
        (
            "policy.activation_recompute=true",
            "unknown key 'policy.activation_recompute' (from command line) - it was replaced by "
            "policy.recompute_granularity (true = full)",
        ),
        (
            "reward.type=synthetic",
            "reward.type=synthetic (from command line) - expected a registered name (chain, code, math) "
            "('synthetic' was renamed 'chain')",
        ),
    ],
)
def test_a_renamed_or_removed_key_says_what_became_of_it(override: str, expected: str) -> None:
    with pytest.raises(ValueError) as info:
        load_config("tiny_cpu_short", [override])
    assert str(info.value) == f"config error: {expected}"


def test_a_recipe_file_with_a_moved_key_names_the_file_and_the_new_key(tmp_path: Path) -> None:
    recipe = tmp_path / "old.yaml"
    recipe.write_text("sparsity:\n  adapt: raise\n")
    with pytest.raises(ValueError) as info:
        load_config(str(recipe))
    assert str(info.value).startswith("config error: unknown key 'sparsity.adapt' (from ")
    assert str(recipe) in str(info.value) and str(info.value).endswith("it moved: control.scheduler.adapt")
