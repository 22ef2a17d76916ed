"""The calibration pass: sparse rollouts at fixed budgets, scored dense, -> the calibrated schedule and its files.

For each candidate budget the engine generates the calibration prompts with a fixed-budget schedule, the
same engine scores the full sequences densely (teacher-forced, no LoRA), and every response token's
acceptance rate is the union-of-top-K lower bound between the dense and the sparse top-K at that position
(``sparrow_nemo.rollout.scoring.measure_mismatch``). The method layer's ``calibrate_schedule``
(:mod:`sparrow_nemo.sparse.calibration`, framework-free) then picks, per bin, the smallest budget whose
tail meets the threshold. Outputs go to ``run_dir``: the per-bin tail table (JSON, CSV, aligned text),
the schedule YAML and a plot (:func:`write_calibration_outputs`). Used by the controller before training
(``control.calibrate``), ``sparrow calibrate`` and the DistillSparse report.
"""

from __future__ import annotations

import csv
import itertools
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from sparrow_nemo.config.schema import AT_LEAST_ONE, Section, knob
from sparrow_nemo.rollout.engine import RolloutEngine, SamplingParams
from sparrow_nemo.rollout.scoring import measure_mismatch
from sparrow_nemo.sparse.calibration import PAPER_CANDIDATE_BUDGETS, CalibrationResult, calibrate_schedule
from sparrow_nemo.sparse.mismatch import tail_name
from sparrow_nemo.sparse.pattern import PAGE_SIZE
from sparrow_nemo.sparse.schedule import DENSE_BUDGET, BudgetSchedule

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CalibrationConfig(Section):
    """``control.calibration``: the calibration pass that picks a schedule for ``sparsity.threshold`` (the paper's
    setup), and the budget ladder of the scheduler and the speculative planner."""

    candidate_budgets: tuple[int, ...] = knob(
        PAPER_CANDIDATE_BUDGETS,
        "candidate budgets in tokens (reserved pages included), strictly increasing multiples of page_size; "
        "also the scheduler's budget ladder and the speculative planner's draft budgets",
    )
    num_prompts: int = knob(
        30, "calibration prompts (held-out: data.val_path or the synthetic task)", check=AT_LEAST_ONE
    )
    samples_per_prompt: int = knob(
        8, "sparse samples per calibration prompt (the paper: 8)", check=AT_LEAST_ONE
    )

    def check(self) -> None:  # multiples of the pages and above the reserved pages: the recipe's rule
        if not self.candidate_budgets:
            raise self.invalid("candidate_budgets", "at least one candidate budget")
        if any(b <= a for a, b in itertools.pairwise(self.candidate_budgets)):
            raise self.invalid("candidate_budgets", "strictly increasing budgets")


def run_calibration(
    engine: RolloutEngine,
    prompts: Sequence[Sequence[int]],
    candidates: Sequence[int],
    sampling: SamplingParams,
    bin_tokens: int,
    threshold: float = 0.86,
    quantile: float = 0.05,
    page_size: int = PAGE_SIZE,
    run_dir: str | Path | None = None,
    min_tokens: int = 1,
) -> CalibrationResult:
    """Calibrate a schedule on ``prompts`` (one sample each; repeat a prompt for several samples).

    Args:
        engine: the rollout engine (sparse generation and dense scoring).
        prompts: token ids per calibration sample.
        candidates: fixed budgets to try, tokens (multiples of ``page_size``).
        sampling: generation settings; its ``logprobs_topk`` (paper: 20) is K for both sides of alpha.
        bin_tokens: bin width of cached length, tokens. threshold, quantile: the tail requirement.
        page_size: tokens per KV page (must match the engine's).
        run_dir: where to write the table (JSON, CSV, text), the schedule YAML and the plot; None: nowhere.
        min_tokens: a (budget, bin) cell with fewer tokens counts as no data.

    Returns:
        The method layer's :class:`CalibrationResult` (schedule, per-budget per-bin tails and counts).
    """
    if not prompts:
        raise ValueError("run_calibration: no calibration prompts")
    budgets = sorted({int(c) for c in candidates})
    if not budgets:
        raise ValueError("run_calibration: no candidate budgets")
    samples: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for budget in budgets:
        schedule = BudgetSchedule(
            bin_tokens=bin_tokens, budgets=(budget,), page_size=page_size, name=f"fixed:{budget}"
        )
        batch = engine.generate(prompts, sampling, schedule)
        mismatch = measure_mismatch(engine, batch)
        samples[budget] = (mismatch.alpha, mismatch.cached_len)
        logger.info(
            "calibration: budget %d tokens: %d response tokens, min alpha %.4f",
            budget,
            samples[budget][0].numel(),
            float(samples[budget][0].min()),
        )
    result = calibrate_schedule(
        samples,
        threshold=threshold,
        bin_tokens=bin_tokens,
        quantile=quantile,
        page_size=page_size,
        min_tokens=min_tokens,
        name=f"calibrated-{threshold:g}",
    )
    if result.unsatisfied_bins:
        logger.warning(
            "calibration: no candidate budget reaches %s >= %.3f in bins %s; those bins fall back to dense",
            tail_name(quantile),
            threshold,
            list(result.unsatisfied_bins),
        )
    if run_dir is not None:
        write_calibration_outputs(result, Path(run_dir))
    return result


