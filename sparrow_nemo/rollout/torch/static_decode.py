"""Static-shape batched decode: one step as a fixed sequence of device ops, replayable from a CUDA graph.

The torch rollout engine's default loop (``decode_loop="compact"``) checks stops after every token and
compacts the batch when a sequence finishes; each step costs a host synchronisation and hundreds of
Python-launched kernels. :class:`StaticDecoder` runs the same math with static shapes instead:

- the batch is fixed for the whole wave (a live mask, not compaction): a finished sequence stays in
  its row until every sequence is done, its extra tokens dropped on the host. Once the host has seen
  it finish, its row is retired: it decodes at cached length 1 (position 0, one page read per layer),
  so it no longer costs attention bandwidth. Pages for prompt + the longest response are reserved up
  front, so nothing is allocated per token;
- one step = ``seq_len += 1``, the schedule's budget looked up on the device, the shared
  :class:`~sparrow_nemo.rollout.torch.decode_step.DecodeStep` (embeddings, norms, projections, attention, MLP, LM head), sampling and the
  logprob/top-k record, all written into preallocated buffers indexed by a device step counter;
- per-sample random streams stay on the host (CPU generators, one uniform per step, as in the
  compact loop); a block of ``check_every`` steps' uniforms is drawn ahead and copied to the device
  once per block. So a sample's tokens equal the compact loop's for the same seeds;
- stop tokens/strings are checked on the host once per block (one device-to-host copy of the
  block's tokens); with no stop tokens or strings (benchmarks) the loop never synchronises.

On CUDA the step is captured once per wave in a ``torch.cuda.CUDAGraph`` and replayed; elsewhere (and
with ``use_graph=False``) the same :meth:`StaticDecoder.step` runs eagerly, which is what CPU tests use.
Graph capture needs an attention backend without host syncs: the fused ``triton`` kernels.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sparrow_nemo.rollout.engine import FinishReason, SamplingParams, TokenTally
from sparrow_nemo.rollout.sampling import sample_tokens, token_logprobs
from sparrow_nemo.rollout.torch.decode_step import DecodeStep
from sparrow_nemo.rollout.torch.paged_cache import PagedKVCache
from sparrow_nemo.rollout.torch.stopping import StopRule
from sparrow_nemo.sparse.schedule import DENSE_BUDGET, BudgetSchedule


class DeviceBudgets:
    """``BudgetSchedule.budgets_for`` without its host-side range check, so it can run inside a graph.

    Holds the schedule's per-bin budgets as a device tensor; ``__call__(cached_len [B] int)`` returns
    int64 [B] tokens. Callers guarantee cached_len >= 0 (the decoder only ever increments it).
    """

    def __init__(self, schedule: BudgetSchedule, device: torch.device) -> None:
        self.bin_tokens = schedule.bin_tokens
        self.table = torch.tensor(schedule.budgets, dtype=torch.int64, device=device)

    def __call__(self, cached_len: torch.Tensor) -> torch.Tensor:
        bins = torch.clamp(cached_len // self.bin_tokens, max=self.table.numel() - 1)
        return self.table[bins]


def draw_uniform_block(generators: Sequence[torch.Generator], steps: int) -> torch.Tensor:
    """The next ``steps`` U[0, 1) draws of every generator: [steps, B] float64 on CPU.

    Row i equals what the i-th successive ``sampling.draw_uniforms(generators)`` call would return.
    """
    if not generators:
        return torch.empty(steps, 0, dtype=torch.float64)
    return torch.stack([torch.rand(steps, generator=g, dtype=torch.float64) for g in generators], dim=1)


class StaticDecoder:
    """Fixed-batch decode steps over an engine's paged cache, writing into preallocated records.

    Args:
        decode_step: the engine's :class:`~sparrow_nemo.rollout.torch.decode_step.DecodeStep` (model, attention
            backend, dense layers, sink/local pages).
        attention_backend: "torch" or "triton" (CUDA-graph capture needs "triton").
        cache, block_table: the paged cache and ``[B, P]`` int32 block table with pages reserved for
            every position the wave will reach.
        seq_len: [B] int64 tokens in the cache before the first step (the prompt lengths).
        steps: record rows (response positions), including row 0 = the prefill-sampled token.
        sampling, schedule: as in ``generate``; the schedule's budgets apply from ``decode_step.dense_layers`` on.
        check_every: steps per block of pre-drawn uniforms (and per host stop check).

    Buffers (device): ``tokens [B]``, ``seq_len [B]``, ``live [B]`` bool, ``step_idx [1]`` (next record row),
    ``uniforms [check_every, B]`` float64, records ``rec_tokens [steps, B]`` int64, ``rec_lp [steps, B]``
    float32, ``rec_top_ids [steps, B, K]`` int64, ``rec_top_lp [steps, B, K]`` float32,
    ``rec_cached [steps, B]`` int64, ``rec_budget [steps, B]`` int64.
    """

    def __init__(
        self,
        decode_step: DecodeStep,
        attention_backend: str,
        cache: PagedKVCache,
        block_table: torch.Tensor,
        seq_len: torch.Tensor,
        steps: int,
        sampling: SamplingParams,
        schedule: BudgetSchedule,
        check_every: int,
    ) -> None:
        if check_every <= 0:
            raise ValueError(f"stop_check_every must be > 0 steps, got {check_every}")
        if steps <= 0:
            raise ValueError(f"StaticDecoder: steps must be > 0, got {steps}")
        device = decode_step.model.device
        batch = block_table.shape[0]
        topk = min(sampling.logprobs_topk, decode_step.model.shape.vocab_size)
        self.decode_step, self.attention_backend = decode_step, attention_backend
        self.cache, self.block_table = cache, block_table
        self.sampling, self.check_every, self.steps = sampling, check_every, steps
        self.budget_of = None if schedule.is_dense else DeviceBudgets(schedule, device)
        self.tokens = torch.zeros(batch, dtype=torch.int64, device=device)
        self.seq_len = seq_len.to(device=device, dtype=torch.int64).clone()
        self.live = torch.ones(batch, dtype=torch.bool, device=device)
        self.step_idx = torch.ones(1, dtype=torch.int64, device=device)
        self.uniforms = torch.zeros(check_every, batch, dtype=torch.float64, device=device)
        self.rec_tokens = torch.zeros(steps, batch, dtype=torch.int64, device=device)
        self.rec_lp = torch.zeros(steps, batch, dtype=torch.float32, device=device)
        self.rec_top_ids = torch.zeros(steps, batch, topk, dtype=torch.int64, device=device)
        self.rec_top_lp = torch.zeros(steps, batch, topk, dtype=torch.float32, device=device)
        self.rec_cached = torch.zeros(steps, batch, dtype=torch.int64, device=device)
        self.rec_budget = torch.zeros(steps, batch, dtype=torch.int64, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None

    def record_first(self, logits: torch.Tensor, uniforms: torch.Tensor) -> None:
        """Sample row 0 (the first step's input tokens) from the prefill ``logits [B, V]`` with
        ``uniforms [B]`` float64; its budget is recorded as DENSE_BUDGET (prefill is dense)."""
        self._sample_into(0, logits, uniforms.to(logits.device), torch.full_like(self.seq_len, DENSE_BUDGET))

    def step(self) -> None:
        """One decode step on the device, no host sync (with the triton backend): feeds ``tokens``,
        samples the next ones and records them at row ``step_idx``; advances ``seq_len`` and ``step_idx``."""
        # The last sampled token enters the cache now; retired rows restart at position 0 every step.
        self.seq_len.copy_(torch.where(self.live, self.seq_len + 1, 1))
        budgets = None if self.budget_of is None else self.budget_of(self.seq_len)
        logits = self.decode_step(self.cache, self.block_table, self.tokens, self.seq_len, budgets)
        row = (self.step_idx - 1) % self.check_every
        uniforms = self.uniforms.index_select(0, row)[0]
        recorded = torch.full_like(self.seq_len, DENSE_BUDGET) if budgets is None else budgets
        self._sample_into(self.step_idx, logits, uniforms, recorded)
        self.step_idx += 1

    def _sample_into(
        self, row: int | torch.Tensor, logits: torch.Tensor, uniforms: torch.Tensor, budgets: torch.Tensor
    ) -> None:
        """Sample from ``logits [B, V]`` into ``tokens`` and record row ``row`` (int or [1] device tensor)."""
        tokens = sample_tokens(logits, self.sampling, uniforms)
        lp, top_ids, top_lp = token_logprobs(logits, tokens, self.rec_top_ids.shape[-1])
        self.tokens.copy_(tokens)
        idx = torch.as_tensor([row], device=self.tokens.device) if isinstance(row, int) else row
        for buf, value in (
            (self.rec_tokens, tokens),
            (self.rec_lp, lp),
            (self.rec_top_ids, top_ids),
            (self.rec_top_lp, top_lp),
            (self.rec_cached, self.seq_len),
            (self.rec_budget, budgets),
        ):
            buf.index_copy_(0, idx, value[None].to(buf.dtype))

    def capture(self) -> None:
        """Run one real step eagerly on a side stream (it compiles the kernels and initialises the
        libraries, as CUDA-graph capture requires), then capture :meth:`step` in a CUDA graph; from
        then on :meth:`run` replays it."""
        device = self.tokens.device
        if device.type != "cuda":
            raise RuntimeError("StaticDecoder.capture needs a CUDA device")
        if self.attention_backend != "triton":
            raise RuntimeError(
                "CUDA-graph decode needs attention_backend='triton' (the torch path syncs with the host)"
            )
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.step()
        self.graph = graph

    def run(self, n: int) -> None:
        """``n`` decode steps: graph replays when captured, else eager :meth:`step` calls."""
        for _ in range(n):
            if self.graph is not None:
                self.graph.replay()
            else:
                self.step()

    def retire(self, rows: Sequence[int]) -> None:
        """Mark finished ``rows`` dead (stream-ordered): from the next queued step on they decode at
        cached length 1, overwriting only their own position 0; their records are meaningless."""
        if rows:
            self.live[torch.as_tensor(list(rows), device=self.live.device)] = False

    def load_uniforms(self, block: torch.Tensor) -> None:
        """Copy ``block [n <= check_every, B]`` float64 host uniforms into rows 0..n-1 (stream-ordered:
        steps already queued read the old values)."""
        src = block.pin_memory() if self.uniforms.is_cuda else block
        self.uniforms[: block.shape[0]].copy_(src, non_blocking=self.uniforms.is_cuda)

    def records(self, upto: int) -> dict[str, torch.Tensor]:
        """Rows 0..upto-1 of every record, on CPU, shaped [upto, B(, K)]."""
        names = ("response_ids", "logprobs", "top_ids", "top_logprobs", "cached_len", "kv_budget")
        bufs = (
            self.rec_tokens,
            self.rec_lp,
            self.rec_top_ids,
            self.rec_top_lp,
            self.rec_cached,
            self.rec_budget,
        )
        return {name: buf[:upto].cpu() for name, buf in zip(names, bufs)}


def decode_static(
    dec: StaticDecoder,
    generators: Sequence[torch.Generator],
    max_new: Sequence[int],
    stop: StopRule,
    use_graph: bool,
    tally: TokenTally | None = None,
) -> tuple[list[dict[str, torch.Tensor]], list[tuple[FinishReason, int | str | None]]]:
    """Drive ``dec`` (row 0 already recorded) until every sample has stopped.

    Blocks of ``dec.check_every`` steps: draw the block's uniforms on the host (sampling only), queue
    the steps (with ``use_graph``, the wave's first step runs eagerly inside ``capture``, then replays),
    and, when ``stop`` has stop tokens or strings, copy the block's tokens to the host and check them
    token by token exactly as the compact loop does. Without them only the length cap applies and the
    loop never waits for the device until the records are read. ``tally`` (optional) counts each
    block's new tokens: those of the rows still live when stops are watched, else batch x steps.

    Returns per-sample record slices (``StaticDecoder.records`` names, rows up to its stop) and finish
    reasons, both in sample order.
    """
    batch = len(generators)
    watch = bool(stop.stop_ids or stop.stop_strings)
    responses: list[list[int]] = [[] for _ in range(batch)]
    finished: list[tuple[FinishReason, int | str | None] | None] = [None] * batch

    def scan(lo: int, hi: int) -> None:  # host stop check of rows lo .. hi-1
        if not watch:
            return
        rows = dec.rec_tokens[lo:hi].cpu().tolist()
        done = []
        for s in range(batch):
            for row in rows:
                if finished[s] is not None:
                    break
                responses[s].append(row[s])
                finished[s] = stop.check(responses[s], max_new[s])
                if finished[s] is not None:
                    done.append(s)
        dec.retire(done)

    scan(0, 1)
    if tally is not None:
        tally.add(batch)
    total = dec.steps
    i = 1
    while i < total and (not watch or any(f is None for f in finished)):
        n = min(dec.check_every, total - i)
        if dec.sampling.temperature > 0:
            dec.load_uniforms(draw_uniform_block(generators, n))
        if use_graph and dec.graph is None:
            dec.capture()  # includes this block's first step
            dec.run(n - 1)
        else:
            dec.run(n)
        before = sum(map(len, responses))
        scan(i, i + n)
        if tally is not None:
            tally.add(sum(map(len, responses)) - before if watch else batch * n)
        i += n
    if watch:
        lengths, reasons = [len(r) for r in responses], [f for f in finished if f is not None]
    else:
        lengths, reasons = list(max_new), [("length", None)] * batch
    rec = dec.records(max(lengths))
    fields = [{name: t[:n, s].clone() for name, t in rec.items()} for s, n in enumerate(lengths)]
    return fields, reasons
