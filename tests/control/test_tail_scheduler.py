"""The tail scheduler through its callback face (:class:`SparrowCallback`) on synthetic step reports whose
per-bin tails are known exactly.

Each bin's alpha is a two-valued sample: a fraction ``low_frac`` of tokens at ``low``, the rest at 0.99,
so its p5 is ``low`` when low_frac > 5% (plus the noise margin) and 0.99 when low_frac is 0.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from control_fakes import FakeLoop, make_callback

from sparrow_nemo.control import SparrowCallback, StepReport
from sparrow_nemo.sparse.schedule import DENSE_BUDGET, BudgetSchedule

BIN = 100
LADDER = [512, 768, 1024, 1536]
START = BudgetSchedule(bin_tokens=BIN, budgets=(512, 768, 1024), name="start")


def make_report(
    step: int,
    bins: dict[int, tuple[int, float, float]],
    reward: float = 1.0,
    length: float = 100.0,
    schedule: BudgetSchedule = START,
) -> StepReport:
    """bins: {bin: (tokens, low_frac, low)} -> a StepReport whose alpha in each bin is exactly that mixture."""
    alphas, lens = [], []
    for b, (tokens, low_frac, low) in bins.items():
        n_low = round(tokens * low_frac)
        alphas.append(torch.cat([torch.full((n_low,), low), torch.full((tokens - n_low,), 0.99)]))
        lens.append(b * BIN + torch.arange(tokens) % BIN)
    return StepReport.from_tokens(
        step,
        alpha=torch.cat(alphas),
        cached_len=torch.cat(lens),
        reward_mean=reward,
        response_length_mean=length,
        schedule=schedule,
    )


OK = (400, 0.0, 0.99)  # a bin comfortably above 0.86 + lower_margin
#: the collapse guard on single steps, by the relative drop alone (the tests of its basic rule)
RAW = dict(collapse_smooth=1, collapse_noise_z=0.0, collapse_drop=0.3)
BAD = (400, 0.10, 0.70)  # p5 = 0.70, far below


def _start(tmp_path, schedule: BudgetSchedule = START, **kwargs) -> tuple[SparrowCallback, FakeLoop]:
    kwargs.setdefault("candidates", LADDER)
    trainer = FakeLoop(schedule, tmp_path)
    scheduler = make_callback(schedule, tmp_path, log=trainer.log, **kwargs)
    trainer.start(scheduler)
    return scheduler, trainer


def _step(scheduler, trainer, report) -> dict[str, float]:
    """The scheduler's metrics of the step, plus the tails it decided on (as ``tail/<bin>``, ``tokens/<bin>``)."""
    trainer.step(scheduler, report)
    tails = {f"tail/{t['bin']}": t["value"] for t in scheduler.history[-1]["bins"]}
    tokens = {f"tokens/{t['bin']}": t["tokens"] for t in scheduler.history[-1]["bins"]}
    return {**trainer.logged[-1], **tails, **tokens}


def test_bin_below_threshold_is_raised_and_later_bins_stay_monotone(tmp_path) -> None:
    scheduler, trainer = _start(tmp_path)
    metrics = _step(scheduler, trainer, make_report(0, {0: OK, 1: BAD, 2: OK}))
    assert trainer.schedule.budgets == (512, 1024, 1024)
    assert trainer.schedule.bin_tokens == BIN
    assert metrics["tail/1"] == pytest.approx(0.70)
    assert metrics["tail/0"] == pytest.approx(0.99)
    assert metrics["tokens/1"] == 400
    assert [metrics[f"sparsity/next_budget/bin_{b}"] for b in range(3)] == [512, 1024, 1024]
    assert (
        metrics["sparsity/raised_bins"],
        metrics["sparsity/below_bins"],
        metrics["sparsity/next_dense"],
    ) == (
        1,
        1,
        0,
    )
    assert scheduler.history[-1]["actions"] == [{"bin": 1, "action": "raise", "from": 768, "to": 1024}]
    # the same bin still below next step -> next rung; the top of the ladder is dense for that bin
    _step(scheduler, trainer, make_report(1, {1: BAD}))
    assert trainer.schedule.budgets == (512, 1536, 1536)
    _step(scheduler, trainer, make_report(2, {1: BAD}))
    assert trainer.schedule.budgets == (512, DENSE_BUDGET, DENSE_BUDGET)
    _step(scheduler, trainer, make_report(3, {1: BAD}))
    assert scheduler.history[-1]["actions"] == [
        {"bin": 1, "action": "at_top", "from": DENSE_BUDGET, "to": None}
    ]


