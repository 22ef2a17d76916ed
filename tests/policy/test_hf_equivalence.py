"""The imported megatron model computes what transformers' Qwen3ForCausalLM computes (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch

from policy._helpers import make_hf_checkpoint
from sparrow_nemo.model_shapes import PRESETS
from sparrow_nemo.policy.batch import PolicyBatch
from sparrow_nemo.policy.hf_import import load_hf_into_model
from sparrow_nemo.policy.logprobs import output_weight
from sparrow_nemo.policy.model import build_model
from sparrow_nemo.policy.parallel import ParallelLayout

TOL = 1e-4  # max abs logit difference, fp32


@pytest.mark.parametrize("tied", [False, True])
def test_logits_match_transformers_with_padding(tmp_path, single_rank, tied):
    from transformers import Qwen3ForCausalLM

    shape = PRESETS["tiny-test"].replace(tie_word_embeddings=tied)
    ckpt = make_hf_checkpoint(shape, tmp_path / "hf", shard_size="20KB" if tied else None)
    single_rank(ParallelLayout(), shape)
    model, spec = build_model(shape, ParallelLayout())
    load_hf_into_model(model, spec, ckpt)
    model.eval()
    hf = Qwen3ForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()

    g = torch.Generator().manual_seed(3)
    lengths = torch.tensor([11, 4, 7])
    tokens = torch.randint(0, shape.vocab_size, (3, 11), generator=g)
    tokens[torch.arange(11).unsqueeze(0) >= lengths.unsqueeze(1)] = 0  # right padding
    batch = PolicyBatch(tokens, lengths)
    with torch.no_grad():
        hidden = model(*batch.model_inputs())  # [S, B, H]: the output layer runs fused with the logprobs
        logits = (hidden.transpose(0, 1) @ output_weight(model).T)[..., : shape.vocab_size]
        for row, n in enumerate(lengths.tolist()):  # each sequence alone, unpadded
            ref = hf(tokens[row : row + 1, :n]).logits[0]
            diff = (logits[row, :n] - ref).abs().max().item()
            assert diff < TOL, f"row {row}: max abs diff {diff}"
        padded_ref = hf(tokens, attention_mask=(torch.arange(11) < lengths.unsqueeze(1)).long()).logits
        valid = torch.arange(11).unsqueeze(0) < lengths.unsqueeze(1)
        assert (logits - padded_ref).abs()[valid].max().item() < TOL
