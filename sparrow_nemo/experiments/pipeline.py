"""The experiment end to end: plan the runs, run the missing ones, analyse, write the report and figures.

Outputs under ``out`` for an arms file ``<prefix>_arms.yaml`` (``<prefix>_smoke_...`` with ``smoke``):
``<prefix>_runs/<arm>/seed_<s>/`` (the runs; not committed), ``<prefix>_report.md``, ``<prefix>_plots/*.png``
and ``<prefix>_results.json`` (every arm's aggregate over its seeds and every claim's verdict: the one
results file a committed experiment keeps).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from sparrow_nemo.experiments import claims as paper_claims
from sparrow_nemo.experiments import tolerant_claims
from sparrow_nemo.experiments.analysis import aggregate, load_runs
from sparrow_nemo.experiments.arms import ArmsSpec
from sparrow_nemo.experiments.plots import write_plots
from sparrow_nemo.experiments.report import ReportContext, render_report
from sparrow_nemo.experiments.runner import RunPlan, execute, plan_runs

__all__ = ["ExperimentPaths", "experiment_paths", "run_experiment"]


@dataclass(frozen=True)
class ExperimentPaths:
    """Where an experiment's runs, report and figures go."""

    runs: Path
    report: Path
    plots: Path
    results: Path


def experiment_paths(out: Path, spec: ArmsSpec, smoke: bool) -> ExperimentPaths:
    """The output paths for ``spec`` under ``out`` (see the module docstring)."""
    stem = spec.prefix + ("_smoke" if smoke else "")
    out = Path(out)
    return ExperimentPaths(
        out / f"{stem}_runs", out / f"{stem}_report.md", out / f"{stem}_plots", out / f"{stem}_results.json"
    )


def results_json(results: Sequence, claims: Sequence, command: str, seeds: Sequence[int]) -> str:
    """The aggregated results file: per arm its :class:`ArmResult` fields (the arm as name/role/label),
    per claim its letter, verdict, numbers and rule; the command that made them."""
    arms = []
    for r in results:
        row = {f.name: getattr(r, f.name) for f in dataclasses.fields(r) if f.name != "arm"}
        row["per_seed"] = [dataclasses.asdict(x) for x in r.per_seed]
        arms.append({"arm": r.arm.name, "role": r.arm.role, "label": r.arm.label, **row})
    data = {
        "command": command,
        "seeds": list(seeds),
        "arms": arms,
        "claims": [dataclasses.asdict(c) for c in claims],
    }
    return json.dumps(_finite(data), indent=1, default=str, allow_nan=False) + "\n"


def _finite(value):
    """``value`` with NaN/inf floats as None (strict JSON), through dicts and lists."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def run_experiment(
    recipe: str,
    spec: ArmsSpec,
    seeds: Sequence[int],
    out: Path,
    *,
    command: str,
    extra: Sequence[str] = (),
    smoke: bool = False,
    report_only: bool = False,
    note: str = "",
    show_progress: bool = True,
    jobs: int = 1,
) -> ExperimentPaths:
    """Run (unless ``report_only``) every arm x seed not yet done, then write the report and the figures.

    Args:
        recipe: base recipe (path or shipped name). spec: the parsed arms file. seeds: rollout seeds.
        out: output folder. command: the command line the report quotes to regenerate itself.
        extra: ``key=value`` overrides for every arm (after the arm's own).
        smoke: the arms file's cut-down subset and overrides. report_only: only read existing runs.
        note: a line shown at the top of the report. show_progress: the bar over the runs.
        jobs: runs at once, each in its own process (see :func:`~sparrow_nemo.experiments.runner.execute`).

    With ``report_only`` the report covers the finished runs and lists the missing ones (an experiment
    in progress); FileNotFoundError when none is finished. ArmsError for a bad override or a stale run folder.
    """
    paths = experiment_paths(out, spec, smoke)
    plans: list[RunPlan] = plan_runs(recipe, spec, seeds, paths.runs, extra, smoke)
    if not report_only:
        execute(plans, show_progress, jobs)
    arms = spec.selected(smoke)
    runs, missing = load_runs(paths.runs, arms, seeds, smoke)
    if not runs:
        raise FileNotFoundError(f"no finished run under {paths.runs} (run without --report-only first)")
    results = aggregate(runs, spec.min_bin_tokens)
    claims = (tolerant_claims if spec.rules == "tolerant" else paper_claims).evaluate_claims(results, spec)
    figures = write_plots(results, spec.threshold, spec.min_bin_tokens, paths.plots)
    ctx = ReportContext(
        command=command,
        recipe=str(recipe),
        seeds=tuple(seeds),
        steps=plans[0].config.trainer.max_steps,
        smoke=smoke,
        note=note,
        plots_dir=paths.plots.name,
        missing=tuple(missing),
    )
    for path, text in (
        (paths.report, render_report(results, claims, spec, ctx, figures)),
        (paths.results, results_json(results, claims, command, seeds)),
    ):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)
    return paths
