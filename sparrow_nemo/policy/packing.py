"""Micro-batch formation: a step's rows -> micro-batches that hold tokens, not padding; and back.

Choice: length-bucketed micro-batches, each cut to its own longest row, rather than megatron's packed
THD layout (``PackedSeqParams``). Reasons: causal attention over right-padded rows needs no mask and
runs on every attention backend we have (Transformer Engine flash attention on GPU, torch SDPA on CPU,
the sparse teacher-forced forward), while THD needs Transformer Engine and cu_seqlens-aware rotary,
neither of which runs here; and at recipe scale (one 40K-token response per micro-batch) a bucketed
micro-batch is already all tokens. With ``max_tokens`` the rows are sorted by length and grouped
greedily, so a micro-batch's padding is bounded by the length spread inside its bucket.

Each :class:`~sparrow_nemo.policy.batch.PolicyBatch` records its :class:`~sparrow_nemo.policy.batch.Placement`
(rows and the step's grid); :func:`concat_outputs` uses it to put per-micro-batch outputs back into
the step's ``[N, S-1]`` grid in the original row order. Extras travel with the rows:

- ``[N]`` (per row, e.g. advantages) -> ``[b]``;
- ``[N, S-1, ...]`` (per predicted position: masks, old / rollout logprobs) -> ``[b, w-1, ...]``;
- ``[N, S, ...]`` (per token position, e.g. sparse budgets) -> ``[b, w, ...]``;

with ``w`` the micro-batch width (its longest row). Anything else is refused with the key's name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from sparrow_nemo.policy.batch import Placement, PolicyBatch
from sparrow_nemo.policy.logprobs import LogprobOutput


def row_groups(
    lengths: torch.Tensor, micro_batch_size: int, max_tokens: int | None = None, multiple_of: int = 1
) -> list[torch.Tensor]:
    """Which rows form each micro-batch.

    Args:
        lengths: [N] int64 tokens per row.
        micro_batch_size: rows per micro-batch when ``max_tokens`` is None (N must be a multiple of it;
            rows keep their order, in contiguous groups).
        max_tokens: token budget of a micro-batch: rows sorted by length (longest first), a micro-batch
            takes rows while rows x its longest row <= max_tokens. A row longer than the budget is an error.
        multiple_of: with ``max_tokens``, the number of micro-batches is made a multiple of this
            (data-parallel ranks) by splitting the micro-batches with the most rows.

    Returns:
        One int64 tensor of row indices per micro-batch.
    """
    n = lengths.shape[0]
    if max_tokens is None:
        if n % micro_batch_size:
            raise ValueError(
                f"{n} sequences per step is not a multiple of policy.micro_batch_size={micro_batch_size} "
                "(grpo.prompts_per_step x grpo.samples_per_prompt, or warmstart.batch_size, must divide evenly)"
            )
        groups = [torch.arange(lo, lo + micro_batch_size) for lo in range(0, n, micro_batch_size)]
    else:
        longest = int(lengths.max()) if n else 0
        if longest > max_tokens:
            raise ValueError(
                f"a sequence of {longest} tokens does not fit policy.max_tokens_per_micro_batch={max_tokens}"
            )
        order = torch.sort(lengths, descending=True, stable=True).indices.tolist()
        groups, current, width = [], [], 0
        for row in order:
            if current and (len(current) + 1) * width > max_tokens:
                groups.append(torch.tensor(current))
                current = []
            if not current:  # sorted longest first: a group's width is its first row's length
                width = int(lengths[row])
            current.append(row)
        if current:
            groups.append(torch.tensor(current))
    while max_tokens is not None and len(groups) % multiple_of:
        widest = max(range(len(groups)), key=lambda i: groups[i].numel())
        if groups[widest].numel() < 2:
            raise ValueError(
                f"{n} sequences cannot form a multiple of {multiple_of} micro-batches (one row each at least)"
            )
        half = groups[widest].numel() // 2
        groups[widest : widest + 1] = [groups[widest][:half], groups[widest][half:]]
    return groups


def _cut(name: str, value: torch.Tensor, rows: torch.Tensor, n: int, s: int, width: int) -> torch.Tensor:
    """``value``'s entries for ``rows``, cut to ``width`` along the position dimension (see the module doc)."""
    if value.dim() == 0 or value.shape[0] != n:
        raise ValueError(f"extras['{name}'] must have {n} rows (one per sequence), got {tuple(value.shape)}")
    picked = value[rows]
    if value.dim() == 1:
        return picked
    if value.shape[1] == s - 1:
        return picked[:, : width - 1]
    if value.shape[1] == s:
        return picked[:, :width]
    raise ValueError(
        f"extras['{name}'] {tuple(value.shape)}: expected [N]={n}, [N, S-1]=[{n}, {s - 1}, ...] or "
        f"[N, S]=[{n}, {s}, ...]"
    )


def micro_batches(
    tokens: torch.Tensor,
    lengths: torch.Tensor,
    extras: Mapping[str, torch.Tensor],
    micro_batch_size: int,
    max_tokens: int | None = None,
    multiple_of: int = 1,
) -> list[PolicyBatch]:
    """The step's rows (tokens [N, S] right-padded, lengths [N]) as :class:`PolicyBatch` es.

    Grouping as :func:`row_groups`; each micro-batch is cut to its longest row and carries its extras
    (shapes in the module doc) and its :class:`Placement`.
    """
    n, s = tokens.shape
    batches = []
    for rows in row_groups(lengths, micro_batch_size, max_tokens, multiple_of):
        width = int(lengths[rows].max())
        batches.append(
            PolicyBatch(
                tokens[rows, :width],
                lengths[rows],
                {k: _cut(k, v, rows, n, s, width) for k, v in extras.items()},
                Placement(rows, n, s),
            )
        )
    return batches


_FIELDS = ("logprobs", "entropy", "topk_ids", "topk_logprobs")


def concat_outputs(outputs: Sequence[LogprobOutput]) -> LogprobOutput:
    """Per-micro-batch outputs back in the step's grid: [N, S-1, ...] in the original row order.

    Outputs that carry a placement (all of them, from :func:`micro_batches`) are scattered to their rows;
    positions past a micro-batch's width are 0. Without placements the outputs are stacked in order
    (they must then have one width).
    """
    if not outputs:
        raise ValueError("concat_outputs needs at least one micro-batch output")
    placements = [o.placement for o in outputs]
    if any(p is None for p in placements):
        widths = {o.logprobs.shape[1] for o in outputs}
        if len(widths) != 1:
            raise ValueError(f"outputs without placements must share one width, got {sorted(widths)}")
        return LogprobOutput(*(torch.cat([getattr(o, f) for o in outputs]) for f in _FIELDS))
    n, s = placements[0].num_rows, placements[0].width
    if any((p.num_rows, p.width) != (n, s) for p in placements):
        raise ValueError(
            "concat_outputs: the outputs come from different steps (placements disagree on N, S)"
        )
    merged = []
    for f in _FIELDS:
        first = getattr(outputs[0], f)
        full = torch.zeros((n, s - 1, *first.shape[2:]), dtype=first.dtype, device=first.device)
        for out, place in zip(outputs, placements):
            part = getattr(out, f)
            full[place.rows.to(full.device), : part.shape[1]] = part
        merged.append(full)
    return LogprobOutput(*merged)
