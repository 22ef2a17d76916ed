"""Plot of the controller's history: per-bin tail and per-bin budget over training steps."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def plot_tail_history(
    history: Sequence[dict[str, Any]], threshold: float, stat_name: str, path: Path
) -> None:
    """PNG with two panels sharing the step axis.

    Top: the tail statistic (``stat_name``, e.g. p5) of each bin per step, and the threshold. Bottom: each
    bin's budget (tokens) in force after the step; a dense bin is drawn at the top edge with an "x".

    Args:
        history: :attr:`~sparrow_nemo.control.callback.SparrowCallback.history` entries (``step``, ``bins``, ``schedule``, ``actions``).
        threshold: the tail requirement. stat_name: its label. path: output PNG.
    """
    fig = Figure(figsize=(8, 6), dpi=100)
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True)
    bins = sorted({cell["bin"] for entry in history for cell in entry["bins"]})
    finite = [b for entry in history for b in entry["schedule"] if b != "dense"]
    dense_level = 1.1 * max(finite) if finite else 1.0
    for b in bins:
        cells = [(e["step"], c["value"]) for e in history for c in e["bins"] if c["bin"] == b]
        (line,) = top.plot(*zip(*cells), marker="o", ms=2, lw=1, label=f"bin {b}")
        budgets = [(e["step"], e["schedule"][min(b, len(e["schedule"]) - 1)]) for e in history]
        bottom.step(
            [s for s, _ in budgets],
            [dense_level if v == "dense" else v for _, v in budgets],
            where="post",
            color=line.get_color(),
            lw=1,
        )
        dense_steps = [s for s, v in budgets if v == "dense"]
        if dense_steps:
            bottom.scatter(dense_steps, [dense_level] * len(dense_steps), marker="x", color=line.get_color())
    guard = [e["step"] for e in history if any(a["action"] == "dense" for a in e["actions"])]
    for ax in (top, bottom):
        for step in guard:
            ax.axvline(step, color="red", lw=1, ls=":")
    top.axhline(threshold, color="black", ls="--", lw=1, label=f"threshold {threshold:g}")
    top.set_ylabel(f"{stat_name} of acceptance rate")
    top.legend(fontsize=7, ncol=3, loc="lower left")
    bottom.set_ylabel("budget (tokens)")
    bottom.set_xlabel("step")
    top.set_title("tail per bin and budget per bin (red: collapse guard)")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
