"""Decode steps replayed from CUDA graphs captured at bucketed batch sizes, for a batch that changes every step.

Continuous batching changes the decode batch from step to step, while a CUDA graph replays fixed shapes. As
vLLM and nano-vllm do, graphs are captured at bucket sizes (1, 2, 4, 8, then every 16 up to the engine's most
running sequences) and a step of ``b`` rows runs the smallest bucket >= b with its rows padded: a padding row
decodes token 0 at cached length 1 over the engine's scratch page, and its outputs are dropped. A graph reads
static buffers that each step fills first (block-table rows, tokens, lengths, position-indexed uniforms); the
KV budgets are looked up inside the graph from a device copy of the schedule (:class:`DeviceBudgets`), so a new
schedule needs no new capture. One step inside the graph: the engine's decode step (every layer, with the
sparse per-row budgets), sampling (:func:`~sparrow_nemo.rollout.sampling.sample_tokens`, no host sync) and the
logprob/top-K record.

Graphs are captured lazily, the first time a bucket is used, into one memory pool shared by all of them, and
dropped when the engine's weights, KV pool or LoRA adapter are reallocated (sleep, a new adapter). Off CUDA
(``capture=False``) :meth:`DecodeGraphs.run` runs the same padded static step eagerly: the CPU tests exercise
the padding and the buffers this way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from sparrow_nemo.rollout.engine import SamplingParams
from sparrow_nemo.rollout.sampling import inject_mixture, mixture_logprobs, sample_tokens, token_logprobs
from sparrow_nemo.sparse.schedule import DENSE_BUDGET, BudgetSchedule

#: most bins of a schedule the device table holds without growing (the paper's schedules have 20)
MAX_BINS = 128


def bucket_sizes(max_batch: int) -> list[int]:
    """Captured batch sizes: 1, 2, 4, 8, then multiples of 16, and ``max_batch`` itself."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sorted({*sizes, max_batch})


