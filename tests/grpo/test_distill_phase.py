"""The DistillSparse phase on a tiny random Qwen3 (fp32, CPU, one process; two ranks: ``tests/test_distill_e2e.py``).

The phase gets a megatron policy, a torch rollout engine, the ``tiny_cpu_distill`` recipe's ``distill`` section, a
probe (random prompts) and rollouts of those prompts as its data (KL only). Checked: the adapter steps fit their
batch (k3 falls) and the engine rolls out with the updated adapter, per-bin p5 and KL before/after are
returned, the policy's own weights never move, the trainer hands the phase the recipe's sparse pattern
(``sparsity.page_score`` included), the loss gradient is k3 + sparse PG with the advantages, bad
settings are refused, and the adapter and its optimizer state survive a checkpoint (a different number of
ranks is refused).

Not checked here: that the probe p5 rises. On this random model it does not (the adapter fits its
batch but the held-out KL grows: the sparse/dense mismatch of random weights is not systematic);
the effect on a warm-started model is measured in ``tests/test_distill_e2e.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from policy._helpers import make_hf_checkpoint, single_rank_env

from sparrow_nemo.checkpoint.atomic import finalize, partial_dir
from sparrow_nemo.checkpoint.run_state import read_run_state, write_run_state
from sparrow_nemo.config import ConfigError
from sparrow_nemo.grpo.distill import DistillConfig, DistillData, DistillSparse, Probe, distill_loss_fn, k3
from sparrow_nemo.grpo.recipe import load_config
from sparrow_nemo.model_shapes import PRESETS
from sparrow_nemo.policy.batch import PolicyBatch
from sparrow_nemo.policy.logprobs import LogprobOutput
from sparrow_nemo.policy.optim import OptimizerSettings
from sparrow_nemo.policy.parallel import ParallelLayout
from sparrow_nemo.policy.policy import MegatronPolicy
from sparrow_nemo.rollout.engine import SamplingParams
from sparrow_nemo.rollout.sampling import sample_seed
from sparrow_nemo.rollout.torch.engine import TorchRolloutEngine
from sparrow_nemo.sparse.mismatch import tail_by_bin
from sparrow_nemo.sparse.pattern import SparsePattern
from sparrow_nemo.sparse.schedule import BudgetSchedule

SHAPE = PRESETS["tiny-test"]
PAGE = 4
#: 12 tokens = the 3 reserved pages of 4 tokens, no top-k page: far below the dense sequence
AGGRESSIVE = BudgetSchedule(bin_tokens=16, budgets=(12,), page_size=PAGE, name="aggressive")


class _Run:
    """A policy, an engine and a probe from one checkpoint, with the ``tiny_cpu_distill`` recipe's settings."""

    def __init__(self, ckpt: Path, overrides: list[str], num_prompts: int = 8) -> None:
        self.config = load_config("tiny_cpu_distill", overrides)
        self.policy = MegatronPolicy(
            SHAPE, ParallelLayout(), OptimizerSettings(lr=1e-3), "float32", hf_dir=ckpt
        )
        self.engine = TorchRolloutEngine.from_hf_dir(
            ckpt, dense_layers=1, page_size=PAGE, attention_backend="torch"
        )
        g = torch.Generator().manual_seed(4)
        prompts = [
            torch.randint(0, SHAPE.vocab_size, (n,), generator=g).tolist()
            for n in (6, 9) * (num_prompts // 2)
        ]
        sampling = SamplingParams(max_new_tokens=28, temperature=1.0, stop_token_ids=())
        self.probe = Probe(prompts, sampling, seed=0, quantile=0.05)

    def phase(self, **changes) -> DistillSparse:
        from dataclasses import replace

        c = self.config
        pattern = SparsePattern(PAGE, c.sparsity.sink_pages, c.sparsity.local_pages, dense_layers=1)
        return DistillSparse(replace(c.distill, **changes), 2e-3, pattern, c.policy.micro_batch_size)

    def data(self) -> DistillData:
        """The probe's own rollouts (its seeds, the current adapter), KL only."""
        seeds = [sample_seed(self.probe.seed, i) for i in range(len(self.probe.prompts))]
        batch = self.engine.generate(self.probe.prompts, self.probe.sampling, AGGRESSIVE, sample_seeds=seeds)
        return DistillData.from_samples(batch.samples, None)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_hf_checkpoint(SHAPE, tmp_path_factory.mktemp("distill") / "hf")


def test_distill_steps_train_the_adapter_the_engine_uses(checkpoint):
    overrides = [
        "policy.optimizer.lr=2e-3",
        "distill.steps=4",
        "distill.pg_coef=0",
        "policy.micro_batch_size=4",
    ]
    with single_rank_env():
        run = _Run(checkpoint, overrides)
        try:
            weights = run.policy.export_hf()
            phase = run.phase(probe_every=2)
            phase.start(run.policy, run.engine)
            assert max(b.abs().max().item() for _, b in run.engine.model.lora.weights.values()) == 0
            logged = [phase.run(run.policy, run.engine, run.data(), AGGRESSIVE, run.probe) for _ in range(3)]
            again = run.probe.measure(run.engine, AGGRESSIVE)
            after = run.policy.export_hf()
            adapter = run.policy.lora.export_adapter()
            engine_adapter = run.engine.model.lora
        finally:
            run.policy.close()
    history = phase.history
    for (
        entry
    ) in history:  # the adapter fits its batch: k3 falls over the adapter steps (by 18 % or more here)
        assert entry["loss"] < 0.9 * entry["loss_first"], entry
    for entry in history[0], history[2]:  # probe_every=2: steps 0 and 2 probe, step 1 does not
        assert entry["p5_before"] and entry["p5_after"] and entry["kl_before"] > 0
    assert "p5_before" not in history[1] and not any(k.startswith("distill/kl_") for k in logged[1])
    tail = tail_by_bin(again.alpha, again.cached_len, AGGRESSIVE.bin_tokens, run.probe.quantile)
    assert {str(b): v for b, v in tail.items()} == history[2]["p5_after"]  # same probe, same adapter
    for name, (a, b) in adapter.weights.items():
        assert torch.equal(engine_adapter.weights[name][0], a) and torch.equal(
            engine_adapter.weights[name][1], b
        )
    assert all(torch.equal(weights[n], w) for n, w in after.items()), "the policy must stay frozen"
    logged = logged[-1]  # a probed step
    assert {
        "distill/kl_before",
        "distill/kl_after",
        "distill/p5_before/bin_0",
        "distill/p5_after/bin_0",
    } <= set(logged)


def test_loss_gradients_are_k3_and_sparse_pg():
    g = torch.Generator().manual_seed(0)
    lp = (-torch.rand(2, 5, generator=g) * 3).requires_grad_(True)
    dense, rollout = -torch.rand(2, 5, generator=g) * 3, -torch.rand(2, 5, generator=g) * 3
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]], dtype=torch.bool)
    adv = torch.tensor([0.7, -1.2])
    batch = PolicyBatch(
        torch.zeros(2, 6, dtype=torch.int64),
        torch.tensor([6, 6]),
        {"mask": mask, "dense_logprobs": dense, "rollout_logprobs": rollout, "advantages": adv},
    )
    out = LogprobOutput(lp, torch.zeros(2, 5), torch.zeros(2, 5, 1, dtype=torch.int64), torch.zeros(2, 5, 1))
    loss, metrics = distill_loss_fn(kl_coef=0.5, pg_coef=2.0)(out, batch)
    loss.backward()
    n, m = mask.sum(), mask.float()
    r = torch.exp(dense - lp.detach())
    want = (0.5 * (1 - r) - 2.0 * adv[:, None] * torch.exp(lp.detach() - rollout)) * m / n
    torch.testing.assert_close(lp.grad, want, atol=1e-6, rtol=0)
    assert metrics["kl"] == pytest.approx(float((k3(lp.detach(), dense) * m).sum() / n), abs=1e-6)
    assert bool((k3(lp.detach(), dense) >= 0).all())
    no_adv = PolicyBatch(
        batch.tokens, batch.lengths, {k: v for k, v in batch.extras.items() if k != "advantages"}
    )
    assert set(distill_loss_fn(0.5, 2.0)(out, no_adv)[1]) == {"kl"}


