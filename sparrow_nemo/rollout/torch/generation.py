"""One generate call of the torch engine: the continuous-batching step loop.

Each iteration: the scheduler admits waiting sequences as pages allow (:meth:`Scheduler.admit`); new prompt
prefixes are prefilled once per distinct prompt and the admitted sequences' caches filled (tail copies, the
recompute of preempted ones); fresh sequences sample their first token from their prompt's logits; then the
running sequences get their next step's pages (:meth:`Scheduler.reserve`, preempting the newest when short) and
take one step together: a decode step (:class:`PlainDecode`: one token each, the schedule's per-row budgets)
or a speculative round (:class:`~sparrow_nemo.rollout.torch.spec_decode.SpeculativeRounds`). Finished sequences
leave at once and free their pages. :class:`LoopStats` counts what the loop did.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from sparrow_nemo.rollout.engine import RolloutSample, SamplingParams, TokenTally
from sparrow_nemo.rollout.sampling import TOKEN, injection_mix, position_uniforms
from sparrow_nemo.rollout.torch.block_manager import BlockManager
from sparrow_nemo.rollout.torch.cuda_graphs import sample_step
from sparrow_nemo.rollout.torch.model_runner import ModelRunner, SlotTable
from sparrow_nemo.rollout.torch.paged_cache import PagedKVCache
from sparrow_nemo.rollout.torch.recorder import StepRecorder
from sparrow_nemo.rollout.torch.scheduler import Scheduler
from sparrow_nemo.rollout.torch.sequence import Sequence as Seq
from sparrow_nemo.rollout.torch.spec_decode import Finish
from sparrow_nemo.rollout.torch.stopping import StopRule
from sparrow_nemo.sparse.schedule import BudgetSchedule


class Decoder(Protocol):
    """What the loop needs from a way of decoding (:class:`PlainDecode`, ``SpeculativeRounds``)."""

    def first(self, seqs: Sequence[Seq], logits: torch.Tensor) -> list[Finish | None]: ...

    def plan(self, seqs: Sequence[Seq]) -> None: ...

    def tokens_after(self, seq: Seq) -> int: ...

    def round(self, cache: PagedKVCache, slots: SlotTable, seqs: Sequence[Seq]) -> list[Finish | None]: ...

    def samples(
        self, seqs: Sequence[Seq], prompts: Sequence[torch.Tensor], finished: dict[int, Finish]
    ) -> list[RolloutSample]: ...


class PlainDecode:
    """Sparse (or dense) decoding: one token per running sequence per step under ``schedule``.

    Args:
        runner: the engine's model runner; schedule, sampling, stop: the request's; samples: sequences in the call.
    """

    def __init__(
        self,
        runner: ModelRunner,
        schedule: BudgetSchedule,
        sampling: SamplingParams,
        stop: StopRule,
        samples: int,
    ) -> None:
        self.runner, self.schedule, self.sampling, self.stop = runner, schedule, sampling, stop
        self.topk = min(sampling.logprobs_topk, runner.model.shape.vocab_size)
        self.recorder = StepRecorder(samples)

    def first(self, seqs: Sequence[Seq], logits: torch.Tensor) -> list[Finish | None]:
        """First tokens of fresh ``seqs`` from their prompts' ``logits [B, V]`` (dense prefill)."""
        seeds, positions = [s.seed for s in seqs], [0] * len(seqs)
        uniforms = position_uniforms(seeds, positions, TOKEN)
        mix = injection_mix(self.sampling.inject_mismatch, seeds, positions, logits.device)
        cached = torch.tensor([s.prompt_len for s in seqs], dtype=torch.int64, device=logits.device)
        step = sample_step(logits, self.sampling, uniforms, self.topk, cached, None, mix)
        return self._take(seqs, step, cached)

    def plan(self, seqs: Sequence[Seq]) -> None:
        """Nothing to plan: every sequence takes one token."""

    def tokens_after(self, seq: Seq) -> int:
        """The step writes the pending token."""
        return seq.cached + 1

    def round(self, cache: PagedKVCache, slots: SlotTable, seqs: Sequence[Seq]) -> list[Finish | None]:
        """One decode step of ``seqs``."""
        out = self.runner.decode(cache, slots, seqs, self.schedule, self.sampling, self.topk)
        cached = torch.tensor([s.cached + 1 for s in seqs], dtype=torch.int64, device=out.tokens.device)
        for s in seqs:
            s.cached += 1
        return self._take(seqs, out, cached)

    def _take(self, seqs: Sequence[Seq], out, cached: torch.Tensor) -> list[Finish | None]:
        """Record a step's tokens and append them, with the stop check."""
        index = torch.tensor([s.index for s in seqs], dtype=torch.int64, device=out.tokens.device)
        self.recorder.add(index, out.tokens, out.logprobs, out.top_ids, out.top_logprobs, cached, out.budgets)
        finishes = []
        for s, token in zip(seqs, out.tokens.tolist()):
            s.response.append(token)
            finishes.append(self.stop.check(s.response, s.max_new))
        return finishes

    def samples(
        self, seqs: Sequence[Seq], prompts: Sequence[torch.Tensor], finished: dict[int, Finish]
    ) -> list[RolloutSample]:
        """The results in ``seqs`` order."""
        out = []
        for s, fields in zip(seqs, self.recorder.per_sample()):
            reason, matched = finished[s.index]
            out.append(
                RolloutSample(prompt_ids=prompts[s.index].cpu(), **fields, finish_reason=reason, stop=matched)
            )
        return out


