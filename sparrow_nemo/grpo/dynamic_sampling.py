"""DAPO's dynamic sampling: a step trains on groups whose rewards differ, refilled from further prompts.

DAPO (Yu et al., 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", section 3.2, "dynamic
sampling"; verl's ``algorithm.filter_groups``, NeMo-RL's ``use_dynamic_sampling``): a GRPO group whose G rewards
are all equal (all right or all wrong) gives every sample advantage 0, so it adds no policy gradient, and as
accuracy rises ever more groups are so. With ``grpo.dynamic_sampling.enabled`` each step (:func:`fill_step`):

1. round 0 is the ordinary rollout: this rank's engine's share of ``grpo.prompts_per_step`` prompts, scored;
2. every engine keeps those of its groups whose training rewards (after any ``grpo.overlong`` shaping: the
   reward the advantages see) are not all equal, up to its quota, the number of groups it generated in round 0.
   Each engine fills its own quota, so every rank ends with the batch shape of a step without dynamic sampling
   and no sample moves between ranks;
3. while any engine is short (one all-reduce max of the shortfall), every engine runs another round: the next
   ``prompts_per_step`` prompts of the stream (what verl calls a generation batch), sampled with seeds of the
   round's own (:func:`round_seed`), and takes informative groups from it in order; informative groups past
   the quota are discarded (``surplus_groups``), as in DAPO and verl;
4. after ``max_refills`` refill rounds an engine still short completes its quota with dropped groups (their
   advantage is 0: no gradient) and the step goes on, logged as ``padded_groups`` and warned about; verl raises
   an error there instead, which ends a long run on one hard batch of prompts.

Advantages are computed once, on the kept groups. The trainer agrees on a stop signal before every refill round
(a preempted step waits one round at most; it is abandoned and its prompts come again on resume). Metrics (sums over the world):
``dynamic_sampling/rounds`` (generation rounds of the step), ``dropped_groups`` (zero-variance groups not trained
on), ``padded_groups`` and ``surplus_groups``. ``rollout/tokens_per_s`` then counts the trained tokens over the
time of every round (the effective rate); ``timing/rollout`` and ``timing/reward`` add up the rounds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from sparrow_nemo.config.schema import NON_NEGATIVE, Section, knob
from sparrow_nemo.grpo import world
from sparrow_nemo.grpo.process_model import reduce_max, reduce_sums
from sparrow_nemo.grpo.step_batch import LocalRollout
from sparrow_nemo.rollout.sampling import sample_seed

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DynamicSamplingConfig(Section):
    """The recipe's ``grpo.dynamic_sampling`` section (off in every shipped recipe; the Qwen3 ones document it)."""

    enabled: bool = knob(
        False,
        "DAPO's dynamic sampling: drop groups whose rewards are all equal (no policy gradient) and refill the "
        "step with groups of further prompts (grpo/dynamic_sampling.py)",
    )
    max_refills: int = knob(
        9,
        "refill rounds per step at most, each sampling grpo.prompts_per_step more prompts (9: ten generation "
        "batches in all, verl's and NeMo-RL's max_num_gen_batches default); an engine still short then trains "
        "on dropped groups (logged as dynamic_sampling/padded_groups)",
        check=NON_NEGATIVE,
    )


def informative_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[n / group_size] bool: the groups of ``rewards`` ([n], grouped by prompt) whose rewards are not all equal."""
    if rewards.numel() % group_size:
        raise ValueError(f"informative_groups: {rewards.numel()} rewards in groups of {group_size}")
    grouped = rewards.view(-1, group_size)
    return grouped.amax(dim=1) != grouped.amin(dim=1)


def round_seed(seed: int, step: int, round_: int) -> int:
    """The sampling seed of generation round ``round_`` of RL step ``step`` (``seed``: ``rollout.seed``).

    Round 0 has the step's seed, ``sample_seed(seed, step)`` (a step without refills samples as without dynamic
    sampling); a refill round's is mixed from it with the negative index ``-round_``, which no per-sample seed
    (index >= 0) uses.
    """
    step_seed = sample_seed(seed, step)
    return step_seed if round_ == 0 else sample_seed(step_seed, -round_)


@dataclass
class _Group:
    samples: list
    rewards: torch.Tensor


def fill_step(
    draw: Callable[[int], LocalRollout],
    config: DynamicSamplingConfig,
    group_size: int,
    advantages: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[LocalRollout, dict[str, float]]:
    """This rank's rollout of the step (module docstring); collective over the world when enabled.

    Args:
        draw: ``draw(round)`` draws the next ``prompts_per_step`` prompts of the stream and returns this rank's
            :class:`LocalRollout` of them, rewards scored (every rank calls it the same number of times).
        config: ``grpo.dynamic_sampling``. group_size: ``grpo.samples_per_prompt``.
        advantages: [n] rewards grouped by prompt -> [n] advantages (the step's estimator), computed again on
            the kept groups (``draw``'s rollouts come with their own, which a step without refills keeps).

    Returns:
        (the rollout the step trains on, with advantages; the ``dynamic_sampling/*`` metrics, empty when off).
    """
    first = draw(0)
    if not config.enabled:
        return first, {}
    quota = len(first.samples) // group_size
    kept: list[_Group] = []
    dropped: list[_Group] = []
    surplus, seconds, errors, rounds, local = 0, 0.0, 0, 1, first
    while True:
        seconds += local.seconds
        errors += local.reward_errors
        signal = informative_groups(local.rewards, group_size).tolist() if local.samples else []
        for k, has_signal in enumerate(signal):
            rows = slice(k * group_size, (k + 1) * group_size)
            group = _Group(local.samples[rows], local.rewards[rows])
            if not has_signal:
                dropped.append(group)
            elif len(kept) < quota:
                kept.append(group)
            else:
                surplus += 1
        if rounds > config.max_refills or reduce_max([float(quota - len(kept))])[0] <= 0:
            break
        local = draw(rounds)
        rounds += 1
    padding = dropped[: quota - len(kept)]  # round 0's groups alone fill the quota: always enough
    groups = kept + padding
    samples = [s for g in groups for s in g.samples]
    rewards = torch.cat([g.rewards for g in groups]) if groups else torch.zeros(0)
    out = LocalRollout(samples, first.rows, seconds, rewards=rewards.float(), reward_errors=errors)
    out.advantages = advantages(out.rewards).float() if samples else torch.zeros(0)
    n_dropped, n_padded, n_surplus = reduce_sums([len(dropped) - len(padding), len(padding), surplus])
    if n_padded and world.rank() == 0:
        logger.warning(
            "dynamic sampling: %d groups without reward variance trained on after %d refill rounds "
            "(grpo.dynamic_sampling.max_refills): too few prompts with mixed outcomes",
            int(n_padded),
            config.max_refills,
        )
    metrics = {
        "dynamic_sampling/rounds": float(rounds),
        "dynamic_sampling/dropped_groups": n_dropped,
        "dynamic_sampling/padded_groups": n_padded,
        "dynamic_sampling/surplus_groups": n_surplus,
    }
    return out, metrics
