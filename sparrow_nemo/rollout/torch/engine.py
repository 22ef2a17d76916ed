"""The torch rollout engine: plain-torch Qwen3 with a paged KV cache and Sparrow sparse decode.

- Prefill is dense (causal attention over the prompt); its keys/values go to the paged cache and
  set each page's landmarks (its mean key, or its key bounds with ``page_score="minmax"``).
- Decode appends one token per live sequence (landmarks updated incrementally), then every layer
  from ``dense_layers`` on attends only to the pages chosen by the method layer's rule (1 sink page,
  2 local pages, top-k by the GQA-averaged query's page score) within the budget the schedule gives for
  that sequence's current cached length. The first ``dense_layers`` layers stay dense.
- Decode loops (``decode_loop``): "compact" checks stops after every token and drops finished
  sequences from the batch (index_select, pages freed); "static" keeps a fixed batch with pages for
  the whole response reserved, checks stops every ``stop_check_every`` tokens and, on CUDA with the
  fused kernels, replays each step from a CUDA graph (``static_decode``). Both give the same tokens.
- On CUDA the fused ``sparrow_kernels`` decode is used when available (see ``choose_backend``).
- ``generate(..., speculative=SpeculativeConfig(...))`` decodes losslessly instead: sparse drafts verified by
  dense forwards (``spec_decode``; its own compact loop, whatever ``decode_loop`` says).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from sparrow_nemo.hf_qwen3 import LoraAdapter, linear_in_out
from sparrow_nemo.model_shapes import Qwen3Shape
from sparrow_nemo.rollout.engine import (
    RolloutBatch,
    RolloutSample,
    SamplingParams,
    ScoredSequence,
    TokenProgress,
    TokenTally,
)
from sparrow_nemo.rollout.sampling import (
    batch_seeds,
    draw_uniforms,
    make_generators,
    sample_tokens,
    token_logprobs,
)
from sparrow_nemo.rollout.torch.decode_step import DecodeStep
from sparrow_nemo.rollout.torch.paged_attention import (
    causal_attention,
    choose_backend,
    decode_attention_backend,
)
from sparrow_nemo.rollout.torch.paged_cache import PagedKVCache
from sparrow_nemo.rollout.torch.qwen3 import Qwen3Decoder
from sparrow_nemo.rollout.torch.recorder import StepRecorder
from sparrow_nemo.rollout.torch.spec_decode import SpeculativeDecoder, SpeculativeSample
from sparrow_nemo.rollout.torch.spec_verify import KernelVerify, TorchVerify, VerifyAttention
from sparrow_nemo.rollout.torch.speculative import SpeculativeConfig
from sparrow_nemo.rollout.torch.static_decode import StaticDecoder, decode_static
from sparrow_nemo.rollout.torch.stopping import Detokenizer, StopRule
from sparrow_nemo.sparse.pattern import PAGE_SCORES, PAGE_SIZE
from sparrow_nemo.sparse.schedule import DENSE_BUDGET, BudgetSchedule

#: decode steps between two ``on_tokens`` reports (a progress bar stays off the per-token path)
PROGRESS_EVERY = 8


class TorchRolloutEngine:
    """:class:`~sparrow_nemo.rollout.engine.RolloutEngine` in plain torch (CPU or one GPU).

    Args:
        model: the decoder (its device and dtype are the engine's).
        dense_layers: leading layers that always attend densely (paper: 2).
        page_size, sink_pages, local_pages: the sparse rule's constants (paper: 16, 1, 2).
        page_score: how the sparse rule ranks pages: "centroid" (paper) or "minmax" (the cache's key bounds).
        attention_backend: "auto" (fused kernels on CUDA when available), "torch" or "triton".
        tokenizer: anything with ``decode(list[int]) -> str``; needed only for stop strings.
        max_batch_size: sequences decoded together (bounds the KV cache); None = all prompts at once.
        prefill_chunk_tokens: prompt positions per prefill chunk (a multiple of page_size; bounds the
            prefill attention memory); None = whole prompts at once.
        decode_loop: "compact", "static" or "auto" (static on CUDA with the fused kernels, else compact).
        stop_check_every: tokens between host stop checks in the static loop.
        cuda_graph: replay static decode steps from a CUDA graph (CUDA + triton backend only).
    """

    def __init__(
        self,
        model: Qwen3Decoder,
        *,
        dense_layers: int = 2,
        page_size: int = PAGE_SIZE,
        sink_pages: int = 1,
        local_pages: int = 2,
        page_score: str = "centroid",
        attention_backend: str = "auto",
        tokenizer: Detokenizer | None = None,
        max_batch_size: int | None = None,
        prefill_chunk_tokens: int | None = None,
        decode_loop: str = "auto",
        stop_check_every: int = 64,
        cuda_graph: bool = True,
    ) -> None:
        if not 0 <= dense_layers <= model.shape.num_layers:
            raise ValueError(f"dense_layers must be in [0, {model.shape.num_layers}], got {dense_layers}")
        if max_batch_size is not None and max_batch_size <= 0:
            raise ValueError(f"max_batch_size must be > 0 (or None), got {max_batch_size}")
        if page_size <= 0 or sink_pages < 0 or local_pages < 0:
            raise ValueError(
                f"page_size must be > 0 and sink_pages/local_pages >= 0, got {page_size}, {sink_pages}, {local_pages}"
            )
        if prefill_chunk_tokens is not None and (
            prefill_chunk_tokens <= 0 or prefill_chunk_tokens % page_size
        ):
            raise ValueError(
                f"prefill_chunk_tokens must be a positive multiple of page_size={page_size}, got {prefill_chunk_tokens}"
            )
        if page_score not in PAGE_SCORES:
            raise ValueError(f"page_score must be one of {PAGE_SCORES}, got {page_score!r}")
        if decode_loop not in ("auto", "compact", "static"):
            raise ValueError(f"decode_loop must be 'auto', 'compact' or 'static', got '{decode_loop}'")
        if stop_check_every <= 0:
            raise ValueError(f"stop_check_every must be > 0 tokens, got {stop_check_every}")
        self.model = model
        self.dense_layers = dense_layers
        self.page_size = page_size
        self.sink_pages = sink_pages
        self.local_pages = local_pages
        self.page_score = page_score
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.device = model.device
        self.backend = choose_backend(attention_backend, self.device)
        attention = decode_attention_backend(self.backend, page_score)
        self.decode_step = DecodeStep(model, attention, dense_layers, sink_pages, local_pages)
        fast = self.device.type == "cuda" and self.backend == "triton"
        self.decode_loop = ("static" if fast else "compact") if decode_loop == "auto" else decode_loop
        self.stop_check_every = stop_check_every
        self.cuda_graph = cuda_graph and fast
        self._cache: PagedKVCache | None = None
        self._cache_pages = 0
        self._verify: VerifyAttention | None = None  # built at the first speculative generate
        self._asleep = False

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_hf_dir(
        cls,
        path: str | Path,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        **kwargs,
    ) -> TorchRolloutEngine:
        """Engine over an HF Qwen3 checkpoint directory (config.json + safetensors)."""
        return cls(Qwen3Decoder.from_hf_dir(path, dtype=dtype, device=device), **kwargs)

    @classmethod
    def from_shape(
        cls,
        shape: Qwen3Shape,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        **kwargs,
    ) -> TorchRolloutEngine:
        """Engine over random weights of ``shape`` (tests, benchmarks)."""
        return cls(Qwen3Decoder.random(shape, seed=seed, dtype=dtype, device=device), **kwargs)

    @property
    def shape(self) -> Qwen3Shape:
        return self.model.shape

    @property
    def cache_bytes(self) -> int:
        """Bytes currently allocated for the KV cache (0 while asleep)."""
        if self._cache is None:
            return 0
        tensors = self._cache.k_pages + self._cache.v_pages + self._cache.landmark_pools
        return sum(t.numel() * t.element_size() for t in tensors)

    # ----------------------------------------------------------------- RolloutEngine API
    def update_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """Copy HF-named weights into the decoder in place (a subset is fine)."""
        self.model.load_state(state)

    def set_lora(self, adapter: LoraAdapter | None) -> None:
        """Apply ``adapter`` in generation (base weights untouched); None restores the base model."""
        if adapter is not None:
            adapter.validate(linear_in_out(self.shape))
            adapter = adapter.to(device=self.model.device, dtype=self.model.dtype)
        self.model.lora = adapter

    def sleep(self) -> None:
        """Free the KV cache; on CUDA also move the weights to CPU and empty the allocator cache."""
        self._cache = None
        if self.device.type == "cuda":
            self.model.to("cpu")
            torch.cuda.empty_cache()
        self._asleep = True

    def wake(self) -> None:
        """Undo :meth:`sleep`: weights back on the device and the KV cache reallocated."""
        if not self._asleep:
            return
        if self.device.type == "cuda":
            self.model.to(self.device)
        self._asleep = False
        if self._cache_pages:
            self._ensure_cache(self._cache_pages)

    @torch.no_grad()
    def score(self, sequences: Sequence[Sequence[int]], topk: int = 20) -> list[ScoredSequence]:
        """Dense teacher-forced scores of each sequence, without the LoRA adapter (the dense policy).

        Runs as a dense prefill through the paged cache, ``prefill_chunk_tokens`` positions at a time, so
        memory (attention and [chunk, vocab] logits) stays bounded for long sequences.
        """
        self._check_awake()
        if topk <= 0:
            raise ValueError(f"score: topk must be > 0, got {topk}")
        if not sequences:
            return []
        ids, lengths = self._pad([self._as_ids(s, i, "sequence") for i, s in enumerate(sequences)])
        n_tokens = lengths.tolist()
        parts: list[list[tuple[torch.Tensor, ...]]] = [[] for _ in n_tokens]

        def collect(start: int, h: torch.Tensor) -> None:  # h: [B, chunk, hidden] at start, start + 1, ...
            for b, n in enumerate(n_tokens):
                upto = min(start + h.shape[1], n - 1)  # the last token predicts nothing
                if upto > start:
                    logits = self.model.logits(h[b, : upto - start])
                    parts[b].append(token_logprobs(logits, ids[b, start + 1 : upto + 1], topk))

        cache = self._ensure_cache(sum(math.ceil(n / self.page_size) for n in n_tokens))
        block_table = torch.full(
            (len(n_tokens), math.ceil(max(n_tokens) / self.page_size)),
            -1,
            dtype=torch.int32,
            device=self.device,
        )
        adapter, self.model.lora = self.model.lora, None
        try:
            cache.reserve(block_table, lengths)
            self._prefill(cache, block_table, ids, lengths, collect)
        finally:
            self.model.lora = adapter
            cache.release(block_table)
        out = []
        for chunks in parts:
            lp, top_ids, top_lp = (
                (torch.cat(c).cpu() for c in zip(*chunks))
                if chunks
                else _empty_scores(min(topk, self.shape.vocab_size))
            )
            out.append(ScoredSequence(logprobs=lp, top_ids=top_ids, top_logprobs=top_lp))
        return out

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams,
        schedule: BudgetSchedule,
        *,
        sample_seeds: Sequence[int] | None = None,
        on_tokens: TokenProgress | None = None,
        speculative: SpeculativeConfig | None = None,
    ) -> RolloutBatch:
        """Sample one response per prompt; see :class:`~sparrow_nemo.rollout.engine.RolloutSample`.

        With ``speculative``, the sparse rule (``schedule``, or the config's own draft schedule) only drafts and
        dense verify passes decide: the samples are dense-distributed, their logprobs dense, and each is a
        :class:`~sparrow_nemo.rollout.torch.spec_decode.SpeculativeSample` carrying its draft statistics.

        ``sample_seeds`` overrides the per-sample seeds (default ``sample_seed(sampling.seed, i)``), so a
        prompt run alone can reproduce its draws from inside a larger batch. Prompts are decoded in waves
        of at most ``max_batch_size``; results do not depend on the wave size. ``on_tokens`` is told the
        new tokens every ``PROGRESS_EVERY`` decode steps (or static-loop blocks) and at the end.
        """
        self._check_awake()
        prompt_ids, seeds, max_new = self._check_request(prompts, sampling, schedule, sample_seeds)
        stop_ids = (self.shape.eos_token_id,) if sampling.stop_token_ids is None else sampling.stop_token_ids
        stop = StopRule(frozenset(stop_ids), sampling.stop_strings, self.tokenizer)
        out = RolloutBatch(samples=[], schedule_name=schedule.name, prefill_s=0.0, decode_s=0.0)
        step = self.max_batch_size or max(len(prompt_ids), 1)
        tally = TokenTally(on_tokens, PROGRESS_EVERY)
        for lo in range(0, len(prompt_ids), step):
            wave = slice(lo, lo + step)
            part = self._generate_wave(
                prompt_ids[wave], seeds[wave], max_new[wave], sampling, schedule, stop, tally, speculative
            )
            out.samples += part.samples
            out.prefill_s += part.prefill_s
            out.decode_s += part.decode_s
        tally.flush()
        return out

    def _generate_wave(
        self,
        prompt_ids: list[torch.Tensor],
        seeds: list[int],
        max_new: list[int],
        sampling: SamplingParams,
        schedule: BudgetSchedule,
        stop: StopRule,
        tally: TokenTally,
        speculative: SpeculativeConfig | None = None,
    ) -> RolloutBatch:
        """Generate for prompts decoded together (at most ``max_batch_size``); inputs already validated."""
        batch = len(prompt_ids)
        ps = self.page_size
        static = self.decode_loop == "static" and speculative is None
        # The static loop decodes every row for the longest response: reserve all of it up front. A
        # speculative verify may address up to the widest k positions past a row's cap (padded queries).
        slack = 0 if speculative is None else speculative.max_draft_tokens
        final_len = [p.numel() + (max(max_new) if static else m) + slack for p, m in zip(prompt_ids, max_new)]
        cache = self._ensure_cache(sum(math.ceil(n / ps) for n in final_len))
        block_table = torch.full(
            (batch, math.ceil(max(final_len) / ps)), -1, dtype=torch.int32, device=self.device
        )
        ids, seq_len = self._pad(prompt_ids)
        gens = make_generators(seeds)
        rec = StepRecorder(batch)

        t0 = self._now()
        cache.reserve(block_table, seq_len)
        adapter = self.model.lora
        if speculative is not None:  # the prompt is the dense policy's (what the verify passes read)
            self.model.lora = None
        try:
            logits = self._prefill_shared(cache, block_table, prompt_ids, ids, seq_len)
        finally:
            self.model.lora = adapter
        if speculative is not None:
            return self._decode_speculative(
                prompt_ids, cache, block_table, seq_len, logits, gens, max_new, sampling, schedule, speculative,
                stop, t0, tally,
            )  # fmt: skip
        if static:
            return self._decode_static(
                prompt_ids,
                cache,
                block_table,
                seq_len,
                logits,
                gens,
                max_new,
                sampling,
                schedule,
                stop,
                t0,
                tally,
            )
        active = torch.arange(batch, device=self.device)  # sample index of each live row
        tokens = self._sample_and_record(rec, logits, sampling, gens, active, seq_len, None)
        t1 = self._now()

        finished: dict[int, tuple[str, int | str | None]] = {}
        responses: list[list[int]] = [[] for _ in range(batch)]
        while True:
            tally.add(active.numel())
            keep = []  # live rows that continue
            for row, (s, t) in enumerate(zip(active.tolist(), tokens.tolist())):
                responses[s].append(t)
                done = stop.check(responses[s], max_new[s])
                if done is None:
                    keep.append(row)
                else:
                    finished[s] = done
            if len(keep) < active.numel():  # finished sequences leave the batch and free their pages
                rows = torch.tensor(keep, dtype=torch.int64, device=self.device)
                gone = torch.ones(active.numel(), dtype=torch.bool, device=self.device)
                gone[rows] = False
                cache.release(block_table[gone])
                active, tokens, seq_len = active[rows], tokens[rows], seq_len[rows]
                block_table = block_table.index_select(0, rows)
                gens = [gens[r] for r in keep]
            if not keep:
                break
            seq_len = seq_len + 1  # the last sampled token enters the cache now
            cache.reserve(block_table, seq_len)
            budgets = None if schedule.is_dense else schedule.budgets_for(seq_len)
            logits = self.decode_step(cache, block_table, tokens, seq_len, budgets)
            tokens = self._sample_and_record(rec, logits, sampling, gens, active, seq_len, budgets)
        t2 = self._now()

        samples = []
        for s, fields in enumerate(rec.per_sample()):
            reason, matched = finished[s]
            samples.append(
                RolloutSample(prompt_ids=prompt_ids[s].cpu(), **fields, finish_reason=reason, stop=matched)
            )
        return RolloutBatch(samples=samples, schedule_name=schedule.name, prefill_s=t1 - t0, decode_s=t2 - t1)

    def _decode_static(
        self,
        prompt_ids: list[torch.Tensor],
        cache: PagedKVCache,
        block_table: torch.Tensor,
        seq_len: torch.Tensor,
        logits: torch.Tensor,
        gens: list[torch.Generator],
        max_new: list[int],
        sampling: SamplingParams,
        schedule: BudgetSchedule,
        stop: StopRule,
        t0: float,
        tally: TokenTally,
    ) -> RolloutBatch:
        """The static decode loop of one wave after its prefill (``logits [B, V]`` of the last prompt
        tokens); pages for prompt + max(max_new) tokens are reserved here and freed at the end."""
        cache.reserve(block_table, seq_len + max(max_new))
        dec = StaticDecoder(
            self.decode_step,
            self.backend,
            cache,
            block_table,
            seq_len,
            max(max_new),
            sampling,
            schedule,
            self.stop_check_every,
        )
        first = (
            draw_uniforms(gens) if sampling.temperature > 0 else torch.zeros(len(gens), dtype=torch.float64)
        )
        dec.record_first(logits, first)
        t1 = self._now()
        try:
            fields, finished = decode_static(dec, gens, max_new, stop, self.cuda_graph, tally)
        finally:
            cache.release(block_table)
        t2 = self._now()
        samples = [
            RolloutSample(prompt_ids=p.cpu(), **f, finish_reason=reason, stop=matched)
            for p, f, (reason, matched) in zip(prompt_ids, fields, finished)
        ]
        return RolloutBatch(samples=samples, schedule_name=schedule.name, prefill_s=t1 - t0, decode_s=t2 - t1)

    def _decode_speculative(
        self,
        prompt_ids: list[torch.Tensor],
        cache: PagedKVCache,
        block_table: torch.Tensor,
        seq_len: torch.Tensor,
        logits: torch.Tensor,
        gens: list[torch.Generator],
        max_new: list[int],
        sampling: SamplingParams,
        schedule: BudgetSchedule,
        speculative: SpeculativeConfig,
        stop: StopRule,
        t0: float,
        tally: TokenTally,
    ) -> RolloutBatch:
        """The speculative loop of one wave after its prefill (:mod:`sparrow_nemo.rollout.torch.spec_decode`)."""
        draft = speculative.schedule_for(schedule)
        if draft.page_size != self.page_size:
            raise ValueError(
                f"speculative draft schedule '{draft.name}' uses page_size={draft.page_size} but the engine "
                f"pages are {self.page_size} tokens"
            )
        decoder = SpeculativeDecoder(
            self.model, self.decode_step, self._verify_attention(), cache, sampling, draft, speculative, stop,
            pad_queries=self.backend == "triton",
        )  # fmt: skip
        t1 = self._now()
        fields = decoder.run(block_table, seq_len, logits, gens, max_new, tally)  # frees every page it holds
        t2 = self._now()
        samples = [SpeculativeSample(prompt_ids=p.cpu(), **f) for p, f in zip(prompt_ids, fields)]
        return RolloutBatch(
            samples=samples, schedule_name=f"speculative:{draft.name}", prefill_s=t1 - t0, decode_s=t2 - t1
        )

    def _verify_attention(self) -> VerifyAttention:
        """The speculative verify pass's attention: the Triton kernel with the fused decode, else torch."""
        if self._verify is None:
            self._verify = KernelVerify() if self.backend == "triton" else TorchVerify()
        return self._verify

    # ----------------------------------------------------------------- internals
    def _check_awake(self) -> None:
        if self._asleep:
            raise RuntimeError("the rollout engine is asleep: call wake() before generate() or score()")

    def _check_request(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams,
        schedule: BudgetSchedule,
        sample_seeds: Sequence[int] | None,
    ) -> tuple[list[torch.Tensor], list[int], list[int]]:
        """Validate a generate() call -> (prompt id tensors, per-sample seeds, per-sample token caps)."""
        if schedule.page_size != self.page_size:
            raise ValueError(
                f"schedule '{schedule.name}' uses page_size={schedule.page_size} but the engine pages are "
                f"{self.page_size} tokens"
            )
        prompt_ids = [self._as_ids(p, i, "prompt") for i, p in enumerate(prompts)]
        seeds = batch_seeds(sampling.seed, len(prompt_ids), sample_seeds)
        max_pos = self.shape.max_position_embeddings
        for i, p in enumerate(prompt_ids):
            if p.numel() >= max_pos:
                raise ValueError(f"prompt {i} has {p.numel()} tokens; the model allows {max_pos} positions")
        return prompt_ids, seeds, [min(sampling.max_new_tokens, max_pos - p.numel()) for p in prompt_ids]

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _ensure_cache(self, pages: int) -> PagedKVCache:
        """The KV cache, (re)allocated when it has fewer than ``pages`` pages."""
        if self._cache is None or self._cache.num_pages < pages:
            self._cache = None  # free the old pools before allocating the new ones
            s = self.shape
            self._cache = PagedKVCache(
                s.num_layers,
                pages,
                s.num_key_value_heads,
                s.head_dim,
                self.page_size,
                dtype=self.model.dtype,
                device=self.device,
                page_score=self.page_score,
            )
            self._cache_pages = pages
        return self._cache

    def _as_ids(self, ids: Sequence[int] | torch.Tensor, index: int, what: str) -> torch.Tensor:
        """Validate one token list -> 1-D int64 tensor on the engine device."""
        t = torch.as_tensor(ids, dtype=torch.int64)
        if t.dim() != 1 or t.numel() == 0:
            raise ValueError(
                f"{what} {index} must be a non-empty 1-D list of token ids, got shape {tuple(t.shape)}"
            )
        if int(t.min()) < 0 or int(t.max()) >= self.shape.vocab_size:
            raise ValueError(
                f"{what} {index} has token ids in [{int(t.min())}, {int(t.max())}], outside the vocabulary "
                f"[0, {self.shape.vocab_size})"
            )
        return t.to(self.device)

    def _pad(self, seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-pad with token 0: ([B, T] int64, lengths [B] int64)."""
        lengths = torch.tensor([s.numel() for s in seqs], dtype=torch.int64, device=self.device)
        ids = torch.zeros(len(seqs), int(lengths.max()), dtype=torch.int64, device=self.device)
        for b, s in enumerate(seqs):
            ids[b, : s.numel()] = s
        return ids, lengths

    def _prefill_shared(
        self,
        cache: PagedKVCache,
        block_table: torch.Tensor,
        prompt_ids: list[torch.Tensor],
        ids: torch.Tensor,
        seq_len: torch.Tensor,
    ) -> torch.Tensor:
        """Prefill each distinct prompt of the wave once (a GRPO group repeats its prompt) and copy its
        keys, values and page landmarks into the pages of the rows that repeat it -> logits [B, V] of every
        row's last prompt token. Pages for the prompts must be reserved."""
        first: dict[tuple[int, ...], int] = {}
        source = [first.setdefault(tuple(p.tolist()), row) for row, p in enumerate(prompt_ids)]
        unique = sorted(set(source))
        rows = torch.tensor(unique, device=self.device)
        u_len = seq_len[rows]
        last = torch.empty(len(unique), self.shape.hidden_size, dtype=self.model.dtype, device=self.device)

        def keep_last(start: int, h: torch.Tensor) -> None:  # the hidden state after each prompt's last token
            ends_here = (u_len - 1 >= start) & (u_len - 1 < start + h.shape[1])
            last[ends_here] = h[ends_here, (u_len - 1 - start)[ends_here]]

        unique_table = block_table[rows]
        self._prefill(cache, unique_table, ids[rows, : int(u_len.max())], u_len, keep_last)
        if copies := [(row, src) for row, src in enumerate(source) if row != src]:
            dst_rows, src_rows = torch.tensor(copies, device=self.device).T
            n_pages = math.ceil(int(seq_len.max()) / self.page_size)
            live = block_table[dst_rows, :n_pages] >= 0  # the pages the prompt fills
            dst = block_table[dst_rows, :n_pages][live].long()
            src = block_table[src_rows, :n_pages][live].long()
            for pool in (*cache.k_pages, *cache.v_pages, *cache.landmark_pools):
                pool[dst] = pool[src]
        index = torch.tensor([unique.index(s) for s in source], device=self.device)
        return self.model.logits(last.index_select(0, index))

    def _prefill(
        self,
        cache: PagedKVCache,
        block_table: torch.Tensor,
        ids: torch.Tensor,
        lengths: torch.Tensor,
        emit: Callable[[int, torch.Tensor], None],
    ) -> None:
        """Dense prefill of right-padded ``ids [B, T]`` into the cache (pages reserved), in chunks of
        ``prefill_chunk_tokens`` positions; each chunk attends to everything cached before it.

        ``emit(start, h)`` receives each chunk's final hidden states ``h [B, chunk, hidden]``
        (positions start, start + 1, ...; rows past a sequence's length are padding).
        """
        t = ids.shape[1]
        chunk = self.prefill_chunk_tokens or t
        for start in range(0, t, chunk):
            end = min(t, start + chunk)
            positions = torch.arange(start, end, device=self.device)[None, :].expand(ids.shape[0], -1)
            h = self.model.embed(ids[:, start:end])
            rope = self.model.rope(positions, h.dtype)
            for layer in range(self.shape.num_layers):
                q, k, v = self.model.attention_inputs(layer, h, positions, rope)
                cache.write_prefill(layer, block_table, k, v, lengths, start=start)
                k_all, v_all = cache.contiguous(layer, block_table, lengths.clamp(max=end))  # [B, Hkv, L, D]
                attn = causal_attention(q, k_all.transpose(1, 2), v_all.transpose(1, 2), q_offset=start)
                h = self.model.attention_output(layer, h, attn)
            emit(start, h)

    def _sample_and_record(
        self,
        rec: StepRecorder,
        logits: torch.Tensor,
        sampling: SamplingParams,
        gens: list[torch.Generator],
        active: torch.Tensor,
        cached_len: torch.Tensor,
        budgets: torch.Tensor | None,
    ) -> torch.Tensor:
        """Sample the next tokens of the live rows and record their logprobs -> tokens [B_live]."""
        uniforms = (
            draw_uniforms(gens) if sampling.temperature > 0 else torch.zeros(len(gens), dtype=torch.float64)
        )
        tokens = sample_tokens(logits, sampling, uniforms)
        lp, top_ids, top_lp = token_logprobs(logits, tokens, sampling.logprobs_topk)
        budget = torch.full_like(cached_len, DENSE_BUDGET) if budgets is None else budgets
        rec.add(active, tokens, lp, top_ids, top_lp, cached_len, budget)
        return tokens


def _empty_scores(topk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scores of a one-token sequence: nothing is predicted."""
    return torch.empty(0), torch.empty(0, topk, dtype=torch.int64), torch.empty(0, topk)
