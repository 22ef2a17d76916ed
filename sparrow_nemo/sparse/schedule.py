"""Dynamic sparsity schedule: the KV budget as a step function of the cached length.

A :class:`BudgetSchedule` holds one budget (tokens, the 3 reserved pages included) per bin of
``bin_tokens`` cached tokens; the last budget holds for every longer length. Bin i covers cached
lengths [i * bin_tokens, (i + 1) * bin_tokens). The published Qwen3 schedules of the Sparrow paper
(docs/METHOD.md) are presets; ``dense`` keeps every page and ``fixed:<tokens>`` is one constant budget.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from sparrow_nemo.config.yaml_io import YamlProblem, load_yaml
from sparrow_nemo.sparse.pattern import PAGE_SIZE

__all__ = ["DENSE_BUDGET", "PAPER_BIN_TOKENS", "PAPER_SCHEDULES", "RESERVED_PAGES", "BudgetSchedule"]

#: Budget (tokens) that means "keep every page": larger than any cache, and it fits int32.
DENSE_BUDGET = 2**31 - 1
#: Pages every budget reserves: 1 attention-sink page + 2 local-window pages.
RESERVED_PAGES = 3
#: Bin width (tokens of cached length) of the paper's schedules.
PAPER_BIN_TOKENS = 2000

#: The paper's published schedules: top-k pages per 2,000-token bin (add RESERVED_PAGES, x 16).
PAPER_SCHEDULES: dict[str, tuple[int, ...]] = {
    name: tuple(int(v) for v in values.split())
    for name, values in {
        "qwen3-1.7b-0.75": "29 29 45 45 61 61 77 77 93 93 93 93 93 93 93 93 93 93 93 93",
        "qwen3-1.7b-0.80": "29 45 61 77 93 93 125 125 125 157 157 157 157 157 157 157 157 157 157 157",
        "qwen3-1.7b-0.83": "29 61 77 93 125 125 157 157 189 189 189 189 189 189 189 189 189 189 189 189",
        "qwen3-1.7b-0.86": "29 61 93 93 125 157 189 221 221 253 253 253 253 253 253 253 253 253 253 253",
        "qwen3-1.7b-0.88": "45 77 125 157 157 189 221 253 253 317 317 317 317 317 317 317 317 317 317 317",
        "qwen3-1.7b-0.90": "45 93 157 189 221 253 317 317 381 381 381 381 381 381 381 381 381 381 381 381",
        "qwen3-1.7b-0.92": "61 125 189 221 253 317 381 381 445 509 509 509 509 509 509 509 509 509 509 509",
        "qwen3-1.7b-0.94": "77 157 221 317 381 445 509 509 637 765 765 765 765 765 765 765 765 765 765 765",
        "qwen3-4b-0.75": "29 29 29 29 45 61 77 93 125 125 125 125 157 157 157 157 157 157 189 189",
        "qwen3-4b-0.80": "29 29 45 61 77 93 125 157 157 157 189 221 221 221 221 221 221 221 221 221",
        "qwen3-4b-0.86": "29 45 61 77 93 125 157 221 253 253 317 317 317 317 381 381 381 381 509 509",
        "qwen3-4b-0.88": "29 61 93 125 157 189 253 317 381 445 445 509 509 509 637 637 637 637 637 637",
        "qwen3-4b-0.90": "45 77 125 157 189 253 317 445 637 765 765 765 765 765 765 893 893 893 893 893",
        "qwen3-4b-0.92": "45 93 157 189 253 381 445 765 893 1021 1021 1149 1149 1149 1149 1149 1149 1149 1149 1149",
        "qwen3-8b-0.75": "29 29 29 45 45 77 77 77 93 93 93 93 125 125 125 125 125 125 157 157",
        "qwen3-8b-0.80": "29 29 45 61 77 93 125 125 157 157 189 189 189 221 221 221 221 253 253 253",
        "qwen3-8b-0.86": "29 45 61 77 125 157 189 253 253 253 253 317 317 317 317 317 317 385 445 445",
        "qwen3-8b-0.87": "29 61 77 93 157 189 221 317 317 317 317 381 381 381 381 381 445 445 509 509",
        "qwen3-8b-0.92": "45 93 125 189 253 445 509 637 765 765 765 893 893 893 893 893 1021 1021 1021 1021",
        "qwen3-14b-0.86": "29 45 77 125 253 381 381 381 381 381 381 381 381 381 381 509 637 637 893 893",
    }.items()
}

_DENSE_WORD = "dense"


@dataclass(frozen=True)
class BudgetSchedule:
    """KV budget (tokens) per bin of cached length; flat after the last bin.

    Attributes:
        bin_tokens: bin width in tokens of cached length (> 0).
        budgets: budget per bin in tokens, the reserved sink/local pages included; each a positive
            multiple of page_size (or DENSE_BUDGET = keep all), non-decreasing.
        page_size: tokens per KV page.
        name: label (preset name or free text).
    """

    bin_tokens: int
    budgets: tuple[int, ...]
    page_size: int = PAGE_SIZE
    name: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "budgets", tuple(self.budgets))
        label = f"schedule '{self.name}'" if self.name else "schedule"
        for key in ("page_size", "bin_tokens"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{label}: {key} must be an int > 0 (tokens), got {value!r}")
        if not self.budgets:
            raise ValueError(f"{label}: budgets must hold at least one value")
        for i, b in enumerate(self.budgets):
            if isinstance(b, bool) or not isinstance(b, int):
                raise ValueError(f"{label}: budget of bin {i} must be an int (tokens), got {b!r}")
            if b <= 0 or (b != DENSE_BUDGET and b % self.page_size):
                raise ValueError(
                    f"{label}: budget of bin {i} must be a positive multiple of page_size={self.page_size} "
                    f"tokens (or '{_DENSE_WORD}'), got {b}"
                )
        for i in range(1, len(self.budgets)):
            if self.budgets[i] < self.budgets[i - 1]:
                raise ValueError(
                    f"{label}: budgets must be non-decreasing, but bin {i} has {self.budgets[i]} tokens "
                    f"after bin {i - 1} with {self.budgets[i - 1]}"
                )

    # ----- queries -------------------------------------------------------------------------
    @property
    def is_dense(self) -> bool:
        """True when every bin keeps every page."""
        return all(b == DENSE_BUDGET for b in self.budgets)

    def budget(self, cached_len: int) -> int:
        """Budget in tokens for a sequence with ``cached_len`` tokens in its KV cache."""
        if cached_len < 0:
            raise ValueError(f"cached_len must be >= 0 tokens, got {cached_len}")
        return self.budgets[min(cached_len // self.bin_tokens, len(self.budgets) - 1)]

    def budgets_for(self, cached_len: torch.Tensor, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """Vectorised :meth:`budget`: [*] integer cached lengths -> [*] budgets (tokens) in ``dtype``."""
        if cached_len.dtype.is_floating_point or cached_len.dtype == torch.bool:
            raise ValueError(f"cached_len must be an integer tensor, got {cached_len.dtype}")
        if cached_len.numel() and int(cached_len.min()) < 0:
            raise ValueError(f"cached_len must be >= 0 tokens, got min {int(cached_len.min())}")
        table = torch.tensor(self.budgets, dtype=torch.int64, device=cached_len.device)
        bins = torch.clamp(cached_len.to(torch.int64) // self.bin_tokens, max=len(self.budgets) - 1)
        return table[bins].to(dtype)

    # ----- construction --------------------------------------------------------------------
    @classmethod
    def dense(cls, bin_tokens: int = PAPER_BIN_TOKENS, page_size: int = PAGE_SIZE) -> BudgetSchedule:
        """The schedule that keeps every page at every length."""
        return cls(bin_tokens=bin_tokens, budgets=(DENSE_BUDGET,), page_size=page_size, name=_DENSE_WORD)

    @classmethod
    def from_pages(
        cls,
        top_k_pages: Sequence[int],
        bin_tokens: int = PAPER_BIN_TOKENS,
        page_size: int = PAGE_SIZE,
        name: str = "",
    ) -> BudgetSchedule:
        """Schedule from top-k page counts per bin, as the paper writes them: budget = (k + 3) * page_size."""
        return cls(
            bin_tokens=bin_tokens,
            budgets=tuple((int(k) + RESERVED_PAGES) * page_size for k in top_k_pages),
            page_size=page_size,
            name=name,
        )

    @classmethod
    def preset_names(cls) -> list[str]:
        """Names :meth:`from_preset` accepts (``fixed:<tokens>`` stands for any token count)."""
        return [*PAPER_SCHEDULES, _DENSE_WORD, "fixed:<tokens>"]

    @classmethod
    def from_preset(
        cls, name: str, bin_tokens: int = PAPER_BIN_TOKENS, page_size: int = PAGE_SIZE
    ) -> BudgetSchedule:
        """A published schedule (e.g. ``qwen3-1.7b-0.86``), ``dense`` or ``fixed:<tokens>``.

        ``bin_tokens`` and ``page_size`` apply to ``dense`` and ``fixed:<tokens>`` (any scale); the
        published schedules are in the paper's 16-token pages and 2,000-token bins.
        """
        key = name.strip().lower()
        if key == _DENSE_WORD:
            return cls.dense(bin_tokens, page_size)
        if key.startswith("fixed:"):
            value = key.removeprefix("fixed:")
            if not value.isdigit():
                raise ValueError(
                    f"schedule preset '{name}': expected fixed:<tokens> with an integer, got '{value}'"
                )
            return cls(bin_tokens=bin_tokens, budgets=(int(value),), page_size=page_size, name=key)
        if key in PAPER_SCHEDULES:
            return cls.from_pages(PAPER_SCHEDULES[key], name=key)
        raise ValueError(f"unknown schedule preset '{name}'; known presets: {', '.join(cls.preset_names())}")

    # ----- serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain dict (YAML/JSON friendly); a keep-everything bin is written as 'dense'."""
        return {
            "name": self.name,
            "bin_tokens": self.bin_tokens,
            "page_size": self.page_size,
            "budgets": [_DENSE_WORD if b == DENSE_BUDGET else b for b in self.budgets],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BudgetSchedule:
        """Inverse of :meth:`to_dict`; unknown or missing keys are a ValueError naming them."""
        if not isinstance(data, Mapping):
            raise ValueError(f"a schedule must be a mapping, got {type(data).__name__}")
        known = {"name", "bin_tokens", "page_size", "budgets"}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"schedule: unknown keys {sorted(unknown)}; expected {sorted(known)}")
        missing = {"bin_tokens", "budgets"} - set(data)
        if missing:
            raise ValueError(f"schedule: missing keys {sorted(missing)}")
        raw = data["budgets"]
        if isinstance(raw, str | bytes) or not isinstance(raw, Sequence):
            raise ValueError(f"schedule: 'budgets' must be a list of token counts, got {raw!r}")
        budgets = tuple(DENSE_BUDGET if b == _DENSE_WORD else b for b in raw)
        return cls(
            bin_tokens=data["bin_tokens"],
            budgets=budgets,
            page_size=data.get("page_size", 16),
            name=str(data.get("name", "")),
        )

    def to_yaml(self, path: str | Path | None = None) -> str:
        """YAML text of :meth:`to_dict`; also written to ``path`` when given."""
        text = yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None)
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_yaml(cls, source: str | Path) -> BudgetSchedule:
        """Schedule from a YAML file path or a YAML string; a bad file is a one-line ValueError naming it."""
        is_file = isinstance(source, Path) or ("\n" not in source and os.path.isfile(source))
        where = f"schedule file {source}" if is_file else "schedule YAML"
        try:  # the recipes' YAML: 1.2 booleans (true/false only), bounded nesting and size, no duplicate keys
            data = load_yaml(Path(source).read_text() if is_file else source)
        except YamlProblem as problem:
            raise ValueError(f"{where} does not parse{problem.where()}: {problem.problem}") from None
        try:
            return cls.from_dict(data)
        except ValueError as exc:
            if not is_file:
                raise
            raise ValueError(f"{where}: {exc}") from None
