"""Fixtures for the rollout tests: tiny random Qwen3 models saved as HF checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest

from ._helpers import SHAPE, save_hf_qwen3


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_qwen3(SHAPE, tmp_path_factory.mktemp("qwen3_untied"))


@pytest.fixture(scope="session")
def hf_dir_tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_qwen3(
        SHAPE.replace(tie_word_embeddings=True), tmp_path_factory.mktemp("qwen3_tied"), seed=1
    )
