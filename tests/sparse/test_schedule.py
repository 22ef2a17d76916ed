"""BudgetSchedule: presets from docs/METHOD.md, step-function lookup, validation, YAML round trip."""

from __future__ import annotations

import pytest
import torch
import yaml
from hypothesis import given
from hypothesis import strategies as st

from sparrow_nemo.sparse.attention import select_pages
from sparrow_nemo.sparse.schedule import DENSE_BUDGET, PAPER_SCHEDULES, BudgetSchedule


def test_paper_schedule_1_7b_086_in_tokens():
    s = BudgetSchedule.from_preset("qwen3-1.7b-0.86")
    pages = [29, 61, 93, 93, 125, 157, 189, 221, 221, 253] + [253] * 10
    assert s.budgets == tuple((p + 3) * 16 for p in pages)
    assert s.budgets[0] == 512 and s.budgets[-1] == 4096
    assert (s.bin_tokens, s.page_size, s.name) == (2000, 16, "qwen3-1.7b-0.86")


@pytest.mark.parametrize("name", sorted(PAPER_SCHEDULES))
def test_every_published_preset_is_valid(name):
    s = BudgetSchedule.from_preset(name.upper())
    assert len(s.budgets) == 20 and s.bin_tokens == 2000 and not s.is_dense
    assert all(b % 16 == 0 and b >= 32 * 16 for b in s.budgets)
    assert list(s.budgets) == sorted(s.budgets)


def test_preset_table_has_every_row_of_method_md():
    assert len(PAPER_SCHEDULES) == 20
    assert BudgetSchedule.from_preset("qwen3-8b-0.86").budgets[-1] == 7168  # docs/METHOD.md: 8B reaches 7,168
    assert BudgetSchedule.from_preset("qwen3-14b-0.86").budgets[-1] == 14336  # 14B: 14,336


def test_budget_is_a_step_function_of_cached_length():
    s = BudgetSchedule(bin_tokens=100, budgets=(32, 64, 128))
    assert [s.budget(n) for n in (0, 99, 100, 199, 200, 10**9)] == [32, 32, 64, 64, 128, 128]
    with pytest.raises(ValueError, match="cached_len"):
        s.budget(-1)


@given(st.lists(st.integers(0, 5000), min_size=1, max_size=40))
def test_budgets_for_matches_budget(lengths):
    s = BudgetSchedule(bin_tokens=250, budgets=(16, 48, 48, 96, 512))
    out = s.budgets_for(torch.tensor(lengths), dtype=torch.int32)
    assert out.dtype == torch.int32
    assert out.tolist() == [s.budget(n) for n in lengths]


def test_dense_keeps_every_page():
    d = BudgetSchedule.from_preset("dense")
    assert d.is_dense and d.budget(10**9) == DENSE_BUDGET >= 10**9
    assert d.budgets_for(torch.tensor([5, 40_000]), dtype=torch.int32).tolist() == [DENSE_BUDGET] * 2
    q, k = torch.randn(1, 2, 4), torch.randn(1, 1, 200, 4)
    idx = select_pages(q, k, torch.tensor([200]), d.budget(200))
    assert idx.tolist() == [[list(range(13))]]


def test_fixed_preset():
    s = BudgetSchedule.from_preset("fixed:4096")
    assert s.budgets == (4096,) and s.budget(0) == s.budget(10**6) == 4096 and not s.is_dense
    with pytest.raises(ValueError, match="fixed:<tokens>"):
        BudgetSchedule.from_preset("fixed:lots")
    with pytest.raises(ValueError, match="multiple of page_size"):
        BudgetSchedule.from_preset("fixed:100")


def test_unknown_preset_lists_known_names():
    with pytest.raises(ValueError, match=r"qwen3-1\.7b-0\.86"):
        BudgetSchedule.from_preset("qwen3-1.7b-0.99")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"bin_tokens": 0, "budgets": (16,)}, "bin_tokens"),
        ({"bin_tokens": 10, "budgets": ()}, "at least one"),
        ({"bin_tokens": 10, "budgets": (32, 16)}, r"bin 1 has 16 tokens after bin 0 with 32"),
        ({"bin_tokens": 10, "budgets": (16, -32)}, r"bin 1 .*got -32"),
        ({"bin_tokens": 10, "budgets": (16, 40)}, r"bin 1 .*multiple of page_size=16"),
        ({"bin_tokens": 10, "budgets": (16, 32.0)}, r"bin 1 must be an int"),
        ({"bin_tokens": 10, "budgets": (16,), "page_size": 0}, "page_size"),
    ],
)
def test_validation_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BudgetSchedule(**kwargs)


@pytest.mark.parametrize("name", ["qwen3-1.7b-0.86", "dense", "fixed:1024"])
def test_yaml_round_trip(name, tmp_path):
    s = BudgetSchedule.from_preset(name)
    assert BudgetSchedule.from_yaml(s.to_yaml()) == s
    path = tmp_path / "schedule.yaml"
    s.to_yaml(path)
    assert BudgetSchedule.from_yaml(path) == s
    assert BudgetSchedule.from_yaml(str(path)) == s
    assert BudgetSchedule.from_dict(s.to_dict()) == s


def test_dense_bins_are_written_as_words():
    s = BudgetSchedule(bin_tokens=100, budgets=(64, DENSE_BUDGET), name="partly dense")
    assert yaml.safe_load(s.to_yaml())["budgets"] == [64, "dense"]
    assert BudgetSchedule.from_yaml(s.to_yaml()) == s and not s.is_dense


def test_schedule_yaml_reads_as_the_recipes_do():
    # YAML 1.2 booleans: a name "off" stays a name (YAML 1.1 made it False); duplicate keys are an error
    assert BudgetSchedule.from_yaml("bin_tokens: 100\nbudgets: [64]\nname: off\n").name == "off"
    with pytest.raises(ValueError, match=r"schedule YAML does not parse line 2.*duplicate key"):
        BudgetSchedule.from_yaml("bin_tokens: 100\nbin_tokens: 50\nbudgets: [64]\n")


def test_schedule_file_errors():
    with pytest.raises(ValueError, match=r"bin 2 has 32 tokens after bin 1 with 64"):
        BudgetSchedule.from_yaml("bin_tokens: 2000\nbudgets: [32, 64, 32]\n")
    with pytest.raises(ValueError, match="unknown keys"):
        BudgetSchedule.from_yaml("bin_tokens: 2000\nbudgets: [32]\nbudget: 3\n")
    with pytest.raises(ValueError, match="missing keys"):
        BudgetSchedule.from_yaml("budgets: [32]\n")
    with pytest.raises(ValueError, match="list of token counts"):
        BudgetSchedule.from_dict({"bin_tokens": 10, "budgets": "32"})
    with pytest.raises(ValueError, match="mapping"):
        BudgetSchedule.from_yaml("- 1\n- 2\n")
