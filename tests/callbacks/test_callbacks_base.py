"""Callback protocol: dispatch order, checkpoint state routing, StepReport checks, recipe instantiation."""

from __future__ import annotations

import logging

import pytest
import torch
from callback_fakes import FakeTrainer, RecordingCallback, ThresholdCallback

from sparrow_nemo.callbacks import (
    HOOKS,
    Callback,
    CallbackConfigError,
    CallbackList,
    StepReport,
    TrainerLike,
    instantiate_callbacks,
)
from sparrow_nemo.sparse.schedule import BudgetSchedule


def _report(step: int = 0, n: int = 4) -> StepReport:
    return StepReport.from_tokens(
        step,
        alpha=torch.ones(n),
        cached_len=torch.arange(n),
        reward_mean=0.5,
        response_length_mean=10.0,
        schedule=BudgetSchedule.from_preset("fixed:512"),
    )


def test_base_callback_has_every_hook_as_noop(tmp_path) -> None:
    trainer = FakeTrainer(BudgetSchedule.dense(), tmp_path)
    cb = Callback()
    for hook in HOOKS:
        assert callable(getattr(cb, hook))
    assert cb.on_save_checkpoint(trainer) == {}
    assert isinstance(trainer, TrainerLike)


def test_callback_list_dispatches_every_hook_in_order(tmp_path) -> None:
    calls: list = []
    cbs = CallbackList([RecordingCallback("a", calls), RecordingCallback("b", calls)])
    trainer = FakeTrainer(BudgetSchedule.dense(), tmp_path)
    report = _report()
    cbs.on_train_start(trainer)
    cbs.on_rollout_end(trainer, report)
    cbs.on_train_batch_end(trainer, report, {"loss": 1.0})
    cbs.on_validation_end(trainer, {"acc": 0.5})
    state = cbs.on_save_checkpoint(trainer)
    cbs.on_load_checkpoint(trainer, state)
    cbs.on_train_end(trainer)
    order = [
        "on_train_start",
        "on_rollout_end",
        "on_train_batch_end",
        "on_validation_end",
        "on_save_checkpoint",
        "on_load_checkpoint",
        "on_train_end",
    ]
    assert set(order) == set(HOOKS)
    assert [(name, hook) for name, hook, _ in calls] == [(n, h) for h in order for n in ("a", "b")]
    assert calls[2][2] == (trainer, report)
    assert calls[4][2] == (trainer, report, {"loss": 1.0})


def test_checkpoint_state_goes_back_to_the_callback_that_saved_it(tmp_path, caplog) -> None:
    first, second, third = RecordingCallback("x"), RecordingCallback("y"), Callback()
    cbs = CallbackList([first, Callback(), second, third])
    assert cbs.state_keys() == ["RecordingCallback", "Callback", "RecordingCallback_1", "Callback_1"]
    trainer = FakeTrainer(BudgetSchedule.dense(), tmp_path)
    state = cbs.on_save_checkpoint(trainer)
    assert state == {"RecordingCallback": {"name": "x"}, "RecordingCallback_1": {"name": "y"}}
    fresh = CallbackList([RecordingCallback("p"), Callback(), RecordingCallback("q"), Callback()])
    with caplog.at_level(logging.WARNING):
        fresh.on_load_checkpoint(trainer, {**state, "Gone": {"k": 1}})
    assert [cb.loaded for cb in fresh if isinstance(cb, RecordingCallback)] == [{"name": "x"}, {"name": "y"}]
    assert "Gone" in caplog.text


def test_callback_list_rejects_non_callbacks() -> None:
    with pytest.raises(TypeError, match=r"callbacks\[1\]"):
        CallbackList([Callback(), object()])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"alpha": torch.ones(2, 2)}, "alpha must be a 1-D floating"),
        ({"alpha": torch.ones(4, dtype=torch.int64)}, "alpha must be a 1-D floating"),
        ({"cached_len": torch.arange(3)}, "cached_len must be an integer tensor"),
        ({"cached_len": torch.ones(4)}, "cached_len must be an integer tensor"),
        ({"alpha": torch.tensor([1.0, float("nan"), 1.0, 1.0])}, "NaN"),
        ({"reward_mean": float("nan")}, "reward_mean"),
        ({"quantile": 1.5}, "quantile"),
    ],
)
def test_step_report_rejects_bad_fields(kwargs, match) -> None:
    base = dict(alpha=torch.ones(4), cached_len=torch.arange(4), reward_mean=0.0, response_length_mean=1.0)
    base.update(kwargs)
    with pytest.raises(ValueError, match=match):
        StepReport.from_tokens(0, schedule=BudgetSchedule.dense(), **base)


