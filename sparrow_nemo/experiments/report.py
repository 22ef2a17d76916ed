"""The experiment's markdown report: setup, per-arm table, acceptance per bin, claims (a)-(d), figures."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from sparrow_nemo.experiments.analysis import ArmResult
from sparrow_nemo.experiments.arms import ArmsSpec
from sparrow_nemo.experiments.claims import Claim

__all__ = ["ReportContext", "render_report"]


@dataclass(frozen=True)
class ReportContext:
    """What the report states about how it was made.

    Attributes:
        command: the command line that regenerates it. recipe: the base recipe. seeds: rollout seeds.
        steps: RL steps per run. smoke: made with ``--smoke``. note: free text shown at the top (e.g.
        "pipeline check"). plots_dir: the figures' folder relative to the report. missing: runs not
        finished yet (``"<arm> seed <s>"``), listed at the top.
    """

    command: str
    recipe: str
    seeds: tuple[int, ...]
    steps: int
    smoke: bool
    note: str
    plots_dir: str
    missing: tuple[str, ...] = ()


def _f(x: float | None, spec: str = ".3f") -> str:
    return "n/a" if x is None or not math.isfinite(x) else format(x, spec)


def _budgets(values: Sequence[object]) -> str:
    return " ".join(str(v) for v in values)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return lines


def _setup(spec: ArmsSpec, ctx: ReportContext, results: Sequence[ArmResult]) -> list[str]:
    runs = sum(len(r.seeds) for r in results)
    wall = sum(r.wall_s * len(r.seeds) for r in results if math.isfinite(r.wall_s))
    cpu = sum(r.cpu_s * len(r.seeds) for r in results if math.isfinite(r.cpu_s))
    lines = [
        f"Regenerate: `{ctx.command}` (add `--report-only` to rebuild this file and the figures from the run "
        "folders without training).",
        "",
        f"- base recipe `{ctx.recipe}`, arms file `{spec.path.as_posix()}`{' (smoke subset)' if ctx.smoke else ''}; "
        f"common overrides: `{' '.join(spec.common) or 'none'}`"
        + (f"; smoke overrides: `{' '.join(spec.smoke_overrides)}`" if ctx.smoke else ""),
        f"- {len(results)} arms x {len(ctx.seeds)} seed(s) (rollout.seed = {', '.join(map(str, ctx.seeds))}; the "
        f"warm-start policy and the prompt stream are shared) = {runs} runs of {ctx.steps} RL steps each",
        f"- tail threshold {spec.threshold:g} (p5 per bin of cached length); bins with < {spec.min_bin_tokens} "
        f"tokens (all steps and seeds) are left out of the tail verdicts; outcome = `{spec.outcome}` "
        f"({results[0].outcome(spec.outcome)[1] if results else 0} samples per arm), degraded = below dense by "
        f"more than max({spec.degrade_margin:g}, 2 SE)",
        f"- time on this machine: {wall / 60:.1f} min wall, {cpu / 60:.1f} min CPU (process time) for the "
        f"{runs} runs; one run: {wall / max(runs, 1):.0f} s wall, {cpu / max(runs, 1):.0f} s CPU on average",
        f"- made {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
    ]
    return lines


def _arms_table(results: Sequence[ArmResult]) -> list[str]:
    rows = [
        [
            r.arm.name,
            r.arm.role,
            r.arm.title,
            "`" + (" ".join(r.arm.overrides) or "-") + "`",
            _budgets(r.final_budgets),
        ]
        for r in results
    ]
    return _table(["arm", "role", "label", "overrides", "final schedule (tokens per bin)"], rows)


def _results_table(results: Sequence[ArmResult], spec: ArmsSpec) -> list[str]:
    rows = [
        [
            r.arm.name,
            _f(r.accuracy_start),
            _f(r.accuracy_end),
            _f(r.accuracy_end_dense),
            f"{_f(r.train_accuracy_last)} / {_f(r.train_accuracy_best)}",
            _f(r.response_length, ".1f"),
            _f(r.acceptance_mean),
            _f(r.acceptance_p5),
            _f(r.min_p5(spec.min_bin_tokens)),
            _f(r.tokens_per_s, ".0f"),
            _f(r.measured_speedup, ".2f"),
            _f(r.predicted_speedup, ".3f"),
            f"{_f(r.wall_s, '.0f')} / {_f(r.cpu_s, '.0f')}",
        ]
        for r in results
    ]
    header = [
        "arm",
        "held-out acc. start",
        "end (own schedule)",
        "end (dense decode)",
        "train acc. last 5 / best 3",
        "response length",
        "mean acceptance",
        "p5 (all tokens)",
        "lowest bin p5",
        "rollout tok/s",
        "measured speedup",
        "predicted speedup",
        "s per run: wall / CPU",
    ]
    return _table(header, rows)


def _bins_table(results: Sequence[ArmResult], spec: ArmsSpec) -> list[str]:
    bins = sorted({b for r in results for b in r.bins})
    width = results[0].bin_tokens if results else 1
    header = ["arm", *(f"bin {b} ({b * width}-{(b + 1) * width - 1})" for b in bins)]
    rows = []
    for r in results:
        cells = [r.arm.name]
        for b in bins:
            v = r.bins.get(b)
            if v is None:
                cells.append("-")
                continue
            mark = "" if v["tokens"] >= spec.min_bin_tokens else " *"
            cells.append(f"{_f(v['p5'])} / {_f(v['mean'])} ({v['tokens']:.0f}){mark}")
        rows.append(cells)
    return _table(header, rows)


def _claims(claims: Sequence[Claim]) -> list[str]:
    rows = [[f"({c.letter})", c.statement, c.numbers, f"**{c.verdict}**"] for c in claims]
    lines = _table(["claim", "paper", "numbers (this experiment)", "verdict"], rows)
    lines += ["", "Rules:", ""]
    lines += [f"- ({c.letter}) {c.rule}." for c in claims]
    disagree = [c for c in claims if c.why]
    lines += ["", "## Where the toy disagrees (or agrees only in part), and why that may be", ""]
    if not disagree:
        lines.append("Every claim is reproduced at this scale.")
    lines += [f"- ({c.letter}) {c.verdict}: {c.why}." for c in disagree]
    return lines


def render_report(
    results: Sequence[ArmResult],
    claims: Sequence[Claim],
    spec: ArmsSpec,
    ctx: ReportContext,
    plots: Sequence[Path],
) -> str:
    """The report's markdown text."""
    title = "# Sparrow in miniature: the paper's claims (a)-(d) on the embedded task"
    lines = [title, ""]
    if ctx.note:
        lines += [f"> **{ctx.note}**", ""]
    if ctx.missing:
        lines += [f"> **Incomplete: {len(ctx.missing)} runs not finished ({', '.join(ctx.missing)}).**", ""]
    lines += _setup(spec, ctx, results)
    lines += ["", "## Arms", "", *_arms_table(results)]
    lines += ["", "## Results per arm (mean over seeds)", "", *_results_table(results, spec)]
    lines += [
        "",
        "Accuracy: fraction of held-out prompts solved, one sample each (start = warm-start policy). Train "
        "accuracy: per RL step on the training rollouts. Response length: tokens, last 5 steps. Acceptance: "
        "per response token, the union-of-top-K lower bound with K = `rollout.logprobs_topk` (the paper's 20; "
        "exact once K covers the vocabulary); p5 (all tokens) is the mean over steps of each step's p5, lowest "
        "bin p5 the pooled per-bin tail below. Tokens/s: rollout generation on this machine "
        "(shared CPU: noisy); measured speedup = held-out tokens/s with the arm's schedule / under dense decode, "
        "the two evaluations of the same run (minutes apart: with other jobs on the CPU the ratio moves by tens "
        "of percent, and the dense arm's own row, 1.0 by construction, shows by how much); predicted speedup = "
        "the decode cost model of the run's `rollout.cost_hardware` (`cost_hardware.json` in each run folder; "
        "auto = fitted to this CPU) for the run's rollouts under its schedule. CPU = process time of the run.",
        "",
        "## Acceptance per bin of cached length (pooled over steps and seeds)",
        "",
        "Each cell: p5 / mean (tokens). `*`: fewer than the minimum tokens, not used in verdicts. p5: "
        + "; ".join(sorted({r.p5_pooling for r in results}))
        + ".",
        "",
    ]
    lines += _bins_table(results, spec)
    lines += ["", "## Claims", "", *_claims(claims)]
    lines += ["", "## Figures", ""]
    lines += [f"![{p.stem}]({ctx.plots_dir}/{p.name})" for p in plots]
    return "\n".join(lines) + "\n"
