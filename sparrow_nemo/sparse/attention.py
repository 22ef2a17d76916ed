"""Sparrow sparse decode attention on a contiguous KV cache (the executable specification).

The KV cache of each sequence is cut into pages of ``page_size`` tokens. A page's landmark is
the mean of its keys (its centroid). For one decode step, each KV head averages the queries of
its GQA group, dots that mean with every page centroid, and keeps the top-k pages, plus the
first ``sink_pages`` pages (attention sink) and the last ``local_pages`` pages (local window).
Exact softmax attention then runs over the tokens of the kept pages only.

``page_score="minmax"`` (an option beyond the paper, after Quest, Tang et al. 2024) keeps each page's
per-channel minimum and maximum key instead and scores a page by the upper bound they give on the
group-mean query's dot product with any key of the page: sum_d max(q_d * min_d, q_d * max_d). A page
holding one key the query needs and fifteen it does not scores high under the bound and low under
the mean (docs/METHOD.md, "page scores").

Keys and queries are taken as attention sees them (after q/k RMSNorm and rotary embedding).
Shapes use B = batch, Hq = query heads, Hkv = KV heads, G = Hq // Hkv, L = cache length
(tokens), D = head dim, P = ceil(L / page_size) pages. Lengths and budgets are in tokens.

The paged kernels (``sparrow_kernels``) and the rollout engines are tested against this file.
"""

from __future__ import annotations

import math

import torch

from sparrow_nemo.sparse.pattern import PAGE_SCORES, PAGE_SIZE

__all__ = [
    "PAGE_SCORES",
    "decode_attention",
    "group_mean_query",
    "key_bound_scores",
    "page_centroids",
    "page_key_bounds",
    "select_pages",
    "select_pages_from_centroids",
    "select_pages_from_key_bounds",
    "selected_page_count",
    "selected_token_mask",
    "sparse_decode_attention",
]


def _check_page_args(page_size: int, sink_pages: int = 0, local_pages: int = 0) -> None:
    if page_size <= 0:
        raise ValueError(f"page_size must be a positive number of tokens, got {page_size}")
    if sink_pages < 0 or local_pages < 0:
        raise ValueError(f"sink_pages and local_pages must be >= 0, got {sink_pages} and {local_pages}")


def _check_seq_len(seq_len: torch.Tensor, batch: int) -> None:
    if seq_len.shape != (batch,):
        raise ValueError(f"seq_len must be [B]=[{batch}], got shape {tuple(seq_len.shape)}")
    if seq_len.dtype.is_floating_point or seq_len.dtype == torch.bool:
        raise ValueError(f"seq_len must be an integer tensor, got {seq_len.dtype}")
    if batch and int(seq_len.min()) < 0:
        raise ValueError(f"seq_len must be >= 0 tokens, got min {int(seq_len.min())}")


def _check_cache(k_cache: torch.Tensor, seq_len: torch.Tensor) -> None:
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must be [B, Hkv, L, D], got shape {tuple(k_cache.shape)}")
    batch, _, max_len, _ = k_cache.shape
    _check_seq_len(seq_len, batch)
    if batch and int(seq_len.max()) > max_len:
        raise ValueError(f"seq_len must be <= L={max_len} (k_cache length), got max {int(seq_len.max())}")


def _check_query(q: torch.Tensor, keys: torch.Tensor) -> int:
    """Validate q [B, Hq, D] against keys or centroids [B, Hkv, *, D]; return the GQA group size G."""
    if q.dim() != 3:
        raise ValueError(f"q must be [B, Hq, D], got shape {tuple(q.shape)}")
    batch, num_q_heads, head_dim = q.shape
    kb, num_kv_heads, _, kd = keys.shape
    if batch != kb or head_dim != kd:
        raise ValueError(
            f"q [B, Hq, D]={tuple(q.shape)} does not match the keys/centroids [B, Hkv, *, D]="
            f"{tuple(keys.shape)} in B or D"
        )
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"q heads Hq={num_q_heads} must be a multiple of KV heads Hkv={num_kv_heads}")
    return num_q_heads // num_kv_heads


