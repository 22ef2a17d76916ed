"""DAPO's dynamic sampling against hand-worked rounds: which groups are kept, dropped, discarded or padded,
the advantages of the kept batch, the metrics; two gloo ranks agree on the rounds; a run draws the rounds
from the prompt stream (seeds of each round's own), trains on the result and logs the step histograms."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from policy._helpers import run_distributed, single_rank_env

from sparrow_nemo.grpo.advantages import grpo_advantages
from sparrow_nemo.grpo.dynamic_sampling import (
    DynamicSamplingConfig,
    fill_step,
    informative_groups,
    round_seed,
)
from sparrow_nemo.grpo.step_batch import LocalRollout
from sparrow_nemo.rollout.engine import RolloutSample
from sparrow_nemo.rollout.sampling import sample_seed

G = 2


def _rollout(rewards: list[float], tag: int, seconds: float = 1.0, errors: int = 0) -> LocalRollout:
    """A rollout of len(rewards) one-token samples; sample k's response token is ``tag * 100 + k``."""
    samples = [
        RolloutSample(
            prompt_ids=torch.tensor([1]),
            response_ids=torch.tensor([tag * 100 + k]),
            logprobs=torch.zeros(1),
            top_ids=torch.zeros(1, 1, dtype=torch.long),
            top_logprobs=torch.zeros(1, 1),
            cached_len=torch.tensor([1]),
            kv_budget=torch.tensor([16]),
            finish_reason="stop_token",
        )
        for k in range(len(rewards))
    ]
    return LocalRollout(
        samples, range(0, len(rewards)), seconds, rewards=torch.tensor(rewards), reward_errors=errors
    )


def _ids(local: LocalRollout) -> list[int]:
    return [int(s.response_ids[0]) for s in local.samples]


def _drawer(rounds: list[list[float]]):
    calls: list[int] = []

    def draw(round_: int) -> LocalRollout:
        calls.append(round_)
        return _rollout(rounds[round_], round_)

    return draw, calls


def _advantages(rewards: torch.Tensor) -> torch.Tensor:
    return grpo_advantages(rewards, G)


def test_informative_groups() -> None:
    assert informative_groups(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.25]), 2).tolist() == [
        False,
        True,
        False,
        True,
    ]
    with pytest.raises(ValueError, match="5 rewards in groups of 2"):
        informative_groups(torch.zeros(5), 2)


def test_refill_keeps_informative_groups_in_order_and_discards_the_surplus() -> None:
    # round 0: groups (1,1) (0,1) (0,0) (1,0) -> kept: g1, g3 (quota 4); dropped: g0, g2
    # round 1: groups (1,0) (1,1) (0,1) (0.5,0) -> kept: g0, g2 (quota met); dropped: g1; surplus: g3
    draw, calls = _drawer([[1, 1, 0, 1, 0, 0, 1, 0], [1, 0, 1, 1, 0, 1, 0.5, 0], [0, 1] * 4])
    local, metrics = fill_step(draw, DynamicSamplingConfig(enabled=True, max_refills=3), G, _advantages)
    assert calls == [0, 1]  # the third round is never drawn
    assert _ids(local) == [2, 3, 6, 7, 100, 101, 104, 105]
    assert local.rewards.tolist() == [0, 1, 1, 0, 1, 0, 0, 1]
    torch.testing.assert_close(local.advantages, _advantages(local.rewards))
    assert local.advantages.abs().min() > 0.5  # every kept sample carries a gradient
    assert local.rows == range(0, 8) and local.seconds == 2.0
    assert metrics == {
        "dynamic_sampling/rounds": 2.0,
        "dynamic_sampling/dropped_groups": 3.0,
        "dynamic_sampling/padded_groups": 0.0,
        "dynamic_sampling/surplus_groups": 1.0,
    }


def test_after_max_refills_the_step_is_padded_with_dropped_groups(caplog) -> None:
    # every group all-equal in rounds 0 and 1, one informative group in round 1 -> 3 padded with round 0's
    draw, calls = _drawer([[1, 1, 0, 0, 1, 1, 0, 0], [0, 0, 1, 0, 1, 1, 1, 1], [0, 1] * 4])
    local, metrics = fill_step(draw, DynamicSamplingConfig(enabled=True, max_refills=1), G, _advantages)
    assert calls == [0, 1]
    assert _ids(local) == [102, 103, 0, 1, 2, 3, 4, 5]
    assert local.advantages[2:].abs().max() == 0 and local.advantages[:2].abs().min() > 0.5
    assert metrics["dynamic_sampling/rounds"] == 2.0
    assert metrics["dynamic_sampling/padded_groups"] == 3.0
    assert metrics["dynamic_sampling/dropped_groups"] == 4.0  # 7 zero-variance groups, 3 of them padding
    assert "3 groups without reward variance trained on after 1 refill rounds" in caplog.text


