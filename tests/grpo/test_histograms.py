"""Step histograms (response lengths, per-token acceptance) against hand counts, and where they go: the
TensorBoard event file read back with tensorboard's own event reader, W&B offline read back from its record
file, ``histograms.jsonl`` (kept and cut on resume as ``metrics.jsonl``), and PNG heat maps."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from sparrow_nemo.grpo.step_batch import BIN_HISTOGRAM_BINS, LocalRollout, measure_tokens, merged_histograms
from sparrow_nemo.rollout.engine import RolloutSample
from sparrow_nemo.rollout.scoring import TokenMismatch
from sparrow_nemo.run_io.histograms import Histogram
from sparrow_nemo.run_io.metrics import HISTOGRAMS_FILE, MetricsWriter
from sparrow_nemo.run_io.plots import write_plots
from sparrow_nemo.sparse.schedule import BudgetSchedule


def test_merged_histogram_hand_counted() -> None:
    # 4 bins over [0, 1]: [0, .25) [.25, .5) [.5, .75) [.75, 1]; outside values count in the end bins
    values = torch.tensor([0.0, 0.01, 0.25, 0.5, 0.99, 1.0, 1.5, -0.2])
    (h,) = merged_histograms([(values, 0.0, 1.0)], bins=4)
    assert h.edges == (0.0, 0.25, 0.5, 0.75, 1.0)
    assert h.counts == (3.0, 1.0, 1.0, 3.0)
    assert (h.total, h.min, h.max) == (8.0, pytest.approx(-0.2), 1.5)
    assert h.sum == pytest.approx(float(values.double().sum()))
    assert h.sum_squares == pytest.approx(float((values.double() ** 2).sum()))
    (empty,) = merged_histograms([(torch.zeros(0), 0.0, 2.0)], bins=2)
    assert empty.counts == (0.0, 0.0) and empty.total == 0 and math.isnan(empty.mean)
    assert Histogram.from_dict(empty.to_dict()) == empty and Histogram.from_dict(h.to_dict()) == h
    with pytest.raises(ValueError, match=r"edges \[1.0, 1.0\] are empty"):
        merged_histograms([(values, 1.0, 1.0)])


def _sample(n: int) -> RolloutSample:
    return RolloutSample(
        prompt_ids=torch.tensor([1, 5]),
        response_ids=torch.arange(n) + 3,
        logprobs=torch.zeros(n),
        top_ids=torch.zeros(n, 1, dtype=torch.long),
        top_logprobs=torch.zeros(n, 1),
        cached_len=torch.arange(2, 2 + n),
        kv_budget=torch.full((n,), 32),
        finish_reason="stop_token",
    )


def test_the_steps_histograms_count_its_samples_and_tokens() -> None:
    """Lengths 2, 3, 10 and 50 (the cap) in 50 bins of 1 token over [0, 50]; 65 token alphas in bins of 0.02."""
    samples = [_sample(n) for n in (2, 3, 10, 50)]
    local = LocalRollout(samples, range(4), 1.0, rewards=torch.tensor([1.0, 0.0, 0.0, 1.0]))
    alpha = torch.cat([torch.full((5,), 0.51), torch.full((10,), 0.95), torch.ones(50)])
    mm = TokenMismatch(alpha, torch.cat([s.cached_len for s in samples]), torch.zeros(65), torch.zeros(65))
    schedule = BudgetSchedule.dense(16)
    stats = measure_tokens(local, mm, schedule, 0.05, 2.0, length_cap=50)
    lengths, acceptance = (
        stats.histograms()["response_length/histogram"],
        stats.histograms()["acceptance/histogram"],
    )
    assert lengths.edges[0] == 0 and lengths.edges[-1] == 50 and len(lengths.counts) == 50
    assert {i: c for i, c in enumerate(lengths.counts) if c} == {2: 1, 3: 1, 10: 1, 49: 1}
    assert (lengths.total, lengths.sum, lengths.min, lengths.max) == (4, 65, 2, 50)
    assert {i: c for i, c in enumerate(acceptance.counts) if c} == {25: 5, 47: 10, 49: 50}
    assert acceptance.mean == pytest.approx(float(alpha.double().mean()))
    bins = mm.cached_len // 16  # per bin of cached length: that bin's tokens, 0.01 wide bins over [0, 1]
    for b in range(int(bins.max()) + 1):
        h = stats.histograms()[f"acceptance/histogram/bin_{b}"]
        assert len(h.counts) == BIN_HISTOGRAM_BINS and (h.edges[0], h.edges[-1]) == (0.0, 1.0)
        assert h.total == int((bins == b).sum()) and h.mean == pytest.approx(float(alpha[bins == b].mean()))
    uncapped = measure_tokens(local, mm, schedule, 0.05, 2.0).histograms()["response_length/histogram"]
    assert uncapped.edges[-1] == 50  # without a cap: the step's longest response


def _steps() -> list[dict[str, Histogram]]:
    """Three steps' histograms: lengths 0..9 shifted by the step, acceptance all 1 but step 1's."""
    out = []
    for step in range(3):
        lengths, acceptance = merged_histograms(
            [(torch.arange(10.0) + step, 0.0, 20.0), (torch.full((7,), 1.0 if step != 1 else 0.3), 0.0, 1.0)]
        )
        out.append({"response_length/histogram": lengths, "acceptance/histogram": acceptance})
    return out


def test_tensorboard_event_file_holds_the_scalars_and_histograms(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = MetricsWriter(tmp_path, jsonl=True, tensorboard=True)
    steps = _steps()
    for step, hists in enumerate(steps):
        writer.write(step, {"reward/mean": 0.25 * step, "acceptance/p5": math.nan}, hists)
    writer.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"histograms": 0, "scalars": 0})
    events.Reload()
    tags = events.Tags()
    assert sorted(tags["histograms"]) == ["acceptance/histogram", "response_length/histogram"]
    assert tags["scalars"] == ["reward/mean"]  # a non-finite value is left out
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")] == [(0, 0.0), (1, 0.25), (2, 0.5)]
    for name in tags["histograms"]:
        read = events.Histograms(name)
        assert [e.step for e in read] == [0, 1, 2]
        for event, hists in zip(read, steps):
            want, got = hists[name], event.histogram_value
            assert list(got.bucket) == list(want.counts)
            assert list(got.bucket_limit) == pytest.approx(list(want.edges[1:]))
            assert (got.num, got.min, got.max) == (want.total, want.min, want.max)
            assert (got.sum, got.sum_squares) == pytest.approx((want.sum, want.sum_squares))


def test_tensorboard_without_the_package_is_a_clear_error(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(
        RuntimeError, match=r"needs the tensorboard package: pip install 'sparrow-nemo\[tensorboard\]'"
    ):
        MetricsWriter(tmp_path, tensorboard=True)


def test_offline_wandb_gets_the_histograms(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("wandb")
    from run_io.test_wandb_logger import _history

    from sparrow_nemo.grpo.recipe import load_config
    from sparrow_nemo.run_io.wandb_logger import open_wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    config = load_config("tiny_cpu_short", ["logging.wandb.enabled=true"])
    writer = MetricsWriter(tmp_path, wandb=open_wandb(config.logging.wandb, tmp_path, config.to_dict()))
    steps = _steps()
    for step, hists in enumerate(steps):
        writer.write(step, {"reward/mean": 0.5}, hists)
    writer.close()
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    rows = _history(run_file)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row, hists in zip(rows, steps):
        assert row["reward/mean"] == 0.5
        for name, want in hists.items():  # W&B's record nests a histogram's fields under its name
            assert row[f"{name}/_type"] == "histogram"
            assert row[f"{name}/values"] == list(want.counts)
            assert row[f"{name}/bins"] == pytest.approx(list(want.edges))


def test_histograms_jsonl_continues_on_resume_and_the_plots_draw_it(tmp_path: Path) -> None:
    steps = _steps()
    writer = MetricsWriter(tmp_path)
    for step, hists in enumerate(steps):
        writer.write(step, {"reward/mean": 0.5}, hists)
    with (tmp_path / HISTOGRAMS_FILE).open("a") as f:
        f.write('{"step": 3, "response_le')  # a line cut short by a kill
    resumed = MetricsWriter(tmp_path)
    assert resumed.keep_rows(2) == 1  # the checkpoint after step 1: step 2 is done again
    assert resumed.histograms == [(0, steps[0]), (1, steps[1])]
    assert [line.count('"step"') for line in (tmp_path / HISTOGRAMS_FILE).read_text().splitlines()] == [1, 1]
    resumed.write(2, {"reward/mean": 0.5}, steps[2])
    again = MetricsWriter(tmp_path)
    again.keep_rows(3)
    assert again.histograms == [(s, h) for s, h in enumerate(steps)]
    paths = write_plots(again.history, 0.86, tmp_path / "plots", "p5", again.histograms)
    names = {p.name for p in paths}
    assert {"response_length_histogram.png", "acceptance_histogram.png"} <= names
    assert all(p.stat().st_size > 1000 for p in paths)


def test_histogram_rows_that_do_not_read_are_dropped_with_a_warning(tmp_path: Path, caplog) -> None:
    """``histograms.jsonl`` only feeds the plots: on resume a row of another shape, or a file with a line that
    is not JSON before its last, loses those histograms (warned), never the run."""
    steps = _steps()
    writer = MetricsWriter(tmp_path)
    for step, hists in enumerate(steps[:2]):
        writer.write(step, {"reward/mean": 0.5}, hists)
    path = tmp_path / HISTOGRAMS_FILE
    first = path.read_text().splitlines()[0]
    path.write_text(first + '\n{"step": 1, "acceptance/histogram": {"edges": [0, 1], "counts": "x"}}\n')
    resumed = MetricsWriter(tmp_path)
    resumed.keep_rows(2)
    assert resumed.histograms == [(0, steps[0])] and "step 1 does not read as histograms" in caplog.text
    assert path.read_text().splitlines() == [first]
    path.write_text("not json\n" + first + "\n")
    again = MetricsWriter(tmp_path)
    again.keep_rows(2)
    assert again.histograms == [] and path.read_text() == "" and "its histograms are dropped" in caplog.text
