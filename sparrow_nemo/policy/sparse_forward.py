"""Sparse teacher-forced forward: the policy re-computes what the sparse rollout engine computed.

At every decode position ``t`` of a rollout (``t >= prompt_len``: the query of the token at ``t``,
whose next-token distribution produced response token ``t + 1 - prompt_len``) the engine attended,
in each layer from ``dense_layers`` on, only to the pages chosen by the method layer's rule for a
cache of ``t + 1`` tokens under the budget ``schedule.budget(t + 1)``. The pages' landmarks were those
of the keys stored so far in each page: complete pages summarise their ``page_size`` keys, the current
(partial) page its keys up to ``t``. Under ``pattern.page_score``: ``"centroid"`` (the paper) the landmark
is the mean key and a page scores the group-mean query . centroid; ``"minmax"`` (after Quest) the landmarks
are the per-channel minimum and maximum keys and a page scores
:func:`sparrow_nemo.sparse.attention.key_bound_scores`. (The current page is always a local page when
``local_pages >= 1``, so its landmarks never change the choice; they are modelled exactly anyway.)
Prompt positions (``t < prompt_len``) were dense prefill, and so are the first ``dense_layers``.

Here the whole sequence runs through the megatron ``GPTModel`` in one pass: each sparse layer's
core attention is swapped for :class:`SparseCoreAttention`, which works in blocks of
:data:`QUERY_BLOCK` query positions (:func:`block_sparse_attention`): the method layer's selection
(:func:`sparrow_nemo.sparse.attention.select_pages_from_scores`) for each query of the block, the union
of the block's selected pages gathered from the keys and values, and exact softmax attention over them
with a per-query mask. Memory per block is ``B x Hq x QUERY_BLOCK x (union of pages x page_size)``
(at most ``QUERY_BLOCK x S`` per head); the page scores are ``B x QUERY_BLOCK x Hkv x P`` matmul outputs
(one under centroid, two under minmax: :func:`score_pages`), no ``S x S`` tensor exists. In training each
block runs under ``torch.utils.checkpoint``: its scores are recomputed in backward, so what a layer keeps
for backward is its q, k, v (as any attention), fp32 copies of k and v, and the page landmarks: ``B x Hkv x
P x D`` fp32 for the centroids, twice that for the minmax bounds. Selection is per KV head, so under tensor
parallelism it is local to each rank. Gradients flow to everything upstream of the attention (e.g.
LoRA adapters); the selection itself is not differentiable.

Each micro-batch forward takes the next :class:`SparsePlan`; its backward (where activation recompute
re-runs the layers, possibly after later micro-batches' forwards under 1F1B) takes the same plan back
(a hook on the model output's gradient), so a recomputed forward always sees its own micro-batch's plan.
Per block, sizing the gathered union costs one host sync (as the method layer's own index packing).
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
from sparrow_nemo.policy.pipeline import compute_logprobs
from sparrow_nemo.sparse.attention import select_pages_from_scores
from sparrow_nemo.sparse.pattern import SparsePattern
from sparrow_nemo.sparse.schedule import DENSE_BUDGET, BudgetSchedule

if TYPE_CHECKING:
    from sparrow_nemo.policy.lora import MegatronLora

#: query positions per attention block: bounds a block's scores to B * Hq * QUERY_BLOCK * S floats
QUERY_BLOCK = 64


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

    def fit(self, width: int) -> SparsePlan:
        """This plan for a micro-batch of ``width`` positions: cut, or extended with dense positions (a plan
        made for the step's full width serves the micro-batch cut from the same rows)."""
        have = self.query_budget.shape[1]
        if width <= have:
            return SparsePlan(self.prompt_lens, self.query_budget[:, :width])
        extra = torch.full((self.query_budget.shape[0], width - have), DENSE_BUDGET, dtype=torch.int64)
        return SparsePlan(self.prompt_lens, torch.cat([self.query_budget, extra], dim=1))

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


def page_landmarks(k: torch.Tensor, pattern: SparsePattern) -> tuple[torch.Tensor, ...]:
    """[B, Hkv, P, D] float32 landmarks of every complete page of k [B, Hkv, S, D] (the last page padded
    with zero keys; a query's own partial page is re-summarised by :func:`query_block_pages`):
    ``(centroid,)`` under ``pattern.page_score="centroid"``, ``(k_max, k_min)`` per channel under ``"minmax"``."""
    batch, heads, width, dim = k.shape
    ps = pattern.page_size
    num_pages = math.ceil(width / ps)
    keys = F.pad(k.detach().float(), (0, 0, 0, num_pages * ps - width))
    paged = keys.view(batch, heads, num_pages, ps, dim)
    if pattern.page_score == "minmax":
        return paged.amax(dim=3), paged.amin(dim=3)
    return (paged.cumsum(dim=3)[:, :, :, -1] / ps,)


def _prefix_landmarks(span: torch.Tensor, page_size: int, page_score: str) -> tuple[torch.Tensor, ...]:
    """Landmarks of every page prefix: span [B, Hkv, L, D] (L a multiple of ``page_size``) ->
    [B, Hkv, L / page_size, page_size, D] float32 each, entry [..., p, j, :] of keys 0..j of page p
    (as :func:`page_landmarks`: the running mean, or the running per-channel max and min)."""
    batch, heads, width, dim = span.shape
    paged = span.detach().float().view(batch, heads, width // page_size, page_size, dim)
    if page_score == "minmax":
        return paged.cummax(dim=3).values, paged.cummin(dim=3).values
    count = torch.arange(1, page_size + 1, device=span.device, dtype=torch.float32)[:, None]
    return (paged.cumsum(dim=3) / count,)


def _query_factors(q_mean: torch.Tensor, page_score: str) -> tuple[torch.Tensor, ...]:
    """What each landmark of :func:`page_landmarks` is dotted with: ``(q,)`` under centroid; under minmax
    ``(max(q, 0), min(q, 0))``, since max(q_d * min_d, q_d * max_d) = max(q_d, 0) * max_d + min(q_d, 0) * min_d
    (max_d >= min_d): the same fp32 product per channel as ``key_bound_scores``, summed by a matmul."""
    return (q_mean.clamp(min=0), q_mean.clamp(max=0)) if page_score == "minmax" else (q_mean,)


def score_pages(
    q_mean: torch.Tensor, landmarks: Sequence[torch.Tensor], page_score: str, subscripts: str
) -> torch.Tensor:
    """Page scores: the sum over landmarks of ``einsum(subscripts, factor, landmark)`` with the factors of
    :func:`_query_factors`; equals :func:`sparrow_nemo.sparse.attention.key_bound_scores` under minmax (up
    to the order of the fp32 sum) and the group-mean query . centroid under centroid.

    Args:
        q_mean: group-mean queries, float32; landmarks: as :func:`page_landmarks` (or one per query);
        subscripts: the einsum contracting D, e.g. ``"bhnd,bhpd->bnhp"``.
    """
    factors = _query_factors(q_mean, page_score)
    scores = torch.einsum(subscripts, factors[0], landmarks[0])
    for factor, landmark in zip(factors[1:], landmarks[1:]):
        scores = scores + torch.einsum(subscripts, factor, landmark)
    return scores


def query_block_pages(
    q: torch.Tensor,
    k: torch.Tensor,
    landmarks: Sequence[torch.Tensor],
    plan: SparsePlan,
    pattern: SparsePattern,
    lo: int,
    hi: int,
) -> torch.Tensor:
    """Which pages each query of positions ``lo .. hi-1`` attends to under decode-time sparse attention.

    Args:
        q: [B, Hq, S, D] queries and k: [B, Hkv, S, D] keys, as attention sees them (after q/k norm and
            rotary); query heads h*G .. h*G+G-1 share KV head h.
        landmarks: [B, Hkv, P, D] complete-page landmarks (:func:`page_landmarks` of ``k``).
        plan: prompt lengths and per-position budgets ([B], [B, S]).

    Returns:
        bool [B, n, Hkv, P] (n = hi - lo): for a prompt position every page up to its own (causal, the
        query's own page included), for a decode position the pages the method layer selects for a
        cache of t + 1 tokens (the current page's landmarks are of its keys up to t). Tokens after t inside a
        kept page are not excluded here (see :func:`block_sparse_attention`).
    """
    batch, num_q_heads, _, head_dim = q.shape
    num_kv_heads, num_pages, ps = k.shape[1], landmarks[0].shape[2], pattern.page_size
    device, n = q.device, hi - lo
    t = torch.arange(lo, hi, device=device)
    page = torch.arange(num_pages, device=device)
    keep = (page[None, :] <= (t // ps)[:, None])[None, :, None, :].expand(batch, n, num_kv_heads, num_pages)
    prompt = t[None, :] < plan.prompt_lens.to(device)[:, None]  # [B, n]
    if bool(prompt.all()):
        return keep
    group = num_q_heads // num_kv_heads
    q_mean = (
        q[:, :, lo:hi].float().view(batch, num_kv_heads, group, n, head_dim).mean(dim=2)
    )  # [B, Hkv, n, D]
    scores = score_pages(q_mean, landmarks, pattern.page_score, "bhnd,bhpd->bnhp")  # [B, n, Hkv, P]
    # the current (partial) page's landmarks: of its keys up to t
    p0, p1 = lo // ps, (hi - 1) // ps + 1
    keys = k[:, :, p0 * ps : p1 * ps]
    span = F.pad(keys, (0, 0, 0, (p1 - p0) * ps - keys.shape[2]))
    current = [
        prefix[:, :, t // ps - p0, t % ps] for prefix in _prefix_landmarks(span, ps, pattern.page_score)
    ]
    # advanced indices on dims 1 and 3 (a slice between): the indexed view is [n, B, Hkv]
    scores[:, torch.arange(n, device=device), :, t // ps] = score_pages(
        q_mean, current, pattern.page_score, "bhnd,bhnd->nbh"
    )
    page_idx = select_pages_from_scores(
        scores.reshape(batch * n, num_kv_heads, num_pages),
        (t + 1).repeat(batch),
        plan.query_budget[:, lo:hi].to(device).reshape(-1),
        ps,
        pattern.sink_pages,
        pattern.local_pages,
    )  # [B*n, Hkv, K], -1 padded
    chosen = torch.zeros(batch * n, num_kv_heads, num_pages + 1, dtype=torch.bool, device=device)
    chosen.scatter_(-1, torch.where(page_idx < 0, num_pages, page_idx), True)
    chosen = chosen[..., :num_pages].view(batch, n, num_kv_heads, num_pages)
    return torch.where(prompt[:, :, None, None], keep, chosen)


def _sorted_true(mask: torch.Tensor) -> torch.Tensor:
    """bool [..., P] -> int64 [..., U] ascending indices of the True entries, -1 padded (U = max count)."""
    num = mask.shape[-1]
    width = int(mask.sum(dim=-1).max())
    index = torch.arange(num, device=mask.device).expand_as(mask)
    picked = torch.sort(torch.where(mask, index, num), dim=-1).values[..., :width]
    return torch.where(picked == num, -1, picked)


def _block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    landmarks: tuple[torch.Tensor, ...],
    plan: SparsePlan,
    pattern: SparsePattern,
    lo: int,
    hi: int,
) -> torch.Tensor:
    """Sparse attention of the queries ``lo .. hi-1``: [B, Hq, n, D] float32 (see :func:`block_sparse_attention`)."""
    batch, num_q_heads, width, head_dim = q.shape
    num_kv_heads, ps, n = k.shape[1], pattern.page_size, hi - lo
    group = num_q_heads // num_kv_heads
    with torch.no_grad():
        keep = query_block_pages(q, k, landmarks, plan, pattern, lo, hi).transpose(1, 2)  # [B, Hkv, n, P]
        union = _sorted_true(keep.any(dim=2))  # [B, Hkv, U] pages any query of the block attends to
        page = union.clamp(min=0)
        tok = (page[..., None] * ps + torch.arange(ps, device=q.device)).flatten(2)  # [B, Hkv, U*ps]
        member = keep.gather(3, page[:, :, None, :].expand(-1, -1, n, -1)) & (union >= 0)[:, :, None]
        t = torch.arange(lo, hi, device=q.device)
        allowed = member.repeat_interleave(ps, dim=3) & (tok[:, :, None, :] <= t[None, None, :, None])
        flat = (
            torch.arange(batch * num_kv_heads, device=q.device).view(batch, num_kv_heads, 1) * width
            + tok.clamp(max=width - 1)
        ).reshape(-1)
    k_sel = k.view(-1, head_dim).index_select(0, flat).view(batch * num_kv_heads, 1, -1, head_dim)
    v_sel = v.view(-1, head_dim).index_select(0, flat).view(batch * num_kv_heads, 1, -1, head_dim)
    q_blk = q[:, :, lo:hi].float().reshape(batch * num_kv_heads, group, n, head_dim)
    out = F.scaled_dot_product_attention(
        q_blk,
        k_sel,
        v_sel,
        attn_mask=allowed.reshape(batch * num_kv_heads, 1, n, -1),
        scale=1.0 / math.sqrt(head_dim),
        enable_gqa=True,
    )
    return out.view(batch, num_q_heads, n, head_dim)


def block_sparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: SparsePlan, pattern: SparsePattern
) -> torch.Tensor:
    """Decode-time sparse attention of every position, :data:`QUERY_BLOCK` queries at a time.

    Per block: :func:`query_block_pages`, the union of those pages per (row, KV head) gathered from k and
    v, and softmax attention with query t allowed exactly the tokens u <= t of its own pages.

    Args:
        q: [B, Hq, S, D]; k, v: [B, Hkv, S, D] (differentiable); plan: [B] prompt lengths, [B, S] budgets.

    Returns:
        [B, Hq, S, D] float32; scale 1/sqrt(D), computed in float32.
    """
    batch, _, width, _ = q.shape
    if k.shape[0] != batch or k.shape[2] != width or plan.query_budget.shape != (batch, width):
        raise ValueError(
            f"block_sparse_attention: q {tuple(q.shape)}, k {tuple(k.shape)} and plan.query_budget "
            f"{tuple(plan.query_budget.shape)} must be [B, Hq, S, D], [B, Hkv, S, D] and [B, S]"
        )
    landmarks = page_landmarks(k, pattern)
    k, v = k.float().contiguous(), v.float().contiguous()  # one copy per layer, gathered from by every block
    blocks = []
    for lo in range(0, width, QUERY_BLOCK):
        hi = min(lo + QUERY_BLOCK, width)
        args = (q, k, v, landmarks, plan, pattern, lo, hi)
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            blocks.append(torch.utils.checkpoint.checkpoint(_block_attention, *args, use_reentrant=False))
        else:
            blocks.append(_block_attention(*args))
    return torch.cat(blocks, dim=2)


class _PlanQueue:
    """Plans of the micro-batches still to run, in forward order, and the one whose layers run now."""

    def __init__(self, plans: Sequence[SparsePlan]) -> None:
        self.pending: deque[SparsePlan] = deque(plans)
        self.current: SparsePlan | None = None

    def next(self, tokens: torch.Tensor) -> SparsePlan:
        """Start the next micro-batch forward (its ``tokens [B, S]``); returns its plan, fitted to S."""
        if not self.pending:
            raise RuntimeError("sparse forward: more micro-batch forwards than SparsePlans were given")
        plan = self.pending.popleft()
        if plan.query_budget.shape[0] != tokens.shape[0]:
            raise ValueError(
                f"sparse forward: the plan has {plan.query_budget.shape[0]} rows but the micro-batch tokens "
                f"are {tuple(tokens.shape)}"
            )
        self.current = plan.fit(tokens.shape[1])
        return self.current

    def resume(self, plan: SparsePlan):
        """A gradient hook that makes ``plan`` current again (the micro-batch's backward starts)."""

        def hook(grad: torch.Tensor) -> None:
            self.current = plan

        return hook


class SparseCoreAttention(torch.nn.Module):
    """Drop-in for megatron's core attention of one layer: decode-time sparse attention of a rollout.

    Takes megatron's ``query [sq, b, np, hn]``, ``key``/``value [sk, b, ng, hn]`` (this rank's heads)
    and returns ``[sq, b, np * hn]`` in the query dtype (:func:`block_sparse_attention`). megatron's
    ``attention_mask`` is not needed: the sparse pattern is causal.
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
        out = block_sparse_attention(q, k, v, plan, self.pattern)  # [b, np, s, hn]
        sq, b, heads, dim = query.shape
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * dim).to(query.dtype)


@contextlib.contextmanager
def sparse_forward(
    model: torch.nn.Module, plans: Sequence[SparsePlan], pattern: SparsePattern
) -> Iterator[None]:
    """Inside the block, forwards of ``model`` compute decode-time sparse attention.

    The i-th forward of the model (one per micro-batch, in order, on every pipeline stage) uses
    ``plans[i]`` (fitted to the micro-batch's width, :meth:`SparsePlan.fit`), and so does that
    micro-batch's backward (activation recompute included). Layers with global index <
    ``pattern.dense_layers`` keep megatron's dense attention. On exit the original core attention
    modules are restored; a RuntimeError is raised when fewer forwards ran than plans were given.

    Args:
        model: this rank's (possibly wrapped) megatron ``GPTModel``.
        plans: one :class:`SparsePlan` per micro-batch forward.
    """
    inner = unwrap_model(model)
    if inner.config.context_parallel_size > 1:
        raise ValueError("sparse_forward: context parallelism is not supported (the sequence must be whole)")
    queue = _PlanQueue(plans)
    swapped = []
    for layer in inner.decoder.layers:
        if layer.layer_number - 1 >= pattern.dense_layers:  # megatron's layer_number is global, 1-based
            attention = layer.self_attention
            swapped.append((attention, attention.core_attention))
            attention.core_attention = SparseCoreAttention(queue, pattern)

    def start(_module, args, kwargs):
        queue.next(args[0] if args else kwargs["input_ids"])

    def finish(_module, _args, _kwargs, output):
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(queue.resume(queue.current))

    handles = [
        inner.register_forward_pre_hook(start, with_kwargs=True),
        inner.register_forward_hook(finish, with_kwargs=True),
    ]
    try:
        yield
    finally:
        for handle in handles:
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