# ----- the files of a pass ------------------------------------------------------------------
#: file names written into the calibration folder
TABLE_JSON = "calibration_table.json"
TABLE_CSV = "calibration_table.csv"
TABLE_TXT = "calibration_table.txt"
SCHEDULE_YAML = "schedule.yaml"
PLOT_PNG = "calibration_tail.png"

CSV_COLUMNS = ("budget", "bin", "cached_len_start", "cached_len_end", "tokens", "tail", "passes", "chosen")


def _budget_label(budget: int) -> str:
    return "dense" if budget == DENSE_BUDGET else str(budget)


def csv_rows(result: CalibrationResult) -> list[dict[str, object]]:
    """One row per (candidate budget, bin) cell with data, budgets ascending then bins ascending.

    ``tail`` is empty for cells below the calibration's min_tokens; ``chosen`` marks the calibrated budget
    of that bin; cached lengths are the bin's token range [start, end).
    """
    bin_tokens, chosen = result.schedule.bin_tokens, result.schedule.budgets
    rows = []
    for budget in sorted(result.counts):
        for b in sorted(result.counts[budget]):
            tail = result.tails[budget].get(b)
            rows.append(
                {
                    "budget": _budget_label(budget),
                    "bin": b,
                    "cached_len_start": b * bin_tokens,
                    "cached_len_end": (b + 1) * bin_tokens,
                    "tokens": result.counts[budget][b],
                    "tail": "" if tail is None else f"{tail:.6f}",
                    "passes": "" if tail is None else int(tail >= result.threshold),
                    "chosen": int(b < len(chosen) and chosen[b] == budget),
                }
            )
    return rows


def plot_calibration(result: CalibrationResult, path: Path) -> None:
    """PNG: tail of alpha vs cached length (bin centre), one line per budget, the threshold, chosen cells."""
    fig = Figure(figsize=(8, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    bin_tokens, chosen = result.schedule.bin_tokens, result.schedule.budgets
    for budget in sorted(result.tails):
        cells = sorted(result.tails[budget].items())
        if not cells:
            continue
        xs = [(b + 0.5) * bin_tokens for b, _ in cells]
        (line,) = ax.plot(
            xs, [v for _, v in cells], marker="o", ms=3, lw=1, label=f"budget {_budget_label(budget)}"
        )
        picked = [(x, v) for x, (b, v) in zip(xs, cells) if b < len(chosen) and chosen[b] == budget]
        if picked:
            ax.scatter(*zip(*picked), s=90, facecolors="none", edgecolors=line.get_color(), linewidths=1.5)
    ax.axhline(result.threshold, color="black", ls="--", lw=1, label=f"threshold {result.threshold:g}")
    ax.set_xlabel("cached length (tokens)")
    ax.set_ylabel(f"{tail_name(result.quantile)} of acceptance rate")
    ax.set_title("calibration: tail per bin and budget (circles: chosen budget)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="lower left")
    fig.tight_layout()
    fig.savefig(path)


def write_calibration_outputs(result: CalibrationResult, out_dir: Path) -> dict[str, Path]:
    """Write the table (JSON, CSV, aligned text), the schedule YAML and the plot into ``out_dir``.

    Returns:
        {kind: path} for ``json``, ``csv``, ``txt``, ``schedule``, ``plot``.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": out_dir / TABLE_JSON,
        "csv": out_dir / TABLE_CSV,
        "txt": out_dir / TABLE_TXT,
        "schedule": out_dir / SCHEDULE_YAML,
        "plot": out_dir / PLOT_PNG,
    }
    paths["json"].write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    with paths["csv"].open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(csv_rows(result))
    paths["txt"].write_text(result.table() + "\n")
    result.schedule.to_yaml(paths["schedule"])
    plot_calibration(result, paths["plot"])
    return paths
