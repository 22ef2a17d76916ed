"""``rollout.inject_mismatch``: at hash-chosen positions the torch engine draws from (1 - d) p + d u and records
that mixture's logprobs; the acceptance rate there is 1 - d TV(p, u); off, the sampler is the plain one.

The model is constructed peaked (the LM head scaled until the dense next-token distributions put almost all
their mass on one id, mean TV(p, u) > 0.97, measured), as a trained chain policy is; the experiments' three
matched-mean arms (``experiments/tolerant_arms.yaml``) are then measured on it with margins."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sparrow_nemo.config import ConfigError
from sparrow_nemo.experiments.arms import load_arms
from sparrow_nemo.grpo.recipe import load_config
from sparrow_nemo.model_shapes import PRESETS
from sparrow_nemo.rollout import SamplingParams, TorchRolloutEngine
from sparrow_nemo.rollout.engine import MismatchInjection
from sparrow_nemo.rollout.sampling import INJECT, injection_mix, position_uniforms, sample_seed
from sparrow_nemo.rollout.scoring import measure_mismatch
from sparrow_nemo.rollout.torch.cuda_graphs import sample_step
from sparrow_nemo.rollout.torch.qwen3 import Qwen3Decoder
from sparrow_nemo.rollout.torch.speculative import SpeculativeConfig
from sparrow_nemo.sparse.schedule import BudgetSchedule

REPO = Path(__file__).resolve().parents[2]
SHAPE = PRESETS["tiny-test"]
DENSE = BudgetSchedule.dense(16)
V = SHAPE.vocab_size


@pytest.fixture(scope="module")
def engine() -> TorchRolloutEngine:
    model = Qwen3Decoder.random(SHAPE, seed=0)
    model.params["lm_head.weight"].mul_(300.0)  # peaked next-token distributions (checked below)
    return TorchRolloutEngine(model, dense_layers=SHAPE.num_layers)


def _prompts(count: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, V, (8,), generator=gen).tolist() for _ in range(count)]


def _params(fraction: float, mix: float, **kw) -> SamplingParams:
    base = {"max_new_tokens": 48, "seed": 1, "stop_token_ids": (), "logprobs_topk": 20}
    return SamplingParams(**{**base, **kw}, inject_mismatch=MismatchInjection(fraction, mix))


def _injected(batch_size: int, length: int, fraction: float) -> torch.Tensor:
    """[B, L] bool: the positions the hash picks for sample seeds sample_seed(1, i)."""
    seeds = [sample_seed(1, i) for i in range(batch_size) for _ in range(length)]
    positions = [p for _ in range(batch_size) for p in range(length)]
    return (position_uniforms(seeds, positions, INJECT) < fraction).view(batch_size, length)


@torch.no_grad()
def test_off_is_the_plain_step_bit_for_bit(engine: TorchRolloutEngine) -> None:
    logits = torch.randn(5, V) * 3
    u = torch.rand(5, dtype=torch.float64)
    plain = sample_step(logits, _params(0, 0), u, 20, torch.ones(5, dtype=torch.int64), None)
    zero = sample_step(logits, _params(0, 0), u, 20, torch.ones(5, dtype=torch.int64), None, torch.zeros(5))
    for a, b in zip(vars(plain).values(), vars(zero).values()):
        assert torch.equal(a, b)  # rows with weight 0 are the plain rows exactly
    assert injection_mix(MismatchInjection(0.0, 0.5), [1], [0], torch.device("cpu")) is None
    prompts = _prompts(4)
    a = engine.generate(prompts, _params(0.0, 0.9), DENSE)  # fraction 0: off
    b = engine.generate(prompts, SamplingParams(max_new_tokens=48, seed=1, stop_token_ids=()), DENSE)
    for x, y in zip(a.samples, b.samples):
        assert torch.equal(x.response_ids, y.response_ids) and torch.equal(x.logprobs, y.logprobs)
        assert torch.equal(x.top_logprobs, y.top_logprobs)


@torch.no_grad()
def test_injected_positions_record_the_mixture_and_lose_alpha_by_d_tv(engine: TorchRolloutEngine) -> None:
    fraction, d = 0.3, 0.5
    prompts = _prompts(8)
    batch = engine.generate(prompts, _params(fraction, d, logprobs_topk=V), DENSE)  # K = V: exact alpha
    plain = engine.generate(prompts, _params(0, 0, logprobs_topk=V), DENSE)
    hit = _injected(len(prompts), 48, fraction)
    scored = engine.score([s.prompt_ids.tolist() + s.response_ids.tolist() for s in batch.samples], topk=V)
    mm = measure_mismatch(engine, batch)
    alpha = mm.alpha.view(len(prompts), 48)
    tvs = []
    for i, (s, dense) in enumerate(zip(batch.samples, scored)):
        span = slice(s.prompt_ids.numel() - 1, s.prompt_ids.numel() - 1 + 48)
        p = torch.zeros(48, V, dtype=torch.float64).scatter_(
            1, dense.top_ids[span], dense.top_logprobs[span].double().exp()
        )
        tv = (p - 1.0 / V).clamp(min=0).sum(-1)
        tvs.append(tv)
        q = torch.where(hit[i, :, None], (1 - d) * p + d / V, p)
        want = q.gather(1, s.response_ids[:, None]).squeeze(1).log()
        assert torch.allclose(s.logprobs.double(), want, atol=1e-4)  # the true sampling logprob
        assert torch.allclose(alpha[i].double(), torch.where(hit[i], 1 - d * tv, 1.0), atol=1e-4)
        first = int(hit[i].nonzero()[0]) if hit[i].any() else 48
        assert torch.equal(s.response_ids[:first], plain.samples[i].response_ids[:first])
    assert float(torch.cat(tvs).mean()) > 0.97  # the constructed model is peaked
    assert 0.2 < float(hit.double().mean()) < 0.4


def _injected_arms() -> dict[str, MismatchInjection]:
    spec = load_arms(REPO / "experiments" / "tolerant_arms.yaml")
    out = {}
    for arm in spec.arms:
        values = dict(o.split("=", 1) for o in arm.overrides if o.startswith("rollout.inject_mismatch."))
        if values:
            key = "rollout.inject_mismatch."
            out[arm.name] = MismatchInjection(float(values[key + "fraction"]), float(values[key + "mix"]))
    return out


#: arm -> (p5 range, p1 upper bound): mean alpha 0.98 in every one
TARGETS = {
    "inject_p5_090": ((0.87, 0.93), 0.93),
    "inject_p5_100": ((0.99, 1.0), 0.40),
    "inject_p5_080": ((0.77, 0.83), 0.83),
}


@torch.no_grad()
def test_the_matched_mean_arms_hit_their_mean_p5_and_p1(engine: TorchRolloutEngine) -> None:
    arms = _injected_arms()
    assert sorted(arms) == sorted(TARGETS)
    prompts = _prompts(32)
    for name, inject in arms.items():
        batch = engine.generate(prompts, _params(inject.fraction, inject.mix), DENSE)
        alpha = measure_mismatch(engine, batch).alpha.double()
        assert alpha.numel() == 32 * 48
        (lo, hi), p1_max = TARGETS[name]
        assert 0.972 <= float(alpha.mean()) <= 0.988, name
        assert lo <= float(torch.quantile(alpha, 0.05)) <= hi, name
        assert float(torch.quantile(alpha, 0.01)) <= p1_max, name


def test_injection_with_speculation_or_filtered_sampling_is_refused(engine: TorchRolloutEngine) -> None:
    with pytest.raises(ValueError, match="inject_mismatch is on: speculative"):
        engine.generate(
            _prompts(1), _params(0.1, 0.2), DENSE, speculative=SpeculativeConfig(draft_tokens=(2,))
        )
    for extra, why in (
        (["rollout.mode=speculative"], "rollout.mode=speculative"),
        (["rollout.top_p=0.9"], "temperature=1, top_k=0 and top_p=1"),
    ):
        with pytest.raises(ConfigError, match=why):
            load_config(
                "tiny_cpu",
                ["rollout.inject_mismatch.fraction=0.1", "rollout.inject_mismatch.mix=0.2", *extra],
            )


def test_only_the_rl_rollouts_inject() -> None:
    """Held-out evaluations (the primary outcome), calibration and the probe sample plainly."""
    from sparrow_nemo.grpo.setup import sampling_params

    config = load_config(
        "tiny_cpu", ["rollout.inject_mismatch.fraction=0.1", "rollout.inject_mismatch.mix=0.2"]
    )
    assert not sampling_params(config).inject_mismatch.on
    assert sampling_params(config, 3, rollouts=True).inject_mismatch == MismatchInjection(0.1, 0.2)


@torch.no_grad()
def test_the_padded_graph_buffers_inject_as_the_eager_step(engine: TorchRolloutEngine) -> None:
    """The CUDA-graph path (static buffers, rows padded to a bucket; here run eagerly, capture=False) carries the
    per-row mixture weights: the same tokens and logprobs as the eager engine, with a sparse schedule."""
    from sparrow_nemo.rollout.torch.cuda_graphs import DecodeGraphs

    padded = TorchRolloutEngine(engine.model, dense_layers=1)
    max_pages = -(-(SHAPE.max_position_embeddings + 1) // padded.page_size)
    padded.runner.graphs = DecodeGraphs(padded._step_fn, padded.device, 16, max_pages, capture=False)
    eager = TorchRolloutEngine(engine.model, dense_layers=1)
    schedule = BudgetSchedule(bin_tokens=32, budgets=(48, 64), name="tiny-sparse")
    prompts = [p * 6 for p in _prompts(3)]  # 48-token prompts: past the budgets
    params = _params(0.3, 0.5, max_new_tokens=24)
    a, b = eager.generate(prompts, params, schedule), padded.generate(prompts, params, schedule)
    for x, y in zip(a.samples, b.samples):
        assert torch.equal(x.response_ids, y.response_ids)
        assert (x.logprobs - y.logprobs).abs().max() < 1e-5
        assert (x.top_logprobs - y.top_logprobs).abs().max() < 1e-5
