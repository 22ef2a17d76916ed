"""Weight mapping for the TensorRT-LLM engine: HF-named export checks, LoRA merge, IPC buckets, and what
each GPU's policy rank sends to its engine's workers (keyed by its own device UUID).

The merged-LoRA weights are checked against the torch rollout engine running the same adapter unmerged
(its logits with the adapter == its logits without an adapter on the merged weights).
"""

from __future__ import annotations

import re

import pytest
import torch

from sparrow_nemo.hf_qwen3 import LoraAdapter, expected_weight_shapes, linear_in_out
from sparrow_nemo.rollout.torch.qwen3 import Qwen3Decoder
from sparrow_nemo.rollout.trtllm.weights import (
    IpcHandles,
    buckets,
    check_handles,
    merge_handles,
    merge_lora,
    refit_messages,
    refit_tensors,
)

from ._helpers import SHAPE


def test_refit_tensors_checks_names_shapes_and_ties() -> None:
    dec = Qwen3Decoder.random(SHAPE, seed=0)
    named = dict(refit_tensors(dec.params, SHAPE, torch.bfloat16))
    assert set(named) == set(expected_weight_shapes(SHAPE))
    assert all(t.dtype == torch.bfloat16 and t.is_contiguous() for t in named.values())
    torch.testing.assert_close(
        named["model.norm.weight"].float(), dec.params["model.norm.weight"], rtol=2**-8, atol=0
    )

    tied = SHAPE.replace(tie_word_embeddings=True)
    state = {"lm_head.weight": torch.zeros(SHAPE.vocab_size, SHAPE.hidden_size)}
    assert refit_tensors(state, tied, torch.float32) == []  # the loader ties lm_head to the embeddings

    with pytest.raises(
        KeyError, match=re.escape("'model.layers.0.self_attn.qkv_proj.weight' is not a Qwen3 parameter")
    ):
        refit_tensors({"model.layers.0.self_attn.qkv_proj.weight": torch.zeros(1)}, SHAPE, torch.float32)
    bad = dec.params["model.layers.0.mlp.up_proj.weight"].t()
    with pytest.raises(ValueError, match=re.escape("'model.layers.0.mlp.up_proj.weight' has shape")):
        refit_tensors({"model.layers.0.mlp.up_proj.weight": bad}, SHAPE, torch.float32)


def _adapter(rank: int = 2, seed: int = 0) -> LoraAdapter:
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, (fan_in, fan_out) in linear_in_out(SHAPE).items():
        if name.endswith(("q_proj", "down_proj")):
            weights[name] = (
                0.1 * torch.randn(rank, fan_in, generator=gen),
                0.1 * torch.randn(fan_out, rank, generator=gen),
            )
    return LoraAdapter.from_alpha(weights, alpha=16.0)


def test_merged_lora_equals_the_reference_adapter() -> None:
    dec = Qwen3Decoder.random(SHAPE, seed=3)
    adapter = _adapter()
    merged = merge_lora(dec.params, adapter, SHAPE)
    assert set(merged) == {f"{m}.weight" for m in adapter.weights}
    h = torch.randn(2, 5, SHAPE.hidden_size)
    for module in adapter.weights:
        if not module.endswith("q_proj"):
            continue
        dec.lora = adapter
        with_adapter = dec.linear(module, h)
        dec.lora = None
        expected = h @ merged[f"{module}.weight"].t()
        torch.testing.assert_close(with_adapter, expected, rtol=1e-5, atol=1e-5)  # fp32 reassociation


def test_merge_lora_errors() -> None:
    adapter = _adapter()
    with pytest.raises(KeyError, match=re.escape("no 'model.layers.0.self_attn.q_proj.weight'")):
        merge_lora({}, adapter, SHAPE)
    wrong = LoraAdapter({"model.layers.0.self_attn.q_proj": (torch.zeros(2, 3), torch.zeros(4, 2))}, 1.0)
    with pytest.raises(ValueError, match="expected A \\[r,"):
        merge_lora(Qwen3Decoder.random(SHAPE).params, wrong, SHAPE)


