"""The speculative decode loop of the torch rollout engine (after the prefill of one wave).

One round for every live row (rows are at different lengths and advance by different amounts):

1. k per row from :class:`~sparrow_nemo.rollout.torch.speculative.SpeculativeConfig` for its cached length, capped
   so that the round cannot pass the row's token cap;
2. draft: k sparse decode steps (the engine's :class:`~sparrow_nemo.rollout.torch.decode_step.DecodeStep` with the
   draft schedule's budgets, the LoRA adapter on when set), batched over the rows still drafting, each draft
   token drawn from the row's own generator; their keys/values enter the cache as usual;
3. verify: one dense forward of the pending token and the k drafts (:func:`~sparrow_nemo.rollout.torch.spec_verify.verify_forward`,
   no adapter), which overwrites the drafted keys/values with the dense ones;
4. accept (:func:`~sparrow_nemo.rollout.torch.speculative.verify_drafts`): the kept prefix plus one token; the
   tokens go to the response one by one with the stop check after each, exactly as in dense decoding, so a stop
   token or string inside an accepted run ends the response there and drops the rest;
5. rollback: the row's length becomes old length + accepted + 1 and the landmarks (centroids or key bounds)
   of the pages the round wrote are rebuilt from the keys below it (:func:`~sparrow_nemo.rollout.torch.spec_verify.rebuild_landmarks`).
   Finished rows leave the batch and free their pages.

Returned logprobs and top-K are the dense distribution's (the verify logits, temperature 1), the recorded
``kv_budget`` is ``DENSE_BUDGET`` (every token is dense-distributed), and each sample carries a
:class:`DraftLog` of its acceptance tests. Per-sample draws: k for the drafts, then k acceptance uniforms and
one for the emitted token per round (none when greedy), all from the sample's generator, so a sample's tokens
do not depend on its batch mates. With k = 0 everywhere a round is one dense step drawing one uniform, and the
tokens equal dense decoding's for the same seeds (up to float rounding).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sparrow_nemo.rollout.engine import FinishReason, RolloutSample, SamplingParams, TokenTally
from sparrow_nemo.rollout.sampling import draw_uniforms, sample_tokens, token_logprobs
from sparrow_nemo.rollout.torch.decode_step import DecodeStep
from sparrow_nemo.rollout.torch.paged_cache import PagedKVCache
from sparrow_nemo.rollout.torch.qwen3 import Qwen3Decoder
from sparrow_nemo.rollout.torch.spec_verify import VerifyAttention, rebuild_landmarks, verify_forward
from sparrow_nemo.rollout.torch.speculative import (
    SpeculativeConfig,
    draw_round_uniforms,
    verify_drafts,
)
from sparrow_nemo.rollout.torch.stopping import StopRule
from sparrow_nemo.sparse.schedule import DENSE_BUDGET, BudgetSchedule


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


class _Sample:
    """Host-side bookkeeping of one sample while it decodes."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.records: list[tuple[torch.Tensor, ...]] = []  # (lp, top ids, top lp, cached_len) per chunk
        self.tests: list[tuple[torch.Tensor, ...]] = []  # (cached_len, alpha, accepted, budget) per round
        self.rounds: list[tuple[int, int, int]] = []  # (cached length, k, tokens emitted) per round
        self.finish: tuple[FinishReason, int | str | None] | None = None

    def fields(self) -> dict[str, torch.Tensor]:
        lp, top_ids, top_lp, cached = (torch.cat(c).cpu() for c in zip(*self.records))
        if self.tests:
            tests = [torch.cat(c).cpu() for c in zip(*self.tests)]
        else:
            tests = [torch.empty(0, dtype=dt) for dt in (torch.int64, torch.float32, torch.bool, torch.int64)]
        rounds = torch.tensor(self.rounds, dtype=torch.int64).reshape(-1, 3)
        return {
            "response_ids": torch.tensor(self.tokens, dtype=torch.int64),
            "logprobs": lp,
            "top_ids": top_ids,
            "top_logprobs": top_lp,
            "cached_len": cached,
            "kv_budget": torch.full_like(cached, DENSE_BUDGET),
            "draft": DraftLog(
                *tests, round_len=rounds[:, 0], round_k=rounds[:, 1], round_emitted=rounds[:, 2]
            ),
        }


