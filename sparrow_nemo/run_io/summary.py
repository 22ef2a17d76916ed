"""The end-of-run summary: accuracy before/after, acceptance-rate tail per bin vs threshold, speedups."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sparrow_nemo.run_io.metric_names import repeat_tag
from sparrow_nemo.sparse.config import SparsityConfig
from sparrow_nemo.sparse.mismatch import PAPER_QUANTILE, tail_name

SUMMARY_JSON = "summary.json"
SUMMARY_TXT = "summary.txt"


def tail_per_bin(history: Sequence[dict[str, Any]], stat: str) -> dict[int, dict[str, float]]:
    """Per bin over the steps: ``last`` and ``min`` of the tail statistic ``stat`` (``acceptance/<stat>/bin_<b>``,
    e.g. ``p5``: :func:`~sparrow_nemo.sparse.mismatch.tail_name` of the rule's quantile), ``steps`` with a value
    and ``tokens`` behind the last value (``acceptance/tokens/bin_<b>``; 0 when not logged)."""
    pattern = re.compile(rf"^acceptance/{re.escape(stat)}/bin_(\d+)$")
    out: dict[int, dict[str, float]] = {}
    for row in history:
        for key, value in row.items():
            match = pattern.match(key)
            if match is None or value is None:
                continue
            b = int(match.group(1))
            entry = out.setdefault(b, {"last": value, "min": value, "steps": 0})
            entry["last"], entry["min"], entry["steps"] = value, min(entry["min"], value), entry["steps"] + 1
            entry["tokens"] = row.get(f"acceptance/tokens/bin_{b}") or 0
    return dict(sorted(out.items()))


def timing_per_phase(history: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Mean seconds per step of every ``timing/<phase>`` metric over the steps that logged it."""
    values: dict[str, list[float]] = {}
    for row in history:
        for key, value in row.items():
            if key.startswith("timing/") and value is not None:
                values.setdefault(key.removeprefix("timing/"), []).append(value)
    return {phase: sum(v) / len(v) for phase, v in values.items()}


def pooled_speedup(
    evals: dict[str, dict[str, Any]], rate: str, arm: str = "end"
) -> tuple[float | None, list[float]]:
    """The end-of-run evaluation ``arm``'s speedup over dense (``end``: the final schedule, ``end_speculative``:
    it as speculative drafts) from the pairs (``arm`` / ``end_dense`` and their ``_repeat_<i>`` timing repeats):
    the ratio of the two's ``rate`` (``tokens_per_s`` or ``decode_tokens_per_s``) pooled over the pairs (their
    tokens summed over their seconds summed), and each pair's own ratio. ``(None, [])`` without a pair, or when
    a rate of one is missing or not positive."""
    found = []
    while (sparse := evals.get(repeat_tag(arm, len(found)))) and (
        dense := evals.get(repeat_tag("end_dense", len(found)))
    ):
        if not (sparse.get(rate, 0) > 0 and dense.get(rate, 0) > 0):
            return None, []
        found.append((sparse, dense))
    if not found:
        return None, []

    def pooled(results: list[dict[str, Any]]) -> float:
        tokens = [r["response_length_mean"] * r["prompts"] for r in results]
        return sum(tokens) / sum(t / r[rate] for t, r in zip(tokens, results, strict=True))

    ratio = pooled([s for s, _ in found]) / pooled([d for _, d in found])
    return ratio, [s[rate] / d[rate] for s, d in found]


def build_summary(
    state, history: Sequence[dict[str, Any]], sparsity: SparsityConfig, cost_hardware: str = ""
) -> dict[str, Any]:
    """The summary dict (JSON-ready) of a finished run; ``state`` is the trainer's :class:`TrainerState`,
    ``sparsity`` the recipe's section (the tail requirement), ``cost_hardware`` the name of the constants its decode cost model predicted with."""
    steps = [row for row in history if row["step"] >= 0]
    evals = state.evals
    threshold = sparsity.threshold
    stat = tail_name(sparsity.quantile)
    min_tokens = sparsity.min_bin_tokens

    def verdicts(tails: dict[int, dict[str, float]]) -> dict[str, dict[str, Any]]:
        # decided: the last value rests on enough tokens for the scheduler to act on it
        return {
            str(b): {**t, "ok": t["last"] >= threshold, "decided": t.get("tokens", 0) >= min_tokens}
            for b, t in tails.items()
        }

    tails = tail_per_bin(steps, stat)
    predicted = [row["sparsity/predicted_speedup"] for row in steps if row.get("sparsity/predicted_speedup")]
    summary: dict[str, Any] = {
        "steps": state.step,
        "threshold": threshold,
        "accuracy_start": evals.get("start", {}).get("accuracy"),
        "accuracy_end": evals.get("end", {}).get("accuracy"),
        "accuracy_end_dense": evals.get("end_dense", {}).get("accuracy"),
        "accuracy_start_dense": evals.get("start_dense", {}).get("accuracy"),
        "train_reward_first": steps[0]["reward/mean"] if steps else None,
        "train_reward_last": steps[-1]["reward/mean"] if steps else None,
        # the median response length (tokens) of the steps' rollouts, averaged over the run's steps
        "response_length_median_mean": _mean([row.get("response_length/median") for row in steps]),
        "min_bin_tokens": min_tokens,
        "tail_statistic": stat,
        "tail_per_bin": verdicts(tails),
        # the paper's p5 per bin whatever the rule's quantile (every step logs it), so runs compare
        "paper_tail_per_bin": verdicts(tail_per_bin(steps, tail_name(PAPER_QUANTILE))),
        "bins_below_threshold_last_step": [b for b, t in tails.items() if t["last"] < threshold],
        "initial_schedule": state.initial_schedule.to_dict() if state.initial_schedule else None,
        "final_schedule": state.schedule.to_dict(),
        "predicted_speedup_mean": sum(predicted) / len(predicted) if predicted else None,
        "cost_hardware": cost_hardware,
        "timing_mean_s": timing_per_phase(steps),
        "evals": evals,
    }
    speedup, pairs = pooled_speedup(evals, "tokens_per_s")
    if speedup is not None:
        summary["measured_rollout_speedup"] = speedup
        if len(pairs) > 1:
            summary["measured_rollout_speedup_pairs"] = pairs
        decode, _ = pooled_speedup(evals, "decode_tokens_per_s")  # absent before 12/2026
        if decode is not None:
            summary["measured_decode_speedup"] = decode
    lossless, lossless_pairs = pooled_speedup(evals, "tokens_per_s", "end_speculative")
    if lossless is not None:  # evaluation.speculative: the same prompts drafted sparse, verified dense
        summary["measured_speculative_speedup"] = lossless
        summary["measured_speculative_speedup_pairs"] = lossless_pairs
    speculative = {
        name: _mean([row.get(f"spec/{name}") for row in steps])
        for name in (
            "accept_rate",
            "alpha",
            "tokens_per_verify",
            "predicted_tokens_per_verify",
            "predicted_speedup",
        )
    }
    if speculative["accept_rate"] is not None:  # rollout.mode=speculative: the end evaluation speculated too
        last = steps[-1]
        bins = sorted(int(k.rsplit("_", 1)[1]) for k in last if k.startswith("spec/k/bin_"))
        speculative["last_k"] = [int(last[f"spec/k/bin_{b}"]) for b in bins]  # the plan of the last step
        speculative["last_draft_budget"] = [int(last[f"spec/budget/bin_{b}"]) for b in bins]
        summary["speculative"] = speculative
    return summary


def _mean(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def _fmt(value: Any, spec: str = ".3f") -> str:
    return "n/a" if value is None else format(value, spec)


def _pairs(summary: dict[str, Any]) -> str:
    """``, N pairs in ABBA order: a, b`` when the measured speedup pools several evaluation pairs."""
    pairs = summary.get("measured_rollout_speedup_pairs") or []
    if len(pairs) < 2:
        return ""
    return f", {len(pairs)} pairs in ABBA order: " + ", ".join(f"{p:.2f}x" for p in pairs)


def format_summary(summary: dict[str, Any]) -> str:
    """A few lines of text for the terminal."""
    hardware = summary.get("cost_hardware") or "h200"  # summaries written before the field: H200 constants
    stat = summary.get("tail_statistic", "p5")  # summaries written before the field: the paper's p5
    lines = [
        f"steps: {summary['steps']}",
        f"accuracy on held-out prompts: start {_fmt(summary['accuracy_start'])} -> end "
        f"{_fmt(summary['accuracy_end'])} (sparse schedule), {_fmt(summary.get('accuracy_start_dense'))} -> "
        f"{_fmt(summary['accuracy_end_dense'])} (dense)",
        f"response length: median {_fmt(summary.get('response_length_median_mean'), '.0f')} tokens "
        "(per step, mean over the steps)",
        f"acceptance-rate tail per bin ({stat}, threshold {summary['threshold']:g}; last step / worst step):",
    ]
    paper = summary.get("paper_tail_per_bin", {}) if stat != tail_name(PAPER_QUANTILE) else {}
    for b, t in summary["tail_per_bin"].items():
        mark = "ok" if t["ok"] else "BELOW"
        if not t["ok"] and t.get("tokens", 0) < summary.get("min_bin_tokens", 0):
            mark += " (too few tokens for a decision)"
        also = f"  (p5 last {paper[b]['last']:.3f})" if b in paper else ""
        lines.append(
            f"  bin {b:>3}: {t['last']:.3f} / {t['min']:.3f}  {mark}  [{t.get('tokens', 0):.0f} tokens]{also}"
        )
    final = summary["final_schedule"]["budgets"]
    lines.append(f"final schedule (tokens per bin): {final}")
    spec = summary.get("speculative")
    if spec is None:
        lines.append(
            f"rollout speedup vs dense: predicted {_fmt(summary['predicted_speedup_mean'], '.2f')}x ({hardware} cost model), "
            f"measured {_fmt(summary.get('measured_rollout_speedup'), '.2f')}x (this machine{_pairs(summary)}; "
            f"decode only {_fmt(summary.get('measured_decode_speedup'), '.2f')}x, prefill is dense in every "
            "schedule)"
        )
        if summary.get("measured_speculative_speedup") is not None:
            accuracy = (summary["evals"].get("end_speculative") or {}).get("accuracy")
            lines.append(
                f"lossless speculative rollout (the final schedule drafts, dense verifies) vs dense: measured "
                f"{summary['measured_speculative_speedup']:.2f}x (pairs: "
                + ", ".join(f"{p:.2f}x" for p in summary["measured_speculative_speedup_pairs"])
                + f"); held-out accuracy {_fmt(accuracy)} (dense's "
                f"{_fmt(summary['accuracy_end_dense'])}: the same distribution, other draws)"
            )
    else:
        lines.append(
            f"speculative rollout (lossless): accept rate {_fmt(spec['accept_rate'])}, "
            f"{_fmt(spec['tokens_per_verify'], '.2f')} tokens per verify (predicted "
            f"{_fmt(spec['predicted_tokens_per_verify'], '.2f')} from the measured acceptance)"
        )
        if spec.get("last_k"):
            lines.append(
                f"last step's plan per bin: k {spec['last_k']}, draft budget {spec['last_draft_budget']} tokens"
                + (
                    " (k = 0: plain dense decoding where drafting would not pay)"
                    if 0 in spec["last_k"]
                    else ""
                )
            )
        lines.append(
            f"rollout speedup vs dense: predicted {_fmt(spec['predicted_speedup'], '.2f')}x ({hardware} cost model), "
            f"measured {_fmt(summary.get('measured_rollout_speedup'), '.2f')}x (this machine, speculative vs dense "
            f"evaluation{_pairs(summary)}; decode only {_fmt(summary.get('measured_decode_speedup'), '.2f')}x)"
        )
    timing = summary.get("timing_mean_s") or {}
    if timing:
        order = ["step", *sorted(k for k in timing if k != "step")]
        lines.append(
            "seconds per step (mean): " + ", ".join(f"{k} {timing[k]:.2f}" for k in order if k in timing)
        )
    return "\n".join(lines)


def write_summary(summary: dict[str, Any], run_dir: Path) -> None:
    """``summary.json`` and ``summary.txt`` in the run folder."""
    (run_dir / SUMMARY_JSON).write_text(json.dumps(summary, indent=2) + "\n")
    (run_dir / SUMMARY_TXT).write_text(format_summary(summary) + "\n")
