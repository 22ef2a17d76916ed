"""The arms file: the shipped one resolves for every arm; bad files are one-line errors naming the key."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from sparrow_nemo import cli
from sparrow_nemo.config.yaml_io import dump_yaml
from sparrow_nemo.experiments.arms import ArmsError, arm_config, load_arms
from sparrow_nemo.experiments.runner import plan_runs, run_folder
from sparrow_nemo.grpo.recipe import SparrowConfig

SHIPPED = Path(__file__).resolve().parents[2] / "experiments" / "tiny_arms.yaml"
LONG = SHIPPED.with_name("long_arms.yaml")


def test_shipped_arms_resolve_with_the_same_seed_and_steps() -> None:
    spec = load_arms(SHIPPED)
    assert spec.prefix == "tiny" and {a.role for a in spec.arms} == {"dense", "fixed", "schedule", "distill"}
    configs = {a.name: arm_config("tiny_cpu_short_smoke", spec, a, seed=3) for a in spec.arms}
    assert {c.rollout.seed for c in configs.values()} == {3}
    assert len({c.trainer.max_steps for c in configs.values()}) == 1
    assert configs["dense"].sparsity.build_schedule().is_dense
    assert configs["fixed_16"].sparsity.build_schedule().budgets == (16,)
    assert configs["distill_24"].distill.enabled and not configs["fixed_24"].distill.enabled
    assert configs["distill_24"].sparsity.build_schedule().budgets == (24,)
    assert configs["calib_0.70"].control.calibrate and configs["calib_0.70"].sparsity.threshold == 0.7
    assert all(c.sparsity.page_size == 4 and not c.control.scheduler.collapse_guard for c in configs.values())
    smoke = arm_config("tiny_cpu_short_smoke", spec, spec.arm("dense"), seed=0, smoke=True)
    assert smoke.trainer.max_steps == 2
    assert [a.name for a in spec.selected(smoke=True)] == list(spec.smoke_arms)


def test_long_arms_resolve_on_the_default_recipe() -> None:
    """The long-context experiment (docs/experiments.md): every arm on ``tiny_cpu``, the paper's 16-token pages,
    the fixed budgets as named, the calibrated arms at their thresholds and quantiles."""
    spec = load_arms(LONG)
    assert spec.prefix == "long" and {a.role for a in spec.arms} == {"dense", "fixed", "schedule", "distill"}
    configs = {a.name: arm_config("tiny_cpu", spec, a, seed=1) for a in spec.arms}
    assert {c.rollout.seed for c in configs.values()} == {1}
    assert len({c.trainer.max_steps for c in configs.values()}) == 1
    assert all(
        c.sparsity.page_size == 16 and not c.control.scheduler.collapse_guard for c in configs.values()
    )
    assert all(c.sparsity.dense_layers == 0 for c in configs.values())  # as the committed report measured
    assert configs["dense"].sparsity.build_schedule().is_dense
    for budget in (512, 256, 128):
        assert configs[f"fixed_{budget}"].sparsity.build_schedule().budgets == (budget,)
    assert configs["distill_128"].distill.enabled and configs[
        "distill_128"
    ].sparsity.build_schedule().budgets == (128,)
    calibrated = {n: c for n, c in configs.items() if n.startswith("calib_")}
    assert {(c.sparsity.threshold, c.sparsity.quantile) for c in calibrated.values()} == {
        (0.86, 0.01),
        (0.7, 0.01),
        (0.86, 0.05),
    }
    assert all(c.control.calibrate for c in calibrated.values())


def test_tolerant_arms_resolve_on_the_tolerant_recipe() -> None:
    """The tolerant grid (issue 39): the paper's geometry scaled down in every arm, the 1.25x ladder, the
    matched-mean injected arms, the calibrated taus, DistillSparse at <= 10x the policy's lr, 8 seeds for dense
    and tau 0.86 and 5 for the rest, the tolerant rules on the dense-decoded final weights."""
    spec = load_arms(LONG.with_name("tolerant_arms.yaml"))
    assert (spec.prefix, spec.rules, spec.outcome, spec.equivalence_margin) == (
        "tolerant",
        "tolerant",
        "accuracy_end_dense",
        0.05,
    )
    configs = {a.name: arm_config("tiny_cpu_tolerant", spec, a, seed=2) for a in spec.arms}
    for c in configs.values():
        assert (c.sparsity.page_score, c.sparsity.dense_layers, c.sparsity.page_size) == ("centroid", 1, 16)
        assert c.task.fact_copies == 2 and c.task.any_order and c.task.max_wrong == 2
        assert c.rollout.logprobs_topk >= c.model.shape().vocab_size  # exact alpha
        assert not c.control.scheduler.collapse_guard and c.rollout.seed == 2
    ladder = sorted(c.sparsity.budgets[0] for n, c in configs.items() if n.startswith("fixed_"))
    assert all(1.15 <= b / a <= 1.35 for a, b in itertools.pairwise(ladder)), ladder
    inject = {n: c.rollout.inject_mismatch for n, c in configs.items() if n.startswith("inject_")}
    assert len(inject) == 3 and all(abs(i.fraction * i.mix - 0.02) < 1e-9 for i in inject.values())
    taus = {c.sparsity.threshold for n, c in configs.items() if n.startswith("calib_")}
    assert taus == {0.75, 0.80, 0.86, 0.92}
    distill = configs["distill_0.80"]
    assert (
        distill.distill.enabled and distill.distill.lr_multiplier <= 10 and distill.sparsity.threshold == 0.80
    )
    seeds = {a.name: len(a.seeds_for(range(5))) for a in spec.arms}
    assert seeds.pop("dense") == seeds.pop("calib_0.86") == 8 and set(seeds.values()) == {5}
    assert all(len(a.seeds_for([0], smoke=True)) == 1 for a in spec.arms)


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "x_arms.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("arms: []", r"'arms' must be a non-empty list"),
        ("arms: [{name: a, role: sparse}]", r"arms\[0\] \(a\): role='sparse' - expected one of dense, fixed"),
        (
            "arms: [{name: a, role: fixed, overrides: [rollout.seed=3]}]",
            r"overrides rollout.seed, which must be equal",
        ),
        ("arms: [{name: a, role: distill}]", r"'baseline' \(an arm name\) is required for role distill"),
        ("arms: [{name: a, role: distill, baseline: b}]", r"baseline 'b' is not an arm"),
        ("arms: [{name: a, role: dense}, {name: a, role: dense}]", r"repeated: a"),
        ("arms: [{name: a, role: dense, budget: 3}]", r"unknown keys \['budget'\]"),
        ("threshold: 2\narms: [{name: a, role: dense}]", r"threshold=2 - expected a number in \[0, 1\]"),
        ("arms: [{name: a, role: dense}]\nsmoke: {arms: [b]}", r"smoke.arms names unknown arms: b"),
        ("arms: [\n", r"invalid YAML in arms file .*x_arms.yaml line"),
        (
            "rules: strict\narms: [{name: a, role: dense}]",
            r"rules='strict' - expected one of paper, tolerant",
        ),
        ("arms: [{name: a, role: dense, seeds: 0}]", r"arms\[0\]: seeds=0 - expected an integer >= 1"),
    ],
)
def test_bad_arms_file_is_a_one_line_error(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ArmsError, match=message) as info:
        load_arms(_write(tmp_path, text))
    assert "\n" not in str(info.value)


def test_bad_override_names_the_arm_and_the_key(tmp_path: Path) -> None:
    spec = load_arms(_write(tmp_path, "arms: [{name: a, role: fixed, overrides: [sparsity.treshold=0.9]}]"))
    with pytest.raises(
        ArmsError, match=r"arm a: config error: unknown key 'sparsity.treshold'.*sparsity.threshold"
    ):
        arm_config("tiny_cpu_short_smoke", spec, spec.arm("a"), seed=0)


def test_cli_reports_a_bad_arms_file_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["experiment", "--arms", str(tmp_path / "none.yaml"), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sparrow experiment: cannot read arms file") and err.count("\n") == 1
    assert not list(tmp_path.iterdir())  # nothing written


def test_a_finished_run_made_with_another_config_is_refused(tmp_path: Path) -> None:
    spec = load_arms(SHIPPED)
    (plan,) = plan_runs("tiny_cpu_short_smoke", spec, [0], tmp_path, smoke=True)[:1]
    assert not plan.done and plan.folder == run_folder(tmp_path, "dense", 0)
    plan.folder.mkdir(parents=True)
    (plan.folder / "summary.json").write_text("{}")
    (plan.folder / "config.yaml").write_text("# sparrow config 'dense', hash 0\n")
    with pytest.raises(ArmsError, match=r"seed_0 was made with another config than arm dense now gives"):
        plan_runs("tiny_cpu_short_smoke", spec, [0], tmp_path, smoke=True)


def test_a_finished_run_is_compared_knob_by_knob(tmp_path: Path) -> None:
    """A knob added since the run (absent from its config.yaml) matches at its default; any other change,
    a changed value, an added knob off its default or a removed knob, is refused naming the key."""
    spec = load_arms(SHIPPED)
    (plan,) = plan_runs("tiny_cpu_short_smoke", spec, [0], tmp_path, smoke=True)[:1]
    plan.folder.mkdir(parents=True)
    (plan.folder / "summary.json").write_text("{}")
    stored = plan.config.to_dict()

    def refusal(tree: dict) -> str | None:
        (plan.folder / "config.yaml").write_text(dump_yaml(tree))
        try:
            plan_runs("tiny_cpu_short_smoke", spec, [0], tmp_path, smoke=True)
        except ArmsError as err:
            return str(err)
        return None

    assert refusal(stored) is None
    assert plan.config.distill.seed == SparrowConfig().distill.seed
    del stored["distill"]["seed"]  # a knob the run predates, at its default
    assert refusal(stored) is None
    stored["trainer"]["max_steps"] += 1
    assert "(trainer.max_steps: " in refusal(stored)
    stored["trainer"]["max_steps"] -= 1
    stored["distill"]["gone"] = 1
    assert "(distill.gone: no longer a knob)" in refusal(stored)
    del stored["distill"]["gone"]
    assert plan.config.rollout.max_new_tokens != SparrowConfig().rollout.max_new_tokens
    del stored["rollout"]["max_new_tokens"]
    assert "(rollout.max_new_tokens: absent -> " in refusal(stored)