def test_off_returns_the_first_round_untouched() -> None:
    draw, calls = _drawer([[1, 1, 0, 0]])
    first = _rollout([1, 1, 0, 0], 0)
    local, metrics = fill_step(
        lambda r: first, DynamicSamplingConfig(enabled=False, max_refills=5), G, _advantages
    )
    assert local is first and metrics == {}
    local, _ = fill_step(draw, DynamicSamplingConfig(enabled=True, max_refills=0), G, _advantages)
    assert calls == [0] and _ids(local) == [0, 1, 2, 3]  # no refill allowed: padded with its own groups


def test_round_seeds() -> None:
    assert round_seed(7, 3, 0) == sample_seed(7, 3)  # round 0: the step's seed, as without dynamic sampling
    seeds = {round_seed(7, step, r) for step in range(20) for r in range(10)}
    assert len(seeds) == 200


#: rank -> rewards of its rounds (one group of 2 per rank and round): rank 0 is short after round 0, rank 1 not
_RANK_ROUNDS = {0: [[1, 1, 0, 1], [0, 0, 1, 0], [1, 0, 0, 0]], 1: [[1, 0, 0, 1], [0, 0, 0, 0], [0, 0, 0, 0]]}


def _ranks_worker(rank: int, out: str) -> None:
    dist.init_process_group("gloo")
    draw, calls = _drawer(_RANK_ROUNDS[rank])
    local, metrics = fill_step(draw, DynamicSamplingConfig(enabled=True, max_refills=5), G, _advantages)
    torch.save({"calls": calls, "ids": _ids(local), "metrics": metrics}, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.multiproc
def test_every_rank_samples_as_many_rounds_as_the_shortest_needs(tmp_path: Path) -> None:
    """Rank 0 fills its quota of 2 groups in round 1 (one group of round 0, one of round 1); rank 1 has its
    quota after round 0 and takes part in round 1 too (a collective round), discarding it as surplus."""
    run_distributed(_ranks_worker, 2, str(tmp_path))
    zero, one = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert zero["calls"] == one["calls"] == [0, 1]
    assert zero["ids"] == [2, 3, 102, 103] and one["ids"] == [0, 1, 2, 3]
    assert (
        zero["metrics"]
        == one["metrics"]
        == {
            "dynamic_sampling/rounds": 2.0,
            "dynamic_sampling/dropped_groups": 4.0,  # rank 0: (1,1) (0,0); rank 1: (0,0) (0,0) of round 1
            "dynamic_sampling/padded_groups": 0.0,
            "dynamic_sampling/surplus_groups": 0.0,
        }
    )


@pytest.mark.slow
def test_a_run_draws_refill_rounds_from_the_prompt_stream_and_logs_its_histograms(tmp_path: Path) -> None:
    """Two steps with one refill allowed: the run reads the prompts of as many rounds as its steps log, and
    each step's metrics account for every group (a random-init policy on the smoke task mostly scores groups
    all-zero: then both rounds run and the step trains on padding). The same run's step histograms reach
    ``histograms.jsonl``, the TensorBoard event file and the end-of-run PNG heat maps."""
    from sparrow_nemo.grpo.recipe import load_config
    from sparrow_nemo.grpo.trainer import GrpoTrainer
    from sparrow_nemo.run_io.histograms import Histogram
    from sparrow_nemo.run_io.metrics import HISTOGRAMS_FILE, read_metrics

    config = load_config(
        "tiny_cpu_short_smoke",
        [
            "warmstart.enabled=false",
            "grpo.prompts_per_step=2",
            "grpo.samples_per_prompt=4",
            "rollout.max_new_tokens=12",
            "evaluation.num_prompts=2",
            "logging.tensorboard=true",
            "trainer.max_steps=2",
            "checkpoint.enabled=false",
            "grpo.dynamic_sampling.enabled=true",
            "grpo.dynamic_sampling.max_refills=1",
        ],
    )
    run_dir = tmp_path / "run"
    with single_rank_env():
        trainer = GrpoTrainer(config, run_dir)
        try:
            trainer.fit()
            read = trainer.prompts.cursor
        finally:
            trainer.policy.close()
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["step"] >= 0]
    assert read == 2 * sum(row["dynamic_sampling/rounds"] for row in rows)
    for row in rows:
        rounds = row["dynamic_sampling/rounds"]
        assert rounds in (1.0, 2.0), row
        # every generated group is trained on (2: the quota), dropped or surplus
        accounted = 2 + row["dynamic_sampling/dropped_groups"] + row["dynamic_sampling/surplus_groups"]
        assert accounted == 2 * rounds, row
        assert row["rollout/tokens"] > 0 and row["timing/rollout"] > 0
        if row["dynamic_sampling/padded_groups"] > 0:
            assert rounds == 2.0
        if row["reward/std"] == 0:  # the kept batch has no signal: both rounds ran, all of it is padding
            assert rounds == 2.0 and row["dynamic_sampling/padded_groups"] == 2, row
    lines = [json.loads(line) for line in (run_dir / HISTOGRAMS_FILE).read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1]
    for line, row in zip(lines, rows):
        lengths = Histogram.from_dict(line["response_length/histogram"])
        assert lengths.edges[-1] == 12 and lengths.total == 8 and lengths.sum == row["rollout/tokens"]
        assert Histogram.from_dict(line["acceptance/histogram"]).total == row["rollout/tokens"]
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"histograms": 0})
    events.Reload()
    assert [e.step for e in events.Histograms("response_length/histogram")] == [0, 1]
    assert [e.histogram_value.num for e in events.Histograms("acceptance/histogram")] == [
        row["rollout/tokens"] for row in rows
    ]
    for name in ("response_length_histogram.png", "acceptance_histogram.png"):
        assert (run_dir / "plots" / name).stat().st_size > 1000