def test_a_bin_past_the_schedule_end_is_raised_on_its_own(tmp_path) -> None:
    scheduler, trainer = _start(tmp_path)
    _step(scheduler, trainer, make_report(0, {4: BAD}))
    assert [trainer.schedule.budget(b * BIN) for b in range(7)] == [512, 768, 1024, 1024, 1536, 1536, 1536]


def test_noise_margin_shrinks_with_token_count(tmp_path) -> None:
    """5.5% of tokens at 0.80: p5 = 0.80 < 0.86 in both cases, but only 40,000 tokens make it significant."""
    scheduler, trainer = _start(tmp_path)
    metrics = _step(scheduler, trainer, make_report(0, {1: (400, 0.055, 0.80)}))
    assert metrics["tail/1"] == pytest.approx(0.80)
    assert trainer.schedule == START and metrics["sparsity/below_bins"] == 0
    _step(scheduler, trainer, make_report(1, {1: (40_000, 0.055, 0.80)}))
    assert trainer.schedule.budgets == (512, 1024, 1024)


def test_bins_with_too_few_tokens_get_no_decision(tmp_path) -> None:
    scheduler, trainer = _start(tmp_path, min_bin_tokens=200)
    metrics = _step(scheduler, trainer, make_report(0, {1: (150, 0.5, 0.1)}))
    assert trainer.schedule == START
    assert metrics["tail/1"] == pytest.approx(0.1) and metrics["sparsity/below_bins"] == 0


def test_lowering_needs_patience_consecutive_steps_and_respects_previous_bin(tmp_path) -> None:
    scheduler, trainer = _start(tmp_path, mode="raise_and_lower", patience=3)
    for step, bins in enumerate([{2: OK}, {2: OK}, {2: BAD, 0: BAD}, {2: OK}, {2: OK}]):
        _step(scheduler, trainer, make_report(step, bins))
        if step < 2:
            assert trainer.schedule == START  # streak 1, 2 < patience
    # step 2 raised bins 0 and 2 and reset bin 2's streak; two more OK steps are not enough
    assert trainer.schedule.budgets == (768, 768, 1536)
    _step(scheduler, trainer, make_report(5, {2: OK}))
    assert trainer.schedule.budgets == (768, 768, 1024, 1536)
    assert scheduler.history[-1]["actions"] == [{"bin": 2, "action": "lower", "from": 1536, "to": 1024}]
    for step in range(6, 12):  # bin 1 well above, but bin 0 holds 768: the floor
        _step(scheduler, trainer, make_report(step, {1: OK}))
    assert trainer.schedule.budgets == (768, 768, 1024, 1536)


def test_lowering_steps_down_one_rung_per_patience_window(tmp_path) -> None:
    scheduler, trainer = _start(tmp_path, mode="raise_and_lower", patience=2)
    budgets = []
    for step in range(6):
        _step(scheduler, trainer, make_report(step, {0: OK, 1: OK, 2: OK}))
        budgets.append(trainer.schedule.budgets)
    assert budgets[0] == START.budgets
    # bin 1: 768 -> 512; bin 2: 1024 -> 768 (floor: the new bin 1); bin 3 (no data) keeps 1024
    assert budgets[1] == (512, 512, 768, 1024)
    assert budgets[3] == (512, 512, 512, 1024)
    assert budgets[5] == (512, 512, 512, 1024)
    assert trainer.logged[1]["sparsity/lowered_bins"] == 2


