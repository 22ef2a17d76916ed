"""A model checkpoint that does not fit the recipe: one clear error naming the tensor (or field) and both
shapes, from the policy import and the rollout engine alike, and no run folder written by the trainer.

(Shape errors of in-memory state dicts and of single decoder loads are covered in tests/policy and
tests/rollout; these go through the files and the user-facing entry points.)
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from policy._helpers import make_hf_checkpoint, single_rank_env
from safetensors.torch import load_file, save_file

from sparrow_nemo.grpo.recipe import load_config
from sparrow_nemo.grpo.trainer import GrpoTrainer
from sparrow_nemo.hf_qwen3 import CheckpointFormatError
from sparrow_nemo.model_shapes import PRESETS
from sparrow_nemo.policy.optim import OptimizerSettings
from sparrow_nemo.policy.parallel import ParallelLayout, destroy_parallel
from sparrow_nemo.policy.policy import MegatronPolicy
from sparrow_nemo.rollout.torch.engine import TorchRolloutEngine

from ._helpers import save_char_tokenizer

SHAPE = PRESETS["tiny-test"]
TENSOR = "model.layers.1.self_attn.k_proj.weight"


@pytest.fixture(scope="module")
def good_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_checkpoint(SHAPE, tmp_path_factory.mktemp("good"))


def copy_with(src: Path, dst: Path, state_edit=None, config_edit=None) -> Path:
    """``src`` checkpoint copied to ``dst`` with its tensors and/or config.json edited."""
    dst.mkdir(parents=True, exist_ok=True)
    state = load_file(str(src / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    save_file(state_edit(state) if state_edit else state, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(config_edit(config) if config_edit else config))
    return dst


def wrong_k_proj(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {**state, TENSOR: torch.zeros(8, state[TENSOR].shape[1])}


def load_policy(hf_dir: Path) -> None:
    with single_rank_env():
        try:
            MegatronPolicy(SHAPE, ParallelLayout(), OptimizerSettings(), "float32", hf_dir=hf_dir)
        finally:
            destroy_parallel()


def test_wrong_tensor_shape_names_the_folder_tensor_and_both_shapes(good_ckpt: Path, tmp_path: Path) -> None:
    bad = copy_with(good_ckpt, tmp_path / "bad", state_edit=wrong_k_proj)
    expected = tuple(load_file(str(good_ckpt / "model.safetensors"))[TENSOR].shape)
    message = f"{bad}: tensor '{TENSOR}' has shape (8, {expected[1]}), expected {expected}"
    with pytest.raises(CheckpointFormatError, match=re.escape(message)):
        load_policy(bad)
    with pytest.raises(ValueError, match=re.escape(message)):
        TorchRolloutEngine.from_hf_dir(bad)


def test_config_of_another_model_names_the_differing_fields(good_ckpt: Path, tmp_path: Path) -> None:
    other = copy_with(
        good_ckpt,
        tmp_path / "other",
        config_edit=lambda c: {**c, "intermediate_size": 2 * c["intermediate_size"]},
    )
    size = SHAPE.intermediate_size
    with pytest.raises(
        CheckpointFormatError,
        match=re.escape(
            f"{other}/config.json differs from the model shape: {{'intermediate_size': ({2 * size}, {size})}}"
        ),
    ):
        load_policy(other)


def test_truncated_or_unparsable_files_name_the_file(good_ckpt: Path, tmp_path: Path) -> None:
    cut = copy_with(good_ckpt, tmp_path / "cut")
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(
        CheckpointFormatError, match=rf"^{weights}: (not a readable safetensors file|cannot read)"
    ):
        TorchRolloutEngine.from_hf_dir(cut)
    broken = copy_with(good_ckpt, tmp_path / "broken")
    (broken / "config.json").write_text('{"model_type": "qwen3",')
    with pytest.raises(CheckpointFormatError, match=rf"^{broken / 'config.json'}: invalid JSON"):
        TorchRolloutEngine.from_hf_dir(broken)


def test_trainer_refuses_a_mismatched_checkpoint_before_writing_anything(tmp_path: Path) -> None:
    ckpt = make_hf_checkpoint(PRESETS["tiny"], tmp_path / "ckpt")
    save_char_tokenizer(ckpt)
    copy_with(ckpt, ckpt, state_edit=wrong_k_proj)
    data = tmp_path / "math.jsonl"
    data.write_text(json.dumps({"problem": "1 + 1", "answer": "2"}) + "\n")
    config = load_config(
        "tiny_cpu",
        [
            "reward.type=math",
            "control.calibrate=false",
            f"data.train_path={data}",
            f"model.hf_checkpoint={ckpt}",
        ],
    )
    run_dir = tmp_path / "run"
    with single_rank_env():
        try:
            with pytest.raises(CheckpointFormatError, match=rf"tensor '{re.escape(TENSOR)}' has shape \(8, "):
                GrpoTrainer(config, run_dir)
        finally:
            destroy_parallel()
    assert not run_dir.exists()
