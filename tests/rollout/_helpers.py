"""Helpers for the rollout tests: the tiny shape, a saved random transformers Qwen3, the method layer's
greedy decode loop over a contiguous cache (the reference the engine's sparse decode is held to), an allocator
that scatters pages, a benchmark script as a module."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType

import torch

from sparrow_nemo.hf_qwen3 import hf_config_dict
from sparrow_nemo.model_shapes import PRESETS, Qwen3Shape
from sparrow_nemo.rollout.torch.block_manager import BlockManager
from sparrow_nemo.rollout.torch.qwen3 import Qwen3Decoder
from sparrow_nemo.sparse.attention import sparse_decode_attention
from sparrow_nemo.sparse.pattern import PAGE_SIZE
from sparrow_nemo.sparse.schedule import DENSE_BUDGET, BudgetSchedule

REPO = Path(__file__).resolve().parents[2]

#: tiny-test with 3 layers, so the default 2 dense layers leave one sparse layer.
SHAPE: Qwen3Shape = PRESETS["tiny-test"].replace(num_layers=3)


def save_hf_qwen3(shape: Qwen3Shape, path: Path, seed: int = 0) -> Path:
    """A randomly initialised transformers Qwen3ForCausalLM of ``shape`` saved under ``path`` (fp32)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    # initializer_range 0.1: peakier next-token distributions than the default 0.02
    config = Qwen3Config(**hf_config_dict(shape), initializer_range=0.1)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).float().eval()
    with torch.no_grad():  # HF initialises norms to 1: perturb them so a mixed-up norm would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


def contiguous_reference(
    model: Qwen3Decoder,
    prompt: list[int],
    n_new: int,
    schedule: BudgetSchedule,
    dense_layers: int,
    page_size: int = PAGE_SIZE,
    page_score: str = "centroid",
) -> tuple[list[int], torch.Tensor]:
    """Greedy decode of one prompt with a growing contiguous cache and the method layer's
    sparse_decode_attention (page landmarks recomputed from the keys every step). Returns tokens, logprobs."""
    s = model.shape
    ids = torch.tensor(prompt)
    keys: list[torch.Tensor] = []
    vals: list[torch.Tensor] = []
    h = model.embed(ids)
    pos = torch.arange(len(prompt))
    for layer in range(s.num_layers):
        q, k, v = model.attention_inputs(layer, h, pos)
        keys.append(k.transpose(0, 1))  # [Hkv, L, D]
        vals.append(v.transpose(0, 1))
        g = s.gqa_group_size
        att = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(g, dim=1)) / math.sqrt(s.head_dim)
        att = att.masked_fill(
            torch.triu(torch.ones(len(prompt), len(prompt), dtype=torch.bool), 1), -math.inf
        )
        out = torch.einsum("hqk,khd->qhd", att.softmax(-1), v.repeat_interleave(g, dim=1))
        h = model.attention_output(layer, h, out)
    logits = model.logits(h[-1])
    tokens, logprobs = [], []
    for _ in range(n_new):
        tok = int(logits.argmax())
        tokens.append(tok)
        logprobs.append(float(torch.log_softmax(logits, -1)[tok]))
        if len(tokens) == n_new:
            break
        cached = len(prompt) + len(tokens)
        h = model.embed(torch.tensor([tok]))
        for layer in range(s.num_layers):
            q, k, v = model.attention_inputs(layer, h, torch.tensor([cached - 1]))
            keys[layer] = torch.cat([keys[layer], k.transpose(0, 1)], dim=1)
            vals[layer] = torch.cat([vals[layer], v.transpose(0, 1)], dim=1)
            budget = DENSE_BUDGET if layer < dense_layers else schedule.budget(cached)
            out = sparse_decode_attention(
                q,
                keys[layer][None],
                vals[layer][None],
                torch.tensor([cached]),
                budget,
                page_size,
                page_score=page_score,
            )
            h = model.attention_output(layer, h, out)
        logits = model.logits(h[0])
    return tokens, torch.tensor(logprobs)


class ScatteredBlocks(BlockManager):
    """A :class:`BlockManager` whose pages are renamed by a seeded random permutation: a row's pages lie scattered
    over the pool instead of in the runs the allocator places them in (kernels must not rely on either)."""

    def __init__(self, num_pages: int, page_size: int, seed: int) -> None:
        super().__init__(num_pages, page_size)
        self._name = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
        self._index = {page: i for i, page in enumerate(self._name)}

    def allocate(self, count: int, after: int | None = None) -> list[int]:
        placed = super().allocate(count, None if after is None else self._index[after])
        return [self._name[p] for p in placed]

    def share(self, pages: list[int]) -> None:
        super().share([self._index[p] for p in pages])

    def release(self, pages: list[int]) -> None:
        super().release([self._index[p] for p in pages])


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module, executed afresh (registered in ``sys.modules`` under ``name``,
    where dataclasses resolve their annotations)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