def test_raise_mode_never_lowers_and_off_mode_only_monitors(tmp_path) -> None:
    raiser, t1 = _start(tmp_path / "a", mode="raise", patience=1)
    monitor, t2 = _start(tmp_path / "b", mode="off")
    for step in range(3):
        _step(raiser, t1, make_report(step, {2: OK}))
        metrics = _step(monitor, t2, make_report(step, {1: BAD}))
    assert t1.schedule == START and t2.schedule == START
    assert metrics["sparsity/below_bins"] == 1 and metrics["sparsity/raised_bins"] == 0


def test_collapse_guard_switches_to_dense_and_stays_there(tmp_path, caplog) -> None:
    scheduler, trainer = _start(tmp_path, collapse_window=5, collapse_min_steps=3, **RAW)
    for step, length in enumerate([100.0, 120.0, 110.0]):
        _step(scheduler, trainer, make_report(step, {0: OK}, length=length))
    with caplog.at_level(logging.WARNING):
        metrics = _step(scheduler, trainer, make_report(3, {1: BAD}, length=70.0))  # 70 < 0.7 * 110
    assert trainer.schedule.is_dense and trainer.schedule.bin_tokens == BIN
    assert metrics["sparsity/next_dense"] == 1 and metrics["sparsity/collapse_guard"] == 1
    assert "collapse guard: step 3: response length 70.0" in caplog.text and "[1]" in caplog.text
    assert scheduler.history[-1]["actions"][0]["action"] == "dense"
    metrics = _step(scheduler, trainer, make_report(4, {1: BAD}, length=10.0))
    assert trainer.schedule.is_dense and metrics["sparsity/collapse_guard"] == 0
    assert scheduler.history[-1]["actions"] == []


@pytest.mark.parametrize(
    ("bins", "reward", "length", "dense"),
    [
        ({0: OK}, 1.0, 50.0, False),  # length collapsed, tail fine -> no guard
        ({1: BAD}, 1.0, 90.0, False),  # tail below, length fine -> ordinary raise
        ({1: BAD}, 0.5, 100.0, True),  # reward fell by 50% with a bin below -> guard
        ({1: BAD}, 0.75, 100.0, False),  # reward fell by 25% < 30% -> raise
    ],
)
def test_collapse_guard_needs_a_drop_and_a_bin_below(tmp_path, bins, reward, length, dense) -> None:
    scheduler, trainer = _start(tmp_path, **RAW)
    for step in range(3):
        _step(scheduler, trainer, make_report(step, {0: OK}, reward=1.0, length=100.0))
    _step(scheduler, trainer, make_report(3, bins, reward=reward, length=length))
    assert trainer.schedule.is_dense == dense


#: step rewards of a real run at 8 prompts per step (tiny_cpu_long, session 3, r2): noise, no collapse
NOISY = [0.27, 0.44, 0.28, 0.23, 0.27, 0.14, 0.52, 0.38, 0.30, 0.19, 0.25, 0.33, 0.16, 0.36, 0.31, 0.09, 0.27]


def _fires(tmp_path, rewards: list[float], **knobs) -> list[int]:
    """Steps at which the guard fires on ``rewards`` (every step with a bin below; it fires once at most)."""
    scheduler, trainer = _start(tmp_path, **knobs)
    fired = []
    for step, reward in enumerate(rewards):
        if _step(scheduler, trainer, make_report(step, {1: BAD}, reward=reward))["sparsity/collapse_guard"]:
            fired.append(step)
    return fired


def test_collapse_guard_ignores_step_to_step_reward_noise(tmp_path) -> None:
    assert _fires(tmp_path / "raw", NOISY, **RAW) == [3]  # 0.23 < 0.7 x 0.44: the single-step rule fires
    assert _fires(tmp_path / "default", NOISY) == []


def test_collapse_guard_fires_on_a_sustained_fall(tmp_path) -> None:
    fallen = [*NOISY[:10], 0.05, 0.02, 0.06, 0.03]  # a plateau of ~0.3, then collapsed to ~0.04
    assert _fires(tmp_path, fallen) == [
        13
    ]  # the 4th low step: the 5-step mean is below half the earlier mean


