"""Sparse teacher-forced forward: the policy re-computes what the sparse rollout engine computed.

At every decode position ``t`` of a rollout (``t >= prompt_len``: the query of the token at ``t``,
whose next-token distribution produced response token ``t + 1 - prompt_len``) the engine attended,
in each layer from ``dense_layers`` on, only to the pages chosen by the method layer's rule for a
cache of ``t + 1`` tokens under the budget ``schedule.budget(t + 1)``. Page centroids were the means
of the keys stored so far in each page: complete pages average their ``page_size`` keys, the current
(partial) page averages its keys up to ``t``. (The current page is always a local page when
``local_pages >= 1``, so its centroid never changes the choice; it is modelled exactly anyway.)
Prompt positions (``t < prompt_len``) were dense prefill, and so are the first ``dense_layers``.

Here the whole sequence runs through the megatron ``GPTModel`` in one pass: each sparse layer's
core attention is swapped for :class:`SparseCoreAttention`, which builds a per-query boolean mask
``[B, Hkv, S, S]`` from that layer's own queries and keys with the method layer's selection
(:func:`sparrow_nemo.sparse.attention.select_pages_from_centroids`), then runs exact softmax
attention over it. Selection is per KV head, so under tensor parallelism it is local to each rank.
Gradients flow to everything upstream of the attention (e.g. LoRA adapters); the mask itself is not
differentiable.

Memory is O(B * Hq * S^2) (a torch path for CPU and short sequences); long GPU sequences need a
block-sparse attention kernel instead.
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from sparrow_nemo.policy.batch import PolicyBatch
from sparrow_nemo.policy.logprobs import TOP_K, LogprobOutput
from sparrow_nemo.policy.model import PolicyModelSpec, unwrap_model
from sparrow_nemo.policy.schedule import compute_logprobs
from sparrow_nemo.sparse.attention import select_pages_from_centroids, selected_token_mask
from sparrow_nemo.sparse.pattern import SparsePattern
from sparrow_nemo.sparse.schedule import DENSE_BUDGET, BudgetSchedule

if TYPE_CHECKING:
    from sparrow_nemo.policy.lora import MegatronLora

#: query positions per selection chunk: bounds the per-query centroid copies to
#: QUERY_CHUNK * Hkv * P * D floats per sequence.
QUERY_CHUNK = 64


@dataclass(frozen=True)
class SparsePlan:
    """What one micro-batch's sparse forward needs besides the tokens.

    Attributes:
        prompt_lens: [B] int64 prompt tokens per row (positions below are dense prefill).
        query_budget: [B, S] int64 KV budget in tokens of the query at each position: the schedule at
            the cached length ``t + 1`` for decode positions, ``DENSE_BUDGET`` for prompt positions.
    """

    prompt_lens: torch.Tensor
    query_budget: torch.Tensor

    def __post_init__(self) -> None:
        if self.query_budget.dim() != 2 or self.query_budget.dtype != torch.int64:
            raise ValueError(
                f"SparsePlan.query_budget must be [B, S] int64, got {tuple(self.query_budget.shape)} "
                f"{self.query_budget.dtype}"
            )
        b = self.query_budget.shape[0]
        if self.prompt_lens.shape != (b,) or self.prompt_lens.dtype != torch.int64:
            raise ValueError(
                f"SparsePlan.prompt_lens must be [{b}] int64, got {tuple(self.prompt_lens.shape)} "
                f"{self.prompt_lens.dtype}"
            )
        if b and int(self.prompt_lens.min()) < 1:
            raise ValueError(f"SparsePlan.prompt_lens must be >= 1, got {self.prompt_lens.tolist()}")
        if self.query_budget.numel() and int(self.query_budget.min()) < 0:
            raise ValueError("SparsePlan.query_budget must be >= 0 tokens")

    @classmethod
    def from_schedule(cls, schedule: BudgetSchedule, prompt_lens: torch.Tensor, width: int) -> SparsePlan:
        """The engine's convention: the query at decode position t uses ``schedule.budget(t + 1)``.

        Args:
            schedule: the rollout schedule (a dense one gives ``DENSE_BUDGET`` everywhere).
            prompt_lens: [B] integer prompt lengths; width: S, the padded sequence length.
        """
        prompt_lens = prompt_lens.to(torch.int64)
        pos = torch.arange(width, dtype=torch.int64).expand(prompt_lens.shape[0], width)
        if schedule.is_dense:
            budget = torch.full_like(pos, DENSE_BUDGET)
        else:
            budget = schedule.budgets_for((pos + 1).reshape(-1)).to(torch.int64).view_as(pos)
        prompt = pos < prompt_lens[:, None]
        return cls(prompt_lens, torch.where(prompt, torch.full_like(budget, DENSE_BUDGET), budget))

    @classmethod
    def from_rollouts(
        cls, prompt_lens: Sequence[int], kv_budgets: Sequence[torch.Tensor], width: int
    ) -> SparsePlan:
        """The budgets a rollout engine recorded: response token i was predicted by the query at position
        ``prompt_len - 1 + i`` under ``kv_budget[i]`` (``RolloutSample.kv_budget``); other positions dense.

        Args:
            prompt_lens: B prompt lengths; kv_budgets: B tensors [Lr] of integer tokens; width: S.
        """
        if len(prompt_lens) != len(kv_budgets):
            raise ValueError(
                f"SparsePlan.from_rollouts: {len(prompt_lens)} prompt lengths, {len(kv_budgets)} budgets"
            )
        budget = torch.full((len(prompt_lens), width), DENSE_BUDGET, dtype=torch.int64)
        for row, (n, kv) in enumerate(zip(prompt_lens, kv_budgets)):
            if n - 1 + kv.numel() > width:
                raise ValueError(
                    f"SparsePlan.from_rollouts: row {row} needs {n - 1 + kv.numel()} > {width} positions"
                )
            budget[row, n - 1 : n - 1 + kv.numel()] = kv.to(torch.int64)
        return cls(torch.tensor(list(prompt_lens), dtype=torch.int64), budget)


def sparse_attention_mask(
    q: torch.Tensor, k: torch.Tensor, plan: SparsePlan, pattern: SparsePattern
) -> torch.Tensor:
    """Which keys each query attends to under decode-time sparse attention.

    Args:
        q: [B, Hq, S, D] queries and k: [B, Hkv, S, D] keys, as attention sees them (after q/k norm and
            rotary); query heads h*G .. h*G+G-1 share KV head h.
        plan: prompt lengths and per-position budgets of this batch ([B], [B, S]).

    Returns:
        bool [B, Hkv, S, S], True where query t attends key u: causal (u <= t) for prompt positions,
        and for decode positions the tokens of the pages selected for a cache of t + 1 tokens.
    """
    batch, num_q_heads, width, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if k.shape != (batch, num_kv_heads, width, head_dim) or plan.query_budget.shape != (batch, width):
        raise ValueError(
            f"sparse_attention_mask: q {tuple(q.shape)}, k {tuple(k.shape)} and plan.query_budget "
            f"{tuple(plan.query_budget.shape)} must be [B, Hq, S, D], [B, Hkv, S, D] and [B, S]"
        )
    ps, device = pattern.page_size, q.device
    pos = torch.arange(width, device=device)
    mask = (pos[None, :] <= pos[:, None]).expand(batch, num_kv_heads, width, width).clone()
    prompt_lens = plan.prompt_lens.to(device)
    first = int(prompt_lens.min()) if batch else width
    if first >= width:
        return mask
    num_pages = math.ceil(width / ps)
    keys = F.pad(k.detach().float(), (0, 0, 0, num_pages * ps - width))
    pages = keys.view(batch, num_kv_heads, num_pages, ps, head_dim)
    running = pages.cumsum(dim=3) / torch.arange(1, ps + 1, device=device, dtype=torch.float32)[:, None]
    complete = running[:, :, :, -1]  # [B, Hkv, P, D]: centroid of a full page
    budget = plan.query_budget.to(device)
    for lo in range(first, width, QUERY_CHUNK):
        t = pos[lo : lo + QUERY_CHUNK]
        n = t.numel()
        cents = complete[:, :, None].expand(batch, num_kv_heads, n, num_pages, head_dim).clone()
        cents[:, :, torch.arange(n, device=device), t // ps] = running[:, :, t // ps, t % ps]
        page_idx = select_pages_from_centroids(
            q[:, :, lo : lo + n].transpose(1, 2).reshape(batch * n, num_q_heads, head_dim),
            cents.permute(0, 2, 1, 3, 4).reshape(batch * n, num_kv_heads, num_pages, head_dim),
            (t + 1).repeat(batch),
            budget[:, lo : lo + n].reshape(-1),
            ps,
            pattern.sink_pages,
            pattern.local_pages,
        )
        chosen = selected_token_mask(page_idx, (t + 1).repeat(batch), width, ps)  # [B*n, Hkv, S]
        decode = (t[None, :] >= prompt_lens[:, None])[:, None, :, None]  # [B, 1, n, 1]
        chosen = chosen.view(batch, n, num_kv_heads, width).transpose(1, 2)
        mask[:, :, lo : lo + n] = torch.where(decode, chosen, mask[:, :, lo : lo + n])
    return mask


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Exact softmax attention under a per-KV-head mask (differentiable in q, k, v).

    Args:
        q: [B, Hq, S, D]; k, v: [B, Hkv, S, D]; mask: bool [B, Hkv, S, S], True = attend (every row needs
            at least one True).

    Returns:
        [B, Hq, S, D] float32; scale 1/sqrt(D), computed in float32.
    """
    group = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(
        q.float(),
        k.float().repeat_interleave(group, dim=1),
        v.float().repeat_interleave(group, dim=1),
        attn_mask=mask.repeat_interleave(group, dim=1),
        scale=1.0 / math.sqrt(q.shape[-1]),
    )


