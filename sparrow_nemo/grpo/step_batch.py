"""The step as data: what this rank generated (:class:`LocalRollout`), its replica's share (:class:`StepBatch`),
built once per step and read by every later phase, and the step's statistics over all ranks (:class:`StepStats`).

Order within a step (see :mod:`sparrow_nemo.grpo.process_model` for what runs where):

1. :func:`generate` - this rank's engine samples its prompts (whole groups, per-sample seeds by global index);
2. :func:`score` - rewards and group advantages where the samples were generated;
3. :meth:`StepBatch.assemble` - the replica's samples on every rank of its model-parallel group (tensors),
   padded into :class:`~sparrow_nemo.grpo.rollout_step.RolloutTensors`;
4. the logprobs / reference phases fill ``dense`` / ``ref_logprobs`` (this replica's rows only);
5. :func:`measure` - acceptance rate of this rank's own tokens, then every step statistic merged over the
   world: sums / maxima by all-reduce, the per-bin tail exactly (:func:`merged_bin_tails`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from sparrow_nemo.control.tail_stats import BinTail, bin_counts, merged_bin_tails, merged_quantiles
from sparrow_nemo.grpo.process_model import (
    RankPlan,
    SampleShare,
    distributed,
    gather_samples,
    gather_scalars,
    reduce_max,
    reduce_sums,
)
from sparrow_nemo.grpo.rollout_step import RolloutTensors, collate_share, token_mismatch
from sparrow_nemo.policy.logprobs import LogprobOutput
from sparrow_nemo.rewards.registry import guarded_reward
from sparrow_nemo.rollout.engine import RolloutSample, SamplingParams, TokenProgress
from sparrow_nemo.rollout.sampling import sample_seed
from sparrow_nemo.rollout.scoring import TokenMismatch
from sparrow_nemo.run_io.histograms import BINS, Histogram
from sparrow_nemo.sparse.config import SparsityConfig
from sparrow_nemo.sparse.mismatch import PAPER_QUANTILE, tail_name
from sparrow_nemo.sparse.schedule import DENSE_BUDGET, BudgetSchedule

#: bins of the per-bin acceptance histograms over [0, 1] (0.01 wide: a pooled quantile read off their merged
#: counts is exact to one bin width)
BIN_HISTOGRAM_BINS = 100


@dataclass
class LocalRollout:
    """This rank's own samples of the step (empty on a rank that generates none).

    Attributes:
        samples: the engine's samples, in step order.
        rows: their rows in the replica's :class:`StepBatch` (contiguous).
        seconds: wall time of the generation.
        rewards, advantages: [n] float32, filled by :func:`score`.
        reward_errors: samples whose reward raised or was not finite (scored 0 by :func:`score`).
    """

    samples: list[RolloutSample]
    rows: range
    seconds: float
    rewards: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    advantages: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    reward_errors: int = 0

    @property
    def tokens(self) -> int:
        """Generated response tokens."""
        return sum(int(s.response_ids.numel()) for s in self.samples)


def generate(
    engine: Any,
    plan: RankPlan,
    prompts: Sequence[Sequence[int]],
    group_size: int,
    sampling: SamplingParams,
    schedule: BudgetSchedule,
    on_tokens: TokenProgress | None = None,
) -> LocalRollout:
    """``group_size`` samples of each of this rank's engine's prompts (``plan.engine_share``) with ``engine``;
    this rank keeps them where it leads the engine (``plan.engine_prompts``), the other ranks of a
    tensor-parallel engine take part in the call and drop their copies.

    Sample ``g`` of step prompt ``j`` is drawn with seed ``sample_seed(sampling.seed, j * group_size + g)``,
    as a one-rank run draws it. ``prompts`` are all the step's prompts (every rank reads the same stream).
    """
    share = plan.engine_share(len(prompts))
    mine = plan.engine_prompts(len(prompts))
    replica = plan.replica_prompts(len(prompts))
    rows = range((mine.start - replica.start) * group_size, (mine.stop - replica.start) * group_size)
    if not share:
        return LocalRollout([], rows, 0.0)
    requests = [list(prompts[j]) for j in share for _ in range(group_size)]
    seeds = [sample_seed(sampling.seed, j * group_size + g) for j in share for g in range(group_size)]
    start = time.perf_counter()
    batch = engine.generate(requests, sampling, schedule, sample_seeds=seeds, on_tokens=on_tokens)
    return LocalRollout(batch.samples if mine else [], rows, time.perf_counter() - start)


def score(
    local: LocalRollout,
    answers: Sequence[Any],
    reward: Callable[[list[int], Any], float],
    advantages: Callable[[torch.Tensor], torch.Tensor],
    group_size: int,
) -> None:
    """Rewards (``reward(response ids, answer)``) and group advantages of ``local``'s samples, in place.

    ``answers`` are this rank's prompts' answers (one per prompt); ``advantages`` maps [n] rewards grouped by
    prompt to [n] advantages (whole groups: a rank always holds all samples of its prompts). A sample whose
    reward raises (a completion no reward function foresaw) or is not finite scores 0, is logged and counted
    in ``local.reward_errors`` (the ``reward/errors`` metric): one bad completion never ends the run.
    """
    expanded = [a for a in answers for _ in range(group_size)]
    if len(expanded) != len(local.samples):
        raise ValueError(f"score: {len(answers)} answers for {len(local.samples)} samples of {group_size}")
    values = [guarded_reward(reward, s.response_ids.tolist(), a) for s, a in zip(local.samples, expanded)]
    local.reward_errors = sum(v is None for v in values)
    local.rewards = torch.tensor([0.0 if v is None else v for v in values], dtype=torch.float32)
    local.advantages = (
        advantages(local.rewards).float() if local.samples else torch.zeros(0, dtype=torch.float32)
    )


@dataclass
class StepBatch:
    """One RL step's data on this rank: its data-parallel replica's share (n rows, width S), built once.

    Attributes:
        step: the RL step. schedule: the schedule the rollouts were generated with.
        data: tokens [n, S], lengths, response_mask [n, S-1], rollout_logprobs [n, S-1], advantages [n].
        rewards: [n] float32. prompt_lens: [n] int64. finish: [n] int64 (``process_model.FINISH_CODES``).
        kv_budgets: per row [Lr] int64 KV budget of each response token (sparse teacher-forcing plans).
        local: what this rank generated (its rows and samples, with their top-K).
        dense: the policy's dense outputs for ``data`` (the logprobs phase), [n, S-1, ...].
        ref_logprobs: [n, S-1] float32 reference-policy log-probs (when the KL penalty is on).
        stats: the step's statistics over every rank (:func:`measure`).
    """

    step: int
    schedule: BudgetSchedule
    data: RolloutTensors
    rewards: torch.Tensor
    prompt_lens: torch.Tensor
    finish: torch.Tensor
    kv_budgets: list[torch.Tensor]
    local: LocalRollout
    dense: LogprobOutput | None = None
    ref_logprobs: torch.Tensor | None = None
    stats: StepStats | None = None

    @classmethod
    def assemble(cls, step: int, schedule: BudgetSchedule, local: LocalRollout, plan: RankPlan) -> StepBatch:
        """The replica's share from every model-parallel rank's :class:`LocalRollout`. Collective over the
        model-parallel group (:func:`~sparrow_nemo.grpo.process_model.gather_samples`)."""
        from megatron.core import parallel_state as ps

        mine = SampleShare.from_samples(local.samples, local.rewards, local.advantages)
        group = ps.get_model_parallel_group() if plan.tp * plan.pp > 1 else None
        share = gather_samples(mine, plan.slot, group)
        if len(share) == 0:
            raise ValueError(f"step {step}: no samples for data-parallel rank {plan.dp_rank}")
        return cls(
            step=step,
            schedule=schedule,
            data=collate_share(share),
            rewards=share.rewards,
            prompt_lens=share.prompt_lens,
            finish=share.finish,
            kv_budgets=share.split_kv_budget(),
            local=local,
        )

    def __len__(self) -> int:
        return int(self.data.tokens.shape[0])

    def local_mismatch(self) -> TokenMismatch:
        """Acceptance rate etc. of this rank's own tokens (policy dense top-K vs the engine's top-K)."""
        if self.dense is None:
            raise RuntimeError("StepBatch.local_mismatch: the logprobs phase has not run")
        rows = slice(self.local.rows.start, self.local.rows.stop)
        if not self.local.samples:
            empty = torch.zeros(0)
            return TokenMismatch(empty, torch.zeros(0, dtype=torch.int64), empty, empty)
        dense = LogprobOutput(
            *(getattr(self.dense, f)[rows] for f in ("logprobs", "entropy", "topk_ids", "topk_logprobs"))
        )
        return token_mismatch(self.local.samples, dense, self.data.rows(rows))


@dataclass(frozen=True)
class StepStats:
    """The step's statistics over all ranks (identical on every rank).

    Attributes:
        samples, tokens: samples and generated response tokens of the step.
        reward_mean, reward_std, accuracy: over samples (accuracy = reward >= 1).
        reward_errors: samples whose reward raised or was not finite (scored 0).
        advantage_nonzero: fraction of samples with a non-zero advantage (a group whose rewards are all equal
            gives its samples none: a step where every group is so has no policy gradient).
        length_mean, length_median, length_max, length_min, truncation_rate: response lengths (tokens; the
            median interpolates between the two middle samples of the world).
        tokens_per_rank: generated tokens of each global rank.
        rollout_s: generation wall time of rank 0; rollout_s_max: of the slowest rank.
        tails: the acceptance-rate tail per bin of cached length (sparsity quantile, noise_z bounds).
        paper_tails: {bin: the paper's p5 per bin} (:data:`PAPER_QUANTILE`; ``tails``' values when the
            sparsity quantile is the paper's), logged beside the rule's so that runs under any rule compare.
        alpha_mean, alpha_tail: mean and ``quantile`` of the acceptance rate over all tokens; alpha_p5: the
            paper's p5 over all tokens.
        alpha_mean_per_bin: {bin: mean acceptance rate}.
        token_mult_prob_error, log_ppl_diff: mean exp|train - gen| and mean (train - gen) logprob.
        predicted_speedup: cost model, dense / schedule time of the slowest engine's batch.
        length_histogram, acceptance_histogram: response lengths of the samples and acceptance rates of the
            tokens, over every rank (:mod:`sparrow_nemo.run_io.histograms`).
        acceptance_histogram_per_bin: {bin: acceptance rates of the bin's tokens}, :data:`BIN_HISTOGRAM_BINS`
            bins over [0, 1], so a quantile of many steps' pooled tokens can be read off the merged counts.
    """

    samples: int
    tokens: int
    reward_mean: float
    reward_std: float
    accuracy: float
    reward_errors: float
    advantage_nonzero: float
    length_mean: float
    length_median: float
    length_max: float
    length_min: float
    truncation_rate: float
    tokens_per_rank: list[float]
    rollout_s: float
    rollout_s_max: float
    tails: list[BinTail]
    paper_tails: dict[int, float]
    alpha_mean: float
    alpha_tail: float
    alpha_p5: float
    alpha_mean_per_bin: dict[int, float]
    token_mult_prob_error: float
    log_ppl_diff: float
    predicted_speedup: float
    length_histogram: Histogram
    acceptance_histogram: Histogram
    acceptance_histogram_per_bin: dict[int, Histogram]

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of the step's rollout (the slowest engine's wall time)."""
        return self.tokens / self.rollout_s_max if self.rollout_s_max > 0 else math.nan

    def metrics(self, schedule: BudgetSchedule, quantile: float) -> dict[str, float]:
        """Flat ``group/name`` metrics (NeMo-RL / verl names); ``schedule``: the one the rollouts used."""
        stat = tail_name(quantile)
        m: dict[str, float] = {
            "reward/mean": self.reward_mean,
            "reward/std": self.reward_std,
            "reward/accuracy": self.accuracy,
            "reward/errors": self.reward_errors,
            "advantage/nonzero_fraction": self.advantage_nonzero,
            "response_length/mean": self.length_mean,
            "response_length/median": self.length_median,
            "response_length/max": self.length_max,
            "response_length/min": self.length_min,
            "response_length/truncation_rate": self.truncation_rate,
            "rollout/tokens": float(self.tokens),
            "rollout/tokens_per_s": self.tokens_per_s,
            "sparsity/predicted_speedup": self.predicted_speedup,
            "sparsity/dense": float(schedule.is_dense),
        }
        m.update({f"rollout/tokens_rank_{r}": t for r, t in enumerate(self.tokens_per_rank)})
        if self.tails:
            m["acceptance/mean"] = self.alpha_mean
            m[f"acceptance/{stat}"] = self.alpha_tail
            m["acceptance/p5"] = self.alpha_p5
            m["token_mult_prob_error"] = self.token_mult_prob_error
            m["rollout_is/log_ppl_diff"] = self.log_ppl_diff
            for t in self.tails:
                m[f"acceptance/{stat}/bin_{t.bin}"] = t.value
                m[f"acceptance/p5/bin_{t.bin}"] = self.paper_tails[t.bin]
                m[f"acceptance/mean/bin_{t.bin}"] = self.alpha_mean_per_bin[t.bin]
                m[f"acceptance/tokens/bin_{t.bin}"] = float(t.tokens)
            for b in range(max([len(schedule.budgets), *(t.bin + 1 for t in self.tails)])):
                budget = schedule.budget(b * schedule.bin_tokens)
                m[f"sparsity/budget/bin_{b}"] = float("inf") if budget == DENSE_BUDGET else float(budget)
        return m

    def histograms(self) -> dict[str, Histogram]:
        """The step's histograms by name (the acceptance rates' when the step measured them, as
        :meth:`metrics`)."""
        out = {"response_length/histogram": self.length_histogram}
        if self.tails:
            out["acceptance/histogram"] = self.acceptance_histogram
            out |= {f"acceptance/histogram/bin_{b}": h for b, h in self.acceptance_histogram_per_bin.items()}
        return out


def measure(
    batch: StepBatch, sparsity: SparsityConfig, cost_model: Any | None = None, length_cap: int | None = None
) -> StepStats:
    """:func:`measure_tokens` of this rank's samples and the acceptance rate of their tokens, the tails as
    ``sparsity`` states them (``quantile``, ``noise_z``, ``noise_unit``). Collective."""
    by_sequence = sparsity.noise_unit == "sequence"
    mm = batch.local_mismatch()
    return measure_tokens(
        batch.local,
        mm,
        batch.schedule,
        sparsity.quantile,
        sparsity.noise_z,
        cost_model,
        by_sequence,
        length_cap,
    )


def measure_tokens(
    local: LocalRollout,
    mm: TokenMismatch,
    schedule: BudgetSchedule,
    quantile: float,
    noise_z: float,
    cost_model: Any | None = None,
    by_sequence: bool = False,
    length_cap: int | None = None,
) -> StepStats:
    """The step's :class:`StepStats` from every rank's own samples (``local``, rewards scored) and the
    mismatch of their response tokens (``mm``, sample-major). Collective over the world.

    Each sample and token is counted on the rank that generated it (so nothing is counted twice however
    many model-parallel ranks hold a copy): one all-reduce each of sums, maxima and minima, one all-gather
    of per-rank token counts, the exact per-bin tail (:func:`merged_bin_tails`) and the overall quantile.
    ``cost_model`` prices this engine's batch dense and under the step's schedule (the step's prediction is
    the slowest engine's dense time over its slowest sparse time). ``by_sequence``: the tails' bounds count
    a sample's tokens together (``sparsity.noise_unit: sequence``). ``length_cap``: the top of the response
    length histogram's bins (``rollout.max_new_tokens``; None = the step's longest response).
    """
    world = torch.distributed.group.WORLD if distributed() else None
    rank0 = not distributed() or torch.distributed.get_rank() == 0
    lengths = torch.tensor([s.response_ids.numel() for s in local.samples], dtype=torch.int64)
    truncated = sum(s.finish_reason == "length" for s in local.samples)
    rewards = local.rewards.double()
    diff = (mm.train_logprobs - mm.gen_logprobs).double()
    dense_s = sparse_s = 0.0
    if cost_model is not None and local.samples:
        prompt_lens = [s.prompt_ids.numel() for s in local.samples]
        dense = BudgetSchedule.dense(schedule.bin_tokens, schedule.page_size)
        dense_s = cost_model.rollout_cost(dense, lengths, prompt_lens).total_s
        sparse_s = cost_model.rollout_cost(schedule, lengths, prompt_lens).total_s
    n, r_sum, r_sq, correct, errors, signal, tokens, n_trunc, a_sum, a_count, tmpe, d_sum, rollout_s = (
        reduce_sums(
            [
                len(local.samples),
                float(rewards.sum()),
                float((rewards**2).sum()),
                float((rewards >= 1.0).sum()),
                local.reward_errors,
                float((local.advantages != 0).sum()),
                float(lengths.sum()),
                truncated,
                float(mm.alpha.double().sum()),
                mm.alpha.numel(),
                float(torch.exp(diff.abs()).sum()),
                float(diff.sum()),
                local.seconds if rank0 else 0.0,
            ]
        )
    )
    length_max, neg_length_min, rollout_max, dense_max, sparse_max = reduce_max(
        [
            float(lengths.max()) if lengths.numel() else -math.inf,
            -float(lengths.min()) if lengths.numel() else -math.inf,
            local.seconds,
            dense_s,
            sparse_s,
        ]
    )
    sequence = torch.repeat_interleave(torch.arange(len(lengths)), lengths) if by_sequence else None
    if sequence is not None and sequence.shape != mm.alpha.shape:
        raise ValueError(
            f"measure_tokens: {tuple(mm.alpha.shape)} token alphas for {int(lengths.sum())} tokens"
        )
    tails = merged_bin_tails(mm.alpha, mm.cached_len, schedule.bin_tokens, quantile, noise_z, world, sequence)
    paper = (
        tails
        if quantile == PAPER_QUANTILE
        else merged_bin_tails(
            mm.alpha, mm.cached_len, schedule.bin_tokens, PAPER_QUANTILE, noise_z, world, sequence
        )
    )
    bins = torch.div(mm.cached_len, schedule.bin_tokens, rounding_mode="floor")
    num_bins = max([t.bin + 1 for t in tails], default=0)
    local_bin_sums = torch.zeros(num_bins, dtype=torch.float64).index_add_(0, bins, mm.alpha.double())
    bin_sums = reduce_sums(local_bin_sums.tolist())
    one_bin = torch.zeros_like(mm.cached_len)
    overall = merged_quantiles(
        mm.alpha,
        one_bin,
        torch.tensor([[quantile], [PAPER_QUANTILE]], dtype=torch.float64),
        bin_counts(one_bin, 1, world),
        world,
    )
    one_sample = torch.zeros_like(lengths)
    median = merged_quantiles(
        lengths.double(),
        one_sample,
        torch.tensor([[0.5]], dtype=torch.float64),
        bin_counts(one_sample, 1, world),
        world,
    )
    length_histogram, acceptance_histogram = merged_histograms(
        [(lengths, 0.0, float(length_cap or max(length_max, 1.0))), (mm.alpha, 0.0, 1.0)]
    )
    per_bin = (
        merged_histograms([(mm.alpha[bins == t.bin], 0.0, 1.0) for t in tails], BIN_HISTOGRAM_BINS)
        if tails
        else []
    )
    mean = r_sum / n
    return StepStats(
        samples=int(n),
        tokens=int(tokens),
        reward_mean=mean,
        reward_std=math.sqrt(max(r_sq - n * mean * mean, 0.0) / (n - 1)) if n > 1 else 0.0,
        accuracy=correct / n,
        reward_errors=errors,
        advantage_nonzero=signal / n,
        length_mean=tokens / n,
        length_median=float(median[0, 0]),
        length_max=length_max,
        length_min=-neg_length_min,
        truncation_rate=n_trunc / n,
        tokens_per_rank=gather_scalars(float(lengths.sum())),
        rollout_s=rollout_s,
        rollout_s_max=rollout_max,
        tails=tails,
        paper_tails={t.bin: t.value for t in paper},
        alpha_mean=a_sum / a_count if a_count else math.nan,
        alpha_tail=float(overall[0, 0]) if a_count else math.nan,
        alpha_p5=float(overall[1, 0]) if a_count else math.nan,
        alpha_mean_per_bin={t.bin: bin_sums[t.bin] / t.tokens for t in tails},
        token_mult_prob_error=tmpe / a_count if a_count else math.nan,
        log_ppl_diff=d_sum / a_count if a_count else math.nan,
        predicted_speedup=dense_max / sparse_max if sparse_max > 0 else math.nan,
        length_histogram=length_histogram,
        acceptance_histogram=acceptance_histogram,
        acceptance_histogram_per_bin={t.bin: h for t, h in zip(tails, per_bin)},
    )


def merged_histograms(
    parts: Sequence[tuple[torch.Tensor, float, float]], bins: int = BINS
) -> list[Histogram]:
    """One :class:`Histogram` per ``(values, low, high)`` of this rank (any shape), ``bins`` equal bins over
    ``[low, high]``, merged over every rank: one all-reduce of sums, one of maxima. Collective; every rank must
    pass the same ``low``, ``high`` and number of parts."""
    sums: list[float] = []
    extremes: list[float] = []
    edges = []
    for values, low, high in parts:
        if not high > low:
            raise ValueError(f"histogram: edges [{low}, {high}] are empty")
        grid = torch.linspace(low, high, bins + 1, dtype=torch.float64)
        v = values.detach().reshape(-1).double().cpu()
        index = torch.bucketize(
            v, grid[1:-1], right=True
        )  # [low, e1) -> 0 ... [e_{bins-1}, high] -> bins - 1
        counts = torch.bincount(index, minlength=bins).double()
        sums += [*counts.tolist(), float(v.numel()), float(v.sum()), float((v * v).sum())]
        extremes += [float(v.max()), -float(v.min())] if v.numel() else [-math.inf, -math.inf]
        edges.append(tuple(grid.tolist()))
    sums, extremes = reduce_sums(sums), reduce_max(extremes)
    out = []
    for k, grid in enumerate(edges):
        s = sums[k * (bins + 3) : (k + 1) * (bins + 3)]
        top, neg_bottom = extremes[2 * k : 2 * k + 2]
        out.append(Histogram(grid, tuple(s[:bins]), s[bins], s[bins + 1], s[bins + 2], -neg_bottom, top))
    return out
