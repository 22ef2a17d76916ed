"""Calibration pass with the real torch rollout engine on a tiny random Qwen3 (fp32, CPU).

The weights are scaled up so that attention is sharp and dropping pages changes the next-token
distribution (random 0.02-std weights give alpha ~ 1 at any budget). K = the whole vocabulary, so the
top-K acceptance rate is exact and can be checked against sum_v min(p, q) computed here from full
distributions with numpy.
"""

from __future__ import annotations

import csv
import json
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from control_fakes import FakeLoop, make_callback

from sparrow_nemo.control import build_step_report, run_calibration
from sparrow_nemo.control.calibration import CSV_COLUMNS
from sparrow_nemo.control.tail_stats import bin_tails
from sparrow_nemo.model_shapes import PRESETS
from sparrow_nemo.rollout import SamplingParams, TorchRolloutEngine
from sparrow_nemo.rollout.scoring import measure_mismatch
from sparrow_nemo.sparse.mismatch import tail_by_bin
from sparrow_nemo.sparse.schedule import BudgetSchedule

SHAPE = PRESETS["tiny-test"]
BIN, PROMPT, NEW = 32, 40, 88  # sequences end at 128 tokens: cached lengths 40..127 -> bins 1..3
CANDIDATES = [48, 64, 96, 128]  # 48 = sink + 2 local pages only; 128 covers every sequence (dense)
THRESHOLD = 0.9
SAMPLING = SamplingParams(max_new_tokens=NEW, seed=0, stop_token_ids=(), logprobs_topk=SHAPE.vocab_size)
SCALE = {"q_proj": 10, "k_proj": 10, "v_proj": 25, "o_proj": 25, "lm_head": 50, "embed_tokens": 25}


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Many tiny matmuls: one thread avoids a large slowdown from thread oversubscription on a busy CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def engine() -> TorchRolloutEngine:
    eng = TorchRolloutEngine.from_shape(SHAPE, seed=0, dense_layers=0)
    eng.update_weights(
        {name: p * s for name, p in eng.model.params.items() for key, s in SCALE.items() if key in name}
    )
    return eng


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, SHAPE.vocab_size, (PROMPT,), generator=g).tolist() for _ in range(4)]


@pytest.fixture(scope="module")
def calibrated(engine, prompts, tmp_path_factory):
    out = tmp_path_factory.mktemp("calib")
    result = run_calibration(engine, prompts, CANDIDATES, SAMPLING, BIN, THRESHOLD, 0.05, 16, out)
    return result, out


def _exact_alpha(engine, prompts, budget: int) -> tuple[np.ndarray, np.ndarray]:
    """sum_v min(p, q) per response token from full-vocab distributions, aligned by hand."""
    schedule = BudgetSchedule(bin_tokens=BIN, budgets=(budget,), name="ref")
    batch = engine.generate(prompts, SAMPLING, schedule)
    alphas, lens = [], []
    for s in batch.samples:
        seq = torch.cat([s.prompt_ids, s.response_ids])
        dense = engine.score([seq.tolist()], topk=SHAPE.vocab_size)[0]
        for j in range(s.response_ids.numel()):
            p = np.zeros(SHAPE.vocab_size)
            q = np.zeros(SHAPE.vocab_size)
            p[dense.top_ids[PROMPT - 1 + j].numpy()] = np.exp(
                dense.top_logprobs[PROMPT - 1 + j].double().numpy()
            )
            q[s.top_ids[j].numpy()] = np.exp(s.top_logprobs[j].double().numpy())
            alphas.append(np.minimum(p, q).sum())
            lens.append(PROMPT + j)
        assert s.cached_len.tolist() == list(range(PROMPT, PROMPT + NEW))
    return np.array(alphas), np.array(lens)