class _PlanQueue:
    """Plans of the micro-batches still to run, in forward order, and the one running now."""

    def __init__(self, plans: Sequence[SparsePlan]) -> None:
        self.pending: deque[SparsePlan] = deque(plans)
        self.current: SparsePlan | None = None

    def next(self, tokens: torch.Tensor) -> None:
        """Start the next micro-batch (called before each model forward with its ``tokens [B, S]``)."""
        if not self.pending:
            raise RuntimeError("sparse forward: more micro-batch forwards than SparsePlans were given")
        plan = self.pending.popleft()
        if plan.query_budget.shape != tuple(tokens.shape):
            raise ValueError(
                f"sparse forward: the plan is for [B, S]={tuple(plan.query_budget.shape)} but the "
                f"micro-batch tokens are {tuple(tokens.shape)}"
            )
        self.current = plan


class SparseCoreAttention(torch.nn.Module):
    """Drop-in for megatron's core attention of one layer: decode-time sparse attention of a rollout.

    Takes megatron's ``query [sq, b, np, hn]``, ``key``/``value [sk, b, ng, hn]`` (this rank's heads)
    and returns ``[sq, b, np * hn]`` in the query dtype. megatron's causal/padding ``attention_mask``
    is not needed: the sparse mask is causal, and padded queries are never scored.
    """

    def __init__(self, queue: _PlanQueue, pattern: SparsePattern) -> None:
        super().__init__()
        self.queue = queue
        self.pattern = pattern

    def forward(self, query, key, value, attention_mask=None, **_unused) -> torch.Tensor:
        plan = self.queue.current
        if plan is None:
            raise RuntimeError("SparseCoreAttention ran outside a sparse_forward() micro-batch")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
        mask = sparse_attention_mask(q, k, plan, self.pattern)
        out = masked_attention(q, k, v, mask)  # [b, np, s, hn]
        sq, b, heads, dim = query.shape
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * dim).to(query.dtype)


