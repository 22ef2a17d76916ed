"""The paper's claims (a)-(d) (docs/METHOD.md), each decided from the arms' numbers by a stated rule.

Every :class:`Claim` carries the numbers it was decided on, the rule, the verdict ("reproduced",
"not reproduced" or "inconclusive") and, when the toy disagrees, the reasons that may explain it. The
verdict is computed here; nothing in the report is hand-written about a particular run.

"Degraded" (the training outcome) is decided against the dense arm: an arm degraded when its outcome
accuracy (``outcome`` in the arms file) is below the dense arm's by more than ``max(degrade_margin,
2 standard errors of the difference)``, the standard error from the binomial variance of both accuracies
over their samples (held-out prompts, or training rollouts of the last steps) x seeds. "Passes the tail" means every decided bin's pooled p5 >= threshold.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from sparrow_nemo.experiments.analysis import ArmResult
from sparrow_nemo.experiments.arms import ArmsSpec

__all__ = ["Claim", "degradation_tolerance", "evaluate_claims"]

REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE = "reproduced", "not reproduced", "inconclusive"
#: (b): a p5 slope (per bin) at or above -FLAT counts as flat.
FLAT = 0.01
#: (a): the tail must separate the groups this many times better than the mean.
SEPARATION_RATIO = 3.0


@dataclass(frozen=True)
class Claim:
    """One claim: its letter, the paper's statement, the numbers, the rule, the verdict, the caveats."""

    letter: str
    statement: str
    numbers: str
    rule: str
    verdict: str
    why: str = ""


def degradation_tolerance(dense: ArmResult, arm: ArmResult, outcome: str, margin: float) -> float:
    """Accuracy drop below dense that counts as degraded: max(margin, 2 SE of the difference)."""
    (p, n), (q, m) = dense.outcome(outcome), arm.outcome(outcome)
    se = math.sqrt(p * (1 - p) / n + q * (1 - q) / m)
    return max(margin, 2.0 * se)


def _degraded(dense: ArmResult, arm: ArmResult, spec: ArmsSpec) -> bool:
    drop = dense.outcome(spec.outcome)[0] - arm.outcome(spec.outcome)[0]
    return drop > degradation_tolerance(dense, arm, spec.outcome, spec.degrade_margin)


def _passes(arm: ArmResult, spec: ArmsSpec) -> bool:
    return arm.min_p5(spec.min_bin_tokens) >= spec.threshold


def _fmt(x: float, spec: str = ".3f") -> str:
    return "n/a" if x is None or not math.isfinite(x) else format(x, spec)


def _names(arms: Sequence[ArmResult]) -> str:
    return ", ".join(a.arm.name for a in arms) or "none"


def _dense(results: Sequence[ArmResult]) -> ArmResult | None:
    return next((r for r in results if r.arm.role == "dense"), None)


def _sparse(results: Sequence[ArmResult]) -> list[ArmResult]:
    return [r for r in results if r.arm.role != "dense"]


