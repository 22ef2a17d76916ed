"""Sharded checkpoints (megatron ``dist_checkpointing``) of megatron's distributed optimizer in bf16 (fp32 master
weights and Adam moments sharded over 2 data-parallel gloo ranks): each rank writes its own shard file holding
its half of the optimizer state, nothing is gathered; a resume at the same layout continues bit-identically, and
one at a different data-parallel size (1 rank) reads the whole state and continues as the 2-rank run does."""

from __future__ import annotations

import pickle

import pytest
import torch

from policy._helpers import make_hf_checkpoint, run_distributed, single_rank_env
from policy._sharded_scenarios import resume_and_continue, save_and_continue
from policy._update_scenarios import SHAPE

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]
DTYPE = "bfloat16"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple:
    root = tmp_path_factory.mktemp("sharded")
    hf_dir = str(make_hf_checkpoint(SHAPE, root / "hf"))
    run_distributed(
        save_and_continue, 2, DTYPE, hf_dir, str(root / "ckpt"), str(root / "run.pt"), timeout=900
    )
    return root / "ckpt" / "step_00000001", torch.load(root / "run.pt", weights_only=False), root


def _bytes_by_file(checkpoint) -> dict[str, dict[str, int]]:
    """Bytes of the model's and the optimizer's tensors in each shard file (from torch DCP's metadata)."""
    with open(checkpoint / "policy" / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # the test's own checkpoint
    by_file: dict[str, dict[str, int]] = {}
    for index, info in metadata.storage_data.items():
        kind = "optimizer" if index.fqn.startswith("optimizer.") else "model"
        counts = by_file.setdefault(info.relative_path, {"model": 0, "optimizer": 0})
        counts[kind] += info.length
    return by_file


def test_each_rank_writes_its_own_optimizer_shard(saved) -> None:
    checkpoint, _, _ = saved
    by_file = _bytes_by_file(checkpoint)
    assert sorted(by_file) == ["__0_0.distcp", "__1_0.distcp"]
    shares = [by_file[f]["optimizer"] for f in sorted(by_file)]
    # fp32 master weights + two moments of ~half the parameters each: neither rank wrote the other's half
    params = sum(p.numel() for p in saved[1]["saved"].values())
    assert all(0.35 * 12 * params < share < 0.65 * 12 * params for share in shares), (shares, params)
    assert by_file["__1_0.distcp"]["model"] == 0  # the bf16 weights: DP rank 0 is their main replica


def test_same_layout_resumes_bit_identically(saved) -> None:
    checkpoint, run, root = saved
    run_distributed(resume_and_continue, 2, DTYPE, str(checkpoint), str(root / "dp2.pt"), timeout=900)
    resumed = torch.load(root / "dp2.pt", weights_only=False)
    assert resumed["step"] == 1
    for name, weight in run["saved"].items():
        assert torch.equal(resumed["loaded"][name], weight), name
    for name, weight in run["after"].items():
        assert torch.equal(resumed["after"][name], weight), name


def test_another_data_parallel_size_resumes(saved) -> None:
    checkpoint, run, root = saved
    with single_rank_env():
        resume_and_continue(0, DTYPE, str(checkpoint), str(root / "dp1.pt"))
        torch.distributed.destroy_process_group()
    resumed = torch.load(root / "dp1.pt", weights_only=False)
    for name, weight in run["saved"].items():
        assert torch.equal(resumed["loaded"][name], weight), name
    # the next update from the resharded moments and master weights, over the same rows on one rank: the 2-rank
    # run's weights up to one bf16 rounding of each element (the gradient sums run in another order), while the
    # update moved most elements by more (fresh moments instead of the loaded ones would change them all)
    changed = total = 0
    for name, weight in run["after"].items():
        got, want, before = resumed["after"][name].float(), weight.float(), run["saved"][name].float()
        ulp = want.abs().clamp_min(1e-30) * torch.finfo(torch.bfloat16).eps
        assert bool(((got - want).abs() <= ulp).all()), name
        changed += int((want != before).sum())
        total += want.numel()
    assert changed > total // 2