def _budget_tensor(budget_tokens: int | torch.Tensor, batch: int, device: torch.device) -> torch.Tensor:
    """budget_tokens (int or [B] integer tensor) as an int64 [B] tensor on ``device``."""
    if isinstance(budget_tokens, torch.Tensor):
        if budget_tokens.dtype.is_floating_point or budget_tokens.dtype == torch.bool:
            raise ValueError(f"budget_tokens must be an integer tensor, got {budget_tokens.dtype}")
        if budget_tokens.dim() == 0:
            budget = budget_tokens.to(device=device, dtype=torch.int64).expand(batch)
        elif budget_tokens.shape == (batch,):
            budget = budget_tokens.to(device=device, dtype=torch.int64)
        else:
            raise ValueError(
                f"budget_tokens must be an int or a [B]=[{batch}] tensor, got {budget_tokens.shape}"
            )
    else:
        budget = torch.full((batch,), int(budget_tokens), dtype=torch.int64, device=device)
    if batch and int(budget.min()) < 0:
        raise ValueError(f"budget_tokens must be >= 0 tokens, got min {int(budget.min())}")
    return budget


def page_centroids(k_cache: torch.Tensor, seq_len: torch.Tensor, page_size: int = PAGE_SIZE) -> torch.Tensor:
    """Mean key of every page.

    Args:
        k_cache: [B, Hkv, L, D] keys (any float dtype); positions >= seq_len are ignored.
        seq_len: [B] integer, valid tokens per sequence (0 <= seq_len <= L).
        page_size: tokens per page.

    Returns:
        [B, Hkv, P, D] float32, P = ceil(L / page_size). A partial last page averages its valid
        tokens only; pages at or past seq_len (no valid token) are all zeros.
    """
    _check_page_args(page_size)
    _check_cache(k_cache, seq_len)
    batch, num_kv_heads, max_len, head_dim = k_cache.shape
    num_pages = math.ceil(max_len / page_size)
    pos = torch.arange(num_pages * page_size, device=k_cache.device)
    valid = pos[None, :] < seq_len.to(k_cache.device)[:, None]  # [B, P*ps]
    keys = torch.zeros(
        batch, num_kv_heads, num_pages * page_size, head_dim, dtype=torch.float32, device=k_cache.device
    )
    keys[:, :, :max_len] = k_cache.float()
    keys = keys.masked_fill(~valid[:, None, :, None], 0.0)  # also drops garbage (NaN) past seq_len
    sums = keys.view(batch, num_kv_heads, num_pages, page_size, head_dim).sum(dim=3)
    counts = valid.view(batch, num_pages, page_size).sum(dim=2).clamp(min=1)  # [B, P]
    return sums / counts[:, None, :, None]