def test_collapse_guard_noise_margin_scales_with_the_spread(tmp_path) -> None:
    steady = [0.30, 0.31, 0.29, 0.30, 0.31, 0.29, 0.10, 0.09, 0.10, 0.11, 0.10]  # a fall to 1/3, little noise
    assert _fires(tmp_path / "steady", steady) == [9]
    assert _fires(tmp_path / "strict", steady, collapse_noise_z=100.0) == []


def test_collapse_smooth_must_fit_the_window() -> None:
    from sparrow_nemo.control.scheduler import SchedulerConfig

    with pytest.raises(ValueError, match="collapse_smooth"):
        SchedulerConfig(collapse_window=4, collapse_smooth=5)


def test_guard_waits_for_enough_history(tmp_path) -> None:
    scheduler, trainer = _start(tmp_path, collapse_min_steps=3, **RAW)
    _step(scheduler, trainer, make_report(0, {0: OK}, length=100.0))
    _step(scheduler, trainer, make_report(1, {1: BAD}, length=10.0))
    assert not trainer.schedule.is_dense and trainer.schedule.budgets == (512, 1024, 1024)


def _script() -> list[StepReport]:
    """Ten steps exercising raises, lowering streaks, the guard window and finally a collapse."""
    plan = [
        ({0: OK, 2: OK}, 1.0, 100.0),
        ({2: BAD}, 1.0, 110.0),
        ({2: OK}, 0.9, 120.0),
        ({1: OK, 2: OK}, 0.9, 115.0),
        ({2: OK, 3: (400, 0.055, 0.80)}, 0.95, 118.0),
        ({2: OK, 1: OK}, 1.0, 121.0),
        ({0: BAD}, 1.0, 119.0),
        ({2: OK}, 1.1, 125.0),
        ({2: OK}, 1.1, 124.0),
        ({1: BAD, 2: OK}, 0.4, 60.0),
    ]
    return [make_report(i, bins, reward=r, length=n) for i, (bins, r, n) in enumerate(plan)]


def test_checkpoint_round_trip_restores_identical_behaviour(tmp_path) -> None:
    kwargs = dict(mode="raise_and_lower", patience=2, collapse_window=4, collapse_min_steps=2, **RAW)
    script = _script()
    a, ta = _start(tmp_path / "a", **kwargs)
    for report in script[:5]:
        _step(a, ta, report)
    state = json.loads(json.dumps(a.state_dict()))  # must survive JSON

    tb = FakeLoop(BudgetSchedule.from_preset("dense"), tmp_path / "b")
    b = make_callback(tb.schedule, tb.run_dir, candidates=LADDER, log=tb.log, **kwargs)
    b.load_state_dict(state)
    tb.start(b)
    assert tb.schedule == ta.schedule and b.history == a.history

    for report in script[5:]:
        _step(a, ta, report)
        _step(b, tb, report)
        assert tb.schedule == ta.schedule
        assert tb.logged[-1] == ta.logged[-1]
    assert b.history == a.history
    assert ta.schedule.is_dense  # the script ends in a collapse, reached by both
    actions = [[act["action"] for act in h["actions"]] for h in a.history]
    assert actions[5] == ["lower"]  # completes a lowering streak that began before the checkpoint


def test_outputs_written_to_run_dir(tmp_path) -> None:
    scheduler, trainer = _start(tmp_path)
    out = tmp_path / "sparsity"
    assert BudgetSchedule.from_yaml(out / "schedule.yaml") == START
    for step in range(3):
        _step(scheduler, trainer, make_report(step, {step: BAD}))
    lines = (out / "tail_history.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1, 2]
    assert BudgetSchedule.from_yaml(out / "schedule.yaml") == trainer.schedule
    scheduler.on_train_end(None, None)
    assert (out / "tail_history.png").read_bytes()[:4] == b"\x89PNG"


def test_history_plot_handles_dense_and_no_history(tmp_path) -> None:
    scheduler, trainer = _start(tmp_path / "a")
    scheduler.on_train_end(None, None)
    assert not (tmp_path / "a" / "sparsity" / "tail_history.png").exists()
    scheduler, trainer = _start(tmp_path / "b", collapse_min_steps=1, **RAW)
    _step(scheduler, trainer, make_report(0, {0: OK, 3: BAD}, length=100.0))
    _step(scheduler, trainer, make_report(1, {1: BAD}, length=10.0))
    assert trainer.schedule.is_dense
    scheduler.on_train_end(None, None)
    assert (tmp_path / "b" / "sparsity" / "tail_history.png").stat().st_size > 5000


def test_bad_setup_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match="candidates \\[520\\] are not multiples"):
        _start(tmp_path, candidates=[512, 520])
    with pytest.raises(ValueError, match="at least one candidate budget"):
        make_callback(START, candidates=[])
    with pytest.raises(ValueError, match="version"):
        make_callback(START).load_state_dict({"version": 99})


