"""The tolerant miniature's rules for claims (a)-(d) (``rules: tolerant`` in an arms file), fixed before its grid runs.

Outcomes (per run, i.e. per seed; :class:`~sparrow_nemo.experiments.analysis.SeedResult`):

- **Primary**: held-out accuracy of the FINAL weights decoded densely (``accuracy_end_dense``: the same fixed
  held-out prompts in every run), so the step-0 inference gap of sparse decoding is not counted as degradation.
- **Secondary 1, collapse** (:func:`collapsed`): the run's training reward over its last :data:`LAST_STEPS` steps
  is below its first :data:`LAST_STEPS` steps' by more than :data:`COLLAPSE_DROP` (rewards in [0, 1]), or its
  mean response length over the last steps left [1 / :data:`COLLAPSE_LENGTH`, :data:`COLLAPSE_LENGTH`] x the
  first steps' (runaway or truncated responses).
- **Secondary 2, difference-in-differences**: (last - first training reward of the arm's run) - (the same of
  dense with the same seed): the change the arm's training made, net of dense's and of the step-0 gap.

Statistics: paired by seed (every arm shares the warm-start and the prompt stream of a seed), the variance is
the between-seed variance of the per-seed differences (:func:`sparrow_nemo.experiments.stats.paired`), never a
binomial error pooled over prompts. "Equivalent to dense": TOST at +-``equivalence_margin`` (0.05) with
Holm-adjusted p < :data:`LEVEL` across the arms a claim tests; "inferior": one-sided p (mean < -margin),
Holm-adjusted, < :data:`LEVEL`. A claim with fewer than 2 paired seeds is inconclusive.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from sparrow_nemo.experiments.analysis import LAST_STEPS, ArmResult, SeedResult
from sparrow_nemo.experiments.arms import ArmsSpec
from sparrow_nemo.experiments.claims import INCONCLUSIVE, NOT_REPRODUCED, REPRODUCED, Claim, claim_b
from sparrow_nemo.experiments.stats import Paired, auc, holm, paired

__all__ = ["collapsed", "evaluate_claims", "fitted_threshold"]

#: collapse: training reward falls by more than this (last vs first steps)
COLLAPSE_DROP = 0.15
#: collapse: mean response length leaves [1/x, x] of its first steps'
COLLAPSE_LENGTH = 2.0
#: test level of every rule (Holm-adjusted where several arms are tested)
LEVEL = 0.05
#: (a): p5 must beat the mean's AUC for collapse by this much
AUC_MARGIN = 0.10
#: (a): the matched-mean triad's token means may differ by at most this
MATCHED_MEAN = 0.01
#: (c): the fitted threshold must lie within this of the claimed one
FIT_BAND = 0.06
#: (d): how far below the threshold the distilled schedule's late p5 may end and still be "near"
NEAR = 0.02


def collapsed(run: SeedResult) -> bool:
    """The collapse event of one run (module docstring)."""
    if run.reward_first - run.reward_last > COLLAPSE_DROP:
        return True
    if run.length_first > 0 and math.isfinite(run.length_last):
        ratio = run.length_last / run.length_first
        return not 1 / COLLAPSE_LENGTH <= ratio <= COLLAPSE_LENGTH
    return False


def _f(x: float, spec: str = ".3f") -> str:
    return "n/a" if x is None or not math.isfinite(x) else format(x, spec)


def _pairs(arm: ArmResult, dense: ArmResult, value: str) -> tuple[list[float], list[float]]:
    """``value`` of the arm's runs and of dense's runs with the same seeds (seeds both have)."""
    ref = {r.seed: r for r in dense.per_seed}
    mine = [r for r in arm.per_seed if r.seed in ref]
    return [getattr(r, value) for r in mine], [getattr(ref[r.seed], value) for r in mine]


def primary(arm: ArmResult, dense: ArmResult, margin: float) -> Paired:
    """Paired comparison of the primary outcome, arm - dense."""
    return paired(*_pairs(arm, dense, "accuracy_end_dense"), margin)


def did(arm: ArmResult, dense: ArmResult) -> Paired:
    """Paired difference-in-differences of the training reward (secondary 2), arm - dense."""
    ref = {r.seed: r.reward_last - r.reward_first for r in dense.per_seed}
    mine = [(r.reward_last - r.reward_first, ref[r.seed]) for r in arm.per_seed if r.seed in ref]
    return paired([m for m, _ in mine], [d for _, d in mine], 0.0)


def _tau(arm: ArmResult) -> float:
    """The ``sparsity.threshold`` an arm's overrides set (NaN when none)."""
    for text in arm.arm.overrides:
        key, _, value = text.lstrip("+").partition("=")
        if key == "sparsity.threshold":
            return float(value)
    return math.nan