def page_key_bounds(
    k_cache: torch.Tensor, seq_len: torch.Tensor, page_size: int = PAGE_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel minimum and maximum key of every page (the ``minmax`` page score's landmarks).

    Args:
        k_cache: [B, Hkv, L, D] keys (any float dtype); positions >= seq_len are ignored.
        seq_len: [B] integer, valid tokens per sequence (0 <= seq_len <= L).

    Returns:
        (k_min, k_max), each [B, Hkv, P, D] float32, P = ceil(L / page_size), over the valid tokens of
        each page; pages at or past seq_len (no valid token) are all zeros in both.
    """
    _check_page_args(page_size)
    _check_cache(k_cache, seq_len)
    batch, num_kv_heads, max_len, head_dim = k_cache.shape
    num_pages = math.ceil(max_len / page_size)
    pos = torch.arange(num_pages * page_size, device=k_cache.device)
    valid = (pos[None, :] < seq_len.to(k_cache.device)[:, None])[:, None, :, None]  # [B, 1, P*ps, 1]
    keys = torch.zeros(
        batch, num_kv_heads, num_pages * page_size, head_dim, dtype=torch.float32, device=k_cache.device
    )
    keys[:, :, :max_len] = k_cache.float()
    paged = (batch, num_kv_heads, num_pages, page_size, head_dim)
    k_min = keys.masked_fill(~valid, math.inf).view(paged).amin(dim=3)
    k_max = keys.masked_fill(~valid, -math.inf).view(paged).amax(dim=3)
    empty = ~valid.view(batch, 1, num_pages, page_size).any(dim=3)[..., None]  # [B, 1, P, 1]
    return k_min.masked_fill(empty, 0.0), k_max.masked_fill(empty, 0.0)


def group_mean_query(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[B, Hq, D] queries -> [B, Hkv, D] float32 mean over each KV head's G = Hq // Hkv query heads."""
    batch, num_heads, head_dim = q.shape
    return q.float().view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim).mean(dim=2)


def key_bound_scores(q_mean: torch.Tensor, k_min: torch.Tensor, k_max: torch.Tensor) -> torch.Tensor:
    """The ``minmax`` page score: an upper bound on ``q_mean . k`` over the keys k of each page.

    Args:
        q_mean: [B, Hkv, D] group-mean queries; k_min, k_max: [B, Hkv, P, D] per-page key bounds.

    Returns:
        [B, Hkv, P] float32, sum over d of max(q_d * k_min_d, q_d * k_max_d).
    """
    q = q_mean.float()[:, :, None, :]
    return torch.maximum(q * k_min.float(), q * k_max.float()).sum(dim=-1)


def selected_page_count(
    seq_len: torch.Tensor,
    budget_tokens: int | torch.Tensor,
    page_size: int = PAGE_SIZE,
    sink_pages: int = 1,
    local_pages: int = 2,
) -> torch.Tensor:
    """How many pages :func:`select_pages` keeps per sequence (the same for every KV head).

    Args:
        seq_len: [B] integer tokens in the cache.
        budget_tokens: int or [B] integer, KV budget in tokens (sink and local pages included).

    Returns:
        [B] int64 page counts: all ``ceil(seq_len / page_size)`` pages when they fit the budget,
        else |sink ∪ local| + min(k, middle pages) with k = max(budget//page_size - sink - local, 0).
    """
    _check_page_args(page_size, sink_pages, local_pages)
    seq_len = seq_len.to(torch.int64)
    budget_pages = _budget_tensor(budget_tokens, seq_len.shape[0], seq_len.device) // page_size
    n_pages = (seq_len + page_size - 1) // page_size
    forced = torch.clamp(n_pages, max=sink_pages + local_pages)  # sink ∪ local, capped by n_pages
    middle = n_pages - forced
    top_k = torch.clamp(budget_pages - sink_pages - local_pages, min=0)
    sparse_count = forced + torch.minimum(top_k, middle)
    return torch.where(n_pages <= budget_pages, n_pages, sparse_count)


def select_pages(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    seq_len: torch.Tensor,
    budget_tokens: int | torch.Tensor,
    page_size: int = PAGE_SIZE,
    sink_pages: int = 1,
    local_pages: int = 2,
    page_score: str = "centroid",
) -> torch.Tensor:
    """Pages each KV head attends to at this decode step.

    Rule per sequence: n_pages = ceil(seq_len / page_size), budget_pages = budget_tokens // page_size.
    If n_pages <= budget_pages every page is kept. Otherwise pages [0, sink_pages) and the last
    ``local_pages`` pages are kept, plus the top k = max(budget_pages - sink_pages - local_pages, 0)
    of the middle pages [sink_pages, n_pages - local_pages), scored by dot(mean of the GQA group's
    queries, page centroid) in float32 (``page_score="minmax"``: by :func:`key_bound_scores` of that
    mean query). Equal scores: the lower page index wins.

    Args:
        q: [B, Hq, D] queries of the token being decoded; query heads h*G .. h*G+G-1 share KV head h.
        k_cache: [B, Hkv, L, D] keys; seq_len: [B] integer valid tokens (the current token included).
        budget_tokens: int or [B] integer tensor, KV budget in tokens including the reserved pages.

    Returns:
        [B, Hkv, n] int64 logical page indices, ascending per row, padded with -1 at the end;
        n = the largest kept-page count over the batch (0 when nothing is kept).
    """
    if page_score == "minmax":
        k_min, k_max = page_key_bounds(k_cache, seq_len, page_size)
        return select_pages_from_key_bounds(
            q, k_min, k_max, seq_len, budget_tokens, page_size, sink_pages, local_pages
        )
    if page_score != "centroid":
        raise ValueError(f"page_score must be one of {PAGE_SCORES}, got {page_score!r}")
    centroids = page_centroids(k_cache, seq_len, page_size)
    return select_pages_from_centroids(
        q, centroids, seq_len, budget_tokens, page_size, sink_pages, local_pages
    )


def select_pages_from_centroids(
    q: torch.Tensor,
    centroids: torch.Tensor,
    seq_len: torch.Tensor,
    budget_tokens: int | torch.Tensor,
    page_size: int = PAGE_SIZE,
    sink_pages: int = 1,
    local_pages: int = 2,
) -> torch.Tensor:
    """:func:`select_pages` given the page centroids (e.g. the paged cache's incremental ones).

    Args:
        q: [B, Hq, D] queries; centroids: [B, Hkv, P, D] page-mean keys with
            P >= ceil(max(seq_len) / page_size) (entries of pages past seq_len are ignored);
        seq_len: [B] integer tokens; budget_tokens: int or [B] integer tokens.

    Returns:
        [B, Hkv, n] int64 logical page indices, ascending, -1 padded (as :func:`select_pages`).
    """
    _check_page_args(page_size, sink_pages, local_pages)
    _check_landmarks(q, centroids, seq_len, page_size, "centroids")
    scores = torch.einsum("bhd,bhpd->bhp", group_mean_query(q, centroids.shape[1]), centroids.float())
    return select_pages_from_scores(scores, seq_len, budget_tokens, page_size, sink_pages, local_pages)


def select_pages_from_key_bounds(
    q: torch.Tensor,
    k_min: torch.Tensor,
    k_max: torch.Tensor,
    seq_len: torch.Tensor,
    budget_tokens: int | torch.Tensor,
    page_size: int = PAGE_SIZE,
    sink_pages: int = 1,
    local_pages: int = 2,
) -> torch.Tensor:
    """:func:`select_pages` with ``page_score="minmax"`` given the per-page key bounds.

    Args:
        q: [B, Hq, D] queries; k_min, k_max: [B, Hkv, P, D] per-page minimum and maximum keys with
            P >= ceil(max(seq_len) / page_size) (entries of pages past seq_len are ignored);
        seq_len: [B] integer tokens; budget_tokens: int or [B] integer tokens.

    Returns:
        [B, Hkv, n] int64 logical page indices, ascending, -1 padded (as :func:`select_pages`).
    """
    _check_page_args(page_size, sink_pages, local_pages)
    _check_landmarks(q, k_min, seq_len, page_size, "k_min")
    if k_max.shape != k_min.shape:
        raise ValueError(f"k_max shape {tuple(k_max.shape)} must equal k_min shape {tuple(k_min.shape)}")
    scores = key_bound_scores(group_mean_query(q, k_min.shape[1]), k_min, k_max)
    return select_pages_from_scores(scores, seq_len, budget_tokens, page_size, sink_pages, local_pages)


def _check_landmarks(
    q: torch.Tensor, landmarks: torch.Tensor, seq_len: torch.Tensor, page_size: int, name: str
) -> None:
    """Validate per-page landmarks [B, Hkv, P, D] against q [B, Hq, D] and seq_len [B]."""
    if landmarks.dim() != 4:
        raise ValueError(f"{name} must be [B, Hkv, P, D], got shape {tuple(landmarks.shape)}")
    batch, _, num_pages, _ = landmarks.shape
    _check_seq_len(seq_len, batch)
    if batch and int(seq_len.max()) > num_pages * page_size:
        raise ValueError(
            f"{name} hold P={num_pages} pages of {page_size} tokens, fewer than seq_len max "
            f"{int(seq_len.max())} needs"
        )
    _check_query(q, landmarks)


def select_pages_from_scores(
    scores: torch.Tensor,
    seq_len: torch.Tensor,
    budget_tokens: int | torch.Tensor,
    page_size: int = 16,
    sink_pages: int = 1,
    local_pages: int = 2,
) -> torch.Tensor:
    """:func:`select_pages` given each page's score (e.g. GQA-averaged query . page centroid).

    Args:
        scores: [B, Hkv, P] float page scores (entries of pages past seq_len are ignored);
        seq_len: [B] integer tokens; budget_tokens: int or [B] integer tokens.

    Returns:
        [B, Hkv, n] int64 logical page indices, ascending, -1 padded (as :func:`select_pages`).
    """
    _check_page_args(page_size, sink_pages, local_pages)
    if scores.dim() != 3:
        raise ValueError(f"scores must be [B, Hkv, P], got shape {tuple(scores.shape)}")
    batch, num_kv_heads, num_pages = scores.shape
    _check_seq_len(seq_len, batch)
    device = scores.device
    seq_len = seq_len.to(device=device, dtype=torch.int64)
    budget_pages = _budget_tensor(budget_tokens, batch, device) // page_size

    page = torch.arange(num_pages, device=device)[None, :]  # [1, P]
    n_pages = ((seq_len + page_size - 1) // page_size)[:, None]  # [B, 1]
    valid = page < n_pages
    forced = valid & ((page < sink_pages) | (page >= n_pages - local_pages))
    middle = (valid & ~forced)[:, None, :].expand(batch, num_kv_heads, num_pages)
    top_k = torch.clamp(budget_pages - sink_pages - local_pages, min=0)[:, None, None]  # [B, 1, 1]

    # Rank middle pages by descending score; the stable sort keeps lower indices first on ties.
    masked = torch.where(middle, scores, torch.full_like(scores, -math.inf))
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(
        -1, order, torch.arange(num_pages, device=device).expand_as(order)
    )
    chosen = middle & (rank < top_k)

    keep_all = (n_pages <= budget_pages[:, None])[:, None, :]  # [B, 1, 1]
    keep = valid[:, None, :] & (keep_all | forced[:, None, :] | chosen)  # [B, Hkv, P]
    return _mask_to_sorted_indices(keep)


def _mask_to_sorted_indices(keep: torch.Tensor) -> torch.Tensor:
    """Bool [B, H, P] -> int64 [B, H, n] ascending indices of True entries, -1 padded at the end."""
    num_pages = keep.shape[-1]
    width = int(keep.sum(dim=-1).max()) if keep.numel() else 0
    index = torch.arange(num_pages, device=keep.device).expand_as(keep)
    keyed = torch.where(keep, index, torch.full_like(index, num_pages))
    picked = torch.sort(keyed, dim=-1).values[..., :width]
    return torch.where(picked == num_pages, torch.full_like(picked, -1), picked)


def selected_token_mask(
    page_idx: torch.Tensor, seq_len: torch.Tensor, max_len: int, page_size: int = PAGE_SIZE
) -> torch.Tensor:
    """Cache positions covered by the selected pages.

    Args:
        page_idx: [B, Hkv, n] integer logical page indices, -1 entries are padding.
        seq_len: [B] integer valid tokens per sequence.
        max_len: L, the cache length in tokens.

    Returns:
        bool [B, Hkv, L]: True at position t when page t // page_size is selected and t < seq_len.
    """
    _check_page_args(page_size)
    if page_idx.dim() != 3:
        raise ValueError(f"page_idx must be [B, Hkv, n], got shape {tuple(page_idx.shape)}")
    batch = page_idx.shape[0]
    if seq_len.shape != (batch,):
        raise ValueError(f"seq_len must be [B]=[{batch}], got shape {tuple(seq_len.shape)}")
    num_pages = math.ceil(max_len / page_size)
    if page_idx.numel() and (int(page_idx.min()) < -1 or int(page_idx.max()) >= num_pages):
        raise ValueError(
            f"page_idx entries must be -1 (padding) or in [0, {num_pages}) for max_len={max_len}, "
            f"got values in [{int(page_idx.min())}, {int(page_idx.max())}]"
        )
    idx = page_idx.to(torch.int64)
    idx = torch.where(idx < 0, torch.full_like(idx, num_pages), idx)  # padding -> spare slot
    page_sel = torch.zeros(*page_idx.shape[:2], num_pages + 1, dtype=torch.bool, device=page_idx.device)
    page_sel.scatter_(-1, idx, True)
    pos = torch.arange(max_len, device=page_idx.device)
    in_page = page_sel[..., pos // page_size]  # [B, Hkv, L]
    return in_page & (pos[None, :] < seq_len.to(page_idx.device)[:, None])[:, None, :]


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, token_mask: torch.Tensor
) -> torch.Tensor:
    """Softmax attention of one query token per sequence over the masked cache positions.

    Args:
        q: [B, Hq, D]; k_cache, v_cache: [B, Hkv, L, D]; token_mask: bool [B, Hkv, L] positions
            to attend to (shared by the G query heads of each KV head; at least one per row).
            Unmasked positions never influence the result, even when they hold NaN or inf.

    Returns:
        [B, Hq, D] in q.dtype; scores use scale 1/sqrt(D) and the softmax runs in float32.
    """
    group = _check_query(q, k_cache)
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"v_cache shape {tuple(v_cache.shape)} must equal k_cache shape {tuple(k_cache.shape)}"
        )
    batch, num_kv_heads, max_len, head_dim = k_cache.shape
    if token_mask.shape != (batch, num_kv_heads, max_len) or token_mask.dtype != torch.bool:
        raise ValueError(
            f"token_mask must be bool [B, Hkv, L]={(batch, num_kv_heads, max_len)}, "
            f"got {token_mask.dtype} {tuple(token_mask.shape)}"
        )
    if token_mask.numel() and not bool(token_mask.any(dim=-1).all()):
        raise ValueError(
            "token_mask selects no position for some (sequence, KV head); attention is undefined"
        )
    qg = q.float().view(batch, num_kv_heads, group, head_dim)
    logits = torch.einsum("bhgd,bhld->bhgl", qg, k_cache.float()) / math.sqrt(head_dim)
    logits = logits.masked_fill(~token_mask[:, :, None, :], -math.inf)
    probs = torch.softmax(logits, dim=-1)
    values = v_cache.float().masked_fill(~token_mask[..., None], 0.0)  # unselected slots may hold garbage
    out = torch.einsum("bhgl,bhld->bhgd", probs, values)
    return out.reshape(batch, num_kv_heads * group, head_dim).to(q.dtype)


def sparse_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_len: torch.Tensor,
    budget_tokens: int | torch.Tensor,
    page_size: int = PAGE_SIZE,
    sink_pages: int = 1,
    local_pages: int = 2,
    page_score: str = "centroid",
) -> torch.Tensor:
    """Exact attention over the pages :func:`select_pages` keeps (one decode step).

    Args:
        q: [B, Hq, D]; k_cache, v_cache: [B, Hkv, L, D]; seq_len: [B] integer, >= 1 (the current
            token is already in the cache); budget_tokens: int or [B] integer tokens.

    Returns:
        [B, Hq, D] in q.dtype (fp32 softmax, scale 1/sqrt(D)). When the budget covers a sequence
        this equals dense attention over its first seq_len positions.
    """
    _check_cache(k_cache, seq_len)
    if seq_len.numel() and int(seq_len.min()) < 1:
        raise ValueError("sparse_decode_attention needs seq_len >= 1 for every sequence (the current token)")
    page_idx = select_pages(
        q, k_cache, seq_len, budget_tokens, page_size, sink_pages, local_pages, page_score
    )
    mask = selected_token_mask(page_idx, seq_len, k_cache.shape[2], page_size)
    return decode_attention(q, k_cache, v_cache, mask)