@dataclass
class LoopStats:
    """What one generate call's loop did.

    Attributes:
        decode_steps: decode steps (or speculative rounds) of the running batch.
        preemptions: sequences that lost their pages and were recomputed later.
        recomputed_tokens: response tokens fed again after a preemption.
        peak_pages: the most KV pages held at once (prompt prefixes included).
        capacity_pages: the pages the pool holds for sequences.
        prefill_s, decode_s: wall seconds of admissions (prefill, recompute, first tokens) and of steps.
    """

    decode_steps: int = 0
    preemptions: int = 0
    recomputed_tokens: int = 0
    peak_pages: int = 0
    capacity_pages: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0


def run_loop(
    runner: ModelRunner,
    cache: PagedKVCache,
    seqs: list[Seq],
    prompts: Sequence[torch.Tensor],
    decoder: Decoder,
    fill_schedule: BudgetSchedule,
    max_running: int,
    lookahead: int,
    dense_cache: bool,
    tally: TokenTally,
    now: Callable[[], float],
) -> tuple[list[RolloutSample], LoopStats]:
    """Generate every sequence of ``seqs`` to its end (see the module docstring).

    Args:
        runner, cache: the engine's model runner and page pools (the last page is the scratch page).
        seqs: one per sample, ``seqs[i].index == i``; prompts: ``prompts[i]`` the token ids of sample i's prompt.
        decoder: how the running batch steps; fill_schedule: the budgets a preempted sequence's tokens are
            recomputed with. max_running: the most sequences that run at once; lookahead: positions a step may
            write past a sequence's cap (a speculative round's padded drafts).
        dense_cache: prefill and recompute without the LoRA adapter (a speculative cache is the dense policy's).
        tally: progress; now: a clock that waits for the device.
    """
    blocks = BlockManager(cache.num_pages - 1, cache.page_size)
    scheduler = Scheduler(blocks, max_running)
    max_tokens = max(s.prompt_len + s.max_new for s in seqs) + 1 + lookahead
    slots = SlotTable(
        max_running, -(-max_tokens // cache.page_size), cache.num_pages - 1, cache.k_pages[0].device
    )
    stats = LoopStats(capacity_pages=blocks.num_pages)
    finished: dict[int, Finish] = {}
    model = runner.model
    group_prompt = {s.prompt_id: prompts[s.index] for s in reversed(seqs)}  # a group's first sample's prompt

    def retire(batch: Sequence[Seq], finishes: Sequence[Finish | None]) -> None:
        for s, f in zip(batch, finishes):
            if f is not None:
                finished[s.index] = f
                scheduler.finish(s)
                slots.release(s)

    scheduler.add(seqs)
    while not scheduler.done:
        admitted = scheduler.admit()
        if admitted:
            t0 = now()
            adapter = model.lora
            if dense_cache:
                model.lora = None
            try:
                new = {a.prefix.prompt_id: a.prefix for a in admitted if not a.prefix.computed}
                if new:
                    runner.prefill(cache, list(new.values()), [group_prompt[p] for p in new])
                stats.recomputed_tokens += sum(max(a.seq.num_generated - 1, 0) for a in admitted)
                runner.fill(cache, slots, [(a.seq, a.prefix) for a in admitted], fill_schedule)
            finally:
                model.lora = adapter
            fresh = [a.seq for a in admitted if a.seq.num_generated == 0]
            if fresh:
                retire(fresh, decoder.first(fresh, runner.first_logits([s.prompt_id for s in fresh])))
                tally.add(len(fresh))
            stats.prefill_s += now() - t0
        if not scheduler.running:
            continue
        decoder.plan(scheduler.running)
        for s in scheduler.reserve(decoder.tokens_after):
            slots.release(s)
        batch = list(scheduler.running)
        t0 = now()
        before = sum(s.num_generated for s in batch)
        finishes = decoder.round(cache, slots, batch)
        tally.add(sum(s.num_generated for s in batch) - before)
        retire(batch, finishes)
        stats.decode_steps += 1
        stats.decode_s += now() - t0
    if blocks.num_used:  # every page must have come back (sequences finished, prefixes dropped)
        raise RuntimeError(
            f"rollout loop: {blocks.num_used} KV pages still held after every sequence finished"
        )
    stats.preemptions = scheduler.preemptions
    stats.peak_pages = blocks.peak_used
    return decoder.samples(seqs, prompts, finished), stats


def now_fn(device: torch.device) -> Callable[[], float]:
    """A wall clock that first waits for ``device`` (CUDA work is asynchronous)."""

    def now() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    return now
