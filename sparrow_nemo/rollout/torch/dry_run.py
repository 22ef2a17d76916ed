"""The engine's scheduler in dry mode: a rollout replayed on page numbers and priced by the decode cost model.

How long would a recipe's rollout take on a GPU we cannot run? :func:`simulate` runs the torch engine's own
:class:`~sparrow_nemo.rollout.torch.scheduler.Scheduler` and :class:`~sparrow_nemo.rollout.torch.block_manager.
BlockManager` (the code that schedules a real rollout) over sequences whose response lengths are given instead
of sampled: the same admissions, page growth, preemptions, prefix sharing and recomputes. Each decode step is
priced by :class:`~sparrow_nemo.sparse.cost_model.DecodeCostModel` on the running rows' cached lengths under the
schedule (:class:`StepPricer`), each prefill and recompute by its prefill cost. :func:`simulate_static` prices
the engine this one replaced (static waves of rows with KV reserved for prompt + cap, halved until they fit),
and ``simulate(..., capacity_pages=None)`` an engine with no memory limit (every request decodes from step 0):
the bound continuous batching is held to.

Response lengths: :func:`qwen3_lengths` (the default: log-normal, median 7,000 tokens, sigma 0.9, cut at the
cap; our reading of Qwen3 thinking models on math RL, not a measurement) or :func:`lengths_like_run`
(a log-normal through the median and mean response length of a finished run's last steps).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from sparrow_nemo.rollout.torch.block_manager import BlockManager, pages_for
from sparrow_nemo.rollout.torch.scheduler import Scheduler
from sparrow_nemo.rollout.torch.sequence import Sequence as Seq
from sparrow_nemo.sparse.cost_model import DecodeCostModel
from sparrow_nemo.sparse.schedule import BudgetSchedule

#: the default length model (tokens): log-normal median and sigma (mean ~10.5K, ~3% past a 37,888 cap)
QWEN3_MEDIAN, QWEN3_SIGMA = 7_000, 0.9
#: decode steps priced at once (memory ~ this x the most running rows)
PRICE_CHUNK = 4096


def qwen3_lengths(
    count: int, cap: int, seed: int = 0, median: float = QWEN3_MEDIAN, sigma: float = QWEN3_SIGMA
) -> list[int]:
    """``count`` response lengths (tokens): log-normal with ``median`` and ``sigma``, in [1, ``cap``]."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(count, generator=gen, dtype=torch.float64)
    return torch.clamp(torch.exp(math.log(median) + sigma * z).round(), 1, cap).to(torch.int64).tolist()


