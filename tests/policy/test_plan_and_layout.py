"""Parallel layout validation and the ``sparrow plan`` report."""

from __future__ import annotations

import pytest

from sparrow_nemo.model_shapes import PRESETS
from sparrow_nemo.policy.engine_memory import RolloutSpec
from sparrow_nemo.policy.memory import MemorySettings
from sparrow_nemo.policy.model import padded_vocab_size
from sparrow_nemo.policy.parallel import LayoutError, ParallelLayout, stage_layer_range
from sparrow_nemo.policy.plan import (
    GIB,
    DistillSpec,
    estimate_memory,
    format_plan,
    head_bytes,
    layer_activations,
    plan,
    stage_parameters,
)


@pytest.mark.parametrize(
    ("world", "tp", "pp", "shape", "message"),
    [
        (8, 3, 1, "qwen3-8b", r"tp\*pp = 3\*1 = 3 does not divide the world size 8"),
        (16, 1, 16, "qwen3-14b", r"pp=16 does not divide num_layers=40"),
        (16, 16, 1, "qwen3-1.7b", r"tp=16 does not divide num_key_value_heads=8"),
        (4, 4, 1, "tiny-test", r"tp=4 does not divide num_key_value_heads=2"),
        (12, 3, 1, "qwen3-4b", r"tp=3 does not divide num_attention_heads=32"),
    ],
)
def test_impossible_layouts_are_refused_with_the_reason(world, tp, pp, shape, message):
    with pytest.raises(LayoutError, match=message):
        ParallelLayout.for_world(world, tp=tp, pp=pp).validate(PRESETS[shape], world_size=world)


def test_layout_world_mismatch_and_bad_values():
    with pytest.raises(LayoutError, match="does not match the world size 4"):
        ParallelLayout(tp=2, pp=1, dp=1).validate(PRESETS["tiny-test"], world_size=4)
    with pytest.raises(LayoutError, match="tp must be a positive integer"):
        ParallelLayout.for_world(4, tp=0)
    assert ParallelLayout.for_world(32, tp=4, pp=2) == ParallelLayout(4, 2, 4)
    assert list(stage_layer_range(28, 4, 3)) == list(range(21, 28))


@pytest.mark.parametrize("name", ["qwen3-0.6b", "qwen3-8b", "tiny-test"])
@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 2)])
def test_stage_parameters_add_up_to_the_model(name, tp, pp):
    """Sum over stages and TP ranks = the model + vocab padding + TP-replicated norms (+ tied copy)."""
    shape = PRESETS[name]
    layout = ParallelLayout(tp, pp, 1)
    total = sum(stage_parameters(shape, layout, s) for s in range(pp)) * tp
    h, d = shape.hidden_size, shape.head_dim
    pad = (padded_vocab_size(shape.vocab_size, tp) - shape.vocab_size) * h
    heads = 1 if shape.tie_word_embeddings else 2
    replicated_extra = (tp - 1) * (shape.num_layers * (2 * h + 2 * d) + h)
    tied_copy = shape.vocab_size * h + pad if shape.tie_word_embeddings and pp > 1 else 0
    assert total == shape.num_parameters() + heads * pad + replicated_extra + tied_copy


