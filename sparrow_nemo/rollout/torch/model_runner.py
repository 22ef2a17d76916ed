"""The tensor side of the engine's step loop: block-table rows, prefill, recompute, decode and sampling.

The scheduler (:mod:`sparrow_nemo.rollout.torch.scheduler`) decides, in page numbers, who runs; the runner does
it on the device:

- :class:`SlotTable`: a running sequence owns a row (*slot*) of a device block table ``[slots, max_pages]``
  int32; pages a sequence gains are written into its row before the step that reads them (only the new
  entries); CUDA-graph padding rows read the pool's scratch page;
- :meth:`ModelRunner.prefill`: new prompt prefixes, each distinct prompt once (GRPO groups), dense and chunked,
  into the prefix's pages; their last hidden state is kept for the first tokens of the prefix's samples;
- :meth:`ModelRunner.fill`: an admitted sequence's cache: its copy of the prefix's tail page, and for a
  preempted one the recompute of its response so far (:func:`~sparrow_nemo.rollout.torch.extend.forward_tokens`
  with each token's own attention rule: sparse with the budget it was decoded with, or dense), so the cache
  holds what decoding had written and its next tokens are the ones it would have sampled;
- :meth:`ModelRunner.decode`: one decode step of the running rows and their next tokens, eagerly or from a
  bucketed CUDA graph (:mod:`sparrow_nemo.rollout.torch.cuda_graphs`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from sparrow_nemo.rollout.engine import SamplingParams
from sparrow_nemo.rollout.sampling import TOKEN, injection_mix, position_uniforms
from sparrow_nemo.rollout.torch.block_manager import Prefix
from sparrow_nemo.rollout.torch.cuda_graphs import DecodeGraphs, StepOutput, sample_step
from sparrow_nemo.rollout.torch.decode_step import DecodeStep
from sparrow_nemo.rollout.torch.extend import DecodeRule, TokensAttention, forward_tokens, rebuild_landmarks
from sparrow_nemo.rollout.torch.paged_attention import causal_attention
from sparrow_nemo.rollout.torch.paged_cache import PagedKVCache
from sparrow_nemo.rollout.torch.sequence import Sequence as Seq
from sparrow_nemo.sparse.schedule import BudgetSchedule


class SlotTable:
    """Device block-table rows of the running sequences (see the module docstring).

    Args:
        slots: the most sequences running at once; max_pages: pages one sequence may hold; scratch: the
            scratch page (no sequence holds it; padding rows read it); device: where the table lives.
    """

    def __init__(self, slots: int, max_pages: int, scratch: int, device: torch.device) -> None:
        self.table = torch.full((slots, max_pages), -1, dtype=torch.int32, device=device)
        self.scratch = scratch
        self._free = list(range(slots - 1, -1, -1))
        self._synced: dict[int, int] = {}

    def assign(self, seq: Seq) -> None:
        """Give ``seq`` a free row (its pages are written at the next :meth:`sync`)."""
        seq.slot = self._free.pop()
        self._synced[seq.slot] = 0

    def release(self, seq: Seq) -> None:
        """``seq`` left the running set: its row is free again."""
        if seq.slot >= 0:
            self._synced.pop(seq.slot)
            self._free.append(seq.slot)
            seq.slot = -1

    def sync(self, seqs: Sequence[Seq]) -> None:
        """Write the pages ``seqs`` gained since their last sync into their rows (one scatter)."""
        slots, cols, pages = [], [], []
        synced, width = self._synced, self.table.shape[1]
        for seq in seqs:
            done = synced[seq.slot]
            if len(seq.pages) > done:
                if len(seq.pages) > width:
                    raise ValueError(
                        f"sample {seq.index} holds {len(seq.pages)} pages; the block table has {width} columns"
                    )
                new = seq.pages[done:]
                slots += [seq.slot] * len(new)
                cols += range(done, done + len(new))
                pages += new
                synced[seq.slot] = len(seq.pages)
        if pages:
            idx = torch.tensor([slots, cols], dtype=torch.int64)
            self.table.index_put_(
                tuple(idx.to(self.table.device)),
                torch.tensor(pages, dtype=torch.int32, device=self.table.device),
            )

    def rows(self, seqs: Sequence[Seq], pages: int) -> torch.Tensor:
        """The rows of ``seqs`` [B, pages] (their first ``pages`` columns), synced first."""
        self.sync(seqs)
        slots = torch.tensor([s.slot for s in seqs], dtype=torch.int64, device=self.table.device)
        return self.table[:, :pages].index_select(0, slots)


class ModelRunner:
    """Prefill, recompute and decode of one engine (see the module docstring).

    Args:
        step: the engine's decode step (model, attention backend, dense layers, sink and local pages).
        dense_attention: causal attention of several tokens per row over the cache (the verify's).
        prefill_chunk_tokens: prompt positions per prefill chunk (None: whole prompts).
        graphs: the bucketed decode graphs (CUDA), or None for eager steps.
    """

    def __init__(
        self,
        step: DecodeStep,
        dense_attention: TokensAttention,
        prefill_chunk_tokens: int | None,
        graphs: DecodeGraphs | None,
    ) -> None:
        self.step = step
        self.dense_attention = dense_attention
        self.model = step.model
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.graphs = graphs
        self.last_hidden: dict[int, torch.Tensor] = {}  # prompt id -> [hidden] after its last token

    # ----------------------------------------------------------------- prefill and recompute
    def prefill(
        self, cache: PagedKVCache, prefixes: Sequence[Prefix], prompts: Sequence[torch.Tensor]
    ) -> None:
        """Dense prefill of ``prefixes`` (``prompts[i]``: the token ids of prefix i's prompt) into their pages."""
        device = self.model.device
        lengths = torch.tensor([p.prompt_len for p in prefixes], dtype=torch.int64, device=device)
        width = max(len(p.pages) for p in prefixes)
        table = torch.tensor(
            [p.pages + [-1] * (width - len(p.pages)) for p in prefixes], dtype=torch.int32, device=device
        )
        ids = torch.zeros(len(prefixes), int(lengths.max()), dtype=torch.int64, device=device)
        for b, tokens in enumerate(prompts):
            ids[b, : tokens.numel()] = tokens
        last = torch.empty(len(prefixes), self.model.shape.hidden_size, dtype=self.model.dtype, device=device)

        def keep_last(start: int, h: torch.Tensor) -> None:
            ends = (lengths - 1 >= start) & (lengths - 1 < start + h.shape[1])
            last[ends] = h[ends, (lengths - 1 - start)[ends]]

        self.dense_prefill(cache, table, ids, lengths, keep_last)
        for b, prefix in enumerate(prefixes):
            self.last_hidden[prefix.prompt_id] = last[b]
            prefix.computed = True

    def dense_prefill(
        self,
        cache: PagedKVCache,
        block_table: torch.Tensor,
        ids: torch.Tensor,
        lengths: torch.Tensor,
        emit: Callable[[int, torch.Tensor], None],
    ) -> None:
        """Dense causal forward of right-padded ``ids [B, T]`` into the cache (pages held), in chunks of
        ``prefill_chunk_tokens`` positions (each attends to everything cached before it); ``emit(start, h)``
        receives each chunk's final hidden states ``h [B, chunk, hidden]`` (rows past a length are padding)."""
        t = ids.shape[1]
        chunk = self.prefill_chunk_tokens or t
        model = self.model
        for start in range(0, t, chunk):
            end = min(t, start + chunk)
            positions = torch.arange(start, end, device=ids.device)[None, :].expand(ids.shape[0], -1)
            h = model.embed(ids[:, start:end])
            rope = model.rope(positions, h.dtype)
            for layer in range(model.shape.num_layers):
                q, k, v = model.attention_inputs(layer, h, positions, rope)
                cache.write_prefill(layer, block_table, k, v, lengths, start=start)
                k_all, v_all = cache.contiguous(layer, block_table, lengths.clamp(max=end))  # [B, Hkv, L, D]
                attn = causal_attention(q, k_all.transpose(1, 2), v_all.transpose(1, 2), q_offset=start)
                h = model.attention_output(layer, h, attn)
            emit(start, h)

    def fill(
        self,
        cache: PagedKVCache,
        slots: SlotTable,
        admitted: Sequence[tuple[Seq, Prefix]],
        schedule: BudgetSchedule,
    ) -> None:
        """The caches of newly admitted sequences, up to their ``target_cached`` tokens: the tail copies, then
        the recompute of preempted ones' responses (each token with the budget ``schedule`` gave it; dense
        for a dense schedule)."""
        ps = cache.page_size
        copies = [
            (prefix.tail, seq.pages[prefix.prompt_len // ps])
            for seq, prefix in admitted
            if prefix.tail is not None
        ]
        cache.copy_pages([s for s, _ in copies], [d for _, d in copies])
        redo = [seq for seq, _ in admitted if seq.num_generated > 1]
        for seq, _ in admitted:
            slots.assign(seq)
            seq.cached = seq.prompt_len
        if redo:
            self._recompute(cache, slots, redo, schedule)

    def _recompute(
        self, cache: PagedKVCache, slots: SlotTable, seqs: list[Seq], schedule: BudgetSchedule
    ) -> None:
        """Feed response tokens ``0 .. n - 2`` of each of ``seqs`` (preempted; its prompt is cached) at positions
        ``P .. P + n - 2``, one sequence at a time in chunks of ``prefill_chunk_tokens``, each token with the rule
        it was decoded with (a sequence is rare: only a preemption brings it here)."""
        device = self.model.device
        for seq in seqs:
            chunk = self.prefill_chunk_tokens or seq.target_cached
            while seq.cached < seq.target_cached:
                count = min(chunk, seq.target_cached - seq.cached)
                first = seq.cached - seq.prompt_len
                tokens = torch.tensor([seq.response[first : first + count]], dtype=torch.int64, device=device)
                start = torch.tensor([seq.cached], dtype=torch.int64, device=device)
                positions = seq.cached + torch.arange(count, device=device)
                budgets = None if schedule.is_dense else schedule.budgets_for(positions + 1)[None, :]
                rule = DecodeRule(
                    self.step.attention,
                    self.dense_attention,
                    budgets,
                    self.step.dense_layers,
                    self.step.sink_pages,
                    self.step.local_pages,
                )
                table = slots.rows([seq], math.ceil((seq.cached + count) / cache.page_size))
                valid = torch.ones(1, count, dtype=torch.bool, device=device)
                forward_tokens(self.model, rule, cache, table, tokens, start, valid, logits=False)
                rebuild_landmarks(cache, table, start, start + count)  # every layer's, dense ones included
                seq.cached += count

    def first_logits(self, prompt_ids: Sequence[int]) -> torch.Tensor:
        """Next-token logits after each prompt (its prefix's kept last hidden state): [B, V] fp32."""
        return self.model.logits(torch.stack([self.last_hidden[p] for p in prompt_ids]))

    # ----------------------------------------------------------------- decode
    def decode(
        self,
        cache: PagedKVCache,
        slots: SlotTable,
        seqs: Sequence[Seq],
        schedule: BudgetSchedule,
        sampling: SamplingParams,
        topk: int,
    ) -> StepOutput:
        """One decode step of ``seqs`` (their pending tokens enter the cache, pages held) and their next tokens,
        drawn with each sequence's uniform for its next response position."""
        device = self.model.device
        lengths = [s.cached + 1 for s in seqs]
        seq_len = torch.tensor(lengths, dtype=torch.int64, device=device)
        tokens = torch.tensor([s.response[-1] for s in seqs], dtype=torch.int64, device=device)
        seeds, positions = [s.seed for s in seqs], [len(s.response) for s in seqs]
        uniforms = position_uniforms(seeds, positions, TOKEN)
        mix = injection_mix(sampling.inject_mismatch, seeds, positions, device)
        pages = -(-max(lengths) // cache.page_size)
        if self.graphs is not None:
            table = slots.rows(seqs, pages)
            return self.graphs.run(
                table, tokens, seq_len, uniforms, schedule.is_dense, sampling, topk, slots.scratch, mix
            )
        table = slots.rows(seqs, pages)
        budgets = None if schedule.is_dense else schedule.budgets_for(seq_len)
        logits = self.step(cache, table, tokens, seq_len, budgets)
        return sample_step(logits, sampling, uniforms, topk, seq_len, budgets, mix)
