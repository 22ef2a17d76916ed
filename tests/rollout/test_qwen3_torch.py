"""The plain-torch Qwen3 decoder against transformers' Qwen3ForCausalLM (fp32, max abs diff < 1e-4)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sparrow_nemo.hf_qwen3 import expected_weight_shapes
from sparrow_nemo.rollout import TorchRolloutEngine
from sparrow_nemo.rollout.torch.qwen3 import Qwen3Decoder

TOL = 1e-4


def hf_logprobs(path: Path, ids: list[int]) -> torch.Tensor:
    """[L-1, V] next-token log-probabilities of one sequence from transformers (run alone, no padding)."""
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("fixture", ["hf_dir", "hf_dir_tied"])
def test_score_matches_transformers_on_unequal_lengths(fixture: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(fixture)
    engine = TorchRolloutEngine.from_hf_dir(path)
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, engine.shape.vocab_size, (n,), generator=gen).tolist() for n in (37, 5, 20)]
    scored = engine.score(seqs, topk=20)
    chunked = TorchRolloutEngine(engine.model, prefill_chunk_tokens=16).score(seqs, topk=20)
    # a pool that holds one sequence at a time scores them one after another, with the same results
    small = TorchRolloutEngine(engine.model, max_cache_tokens=48).score(seqs, topk=20)
    for a, b in zip(scored, small):
        assert (a.logprobs - b.logprobs).abs().max() < 1e-5 and (
            a.top_logprobs - b.top_logprobs
        ).abs().max() < 1e-5
    for a, b in zip(scored, chunked):
        assert (a.logprobs - b.logprobs).abs().max() < 1e-5
    one = engine.score([[4]])[0]
    assert one.logprobs.shape == (0,) and one.top_ids.shape == (0, 20)
    for ids, got in zip(seqs, scored):
        ref = hf_logprobs(path, ids)
        target = torch.tensor(ids[1:])
        assert got.logprobs.shape == (len(ids) - 1,)
        assert (got.logprobs - ref.gather(-1, target[:, None])[:, 0]).abs().max() < TOL
        ref_top, ref_ids = torch.topk(ref, 20, dim=-1)
        assert (got.top_logprobs - ref_top).abs().max() < TOL
        # ids agree wherever the top-20 values are not (numerically) tied
        gap = (ref_top[:, :-1] - ref_top[:, 1:]).abs() > 1e-4
        assert torch.equal(got.top_ids[:, :-1][gap], ref_ids[:, :-1][gap])


def test_decoder_reads_config(hf_dir: Path) -> None:
    dec = Qwen3Decoder.from_hf_dir(hf_dir)
    cfg = json.loads((hf_dir / "config.json").read_text())
    assert dec.shape.num_layers == cfg["num_hidden_layers"]
    assert dec.shape.rope_theta == 10_000.0
    assert set(dec.params) == set(expected_weight_shapes(dec.shape))


def test_wrong_tensor_shape_names_tensor_and_both_shapes(hf_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text((hf_dir / "config.json").read_text())
    state = load_file(str(hf_dir / "model.safetensors"))
    state["model.layers.1.mlp.up_proj.weight"] = torch.zeros(7, 64)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*\(7, 64\).*\(128, 64\)"):
        Qwen3Decoder.from_hf_dir(tmp_path)


def test_missing_tensor_files_and_unsupported_config_are_clear(hf_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
        Qwen3Decoder.from_hf_dir(tmp_path)
    state = load_file(str(hf_dir / "model.safetensors"))
    del state["model.norm.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        Qwen3Decoder.from_hf_dir(tmp_path)
    config = json.loads((hf_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(KeyError, match=r"model\.norm\.weight"):
        Qwen3Decoder.from_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "use_sliding_window": True}))
    with pytest.raises(ValueError, match="sliding"):
        Qwen3Decoder.from_hf_dir(tmp_path)
