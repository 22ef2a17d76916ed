"""Decode cost model: predicted rollout time and speedup of a sparsity schedule against dense.

One decode step of a batch costs (Kinetics-style "effective FLOPs", expressed in seconds)

    time = FLOPs / peak_flops + bytes / mem_bandwidth + page_bytes / page_read_bandwidth + step_overhead_s

i.e. the compute term and the memory term are added, not overlapped with max(): the sum is what
Kinetics uses to rank inference configurations, it is an upper bound of an overlapped kernel and
it keeps both terms visible when the memory term dominates (long-context decode). Terms per step:

- FLOPs: 2 * non-embedding params * live sequences (matmuls incl. the LM head);
  attention 4 * Hq * D * (KV tokens read, summed over layers) per sequence (QK^T and PV);
  page scoring 2 * Hkv * D * landmarks per page * pages scored per sparse layer per sequence.
- bytes: all non-embedding weights once per step; K and V of every token read (2 * Hkv * D *
  kv_bytes per token per layer); the page landmarks scored (Hkv * D * centroid_bytes per landmark
  per page per sparse layer): one centroid per page for the paper's ``centroid`` page score, a
  per-channel key minimum and maximum for ``minmax`` (1/page_size, resp. 2/page_size of the keys). The K and V a sparse layer reads
  from the pages it selected are ``page_bytes``: scattered runs of one page of one KV head, which a GPU
  reads as fast as the rest (``page_read_bandwidth`` unset) and a CPU core several times slower
  (measured: docs/cpu_decode.md; :mod:`sparrow_nemo.rollout.tools.cost_fit` fits it).

The first ``dense_layers`` layers always read the whole cache (the paper keeps 2 layers dense);
the others read the pages that :func:`sparrow_nemo.sparse.attention.selected_page_count` keeps
and score every page only when the sequence exceeds its budget (otherwise all pages are kept
and no scoring is needed). Prefill is dense in both arms and is left out.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from sparrow_nemo.model_shapes import Qwen3Shape, get_shape
from sparrow_nemo.sparse.attention import selected_page_count
from sparrow_nemo.sparse.pattern import PAGE_SCORES, landmarks_per_page
from sparrow_nemo.sparse.schedule import BudgetSchedule

__all__ = [
    "HARDWARE",
    "DecodeCostModel",
    "Hardware",
    "RolloutCost",
    "StepCost",
    "predicted_speedup",
    "rollout_cost",
]


@dataclass(frozen=True)
class Hardware:
    """Accelerator constants of the cost model.

    Attributes:
        name: label.
        peak_flops: dense bf16 matmul throughput, FLOP/s.
        mem_bandwidth: achievable HBM bandwidth, bytes/s.
        step_overhead_s: fixed time per decode step (kernel launches, sampling), seconds.
        page_read_bandwidth: bandwidth of a sparse layer's reads of its selected pages, bytes/s; None =
            ``mem_bandwidth``.
    """

    name: str
    peak_flops: float
    mem_bandwidth: float
    step_overhead_s: float = 0.0
    page_read_bandwidth: float | None = None

    def __post_init__(self) -> None:
        if self.peak_flops <= 0 or self.mem_bandwidth <= 0 or (self.page_read_bandwidth or 1.0) <= 0:
            raise ValueError(
                f"hardware '{self.name}': peak_flops, mem_bandwidth and page_read_bandwidth must be > 0, got "
                f"{self.peak_flops}, {self.mem_bandwidth} and {self.page_read_bandwidth}"
            )
        if self.step_overhead_s < 0:
            raise ValueError(
                f"hardware '{self.name}': step_overhead_s must be >= 0, got {self.step_overhead_s}"
            )

    @classmethod
    def from_json(cls, path: str | Path) -> Hardware:
        """Measured constants from a JSON object with this class's field names (benchmarks write it)."""
        data = json.loads(Path(path).read_text())
        names = {f.name for f in fields(cls)}
        if not isinstance(data, dict) or set(data) - names or {"peak_flops", "mem_bandwidth"} - set(data):
            raise ValueError(
                f"{path}: expected a JSON object with keys peak_flops, mem_bandwidth and optionally "
                f"name, step_overhead_s, page_read_bandwidth; got "
                f"{sorted(data) if isinstance(data, dict) else type(data).__name__}"
            )
        page_bw = data.get("page_read_bandwidth")
        return cls(
            name=str(data.get("name", Path(path).stem)),
            peak_flops=float(data["peak_flops"]),
            mem_bandwidth=float(data["mem_bandwidth"]),
            step_overhead_s=float(data.get("step_overhead_s", 0.0)),
            page_read_bandwidth=None if page_bw is None else float(page_bw),
        )

    @property
    def page_bandwidth(self) -> float:
        """Bytes/s of a sparse layer's selected-page reads (``page_read_bandwidth`` or ``mem_bandwidth``)."""
        return self.page_read_bandwidth or self.mem_bandwidth

    def to_json(self, path: str | Path) -> None:
        """Write the constants as JSON (the format :meth:`from_json` reads)."""
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")


