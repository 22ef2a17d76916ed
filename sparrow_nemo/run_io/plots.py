"""PNG plots of a run from its metrics rows (reward, response length, tail per bin, schedule) and its step
histograms (response length and per-token acceptance as heat maps over the steps, TensorBoard's distributions
for runs without TensorBoard or W&B)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sparrow_nemo.run_io.histograms import Histogram

_BUDGET = re.compile(r"^sparsity/budget/bin_(\d+)$")


def _series(history: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    points = [(row["step"], row[key]) for row in history if row.get(key) is not None and row["step"] >= 0]
    return [p[0] for p in points], [p[1] for p in points]


def _per_bin(history: Sequence[dict[str, Any]], pattern: re.Pattern) -> dict[int, str]:
    keys = {k for row in history for k in row if pattern.match(k)}
    return dict(sorted((int(pattern.match(k).group(1)), k) for k in keys))


#: PNG file and title of each step histogram (:mod:`sparrow_nemo.run_io.histograms`)
HISTOGRAM_PLOTS = {
    "response_length/histogram": ("response_length_histogram.png", "response length (tokens)"),
    "acceptance/histogram": ("acceptance_histogram.png", "per-token acceptance rate"),
}


def write_plots(
    history: Sequence[dict[str, Any]],
    threshold: float,
    out_dir: Path,
    stat: str,
    histograms: Sequence[tuple[int, Mapping[str, Histogram]]] = (),
) -> list[Path]:
    """Write reward.png, response_length.png, tail_per_bin.png (the tail statistic ``stat``, e.g. ``p1``, per
    bin) and schedule.png (and, for a speculative run, speculative.png and speculative_tokens.png), and one
    heat map per step histogram in ``histograms`` (``(step, {name: Histogram})``, as
    :attr:`~sparrow_nemo.run_io.metrics.MetricsWriter.histograms` holds them; :func:`write_histogram_plot`);
    returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    panels = {
        "reward.png": ("reward", [("reward/mean", "mean reward"), ("reward/accuracy", "accuracy")], None),
        "response_length.png": (
            "response length (tokens)",
            [
                ("response_length/mean", "mean"),
                ("response_length/median", "median"),
                ("response_length/max", "max"),
            ],
            None,
        ),
        "tail_per_bin.png": (
            f"acceptance-rate tail ({stat}) per bin",
            [
                (k, f"bin {b}")
                for b, k in _per_bin(history, re.compile(rf"^acceptance/{stat}/bin_(\d+)$")).items()
            ],
            threshold,
        ),
        "schedule.png": (
            "KV budget per bin (tokens)",
            [(k, f"bin {b}") for b, k in _per_bin(history, _BUDGET).items()],
            None,
        ),
    }
    if any("spec/accept_rate" in row for row in history):  # rollout.mode=speculative
        panels["speculative.png"] = (
            "speculative rollout: draft acceptance",
            [("spec/accept_rate", "accept rate (tested drafts)"), ("spec/alpha", "mean sum_v min(p, q)")],
            None,
        )
        panels["speculative_tokens.png"] = (
            "speculative rollout: tokens per verify and predicted speedup",
            [
                ("spec/tokens_per_verify", "tokens per verify (measured)"),
                ("spec/predicted_tokens_per_verify", "tokens per verify (from acceptance)"),
                ("spec/predicted_speedup", "predicted speedup vs dense (cost model)"),
            ],
            None,
        )
    paths = []
    for name, (title, lines, hline) in panels.items():
        fig, ax = plt.subplots(figsize=(6, 4))
        for key, label in lines:
            x, y = _series(history, key)
            y = [v if math.isfinite(v) else float("nan") for v in y]
            ax.plot(x, y, marker=".", label=label)
        if hline is not None:
            ax.axhline(hline, color="red", linestyle="--", label=f"threshold {hline:g}")
        ax.set_xlabel("RL step")
        ax.set_title(title)
        if lines or hline is not None:
            ax.legend(fontsize="small")
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=100)
        plt.close(fig)
        paths.append(out_dir / name)
    for key, (name, title) in HISTOGRAM_PLOTS.items():
        steps = [(step, found[key]) for step, found in histograms if key in found]
        if steps:
            paths.append(write_histogram_plot(steps, title, out_dir / name))
    return paths


def write_histogram_plot(steps: Sequence[tuple[int, Histogram]], title: str, path: Path) -> Path:
    """One histogram over the RL steps as a heat map: a column per step, its bins' share of the step's values
    as colour, the step's mean as a line (TensorBoard's distribution view as a PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shares = [[[c / h.total if h.total else 0.0] for c in h.counts] for _, h in steps]
    top = max(max(row[0] for row in share) for share in shares) or 1.0
    fig, ax = plt.subplots(figsize=(6, 4))
    mesh = None
    for (step, h), share in zip(steps, shares):
        mesh = ax.pcolormesh([step - 0.5, step + 0.5], h.edges, share, cmap="viridis", vmin=0.0, vmax=top)
    ax.plot([s for s, _ in steps], [h.mean for _, h in steps], color="white", marker=".", label="mean")
    fig.colorbar(mesh, ax=ax, label="share of the step's values")
    ax.set_xlabel("RL step")
    ax.set_title(title)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
