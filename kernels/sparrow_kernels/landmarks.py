"""What the kernels score pages by: page centroids (the paper) or per-page key bounds (``minmax``).

Every entry point that reads or maintains page landmarks takes one ``landmarks`` argument:

- a tensor: the page centroids [num_pages, Hkv, D] (``page_score="centroid"``);
- a :class:`KeyBounds`: the per-channel minimum and maximum stored key of every physical page, each
  [num_pages, Hkv, D] (``page_score="minmax"``, after Quest; the method layer's ``page_key_bounds``).

The page score follows from the argument's type, so a call cannot pair centroids with the bound score.
This module imports no triton.
"""

from __future__ import annotations

from typing import NamedTuple, TypeAlias

import torch


class KeyBounds(NamedTuple):
    """Per-page key bounds, indexed by physical page like the centroids.

    key_min, key_max: [num_pages, Hkv, D] in float32 or the key cache's dtype (one dtype for both; a
    min/max of stored keys is exact in either), last dimension contiguous. A partial page's bounds
    cover its stored tokens only.
    """

    key_min: torch.Tensor
    key_max: torch.Tensor


#: Centroids [num_pages, Hkv, D], or the key bounds.
Landmarks: TypeAlias = torch.Tensor | KeyBounds


def page_score_of(landmarks: Landmarks) -> str:
    """``"minmax"`` for :class:`KeyBounds`, ``"centroid"`` for a centroid tensor."""
    return "minmax" if isinstance(landmarks, KeyBounds) else "centroid"
