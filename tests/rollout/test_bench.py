"""Dense re-scoring of rollouts, the bench table and the JSONL benchmark script."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sparrow_nemo.model_shapes import PRESETS
from sparrow_nemo.rollout import SamplingParams, TorchRolloutEngine
from sparrow_nemo.rollout.scoring import measure_mismatch
from sparrow_nemo.rollout.tools.bench import bench_rollout, make_engine
from sparrow_nemo.sparse.mismatch import acceptance_rate
from sparrow_nemo.sparse.schedule import BudgetSchedule

from ._helpers import SHAPE, load_benchmark


def test_measure_mismatch_aligns_rollout_and_dense_positions(hf_dir: Path) -> None:
    from transformers import Qwen3ForCausalLM

    engine = TorchRolloutEngine.from_hf_dir(hf_dir, dense_layers=1)
    hf = Qwen3ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, SHAPE.vocab_size, (n,), generator=gen).tolist() for n in (50, 20)]
    full = SamplingParams(max_new_tokens=30, seed=2, stop_token_ids=(), logprobs_topk=SHAPE.vocab_size)
    dense = engine.generate(prompts, full, BudgetSchedule.dense())
    assert (measure_mismatch(engine, dense).alpha - 1).abs().max() < 1e-4

    sparse = engine.generate(prompts, full, BudgetSchedule.from_preset("fixed:32"))
    m = measure_mismatch(engine, sparse)
    # top-K = whole vocabulary: the bound is the exact alpha between HF's dense and the rollout's q
    expected = []
    for s in sparse.samples:
        ids = torch.cat([s.prompt_ids, s.response_ids])
        with torch.no_grad():
            logp = torch.log_softmax(hf(ids[None]).logits[0].float(), -1)[s.prompt_ids.numel() - 1 : -1]
        logq = torch.full_like(logp, -torch.inf).scatter(-1, s.top_ids, s.top_logprobs)
        expected.append(acceptance_rate(logp, logq))
    assert (m.alpha - torch.cat(expected)).abs().max() < 1e-4
    assert m.alpha.min() < 0.9999  # sparsity really changed something
    assert torch.equal(m.cached_len, torch.cat([s.cached_len for s in sparse.samples]))


def test_bench_rollout_rows_and_table() -> None:
    lines: list[str] = []
    step = BudgetSchedule(bin_tokens=32, budgets=(32, 48), name="step")
    rows = bench_rollout(
        make_engine(SHAPE, dense_layers=1),
        batch=3,
        prompt_len=20,
        gen_len=40,
        schedules=["fixed:32", step],
        print_fn=lines.append,
    )
    assert [r["schedule"] for r in rows] == ["dense", "fixed:32", "step"]
    assert rows[0]["speedup_vs_dense"] == 1.0 and rows[0]["acceptance/min_p5"] > 0.9999
    assert all(
        r["tokens"] == 120 and r["bin_tokens"] == 32 and r["logprobs_topk"] == SHAPE.vocab_size for r in rows
    )
    assert rows[1]["kept_kv_fraction"] < 1.0 and rows[1]["acceptance/min_p5"] < 1.0
    assert set(k for k in rows[2] if k.startswith("acceptance/p5/bin_")) == {
        "acceptance/p5/bin_0",
        "acceptance/p5/bin_1",
    }
    table = lines[0]
    assert "p5 bin0" in table and "p5 bin1" in table and "fixed:32" in table


def test_throughput_script_appends_json_lines(tmp_path: Path) -> None:
    script = load_benchmark("rollout_throughput")
    out = tmp_path / "r.jsonl"
    args = [
        "--shape",
        "tiny-test",
        "--batch",
        "2",
        "3",
        "--prompt-len",
        "8",
        "--gen-len",
        "12",
        "--schedules",
        "fixed:16",
        "--out",
        str(out),
    ]
    script.main(args)
    script.main([*args[:3], "4", *args[5:]])  # batch 4 only
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 6  # (2 batch sizes, then 1) x (dense, fixed:16)
    assert {r["batch"] for r in rows} == {2, 3, 4} and {r["schedule"] for r in rows} == {"dense", "fixed:16"}
    for r in rows:
        assert (
            r["torch"] == torch.__version__ and r["date"] and r["host"] is not None and r["tokens_per_s"] > 0
        )


def test_cpu_decode_script_appends_json_lines(tmp_path: Path) -> None:
    """benchmarks/cpu_decode.py (docs/results.md's bench numbers) on small contexts: one line per (context,
    schedule, page score) with the machine, the load before and after, the bound and the ratio."""
    script = load_benchmark("cpu_decode")
    out = tmp_path / "d.jsonl"
    argv = [
        "--shape",
        "tiny-test",
        "--batch",
        "2",
        "--contexts",
        "64",
        "128",
        "--steps",
        "2",
        "--repeats",
        "1",
    ]
    script.main([*argv, "--fractions", "0.25", "--out", str(out), "--page-scores", "centroid", "minmax"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    configs = [(64, "dense"), (64, "25% fixed"), (128, "dense"), (128, "25% fixed")]
    assert [(r["context"], r["schedule"], r["page_score"]) for r in rows] == [
        (*c, score) for score in ("centroid", "minmax") for c in configs
    ]
    for r in rows:
        assert r["benchmark"] == "cpu_decode" and r["date"] and r["cpu_count"] >= 1
        assert r["load_avg_1m_start"] >= 0 and r["tokens_per_s"] > 0 and r["bound_tokens_per_s"] > 0
        assert r["dense_vs_bound"] > 0 and r["bandwidth_gb_s"] > 0


def test_page_score_calibration_script_appends_one_line_per_score(tmp_path: Path) -> None:
    """benchmarks/page_score_calibration.py on the smoke recipe (random weights, no warm-start, a lenient
    threshold so every bin takes the smaller candidate): one line per page score with its budgets and p5s."""
    script = load_benchmark("page_score_calibration")
    out = tmp_path / "c.jsonl"
    overrides = [
        "warmstart.enabled=false",
        "control.calibration.num_prompts=2",
        "control.calibration.samples_per_prompt=1",
        "control.calibration.candidate_budgets=[64, 96]",
        "rollout.max_new_tokens=24",
        "sparsity.threshold=0.01",
    ]
    argv = [
        "--config",
        "tiny_cpu_short_smoke",
        "--out",
        str(out),
        "--work-dir",
        str(tmp_path / "w"),
        *overrides,
    ]
    script.main(argv)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["page_score"] for r in rows] == ["centroid", "minmax"]
    for r in rows:
        assert r["benchmark"] == "page_score_calibration" and r["date"] and r["load_avg_1m_start"] >= 0
        assert set(r["tails"]) == {"64", "96"} and r["budgets"] and set(r["budgets"]) <= {64, 96}
        assert all(p is not None and p >= 0.01 for p in r["chosen_p5"])
        assert (tmp_path / "w" / r["page_score"] / "calibration_table.json").is_file()


def test_page_choice_oracle_layer_sets_name_a_bad_layer() -> None:
    script = load_benchmark("page_choice_oracle")
    assert script.layer_sets(["all", "3,1", "0"], 4) == [(0, 1, 2, 3), (1, 3), (0,)]
    with pytest.raises(ValueError, match=r"--sparse-layers '1,4': layer\(s\) \[4\] outside the model's 0..3"):
        script.layer_sets(["1,4"], 4)


def test_page_choice_oracle_keeps_the_dense_output_when_the_budget_covers_the_cache(tmp_path: Path) -> None:
    """benchmarks/page_choice_oracle.py on the smoke recipe (the shipped warm-start of the default): one line per
    (ranking, sparse layers, budget); a budget above every sequence's length keeps every page, so alpha is 1 for
    every ranking, and a one-page budget moves the output off the dense one somewhere."""
    script = load_benchmark("page_choice_oracle")
    out = tmp_path / "o.jsonl"
    argv = ["--config", "tiny_cpu_smoke", "--prompts", "3", "--budgets", "16", "4096", "--out", str(out)]
    script.main(
        [*argv, "--rankings", "minmax", "centroid", "keymax", "oracle", "--sparse-layers", "all", "1"]
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4 * 2 * 2
    for r in rows:
        assert r["benchmark"] == "page_choice_oracle" and r["date"] and r["prompts"] == 3
        assert (
            set(r["p1"]) == set(r["p5"]) == set(r["tokens_per_bin"]) and sum(r["tokens_per_bin"].values()) > 0
        )
        assert all(0.0 <= r["p1"][b] <= r["p5"][b] <= 1.0 for b in r["p1"])
        if r["budget"] == 4096:
            assert min(r["p1"].values()) > 1 - 1e-5, r
        # the whole-cache budget passes every bin, so the rule's schedule never falls back to dense
        assert (
            set(r["calibrated"]["budgets"]) <= {16, 4096} and r["calibrated"]["bin_tokens"] == r["bin_tokens"]
        )
    one_page = [r for r in rows if r["budget"] == 16 and r["sparse_layers"] == [0, 1, 2, 3]]
    assert min(min(r["p1"].values()) for r in one_page) < 1 - 1e-3


def test_page_choice_oracle_keymax_is_each_heads_page_maximum_share() -> None:
    """The keymax score against a loop over positions, heads and pages: log of the group's summed softmax (over
    the pages) of each head's largest causal logit in the page; keys after a position never move its scores."""
    script = load_benchmark("page_choice_oracle")
    torch.manual_seed(0)
    seq, hkv, group, d, ps = 11, 2, 2, 8, 4
    q, k = torch.randn(seq, hkv * group, d), torch.randn(seq, hkv, d)
    got = script.key_max_scores(q, k, ps)
    pages = -(-seq // ps)
    assert got.shape == (seq, hkv, pages)
    for s in range(seq):
        for h in range(hkv):
            share = torch.zeros(pages)
            for g in range(group):
                m = torch.full((pages,), float("-inf"))
                for p in range(min(pages, s // ps + 1)):
                    keys = k[p * ps : min((p + 1) * ps, s + 1), h]
                    m[p] = (keys @ q[s, h * group + g]).max() / d**0.5
                share += torch.softmax(m, 0)
            torch.testing.assert_close(got[s, h], share.log(), rtol=1e-5, atol=1e-5)
    later = k.clone()
    later[6:] = torch.randn(seq - 6, hkv, d) * 10
    torch.testing.assert_close(script.key_max_scores(q, later, ps)[:6], got[:6])


def test_schedule_ab_alternates_the_arms_and_pools_their_rates(tmp_path: Path) -> None:
    """benchmarks/schedule_ab.py on the smoke recipe: ABBA order, one pair ratio per repeat, the pooled speedup
    from the arms' summed tokens and seconds; a dense schedule is refused."""
    script = load_benchmark("schedule_ab")
    assert script.abba(3) == [("dense", "sparse"), ("sparse", "dense"), ("dense", "sparse")]
    out = tmp_path / "ab.jsonl"
    small = ["--config", "tiny_cpu_smoke", "--prompts", "2", "--repeats", "2", "--out", str(out)]
    row = script.main([*small, "rollout.max_new_tokens=64", "sparsity.budgets=[64]"])
    assert json.loads(out.read_text()) == json.loads(json.dumps(row))
    assert row["benchmark"] == "schedule_ab" and row["schedule"]["budgets"] == [64] and row["prompts"] == 2
    assert len(row["pair_speedups"]) == 2 and len(row["runs"]["dense"]) == len(row["runs"]["sparse"]) == 2
    tokens = sum(t for t, _ in row["runs"]["sparse"])
    seconds = sum(s for _, s in row["runs"]["sparse"])
    assert row["sparse_tokens_per_s"] == pytest.approx(tokens / seconds)
    assert row["speedup"] == pytest.approx(row["sparse_tokens_per_s"] / row["dense_tokens_per_s"])
    with pytest.raises(SystemExit, match="the schedule is dense"):
        script.main([*small, "sparsity.schedule=dense"])


def test_decode_profile_splits_each_arm_and_bounds_the_speedup(tmp_path: Path) -> None:
    """benchmarks/decode_profile.py on the smoke recipe: every layer's attention timed in both arms, the
    per-token split adds up to the wall time, and the Amdahl bound and its inverse are exact."""
    script = load_benchmark("decode_profile")
    assert script.amdahl(4.0, 2.0, 2.0, 0.5) == pytest.approx(4.0 / 3.0)
    assert script.amdahl(4.0, 2.0, 2.0, 0.0) == pytest.approx(2.0)
    assert script.needed_r(4.0, 2.0, 2.0, 4.0 / 3.0) == pytest.approx(0.5)
    assert script.needed_r(4.0, 2.0, 2.0, 2.5) < 0  # above the r = 0 ceiling of 2x: out of reach
    out = tmp_path / "profile.jsonl"
    small = ["--config", "tiny_cpu_smoke", "--prompts", "2", "--repeats", "1", "--out", str(out)]
    row = script.main(
        [*small, "rollout.max_new_tokens=48", "sparsity.budgets=[64]", "sparsity.dense_layers=1"]
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(row))
    layers = PRESETS["tiny"].num_layers
    for arm in ("dense", "sparse"):
        assert sorted(map(int, row["layer_seconds"][arm])) == list(range(layers)), arm
        split = row["us_per_token"][arm]
        assert min(split.values()) > 0, split
        assert split["rest"] + split["dense"] + split["sparse"] == pytest.approx(split["total"])
    assert row["dense_layers"] == 1 and row["ceiling_speedup"] > row["measured_speedup"] > 0
    dense, sparse = row["us_per_token"]["dense"], row["us_per_token"]["sparse"]
    parts = (dense["total"], sparse["rest"] + sparse["dense"], dense["sparse"])
    # at the measured ratio the bound gives back the measured speedup: the split accounts for all the time
    assert script.amdahl(*parts, row["sparse_attention_ratio"]) == pytest.approx(row["measured_speedup"])