def test_settings_refuse_bad_values():
    with pytest.raises(ConfigError, match=r"distill\.kl_coef"):
        load_config("tiny_cpu_distill", ["distill.kl_coef=0", "distill.pg_coef=0"])
    with pytest.raises(ConfigError, match=r"distill\.steps"):
        load_config("tiny_cpu_distill", ["distill.steps=0"])
    with pytest.raises(ValueError, match="pg_coef > 0"):  # the class itself, outside a recipe
        DistillConfig(kl_coef=0.0, pg_coef=0.0)


@pytest.mark.parametrize("page_score", ["centroid", "minmax"])
def test_the_trainer_gives_the_phase_the_recipes_whole_sparse_pattern(page_score):
    """DistillSparse trains under the selection the engine uses: sparsity.page_score reaches its pattern."""
    from types import SimpleNamespace

    from sparrow_nemo.grpo.trainer import GrpoTrainer

    config = load_config("tiny_cpu_distill", [f"sparsity.page_score={page_score}"])
    phase = GrpoTrainer._distill(SimpleNamespace(config=config))  # the trainer's own wiring, on its config
    assert phase.pattern == config.sparsity.pattern() and phase.pattern.page_score == page_score


def test_adapter_and_optimizer_survive_a_checkpoint(checkpoint, tmp_path):
    overrides = ["distill.steps=1", "distill.pg_coef=0", "policy.micro_batch_size=4", "distill.lora_rank=4"]
    with single_rank_env():
        run = _Run(checkpoint, overrides, num_prompts=4)
        try:
            callback = run.phase(lora_rank=4)
            callback.start(run.policy, run.engine)
            callback.run(run.policy, run.engine, run.data(), AGGRESSIVE, run.probe)
            staging = partial_dir(tmp_path / "ckpt", "step_1")  # through the trainer's checkpoint files
            write_run_state(staging, {}, {"DistillSparse": callback.state_dict(run.policy)})
            _, states = read_run_state(finalize(tmp_path / "ckpt", "step_1", {"step": 1}))
            state = states["DistillSparse"]
            saved = run.policy.lora.export_adapter()
            saved_opt = callback.optimizer.state_dict()
        finally:
            run.policy.close()
    with single_rank_env():
        run = _Run(checkpoint, overrides, num_prompts=4)
        try:
            with pytest.raises(ValueError, match="optimizer states of 2 ranks, this run has 1"):
                run.phase(lora_rank=4).load_state_dict({**state, "optimizer": state["optimizer"] * 2})
            resumed = run.phase(lora_rank=4)
            resumed.load_state_dict(state)
            resumed.start(run.policy, run.engine)
            loaded = run.policy.lora.export_adapter()
            engine_adapter = run.engine.model.lora
            loaded_opt = resumed.optimizer.state_dict()
        finally:
            run.policy.close()
    assert resumed.step == 1 and resumed.history == callback.history
    assert set(loaded.weights) == set(saved.weights)
    for name, (a, b) in saved.weights.items():
        assert torch.equal(loaded.weights[name][0], a) and torch.equal(loaded.weights[name][1], b)
        assert torch.equal(engine_adapter.weights[name][1], b), (
            "the engine rolls out with the resumed adapter"
        )
    assert max(b.abs().max().item() for _, b in saved.weights.values()) > 0, "B moved off its zero init"
    for key, moments in saved_opt["state"].items():
        torch.testing.assert_close(loaded_opt["state"][key]["exp_avg"], moments["exp_avg"], atol=0, rtol=0)