def _dense(results: Sequence[ArmResult]) -> ArmResult | None:
    return next((r for r in results if r.arm.role == "dense"), None)


def _runs(results: Sequence[ArmResult]) -> list[tuple[ArmResult, SeedResult]]:
    """Every run of the sparse arms (all roles but dense)."""
    return [(r, s) for r in results if r.arm.role != "dense" for s in r.per_seed]


def _secondaries(results: Sequence[ArmResult], dense: ArmResult, spec: ArmsSpec) -> str:
    parts = []
    for r in results:
        if r.arm.role == "dense":
            continue
        p, d = primary(r, dense, spec.equivalence_margin), did(r, dense)
        n_collapse = sum(collapsed(s) for s in r.per_seed)
        parts.append(
            f"{r.arm.name}: primary {_f(p.mean, '+.3f')} +- {_f(p.se)} (n {p.n}), DiD {_f(d.mean, '+.3f')} "
            f"+- {_f(d.se)}, collapses {n_collapse}/{len(r.per_seed)}"
        )
    dense_collapses = sum(collapsed(s) for s in dense.per_seed)
    return f"dense collapses {dense_collapses}/{len(dense.per_seed)}; " + "; ".join(parts)


def claim_a(results: Sequence[ArmResult], spec: ArmsSpec) -> Claim:
    """(a) the per-bin p5 predicts collapse better than the mean acceptance (across runs, and at a matched mean)."""
    statement = "mean acceptance barely separates stable from degrading runs; the 5th percentile does"
    rule = (
        f"across the sparse runs: AUC for collapse of the run's lowest-bin p5 vs of its mean acceptance; "
        f"supported when AUC(p5) >= AUC(mean) + {AUC_MARGIN:g} (>= 2 collapsed and >= 2 stable runs), opposed "
        f"when AUC(p5) <= AUC(mean). Matched-mean triad (inject arms, token means within {MATCHED_MEAN:g}): "
        f"supported when the lowest-p5 arm's primary outcome is below the highest-p5 arm's (paired one-sided t, "
        f"p < {LEVEL:g}), opposed when not (or the reverse). Reproduced when both support; not reproduced when "
        "both oppose; otherwise inconclusive"
    )
    dense = _dense(results)
    if dense is None:
        return Claim("a", statement, "no dense arm", rule, INCONCLUSIVE, "the outcomes need a dense arm")
    runs = _runs(results)
    events = [collapsed(s) for _, s in runs]
    auc_p5 = auc([s.min_p5 for _, s in runs], events)
    auc_mean = auc([s.acceptance_mean for _, s in runs], events)
    n_events = sum(events)
    across = None
    if n_events >= 2 and len(events) - n_events >= 2 and math.isfinite(auc_p5) and math.isfinite(auc_mean):
        across = True if auc_p5 >= auc_mean + AUC_MARGIN else (False if auc_p5 <= auc_mean else None)
    numbers = (
        f"{n_events} of {len(events)} sparse runs collapsed; AUC p5 {_f(auc_p5)} vs mean {_f(auc_mean)}; "
        + _secondaries(results, dense, spec)
    )
    triad = sorted(
        (r for r in results if r.arm.role == "inject"), key=lambda r: r.min_p5(spec.min_bin_tokens)
    )
    within, why = None, []
    if len(triad) >= 2:
        low, high = triad[0], triad[-1]
        spread = max(r.acceptance_mean for r in triad) - min(r.acceptance_mean for r in triad)
        highs = {s.seed: s.accuracy_end_dense for s in high.per_seed}
        both = [(s.accuracy_end_dense, highs[s.seed]) for s in low.per_seed if s.seed in highs]
        test = paired([x for x, _ in both], [y for _, y in both], 0.0)
        numbers += (
            f"; triad means {', '.join(f'{r.arm.name} {_f(r.acceptance_mean)}' for r in triad)} (spread "
            f"{_f(spread)}); {low.arm.name} - {high.arm.name} primary {_f(test.mean, '+.3f')} +- {_f(test.se)}, "
            f"p(lower) {_f(test.p_worse)}"
        )
        if spread > MATCHED_MEAN:
            why.append(
                f"the triad's means differ by {_f(spread)} > {MATCHED_MEAN:g}: not a matched-mean test"
            )
        elif math.isfinite(test.p_worse):
            within = test.p_worse < LEVEL
    else:
        why.append("no matched-mean triad (inject arms) finished")
    if across is None:
        why.append("too few collapsed or stable runs, or AUCs within the margin")
    if across and within:
        return Claim("a", statement, numbers, rule, REPRODUCED)
    if across is False and within is False:
        return Claim("a", statement, numbers, rule, NOT_REPRODUCED, "; ".join(why))
    return Claim("a", statement, numbers, rule, INCONCLUSIVE, "; ".join(why) or "the two tests disagree")


