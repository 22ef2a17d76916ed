"""The tolerant miniature's rules (tolerant_claims.py) on constructed per-seed results: each claim's verdict
for results built to pass and built to fail; the statistics they use against known values."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from sparrow_nemo.experiments.analysis import ArmResult, SeedResult
from sparrow_nemo.experiments.arms import Arm, load_arms
from sparrow_nemo.experiments.claims import INCONCLUSIVE, NOT_REPRODUCED, REPRODUCED
from sparrow_nemo.experiments.stats import auc, holm, paired, t_sf
from sparrow_nemo.experiments.tolerant_claims import (
    claim_a,
    claim_c,
    claim_d,
    collapsed,
    evaluate_claims,
    fitted_threshold,
)

REPO = Path(__file__).resolve().parents[2]
SPEC = dataclasses.replace(load_arms(REPO / "experiments" / "tolerant_arms.yaml"), min_bin_tokens=100)
SEEDS = range(6)
NOISE = [0.01, -0.012, 0.004, -0.006, 0.011, -0.007]  # per-seed scatter of an outcome difference
DENSE_ACC = [0.50, 0.42, 0.55, 0.47, 0.52, 0.45]


def _seed(
    seed: int, acc: float, p5: float, mean: float, collapse: bool, late_p5: float, speedup: float
) -> SeedResult:
    return SeedResult(
        seed=seed,
        accuracy_end_dense=acc,
        reward_end_dense=acc,
        accuracy_start_dense=0.45,
        reward_first=0.5,
        reward_last=0.2 if collapse else 0.6,
        length_first=400.0,
        length_last=400.0,
        acceptance_mean=mean,
        min_p5=p5,
        late_min_p5=late_p5,
        predicted_speedup=speedup * (1 + NOISE[seed]),
    )


def _arm(
    name: str,
    role: str,
    delta: float = 0.0,
    p5: float = 1.0,
    mean: float = 1.0,
    collapse: bool = False,
    overrides: tuple[str, ...] = (),
    late_p5: float | None = None,
    speedup: float = 1.0,
    baseline: str | None = None,
) -> ArmResult:
    nan = math.nan
    per_seed = [
        _seed(
            s,
            DENSE_ACC[s] + delta + (NOISE[s] if role != "dense" else 0.0),
            p5,
            mean,
            collapse,
            p5 if late_p5 is None else late_p5,
            speedup,
        )
        for s in SEEDS
    ]
    return ArmResult(
        arm=Arm(name, role, overrides, baseline=baseline),
        seeds=list(SEEDS),
        bin_tokens=256,
        eval_prompts=128 * 6,
        train_samples=32 * 5 * 6,
        accuracy_start=0.45,
        accuracy_end=0.5 + delta,
        accuracy_end_dense=0.5 + delta,
        train_accuracy_last=nan,
        train_accuracy_best=nan,
        response_length=400.0,
        acceptance_mean=mean,
        acceptance_p5=p5,
        tokens_per_s=nan,
        measured_speedup=nan,
        predicted_speedup=speedup,
        final_budgets=[128],
        wall_s=nan,
        cpu_s=nan,
        bins={
            1: {"p5": p5, "mean": mean, "tokens": 5000.0},
            2: {"p5": min(1.0, p5 + 0.02), "mean": mean, "tokens": 5000.0},
        },
        per_seed=per_seed,
    )


DENSE = _arm("dense", "dense")


def _tau(t: float) -> tuple[str, ...]:
    return ("control.calibrate=true", f"sparsity.threshold={t}")


def test_statistics_against_known_values() -> None:
    assert t_sf(2.0, 4) == pytest.approx(0.0580583, abs=1e-6)
    assert t_sf(3.0, 20) == pytest.approx(0.0035379, abs=1e-6)
    assert t_sf(-1.5, 9) == pytest.approx(1 - t_sf(1.5, 9), abs=1e-12)
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert auc([0.1, 0.2, 0.9, 0.8], [True, True, False, False]) == 1.0
    assert auc([0.9, 0.1, 0.2, 0.8], [True, True, False, False]) == 0.5
    same = paired([0.5 + n for n in NOISE], [0.5] * 6, 0.05)
    assert same.p_equivalent < 0.01 and same.p_inferior > 0.5
    worse = paired([0.35 + n for n in NOISE], [0.5] * 6, 0.05)
    assert worse.p_equivalent > 0.5 and worse.p_inferior < 0.01


def test_collapse_definition() -> None:
    ok = _seed(0, 0.5, 1.0, 1.0, False, 1.0, 1.0)
    assert not collapsed(ok)
    assert collapsed(_seed(0, 0.5, 1.0, 1.0, True, 1.0, 1.0))  # reward fell by 0.3 > 0.15
    assert collapsed(dataclasses.replace(ok, length_last=900.0))  # runaway responses
    assert not collapsed(dataclasses.replace(ok, reward_last=0.4, length_last=700.0))


def _triad(low_delta: float) -> list[ArmResult]:
    return [
        _arm("inject_p5_080", "inject", delta=low_delta, p5=0.80, mean=0.98),
        _arm("inject_p5_090", "inject", delta=low_delta / 2, p5=0.90, mean=0.98),
        _arm("inject_p5_100", "inject", delta=0.0, p5=1.0, mean=0.981),
    ]


def test_a_reproduced_when_p5_predicts_collapse_and_splits_the_matched_mean_triad() -> None:
    arms = [
        DENSE,
        _arm("fixed_64", "fixed", -0.2, p5=0.40, mean=0.985, collapse=True),
        _arm("fixed_80", "fixed", -0.2, p5=0.50, mean=0.965, collapse=True),
        _arm("fixed_128", "fixed", 0.0, p5=0.92, mean=0.975),
        _arm("fixed_160", "fixed", 0.0, p5=0.95, mean=0.97),
        *_triad(-0.12),
    ]
    claim = claim_a(arms, SPEC)
    assert claim.verdict == REPRODUCED, claim.numbers
    assert "AUC p5 1.000 vs mean 0.500" in claim.numbers


def test_a_not_reproduced_when_the_mean_predicts_and_the_triad_does_not_split() -> None:
    arms = [
        DENSE,
        _arm("fixed_64", "fixed", -0.2, p5=0.95, mean=0.90, collapse=True),
        _arm("fixed_80", "fixed", -0.2, p5=0.40, mean=0.91, collapse=True),
        _arm("fixed_128", "fixed", 0.0, p5=0.50, mean=0.99),
        _arm("fixed_160", "fixed", 0.0, p5=0.92, mean=0.995),
        *_triad(0.0),
    ]
    assert claim_a(arms, SPEC).verdict == NOT_REPRODUCED


def test_c_reproduced_when_tau_086_092_are_equivalent_and_the_cut_sits_near_086() -> None:
    arms = [
        DENSE,
        _arm("calib_0.86", "schedule", 0.0, p5=0.88, overrides=_tau(0.86)),
        _arm("calib_0.92", "schedule", 0.0, p5=0.93, overrides=_tau(0.92)),
        _arm("calib_0.75", "schedule", -0.15, p5=0.76, overrides=_tau(0.75)),
        _arm("fixed_80", "fixed", -0.15, p5=0.82),
    ]
    claim = claim_c(arms, SPEC)
    assert claim.verdict == REPRODUCED, claim.numbers
    assert "fitted cut 0.850 (0 of 24 runs misclassified)" in claim.numbers


def test_c_not_reproduced_when_tau_086_is_inferior_or_the_cut_is_far() -> None:
    inferior = [
        DENSE,
        _arm("calib_0.86", "schedule", -0.15, p5=0.88, overrides=_tau(0.86)),
        _arm("fixed_80", "fixed", -0.15, p5=0.82),
    ]
    assert claim_c(inferior, SPEC).verdict == NOT_REPRODUCED
    far = [  # runs far below 0.86 train like dense: they separate at ~0.55
        DENSE,
        _arm("calib_0.86", "schedule", 0.0, p5=0.88, overrides=_tau(0.86)),
        _arm("fixed_96", "fixed", 0.0, p5=0.60),
        _arm("fixed_64", "fixed", -0.2, p5=0.50),
    ]
    claim = claim_c(far, SPEC)
    assert claim.verdict == NOT_REPRODUCED and "below 0.86" in claim.why
    assert fitted_threshold([(0.5, True), (0.6, False), (0.88, False)], 0.86) == (pytest.approx(0.55), 0)


def test_c_inconclusive_without_a_degraded_run() -> None:
    arms = [DENSE, _arm("calib_0.86", "schedule", 0.0, p5=0.88, overrides=_tau(0.86))]
    assert claim_c(arms, SPEC).verdict == INCONCLUSIVE


def test_d_reproduced_when_distilled_080_reaches_086_faster_than_the_086_schedule() -> None:
    reference = _arm("calib_0.86", "schedule", 0.0, p5=0.88, overrides=_tau(0.86), speedup=1.30)
    base = _arm("calib_0.80", "schedule", -0.05, p5=0.81, overrides=_tau(0.80), speedup=1.50)
    good = _arm("distill_0.80", "distill", 0.0, p5=0.84, late_p5=0.87, speedup=1.50, baseline="calib_0.80")
    claim = claim_d([DENSE, reference, base, good], SPEC)
    assert claim.verdict == REPRODUCED, claim.numbers
    short = dataclasses.replace(
        good, per_seed=[dataclasses.replace(s, late_min_p5=0.80) for s in good.per_seed]
    )
    assert claim_d([DENSE, reference, base, short], SPEC).verdict == NOT_REPRODUCED
    slower = _arm("distill_0.80", "distill", 0.0, p5=0.84, late_p5=0.87, speedup=1.20, baseline="calib_0.80")
    assert claim_d([DENSE, reference, base, slower], SPEC).verdict == NOT_REPRODUCED


def test_one_seed_decides_nothing() -> None:
    one = [
        dataclasses.replace(a, per_seed=a.per_seed[:1])
        for a in (DENSE, _arm("calib_0.86", "schedule", 0.0, p5=0.88, overrides=_tau(0.86)))
    ]
    assert [c.verdict for c in evaluate_claims(one, SPEC)] == [INCONCLUSIVE] * 4
