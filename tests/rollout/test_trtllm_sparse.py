"""The "sparrow" TensorRT-LLM algorithm's settings: recipe -> spec -> ``sparse_attention_config`` dict and back."""

from __future__ import annotations

import pytest

from sparrow_nemo.grpo.recipe import load_config
from sparrow_nemo.rollout.trtllm.sparse import ALGORITHM, SparrowSparseSpec
from sparrow_nemo.sparse.schedule import BudgetSchedule

PS = 4


def _spec(budgets: tuple[int, ...] = (16, 24), bin_tokens: int = 20) -> SparrowSparseSpec:
    return SparrowSparseSpec(
        BudgetSchedule(bin_tokens=bin_tokens, budgets=budgets, page_size=PS, name="t"), dense_layers=1
    )


def test_config_dict_round_trip_and_recipe() -> None:
    spec = SparrowSparseSpec(BudgetSchedule.from_preset("qwen3-1.7b-0.86"))
    data = spec.to_config_dict()
    assert data["algorithm"] == ALGORITHM == "sparrow"
    assert data["page_size"] == 16 and data["sink_pages"] == 1 and data["local_pages"] == 2
    assert data["dense_layers"] == 2 and data["bin_tokens"] == 2000
    assert data["budgets"][0] == (29 + 3) * 16 and data["budgets"][-1] == (253 + 3) * 16
    assert SparrowSparseSpec.from_config_dict(data) == spec
    dense = SparrowSparseSpec(BudgetSchedule.dense())
    assert dense.to_config_dict()["budgets"] == ["dense"]
    assert SparrowSparseSpec.from_config_dict(dense.to_config_dict()) == dense
    assert not dense.is_sparse_layer(5) and spec.is_sparse_layer(2) and not spec.is_sparse_layer(1)
    # landmarks are kept for every layer that may select pages, whatever the current schedule
    assert dense.keeps_landmarks(2) and not dense.keeps_landmarks(1) and spec.keeps_landmarks(2)
    assert data["page_score"] == "centroid"  # the default: the paper's score
    legacy = {k: v for k, v in data.items() if k != "page_score"}  # a dict written before the knob
    assert SparrowSparseSpec.from_config_dict(legacy) == spec

    config = load_config("tiny_cpu_short", ["sparsity.dense_layers=1", "sparsity.sink_pages=0"])
    from_section = SparrowSparseSpec.from_sparsity(config.sparsity)
    assert (from_section.dense_layers, from_section.local_pages, from_section.sink_pages) == (1, 2, 0)
    assert from_section.schedule == config.sparsity.build_schedule()

    minmax = SparrowSparseSpec.from_sparsity(
        load_config("tiny_cpu_short", ["sparsity.page_score=minmax"]).sparsity
    )
    assert minmax.page_score == "minmax" and minmax.to_config_dict()["page_score"] == "minmax"
    assert SparrowSparseSpec.from_config_dict(minmax.to_config_dict()) == minmax
    assert minmax.with_schedule(BudgetSchedule(20, (16,), minmax.page_size)).page_score == "minmax"


def test_config_dict_errors_name_the_key() -> None:
    good = _spec().to_config_dict()
    with pytest.raises(ValueError, match="algorithm must be 'sparrow'"):
        SparrowSparseSpec.from_config_dict({**good, "algorithm": "rocket"})
    with pytest.raises(ValueError, match="unknown keys \\['topk'\\]"):
        SparrowSparseSpec.from_config_dict({**good, "topk": 4})
    with pytest.raises(ValueError, match="missing keys \\['budgets'\\]"):
        SparrowSparseSpec.from_config_dict({k: v for k, v in good.items() if k != "budgets"})
    with pytest.raises(ValueError, match="multiple of page_size"):
        SparrowSparseSpec.from_config_dict({**good, "budgets": [17]})
    with pytest.raises(ValueError, match=r"page_score must be one of \('centroid', 'minmax'\), got 'mean'"):
        SparrowSparseSpec.from_config_dict({**good, "page_score": "mean"})
    with pytest.raises(ValueError, match="page_size=16"):
        _spec().with_schedule(BudgetSchedule.from_preset("fixed:64"))
