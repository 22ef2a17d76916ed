"""``trainer.cpu_threads`` sets torch's intra-op threads for a CPU run; 0 keeps torch's default."""

from __future__ import annotations

import pytest
import torch

from sparrow_nemo.grpo.recipe import load_config
from sparrow_nemo.grpo.setup import apply_cpu_threads


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("restore_threads")
def test_cpu_threads_applies_on_cpu_and_zero_keeps_the_default() -> None:
    torch.set_num_threads(2)
    apply_cpu_threads(load_config("tiny_cpu", ["trainer.device=cpu", "trainer.cpu_threads=0"]))
    assert torch.get_num_threads() == 2
    apply_cpu_threads(load_config("tiny_cpu", ["trainer.device=cpu"]))
    assert torch.get_num_threads() == 1