def claim_a(results: Sequence[ArmResult], spec: ArmsSpec) -> Claim:
    """(a) the mean acceptance barely separates stable from degrading arms; the per-bin p5 does."""
    statement = "mean acceptance barely separates stable from degrading budgets; the 5th percentile does"
    rule = (
        f"groups by outcome ({spec.outcome} vs dense). Reproduced when both groups exist, the lowest-bin p5 "
        f"splits them perfectly and its gap between group means is >= {SEPARATION_RATIO:g}x the gap of the "
        "mean acceptance; not reproduced when the p5 gap is <= the mean gap; otherwise inconclusive"
    )
    dense = _dense(results)
    if dense is None:
        return Claim("a", statement, "no dense arm", rule, INCONCLUSIVE, "the outcome needs a dense arm")
    stable = [r for r in _sparse(results) if not _degraded(dense, r, spec)]
    degrading = [r for r in _sparse(results) if _degraded(dense, r, spec)]
    per_arm = "; ".join(
        f"{r.arm.name}: mean {_fmt(r.acceptance_mean)}, p5 {_fmt(r.min_p5(spec.min_bin_tokens))}"
        for r in (*stable, *degrading)
    )
    if not stable or not degrading:
        empty = "degrading" if not degrading else "stable"
        return Claim(
            "a",
            statement,
            f"stable: {_names(stable)}; degrading: {_names(degrading)} ({per_arm})",
            rule,
            INCONCLUSIVE,
            f"no sparse arm is {empty} on this toy within the step budget, so there is nothing to separate",
        )
    mean_s = sum(r.acceptance_mean for r in stable) / len(stable)
    mean_d = sum(r.acceptance_mean for r in degrading) / len(degrading)
    p5_s = sum(r.min_p5(spec.min_bin_tokens) for r in stable) / len(stable)
    p5_d = sum(r.min_p5(spec.min_bin_tokens) for r in degrading) / len(degrading)
    gap_mean, gap_p5 = mean_s - mean_d, p5_s - p5_d
    split = min(r.min_p5(spec.min_bin_tokens) for r in stable) > max(
        r.min_p5(spec.min_bin_tokens) for r in degrading
    )
    mean_split = min(r.acceptance_mean for r in stable) > max(r.acceptance_mean for r in degrading)
    numbers = (
        f"stable ({_names(stable)}): mean {_fmt(mean_s)}, p5 {_fmt(p5_s)}; degrading ({_names(degrading)}): "
        f"mean {_fmt(mean_d)}, p5 {_fmt(p5_d)}; gap mean {_fmt(gap_mean)} vs gap p5 {_fmt(gap_p5)}; "
        f"p5 splits the groups: {'yes' if split else 'no'}, the mean: {'yes' if mean_split else 'no'}"
    )
    if split and gap_p5 >= SEPARATION_RATIO * gap_mean:
        caveat = (
            f"the mean splits the groups too (gap {_fmt(gap_mean)} vs the paper's 0.009): the degrading budgets "
            "here disturb many tokens, not only a tail, so only the relative claim (p5 separates more) holds"
            if mean_split
            else ""
        )
        return Claim("a", statement, numbers, rule, REPRODUCED, caveat)
    if gap_p5 <= gap_mean:
        return Claim(
            "a",
            statement,
            numbers,
            rule,
            NOT_REPRODUCED,
            "the toy's degrading budgets may be far past the edge (most tokens disturbed, so the mean drops "
            "too), unlike the paper's near-threshold budgets where only a few tokens go bad",
        )
    return Claim(
        "a",
        statement,
        numbers,
        rule,
        INCONCLUSIVE,
        "the tail separates better than the mean but not by the stated margin or not perfectly; with few "
        "arms and seeds one noisy accuracy can move an arm between the groups",
    )