def test_calibration_alpha_is_exact_with_full_vocab_and_one_for_dense_budget(engine, prompts) -> None:
    """The per-token alpha calibration feeds on (``measure_mismatch``), against a hand-aligned numpy reference."""
    for budget in (48, 128):
        batch = engine.generate(
            prompts, SAMPLING, BudgetSchedule(bin_tokens=BIN, budgets=(budget,), name="x")
        )
        m = measure_mismatch(engine, batch)
        alpha, cached = m.alpha, m.cached_len
        ref_alpha, ref_len = _exact_alpha(engine, prompts, budget)
        np.testing.assert_allclose(alpha.double().numpy(), ref_alpha, atol=1e-5)
        assert cached.tolist() == ref_len.tolist()
        if budget == 128:
            assert float(alpha.min()) > 1 - 1e-4  # budget covers the sequence: sparse == dense
        else:
            assert float(alpha.min()) < 0.5  # only sink + local pages: a visibly different policy


def test_calibration_picks_the_smallest_passing_budget_per_bin(engine, prompts, calibrated) -> None:
    result, _ = calibrated
    tails: dict[int, dict[int, float]] = {}
    for budget in CANDIDATES:
        alpha, lens = _exact_alpha(engine, prompts, budget)
        tails[budget] = {b: float(np.quantile(alpha[lens // BIN == b], 0.05)) for b in np.unique(lens // BIN)}
        for b, v in tails[budget].items():
            assert result.tails[budget][b] == pytest.approx(v, abs=1e-5)
            assert result.counts[budget][b] == int((lens // BIN == b).sum())
    expected = []
    for b in (1, 2, 3):
        passing = min(c for c in CANDIDATES if tails[c][b] >= THRESHOLD)
        expected.append(max([passing, *expected]))
    expected = [expected[0], *expected]  # bin 0 has no tokens: takes the first calibrated bin's budget
    assert list(result.schedule.budgets) == expected
    assert len(set(expected)) > 1  # the pass discriminates between budgets on this model
    assert result.schedule.bin_tokens == BIN and result.unsatisfied_bins == ()


def test_calibration_files(calibrated) -> None:
    result, out = calibrated
    assert json.loads((out / "calibration_table.json").read_text()) == json.loads(
        json.dumps(result.to_dict())
    )
    assert BudgetSchedule.from_yaml(out / "schedule.yaml") == result.schedule
    with (out / "calibration_table.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == CSV_COLUMNS
    assert len(rows) == sum(len(c) for c in result.counts.values())
    for row in rows:
        budget, b = int(row["budget"]), int(row["bin"])
        assert float(row["tail"]) == pytest.approx(result.tails[budget][b], abs=1e-6)
        assert row["passes"] == str(int(result.tails[budget][b] >= THRESHOLD))
        assert row["chosen"] == str(int(result.schedule.budget(b * BIN) == budget))
    assert "threshold 0.9" in (out / "calibration_table.txt").read_text()
    png = (out / "calibration_tail.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_scheduler_calibrates_on_start_but_not_on_resume(engine, prompts, calibrated, tmp_path: Path) -> None:
    result, _ = calibrated
    loop = FakeLoop(BudgetSchedule.dense(bin_tokens=BIN), tmp_path)

    def calibrate(schedule: BudgetSchedule, out: Path | None):
        return run_calibration(
            engine, prompts, CANDIDATES, SAMPLING, BIN, THRESHOLD, 0.05, schedule.page_size, out
        )

    knobs = dict(threshold=THRESHOLD, candidates=CANDIDATES, calibrate=True, bin_tokens=BIN)
    callback = make_callback(loop.schedule, tmp_path, calibrate_fn=calibrate, log=loop.log, **knobs)
    loop.start(callback)
    assert loop.schedule == result.schedule
    assert loop.logged[0]["calibration/budget/bin_3"] == result.schedule.budgets[3]
    assert (tmp_path / "sparsity" / "calibration" / "calibration_tail.png").is_file()

    resumed = FakeLoop(BudgetSchedule.dense(bin_tokens=BIN), tmp_path / "r")
    fails = partial(pytest.fail, "a resumed run must not calibrate")
    again = make_callback(resumed.schedule, resumed.run_dir, calibrate_fn=fails, **knobs)
    again.load_state_dict(callback.state_dict())
    resumed.start(again)
    assert resumed.schedule == result.schedule


def test_a_rank_without_the_calibration_pass_keeps_its_schedule(tmp_path) -> None:
    """The decision says calibrate; a rank given no pass (not in rank 0's engine) waits for rank 0's schedule."""
    loop = FakeLoop(BudgetSchedule.dense(), tmp_path)
    callback = make_callback(loop.schedule, None, calibrate=True, bin_tokens=2000)
    loop.start(callback)
    assert callback.decision.calibrate and loop.schedule == BudgetSchedule.dense()


def test_online_scheduler_raises_until_every_bin_passes(engine, prompts, tmp_path) -> None:
    """From the sparsest budget, real rollouts each step; strict rule (noise_z=0): every bin ends >= threshold.

    Observed here: (48,) -> (48, 64, 64, 64) -> (48, 64, 96, 96) -> (48, 64, 96, 128), one rung per failing
    bin per step; in bins 1-3 (the ones with tokens) the budgets the offline calibration picks.
    """
    trainer = FakeLoop(BudgetSchedule(bin_tokens=BIN, budgets=(48,), name="sparsest"), tmp_path)
    knobs = dict(threshold=THRESHOLD, candidates=CANDIDATES, noise_z=0.0, min_bin_tokens=16, bin_tokens=BIN)
    scheduler = make_callback(trainer.schedule, tmp_path, **knobs)
    trainer.start(scheduler)
    seen = []
    for step in range(8):
        schedule = trainer.schedule
        seen.append(schedule.budgets)
        batch = engine.generate(prompts, SAMPLING, schedule)
        mismatch = measure_mismatch(engine, batch)
        report = build_step_report(step, batch.samples, mismatch, [1.0] * len(prompts), schedule, noise_z=0.0)
        trainer.step(scheduler, report)
        if trainer.schedule == schedule:
            break
    assert trainer.schedule == schedule, f"no fixed point in 8 steps: {seen}"
    assert len(seen) > 2  # it had to raise, more than once
    final = tail_by_bin(mismatch.alpha, mismatch.cached_len, BIN, 0.05)
    assert min(final.values()) >= THRESHOLD
    assert not trainer.schedule.is_dense and max(trainer.schedule.budgets) <= 128  # 128 covers every sequence


def test_build_step_report(engine, prompts) -> None:
    schedule = BudgetSchedule(bin_tokens=BIN, budgets=(64,), name="x")
    short = SamplingParams(max_new_tokens=12, seed=3, logprobs_topk=20)
    batch = engine.generate(prompts[:3], short, schedule)
    mismatch = measure_mismatch(engine, batch)
    report = build_step_report(
        7, batch.samples, mismatch, [1.0, 0.0, 0.5], schedule, correct=[True, False, False]
    )
    assert list(report.tails) == bin_tails(mismatch.alpha, mismatch.cached_len, BIN, 0.05, 2.0)
    assert (report.step, report.reward_mean, report.accuracy) == (7, 0.5, pytest.approx(1 / 3))
    assert report.response_length_mean == pytest.approx(
        np.mean([s.response_ids.numel() for s in batch.samples])
    )
    assert report.schedule is schedule
    with pytest.raises(ValueError, match="rewards"):
        build_step_report(7, batch.samples, mismatch, [1.0], schedule)
    with pytest.raises(ValueError, match=r"mismatch\.alpha"):
        build_step_report(7, batch.samples[:2], mismatch, [1.0, 0.0], schedule)
    with pytest.raises(ValueError, match="correct"):
        build_step_report(7, batch.samples, mismatch, [1.0, 0.0, 0.5], schedule, correct=[True])
