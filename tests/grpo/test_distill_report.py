"""benchmarks/distill_report.py on a tiny random Qwen3 and the torch rollout engine (CPU, seconds).

A zero adapter (B = 0) is the base model: with and without it the same seeds give identical tails and
calibrations. A random adapter changes the rollouts, and the engine keeps the adapter afterwards.
"""

from __future__ import annotations

import torch
from rollout._helpers import load_benchmark

from sparrow_nemo.hf_qwen3 import LoraAdapter
from sparrow_nemo.model_shapes import PRESETS
from sparrow_nemo.policy.lora import LoraConfig, init_adapter
from sparrow_nemo.rollout.engine import SamplingParams
from sparrow_nemo.rollout.torch.engine import TorchRolloutEngine
from sparrow_nemo.sparse.cost_model import HARDWARE, DecodeCostModel
from sparrow_nemo.sparse.schedule import BudgetSchedule

SHAPE = PRESETS["tiny-test"]
#: benchmarks/distill_report.py (benchmark code, not in the package)
REPORT = load_benchmark("distill_report")
SCHEDULE = BudgetSchedule(bin_tokens=16, budgets=(16,), page_size=4, name="fixed:16")


def _setup():
    engine = TorchRolloutEngine.from_shape(SHAPE, seed=0, dense_layers=0, page_size=4)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, SHAPE.vocab_size, (n,), generator=g).tolist() for n in (9, 12, 14, 10)]
    sampling = SamplingParams(max_new_tokens=24, temperature=1.0, stop_token_ids=())
    zero = init_adapter(SHAPE, LoraConfig(rank=2, alpha=4.0, targets=("linear_qkv", "linear_proj")), seed=0)
    noisy = LoraAdapter(
        {n: (a, torch.randn(b.shape, generator=g)) for n, (a, b) in zero.weights.items()}, zero.scaling
    )
    return engine, prompts, sampling, zero, noisy


def test_zero_adapter_changes_nothing_and_a_real_one_does():
    engine, prompts, sampling, zero, noisy = _setup()
    same = REPORT.adapter_effect(engine, zero, prompts, sampling, SCHEDULE, seed=3)
    assert same["with"] == same["without"]
    assert same["without"].tokens and sum(same["without"].response_lengths) == 4 * 24
    changed = REPORT.adapter_effect(engine, noisy, prompts, sampling, SCHEDULE, seed=3)
    assert changed["without"] == same["without"]  # the base model, whatever adapter was loaded before
    assert changed["with"].mean_k3 != changed["without"].mean_k3
    assert engine.model.lora is not None and torch.equal(
        engine.model.lora.weights["model.layers.0.self_attn.o_proj"][1],
        noisy.weights["model.layers.0.self_attn.o_proj"][1],
    )


def test_calibrated_speedups_price_each_schedule_with_the_cost_model():
    engine, prompts, sampling, zero, _ = _setup()
    model = DecodeCostModel(SHAPE, HARDWARE["h200"], dense_layers=0)
    lengths, prompt_lens = [24] * 4, [len(p) for p in prompts]
    out = REPORT.calibrated_speedups(
        engine, zero, prompts, sampling, [16, 24, 32], 16, 4, model, lengths, prompt_lens, threshold=0.5
    )
    assert out["with"].result.schedule.budgets == out["without"].result.schedule.budgets
    for c in out.values():
        assert c.speedup == model.predicted_speedup(c.result.schedule, lengths, prompt_lens)
    assert engine.model.lora is not None