def lengths_like_run(metrics: Path, count: int, cap: int, last_steps: int = 10, seed: int = 0) -> list[int]:
    """:func:`qwen3_lengths` through a finished run's lengths: the mean ``response_length/median`` and
    ``response_length/mean`` of its last ``last_steps`` rows of ``metrics.jsonl`` (sigma from mean/median)."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "response_length/median" in r and "response_length/mean" in r][-last_steps:]
    if not rows:
        raise ValueError(f"{metrics}: no rows with response_length/median and response_length/mean")
    median = sum(r["response_length/median"] for r in rows) / len(rows)
    mean = sum(r["response_length/mean"] for r in rows) / len(rows)
    sigma = math.sqrt(2 * math.log(max(mean / median, 1.0)))
    return qwen3_lengths(count, cap, seed, median=median, sigma=sigma)


class StepPricer:
    """Seconds of decode steps and prefills of one engine under a schedule.

    Args:
        model: the decode cost model of the engine's model and GPU.
        schedule: the sparse layers' budgets (``BudgetSchedule.dense`` for the dense baseline).
        tensor_parallel: GPUs per engine: FLOP/s and bandwidth scale with it, and every layer adds two
            all-reduces of ``allreduce_s`` seconds each per step (attention output, MLP).
        allreduce_s: latency of one small all-reduce over the engine's GPUs (NVLink: ~10 us).
    """

    def __init__(
        self,
        model: DecodeCostModel,
        schedule: BudgetSchedule,
        tensor_parallel: int = 1,
        allreduce_s: float = 10e-6,
    ) -> None:
        hw = model.hardware
        group = replace(
            hw, peak_flops=hw.peak_flops * tensor_parallel, mem_bandwidth=hw.mem_bandwidth * tensor_parallel
        )
        self.model = replace(model, hardware=group)
        self.schedule = schedule
        self.sync_s = 0.0 if tensor_parallel == 1 else 2 * model.shape.num_layers * allreduce_s

    def decode_s(self, cached: torch.Tensor, live: torch.Tensor) -> float:
        """Seconds of decode steps: ``cached [T, B]`` tokens in each row's cache after the step, ``live [T, B]``
        which rows run (the others are padding)."""
        read, scored = self.model.sparse_reads(cached, self.schedule)
        cost = self.model.step_cost(cached, read, scored, live)
        return float(cost.total_s.sum()) + self.sync_s * cached.shape[0]

    def prefill_s(self, tokens: int, cached_before: int) -> float:
        """Seconds of a dense forward of ``tokens`` tokens after ``cached_before`` cached ones (prefill, recompute)."""
        return self.model.prefill_seconds(tokens, cached_before) + self.sync_s


@dataclass
class DryRun:
    """One simulated rollout of one engine.

    Attributes:
        seconds: decode + prefill; decode_s, prefill_s: their parts (recomputes are prefill).
        decode_steps: batched decode steps; preemptions, recomputed_tokens: the scheduler's.
        peak_pages: the most pages held; mean_batch: running rows per decode step on average.
        tokens: response tokens generated.
    """

    seconds: float
    decode_s: float
    prefill_s: float
    decode_steps: int
    preemptions: int
    recomputed_tokens: int
    peak_pages: int
    mean_batch: float
    tokens: int


def simulate(
    lengths: Sequence[int],
    prompt_len: int,
    group: int,
    pricer: StepPricer,
    page_size: int,
    capacity_pages: int | None,
    max_running: int,
) -> DryRun:
    """Replay the engine's scheduler over requests whose responses end at ``lengths`` (see the module docstring).

    Args:
        lengths: response length of each request (tokens); consecutive blocks of ``group`` share a prompt.
        prompt_len: tokens of every prompt; pricer: the step prices; page_size: tokens per KV page.
        capacity_pages: the KV pool, pages; None: enough for every request at once (no memory limit).
        max_running: the most sequences running at once.
    """
    seqs = [Seq(i, i // group, prompt_len, max(1, n)) for i, n in enumerate(lengths)]
    if capacity_pages is None:  # every request and prompt at its full length, above the watermark
        capacity_pages = 2 * sum(pages_for(prompt_len + s.max_new + 1, page_size) for s in seqs) + 2
        max_running = len(seqs)
    scheduler = Scheduler(BlockManager(capacity_pages, page_size), max_running)
    scheduler.add(seqs)
    segments: list[tuple[list[int], int]] = []  # (cached lengths after the first step, steps) per stretch
    prefill = 0.0
    recomputed = 0
    while not scheduler.done:
        for a in scheduler.admit():
            if not a.prefix.computed:
                prefill += pricer.prefill_s(prompt_len, 0)
                a.prefix.computed = True
            redo = max(a.seq.num_generated - 1, 0)
            if redo:
                prefill += pricer.prefill_s(redo, prompt_len)
                recomputed += redo
            a.seq.cached = a.seq.target_cached
            if a.seq.num_generated == 0:  # the first token comes from the prefill's logits
                a.seq.response.append(0)
                if a.seq.remaining == 0:
                    scheduler.finish(a.seq)
        if not scheduler.running:
            continue
        steps = _quiet_steps(scheduler)
        scheduler.reserve(lambda s, n=steps: s.cached + n)  # no preemption within a quiet stretch
        segments.append(([s.cached + 1 for s in scheduler.running], steps))
        for s in list(scheduler.running):
            s.cached += steps
            s.response += [0] * steps
            if s.remaining == 0:
                scheduler.finish(s)
    decode = sum(_price(pricer, first, steps) for first, steps in segments)
    total_steps = sum(steps for _, steps in segments)
    batch = sum(len(first) * steps for first, steps in segments) / max(total_steps, 1)
    return DryRun(
        decode + prefill, decode, prefill, total_steps, scheduler.preemptions, recomputed,
        scheduler.blocks.peak_used, batch, sum(max(1, n) for n in lengths),
    )  # fmt: skip


def _quiet_steps(scheduler: Scheduler) -> int:
    """Decode steps the running set can take unchanged: until its first sequence ends and while the free pages
    last (no admission can happen meanwhile: pages only get fewer until something finishes). 1 when the next
    step already needs a preemption (:meth:`Scheduler.reserve` decides it)."""
    running, blocks = scheduler.running, scheduler.blocks

    def need(steps: int) -> int:
        return sum(pages_for(s.cached + steps, blocks.page_size) - len(s.pages) for s in running)

    lo, hi = 1, min(s.remaining for s in running)
    if need(1) > blocks.num_free:
        return 1
    while lo < hi:  # the most steps whose pages fit (need grows with the steps)
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if need(mid) <= blocks.num_free else (lo, mid - 1)
    return lo


def _price(pricer: StepPricer, first: list[int], steps: int) -> float:
    """Seconds of ``steps`` decode steps of rows at cached lengths ``first`` after the first, growing by one."""
    base = torch.tensor(first, dtype=torch.int64)[None, :]
    total = 0.0
    for lo in range(0, steps, PRICE_CHUNK):
        t = torch.arange(lo, min(steps, lo + PRICE_CHUNK), dtype=torch.int64)[:, None]
        total += pricer.decode_s(base + t, torch.ones(t.shape[0], base.shape[1], dtype=torch.int64))
    return total


def simulate_static(
    lengths: Sequence[int],
    prompt_len: int,
    cap: int,
    pricer: StepPricer,
    page_size: int,
    capacity_pages: int,
    max_batch: int,
) -> DryRun:
    """The engine this scheduler replaced: waves of rows decoded in lockstep, KV reserved for prompt + cap per
    row up front, the batch halved until a wave fits the pool; a wave lasts its longest response (finished rows
    stay, at no attention cost) and its prompts are prefilled per row."""
    rows = min(max_batch, len(lengths))
    while rows > 1 and rows * pages_for(prompt_len + cap, page_size) > capacity_pages:
        rows //= 2
    decode = prefill = 0.0
    steps = 0
    batch_sum = 0
    for lo in range(0, len(lengths), rows):
        wave = torch.tensor([max(1, n) for n in lengths[lo : lo + rows]], dtype=torch.int64)
        prefill += pricer.prefill_s(prompt_len * wave.numel(), 0)
        longest = int(wave.max())
        t = torch.arange(1, longest, dtype=torch.int64)[:, None]  # decode steps after the first token
        live = (t < wave[None, :]).to(torch.int64)
        for c in range(0, longest - 1, PRICE_CHUNK):
            part = slice(c, c + PRICE_CHUNK)
            decode += pricer.decode_s(prompt_len + t[part].expand(-1, wave.numel()), live[part])
        steps += longest - 1
        batch_sum += int(live.sum())
    return DryRun(
        decode + prefill, decode, prefill, steps, 0, 0, rows * pages_for(prompt_len + cap, page_size),
        batch_sum / max(steps, 1), sum(max(1, n) for n in lengths),
    )  # fmt: skip
