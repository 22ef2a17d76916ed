"""``policy.offload_during_rollout``: the gradients and optimizer state leave the policy's device between the
update and the next one, and training is bit-identical with or without the offload / restore cycle.

Measured on CPU by what the optimizer and gradients own on the device (:func:`sparrow_nemo.policy.offload.
device_bytes`: their storages, each once; the offloaded copies live apart): the CPU path (AdamW, ``param.grad``)
in one process, megatron's GPU branch (DDP grad buffers, distributed optimizer) in fp32 in one process and in
bf16 (fp32 master weights apart from the weights) over two data-parallel gloo ranks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from policy._helpers import make_hf_checkpoint, run_distributed, single_rank_env
from policy._offload_scenarios import cycle
from policy._update_scenarios import SHAPE

#: branch, dtype, ranks
CASES = {
    "cpu_path": (False, "float32", 1),
    "megatron_fp32": (True, "float32", 1),
    "megatron_bf16_dp2": (True, "bfloat16", 2),
}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    return str(make_hf_checkpoint(SHAPE, tmp_path_factory.mktemp("offload") / "hf"))


def _same_checkpoint(got: Path, ref: Path, scratch: Path) -> None:
    """The same tensors (model, optimizer, RNG) bit for bit: each rank's RNG file and the sharded state whole,
    except megatron's distributed-optimizer bucket buffers (``dp_reshardable``: the padding between parameters
    is uninitialised memory; the updates after the save show their contents came back)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    names = sorted(f.name for f in ref.glob("rng_*.pt"))
    assert names and names == sorted(f.name for f in got.glob("rng_*.pt"))
    pairs = [
        (torch.load(got / n, weights_only=True)["rng"], torch.load(ref / n, weights_only=True)["rng"])
        for n in names
    ]
    for i, folder in enumerate((got, ref)):
        dcp_to_torch_save(folder / "policy", scratch / f"whole{i}.pt")
    pairs.append(tuple(torch.load(scratch / f"whole{i}.pt", weights_only=True) for i in (0, 1)))
    for a, b in pairs:
        assert a.keys() == b.keys() and a
        assert any(k.startswith("optimizer.") for k in a) or "torch" in a  # the optimizer state is there
        for key, value in b.items():
            if ".bucket_idx_" in key:  # megatron's DP-sharded bucket buffers: their padding is never written
                continue
            same = torch.equal(a[key], value) if isinstance(value, torch.Tensor) else a[key] == value
            assert same, key


def _run(tmp_path, hf_dir: str, megatron: bool, dtype: str, world: int, offload: bool) -> dict:
    out = tmp_path / f"offload_{offload}.pt"
    if world == 1:
        with single_rank_env():
            cycle(0, megatron, dtype, offload, hf_dir, str(out))
            torch.distributed.destroy_process_group()
    else:
        run_distributed(cycle, world, megatron, dtype, offload, hf_dir, str(out), timeout=900)
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize(
    "case",
    [
        "cpu_path",
        pytest.param("megatron_fp32", marks=pytest.mark.slow),
        pytest.param("megatron_bf16_dp2", marks=[pytest.mark.slow, pytest.mark.multiproc]),
    ],
)
def test_offload_frees_the_training_state_and_changes_no_bit(case, hf_dir, tmp_path):
    megatron, dtype, world = CASES[case]
    plain = _run(tmp_path, hf_dir, megatron, dtype, world, offload=False)
    cycled = _run(tmp_path, hf_dir, megatron, dtype, world, offload=True)
    trained, offloaded = cycled["bytes"]["trained"], cycled["bytes"]["offloaded"]
    params = sum(p.numel() for p in cycled["weights"].values())  # the whole model (HF export)
    # the device held the gradients and Adam's state; offloaded, it holds the weights only
    assert trained["gradients"] > 0 and trained["optimizer"] >= 8 * params // world // 2
    if dtype == "bfloat16":  # + the fp32 master weights, sharded over the data-parallel ranks
        assert trained["optimizer"] >= 12 * params // world * 0.9
    assert offloaded == {"weights": trained["weights"], "gradients": 0, "optimizer": 0}
    assert cycled["released"] == trained["gradients"] + trained["optimizer"] and cycled["again"] == 0
    assert cycled["bytes"]["restored"] == trained
    # the rollout's logprobs ran on the offloaded policy, and the next two updates did not notice the cycle
    for got, ref in zip(cycled["logprobs"], plain["logprobs"], strict=True):
        assert torch.equal(got, ref)
    assert cycled["metrics"] == plain["metrics"]
    _same_checkpoint(Path(cycled["checkpoint"]), Path(plain["checkpoint"]), tmp_path)
    assert set(cycled["weights"]) == set(plain["weights"])
    for name, weight in plain["weights"].items():
        assert torch.equal(cycled["weights"][name], weight), name
