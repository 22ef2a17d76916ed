"""Evaluation of a rollout engine on a prompt set: n samples per prompt, rewards, per-prompt records, summary.

A correct sample is one with reward >= 1 (the math reward is 0/1; the code reward is the pass fraction, so
only all-tests-pass counts). Reported, AIME-style:
- ``mean@n``: the fraction of correct samples per prompt, averaged over prompts (e.g. mean@16);
- ``pass@k``: the unbiased estimator (:func:`~sparrow_nemo.evaluation.passk.pass_at_k`) averaged over prompts;
- the mean reward, mean response length (tokens) and generation throughput.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from sparrow_nemo.evaluation.passk import default_ks, pass_at_k
from sparrow_nemo.rewards.registry import guarded_reward
from sparrow_nemo.rollout.engine import RolloutBatch, RolloutEngine, SamplingParams
from sparrow_nemo.sparse.schedule import BudgetSchedule


@dataclass
class PromptResult:
    """The n samples of one prompt.

    Attributes:
        index: position of the prompt in the evaluated set. answer: the reference answer.
        rewards: per sample, in [0, 1]. correct: samples with reward >= 1.
        response_tokens: response length per sample. finish_reasons: per sample.
        pass_at: {k: pass@k of this prompt}. responses: decoded responses (when a decoder was given).
    """

    index: int
    answer: Any
    rewards: list[float]
    correct: int
    response_tokens: list[int]
    finish_reasons: list[str]
    pass_at: dict[int, float]
    responses: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["pass_at"] = {str(k): v for k, v in self.pass_at.items()}
        return out


@dataclass(frozen=True)
class EvalSummary:
    """Averages over prompts (see the module docstring); ``schedule``: the schedule's name."""

    prompts: int
    n: int
    mean_at_n: float
    pass_at: dict[int, float]
    reward_mean: float
    response_tokens_mean: float
    tokens_per_s: float
    schedule: str

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "prompts": self.prompts,
            "n": self.n,
            f"mean@{self.n}": self.mean_at_n,
        }
        out.update({f"pass@{k}": v for k, v in self.pass_at.items()})
        out.update(
            reward_mean=self.reward_mean,
            response_tokens_mean=self.response_tokens_mean,
            tokens_per_s=self.tokens_per_s,
            schedule=self.schedule,
        )
        return out


def evaluate_samples(
    engine: RolloutEngine,
    prompts: Sequence[Sequence[int]],
    answers: Sequence[Any],
    reward: Callable[[list[int], Any], float],
    sampling: SamplingParams,
    schedule: BudgetSchedule,
    n: int,
    ks: Sequence[int] | None = None,
    decode: Callable[[list[int]], str] | None = None,
) -> tuple[list[PromptResult], float]:
    """Generate ``n`` samples per prompt in one ``engine.generate`` call and score them (:func:`score_samples`).

    Sample j of prompt i is request ``i * n + j`` (seed ``sample_seed(sampling.seed, i * n + j)``).

    Args:
        reward: ``(response ids, answer) -> reward in [0, 1]``.
        ks: pass@k values to compute (default :func:`default_ks`); each in [1, n].
        decode: optional ``ids -> text`` to store the responses.

    Returns:
        (per-prompt results in prompt order, generated tokens per second).
    """
    if len(prompts) != len(answers):
        raise ValueError(f"evaluate_samples: {len(prompts)} prompts but {len(answers)} answers")
    if not prompts:
        raise ValueError("evaluate_samples: no prompts to evaluate")
    ks = list(default_ks(n) if ks is None else ks)
    for k in ks:
        pass_at_k(n, 0, k)  # validates k against n before any generation
    batch = engine.generate([p for p in prompts for _ in range(n)], sampling, schedule)
    return score_samples(batch, answers, reward, n, ks, decode), batch.tokens_per_second()


def score_samples(
    batch: RolloutBatch,
    answers: Sequence[Any],
    reward: Callable[[list[int], Any], float],
    n: int,
    ks: Sequence[int],
    decode: Callable[[list[int]], str] | None = None,
) -> list[PromptResult]:
    """Per-prompt results of a generated batch whose samples ``i * n .. i * n + n - 1`` answer ``answers[i]``.

    Args:
        batch: ``len(answers) * n`` samples, prompt-major.
        reward: ``(response ids, answer) -> reward in [0, 1]``; a sample is correct when it is >= 1.
        ks: pass@k values to compute, each in [1, n].
        decode: optional ``ids -> text`` to store the responses.
    """
    if len(batch.samples) != len(answers) * n:
        raise ValueError(f"score_samples: {len(batch.samples)} samples for {len(answers)} prompts x n={n}")
    results = []
    for i, answer in enumerate(answers):
        samples = batch.samples[i * n : (i + 1) * n]
        ids = [s.response_ids.tolist() for s in samples]
        rewards = [guarded_reward(reward, r, answer) or 0.0 for r in ids]  # a raising reward: that sample's 0
        correct = sum(r >= 1.0 for r in rewards)
        results.append(
            PromptResult(
                index=i,
                answer=answer,
                rewards=rewards,
                correct=correct,
                response_tokens=[len(r) for r in ids],
                finish_reasons=[s.finish_reason for s in samples],
                pass_at={k: pass_at_k(n, correct, k) for k in ks},
                responses=[decode(r) for r in ids] if decode is not None else [],
            )
        )
    return results


def summarize(results: Sequence[PromptResult], n: int, tokens_per_s: float, schedule: str) -> EvalSummary:
    """Averages of :func:`evaluate_samples`' results over prompts."""
    if not results:
        raise ValueError("summarize: no results")
    m = len(results)
    ks = list(results[0].pass_at)
    return EvalSummary(
        prompts=m,
        n=n,
        mean_at_n=sum(r.correct / n for r in results) / m,
        pass_at={k: sum(r.pass_at[k] for r in results) / m for k in ks},
        reward_mean=sum(sum(r.rewards) / n for r in results) / m,
        response_tokens_mean=sum(sum(r.response_tokens) / n for r in results) / m,
        tokens_per_s=tokens_per_s,
        schedule=schedule,
    )