def fitted_threshold(points: Sequence[tuple[float, bool]], near: float) -> tuple[float, int]:
    """The cut t on a run's lowest-bin p5 that best predicts "degraded" as p5 < t: (t, misclassified runs).

    Candidates: midpoints between consecutive distinct p5 values and the ends; ties go to the cut nearest
    ``near``. ``points``: (p5, degraded) per run, finite p5 only. (NaN, 0) without both kinds of runs.
    """
    finite = [(p, d) for p, d in points if math.isfinite(p)]
    if not any(d for _, d in finite) or all(d for _, d in finite):
        return math.nan, 0
    values = sorted({p for p, _ in finite})
    cuts = [values[0] - 1e-6, *((a + b) / 2 for a, b in itertools.pairwise(values)), values[-1] + 1e-6]
    errors = {t: sum((p < t) != d for p, d in finite) for t in cuts}
    best = min(errors.values())
    t = min((c for c in cuts if errors[c] == best), key=lambda c: abs(c - near))
    return t, best


def claim_c(results: Sequence[ArmResult], spec: ArmsSpec) -> Claim:
    """(c) schedules at tau >= threshold train like dense; the threshold a fit puts between the runs is ~tau."""
    tau, margin = spec.threshold, spec.equivalence_margin
    statement = f"runs whose per-bin p5 stays >= {tau:g} train like dense, runs below it degrade"
    rule = (
        f"every schedule arm with sparsity.threshold >= {tau:g} equivalent to dense on the primary outcome (paired "
        f"TOST at +-{margin:g}, Holm across those arms, p < {LEVEL:g}), and the p5 cut that best separates "
        f"degraded runs (primary below the same seed's dense by > {margin:g}) within +-{FIT_BAND:g} of {tau:g}: "
        f"reproduced. Not reproduced when such an arm is inferior (one-sided, Holm, p < {LEVEL:g}) or the cut lies "
        f"outside the band while misclassifying <= 1/4 of the runs; otherwise inconclusive"
    )
    dense = _dense(results)
    if dense is None:
        return Claim("c", statement, "no dense arm", rule, INCONCLUSIVE, "the outcomes need a dense arm")
    high = [r for r in results if r.arm.role == "schedule" and _tau(r) >= tau]
    tests = [primary(r, dense, margin) for r in high]
    eq = holm([t.p_equivalent for t in tests])
    inferior = holm([t.p_inferior for t in tests])
    ref = {s.seed: s.accuracy_end_dense for s in dense.per_seed}
    points = [
        (s.min_p5, s.accuracy_end_dense < ref[s.seed] - margin) for r, s in _runs(results) if s.seed in ref
    ]
    cut, wrong = fitted_threshold(points, tau)
    numbers = "; ".join(
        f"{r.arm.name} (tau {_tau(r):g}): {_f(t.mean, '+.3f')} +- {_f(t.se)} (n {t.n}), p(equiv) Holm {_f(e)}, "
        f"p(inferior) Holm {_f(i)}"
        for r, t, e, i in zip(high, tests, eq, inferior)
    )
    numbers = (numbers or "no schedule arm at tau >= threshold") + (
        f"; fitted cut {_f(cut)} ({wrong} of {len(points)} runs misclassified)"
    )
    equivalent = bool(high) and all(math.isfinite(e) and e < LEVEL for e in eq)
    in_band = math.isfinite(cut) and abs(cut - tau) <= FIT_BAND
    if equivalent and in_band:
        return Claim("c", statement, numbers, rule, REPRODUCED)
    if any(math.isfinite(i) and i < LEVEL for i in inferior):
        return Claim(
            "c", statement, numbers, rule, NOT_REPRODUCED, "a schedule at tau >= threshold is inferior"
        )
    if math.isfinite(cut) and not in_band and wrong <= len(points) / 4:
        side = "above" if cut > tau else "below"
        return Claim(
            "c", statement, numbers, rule, NOT_REPRODUCED, f"the runs separate at {_f(cut)}, {side} {tau:g}"
        )
    why = []
    if not equivalent:
        why.append("equivalence not shown (too few seeds, or differences near the margin)")
    if not math.isfinite(cut):
        why.append("no degraded run (or no stable one): no threshold to fit")
    elif not in_band:
        why.append(f"the cut {_f(cut)} misclassifies {wrong} of {len(points)} runs")
    return Claim("c", statement, numbers, rule, INCONCLUSIVE, "; ".join(why))


