"""Predicted rollout minutes per RL step of a recipe on a cluster, from the engine's scheduler in dry mode.

Used by ``sparrow plan`` and ``scripts/recipe_hours.py`` (the README's hours table). Assumptions, each stated
where it is made:

- engines: one per ``rollout.tensor_parallel_size`` GPUs; each decodes its share of the step's prompt groups
  (``grpo.prompts_per_step`` split as evenly as whole groups allow);
- its KV pool: what ``sparrow plan`` gives it next to the policy's resident state
  (:mod:`sparrow_nemo.policy.engine_memory`);
- responses: :func:`~sparrow_nemo.rollout.torch.dry_run.qwen3_lengths` (or lengths given), prompts of
  ``data.max_prompt_tokens / 4`` tokens; the step waits for its slowest engine: the one holding the longest
  response and the one holding the most tokens are simulated, the slower counts;
- prices: the decode cost model on the GPU's constants (:data:`~sparrow_nemo.sparse.cost_model.HARDWARE`),
  the FLOP/s and bandwidth of a k-GPU engine k times one GPU's plus two all-reduces per layer and step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sparrow_nemo.rollout.torch.dry_run import DryRun, StepPricer, qwen3_lengths, simulate, simulate_static
from sparrow_nemo.sparse.cost_model import DecodeCostModel, Hardware
from sparrow_nemo.sparse.schedule import BudgetSchedule

#: GiB of one GPU of each kind the forecasts know
GPU_MEMORY_GIB = {"h100": 80.0, "h200": 141.0}


@dataclass(frozen=True)
class RolloutForecast:
    """One RL step's rollout on the slowest engine, four ways.

    Attributes:
        engines: engines in the job; requests: responses the simulated engine decodes; pool_tokens: its KV pool.
        continuous, dense: this engine under the recipe's schedule and dense (continuous batching, its pool).
        static: the static-wave engine it replaced (KV reserved for prompt + cap per row, batch halved to fit).
        unlimited: continuous batching with no memory limit (every request decodes from the first step).
    """

    engines: int
    requests: int
    pool_tokens: int
    continuous: DryRun
    dense: DryRun
    static: DryRun
    unlimited: DryRun

    @property
    def sparse_speedup(self) -> float:
        """Dense / sparse rollout time at the engine's own batch."""
        return self.dense.seconds / self.continuous.seconds

    def lines(self) -> list[str]:
        """What ``sparrow plan`` prints."""
        c, u, s = self.continuous, self.unlimited, self.static
        return [
            f"rollout per step (predicted, slowest of {self.engines} engines, {self.requests} responses, KV pool "
            f"{self.pool_tokens:,} tokens): continuous {c.seconds / 60:.1f} min ({c.decode_steps:,} decode steps, "
            f"mean batch {c.mean_batch:.1f}, {c.preemptions} preemptions), no-memory-limit bound "
            f"{u.seconds / 60:.1f} min ({c.seconds / u.seconds:.2f}x), static waves {s.seconds / 60:.1f} min; "
            f"sparse vs dense {self.sparse_speedup:.2f}x",
        ]


def rollout_forecast(
    config, pool_tokens: int, gpus: int, hardware: Hardware, lengths: list[int] | None = None, seed: int = 0
) -> RolloutForecast:
    """The forecast of ``config`` (a resolved recipe) on ``gpus`` GPUs of ``hardware`` whose engines each hold
    ``pool_tokens`` KV tokens (``sparrow plan``'s :class:`~sparrow_nemo.policy.engine_memory.RolloutMemory`)."""
    r, s, g = config.rollout, config.sparsity, config.grpo
    k = r.tensor_parallel_size
    engines = gpus // k
    groups = math.ceil(g.prompts_per_step / engines)
    prompt = config.data.max_prompt_tokens // 4
    cap = r.max_new_tokens
    if lengths is None:
        lengths = qwen3_lengths(engines * groups * g.samples_per_prompt, cap, seed)
    per_engine = groups * g.samples_per_prompt
    shares = [lengths[i : i + per_engine] for i in range(0, len(lengths), per_engine)]
    picks = {
        max(range(len(shares)), key=lambda e: max(shares[e])),
        max(range(len(shares)), key=lambda e: sum(shares[e])),
    }
    model = DecodeCostModel(
        config.model.shape(), hardware, dense_layers=s.dense_layers, page_score=s.page_score
    )
    schedule = s.build_schedule()
    dense_schedule = BudgetSchedule.dense(schedule.bin_tokens, s.page_size)
    pages = pool_tokens // s.page_size
    sparse, dense = StepPricer(model, schedule, k), StepPricer(model, dense_schedule, k)
    runs = []
    for e in picks:
        mine = shares[e]
        common = (mine, prompt, g.samples_per_prompt)
        runs.append(
            (
                simulate(*common, sparse, s.page_size, pages, r.max_batch_size),
                simulate(*common, dense, s.page_size, pages, r.max_batch_size),
                simulate_static(mine, prompt, cap, sparse, s.page_size, pages, r.max_batch_size),
                simulate(*common, sparse, s.page_size, None, r.max_batch_size),
            )
        )
    slowest = max(runs, key=lambda run: run[0].seconds)
    return RolloutForecast(engines, per_engine, pool_tokens, *slowest)
