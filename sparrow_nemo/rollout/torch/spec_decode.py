"""Speculative rounds of the torch rollout engine: sparse drafts, dense verify, inside the continuous-batching loop.

The engine's step loop (:mod:`sparrow_nemo.rollout.torch.generation`) admits and retires sequences between
rounds as it does between plain decode steps; a round, for every running sequence (rows sit at different
lengths and advance by different amounts):

1. k per row from :class:`~sparrow_nemo.rollout.torch.speculative.SpeculativeConfig` for its cached length,
   capped so that the round cannot pass the row's token cap (:meth:`SpeculativeRounds.plan`, before the
   scheduler reserves the round's pages: ``k + 1`` per row, or the widest k + 1 with the kernel verify);
2. draft: k sparse decode steps (the engine's decode step with the draft schedule's budgets, the LoRA adapter on
   when set), batched over the rows still drafting; their keys/values enter the cache as usual;
3. verify: one dense forward of the pending token and the k drafts
   (:func:`~sparrow_nemo.rollout.torch.extend.forward_tokens`, no adapter), which overwrites the drafted
   keys/values with the dense ones;
4. accept (:func:`~sparrow_nemo.rollout.torch.speculative.verify_drafts`): the kept prefix plus one token; the
   tokens go to the response one by one with the stop check after each, exactly as in dense decoding, so a stop
   token or string inside an accepted run ends the response there and drops the rest;
5. rollback: the row's cache keeps old length + accepted + 1 tokens and the landmarks of the pages the round
   wrote are rebuilt from the keys below that (:func:`~sparrow_nemo.rollout.torch.extend.rebuild_landmarks`).

The cache of a speculative sequence is the dense policy's (the verify's keys and values), so a preempted one is
recomputed densely. Draws are position-indexed (:func:`~sparrow_nemo.rollout.sampling.position_uniforms`): the
draft token at response position t uses stream DRAFT at t, its acceptance test ACCEPT at t, and the token a
round emits after its accepted drafts TOKEN at its position, the stream plain decoding uses; so with k = 0 a
round is a dense decode step drawing what dense decoding draws, and a sample's tokens do not depend on its batch
mates. Returned logprobs and top-K are the dense distribution's (the verify logits, temperature 1), the recorded
``kv_budget`` is ``DENSE_BUDGET``, and each sample carries a :class:`DraftLog` of its acceptance tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from sparrow_nemo.rollout.engine import FinishReason, RolloutSample, SamplingParams
from sparrow_nemo.rollout.sampling import (
    ACCEPT,
    DRAFT,
    TOKEN,
    position_uniforms,
    sample_tokens,
    token_logprobs,
)
from sparrow_nemo.rollout.torch.decode_step import DecodeStep
from sparrow_nemo.rollout.torch.extend import TokensAttention, forward_tokens, rebuild_landmarks
from sparrow_nemo.rollout.torch.model_runner import SlotTable
from sparrow_nemo.rollout.torch.paged_cache import PagedKVCache
from sparrow_nemo.rollout.torch.qwen3 import Qwen3Decoder
from sparrow_nemo.rollout.torch.sequence import Sequence as Seq
from sparrow_nemo.rollout.torch.speculative import SpeculativeConfig, verify_drafts
from sparrow_nemo.rollout.torch.stopping import StopRule
from sparrow_nemo.sparse.schedule import DENSE_BUDGET, BudgetSchedule

Finish = tuple[FinishReason, int | str | None]


@dataclass
class DraftLog:
    """One sample's speculative rounds (r of them) and acceptance tests (n: the draft positions whose test ran,
    the accepted ones and each round's first rejection), in order.

    Attributes:
        cached_len: [n] int64 tokens in the cache when the draft token was sampled (as ``RolloutSample.cached_len``).
        alpha: [n] float32 ``sum_v min(p, q)`` of the dense and draft sampling distributions there: the
            probability that the draft token is accepted (the paper's acceptance rate, exact, not top-20).
        accepted: [n] bool.
        budget: [n] int64 the draft's KV budget (tokens) for that token.
        round_len: [r] int64 cached length when a round's first token was sampled (its bin picks k).
        round_k: [r] int64 draft tokens of the round (0 = one dense step); those after a rejection are never tested.
        round_emitted: [r] int64 tokens the round added to the response (accepted + 1, fewer at a stop).
    """

    cached_len: torch.Tensor
    alpha: torch.Tensor
    accepted: torch.Tensor
    budget: torch.Tensor
    round_len: torch.Tensor
    round_k: torch.Tensor
    round_emitted: torch.Tensor

    @property
    def drafted(self) -> int:
        """Draft tokens generated in all."""
        return int(self.round_k.sum())

    @property
    def verifies(self) -> int:
        """Verify passes (rounds; a round with k = 0 is one dense step and counts as one)."""
        return int(self.round_k.numel())


@dataclass
class SpeculativeSample(RolloutSample):
    """A :class:`~sparrow_nemo.rollout.engine.RolloutSample` of a speculative rollout, with its :class:`DraftLog`."""

    draft: DraftLog | None = None


@dataclass
class _Log:
    """What one sample's rounds recorded, in order."""

    records: list[tuple[torch.Tensor, ...]] = field(default_factory=list)  # (lp, top ids, top lp, cached_len)
    tests: list[tuple[torch.Tensor, ...]] = field(
        default_factory=list
    )  # (cached_len, alpha, accepted, budget)
    rounds: list[tuple[int, int, int]] = field(default_factory=list)  # (cached length, k, tokens emitted)

    def fields(self, response: list[int]) -> dict:
        lp, top_ids, top_lp, cached = (torch.cat(c).cpu() for c in zip(*self.records))
        if self.tests:
            tests = [torch.cat(c).cpu() for c in zip(*self.tests)]
        else:
            tests = [torch.empty(0, dtype=dt) for dt in (torch.int64, torch.float32, torch.bool, torch.int64)]
        rounds = torch.tensor(self.rounds, dtype=torch.int64).reshape(-1, 3)
        return {
            "response_ids": torch.tensor(response, dtype=torch.int64),
            "logprobs": lp,
            "top_ids": top_ids,
            "top_logprobs": top_lp,
            "cached_len": cached,
            "kv_budget": torch.full_like(cached, DENSE_BUDGET),
            "draft": DraftLog(
                *tests, round_len=rounds[:, 0], round_k=rounds[:, 1], round_emitted=rounds[:, 2]
            ),
        }


class SpeculativeRounds:
    """The speculative decoder of one generate call (see the module docstring).

    Args:
        model: the decoder; step: the engine's decode step (the draft); verify: the dense verify attention.
        sampling, stop: the request's; schedule: the draft's budgets; spec: k per bin.
        pad_queries: every row's pages reach the widest row's k + 1 (the kernel verify reads ``start + T``).
    """

    def __init__(
        self,
        model: Qwen3Decoder,
        step: DecodeStep,
        verify: TokensAttention,
        sampling: SamplingParams,
        schedule: BudgetSchedule,
        spec: SpeculativeConfig,
        stop: StopRule,
        pad_queries: bool,
    ) -> None:
        self.model, self.step, self.verify = model, step, verify
        self.sampling, self.schedule, self.spec, self.stop = sampling, schedule, spec, stop
        self.pad_queries = pad_queries
        self.topk = min(sampling.logprobs_topk, model.shape.vocab_size)
        self.logs: dict[int, _Log] = {}
        self._k: dict[int, int] = {}
        self._width = 0

    # ----------------------------------------------------------------- the loop's interface
    def first(self, seqs: Sequence[Seq], logits: torch.Tensor) -> list[Finish | None]:
        """The first tokens of fresh ``seqs`` from their prompts' dense ``logits [B, V]``."""
        greedy = self.sampling.temperature == 0
        u = (
            torch.zeros(len(seqs), dtype=torch.float64)
            if greedy
            else position_uniforms([s.seed for s in seqs], [0] * len(seqs), TOKEN)
        )
        tokens = sample_tokens(logits, self.sampling, u)
        cached = torch.tensor([s.prompt_len for s in seqs], device=logits.device)
        for s in seqs:
            self.logs[s.index] = _Log()
        self._record(seqs, logits[:, None], tokens[:, None], torch.ones_like(cached), cached - 1)
        return self._emit(seqs, tokens[:, None].tolist(), [1] * len(seqs))

    def plan(self, seqs: Sequence[Seq]) -> None:
        """k of every running sequence for the coming round (its bin, capped by its remaining tokens)."""
        cached = torch.tensor([s.cached + 1 for s in seqs], dtype=torch.int64)
        ks = self.spec.k_for(cached, self.schedule.bin_tokens).tolist()
        self._k = {s.index: max(0, min(k, s.remaining - 1)) for s, k in zip(seqs, ks)}
        self._width = max(self._k.values(), default=0)

    def tokens_after(self, seq: Seq) -> int:
        """Cache positions the round writes for ``seq``: the pending token and its drafts (the widest row's with
        the kernel verify)."""
        return seq.cached + 1 + (self._width if self.pad_queries else self._k[seq.index])

    def samples(
        self, seqs: Sequence[Seq], prompts: Sequence[torch.Tensor], finished: dict[int, Finish]
    ) -> list[SpeculativeSample]:
        """The results, in ``seqs`` order (every one finished; ``prompts[i]`` is sequence i's prompt)."""
        out = []
        for s, prompt in zip(seqs, prompts):
            reason, matched = finished[s.index]
            fields = self.logs[s.index].fields(s.response)
            out.append(
                SpeculativeSample(prompt_ids=prompt.cpu(), **fields, finish_reason=reason, stop=matched)
            )
        return out

    # ----------------------------------------------------------------- one round
    @torch.no_grad()
    def round(self, cache: PagedKVCache, slots: SlotTable, seqs: Sequence[Seq]) -> list[Finish | None]:
        """One draft / verify / accept round of the running ``seqs`` (pages held for :meth:`tokens_after`);
        their responses and cached lengths advance. Returns each row's finish (None: it goes on)."""
        device = self.model.device
        k_list = [self._k[s.index] for s in seqs]
        width = max(k_list)
        k = torch.tensor(k_list, dtype=torch.int64, device=device)
        cached = torch.tensor([s.cached for s in seqs], dtype=torch.int64, device=device)
        pending = torch.tensor([s.response[-1] for s in seqs], dtype=torch.int64, device=device)
        table = slots.rows(seqs, -(-max(self.tokens_after(s) for s in seqs) // cache.page_size))
        u_draft, u_accept, u_final = self._uniforms(seqs, k_list, width)
        drafts, draft_logits, budgets = self._draft(cache, table, cached, pending, k, width, u_draft)
        tokens = torch.cat([pending[:, None], drafts], dim=1)  # [b, width + 1]
        valid = torch.arange(width + 1, device=device)[None, :] <= k[:, None]
        adapter, self.model.lora = self.model.lora, None  # the verify is the dense policy's
        try:
            dense = forward_tokens(self.model, self.verify, cache, table, tokens, cached, valid)
        finally:
            self.model.lora = adapter
        verdict = verify_drafts(dense, draft_logits, drafts, k, self.sampling, u_accept, u_final)

        accepted = verdict.accepted.tolist()
        run = torch.cat([drafts, verdict.next_token[:, None]], dim=1)  # accepted drafts, then the new token
        run[torch.arange(len(seqs)), verdict.accepted] = verdict.next_token
        starts = [s.num_generated for s in seqs]
        finishes = self._emit(seqs, run.tolist(), [a + 1 for a in accepted])
        emitted = [s.num_generated - n for s, n in zip(seqs, starts)]
        self._record(seqs, dense, run, torch.tensor(emitted, device=device), cached)
        positions = cached[:, None] + 1 + torch.arange(width, device=device)[None, :]
        is_accepted = torch.arange(width, device=device)[None, :] < verdict.accepted[:, None]
        counts = verdict.tested.sum(dim=1).tolist()  # each row's tests, split out of one masked selection
        parts = [
            f[verdict.tested].split(counts) for f in (positions, verdict.alpha.float(), is_accepted, budgets)
        ]
        for b, s in enumerate(seqs):
            log = self.logs[s.index]
            log.tests.append(tuple(part[b] for part in parts))
            log.rounds.append((int(cached[b]) + 1, k_list[b], emitted[b]))
        new_cached = cached + verdict.accepted + 1
        going = torch.tensor([f is None for f in finishes], device=device)
        if bool(going.any()):
            rebuild_landmarks(cache, table[going], cached[going], new_cached[going])
        for s, c in zip(seqs, new_cached.tolist()):
            s.cached = c
        return finishes

    def _uniforms(self, seqs: Sequence[Seq], k: list[int], width: int) -> tuple[torch.Tensor, ...]:
        """A round's draws by position (zeros when greedy): draft and accept ``[b, width]`` (zeros past a row's k),
        and the emitted token's ``[b, width + 1]`` (column j: after j accepted drafts)."""
        b = len(seqs)
        if self.sampling.temperature == 0:
            zeros = torch.zeros(b, width + 1, dtype=torch.float64)
            return zeros[:, :width], zeros[:, :width], zeros
        seeds = [s.seed for s in seqs for _ in range(width + 1)]
        pos = [s.num_generated + j for s in seqs for j in range(width + 1)]
        grid = [position_uniforms(seeds, pos, stream).view(b, width + 1) for stream in (DRAFT, ACCEPT, TOKEN)]
        live = torch.arange(width)[None, :] < torch.tensor(k)[:, None]
        return grid[0][:, :width] * live, grid[1][:, :width] * live, grid[2]

    def _draft(
        self,
        cache: PagedKVCache,
        table: torch.Tensor,
        cached: torch.Tensor,
        pending: torch.Tensor,
        k: torch.Tensor,
        width: int,
        uniforms: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``width`` sparse steps over the rows still drafting, draft token j of row b drawn with ``uniforms
        [b, width]`` -> (drafts [b, width] int64, their logits [b, width, V] fp32, the draft budgets [b, width]
        int64); entries past a row's k are 0."""
        b, device = cached.shape[0], cached.device
        drafts = torch.zeros(b, width, dtype=torch.int64, device=device)
        logits = torch.zeros(b, width, self.model.shape.vocab_size, dtype=torch.float32, device=device)
        budgets = torch.zeros(b, width, dtype=torch.int64, device=device)
        every = int(k.min()) if b else 0  # steps that every row takes (no row selection needed)
        feed = pending
        for j in range(width):
            sub = slice(None) if j < every else torch.nonzero(k > j)[:, 0]
            seq = cached[sub] + j + 1
            budget = None if self.schedule.is_dense else self.schedule.budgets_for(seq)
            lg = self.step(cache, table[sub], feed[sub], seq, budget)
            drafts[sub, j] = sample_tokens(lg, self.sampling, uniforms[sub, j])
            logits[sub, j] = lg
            budgets[sub, j] = torch.full_like(seq, DENSE_BUDGET) if budget is None else budget
            feed = drafts[:, j]
        return drafts, logits, budgets

    # ----------------------------------------------------------------- bookkeeping
    def _emit(self, seqs: Sequence[Seq], runs: list[list[int]], lengths: list[int]) -> list[Finish | None]:
        """Append each row's run (its first ``lengths[b]`` tokens) to its response one token at a time with the
        stop check after each; a stop ends the response there."""
        finishes: list[Finish | None] = []
        for s, run, n in zip(seqs, runs, lengths):
            done = None
            for token in run[:n]:
                s.response.append(token)
                done = self.stop.check(s.response, s.max_new)
                if done is not None:
                    break
            finishes.append(done)
        return finishes

    def _record(
        self,
        seqs: Sequence[Seq],
        logits: torch.Tensor,
        tokens: torch.Tensor,
        counts: torch.Tensor,
        cached: torch.Tensor,
    ) -> None:
        """Logprobs and top-K of the first ``counts[b]`` tokens of ``tokens [b, T]`` under the dense ``logits
        [b, T, V]``; token i of row b was sampled with ``cached[b] + 1 + i`` tokens in the cache."""
        width = tokens.shape[1]
        take = torch.arange(width, device=tokens.device)[None, :] < counts[:, None]
        b_idx, i_idx = torch.nonzero(take, as_tuple=True)
        lp, top_ids, top_lp = token_logprobs(logits[b_idx, i_idx], tokens[b_idx, i_idx], self.topk)
        parts = counts.tolist()  # b_idx is sorted: row b's tokens are the next parts[b] entries
        cached_len = cached[b_idx] + 1 + i_idx
        for s, chunk in zip(seqs, zip(*(t.split(parts) for t in (lp, top_ids, top_lp, cached_len)))):
            if chunk[0].numel():
                self.logs[s.index].records.append(chunk)