@pytest.mark.slow
def test_a_stop_signal_between_refill_rounds_abandons_the_step(tmp_path: Path) -> None:
    """A reward that is always 0 leaves no group with signal, so every step asks for its refill rounds; a stop
    signal during step 1's first round is agreed before its second: the run checkpoints step 1 with the prompt
    cursor where step 1 began (its prompts come again on resume) and never generates the second round."""
    import os
    import signal

    from sparrow_nemo.checkpoint.run_state import read_run_state
    from sparrow_nemo.grpo.checkpoint import TrainerState
    from sparrow_nemo.grpo.preemption import Preempted
    from sparrow_nemo.grpo.recipe import load_config
    from sparrow_nemo.grpo.trainer import GrpoTrainer
    from sparrow_nemo.run_io.metrics import read_metrics

    config = load_config(
        "tiny_cpu_short_smoke",
        [
            "warmstart.enabled=false",
            "grpo.prompts_per_step=2",
            "grpo.samples_per_prompt=4",
            "rollout.max_new_tokens=8",
            "evaluation.num_prompts=2",
            "logging.plots=false",
            "trainer.max_steps=3",
            "grpo.dynamic_sampling.enabled=true",
            "grpo.dynamic_sampling.max_refills=2",
        ],
    )
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    calls: list[int] = []
    try:
        with single_rank_env():
            trainer = GrpoTrainer(config, tmp_path / "run")
            trainer.prompts.train_reward = lambda ids, answer: 0.0
            generate = trainer.rollout_engine.generate

            def signalled(*args, **kwargs):
                calls.append(trainer.state.step)
                if trainer.state.step == 1:
                    os.kill(os.getpid(), signal.SIGUSR1)
                return generate(*args, **kwargs)

            trainer.rollout_engine.generate = signalled
            try:
                with pytest.raises(Preempted) as info:
                    trainer.fit()
            finally:
                trainer.policy.close()
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert info.value.step == 1
    (row,) = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["step"] >= 0]
    assert row["step"] == 0 and row["dynamic_sampling/rounds"] == 3  # step 0: every round it may have
    assert calls.count(1) == 1  # step 1: its first round only
    state = TrainerState.from_dict(read_run_state(info.value.checkpoint)[0])
    assert state.step == 1 and state.prompt_stream["cursor"] == 3 * 2  # step 0's three rounds of 2 prompts