def test_the_recipe_sections_configure_the_scheduler() -> None:
    from sparrow_nemo.grpo.recipe import load_config

    config = load_config(
        "tiny_cpu_short",
        ["control.scheduler.adapt=raise_and_lower", "sparsity.threshold=0.9", "control.scheduler.patience=5"],
    )
    callback = SparrowCallback.from_config(config.sparsity, config.control, START)
    scheduler = callback.scheduler
    assert (scheduler.config.adapt, scheduler.threshold, scheduler.config.patience) == (
        "raise_and_lower",
        0.9,
        5,
    )
    sparsity = config.sparsity
    assert list(scheduler.candidates) == sorted(config.control.calibration.candidate_budgets)
    assert (scheduler.bin_tokens, scheduler.min_bin_tokens) == (sparsity.bin_tokens, sparsity.min_bin_tokens)


def test_bins_must_match_the_schedule(tmp_path) -> None:
    with pytest.raises(ValueError, match="bin_tokens=128 but schedule 'start' has bin_tokens=100"):
        _start(tmp_path, bin_tokens=128)
    dense = BudgetSchedule.from_preset("dense")  # 2000-token bins
    scheduler, trainer = _start(tmp_path, dense, bin_tokens=BIN, mode="raise_and_lower", patience=1)
    assert trainer.schedule.is_dense and trainer.schedule.bin_tokens == BIN
    _step(scheduler, trainer, make_report(0, {0: OK}))  # dense -> the largest candidate in bin 0
    assert trainer.schedule.budgets == (1536, DENSE_BUDGET)
    trainer.schedule = BudgetSchedule.from_preset("fixed:512")
    with pytest.raises(ValueError, match="bin_tokens=2000"):
        _step(scheduler, trainer, make_report(1, {0: OK}))


def test_several_bins_below_move_one_rung_each_from_what_was_measured(tmp_path) -> None:
    flat = BudgetSchedule(bin_tokens=BIN, budgets=(512, 512, 512), name="flat")
    scheduler, trainer = _start(tmp_path, flat)
    _step(scheduler, trainer, make_report(0, {1: BAD, 2: BAD}))
    assert trainer.schedule.budgets == (512, 768, 768)  # not 1024 for bin 2: it was measured at 512
    assert [a["to"] for a in scheduler.history[-1]["actions"]] == [768, 768]


def test_a_checkpoint_of_the_former_tail_scheduler_loads(tmp_path) -> None:
    """Version 1 (``TailMismatchScheduler``'s state, before the control package): restored, no second calibration."""
    raised = BudgetSchedule(bin_tokens=BIN, budgets=(512, 1024, 1024), name="start+adapted")
    old = {
        "version": 1,
        "schedule": raised.to_dict(),
        "bin_tokens": BIN,
        "collapsed": False,
        "above_streak": {"2": 1},
        "recent": [[1.0, 100.0]],
        "history": [
            {"step": 0, "bins": [], "actions": [], "reward_mean": 1.0, "response_length_mean": 100.0}
        ],
    }
    loop = FakeLoop(START, tmp_path)
    callback = make_callback(START, tmp_path, candidates=LADDER, calibrate=True, calibrate_fn=pytest.fail)
    callback.load_state_dict(old)
    loop.start(callback)
    assert loop.schedule == raised and not callback.decision.calibrate
    assert callback.state.above_streak == {2: 1} and callback.state.recent == ((1.0, 100.0),)
