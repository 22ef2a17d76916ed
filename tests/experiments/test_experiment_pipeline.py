"""`sparrow experiment --smoke`: the pipeline end to end on the smoke arms (mechanics, not findings).

Runs the arms file's smoke subset (3 arms, 1 seed, 2 RL steps, 8 held-out prompts) with the smoke recipe
through the CLI, then checks the run folders, the report's tables and claims, the figures, that a second
call skips the finished runs, and that ``--report-only`` rebuilds the same report. The warm-start comes
from the shared cache (``~/.cache/sparrow_nemo/warmstart`` or ``$SPARROW_CACHE``; trained once if cold).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from sparrow_nemo import cli
from sparrow_nemo.experiments.arms import load_arms
from sparrow_nemo.experiments.plots import PLOT_NAMES

pytestmark = pytest.mark.slow

ARMS = Path(__file__).resolve().parents[2] / "experiments" / "tiny_arms.yaml"


def test_smoke_experiment_writes_runs_report_and_figures(tmp_path: Path) -> None:
    spec = load_arms(ARMS)
    args = [
        "experiment",
        "--config",
        "tiny_cpu_short_smoke",
        "--arms",
        str(ARMS),
        "--smoke",
        "--out",
        str(tmp_path),
    ]
    assert cli.main([*args, "--note", "pipeline check"]) == 0

    runs = tmp_path / "tiny_smoke_runs"
    assert sorted(p.name for p in runs.iterdir()) == sorted(spec.smoke_arms)
    for arm in spec.smoke_arms:
        folder = runs / arm / "seed_0"
        summary = json.loads((folder / "summary.json").read_text())
        assert summary["steps"] == 2
        record = json.loads((folder / "experiment_run.json").read_text())
        assert record["arm"] == arm and record["wall_s"] > 0 and record["cpu_s"] > 0
        rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        assert any("acceptance/mean/bin_1" in row for row in rows)
    assert not list(runs.glob("*/*.partial"))

    report = (tmp_path / "tiny_smoke_report.md").read_text()
    assert report.startswith("# Sparrow in miniature") and "> **pipeline check**" in report
    for arm in spec.smoke_arms:  # one row per arm in the arms, results and per-bin tables
        assert len(re.findall(rf"^\| {re.escape(arm)} \|", report, flags=re.M)) == 3, arm
    for letter in "abcd":
        row = re.search(rf"^\| \({letter}\) \|.*\| \*\*(.+?)\*\* \|$", report, flags=re.M)
        assert row and row.group(1) in ("reproduced", "not reproduced", "inconclusive"), letter
    for name in PLOT_NAMES:
        assert (tmp_path / "tiny_smoke_plots" / name).stat().st_size > 5000, name
        assert f"(tiny_smoke_plots/{name})" in report
    results = json.loads(
        (tmp_path / "tiny_smoke_results.json").read_text(),
        parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"),
    )
    assert [a["arm"] for a in results["arms"]] == list(spec.smoke_arms)
    assert [c["letter"] for c in results["claims"]] == list("abcd")
    assert all(a["eval_prompts"] > 0 and "bins" in a for a in results["arms"])

    # finished runs are skipped; --report-only rebuilds the same tables from the run folders
    stamp = (runs / "dense" / "seed_0" / "summary.json").stat().st_mtime_ns
    assert cli.main([*args, "--report-only", "--note", "pipeline check"]) == 0
    assert (runs / "dense" / "seed_0" / "summary.json").stat().st_mtime_ns == stamp
    again = (tmp_path / "tiny_smoke_report.md").read_text()
    drop_date = re.compile(r"^- made .*$", flags=re.M)
    assert drop_date.sub("", again) == drop_date.sub("", report)


TOLERANT = ARMS.with_name("tolerant_arms.yaml")


def test_tolerant_smoke_runs_every_new_mechanism_and_decides_by_the_tolerant_rules(tmp_path: Path) -> None:
    """The tolerant grid's smoke arms (dense, injected mismatch, a calibrated schedule, DistillSparse; no
    warm-start, 2 steps): runs, per-bin histograms pooled into the p5, per-seed outcomes, the tolerant rules."""
    spec = load_arms(TOLERANT)
    assert spec.rules == "tolerant"
    args = [
        "experiment",
        "--config",
        "tiny_cpu_tolerant",
        "--arms",
        str(TOLERANT),
        "--smoke",
        "--out",
        str(tmp_path),
    ]
    assert cli.main(args) == 0
    results = json.loads((tmp_path / "tolerant_smoke_results.json").read_text())
    assert [a["arm"] for a in results["arms"]] == list(spec.smoke_arms)
    for arm in results["arms"]:
        assert arm["p5_pooling"].startswith("p5 of the pooled tokens"), arm["arm"]
        (seed,) = arm["per_seed"]
        assert seed["seed"] == 0 and 0 <= seed["accuracy_end_dense"] <= 1
    inject = next(a for a in results["arms"] if a["role"] == "inject")
    dense = next(a for a in results["arms"] if a["role"] == "dense")
    # injected positions lower alpha on dense decoding (little here: an untrained model's p is flat, TV(p, u) small)
    assert inject["acceptance_mean"] < dense["acceptance_mean"]
    rules = {c["letter"]: c["rule"] for c in results["claims"]}
    assert "AUC" in rules["a"] and "TOST" in rules["c"]
    assert all(c["verdict"] == "inconclusive" for c in results["claims"])  # one seed: no between-seed test
