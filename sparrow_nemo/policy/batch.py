"""Micro-batches of right-padded token sequences, and the model inputs built from them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PolicyBatch:
    """One micro-batch.

    Attributes:
        tokens: [B, S] int64 token ids, right-padded (pad ids must still be valid ids, e.g. 0).
        lengths: [B] int64 real tokens per row (1..S).
        extras: per-token or per-sequence tensors the loss needs (advantages, old logprobs, ...);
            passed through to the loss function untouched.
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

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
        self, device: torch.device | str = "cpu"
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(tokens [B,S], position_ids [B,S], attention_mask [B,1,S,S] bool, True = masked)``.

        The mask is causal and also hides padded keys, so a padded row computes exactly what the
        unpadded sequence would at its real positions.
        """
        b, s = self.tokens.shape
        pos = torch.arange(s).unsqueeze(0).expand(b, s)
        future = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)
        pad_key = pos >= self.lengths.unsqueeze(1)  # [B, S]
        mask = future.unsqueeze(0) | pad_key.unsqueeze(1)
        return self.tokens.to(device), pos.to(device), mask.unsqueeze(1).to(device)
