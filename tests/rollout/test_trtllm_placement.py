"""Where a rank builds its colocated TensorRT-LLM engine: a private Ray instance that sees only its GPU."""

from __future__ import annotations

import os

import pytest

from sparrow_nemo.rollout.trtllm.placement import engine_env, patched_env, physical_gpu


def test_physical_gpu_of_the_rank() -> None:
    assert physical_gpu(3, None) == physical_gpu(3, "") == "3"  # everything visible: index = id
    assert physical_gpu(1, "4,5,6,7") == "5"  # a Slurm step that shows the node's second half
    assert physical_gpu(0, "GPU-aaaa, GPU-bbbb") == "GPU-aaaa"  # UUID entries pass through
    with pytest.raises(ValueError, match="CUDA device 2 is not visible: CUDA_VISIBLE_DEVICES='0,1'"):
        physical_gpu(2, "0,1")


def test_engine_env_and_its_restoration(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    monkeypatch.delenv("TLLM_RAY_FORCE_LOCAL_CLUSTER", raising=False)
    env = engine_env(6, os.environ["CUDA_VISIBLE_DEVICES"])
    assert env == {"CUDA_VISIBLE_DEVICES": "6", "TLLM_RAY_FORCE_LOCAL_CLUSTER": "1"}
    with patched_env(env):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "6" and os.environ["TLLM_RAY_FORCE_LOCAL_CLUSTER"] == "1"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
    assert "TLLM_RAY_FORCE_LOCAL_CLUSTER" not in os.environ
    with pytest.raises(RuntimeError, match="boom"), patched_env(env):
        raise RuntimeError("boom")  # restored on errors too
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