def test_step_report_carries_the_tail_of_its_tokens() -> None:
    alpha = torch.cat([torch.full((90,), 0.99), torch.full((10,), 0.5), torch.ones(50)])
    cached = torch.cat([torch.zeros(100, dtype=torch.int64), torch.full((50,), 20)])
    report = StepReport.from_tokens(3, alpha, cached, 0.5, 10.0, BudgetSchedule.dense(16, 4), quantile=0.05)
    assert [(t.bin, t.tokens) for t in report.tails] == [(0, 100), (1, 50)]
    assert report.tails[0].value == pytest.approx(0.5) and report.tails[1].value == 1.0
    with pytest.raises(ValueError, match="ascending distinct bins"):
        StepReport(0, BudgetSchedule.dense(), (report.tails[1], report.tails[0]), 0.05, 2.0, 0.0, 1.0)


def test_instantiate_builds_in_order_with_kwargs() -> None:
    cbs = instantiate_callbacks(
        [
            {"_target_": "callback_fakes.ThresholdCallback", "threshold": 0.9, "mode": "act"},
            {"_target_": "callback_fakes.RecordingCallback", "name": "r"},
        ]
    )
    first, second = list(cbs)
    assert isinstance(first, ThresholdCallback) and first.threshold == 0.9 and first.mode == "act"
    assert isinstance(second, RecordingCallback) and second.name == "r"
    assert len(instantiate_callbacks(None)) == 0
    (open_cb,) = instantiate_callbacks([{"_target_": "callback_fakes.OpenKwargsCallback", "anything": 1}])
    assert open_cb.options == {"anything": 1}


@pytest.mark.parametrize(
    ("entries", "expected"),
    [
        (
            [{"_target_": "callback_fakes.ThresholdCallback", "treshold": 0.9}],
            ["callbacks[0]", "unknown argument 'treshold'", "did you mean 'threshold'"],
        ),
        (
            [
                {"_target_": "callback_fakes.RecordingCallback", "name": "a"},
                {"_target_": "sparrow_nemo.control.SparowCallback"},
            ],
            [
                "callbacks[1]",
                "has no attribute 'SparowCallback'",
                "did you mean 'SparrowCallback'",
            ],
        ),
        ([{"_target_": "sparrow_nemo.no_such_module.Thing"}], ["callbacks[0]", "cannot import module"]),
        ([{"_target_": "collections.OrderedDict"}], ["callbacks[0]", "not a Callback subclass"]),
        ([{"_target_": "SparrowCallback"}], ["callbacks[0]", "dotted path"]),
        ([{"threshold": 0.9}], ["callbacks[0]", "missing '_target_'", "threshold"]),
        (["callback_fakes.ThresholdCallback"], ["callbacks[0]", "expected a mapping"]),
        ([{"_target_": "callback_fakes.RecordingCallback"}], ["callbacks[0]", "needs argument(s) name"]),
        (
            [{"_target_": "callback_fakes.ThresholdCallback", "threshold": 1.5}],
            ["callbacks[0] (callback_fakes.ThresholdCallback)", "threshold=1.5"],
        ),
        (
            [{"_target_": "callback_fakes.ThresholdCallback", "mode": "sometimes"}],
            ["callbacks[0]", "mode='sometimes'", "watch, act"],
        ),
        (
            [{"_target_": "sparrow_nemo.control.SparrowCallback", "threshold": 0.9}],
            [
                "callbacks[0]",
                "built by the trainer from the recipe's control section",
                "remove it",
            ],
        ),
        (
            [{"_target_": "sparrow_nemo.grpo.distill.DistillSparse"}],
            ["callbacks[0]", "built by the trainer from the recipe's distill section", "remove it"],
        ),
    ],
)
def test_instantiate_errors_name_the_entry_and_the_bad_key(entries, expected) -> None:
    with pytest.raises(CallbackConfigError) as info:
        instantiate_callbacks(entries)
    message = str(info.value)
    assert "\n" not in message
    for part in expected:
        assert part in message