def test_plan_memory_terms_by_hand():
    shape = PRESETS["qwen3-8b"]
    r = plan(
        shape,
        4,
        8,
        tp=2,
        pp=2,
        micro_batch=1,
        seq_len=4096,
        dtype="bf16",
        optimizer="distributed_adam",
        gpu_memory_gb=141,
    )
    params = stage_parameters(shape, r.layout, 0)
    assert r.layout == ParallelLayout(2, 2, 8)
    assert r.memory.weights == 2 * params and r.memory.gradients == 4 * params
    assert r.memory.optimizer == -(-12 * params // 8)
    # per token and layer: 6h + ((Hq + 2Hkv) D + 4 Hq D + 2 Hkv D + 5 I) / tp in bf16, fp32 tables and stats
    h, d, hq, hkv, i = 4096, 128, 32 // 2, 8 // 2, 12288 // 2
    per_layer = (6 * h + (hq + 2 * hkv) * d + 4 * hq * d + 2 * hkv * d + 5 * i) * 2 + 4 * (
        4 * d + 2 + 2 * hq + hkv
    )
    assert layer_activations(shape, 2, 2, False).full == per_layer
    stage0 = per_layer * 4096 * 18 * 2  # 18 layers, 2 micro-batches in flight on stage 0 (1F1B)
    stage1 = per_layer * 4096 * 18 + 2 * h * 2 * 4096  # + the final norm
    assert r.memory.activations in (stage0, stage1) and r.memory.recompute == 0
    local_v = padded_vocab_size(151_936, 2) // 2
    head = head_bytes(shape, r.layout, 4096, 2, 4096)
    assert head > 1.25 * 4096 * local_v * 4  # one fp32 chunk of logits and a quarter of it, at least
    text = format_plan(r)
    assert "TP=2 PP=2 DP=8" in text and f"{r.memory.total / GIB:8.2f} GiB of 141 GiB" in text
    for line in ("weights", "gradients", "optimizer", "activations", "recompute", "logits"):
        assert f"  {line}" in text
    rank_lines = [ln for ln in text.splitlines() if ln.startswith("  ") and ln.split()[0].isdigit()]
    assert len(rank_lines) == 32
    # rank 31: node 3, gpu 7, tp 1, pp 1, dp 7, the second half of the layers
    assert rank_lines[-1].split() == ["31", "3", "7", "1", "1", "7", "18-35"]


def test_recompute_sequence_parallel_and_chunk_change_the_plan_as_built():
    shape, tokens = PRESETS["qwen3-1.7b"], 32768
    layout = ParallelLayout(2, 1, 4)

    def est(**kwargs):
        return estimate_memory(
            shape, layout, tokens, tokens, "bf16", "distributed_adam", 0, MemorySettings(**kwargs)
        )

    none, full, selective = est(), est(recompute_granularity="full"), est(recompute_granularity="selective")
    per = layer_activations(shape, 2, 2, False)
    assert (
        full.activations == (28 * per.layer_input + 2 * 2048 * 2) * tokens
        and full.recompute == per.full * tokens
    )
    assert selective.activations == (28 * (per.full - per.mlp) + 2 * 2048 * 2) * tokens
    assert full.total < selective.total < none.total
    sp = est(recompute_granularity="full", sequence_parallel=True)
    assert sp.activations < full.activations and sp.recompute < full.recompute
    block = est(recompute_granularity="full", recompute_method="block", recompute_num_layers=4)
    assert block.activations == (4 * per.layer_input + 24 * per.full + 2 * 2048 * 2) * tokens
    assert est(logprob_chunk_tokens=1024).logits < est(logprob_chunk_tokens=8192).logits
    # the same object configures megatron
    kwargs = MemorySettings(recompute_granularity="full", sequence_parallel=True).transformer_config_kwargs()
    assert kwargs == {
        "sequence_parallel": True,
        "recompute_granularity": "full",
        "recompute_method": "uniform",
        "recompute_num_layers": 1,
    }
    assert MemorySettings(recompute_granularity="selective").transformer_config_kwargs()[
        "recompute_modules"
    ] == ["mlp"]
    with pytest.raises(LayoutError, match="recompute_num_layers=3 does not divide the 28 layers"):
        MemorySettings(recompute_granularity="full", recompute_num_layers=3).validate(28, layout)


def test_distill_and_rollout_terms():
    shape = PRESETS["qwen3-1.7b"]
    distill = DistillSpec(
        rank=8,
        targets=("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"),
        sparse_layers_from=2,
        page_size=16,
    )
    common = dict(nodes=1, gpus_per_node=8, tp=2, pp=1, micro_batch=1, seq_len=39_936)
    memory = MemorySettings(recompute_granularity="full")
    trtllm = RolloutSpec("trtllm", 256, "bf16", 16, dense_layers=2)
    r = plan(shape, memory=memory, distill=distill, rollout=trtllm, **common)
    assert r.distill is not None and r.distill.lora > 0 and r.distill.sparse_attention > 0
    assert r.distill.total > r.memory.total and r.peak is r.distill
    # layers x KV heads x head_dim x bf16 K and V, + one fp32 centroid per page in the 26 sparse layers
    kv_token = 28 * 8 * 128 * 2 * 2 + 26 * 8 * 128 * 4 / 16
    assert r.rollout.kv_per_sequence == int(kv_token * 39_936)
    assert r.rollout.engine_weights == shape.num_parameters() * 2  # engine TP 1: the whole model per GPU
    assert r.rollout.sequences == r.rollout.kv_pool // r.rollout.kv_per_sequence > 0
    text = format_plan(r)
    assert "distill" in text and "KV cache" in text and "sequences of 39936 tokens" in text
    # the torch engine sleeps while the policy trains: during rollout its pool is kv_cache_fraction of what the
    # policy's weights, gradient buffers and optimizer shard and the engine's weights leave
    torch_engine = plan(shape, memory=memory, rollout=RolloutSpec("torch", 256, "bf16", 16), **common).rollout
    resident = r.memory.weights + r.memory.gradients + r.memory.optimizer
    free = 80 * GIB - resident - torch_engine.engine_weights
    assert (
        torch_engine.kv_pool == int(0.9 * free)
        and torch_engine.sequences == torch_engine.kv_pool // torch_engine.kv_per_sequence > 0
    )
    assert torch_engine.pool_tokens == int(torch_engine.kv_pool / torch_engine.kv_per_token)
    # policy.offload_during_rollout: the gradients are freed and the optimizer shard waits on the host, so the
    # pool takes its share of what the weights alone leave; the node's host holds gpus_per_node shards
    offloaded = plan(
        shape,
        memory=memory,
        rollout=RolloutSpec("torch", 256, "bf16", 16),
        offload_during_rollout=True,
        **common,
    )
    assert offloaded.memory == r.memory  # training is unchanged
    assert offloaded.rollout_policy == r.memory.weights and offloaded.host_offload == r.memory.optimizer
    assert offloaded.rollout.kv_pool == int(0.9 * (80 * GIB - r.memory.weights - torch_engine.engine_weights))
    assert offloaded.rollout.sequences > torch_engine.sequences
    assert "host memory per node during rollout: 8 x" in format_plan(offloaded)
    assert plan(shape, memory=memory, rollout=trtllm, **common).host_offload == 0
    fixed = plan(
        shape, memory=memory, rollout=RolloutSpec("torch", 4, "bf16", 16, max_cache_tokens=100_000), **common
    )
    assert fixed.rollout.pool_tokens == 100_000 and fixed.rollout.sequences == 2
    # an engine over 2 GPUs holds half the weights and half of every token's KV heads on each
    two = plan(
        shape, memory=memory, rollout=RolloutSpec("torch", 4, "bf16", 16, tensor_parallel=2), **common
    ).rollout
    assert (
        two.engine_weights == torch_engine.engine_weights // 2
        and two.kv_per_token == torch_engine.kv_per_token / 2
    )
    assert two.pool_tokens > 2 * torch_engine.pool_tokens
    with pytest.raises(LayoutError, match="no room for one 39936-token sequence"):
        plan(
            shape,
            memory=memory,
            rollout=RolloutSpec("torch", 4, "bf16", 16, max_cache_tokens=30_000),
            **common,
        )
    assert plan(shape, memory=memory, **common).distill is None
    with pytest.raises(LayoutError, match="below the longest sequence"):
        plan(shape, memory=MemorySettings(max_tokens_per_micro_batch=4096), **common)
    packed = plan(
        shape, memory=MemorySettings(recompute_granularity="full", max_tokens_per_micro_batch=65536), **common
    )
    assert packed.tokens_per_micro_batch == 65536


def test_minmax_counts_two_landmarks_per_page():
    """sparsity.page_score=minmax keeps a page's key minimum and maximum where centroid keeps its mean: the
    rollout KV cache and DistillSparse's kept activations count two [Hkv, D] landmarks per page."""
    shape = PRESETS["qwen3-1.7b"]
    common = dict(nodes=1, gpus_per_node=8, tp=2, pp=1, micro_batch=1, seq_len=39_936, gpu_memory_gb=1000)
    kv = 28 * 8 * 128 * 2 * 2  # bf16 K and V of every layer, per token
    reports = {}
    for score in ("centroid", "minmax"):
        distill = DistillSpec(8, ("linear_qkv",), sparse_layers_from=2, page_size=16, page_score=score)
        trtllm = RolloutSpec("trtllm", 256, "bf16", 16, dense_layers=2, page_score=score)
        torch_engine = RolloutSpec("torch", 256, "bf16", 16, page_score=score)
        reports[score] = (
            plan(shape, distill=distill, rollout=trtllm, **common),
            plan(shape, rollout=torch_engine, **common).rollout,
        )
    for score, landmarks in (("centroid", 1), ("minmax", 2)):
        trt, torch_engine = reports[score][0].rollout, reports[score][1]
        # TensorRT-LLM: fp32 landmarks in the 26 sparse layers; torch engine: bf16 landmarks in all 28
        assert trt.kv_per_sequence == int((kv + landmarks * 26 * 8 * 128 * 4 / 16) * 39_936), score
        assert torch_engine.kv_per_sequence == int((kv + landmarks * 28 * 8 * 128 * 2 / 16) * 39_936), score
    # no recompute: each of the 26 sparse layers keeps one more fp32 [Hkv/tp, D] landmark per 16 tokens
    extra = reports["minmax"][0].distill.activations - reports["centroid"][0].distill.activations
    assert extra == 26 * 4 * 128 * 4 // 16 * 39_936
    assert reports["minmax"][0].memory == reports["centroid"][0].memory  # the training phase is unchanged
    with pytest.raises(ValueError, match="page_score must be one of"):
        plan(shape, rollout=RolloutSpec("torch", 4, "bf16", 16, page_score="mean"), **common)


def test_plan_refuses_what_does_not_fit_or_divide():
    with pytest.raises(LayoutError, match=r"needs .* GiB .* > 80 GiB per GPU"):
        plan(PRESETS["qwen3-14b"], 4, 8, tp=1, pp=1, micro_batch=1, seq_len=32768, gpu_memory_gb=80)
    with pytest.raises(LayoutError, match="does not divide num_layers=36"):
        plan(PRESETS["qwen3-8b"], 4, 8, tp=4, pp=8, micro_batch=1, seq_len=4096)
    with pytest.raises(LayoutError, match="max_position_embeddings"):
        plan(PRESETS["qwen3-8b"], 4, 8, tp=8, pp=1, micro_batch=1, seq_len=50_000)
    with pytest.raises(LayoutError, match="optimizer must be one of"):
        plan(PRESETS["qwen3-8b"], 4, 8, tp=8, pp=1, micro_batch=1, seq_len=4096, optimizer="lion")
    fits = plan(
        PRESETS["qwen3-14b"],
        4,
        8,
        tp=4,
        pp=2,
        micro_batch=1,
        seq_len=32768,
        gpu_memory_gb=141,
        memory=MemorySettings(recompute_granularity="full"),
    )
    assert fits.memory.total < 141 * GIB
    cross = plan(PRESETS["qwen3-8b"], 2, 4, tp=8, pp=1, micro_batch=1, seq_len=4096, gpu_memory_gb=141)
    assert any("spans nodes" in n for n in cross.notes)


def test_start_refuses_a_layout_the_world_cannot_hold(single_rank):
    with pytest.raises(LayoutError, match=r"tp\*pp\*dp = 2\*1\*1 = 2 does not match the world size 1"):
        single_rank(ParallelLayout(tp=2), PRESETS["tiny-test"])
