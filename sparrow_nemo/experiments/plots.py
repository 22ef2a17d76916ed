"""PNG figures of an experiment from its :class:`~sparrow_nemo.experiments.analysis.ArmResult` list.

- ``p5_vs_length.png``: pooled p5 per bin against cached length (tokens), fixed budgets solid, schedules
  dashed, distilled dotted, the threshold as a red line (claim b); hollow markers: bins with too few
  tokens for a verdict;
- ``training_curves.png``: mean reward, train accuracy and response length per RL step, one line per arm, and
  each sparse arm's reward minus the dense arm's (a trailing 5-step mean): the arms share the prompt stream, so
  the difference removes the step-to-step swing of problem difficulty that hides a slow degradation;
- ``acceptance_over_steps.png``: mean acceptance and the lowest per-bin p5 per RL step (claim a).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from sparrow_nemo.experiments.analysis import ArmResult

__all__ = ["PLOT_NAMES", "write_plots"]

PLOT_NAMES: tuple[str, ...] = ("p5_vs_length.png", "training_curves.png", "acceptance_over_steps.png")
_STYLE = {"dense": "-", "fixed": "-", "schedule": "--", "distill": ":", "inject": "-."}
_SMOOTH_STEPS = 5  # the trailing window of the reward-minus-dense panel (RL steps)


def _clean(values: Sequence[float]) -> list[float]:
    return [v if math.isfinite(v) else float("nan") for v in values]


def write_plots(
    results: Sequence[ArmResult], threshold: float, min_bin_tokens: int, out_dir: Path
) -> list[Path]:
    """Write the three figures into ``out_dir``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, r in enumerate(results):
        if r.arm.role == "dense":
            continue
        decided = r.decided_bins(min_bin_tokens)
        x = [b * r.bin_tokens for b in decided]
        y = [v["p5"] for v in decided.values()]
        ax.plot(x, y, _STYLE[r.arm.role], color=f"C{i}", marker="o", label=r.arm.title)
        sparse = {b: v for b, v in r.bins.items() if b not in decided}
        ax.scatter(
            [b * r.bin_tokens for b in sparse],
            [v["p5"] for v in sparse.values()],
            facecolors="none",
            edgecolors=f"C{i}",
        )
    ax.axhline(threshold, color="red", linestyle="--", linewidth=1, label=f"threshold {threshold:g}")
    ax.set_xlabel("cached length (tokens, start of bin)")
    ax.set_ylabel("p5 of acceptance rate (pooled over steps, seeds)")
    ax.set_title("tail per bin: fixed budgets (solid) vs schedules (dashed); hollow: few tokens")
    ax.legend(fontsize="small")
    fig.tight_layout()
    paths.append(out_dir / PLOT_NAMES[0])
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    panels = (
        ("reward", "mean reward"),
        ("accuracy", "train accuracy"),
        ("response_length", "response length"),
        (_VS_DENSE, f"reward - dense reward ({_SMOOTH_STEPS}-step trailing mean)"),
    )
    paths.append(_curves_over_steps(results, panels, out_dir / PLOT_NAMES[1], width=20))
    panels = (("acceptance_mean", "mean acceptance"), ("min_bin_p5", "lowest per-bin p5"))
    paths.append(
        _curves_over_steps(
            results, panels, out_dir / PLOT_NAMES[2], width=11, threshold=("min_bin_p5", threshold)
        )
    )
    return paths


_VS_DENSE = "reward_vs_dense"  # a derived curve: not in ArmResult.curves


def _reward_vs_dense(arm: ArmResult, results: Sequence[ArmResult]) -> list[float]:
    """Per RL step, ``arm``'s mean reward minus the dense arm's, as a trailing mean over ``_SMOOTH_STEPS``
    steps (empty without a dense arm, and for the dense arm itself)."""
    dense = next((r for r in results if r.arm.role == "dense"), None)
    if dense is None or arm is dense:
        return []
    diff = [a - b for a, b in zip(_clean(arm.curves["reward"]), _clean(dense.curves["reward"]))]
    return [
        sum(window) / len(window)
        for window in (diff[max(0, i + 1 - _SMOOTH_STEPS) : i + 1] for i in range(len(diff)))
    ]


def _curves_over_steps(
    results: Sequence[ArmResult],
    panels: Sequence[tuple[str, str]],
    path: Path,
    width: float,
    threshold: tuple[str, float] | None = None,
) -> Path:
    """One PNG, a panel per ``(curve key, title)``: each arm's curve over RL steps; ``threshold`` = (key, value)
    draws the tail threshold on that panel."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(width, 4))
    for ax, (key, title) in zip(axes, panels):
        for i, r in enumerate(results):
            values = _reward_vs_dense(r, results) if key == _VS_DENSE else _clean(r.curves[key])
            ax.plot(values, _STYLE[r.arm.role], color=f"C{i}", marker=".", label=r.arm.title)
        if key == _VS_DENSE:
            ax.axhline(0.0, color="gray", linewidth=1)
        if threshold is not None and key == threshold[0]:
            value = threshold[1]
            ax.axhline(value, color="red", linestyle="--", linewidth=1, label=f"threshold {value:g}")
        ax.set_xlabel("RL step")
        ax.set_title(title)
    axes[0].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