@dataclass
class SpeculativeDecoder:
    """Runs the rounds of one wave (see the module docstring).

    Attributes:
        model: the decoder; step: the engine's decode step (the draft); verify: the verify attention backend.
        cache: the engine's paged KV cache; sampling, stop: the request's; schedule: the draft's budgets.
        spec: k per bin; pad_queries: reserve pages up to the widest row's k + 1 for every row (the kernel
            verify reads ``start + T`` tokens of each row).
    """

    model: Qwen3Decoder
    step: DecodeStep
    verify: VerifyAttention
    cache: PagedKVCache
    sampling: SamplingParams
    schedule: BudgetSchedule
    spec: SpeculativeConfig
    stop: StopRule
    pad_queries: bool

    def run(
        self,
        block_table: torch.Tensor,
        cached: torch.Tensor,
        logits: torch.Tensor,
        generators: Sequence[torch.Generator],
        max_new: Sequence[int],
        tally: TokenTally,
    ) -> list[dict]:
        """Decode every row to its end.

        Pages: rows free theirs when they finish (and the live ones on an error), so the caller's
        ``block_table`` must not be released again.

        Args:
            block_table: [B, P] with the prompts' pages (P covers prompt + max_new + the widest k tokens).
            cached: [B] int64 prompt lengths (all cached). logits: [B, V] the prefill's last-position logits.
            generators: one per row. max_new: token cap per row. tally: progress.

        Returns:
            Per row the ``RolloutSample`` fields (``draft`` included) plus ``finish_reason`` and ``stop``.
        """
        batch = cached.shape[0]
        samples = [_Sample() for _ in range(batch)]
        greedy = self.sampling.temperature == 0
        rows = list(range(batch))
        gens = list(generators)
        try:
            u = torch.zeros(batch, dtype=torch.float64) if greedy else draw_uniforms(gens)
            pending = sample_tokens(logits, self.sampling, u)
            self._emit(samples, rows, pending[:, None].tolist(), [1] * batch, max_new)
            self._record(
                samples, rows, logits[:, None], pending[:, None], torch.ones_like(cached), cached - 1
            )
            tally.add(batch)
            while rows:
                keep = [b for b, s in enumerate(rows) if samples[s].finish is None]
                rows, block_table, cached, pending, gens = self._compact(
                    keep, rows, block_table, cached, pending, gens
                )
                if rows:
                    emitted, cached, pending = self._round(
                        samples, rows, block_table, cached, pending, gens, max_new
                    )
                    tally.add(emitted)
        finally:  # finished rows freed their pages as they left; on an error the live ones do here
            self.cache.release(block_table)
        out = []
        for s in samples:
            reason, matched = s.finish
            out.append({**s.fields(), "finish_reason": reason, "stop": matched})
        return out

    # ----------------------------------------------------------------- one round
    def _round(
        self,
        samples: list[_Sample],
        rows: list[int],
        block_table: torch.Tensor,
        cached: torch.Tensor,
        pending: torch.Tensor,
        gens: list[torch.Generator],
        max_new: Sequence[int],
    ) -> tuple[int, torch.Tensor, torch.Tensor]:
        """One draft / verify / accept round of the live ``rows`` -> (tokens emitted, new cached, new pending)."""
        remaining = torch.tensor([max_new[s] - len(samples[s].tokens) for s in rows], device=cached.device)
        k = torch.minimum(self.spec.k_for(cached + 1, self.schedule.bin_tokens), remaining - 1)
        k_list = k.tolist()
        width = max(k_list)
        self.cache.reserve(block_table, cached + (width + 1 if self.pad_queries else k + 1))
        greedy = self.sampling.temperature == 0
        u_draft, u_accept, u_final = draw_round_uniforms(gens, k_list, width, greedy)
        drafts, draft_logits, budgets = self._draft(block_table, cached, pending, k, width, u_draft)
        tokens = torch.cat([pending[:, None], drafts], dim=1)  # [b, width + 1]
        valid = torch.arange(width + 1, device=k.device)[None, :] <= k[:, None]
        dense = verify_forward(self.model, self.verify, self.cache, block_table, tokens, cached, valid)
        verdict = verify_drafts(dense, draft_logits, drafts, k, self.sampling, u_accept, u_final)

        accepted = verdict.accepted.tolist()
        run = torch.cat([drafts, verdict.next_token[:, None]], dim=1)  # accepted drafts, then the new token
        run[torch.arange(len(rows)), verdict.accepted] = verdict.next_token
        emitted = self._emit(samples, rows, run.tolist(), [a + 1 for a in accepted], max_new)
        self._record(samples, rows, dense, run, torch.tensor(emitted, device=cached.device), cached)
        tested = verdict.tested
        positions = cached[:, None] + 1 + torch.arange(width, device=cached.device)[None, :]
        is_accepted = torch.arange(width, device=k.device)[None, :] < verdict.accepted[:, None]
        counts = tested.sum(dim=1).tolist()  # each row's tests, split out of one masked selection per field
        fields = (positions, verdict.alpha.float(), is_accepted, budgets)
        parts = [f[tested].split(counts) for f in fields]
        starts = (cached + 1).tolist()
        for b, s in enumerate(rows):
            samples[s].tests.append(tuple(part[b] for part in parts))
            samples[s].rounds.append((starts[b], k_list[b], emitted[b]))
        new_cached = cached + verdict.accepted + 1
        going = torch.tensor([samples[s].finish is None for s in rows], device=cached.device)
        if bool(going.any()):
            rebuild_landmarks(self.cache, block_table[going], cached[going], new_cached[going])
        return sum(emitted), new_cached, verdict.next_token

    def _draft(
        self,
        block_table: torch.Tensor,
        cached: torch.Tensor,
        pending: torch.Tensor,
        k: torch.Tensor,
        width: int,
        uniforms: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``width`` sparse steps over the rows still drafting, draft token j of row b drawn with
        ``uniforms [b, width]`` -> (drafts [b, width] int64, their logits [b, width, V] fp32, the draft budgets
        [b, width] int64); entries past a row's k are 0."""
        b = cached.shape[0]
        device = cached.device
        drafts = torch.zeros(b, width, dtype=torch.int64, device=device)
        logits = torch.zeros(b, width, self.model.shape.vocab_size, dtype=torch.float32, device=device)
        budgets = torch.zeros(b, width, dtype=torch.int64, device=device)
        every = int(k.min()) if b else 0  # steps that every row takes (no row selection needed)
        feed = pending
        for j in range(width):
            sub = slice(None) if j < every else torch.nonzero(k > j)[:, 0]
            seq = cached[sub] + j + 1
            budget = None if self.schedule.is_dense else self.schedule.budgets_for(seq)
            lg = self.step(self.cache, block_table[sub], feed[sub], seq, budget)
            drafts[sub, j] = sample_tokens(lg, self.sampling, uniforms[sub, j])
            logits[sub, j] = lg
            budgets[sub, j] = torch.full_like(seq, DENSE_BUDGET) if budget is None else budget
            feed = drafts[:, j]
        return drafts, logits, budgets

    # ----------------------------------------------------------------- bookkeeping
    def _emit(
        self,
        samples: list[_Sample],
        rows: list[int],
        runs: list[list[int]],
        lengths: list[int],
        max_new: Sequence[int],
    ) -> list[int]:
        """Append each row's run (its first ``lengths[b]`` tokens) one token at a time with the stop check after
        each; a stop ends the sample there. Returns the tokens taken per row."""
        taken = []
        for s, run, n in zip(rows, runs, lengths):
            sample = samples[s]
            count = 0
            for token in run[:n]:
                sample.tokens.append(token)
                count += 1
                done = self.stop.check(sample.tokens, max_new[s])
                if done is not None:
                    sample.finish = done
                    break
            taken.append(count)
        return taken

    def _record(
        self,
        samples: list[_Sample],
        rows: list[int],
        logits: torch.Tensor,
        tokens: torch.Tensor,
        counts: torch.Tensor,
        cached: torch.Tensor,
    ) -> None:
        """Logprobs and top-K of the first ``counts[b]`` tokens of ``tokens [b, T]`` under the dense
        ``logits [b, T, V]``; token i of row b was sampled with ``cached[b] + 1 + i`` tokens in the cache."""
        width = tokens.shape[1]
        take = torch.arange(width, device=tokens.device)[None, :] < counts[:, None]
        b_idx, i_idx = torch.nonzero(take, as_tuple=True)
        lp, top_ids, top_lp = token_logprobs(
            logits[b_idx, i_idx], tokens[b_idx, i_idx], self.sampling.logprobs_topk
        )
        parts = counts.tolist()  # b_idx is sorted: row b's tokens are the next parts[b] entries
        cached_len = cached[b_idx] + 1 + i_idx
        for s, chunk in zip(rows, zip(*(t.split(parts) for t in (lp, top_ids, top_lp, cached_len)))):
            if chunk[0].numel():
                samples[s].records.append(chunk)

    def _compact(
        self,
        keep: list[int],
        rows: list[int],
        block_table: torch.Tensor,
        cached: torch.Tensor,
        pending: torch.Tensor,
        gens: list[torch.Generator],
    ) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Generator]]:
        """Drop the finished rows (their pages freed); ``keep`` are the positions of the live ones."""
        if len(keep) == len(rows):
            return rows, block_table, cached, pending, gens
        index = torch.tensor(keep, dtype=torch.int64, device=cached.device)
        gone = torch.ones(len(rows), dtype=torch.bool, device=cached.device)
        gone[index] = False
        self.cache.release(block_table[gone])
        return (
            [rows[b] for b in keep],
            block_table.index_select(0, index),
            cached[index],
            pending[index],
            [gens[b] for b in keep],
        )
