"""Numbers of an experiment, read from its run folders: per-run series, per-arm aggregates over seeds.

Nothing is re-measured: every value comes from a run's ``metrics.jsonl`` (one row per RL step),
``summary.json`` (held-out evaluations, predicted speedup) and the runner's ``experiment_run.json``.

Per-bin statistics pool the steps and seeds of an arm: the p5 of a bin is the 5th percentile of all the
arm's tokens in the bin, read off the sum of the runs' per-step per-bin acceptance histograms
(``histograms.jsonl``, ``acceptance/histogram/bin_<b>``: :data:`~sparrow_nemo.grpo.step_batch.BIN_HISTOGRAM_BINS`
bins of 0.01 over [0, 1]) by linear interpolation inside the bin that holds it, so exact to 0.01; the mean
is the histograms' sum over their count (exact). Runs made before those histograms were logged cannot be
pooled so: their p5 is the token-weighted mean of the per-step p5 values (``metrics.jsonl``), which is not a
quantile of the pooled tokens, and :attr:`ArmResult.p5_pooling` says which an arm got. Bins with fewer than
``min_bin_tokens`` tokens in all are left out of the tail verdicts (too few tokens for a 5th percentile).
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from sparrow_nemo.experiments.arms import OUTCOMES, Arm
from sparrow_nemo.experiments.runner import RUN_RECORD, run_folder
from sparrow_nemo.run_io.histograms import Histogram
from sparrow_nemo.run_io.metrics import HISTOGRAMS_FILE, read_metrics
from sparrow_nemo.sparse.mismatch import PAPER_QUANTILE

__all__ = [
    "LAST_STEPS",
    "POOLED",
    "STEP_MEAN",
    "ArmResult",
    "RunData",
    "SeedResult",
    "aggregate",
    "histogram_quantile",
    "load_run",
    "load_runs",
    "slope",
]

#: Steps at the end of a run over which the train accuracy and response length are averaged.
LAST_STEPS = 5
_BIN_KEY = re.compile(r"^acceptance/(p5|mean|tokens)/bin_(\d+)$")
_BIN_HISTOGRAM = re.compile(r"^acceptance/histogram/bin_(\d+)$")
#: :attr:`ArmResult.p5_pooling`: the quantile of the pooled tokens, or (old runs) the mean of per-step p5s
POOLED = "p5 of the pooled tokens (per-bin histograms, 0.01 resolution)"
STEP_MEAN = "token-weighted mean of per-step p5 (runs without per-bin histograms)"


@dataclass(frozen=True)
class RunData:
    """One finished arm/seed run.

    Attributes:
        arm, seed: which run. summary: its ``summary.json``. rows: its metrics rows of RL steps (step >= 0).
        record: the runner's ``experiment_run.json`` (wall_s, cpu_s), empty when absent.
        samples_per_step: rollouts per RL step (grpo.prompts_per_step x grpo.samples_per_prompt).
        bin_histograms: {bin: acceptance histogram of the bin's tokens summed over the RL steps}; empty for a
            run made before the per-bin histograms were logged. late_bin_histograms: the same over the last
            :data:`LAST_STEPS` steps.
    """

    arm: Arm
    seed: int
    summary: dict[str, Any]
    rows: list[dict[str, Any]]
    record: dict[str, Any]
    samples_per_step: int
    bin_histograms: dict[int, Histogram] = field(default_factory=dict)
    late_bin_histograms: dict[int, Histogram] = field(default_factory=dict)

    @property
    def bin_tokens(self) -> int:
        """Bin width of the run's tail statistics, tokens of cached length."""
        return int(self.summary["final_schedule"]["bin_tokens"])

    def series(self, key: str) -> list[float]:
        """``key`` per step (NaN where a step lacks it)."""
        return [math.nan if row.get(key) is None else float(row[key]) for row in self.rows]

    def per_bin(self) -> dict[int, dict[str, list[float]]]:
        """bin -> {"p5": [...], "mean": [...], "tokens": [...]} over the steps that have the bin."""
        out: dict[int, dict[str, list[float]]] = {}
        for row in self.rows:
            for b, stats in _row_bins(row).items():
                entry = out.setdefault(b, {"p5": [], "mean": [], "tokens": []})
                for name in ("p5", "mean", "tokens"):
                    entry[name].append(stats[name])
        return dict(sorted(out.items()))


def _row_bins(row: dict[str, Any]) -> dict[int, dict[str, float]]:
    """One metrics row's per-bin p5, mean and token count (bins that have all three)."""
    found: dict[int, dict[str, float]] = {}
    for key, value in row.items():
        match = _BIN_KEY.match(key)
        if match and value is not None:
            found.setdefault(int(match.group(2)), {})[match.group(1)] = float(value)
    return {b: stats for b, stats in found.items() if {"p5", "mean", "tokens"} <= set(stats)}


def _summed_bin_histograms(path: Path, first_step: int = 0) -> dict[int, Histogram]:
    """{bin: the run's per-step acceptance histograms of the bin summed over its RL steps >= ``first_step``}."""
    if not path.is_file():
        return {}
    summed: dict[int, Histogram] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if row.get("step", -1) < first_step:
            continue
        for key, data in row.items():
            match = _BIN_HISTOGRAM.match(key)
            if not match:
                continue
            h, b = Histogram.from_dict(data), int(match.group(1))
            total = summed.get(b)
            if total is not None and total.edges != h.edges:
                raise ValueError(f"{path}:{number}: {key} has other edges than the earlier steps")
            summed[b] = h if total is None else _add(total, h)
    return dict(sorted(summed.items()))


def _add(a: Histogram, b: Histogram) -> Histogram:
    """Two histograms of the same edges as one."""
    return Histogram(
        a.edges,
        tuple(x + y for x, y in zip(a.counts, b.counts)),
        a.total + b.total,
        a.sum + b.sum,
        a.sum_squares + b.sum_squares,
        min(a.min, b.min),
        max(a.max, b.max),
    )


def histogram_quantile(h: Histogram, q: float) -> float:
    """The ``q`` quantile of the values counted in ``h``: the value below which a fraction ``q`` of them lie,
    linearly interpolated inside the bin that holds it (exact to one bin width); NaN when ``h`` is empty."""
    if h.total <= 0:
        return math.nan
    target, below = q * h.total, 0.0
    for i, count in enumerate(h.counts):
        if count > 0 and below + count >= target:
            return h.edges[i] + (target - below) / count * (h.edges[i + 1] - h.edges[i])
        below += count
    return h.edges[-1]


def load_run(folder: Path, arm: Arm, seed: int) -> RunData:
    """Read one finished run folder (FileNotFoundError naming the file when a piece is missing)."""
    summary_path, metrics_path = folder / "summary.json", folder / "metrics.jsonl"
    for path in (summary_path, metrics_path, folder / "config.yaml"):
        if not path.is_file():
            raise FileNotFoundError(
                f"run of arm {arm.name} seed {seed}: {path} is missing (run not finished?)"
            )
    record_path = folder / RUN_RECORD
    grpo = yaml.safe_load((folder / "config.yaml").read_text())["grpo"]
    rows = [row for row in read_metrics(metrics_path) if row["step"] >= 0]
    late = rows[-min(LAST_STEPS, len(rows))]["step"] if rows else 0
    return RunData(
        arm=arm,
        seed=seed,
        summary=json.loads(summary_path.read_text()),
        rows=rows,
        record=json.loads(record_path.read_text()) if record_path.is_file() else {},
        samples_per_step=int(grpo["prompts_per_step"]) * int(grpo["samples_per_prompt"]),
        bin_histograms=_summed_bin_histograms(folder / HISTOGRAMS_FILE),
        late_bin_histograms=_summed_bin_histograms(folder / HISTOGRAMS_FILE, late),
    )


def load_runs(
    root: Path, arms: Sequence[Arm], seeds: Sequence[int], smoke: bool = False
) -> tuple[list[RunData], list[str]]:
    """The finished arm x seed runs under the runs folder ``root`` (each arm's :meth:`Arm.seeds_for`), and
    ``"<arm> seed <s>"`` for the missing."""
    runs, missing = [], []
    for arm in arms:
        for seed in arm.seeds_for(seeds, smoke):
            folder = run_folder(root, arm.name, seed)
            if (folder / "summary.json").is_file():
                runs.append(load_run(folder, arm, seed))
            else:
                missing.append(f"{arm.name} seed {seed}")
    return runs, missing


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ys on xs; NaN with fewer than 2 distinct xs."""
    if len(set(xs)) < 2:
        return math.nan
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


def _mean(values: Sequence[float]) -> float:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.fmean(finite) if finite else math.nan


def _running_best(values: Sequence[float], window: int = 3) -> float:
    """Largest mean over ``window`` consecutive steps (the whole series when shorter)."""
    if not values:
        return math.nan
    if len(values) <= window:
        return _mean(values)
    return max(_mean(values[i : i + window]) for i in range(len(values) - window + 1))


@dataclass(frozen=True)
class SeedResult:
    """One run (seed) of an arm, for the between-seed rules (:mod:`sparrow_nemo.experiments.tolerant_claims`).

    Attributes:
        accuracy_end_dense, reward_end_dense: held-out accuracy (solved problems) and mean reward (fraction of
            queries right) of the final weights decoded densely (the tolerant miniature's primary outcome);
            accuracy_start_dense: of the warm-start, decoded densely.
        reward_first, reward_last: training reward (``reward/mean``) over the first / last :data:`LAST_STEPS`
            steps. length_first, length_last: mean response length (tokens) over the same steps.
        acceptance_mean: token-mean acceptance over the run. min_p5, late_min_p5: lowest decided bin's p5 of the
            run's pooled tokens, over all steps / the last :data:`LAST_STEPS` steps (NaN when no bin is decided).
        predicted_speedup: the run's cost-model speedup over dense (mean over its steps).
    """

    seed: int
    accuracy_end_dense: float
    reward_end_dense: float
    accuracy_start_dense: float
    reward_first: float
    reward_last: float
    length_first: float
    length_last: float
    acceptance_mean: float
    min_p5: float
    late_min_p5: float
    predicted_speedup: float


def _lowest_p5(bins: dict[int, dict[str, float]], min_tokens: float) -> float:
    decided = [v["p5"] for v in bins.values() if v["tokens"] >= min_tokens]
    return min(decided) if decided else math.nan


def _seed_result(run: RunData, min_tokens: float) -> SeedResult:
    """``run``'s :class:`SeedResult`; bins with fewer than ``min_tokens`` tokens are not decided."""
    evals = run.summary.get("evals", {})
    late = RunData(
        run.arm,
        run.seed,
        run.summary,
        run.rows[-LAST_STEPS:],
        run.record,
        run.samples_per_step,
        run.late_bin_histograms,
    )
    reward, length = run.series("reward/mean"), run.series("response_length/mean")
    return SeedResult(
        seed=run.seed,
        accuracy_end_dense=_mean([run.summary.get("accuracy_end_dense")]),
        reward_end_dense=_mean([evals.get("end_dense", {}).get("reward_mean")]),
        accuracy_start_dense=_mean([run.summary.get("accuracy_start_dense")]),
        reward_first=_mean(reward[:LAST_STEPS]),
        reward_last=_mean(reward[-LAST_STEPS:]),
        length_first=_mean(length[:LAST_STEPS]),
        length_last=_mean(length[-LAST_STEPS:]),
        acceptance_mean=_mean(run.series("acceptance/mean")),
        min_p5=_lowest_p5(_pool_bins([run])[0], min_tokens),
        late_min_p5=_lowest_p5(
            _pool_bins([late])[0], min_tokens * min(LAST_STEPS, len(run.rows)) / max(len(run.rows), 1)
        ),
        predicted_speedup=_mean(run.series("sparsity/predicted_speedup")),
    )


@dataclass
class ArmResult:
    """An arm's numbers, averaged over its seeds (see the module docstring for the per-bin pooling).

    Accuracies are fractions of held-out prompts solved (``accuracy_end``: with the arm's own rollout
    schedule at the end; ``accuracy_end_dense``: the same trained policy decoded dense). Speedups are
    ratios to dense; tokens/s are generated tokens per second of wall time on this machine.
    """

    arm: Arm
    seeds: list[int]
    bin_tokens: int
    eval_prompts: int
    train_samples: int
    accuracy_start: float
    accuracy_end: float
    accuracy_end_dense: float
    train_accuracy_last: float
    train_accuracy_best: float
    response_length: float
    acceptance_mean: float
    acceptance_p5: float
    tokens_per_s: float
    measured_speedup: float
    predicted_speedup: float
    final_budgets: list[Any]
    wall_s: float
    cpu_s: float
    bins: dict[int, dict[str, float]] = field(default_factory=dict)
    p5_pooling: str = POOLED
    per_seed: list[SeedResult] = field(default_factory=list)
    curves: dict[str, list[float]] = field(default_factory=dict)

    def decided_bins(self, min_tokens: int) -> dict[int, dict[str, float]]:
        """Bins with at least ``min_tokens`` tokens over all steps and seeds."""
        return {b: v for b, v in self.bins.items() if v["tokens"] >= min_tokens}

    def min_p5(self, min_tokens: int) -> float:
        """Lowest pooled p5 over the decided bins (1.0 for a dense arm; NaN when no bin is decided)."""
        decided = self.decided_bins(min_tokens)
        return min(v["p5"] for v in decided.values()) if decided else math.nan

    def p5_slope(self, min_tokens: int) -> float:
        """Least-squares slope of the pooled p5 over the decided bins, per bin."""
        decided = self.decided_bins(min_tokens)
        return slope(list(decided), [v["p5"] for v in decided.values()])

    def outcome(self, name: str) -> tuple[float, int]:
        """Outcome ``name`` (see :data:`sparrow_nemo.experiments.arms.OUTCOMES`) and its sample count (all seeds)."""
        if name not in OUTCOMES:
            raise ValueError(f"unknown outcome '{name}'; known: {', '.join(OUTCOMES)}")
        samples = self.train_samples if name == "train_accuracy_last" else self.eval_prompts
        return float(getattr(self, name)), samples


def _pool_bins(runs: Sequence[RunData]) -> tuple[dict[int, dict[str, float]], str]:
    """{bin: {"p5", "mean", "tokens"}} over the runs' steps and tokens, and how the p5 was pooled (:data:`POOLED`
    when every run logged per-bin histograms, else :data:`STEP_MEAN`; see the module docstring)."""
    if all(run.bin_histograms for run in runs):
        merged: dict[int, Histogram] = {}
        for run in runs:
            for b, h in run.bin_histograms.items():
                merged[b] = h if b not in merged else _add(merged[b], h)
        pooled = {
            b: {"p5": histogram_quantile(h, PAPER_QUANTILE), "mean": h.mean, "tokens": h.total}
            for b, h in sorted(merged.items())
            if h.total > 0
        }
        return pooled, POOLED
    weighted: dict[int, dict[str, float]] = {}
    for run in runs:
        for b, stats in run.per_bin().items():
            entry = weighted.setdefault(b, {"p5w": 0.0, "meanw": 0.0, "tokens": 0.0})
            for p5, mean, tokens in zip(stats["p5"], stats["mean"], stats["tokens"]):
                entry["p5w"] += p5 * tokens
                entry["meanw"] += mean * tokens
                entry["tokens"] += tokens
    averaged = {
        b: {"p5": e["p5w"] / e["tokens"], "mean": e["meanw"] / e["tokens"], "tokens": e["tokens"]}
        for b, e in sorted(weighted.items())
        if e["tokens"] > 0
    }
    return averaged, STEP_MEAN


def _curve(runs: Sequence[RunData], key: str) -> list[float]:
    """``key`` per step, averaged over the runs (steps are aligned: every arm runs the same steps)."""
    series = [run.series(key) for run in runs]
    length = min(len(s) for s in series)
    return [_mean([s[i] for s in series]) for i in range(length)]


def _min_bin_p5_curve(runs: Sequence[RunData], min_tokens_per_step: int) -> list[float]:
    """Per step, the lowest per-bin p5 among bins with >= ``min_tokens_per_step`` tokens, seed-averaged."""
    per_run = []
    for run in runs:
        values = []
        for row in run.rows:
            p5s = [v["p5"] for v in _row_bins(row).values() if v["tokens"] >= min_tokens_per_step]
            values.append(min(p5s) if p5s else math.nan)
        per_run.append(values)
    length = min(len(v) for v in per_run)
    return [_mean([v[i] for v in per_run]) for i in range(length)]


def aggregate(runs: Sequence[RunData], min_bin_tokens: int) -> list[ArmResult]:
    """One :class:`ArmResult` per arm, in the order the arms first appear in ``runs``."""
    order: list[str] = []
    by_arm: dict[str, list[RunData]] = {}
    for run in runs:
        if run.arm.name not in by_arm:
            order.append(run.arm.name)
        by_arm.setdefault(run.arm.name, []).append(run)
    results = []
    for name in order:
        group = by_arm[name]
        steps = len(group[0].rows)
        per_step_min = max(1, min_bin_tokens // max(steps, 1))
        bins, pooling = _pool_bins(group)

        def summary(key: str, group: list[RunData] = group) -> float:
            return _mean([run.summary.get(key) for run in group])

        results.append(
            ArmResult(
                arm=group[0].arm,
                seeds=[run.seed for run in group],
                bin_tokens=group[0].bin_tokens,
                eval_prompts=int(group[0].summary["evals"]["end"]["prompts"]) * len(group),
                accuracy_start=summary("accuracy_start"),
                accuracy_end=summary("accuracy_end"),
                accuracy_end_dense=summary("accuracy_end_dense"),
                train_samples=sum(run.samples_per_step * min(LAST_STEPS, len(run.rows)) for run in group),
                train_accuracy_last=_mean(
                    [_mean(run.series("reward/accuracy")[-LAST_STEPS:]) for run in group]
                ),
                train_accuracy_best=_mean([_running_best(run.series("reward/accuracy")) for run in group]),
                response_length=_mean(
                    [_mean(run.series("response_length/mean")[-LAST_STEPS:]) for run in group]
                ),
                acceptance_mean=_mean([_mean(run.series("acceptance/mean")) for run in group]),
                acceptance_p5=_mean([_mean(run.series("acceptance/p5")) for run in group]),
                tokens_per_s=_mean([_mean(run.series("rollout/tokens_per_s")) for run in group]),
                measured_speedup=summary("measured_rollout_speedup"),
                predicted_speedup=summary("predicted_speedup_mean"),
                final_budgets=list(group[0].summary["final_schedule"]["budgets"]),
                wall_s=_mean([run.record.get("wall_s", math.nan) for run in group]),
                cpu_s=_mean([run.record.get("cpu_s", math.nan) for run in group]),
                bins=bins,
                p5_pooling=pooling,
                per_seed=[_seed_result(run, min_bin_tokens / len(group)) for run in group],
                curves={
                    "reward": _curve(group, "reward/mean"),
                    "accuracy": _curve(group, "reward/accuracy"),
                    "response_length": _curve(group, "response_length/mean"),
                    "acceptance_mean": _curve(group, "acceptance/mean"),
                    "min_bin_p5": _min_bin_p5_curve(group, per_step_min),
                },
            )
        )
    return results