def test_buckets_bound_bytes_and_keep_order() -> None:
    named = [(f"t{i}", torch.zeros(n, dtype=torch.float32)) for i, n in enumerate([10, 10, 30, 5, 100, 1])]
    groups = buckets(named, max_bytes=80)  # 40, 40, 120, 20, 400, 4 bytes
    assert [[n for n, _ in g] for g in groups] == [["t0", "t1"], ["t2"], ["t3"], ["t4"], ["t5"]]
    assert [n for g in groups for n, _ in g] == [n for n, _ in named]
    with pytest.raises(ValueError, match="max_bytes must be > 0"):
        buckets(named, 0)


def test_buckets_keep_each_layer_whole() -> None:
    named = refit_tensors(Qwen3Decoder.random(SHAPE).params, SHAPE, torch.float32)
    layer_bytes = sum(t.numel() * 4 for n, t in named if n.startswith("model.layers.0."))
    groups = buckets(named, max_bytes=layer_bytes + 1)
    assert [n for g in groups for n, _ in g] == [n for n, _ in named]
    for i in range(SHAPE.num_layers):
        holding = [j for j, g in enumerate(groups) if any(n.startswith(f"model.layers.{i}.") for n, _ in g)]
        assert len(holding) == 1, (i, holding)
    assert all(sum(t.numel() * 4 for _, t in g) <= layer_bytes + 1 or len(g) == 1 for g in groups)


def _handle(t: torch.Tensor) -> tuple[str, int, tuple[int, ...]]:
    """Stands in for ``reduce_tensor`` (CUDA IPC cannot run here): which storage, which shape."""
    return ("ipc", t.data_ptr(), tuple(t.shape))


def _worker_loads(handles: IpcHandles | None, my_uuid: str) -> list[str]:
    """The lookup of ``tensorrt_llm/llmapi/rlhf_utils.py`` ``WorkerExtension.update_weights`` on one worker."""
    if handles is None:
        return []  # finalise
    if my_uuid not in handles:
        raise ValueError(f"Device UUID {my_uuid} not found in ipc_handles")
    return [name for name, _ in handles[my_uuid]]


def test_each_gpu_refits_its_own_engine_by_its_own_uuid() -> None:
    """A node of 4 colocated ranks, one engine (one worker) per GPU: each rank's messages are keyed by
    its GPU only, cover every tensor once, end with the finalise message, and serve exactly its worker."""
    named = refit_tensors(Qwen3Decoder.random(SHAPE).params, SHAPE, torch.float32)
    layer_bytes = sum(t.numel() * 4 for n, t in named if n.startswith("model.layers.0."))
    uuids = [f"GPU-{i}" for i in range(4)]
    for rank, uuid in enumerate(uuids):
        messages = list(refit_messages(named, uuid, torch.device("cpu"), layer_bytes, _handle))
        assert messages[-1] is None and all(m is not None for m in messages[:-1])
        assert len(messages) - 1 == len(buckets(named, layer_bytes)) > 1
        assert all(set(m) == {uuid} for m in messages[:-1])
        loaded = [n for m in messages for n in _worker_loads(check_handles(m, [uuid]) if m else m, uuid)]
        assert loaded == [n for n, _ in named]
        other = uuids[(rank + 1) % 4]
        with pytest.raises(ValueError, match=f"Device UUID {other} not found"):
            _worker_loads(messages[0], other)  # what TensorRT-LLM would do with a rank-0-only refit
        with pytest.raises(ValueError, match=rf"workers run on devices \['{other}'\].*not an engine device"):
            check_handles(messages[0], [other])  # caught before sending, naming both sides


def test_an_engine_over_two_gpus_gets_both_ranks_handles() -> None:
    named = refit_tensors(Qwen3Decoder.random(SHAPE).params, SHAPE, torch.float32)
    total = sum(t.numel() * 4 for _, t in named)
    per_rank = [list(refit_messages(named, uuid, torch.device("cpu"), total, _handle)) for uuid in ("A", "B")]
    merged = merge_handles([per_rank[0][0], per_rank[1][0]])
    check_handles(merged, ["A", "B"])
    assert _worker_loads(merged, "A") == _worker_loads(merged, "B") == [n for n, _ in named]
    with pytest.raises(ValueError, match=r"missing \['B'\]"):
        check_handles(per_rank[0][0], ["A", "B"])  # the driver's own handles only: worker B would raise
    with pytest.raises(ValueError, match="two ranks sent weights for device A"):
        merge_handles([per_rank[0][0], per_rank[0][0]])
    with pytest.raises(ValueError, match="device_uuid is empty"):
        next(refit_messages(named, "", torch.device("cpu"), total, _handle))
