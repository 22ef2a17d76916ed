"""Claims (a)-(d): each verdict follows its stated rule on hand-made arm results."""

from __future__ import annotations

from pathlib import Path

import pytest

from sparrow_nemo.experiments.analysis import ArmResult, slope
from sparrow_nemo.experiments.arms import Arm, ArmsSpec
from sparrow_nemo.experiments.claims import (
    INCONCLUSIVE,
    NOT_REPRODUCED,
    REPRODUCED,
    claim_a,
    claim_b,
    claim_c,
    claim_d,
    degradation_tolerance,
)

SPEC = ArmsSpec(
    path=Path("t_arms.yaml"),
    threshold=0.86,
    outcome="accuracy_end",
    degrade_margin=0.05,
    min_bin_tokens=100,
    common=(),
    arms=(),
    smoke_arms=(),
    smoke_overrides=(),
)


def _arm(
    name: str,
    role: str,
    accuracy: float,
    mean: float,
    p5_per_bin: list[float],
    speedup: float = 1.0,
    baseline: str | None = None,
) -> ArmResult:
    bins = {b + 1: {"p5": p5, "mean": mean, "tokens": 500.0} for b, p5 in enumerate(p5_per_bin)}
    bins[0] = {"p5": 0.2, "mean": 0.5, "tokens": 10.0}  # too few tokens: never decides anything
    nan = float("nan")
    return ArmResult(
        arm=Arm(name, role, (), baseline=baseline),
        seeds=[0],
        bin_tokens=16,
        eval_prompts=400,
        train_samples=400,
        accuracy_start=0.5,
        accuracy_end=accuracy,
        accuracy_end_dense=accuracy,
        train_accuracy_last=accuracy,
        train_accuracy_best=accuracy,
        response_length=20.0,
        acceptance_mean=mean,
        acceptance_p5=min(p5_per_bin),
        tokens_per_s=100.0,
        measured_speedup=nan,
        predicted_speedup=speedup,
        final_budgets=[16],
        wall_s=nan,
        cpu_s=nan,
        bins=bins,
    )


DENSE = _arm("dense", "dense", 0.80, 1.0, [1.0, 1.0, 1.0])


def test_slope_and_degradation_tolerance() -> None:
    assert slope([1, 2, 3], [0.9, 0.8, 0.7]) == pytest.approx(-0.1)
    assert slope([1], [0.5]) != slope([1], [0.5])  # NaN with one point
    low = _arm("x", "fixed", 0.70, 0.98, [0.9])
    assert degradation_tolerance(DENSE, low, "accuracy_end", 0.05) == pytest.approx(0.0612, abs=1e-3)  # 2 SE


def test_a_tail_separates_when_the_mean_does_not() -> None:
    stable = _arm("s", "fixed", 0.80, 0.977, [0.95, 0.90, 0.88])
    degrading = _arm("d", "fixed", 0.60, 0.968, [0.95, 0.80, 0.60])
    assert claim_a([DENSE, stable, degrading], SPEC).verdict == REPRODUCED
    # the mean separates as much as the tail: not reproduced
    far = _arm("d", "fixed", 0.60, 0.70, [0.85])
    assert claim_a([DENSE, _arm("s", "fixed", 0.80, 0.99, [0.90]), far], SPEC).verdict == NOT_REPRODUCED
    # nothing degrades: inconclusive, with the reason
    claim = claim_a([DENSE, stable], SPEC)
    assert claim.verdict == INCONCLUSIVE and "no sparse arm is degrading" in claim.why


def test_b_fixed_tail_falls_with_length_and_the_schedule_holds_it() -> None:
    fixed = _arm("f", "fixed", 0.8, 0.9, [0.95, 0.80, 0.60])
    flat = _arm("s", "schedule", 0.8, 0.9, [0.90, 0.89, 0.90])
    assert claim_b([fixed, flat], SPEC).verdict == REPRODUCED
    assert claim_b([_arm("f", "fixed", 0.8, 0.9, [0.9, 0.9, 0.91]), flat], SPEC).verdict == NOT_REPRODUCED
    assert claim_b([fixed, _arm("s", "schedule", 0.8, 0.9, [0.99, 0.8, 0.5])], SPEC).verdict == NOT_REPRODUCED
    assert claim_b([fixed, _arm("s", "schedule", 0.8, 0.9, [0.95])], SPEC).verdict == INCONCLUSIVE


def test_c_tail_above_threshold_predicts_training_like_dense() -> None:
    ok = _arm("ok", "schedule", 0.79, 0.99, [0.90, 0.88])
    bad = _arm("bad", "fixed", 0.55, 0.95, [0.90, 0.60])
    assert claim_c([DENSE, ok, bad], SPEC).verdict == REPRODUCED
    lucky = _arm("lucky", "fixed", 0.80, 0.95, [0.90, 0.60])  # below the threshold but trains like dense
    lost = _arm("lost", "fixed", 0.50, 0.99, [0.95, 0.95])  # passes but degrades
    assert claim_c([DENSE, lucky, lost], SPEC).verdict == NOT_REPRODUCED
    assert claim_c([DENSE, ok, bad, lucky], SPEC).verdict == INCONCLUSIVE
    assert claim_c([DENSE, ok], SPEC).verdict == INCONCLUSIVE


def test_d_distilled_aggressive_arm_reaches_the_threshold_for_more_speedup() -> None:
    base = _arm("f16", "fixed", 0.6, 0.9, [0.9, 0.5], speedup=3.0)
    calibrated = _arm("c86", "schedule", 0.8, 0.99, [0.9, 0.9], speedup=2.0)
    distilled = _arm("d16", "distill", 0.8, 0.99, [0.92, 0.87], speedup=3.0, baseline="f16")
    assert claim_d([DENSE, base, calibrated, distilled], SPEC).verdict == REPRODUCED
    short = _arm("d16", "distill", 0.6, 0.95, [0.9, 0.6], speedup=3.0, baseline="f16")
    claim = claim_d([DENSE, base, calibrated, short], SPEC)
    assert claim.verdict == NOT_REPRODUCED and "+0.100" in claim.numbers
    easy = _arm("f16", "fixed", 0.8, 0.99, [0.9, 0.9], speedup=3.0)
    assert claim_d([DENSE, easy, calibrated, distilled], SPEC).verdict == INCONCLUSIVE
