"""The experiment end to end: plan the runs, run the missing ones, analyse, write the report and figures.

Outputs under ``out`` for an arms file ``<prefix>_arms.yaml`` (``<prefix>_smoke_...`` with ``smoke``):
``<prefix>_runs/<arm>/seed_<s>/`` (the runs), ``<prefix>_report.md`` and ``<prefix>_plots/*.png``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from sparrow_nemo.experiments.analysis import aggregate, load_runs
from sparrow_nemo.experiments.arms import ArmsSpec
from sparrow_nemo.experiments.claims import evaluate_claims
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


def experiment_paths(out: Path, spec: ArmsSpec, smoke: bool) -> ExperimentPaths:
    """The output paths for ``spec`` under ``out`` (see the module docstring)."""
    stem = spec.prefix + ("_smoke" if smoke else "")
    out = Path(out)
    return ExperimentPaths(out / f"{stem}_runs", out / f"{stem}_report.md", out / f"{stem}_plots")


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
) -> ExperimentPaths:
    """Run (unless ``report_only``) every arm x seed not yet done, then write the report and the figures.

    Args:
        recipe: base recipe (path or shipped name). spec: the parsed arms file. seeds: rollout seeds.
        out: output folder. command: the command line the report quotes to regenerate itself.
        extra: ``key=value`` overrides for every arm (after the arm's own).
        smoke: the arms file's cut-down subset and overrides. report_only: only read existing runs.
        note: a line shown at the top of the report. show_progress: the bar over the runs.

    With ``report_only`` the report covers the finished runs and lists the missing ones (an experiment
    in progress); FileNotFoundError when none is finished. ArmsError for a bad override or a stale run folder.
    """
    paths = experiment_paths(out, spec, smoke)
    plans: list[RunPlan] = plan_runs(recipe, spec, seeds, paths.runs, extra, smoke)
    if not report_only:
        execute(plans, show_progress)
    arms = spec.selected(smoke)
    runs, missing = load_runs(paths.runs, arms, seeds)
    if not runs:
        raise FileNotFoundError(f"no finished run under {paths.runs} (run without --report-only first)")
    results = aggregate(runs, spec.min_bin_tokens)
    claims = evaluate_claims(results, spec)
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
    tmp = paths.report.with_suffix(".md.tmp")
    tmp.write_text(render_report(results, claims, spec, ctx, figures))
    tmp.replace(paths.report)
    return paths
