"""megatron-core's GPU-only training branch runs in CI: ``DistributedDataParallel``, ``DistributedOptimizer``
and ``get_forward_backward_func`` (no pipelining and 1F1B), on CPU/gloo through the test-only shim
:mod:`megatron_gpu_branch.cuda_on_cpu`, against the project's CPU path (one process).

At TP2 x DP2 (4 processes) and PP2 (2 processes), the GRPO update phase (``update_policy``, 1-row
micro-batches, clipping and weight decay on): dense logprobs through megatron's forward-only schedule,
the logged loss and metrics, the grad norm and every weight after each of two steps match the CPU path
(fp32, different reduction orders: ``atol=1e-5``; grad norm ``rel=1e-5``). Checkpoints written before the
first update and after it resume to the same second step (``atol=1e-6``).

Each of these failed before its fix: the norms were weight-decayed (megatron's ``wd_mult=0`` groups were
never applied), the logged loss was divided by the micro-batches per rank, saving before the first update
raised (``exp_avg`` / Adam step count), and loading the fp32 parameter state raised under autograd.
"""

from __future__ import annotations

import pytest
import torch
from policy._helpers import make_hf_checkpoint, run_distributed, single_rank_env
from policy._update_scenarios import SHAPE

from megatron_gpu_branch._scenarios import suite, train_two_steps

ATOL = 1e-5
LAYOUTS = {"tp2xdp2": (2, 1, 4), "pp2": (1, 2, 2)}  # tp, pp, processes

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory) -> tuple[str, dict]:
    """The HF checkpoint both branches start from, and the CPU path's run (one process, in this one)."""
    root = tmp_path_factory.mktemp("gpu_branch_cpu")
    ckpt = str(make_hf_checkpoint(SHAPE, root / "hf"))
    with single_rank_env():
        train_two_steps(0, 1, 1, False, ckpt, str(root / "ckpt"), str(root / "cpu.pt"))
        torch.distributed.destroy_process_group()
    return ckpt, torch.load(root / "cpu.pt", weights_only=False)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def runs(request, cpu_run, tmp_path_factory) -> dict:
    """The megatron branch's runs at one layout (``run``, ``resume0``, ``resume1``) and the CPU path's (``cpu``)."""
    tp, pp, world = LAYOUTS[request.param]
    root = tmp_path_factory.mktemp(f"gpu_branch_{request.param}")
    # 4 processes of 3 jobs each: ~4 minutes at load 30 on 2 cores
    run_distributed(suite, world, tp, pp, cpu_run[0], str(root), timeout=1200)
    out = {f: torch.load(root / f"{f}.pt", weights_only=False) for f in ("run", "resume0", "resume1")}
    return {**out, "cpu": cpu_run[1]}


def _same_weights(got: dict, ref: dict, atol: float) -> None:
    assert set(got) == set(ref)
    for name, w in ref.items():
        torch.testing.assert_close(got[name], w, atol=atol, rtol=0, msg=name)


def _same_metrics(got: dict, ref: dict) -> None:
    assert set(got) == set(ref)
    for key, value in ref.items():
        assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_megatron_branch_is_what_was_built(runs):
    built = runs["run"]["built"]
    assert built[0] == "DistributedDataParallel" and "DistributedOptimizer" in built[1:], built
    assert runs["cpu"]["built"] == ["HiddenStateGPTModel"]  # the bare model: no DDP, no megatron optimizer


def test_one_step_matches_the_cpu_path(runs):
    got, ref = runs["run"], runs["cpu"]
    for g, r in zip(got["logprobs"], ref["logprobs"], strict=True):
        torch.testing.assert_close(g, r, atol=ATOL, rtol=0)
    assert ref["first"]["train/grad_norm"] > 0.5, "clipping must act (grad_clip=0.5)"
    _same_metrics(got["first"], ref["first"])  # logged loss, grad norm, clip fraction, ratios, entropy, kl
    _same_weights(got["weights1"], ref["weights1"], ATOL)  # norms included: no weight decay on them


def test_second_step_matches_the_cpu_path(runs):
    # the optimizer moments of step 1 are the same as the CPU path's
    got, ref = runs["run"], runs["cpu"]
    _same_metrics(got["second"], ref["second"])
    _same_weights(got["weights2"], ref["weights2"], ATOL)


@pytest.mark.parametrize("step", [0, 1])
def test_checkpoint_resumes_to_the_same_step(runs, step):
    # step 0 was saved before any update (no moments yet); step 1 holds the distributed optimizer's
    # fp32 parameter state, loaded into the model's own parameters
    run, resumed = runs["run"], runs[f"resume{step}"]
    assert resumed["step"] == step
    if step == 0:
        _same_metrics(resumed["first"], run["first"])
    _same_metrics(resumed["second"], run["second"])
    _same_weights(resumed["weights2"], run["weights2"], 1e-6)