@contextlib.contextmanager
def sparse_forward(
    model: torch.nn.Module, plans: Sequence[SparsePlan], pattern: SparsePattern
) -> Iterator[None]:
    """Inside the block, forwards of ``model`` compute decode-time sparse attention.

    The i-th forward of the model (one per micro-batch, in order, on every pipeline stage) uses
    ``plans[i]``. Layers with global index < ``pattern.dense_layers`` keep megatron's dense attention.
    On exit the original core attention modules are restored; a RuntimeError is raised when fewer
    forwards ran than plans were given.

    Args:
        model: this rank's (possibly wrapped) megatron ``GPTModel``.
        plans: one :class:`SparsePlan` per micro-batch forward.
    """
    inner = unwrap_model(model)
    if inner.config.sequence_parallel or inner.config.context_parallel_size > 1:
        raise ValueError(
            "sparse_forward: sequence/context parallelism is not supported (heads must be whole)"
        )
    queue = _PlanQueue(plans)
    swapped = []
    for layer in inner.decoder.layers:
        if layer.layer_number - 1 >= pattern.dense_layers:  # megatron's layer_number is global, 1-based
            attention = layer.self_attention
            swapped.append((attention, attention.core_attention))
            attention.core_attention = SparseCoreAttention(queue, pattern)
    handle = inner.register_forward_pre_hook(
        lambda _module, args, kwargs: queue.next(args[0] if args else kwargs["input_ids"]), with_kwargs=True
    )
    try:
        yield
    finally:
        handle.remove()
        for attention, original in swapped:
            attention.core_attention = original
    if queue.pending:
        raise RuntimeError(f"sparse forward: {len(queue.pending)} SparsePlan(s) were not used")


def compute_sparse_logprobs(
    model: torch.nn.Module,
    spec: PolicyModelSpec,
    batches: list[PolicyBatch],
    plans: Sequence[SparsePlan],
    pattern: SparsePattern,
    lora: MegatronLora | None = None,
    top_k: int = TOP_K,
) -> list[LogprobOutput]:
    """Sparse teacher-forced log-probs, entropy and top-k per micro-batch (CPU [B, S-1], every rank).

    ``lora``: an adapter applied during this forward only (DistillSparse), or None for the base policy.
    """
    if len(plans) != len(batches):
        raise ValueError(
            f"compute_sparse_logprobs: {len(plans)} SparsePlans for {len(batches)} micro-batches"
        )
    adapter = lora.active() if lora is not None else contextlib.nullcontext()
    with adapter, sparse_forward(model, plans, pattern):
        return compute_logprobs(model, spec, batches, top_k)
