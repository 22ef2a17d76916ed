"""Helpers for the rollout tests: the tiny shape and a saved random transformers Qwen3."""

from __future__ import annotations

from pathlib import Path

import torch

from sparrow_nemo.hf_qwen3 import hf_config_dict
from sparrow_nemo.model_shapes import PRESETS, Qwen3Shape

#: tiny-test with 3 layers, so the default 2 dense layers leave one sparse layer.
SHAPE: Qwen3Shape = PRESETS["tiny-test"].replace(num_layers=3)


def save_hf_qwen3(shape: Qwen3Shape, path: Path, seed: int = 0) -> Path:
    """A randomly initialised transformers Qwen3ForCausalLM of ``shape`` saved under ``path`` (fp32)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    # initializer_range 0.1: peakier next-token distributions than the default 0.02
    config = Qwen3Config(**hf_config_dict(shape), initializer_range=0.1)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).float().eval()
    with torch.no_grad():  # HF initialises norms to 1: perturb them so a mixed-up norm would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return path