def claim_d(results: Sequence[ArmResult], spec: ArmsSpec) -> Claim:
    """(d) DistillSparse brings an aggressive schedule up to the threshold, faster than the threshold's own schedule."""
    tau = spec.threshold
    statement = "DistillSparse lets a more aggressive schedule reach the threshold, for more speedup"
    rule = (
        f"the distill arm's lowest-bin p5 over its last {LAST_STEPS} steps (mean over seeds) >= {tau:g}, and its "
        f"predicted speedup above the undistilled schedule at tau = {tau:g} (paired log ratio > 0, one-sided t, "
        f"p < {LEVEL:g}): reproduced. Not reproduced when that p5 ends below {tau - NEAR:g} or the mean speedup "
        "ratio is <= 1; otherwise inconclusive"
    )
    distilled = [r for r in results if r.arm.role == "distill"]
    reference = next((r for r in results if r.arm.role == "schedule" and _tau(r) == tau), None)
    if not distilled or reference is None:
        return Claim("d", statement, "no distill arm or no schedule at the threshold", rule, INCONCLUSIVE)
    verdicts, parts, why = [], [], []
    for d in distilled:
        late = [s.late_min_p5 for s in d.per_seed if math.isfinite(s.late_min_p5)]
        late_p5 = sum(late) / len(late) if late else math.nan
        ref = {s.seed: s.predicted_speedup for s in reference.per_seed}
        logs = [
            (math.log(s.predicted_speedup), math.log(ref[s.seed]))
            for s in d.per_seed
            if s.seed in ref and s.predicted_speedup > 0 and ref[s.seed] > 0
        ]
        test = paired([a for a, _ in logs], [b for _, b in logs], 0.0)
        ratio = math.exp(test.mean) if math.isfinite(test.mean) else math.nan
        parts.append(
            f"{d.arm.name}: late p5 {_f(late_p5)} (seeds {', '.join(_f(v) for v in late)}), predicted speedup "
            f"{_f(ratio, '.3f')}x that of {reference.arm.name} (n {test.n}, p(not faster) "
            f"{_f(1 - test.p_worse)})"
        )
        faster = math.isfinite(test.p_worse) and 1 - test.p_worse < LEVEL
        if late_p5 >= tau and faster:
            verdicts.append(REPRODUCED)
        elif late_p5 < tau - NEAR or (math.isfinite(ratio) and ratio <= 1):
            verdicts.append(NOT_REPRODUCED)
            why.append(f"{d.arm.name} ends below the threshold or is not faster")
        else:
            verdicts.append(INCONCLUSIVE)
            why.append(f"{d.arm.name}: p5 near the threshold or the speedup not significant")
    verdict = verdicts[0] if len(set(verdicts)) == 1 else INCONCLUSIVE
    return Claim("d", statement, "; ".join(parts), rule, verdict, "; ".join(why))


def evaluate_claims(results: Sequence[ArmResult], spec: ArmsSpec) -> list[Claim]:
    """Claims (a)-(d) under the tolerant rules ((b): the earlier grids' slope rule, :func:`claims.claim_b`)."""
    return [claim_a(results, spec), claim_b(results, spec), claim_c(results, spec), claim_d(results, spec)]
