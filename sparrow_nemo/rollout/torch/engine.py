"""The torch rollout engine: plain-torch Qwen3 over a paged KV cache, continuous batching, Sparrow sparse decode.

- ``generate`` queues one request per prompt and runs the continuous-batching loop
  (:mod:`sparrow_nemo.rollout.torch.generation`): every running sequence decodes each step, finished ones leave,
  waiting ones are admitted as KV pages free up; pages are taken as sequences grow and, when none is left, the
  most recently admitted sequence is preempted and recomputed later. A GRPO group's prompt is prefilled once.
- The KV pool: ``max_cache_tokens`` tokens when given; else on CUDA ``kv_cache_fraction`` of the device memory
  free when the first call after a wake sizes it (vLLM's ``gpu_memory_utilization``, of what is left after
  the weights and whatever else holds the device), and elsewhere what the call could need at most (no
  preemption). Sample i draws position-indexed uniforms from its own seed, so its tokens do not depend on the
  pool's size, admission order or preemption.
- Decode: prefill is dense; each step appends one token per running sequence (page landmarks updated), the
  first ``dense_layers`` layers attend densely, the others to the pages the sparse rule keeps within the budget
  the schedule gives that row's cached length. On CUDA with the fused kernels (``choose_backend``) steps replay
  from CUDA graphs captured at bucketed batch sizes (:mod:`sparrow_nemo.rollout.torch.cuda_graphs`).
- ``generate(..., speculative=SpeculativeConfig(...))`` decodes losslessly instead: sparse drafts verified by
  dense forwards, rounds inside the same loop (:mod:`sparrow_nemo.rollout.torch.spec_decode`).
- ``sleep`` releases the weights and the KV pool (no host copy); ``wake`` gives the weights storage again and
  the refit (``update_weights``, every tensor) fills it before the next ``generate``.
- Tensor parallelism: a decoder built with a :class:`~sparrow_nemo.rollout.torch.tensor_parallel.TensorParallel`
  holds one rank's shard (its KV heads: the pool's pages shrink by ``k``); every rank of the engine calls
  ``generate`` / ``score`` / ``update_weights`` / ``set_lora`` / ``sleep`` / ``wake`` with the same arguments,
  in the same order, and gets the same samples (its forward gathers the full logits on every rank).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from sparrow_nemo.hf_qwen3 import LoraAdapter, expected_weight_shapes, linear_in_out
from sparrow_nemo.model_shapes import Qwen3Shape
from sparrow_nemo.rollout.engine import (
    RolloutBatch,
    SamplingParams,
    ScoredSequence,
    TokenProgress,
    TokenTally,
)
from sparrow_nemo.rollout.sampling import batch_seeds, token_logprobs
from sparrow_nemo.rollout.torch.block_manager import BlockManager, OutOfPages, pages_for
from sparrow_nemo.rollout.torch.cuda_graphs import DecodeGraphs
from sparrow_nemo.rollout.torch.decode_step import DecodeStep
from sparrow_nemo.rollout.torch.extend import KernelVerify, TokensAttention, TorchVerify
from sparrow_nemo.rollout.torch.generation import PlainDecode, now_fn, run_loop
from sparrow_nemo.rollout.torch.model_runner import ModelRunner
from sparrow_nemo.rollout.torch.paged_attention import choose_backend, decode_attention_backend
from sparrow_nemo.rollout.torch.paged_cache import PagedKVCache
from sparrow_nemo.rollout.torch.qwen3 import Qwen3Decoder
from sparrow_nemo.rollout.torch.scheduler import WATERMARK
from sparrow_nemo.rollout.torch.sequence import Sequence as Seq
from sparrow_nemo.rollout.torch.spec_decode import SpeculativeRounds
from sparrow_nemo.rollout.torch.speculative import SpeculativeConfig
from sparrow_nemo.rollout.torch.stopping import Detokenizer, StopRule
from sparrow_nemo.rollout.torch.tensor_parallel import TensorParallel
from sparrow_nemo.sparse.pattern import PAGE_SCORES, PAGE_SIZE, landmarks_per_page
from sparrow_nemo.sparse.schedule import BudgetSchedule

logger = logging.getLogger(__name__)

#: decode steps between two ``on_tokens`` reports (a progress bar stays off the per-token path)
PROGRESS_EVERY = 8

#: the most sequences a CUDA engine runs at once when ``max_batch_size`` is not given (vLLM's max_num_seqs)
DEFAULT_MAX_RUNNING = 256


class TorchRolloutEngine:
    """:class:`~sparrow_nemo.rollout.engine.RolloutEngine` in plain torch (CPU or GPUs).

    Args:
        model: the decoder (its device and dtype are the engine's; its ``tensor_parallel`` the engine's shard).
        dense_layers: leading layers that always attend densely (paper: 2).
        page_size, sink_pages, local_pages: the sparse rule's constants (paper: 16, 1, 2).
        page_score: how the sparse rule ranks pages: "centroid" (paper) or "minmax" (the cache's key bounds).
        attention_backend: "auto" (fused kernels on CUDA when available), "torch" or "triton".
        tokenizer: anything with ``decode(list[int]) -> str``; needed only for stop strings.
        max_batch_size: the most sequences running at once (vLLM's ``max_num_seqs``); None: every request of a
            call on the CPU, :data:`DEFAULT_MAX_RUNNING` on CUDA.
        max_cache_tokens: the KV pool in tokens (a multiple of pages); None: see ``kv_cache_fraction``.
        kv_cache_fraction: on CUDA without ``max_cache_tokens``, the share of the free device memory the pool takes.
        prefill_chunk_tokens: prompt positions per prefill chunk (a multiple of page_size; bounds the prefill
            attention memory); None = whole prompts at once.
        cuda_graph: replay decode steps from CUDA graphs (CUDA + triton backend only).
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
        max_cache_tokens: int | None = None,
        kv_cache_fraction: float = 0.9,
        prefill_chunk_tokens: int | None = None,
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
        if max_cache_tokens is not None and max_cache_tokens < page_size:
            raise ValueError(
                f"max_cache_tokens must be >= page_size={page_size} tokens, got {max_cache_tokens}"
            )
        if not 0 < kv_cache_fraction <= 1:
            raise ValueError(f"kv_cache_fraction must lie in (0, 1], got {kv_cache_fraction}")
        if prefill_chunk_tokens is not None and (
            prefill_chunk_tokens <= 0 or prefill_chunk_tokens % page_size
        ):
            raise ValueError(
                f"prefill_chunk_tokens must be a positive multiple of page_size={page_size}, got {prefill_chunk_tokens}"
            )
        if page_score not in PAGE_SCORES:
            raise ValueError(f"page_score must be one of {PAGE_SCORES}, got {page_score!r}")
        self.model = model
        self.dense_layers = dense_layers
        self.page_size = page_size
        self.sink_pages = sink_pages
        self.local_pages = local_pages
        self.page_score = page_score
        self.tokenizer = tokenizer
        self.max_cache_tokens = max_cache_tokens
        self.kv_cache_fraction = kv_cache_fraction
        self.device, self.dtype = model.device, model.dtype
        self.backend = choose_backend(attention_backend, self.device)
        self.decode_step = DecodeStep(
            model, decode_attention_backend(self.backend, page_score), dense_layers, sink_pages, local_pages
        )
        fast = self.device.type == "cuda" and self.backend == "triton"
        self.max_batch_size = max_batch_size or (DEFAULT_MAX_RUNNING if fast else None)
        self.verify: TokensAttention = KernelVerify() if self.backend == "triton" else TorchVerify()
        graphs = None
        if fast and cuda_graph:
            max_pages = pages_for(model.shape.max_position_embeddings + 1, page_size)
            graphs = DecodeGraphs(self._step_fn, self.device, self.max_batch_size, max_pages, capture=True)
        self.runner = ModelRunner(self.decode_step, self.verify, prefill_chunk_tokens, graphs)
        self._cache: PagedKVCache | None = None
        self._fraction_pages: int | None = None  # the pool kv_cache_fraction sized after the last wake
        self._asleep = False
        self._unfilled: set[str] = set()  # weights not refitted since the last wake

    def _step_fn(self, table, tokens, seq_len, budgets) -> torch.Tensor:
        """The decode step over the current pool (what the CUDA graphs capture)."""
        return self.decode_step(self._cache, table, tokens, seq_len, budgets)

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_hf_dir(
        cls,
        path: str | Path,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        tensor_parallel: TensorParallel | None = None,
        **kwargs,
    ) -> TorchRolloutEngine:
        """Engine over an HF Qwen3 checkpoint directory (config.json + safetensors); with ``tensor_parallel``
        this rank's shard of it."""
        model = Qwen3Decoder.from_hf_dir(path, dtype=dtype, device=device, tensor_parallel=tensor_parallel)
        return cls(model, **kwargs)

    @classmethod
    def from_shape(
        cls,
        shape: Qwen3Shape,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        tensor_parallel: TensorParallel | None = None,
        **kwargs,
    ) -> TorchRolloutEngine:
        """Engine over random weights of ``shape`` (tests, benchmarks); with ``tensor_parallel`` this rank's
        shard of the same weights."""
        model = Qwen3Decoder.random(
            shape, seed=seed, dtype=dtype, device=device, tensor_parallel=tensor_parallel
        )
        return cls(model, **kwargs)

    @classmethod
    def awaiting_weights(cls, model: Qwen3Decoder, **kwargs) -> TorchRolloutEngine:
        """Engine over ``model`` whose weights have storage but no values yet (:meth:`Qwen3Decoder.empty`; as
        after a wake): ``update_weights`` of every tensor (a trainer's refit) must come before the first
        ``generate`` or ``score``."""
        engine = cls(model, **kwargs)
        engine._unfilled = engine._weight_names()
        return engine

    @property
    def tensor_parallel(self) -> TensorParallel | None:
        """This rank's place in a tensor-parallel engine (None: the whole model on one device)."""
        return self.model.tensor_parallel

    @property
    def shape(self) -> Qwen3Shape:
        return self.model.shape

    @property
    def cache_bytes(self) -> int:
        """Bytes currently allocated for the KV pool (0 while asleep)."""
        return 0 if self._cache is None else self._cache.nbytes

    @property
    def page_bytes(self) -> int:
        """Bytes of one KV page in every layer: keys, values and the page score's landmarks."""
        s, item = self.shape, torch.empty(0, dtype=self.dtype).element_size()
        kv_heads = self.model.heads[1]  # this rank's
        per_layer = kv_heads * s.head_dim * (2 * self.page_size + landmarks_per_page(self.page_score))
        return s.num_layers * per_layer * item

    # ----------------------------------------------------------------- RolloutEngine API
    def update_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """Copy HF-named weights into the decoder in place (a subset is fine; after a wake, every tensor must
        come before the next ``generate``). A tensor-parallel engine takes each tensor whole (it slices its
        shard) or as its own shard, told apart by shape (:meth:`Qwen3Decoder.load_state`)."""
        self.model.load_state(state)
        self._unfilled -= set(state)

    def set_lora(self, adapter: LoraAdapter | None) -> None:
        """Apply ``adapter`` in generation (base weights untouched); None restores the base model."""
        if adapter is not None:
            adapter.validate(linear_in_out(self.shape))
            if self.tensor_parallel is not None:
                adapter = self.tensor_parallel.shard_lora(adapter)
            adapter = adapter.to(device=self.device, dtype=self.dtype)
        self.model.lora = adapter
        if self.runner.graphs is not None:
            self.runner.graphs.reset()  # the captured steps read the old adapter's tensors

    def sleep(self) -> None:
        """Release the weights and the KV pool (no copy is kept; the refit after :meth:`wake` fills the weights)."""
        self._cache = None
        if self.runner.graphs is not None:
            self.runner.graphs.reset()
        self.model.release()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self._asleep = True

    def wake(self) -> None:
        """Storage for the weights again (uninitialised until the refit); the KV pool is sized at the next call."""
        if not self._asleep:
            return
        self.model.allocate(self.device, self.dtype)
        self._unfilled = self._weight_names()
        self._fraction_pages = None
        self._asleep = False

    def _weight_names(self) -> set[str]:
        """The HF names a refit must fill."""
        return set(expected_weight_shapes(self.shape))

    @torch.no_grad()
    def score(self, sequences: Sequence[Sequence[int]], topk: int = 20) -> list[ScoredSequence]:
        """Dense teacher-forced scores of each sequence, without the LoRA adapter (the dense policy).

        Runs as dense prefills through the paged cache, as many sequences at a time as the pool holds and
        ``prefill_chunk_tokens`` positions at a time, so memory (attention and [chunk, vocab] logits) stays
        bounded for long sequences.
        """
        self._check_ready()
        if topk <= 0:
            raise ValueError(f"score: topk must be > 0, got {topk}")
        ids = [self._as_ids(s, i, "sequence") for i, s in enumerate(sequences)]
        need = [pages_for(t.numel(), self.page_size) for t in ids]
        cache = self._pool(sum(need))
        blocks = BlockManager(cache.num_pages - 1, self.page_size)
        if ids and max(need) > blocks.num_pages:
            raise OutOfPages(f"score: a {max(t.numel() for t in ids)}-token sequence exceeds the KV pool")
        out: list[ScoredSequence] = []
        adapter, self.model.lora = self.model.lora, None
        try:
            start = 0
            while start < len(ids):
                stop = start
                while stop < len(ids) and sum(need[start : stop + 1]) <= blocks.num_pages:
                    stop += 1
                out += self._score_batch(cache, blocks, ids[start:stop], topk)
                start = stop
        finally:
            self.model.lora = adapter
        return out

    def _score_batch(
        self, cache: PagedKVCache, blocks: BlockManager, ids: list[torch.Tensor], topk: int
    ) -> list[ScoredSequence]:
        lengths = torch.tensor([t.numel() for t in ids], dtype=torch.int64, device=self.device)
        padded = torch.zeros(len(ids), int(lengths.max()), dtype=torch.int64, device=self.device)
        for b, t in enumerate(ids):
            padded[b, : t.numel()] = t
        pages = [blocks.allocate(pages_for(t.numel(), self.page_size)) for t in ids]
        width = max(map(len, pages))
        table = torch.tensor(
            [p + [-1] * (width - len(p)) for p in pages], dtype=torch.int32, device=self.device
        )
        n_tokens = lengths.tolist()
        parts: list[list[tuple[torch.Tensor, ...]]] = [[] for _ in ids]

        def collect(start: int, h: torch.Tensor) -> None:  # h: [B, chunk, hidden] at start, start + 1, ...
            for b, n in enumerate(n_tokens):
                upto = min(start + h.shape[1], n - 1)  # the last token predicts nothing
                if upto > start:
                    logits = self.model.logits(h[b, : upto - start])
                    parts[b].append(token_logprobs(logits, padded[b, start + 1 : upto + 1], topk))

        try:
            self.runner.dense_prefill(cache, table, padded, lengths, collect)
        finally:
            for p in pages:
                blocks.release(p)
        k = min(topk, self.shape.vocab_size)
        empty = (torch.empty(0), torch.empty(0, k, dtype=torch.int64), torch.empty(0, k))
        return [
            ScoredSequence(*((torch.cat(c).cpu() for c in zip(*chunks)) if chunks else empty))
            for chunks in parts
        ]

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams,
        schedule: BudgetSchedule,
        *,
        sample_seeds: Sequence[int] | None = None,
        max_new_tokens: Sequence[int] | None = None,
        on_tokens: TokenProgress | None = None,
        speculative: SpeculativeConfig | None = None,
    ) -> RolloutBatch:
        """Sample one response per prompt; see :class:`~sparrow_nemo.rollout.engine.RolloutSample`.

        ``max_new_tokens`` caps each prompt's response (default ``sampling.max_new_tokens`` for all; both are
        also capped by the model's positions). With ``speculative``, the sparse rule (``schedule``, or the config's
        own draft schedule) only drafts and dense verify passes decide: the samples are dense-distributed, their
        logprobs dense, and each is a :class:`~sparrow_nemo.rollout.torch.spec_decode.SpeculativeSample` carrying
        its draft statistics. ``sample_seeds`` overrides the per-sample seeds (default ``sample_seed(sampling.seed,
        i)``). ``on_tokens`` is told the new tokens every ``PROGRESS_EVERY`` steps and at the end.
        """
        self._check_ready()
        if speculative is not None and sampling.inject_mismatch.on:
            raise ValueError(
                "rollout.inject_mismatch is on: speculative decoding (dense verify) would undo it"
            )
        prompt_ids, seeds, caps = self._check_request(
            prompts, sampling, schedule, sample_seeds, max_new_tokens
        )
        stop_ids = (self.shape.eos_token_id,) if sampling.stop_token_ids is None else sampling.stop_token_ids
        stop = StopRule(frozenset(stop_ids), sampling.stop_strings, self.tokenizer)
        if not prompt_ids:
            return RolloutBatch(samples=[], schedule_name=schedule.name, prefill_s=0.0, decode_s=0.0)
        group: dict[tuple[int, ...], int] = {}
        seqs = [
            Seq(i, group.setdefault(tuple(p.tolist()), len(group)), p.numel(), cap, seed)
            for i, (p, cap, seed) in enumerate(zip(prompt_ids, caps, seeds))
        ]
        if speculative is None:
            decoder, fill, lookahead, name = (
                PlainDecode(self.runner, schedule, sampling, stop, len(seqs)),
                schedule,
                0,
                schedule.name,
            )
        else:
            draft = speculative.schedule_for(schedule)
            if draft.page_size != self.page_size:
                raise ValueError(
                    f"speculative draft schedule '{draft.name}' uses page_size={draft.page_size} but the engine "
                    f"pages are {self.page_size} tokens"
                )
            pad = self.backend == "triton"
            decoder = SpeculativeRounds(
                self.model, self.decode_step, self.verify, sampling, draft, speculative, stop, pad
            )
            fill, lookahead, name = (
                BudgetSchedule.dense(schedule.bin_tokens, self.page_size),
                speculative.max_draft_tokens,
                f"speculative:{draft.name}",
            )
        prefixes = sum(
            pages_for(p.numel(), self.page_size) for p in {tuple(p.tolist()): p for p in prompt_ids}.values()
        )
        cache = self._pool(
            prefixes + sum(pages_for(s.prompt_len + s.max_new + lookahead + 1, self.page_size) for s in seqs)
        )
        if self.runner.graphs is not None and speculative is None and not schedule.is_dense:
            self.runner.graphs.budget_of.load(schedule)
        tally = TokenTally(on_tokens, PROGRESS_EVERY)
        samples, stats = run_loop(
            self.runner,
            cache,
            seqs,
            prompt_ids,
            decoder,
            fill,
            self.max_batch_size or len(seqs),
            lookahead,
            dense_cache=speculative is not None,
            tally=tally,
            now=now_fn(self.device),
        )
        tally.flush()
        if stats.preemptions:
            logger.info(
                "rollout: %d preemptions (%d tokens recomputed) in a %d-page KV pool; peak %d pages",
                stats.preemptions,
                stats.recomputed_tokens,
                stats.capacity_pages,
                stats.peak_pages,
            )
        return RolloutBatch(
            samples=samples,
            schedule_name=name,
            prefill_s=stats.prefill_s,
            decode_s=stats.decode_s,
            decode_steps=stats.decode_steps,
            preemptions=stats.preemptions,
            peak_pages=stats.peak_pages,
            capacity_pages=stats.capacity_pages,
        )

    # ----------------------------------------------------------------- internals
    def _check_ready(self) -> None:
        if self._asleep:
            raise RuntimeError(
                "the rollout engine is asleep: call wake() (and refit) before generate() or score()"
            )
        if self._unfilled:
            raise RuntimeError(
                f"the rollout engine's weights have no values (released by sleep(), or built awaiting a refit): "
                f"{len(self._unfilled)} tensors (e.g. '{min(self._unfilled)}') not refitted since wake(); "
                "update_weights() every tensor first"
            )

    def _check_request(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams,
        schedule: BudgetSchedule,
        sample_seeds: Sequence[int] | None,
        max_new_tokens: Sequence[int] | None,
    ) -> tuple[list[torch.Tensor], list[int], list[int]]:
        """Validate a generate() call -> (prompt id tensors, per-sample seeds, per-sample token caps)."""
        if schedule.page_size != self.page_size:
            raise ValueError(
                f"schedule '{schedule.name}' uses page_size={schedule.page_size} but the engine pages are "
                f"{self.page_size} tokens"
            )
        prompt_ids = [self._as_ids(p, i, "prompt") for i, p in enumerate(prompts)]
        seeds = batch_seeds(sampling.seed, len(prompt_ids), sample_seeds)
        caps = (
            [sampling.max_new_tokens] * len(prompt_ids)
            if max_new_tokens is None
            else [int(m) for m in max_new_tokens]
        )
        if len(caps) != len(prompt_ids):
            raise ValueError(f"max_new_tokens has {len(caps)} entries for {len(prompt_ids)} prompts")
        max_pos = self.shape.max_position_embeddings
        for i, (p, cap) in enumerate(zip(prompt_ids, caps)):
            if cap < 1:
                raise ValueError(f"max_new_tokens[{i}] must be >= 1 token, got {cap}")
            if p.numel() >= max_pos:
                raise ValueError(f"prompt {i} has {p.numel()} tokens; the model allows {max_pos} positions")
        return prompt_ids, seeds, [min(cap, max_pos - p.numel()) for p, cap in zip(prompt_ids, caps)]

    def _pool(self, pages_wanted: int) -> PagedKVCache:
        """The KV pool for a call that could hold ``pages_wanted`` pages at most (plus the scratch page): fixed
        by ``max_cache_tokens`` or ``kv_cache_fraction``, else grown to what the call could need."""
        if self.max_cache_tokens is not None:
            pages = self.max_cache_tokens // self.page_size
        elif self.device.type == "cuda":
            if self._fraction_pages is None:
                self._cache = None  # its memory counts as free
                torch.cuda.empty_cache()
                free, _ = torch.cuda.mem_get_info(self.device)
                pages = max(1, int(self.kv_cache_fraction * free) // self.page_bytes - 1)
                self._fraction_pages = self._agreed_pages(pages)
            pages = self._fraction_pages
        else:  # room for everything the call could write, above the scheduler's admission watermark
            pages = pages_wanted + math.ceil(2 * WATERMARK * pages_wanted) + 1
        if self._cache is None or self._cache.num_pages < pages + 1:
            self._cache = None  # free the old pools before allocating the new ones
            s = self.shape
            self._cache = PagedKVCache(
                s.num_layers,
                pages + 1,
                self.model.heads[1],
                s.head_dim,
                self.page_size,
                dtype=self.dtype,
                device=self.device,
                page_score=self.page_score,
            )
            if self.runner.graphs is not None:
                self.runner.graphs.reset()  # the captured steps read the old pools
        return self._cache

    def _agreed_pages(self, pages: int) -> int:
        """The pool every rank of a tensor-parallel engine can hold (the smallest ``pages``): its ranks must
        schedule alike, so their pools are one size."""
        tp = self.tensor_parallel
        if tp is None:
            return pages
        least = torch.tensor([pages], dtype=torch.int64, device=self.device)
        dist.all_reduce(least, op=dist.ReduceOp.MIN, group=tp.group)
        return int(least.item())

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