class DeviceBudgets:
    """A schedule's per-bin budgets on the device, looked up without a host sync (graph-safe).

    ``load(schedule)`` overwrites the table in place (captured graphs keep reading it); ``__call__(cached_len
    [B])`` -> [B] int64 tokens of each row's bin (the last bin for longer lengths).
    """

    def __init__(self, device: torch.device) -> None:
        self.table = torch.full((MAX_BINS,), DENSE_BUDGET, dtype=torch.int64, device=device)
        self.bin_tokens = torch.ones(1, dtype=torch.int64, device=device)

    def load(self, schedule: BudgetSchedule) -> None:
        budgets = list(schedule.budgets)
        if len(budgets) > MAX_BINS:
            raise ValueError(
                f"schedule '{schedule.name}' has {len(budgets)} bins; the engine holds {MAX_BINS}"
            )
        values = budgets + [budgets[-1]] * (MAX_BINS - len(budgets))
        self.table.copy_(torch.tensor(values, dtype=torch.int64))
        self.bin_tokens.fill_(schedule.bin_tokens)

    def __call__(self, cached_len: torch.Tensor) -> torch.Tensor:
        return self.table[torch.clamp(cached_len // self.bin_tokens, max=MAX_BINS - 1)]


@dataclass
class StepOutput:
    """One decode step's sampled tokens and record, ``b`` rows: tokens [b] int64, logprobs [b] fp32, top ids
    [b, K] int64, top logprobs [b, K] fp32, budgets [b] int64 (``DENSE_BUDGET`` where dense)."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor
    budgets: torch.Tensor


def sample_step(
    logits: torch.Tensor,
    sampling: SamplingParams,
    uniforms: torch.Tensor,
    topk: int,
    cached_len: torch.Tensor,
    budgets: torch.Tensor | None,
    mix: torch.Tensor | None = None,
) -> StepOutput:
    """The tokens drawn from ``logits [B, V]`` with ``uniforms [B]`` and their record (logprob, top-K, the budget
    the step read with: ``DENSE_BUDGET`` where ``budgets`` is None, ``cached_len [B]`` giving the shape).
    ``mix [B]`` (``rollout.inject_mismatch``, :func:`~sparrow_nemo.rollout.sampling.injection_mix`): rows with a
    positive weight draw from the mixture with the uniform and record its logprobs; None = the plain step."""
    tokens = sample_tokens(logits, sampling, uniforms)
    if mix is not None:
        tokens = inject_mixture(logits, tokens, uniforms, mix)
    lp, top_ids, top_lp = token_logprobs(logits, tokens, topk)
    if mix is not None:
        vocab = logits.shape[-1]
        lp, top_lp = mixture_logprobs(lp, mix, vocab), mixture_logprobs(top_lp, mix, vocab)
    recorded = torch.full_like(cached_len, DENSE_BUDGET) if budgets is None else budgets
    return StepOutput(tokens, lp, top_ids, top_lp, recorded)


#: ``step(block_table [B, P], tokens [B], seq_len [B], budgets [B] | None) -> logits [B, V] fp32``
DecodeFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


class DecodeGraphs:
    """Bucketed decode-and-sample steps over static buffers (see the module docstring).

    Args:
        decode: the engine's decode step over its cache.
        device: where the buffers live; max_batch: the largest bucket; max_pages: block-table columns.
        capture: capture CUDA graphs (CUDA only); False runs the padded step eagerly.
    """

    def __init__(
        self, decode: DecodeFn, device: torch.device, max_batch: int, max_pages: int, capture: bool
    ) -> None:
        if capture and device.type != "cuda":
            raise ValueError("DecodeGraphs: CUDA graphs need a CUDA device")
        self.decode, self.device, self.capture = decode, device, capture
        self.buckets = bucket_sizes(max_batch)
        top = self.buckets[-1]
        self.table = torch.zeros(top, max_pages, dtype=torch.int32, device=device)
        self.tokens = torch.zeros(top, dtype=torch.int64, device=device)
        self.seq_len = torch.ones(top, dtype=torch.int64, device=device)
        self.uniforms = torch.zeros(top, dtype=torch.float64, device=device)
        self.mix = torch.zeros(top, dtype=torch.float64, device=device)
        self.budget_of = DeviceBudgets(device)
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, StepOutput]] = {}
        self._pool = None

    def reset(self) -> None:
        """Forget every captured graph (the tensors they read were reallocated)."""
        self._graphs.clear()
        self._pool = None

    def bucket(self, batch: int) -> int:
        """The smallest captured size >= ``batch``."""
        for size in self.buckets:
            if size >= batch:
                return size
        raise ValueError(f"DecodeGraphs: {batch} rows exceed the largest bucket {self.buckets[-1]}")

    def _step(self, size: int, dense: bool, sampling: SamplingParams, topk: int) -> StepOutput:
        """The static step on the first ``size`` rows of the buffers (what a graph captures)."""
        seq_len = self.seq_len[:size]
        budgets = None if dense else self.budget_of(seq_len)
        logits = self.decode(self.table[:size], self.tokens[:size], seq_len, budgets)
        mix = self.mix[:size] if sampling.inject_mismatch.on else None
        return sample_step(logits, sampling, self.uniforms[:size], topk, seq_len, budgets, mix)

    def run(
        self,
        table_rows: torch.Tensor,
        tokens: torch.Tensor,
        seq_len: torch.Tensor,
        uniforms: torch.Tensor,
        dense: bool,
        sampling: SamplingParams,
        topk: int,
        pad_page: int,
        mix: torch.Tensor | None = None,
    ) -> StepOutput:
        """One step of ``b`` rows (``table_rows [b, P]``, ``tokens``, ``seq_len [b]``, ``uniforms [b]``), padded
        to its bucket with rows that read page ``pad_page`` (the scratch page) at cached length 1; the schedule
        must be loaded (``budget_of.load``) unless ``dense``; ``mix [b]``: the injected rows' uniform weights (given
        exactly when ``sampling.inject_mismatch`` is on, :func:`sample_step`). Returns the first ``b`` rows of the outputs (copies)."""
        b, size = tokens.shape[0], self.bucket(tokens.shape[0])
        cols = table_rows.shape[1]
        self.table[:b, :cols].copy_(table_rows)
        self.table[b:size, 0] = pad_page
        self.tokens[:b].copy_(tokens)
        self.tokens[b:size].zero_()
        self.seq_len[:b].copy_(seq_len)
        self.seq_len[b:size].fill_(1)
        self.uniforms[:b].copy_(uniforms, non_blocking=True)
        self.uniforms[b:size].zero_()
        if mix is not None:
            self.mix[:b].copy_(mix, non_blocking=True)
            self.mix[b:size].zero_()
        if not self.capture:
            out = self._step(size, dense, sampling, topk)
        else:
            key = (
                size,
                dense,
                sampling.temperature,
                sampling.top_k,
                sampling.top_p,
                sampling.inject_mismatch.on,
                topk,
            )
            if key not in self._graphs:
                self._graphs[key] = self._capture(size, dense, sampling, topk)
            graph, out = self._graphs[key]
            graph.replay()
        return StepOutput(
            *(t[:b].clone() for t in (out.tokens, out.logprobs, out.top_ids, out.top_logprobs, out.budgets))
        )

    def _capture(
        self, size: int, dense: bool, sampling: SamplingParams, topk: int
    ) -> tuple[torch.cuda.CUDAGraph, StepOutput]:
        """Warm the step up on a side stream (kernel compiles, library handles), then capture it."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._step(size, dense, sampling, topk)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._step(size, dense, sampling, topk)
        self._pool = graph.pool()
        return graph, out