#: H200: 989 TFLOP/s dense bf16 (spec) and the 4.4 TB/s dense decode attention reaches (docs/METHOD.md).
#: H100 SXM: 989 TFLOP/s dense bf16 and 3.35 TB/s HBM3 (spec sheet, not measured here).
HARDWARE: dict[str, Hardware] = {
    "h200": Hardware("h200", peak_flops=989e12, mem_bandwidth=4.4e12),
    "h100": Hardware("h100", peak_flops=989e12, mem_bandwidth=3.35e12),
}


@dataclass(frozen=True)
class StepCost:
    """Cost of decode steps, seconds; tensors share the steps' leading shape."""

    compute_s: torch.Tensor
    memory_s: torch.Tensor
    overhead_s: torch.Tensor

    @property
    def total_s(self) -> torch.Tensor:
        """compute + memory + overhead, seconds."""
        return self.compute_s + self.memory_s + self.overhead_s


@dataclass(frozen=True)
class RolloutCost:
    """Predicted time of one batched generation, seconds, and its size."""

    total_s: float
    compute_s: float
    memory_s: float
    overhead_s: float
    decode_steps: int
    tokens: int

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second."""
        return self.tokens / self.total_s if self.total_s > 0 else 0.0


@dataclass(frozen=True)
class DecodeCostModel:
    """Per-step decode cost of one model on one accelerator.

    Attributes:
        shape: the model (layers, hidden, heads, KV heads, head dim, intermediate, vocab).
        hardware: the accelerator constants.
        dense_layers: leading layers that always attend densely (the paper: 2).
        weight_bytes, kv_bytes: bytes per weight / per K or V element (bf16: 2).
        centroid_bytes: bytes per landmark element (centroid or key bound; the paged layout stores float32: 4).
        page_score: the sparse rule's page score (``sparsity.page_score``): ``centroid`` reads one landmark
            vector per page and KV head when scoring, ``minmax`` two (the key bounds).
    """

    shape: Qwen3Shape
    hardware: Hardware
    dense_layers: int = 2
    weight_bytes: int = 2
    kv_bytes: int = 2
    centroid_bytes: int = 4
    page_score: str = "centroid"

    def __post_init__(self) -> None:
        if self.page_score not in PAGE_SCORES:
            raise ValueError(f"page_score must be one of {PAGE_SCORES}, got {self.page_score!r}")
        if not 0 <= self.dense_layers <= self.shape.num_layers:
            raise ValueError(
                f"dense_layers must lie in [0, {self.shape.num_layers}], got {self.dense_layers}"
            )
        if min(self.weight_bytes, self.kv_bytes, self.centroid_bytes) <= 0:
            raise ValueError("weight_bytes, kv_bytes and centroid_bytes must be > 0")

    @property
    def landmarks_per_page(self) -> int:
        """Vectors of Hkv * D elements a page's score reads (:func:`~sparrow_nemo.sparse.pattern.landmarks_per_page`)."""
        return landmarks_per_page(self.page_score)

    @classmethod
    def for_preset(cls, model: str, hardware: str = "h200", **options: int) -> DecodeCostModel:
        """Model from the names in ``model_shapes.PRESETS`` and :data:`HARDWARE`."""
        if hardware.lower() not in HARDWARE:
            raise ValueError(f"unknown hardware '{hardware}'; known: {', '.join(HARDWARE)}")
        return cls(shape=get_shape(model), hardware=HARDWARE[hardware.lower()], **options)

    def step_cost(
        self,
        cached_len: torch.Tensor,
        kv_tokens_read: torch.Tensor,
        scored_pages: torch.Tensor,
        live: torch.Tensor,
    ) -> StepCost:
        """Cost of decode steps of a batch.

        Args:
            cached_len: [..., B] integer tokens in the cache of column b's sequences (read by dense layers).
            kv_tokens_read: [..., B] tokens such a sequence reads in one sparse layer.
            scored_pages: [..., B] pages scored per sparse layer (0 when no selection runs).
            live: [..., B] how many generating sequences column b stands for (bool/0-1 per sequence,
                or a count of sequences in the same state); the leading dims index steps.

        Returns:
            :class:`StepCost` with [...] tensors (float64 seconds), one entry per step.
        """
        s, hw = self.shape, self.hardware
        sparse_layers = s.num_layers - self.dense_layers
        live = live.to(torch.float64)
        n_live = live.sum(dim=-1)
        params = float(s.non_embedding_parameters())
        kv_layer_tokens = (self.dense_layers * cached_len + sparse_layers * kv_tokens_read).to(torch.float64)
        pages = (sparse_layers * scored_pages).to(torch.float64) * self.landmarks_per_page
        head_d = s.num_attention_heads * s.head_dim
        kv_d = s.num_key_value_heads * s.head_dim

        flops = 2 * params * n_live + ((4 * head_d * kv_layer_tokens + 2 * kv_d * pages) * live).sum(-1)
        in_order, scattered = self.step_bytes(cached_len, kv_tokens_read, scored_pages, live)
        stepping = (n_live > 0).to(torch.float64)  # steps with at least one live sequence
        overhead = stepping * hw.step_overhead_s
        memory = in_order / hw.mem_bandwidth + scattered / hw.page_bandwidth
        return StepCost(flops / hw.peak_flops, memory, overhead)

    def step_bytes(
        self,
        cached_len: torch.Tensor,
        kv_tokens_read: torch.Tensor,
        scored_pages: torch.Tensor,
        live: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Bytes decode steps read, as :meth:`step_cost` takes its arguments: (in order, scattered) [...] float64.

        Scattered = the K and V sparse layers read from their selected pages (only where a selection ran:
        ``scored_pages > 0``); in order = the weights, the dense layers' K and V, the landmarks scored, and a
        sparse layer's K and V where it kept every page.
        """
        s = self.shape
        sparse_layers = s.num_layers - self.dense_layers
        live = live.to(torch.float64)
        kv_d = s.num_key_value_heads * s.head_dim
        kv_token = 2 * kv_d * self.kv_bytes  # K and V of one token in one layer
        selected = (scored_pages > 0).to(torch.float64)
        sparse_kv = sparse_layers * kv_tokens_read.to(torch.float64) * kv_token
        per_seq_order = (
            self.dense_layers * cached_len.to(torch.float64) * kv_token
            + (1 - selected) * sparse_kv
            + kv_d
            * self.centroid_bytes
            * self.landmarks_per_page
            * (sparse_layers * scored_pages).to(torch.float64)
        )
        stepping = (live.sum(dim=-1) > 0).to(torch.float64)
        weights = stepping * float(s.non_embedding_parameters()) * self.weight_bytes
        return weights + (per_seq_order * live).sum(-1), (selected * sparse_kv * live).sum(-1)

    def prefill_seconds(self, tokens: int, cached_before: int = 0) -> float:
        """Seconds of one dense forward of ``tokens`` new tokens after ``cached_before`` cached ones (a prefill,
        or the recompute of a preempted sequence): 2 x non-embedding parameters FLOPs per token plus causal
        attention (4 * Hq * D per query-key pair and layer) at the peak FLOP/s, plus the weights and the
        keys/values written and read once at the memory bandwidth, plus one step overhead."""
        s, hw = self.shape, self.hardware
        pairs = tokens * cached_before + tokens * (tokens + 1) / 2
        flops = (
            2 * s.non_embedding_parameters() * tokens
            + 4 * s.num_attention_heads * s.head_dim * s.num_layers * pairs
        )
        kv = 2 * s.num_key_value_heads * s.head_dim * self.kv_bytes * s.num_layers * (cached_before + tokens)
        weights = s.non_embedding_parameters() * self.weight_bytes
        return flops / hw.peak_flops + (weights + kv) / hw.mem_bandwidth + hw.step_overhead_s

    def sparse_reads(
        self, cached_len: torch.Tensor, schedule: BudgetSchedule
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(KV tokens read per sparse layer, pages scored per sparse layer) under ``schedule``.

        Args:
            cached_len: [...] integer tokens in the cache.

        Returns:
            Two int64 tensors shaped like cached_len. Kept pages count whole (a partial last page
            reads at most the cached tokens).
        """
        flat = cached_len.reshape(-1).to(torch.int64)
        budget = schedule.budgets_for(flat)
        ps = schedule.page_size
        kept = selected_page_count(flat, budget, ps)
        n_pages = (flat + ps - 1) // ps
        read = torch.minimum(kept * ps, flat)
        scored = torch.where(n_pages > budget // ps, n_pages, torch.zeros_like(n_pages))
        return read.view(cached_len.shape), scored.view(cached_len.shape)

    def rollout_cost(
        self,
        schedule: BudgetSchedule,
        length_distribution: Sequence[int] | torch.Tensor,
        prompt_len: int | Sequence[int] | torch.Tensor = 512,
        chunk_steps: int = 4096,
    ) -> RolloutCost:
        """Predicted decode time of one batch: every sequence starts together and leaves when done.

        Args:
            schedule: budget per cached length (``BudgetSchedule.dense()`` for the baseline).
            length_distribution: [N] final response lengths, tokens (N = batch size).
            prompt_len: prompt tokens, one int for all or [N].
            chunk_steps: steps integrated at once (memory ~ chunk_steps * distinct prompt lengths).

        Returns:
            :class:`RolloutCost`. Response token i (i = 0 .. len-1) is one decode step with
            cached length prompt_len + i, whose bin picks the budget.
        """
        lengths = torch.as_tensor(length_distribution, dtype=torch.int64).reshape(-1)
        prompts = torch.as_tensor(prompt_len, dtype=torch.int64).reshape(-1).expand(lengths.shape[0])
        if lengths.numel() == 0 or int(lengths.min()) < 0 or int(prompts.min()) < 0:
            raise ValueError(
                "length_distribution must be non-empty and lengths/prompt_len must be >= 0 tokens"
            )
        if chunk_steps <= 0:
            raise ValueError(f"chunk_steps must be > 0, got {chunk_steps}")
        steps = int(lengths.max())
        # Sequences with the same prompt length share every step's state: one column per prompt
        # length, weighted by how many of its sequences are still generating.
        prompt_values, group = torch.unique(prompts, return_inverse=True)
        sorted_lengths = [torch.sort(lengths[group == u]).values for u in range(len(prompt_values))]
        totals = torch.zeros(3, dtype=torch.float64)
        for start in range(0, steps, chunk_steps):
            t = torch.arange(start, min(start + chunk_steps, steps))  # [T]
            live = torch.stack(
                [len(sl) - torch.searchsorted(sl, t, right=True) for sl in sorted_lengths], dim=-1
            )  # [T, U] sequences with length > t
            cached = prompt_values[None, :] + t[:, None]
            read, scored = self.sparse_reads(cached, schedule)
            cost = self.step_cost(cached, read, scored, live)
            totals += torch.stack([cost.compute_s.sum(), cost.memory_s.sum(), cost.overhead_s.sum()])
        compute_s, memory_s, overhead_s = (float(x) for x in totals)
        return RolloutCost(
            total_s=compute_s + memory_s + overhead_s,
            compute_s=compute_s,
            memory_s=memory_s,
            overhead_s=overhead_s,
            decode_steps=steps,
            tokens=int(lengths.sum()),
        )

    def predicted_speedup(
        self,
        schedule: BudgetSchedule,
        length_distribution: Sequence[int] | torch.Tensor,
        prompt_len: int | Sequence[int] | torch.Tensor = 512,
    ) -> float:
        """Dense rollout time / ``schedule`` rollout time on the same lengths (> 1 = faster)."""
        dense = BudgetSchedule.dense(schedule.bin_tokens, schedule.page_size)
        base = self.rollout_cost(dense, length_distribution, prompt_len).total_s
        return base / self.rollout_cost(schedule, length_distribution, prompt_len).total_s


def rollout_cost(
    schedule: BudgetSchedule,
    length_distribution: Sequence[int] | torch.Tensor,
    model: DecodeCostModel,
    prompt_len: int | Sequence[int] | torch.Tensor = 512,
) -> RolloutCost:
    """Module-level form of :meth:`DecodeCostModel.rollout_cost`."""
    return model.rollout_cost(schedule, length_distribution, prompt_len)


def predicted_speedup(
    schedule: BudgetSchedule,
    length_distribution: Sequence[int] | torch.Tensor,
    model: DecodeCostModel,
    prompt_len: int | Sequence[int] | torch.Tensor = 512,
) -> float:
    """Module-level form of :meth:`DecodeCostModel.predicted_speedup`."""
    return model.predicted_speedup(schedule, length_distribution, prompt_len)