def claim_b(results: Sequence[ArmResult], spec: ArmsSpec) -> Claim:
    """(b) under a fixed budget the tail worsens with length; a length-dependent schedule holds it flat."""
    statement = "under a fixed budget the tail worsens with generation length; a length-dependent schedule holds it flat"
    rule = (
        f"least-squares slope of the pooled p5 over the decided bins (>= {spec.min_bin_tokens} tokens), mean over "
        f"arms. Reproduced when the fixed arms' slope < -{FLAT:g}/bin and the schedule arms' |slope| <= half of "
        f"it; not reproduced when the fixed slope >= -{FLAT:g}/bin or the schedule's |slope| >= the fixed one's"
    )
    fixed = [r for r in results if r.arm.role == "fixed"]
    scheduled = [r for r in results if r.arm.role == "schedule"]
    slopes = {r.arm.name: r.p5_slope(spec.min_bin_tokens) for r in (*fixed, *scheduled)}
    numbers = "slope of p5 per bin: " + ", ".join(f"{k} {_fmt(v, '+.3f')}" for k, v in slopes.items())
    fixed_s = [slopes[r.arm.name] for r in fixed if math.isfinite(slopes[r.arm.name])]
    sched_s = [slopes[r.arm.name] for r in scheduled if math.isfinite(slopes[r.arm.name])]
    if not fixed_s or not sched_s:
        return Claim(
            "b",
            statement,
            numbers,
            rule,
            INCONCLUSIVE,
            "fewer than two decided bins in the fixed or the schedule arms",
        )
    f, s = sum(fixed_s) / len(fixed_s), sum(sched_s) / len(sched_s)
    numbers += f"; mean fixed {_fmt(f, '+.3f')}, mean schedule {_fmt(s, '+.3f')}"
    if f < -FLAT and abs(s) <= 0.5 * abs(f):
        return Claim("b", statement, numbers, rule, REPRODUCED)
    if f >= -FLAT:
        return Claim(
            "b",
            statement,
            numbers,
            rule,
            NOT_REPRODUCED,
            "the toy's responses span only a few bins, and a fixed budget that is lenient there keeps most of "
            "a short cache, so the tail may have no room to fall",
        )
    if abs(s) >= abs(f):
        return Claim(
            "b",
            statement,
            numbers,
            rule,
            NOT_REPRODUCED,
            "the calibrated schedule comes from a small calibration set and a coarse budget grid; a later bin "
            "with few calibration tokens may get a budget that is too small",
        )
    return Claim(
        "b", statement, numbers, rule, INCONCLUSIVE, "the schedule flattens the tail, but by less than half"
    )


def claim_c(results: Sequence[ArmResult], spec: ArmsSpec) -> Claim:
    """(c) runs whose per-bin p5 stays >= threshold train like dense; runs below it degrade."""
    statement = f"runs with every bin's p5 >= {spec.threshold:g} train like dense, runs below it degrade"
    rule = (
        f"predict 'stable' from the tail (every decided bin's p5 >= {spec.threshold:g}), compare with the "
        f"outcome ({spec.outcome} within max({spec.degrade_margin:g}, 2 SE) of dense). Reproduced when every "
        "sparse arm agrees and both predictions occur; not reproduced when at most half agree; else inconclusive"
    )
    dense = _dense(results)
    if dense is None:
        return Claim("c", statement, "no dense arm", rule, INCONCLUSIVE, "the outcome needs a dense arm")
    rows, agree = [], 0
    for r in _sparse(results):
        ok, degraded = _passes(r, spec), _degraded(dense, r, spec)
        agree += ok != degraded
        rows.append(
            f"{r.arm.name}: p5 {_fmt(r.min_p5(spec.min_bin_tokens))} ({'pass' if ok else 'below'}), "
            f"{spec.outcome} {_fmt(r.outcome(spec.outcome)[0])} ({'degraded' if degraded else 'like dense'})"
        )
    sparse = _sparse(results)
    numbers = f"dense {spec.outcome} {_fmt(dense.outcome(spec.outcome)[0])}; " + "; ".join(rows)
    numbers += f"; agreement {agree}/{len(sparse)}"
    passing = [r for r in sparse if _passes(r, spec)]
    if not sparse or not passing or len(passing) == len(sparse):
        which = "below the threshold" if passing else "passing the threshold"
        return Claim("c", statement, numbers, rule, INCONCLUSIVE, f"no sparse arm is {which}")
    if agree == len(sparse):
        return Claim("c", statement, numbers, rule, REPRODUCED)
    why = _exceptions(dense, sparse, spec)
    if agree <= len(sparse) / 2:
        return Claim("c", statement, numbers, rule, NOT_REPRODUCED, why)
    return Claim("c", statement, numbers, rule, INCONCLUSIVE, why)


