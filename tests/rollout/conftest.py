"""Fixtures for the rollout tests: tiny random Qwen3 models saved as HF checkpoints."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ._helpers import SHAPE, save_hf_qwen3


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_qwen3(SHAPE, tmp_path_factory.mktemp("qwen3_untied"))


@pytest.fixture(scope="session")
def hf_dir_tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_qwen3(
        SHAPE.replace(tie_word_embeddings=True), tmp_path_factory.mktemp("qwen3_tied"), seed=1
    )


@pytest.fixture(autouse=True)
def _single_thread() -> Iterator[None]:
    """The rollout tests run tiny matrices step by step: one intra-op thread is faster, and avoids
    OpenMP spin-waiting when the 2 cores are shared with other jobs. Restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
