"""LoRA under model parallelism: TP=2 and PP=2 (two gloo processes each) give what one rank gives (fp32, CPU).

Checked on the sparse forward with the adapter: log-probs before training, one adapter step
(loss, pre-clip grad norm, every gradient and updated matrix exported in HF names), and that the
step leaves the policy's own weights and dense log-probs untouched.
"""

from __future__ import annotations

import os

import pytest
import torch

from policy._helpers import make_hf_checkpoint, run_distributed, single_rank_env
from policy.test_sparse_forward import PAGE, SCHEDULE, SHAPE, random_lora
from sparrow_nemo.policy.batch import PolicyBatch
from sparrow_nemo.policy.logprobs import LogprobOutput
from sparrow_nemo.policy.optim import OptimizerSettings
from sparrow_nemo.policy.parallel import ParallelLayout
from sparrow_nemo.policy.policy import MegatronPolicy
from sparrow_nemo.policy.sparse_forward import SparsePlan
from sparrow_nemo.sparse.pattern import SparsePattern

ATOL = 1e-5  # fp32, different reduction orders
PATTERN = SparsePattern(page_size=PAGE, sink_pages=1, local_pages=2, dense_layers=1)
CLIP = 0.05


def _inputs() -> tuple[PolicyBatch, SparsePlan]:
    g = torch.Generator().manual_seed(2)
    lengths = torch.tensor([30, 24])
    tokens = torch.randint(0, SHAPE.vocab_size, (2, 30), generator=g)
    tokens[torch.arange(30) >= lengths[:, None]] = 0
    prompt_lens = torch.tensor([5, 9])
    mask = (torch.arange(1, 30) < lengths[:, None]) & (torch.arange(29) >= prompt_lens[:, None] - 1)
    extras = {"mask": mask, "adv": torch.tensor([1.0, -0.5])}
    return PolicyBatch(tokens, lengths, extras), SparsePlan.from_schedule(SCHEDULE, prompt_lens, 30)


def _pg_loss(out: LogprobOutput, batch: PolicyBatch) -> tuple[torch.Tensor, dict[str, float]]:
    mask = batch.extras["mask"].float()
    loss = -(batch.extras["adv"][:, None] * out.logprobs * mask).sum() / mask.sum()
    return loss, {}


def lora_step(rank: int, tp: int, pp: int, ckpt: str, out_file: str) -> None:
    """Sparse logprobs with LoRA, one adapter step, exports; rank 0 saves them."""
    layout = ParallelLayout.for_world(int(os.environ["WORLD_SIZE"]), tp=tp, pp=pp)
    policy = MegatronPolicy(SHAPE, layout, OptimizerSettings(lr=1e-3), "float32", hf_dir=ckpt)
    config, adapter = random_lora(seed=5)
    policy.enable_lora(config, adapter)
    batch, plan = _inputs()
    before = policy.sparse_logprobs([batch], [plan], PATTERN)[0]
    dense_before = policy.logprobs([batch])[0]
    weights_before = policy.export_hf()
    optimizer = policy.lora_optimizer(OptimizerSettings(lr=1e-2, weight_decay=0.0, grad_clip=CLIP))
    result = policy.lora_train_step([batch], [plan], PATTERN, _pg_loss, optimizer)
    grads = policy.lora.export_adapter(grads=True)
    after = policy.lora.export_adapter()
    dense_after = policy.logprobs([batch])[0]
    weights_after = policy.export_hf()
    if rank == 0:
        torch.save(
            {
                "before": before,
                "loss": result.loss,
                "grad_norm": result.grad_norm,
                "grads": grads.weights,
                "after": after.weights,
                "dense_same": torch.equal(dense_before.logprobs, dense_after.logprobs),
                "weights_same": all(torch.equal(weights_before[n], w) for n, w in weights_after.items()),
            },
            out_file,
        )
    policy.close()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_tp")
    ckpt = str(make_hf_checkpoint(SHAPE, root / "hf"))
    with single_rank_env():
        lora_step(0, 1, 1, ckpt, str(root / "one.pt"))
    run_distributed(lora_step, 2, 2, 1, ckpt, str(root / "tp2.pt"))
    run_distributed(lora_step, 2, 1, 2, ckpt, str(root / "pp2.pt"))
    return {name: torch.load(root / f"{name}.pt", weights_only=False) for name in ("one", "tp2", "pp2")}


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_model_parallel_lora_matches_one_rank(runs, layout):
    ref, got = runs["one"], runs[layout]
    for key in ("logprobs", "entropy", "topk_logprobs"):
        torch.testing.assert_close(
            getattr(got["before"], key), getattr(ref["before"], key), atol=ATOL, rtol=0
        )
    assert got["loss"] == pytest.approx(ref["loss"], abs=ATOL)
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    assert ref["grad_norm"] > CLIP, "clipping must be exercised"
    for field in ("grads", "after"):
        assert set(got[field]) == set(ref[field])
        for name, (a, b) in ref[field].items():
            torch.testing.assert_close(got[field][name][0], a, atol=ATOL, rtol=0, msg=f"{field} {name} A")
            torch.testing.assert_close(got[field][name][1], b, atol=ATOL, rtol=0, msg=f"{field} {name} B")
    moved = max(
        (ref["after"][n][1] - b).abs().max().item() for n, (_, b) in random_lora(seed=5)[1].weights.items()
    )
    assert moved > 1e-3, "the adapter step must change B"
    assert min(g[0].abs().max().item() for g in ref["grads"].values()) > 0, "every A gets a gradient"


@pytest.mark.multiproc
def test_adapter_step_leaves_the_policy_alone(runs):
    for run in runs.values():
        assert run["dense_same"] and run["weights_same"]