def _exceptions(dense: ArmResult, sparse: Sequence[ArmResult], spec: ArmsSpec) -> str:
    """Why the tail mispredicted: for each such arm, the share of its tokens in the failing bins."""
    parts = []
    for r in sparse:
        if _passes(r, spec) != _degraded(dense, r, spec):
            continue
        decided = r.decided_bins(spec.min_bin_tokens)
        failing = {b: v for b, v in decided.items() if v["p5"] < spec.threshold}
        share = sum(v["tokens"] for v in failing.values()) / max(sum(v["tokens"] for v in r.bins.values()), 1)
        if failing:
            parts.append(
                f"{r.arm.name} is below the threshold in bins {', '.join(map(str, failing))} holding "
                f"{100 * share:.0f}% of its tokens, yet trains like dense"
            )
        else:
            parts.append(f"{r.arm.name} passes the tail yet its {spec.outcome} is below dense")
    return (
        "; ".join(parts) + ". A short run may not let the off-policy error compound into a collapse, a tail "
        "that fails only in the rare long responses touches few tokens, and the accuracies carry binomial "
        "noise of several points"
    )


def claim_d(results: Sequence[ArmResult], spec: ArmsSpec) -> Claim:
    """(d) DistillSparse lets a more aggressive schedule reach the threshold, for more speedup."""
    statement = "DistillSparse lets a more aggressive schedule reach the threshold, for more speedup"
    rule = (
        "for each distill arm: reproduced when it passes the tail, its baseline (same schedule, no adapter) "
        "does not, and its predicted speedup exceeds that of every undistilled sparse arm that passes (dense "
        "= 1.0 when none does); not reproduced when it stays below the threshold; otherwise inconclusive"
    )
    by_name = {r.arm.name: r for r in results}
    distilled = [r for r in results if r.arm.role == "distill"]
    if not distilled:
        return Claim(
            "d", statement, "no distill run", rule, INCONCLUSIVE, "no distill arm has a finished run"
        )
    passing = [r for r in results if r.arm.role in ("fixed", "schedule") and _passes(r, spec)]
    best = max(passing, key=lambda r: r.predicted_speedup, default=None)
    best_speedup = best.predicted_speedup if best is not None else 1.0
    verdicts, parts, why = [], [], []
    for d in distilled:
        base = by_name.get(d.arm.baseline)
        p5_d = d.min_p5(spec.min_bin_tokens)
        p5_b = base.min_p5(spec.min_bin_tokens) if base else math.nan
        parts.append(
            f"{d.arm.name}: p5 {_fmt(p5_d)} vs {d.arm.baseline} {_fmt(p5_b)} (gain {_fmt(p5_d - p5_b, '+.3f')}), "
            f"predicted speedup {_fmt(d.predicted_speedup, '.2f')}x vs best passing undistilled "
            f"{best.arm.name if best else 'dense'} {_fmt(best_speedup, '.2f')}x"
        )
        if not _passes(d, spec):
            verdicts.append(NOT_REPRODUCED)
            why.append(
                f"{d.arm.name} stays below {spec.threshold:g}: the adapter is trained for a few steps on a small "
                "batch, and a budget this small may drop the pages the look-ups need, which no adapter can restore"
            )
        elif base is None or _passes(base, spec):
            verdicts.append(INCONCLUSIVE)
            why.append(f"{d.arm.baseline} passes without the adapter: nothing for the adapter to close")
        elif d.predicted_speedup > best_speedup:
            verdicts.append(REPRODUCED)
        else:
            verdicts.append(INCONCLUSIVE)
            why.append(
                f"{d.arm.name} passes but predicts no more speedup than {best.arm.name if best else 'dense'}"
            )
    verdict = verdicts[0] if len(set(verdicts)) == 1 else INCONCLUSIVE
    return Claim("d", statement, "; ".join(parts), rule, verdict, "; ".join(why))


def evaluate_claims(results: Sequence[ArmResult], spec: ArmsSpec) -> list[Claim]:
    """Claims (a)-(d) in order."""
    return [claim(results, spec) for claim in (claim_a, claim_b, claim_c, claim_d)]
