"""Micro-batches of right-padded token sequences, and the model inputs built from them.

Attention is causal with no explicit mask (megatron's ``AttnMaskType.causal``; flash attention on GPU,
torch SDPA on CPU): padding sits after each row's last real token, so no real position ever attends to
it, and no ``[S, S]`` mask is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Placement:
    """Where a micro-batch's rows sit in the step's token grid ``[num_rows, width]``.

    Attributes:
        rows: [b] int64 row indices into the step's rows, one per micro-batch row.
        num_rows: N, rows of the step.
        width: S, tokens per row of the step (the micro-batch may be cut shorter).
    """

    rows: torch.Tensor
    num_rows: int
    width: int


@dataclass
class PolicyBatch:
    """One micro-batch.

    Attributes:
        tokens: [B, S] int64 token ids, right-padded (pad ids must still be valid ids, e.g. 0).
        lengths: [B] int64 real tokens per row (1..S).
        extras: per-token or per-sequence tensors the loss needs (advantages, old logprobs, ...);
            passed through to the loss function untouched ([B, S-1] per position, [B] per row).
        placement: where these rows came from (:mod:`sparrow_nemo.policy.packing`), or None.
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    placement: Placement | None = None

    def __post_init__(self) -> None:
        if self.tokens.dim() != 2 or self.tokens.dtype != torch.int64:
            raise ValueError(
                f"PolicyBatch.tokens must be [B, S] int64, got {tuple(self.tokens.shape)} {self.tokens.dtype}"
            )
        b, s = self.tokens.shape
        if self.lengths.shape != (b,):
            raise ValueError(f"PolicyBatch.lengths must be [{b}], got {tuple(self.lengths.shape)}")
        if b and (int(self.lengths.min()) < 1 or int(self.lengths.max()) > s):
            raise ValueError(f"PolicyBatch.lengths must lie in [1, {s}], got {self.lengths.tolist()}")

    def target_mask(self) -> torch.Tensor:
        """[B, S-1] bool: position j predicts a real token (``j + 1 < length``)."""
        s = self.tokens.shape[1]
        return torch.arange(1, s).unsqueeze(0) < self.lengths.unsqueeze(1)

    def model_inputs(
        self, device: torch.device | str = "cpu", multiple: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor, None]:
        """``(tokens [B, S'], position_ids [B, S'], None)``: the attention mask is megatron's causal type.

        Args:
            multiple: pad the width S up to ``S'``, a multiple of this (sequence parallelism splits the
                sequence over the tensor-parallel ranks); the extra columns are pad tokens.
        """
        b, s = self.tokens.shape
        width = -(-s // multiple) * multiple
        tokens = self.tokens if width == s else torch.nn.functional.pad(self.tokens, (0, width - s))
        pos = torch.arange(width).unsqueeze(0).expand(b, width)
        return tokens.to(device), pos.to(device), None
