"""A tensor-parallel torch engine (TP2 on 2 gloo processes) generates what the one-process engine generates.

Each rank builds its shard of the same seeded random weights (the tiny shape with 2 KV heads and a vocabulary
of 101, so rank 1's vocabulary slice holds a padding row) and runs the same calls; the test process runs them on
the TP1 engine. Per call, against TP1:

- greedy (dense and under a sparse schedule, and under a KV pool so small that sequences are preempted and
  recomputed): the same tokens;
- sampled at temperature 1 with a stop token (dense and sparse): the same tokens, logprobs within 1e-4;
- speculative greedy (sparse drafts, dense verify) at TP2: the tokens of TP1's dense greedy;
- with a LoRA adapter (DistillSparse; B split by rows for the column-parallel modules, A by columns for the
  row-parallel ones), and after ``sleep`` / ``wake`` / ``update_weights`` of other weights given whole: the same
  tokens; ``score``: logprobs within 1e-4;
- both ranks return the same samples (every rank samples from the gathered logits), and each holds half the
  KV heads (its pages are half the bytes).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from policy._helpers import run_distributed

from sparrow_nemo.hf_qwen3 import LoraAdapter, linear_in_out
from sparrow_nemo.model_shapes import PRESETS
from sparrow_nemo.rollout.engine import SamplingParams
from sparrow_nemo.rollout.torch.engine import TorchRolloutEngine
from sparrow_nemo.rollout.torch.qwen3 import Qwen3Decoder
from sparrow_nemo.rollout.torch.speculative import SpeculativeConfig
from sparrow_nemo.rollout.torch.tensor_parallel import TensorParallel
from sparrow_nemo.sparse.schedule import BudgetSchedule

pytestmark = pytest.mark.multiproc

SHAPE = PRESETS["tiny-test"].replace(num_layers=3, vocab_size=101)
SPARSE = BudgetSchedule(bin_tokens=32, budgets=(32, 32, 48), name="t")
DENSE = BudgetSchedule.dense(32)
CAP = 40
GREEDY = SamplingParams(max_new_tokens=CAP, temperature=0.0)
#: seconds for the 2 processes (start, imports, the calls) on 2 loaded cores
TIMEOUT = 240


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, SHAPE.vocab_size, (n,), generator=gen).tolist() for n in (9, 23, 23, 40)]


def _adapter() -> LoraAdapter:
    gen = torch.Generator().manual_seed(7)
    weights = {
        name: (0.05 * torch.randn(4, fan_in, generator=gen), 0.05 * torch.randn(fan_out, 4, generator=gen))
        for name, (fan_in, fan_out) in linear_in_out(SHAPE).items()
        if name.startswith("model.layers.2.")
    }
    return LoraAdapter(weights=weights, scaling=2.0)


def _engine(tensor_parallel: TensorParallel | None, **kw) -> TorchRolloutEngine:
    return TorchRolloutEngine.from_shape(
        SHAPE, seed=1, dense_layers=1, attention_backend="torch", tensor_parallel=tensor_parallel, **kw
    )


def _calls(engine: TorchRolloutEngine, tight: TorchRolloutEngine) -> dict[str, list]:
    """Every call of the comparison on ``engine`` (``tight``: the same weights in a 6-page KV pool)."""
    prompts = _prompts()
    stop = SamplingParams(max_new_tokens=CAP, temperature=1.0, seed=3, stop_token_ids=(5, 9))

    def run(batch) -> list[tuple[list[int], torch.Tensor]]:
        return [(s.response_ids.tolist(), s.logprobs) for s in batch.samples]

    out = {
        "greedy_dense": run(engine.generate(prompts, GREEDY, DENSE)),
        "greedy_sparse": run(engine.generate(prompts, GREEDY, SPARSE)),
        "sampled_dense": run(engine.generate(prompts, stop, DENSE)),
        "sampled_sparse": run(engine.generate(prompts, stop, SPARSE)),
        "speculative": run(engine.generate(prompts, GREEDY, SPARSE, speculative=SpeculativeConfig((3,)))),
    }
    batch = tight.generate(prompts * 2, GREEDY, SPARSE)
    out["preempted"], out["preemptions"] = run(batch), batch.preemptions
    out["score"] = [
        s.logprobs for s in engine.score([p + r for p, (r, _) in zip(prompts, out["greedy_dense"])])
    ]
    engine.set_lora(_adapter())
    out["lora"] = run(engine.generate(prompts, GREEDY, SPARSE))
    engine.set_lora(None)
    engine.sleep()
    engine.wake()
    engine.update_weights(Qwen3Decoder.random(SHAPE, seed=2).params)  # whole tensors: each rank slices
    out["refit"] = run(engine.generate(prompts, GREEDY, SPARSE))
    out["page_bytes"] = engine.page_bytes
    return out


def _tight(tensor_parallel: TensorParallel | None) -> TorchRolloutEngine:
    return _engine(tensor_parallel, max_cache_tokens=6 * 16)


def _rank(rank: int, out_dir: str) -> None:
    dist.init_process_group("gloo")
    try:
        tp = TensorParallel.over(None, SHAPE.vocab_size)
        engine = _engine(tp)
        torch.save(_calls(engine, _tight(tp)), Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _tokens(results: list) -> list[list[int]]:
    return [ids for ids, _ in results]


def test_tp2_engine_on_gloo_samples_like_tp1(tmp_path: Path) -> None:
    run_distributed(_rank, 2, str(tmp_path), timeout=TIMEOUT)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    tp1 = _calls(_engine(None), _tight(None))

    for key in (
        "greedy_dense",
        "greedy_sparse",
        "sampled_dense",
        "sampled_sparse",
        "lora",
        "refit",
        "preempted",
    ):
        assert _tokens(ranks[0][key]) == _tokens(ranks[1][key]), key  # one sample on every rank
        assert _tokens(ranks[0][key]) == _tokens(tp1[key]), key
        for (_, got), (_, want) in zip(ranks[0][key], tp1[key]):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert _tokens(ranks[0]["speculative"]) == _tokens(tp1["greedy_dense"])  # lossless at TP2
    assert ranks[0]["preemptions"] > 0 and ranks[0]["preemptions"] == tp1["preemptions"]
    for got, want in zip(ranks[0]["score"], tp1["score"]):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    # the calls are not degenerate: stop tokens end some samples, others run to the cap
    lengths = [len(ids) for ids, _ in tp1["sampled_sparse"]]
    assert min(lengths) < CAP and max(lengths) == CAP, lengths
    assert _tokens(tp1["lora"]) != _tokens(tp1["greedy_sparse"])
    assert _tokens(tp1["refit"]) != _tokens(tp1["greedy_sparse"])
    assert 2 * ranks[0]["page_bytes"] == tp1["page_bytes"]


def test_the_shard_of_each_weight_is_megatron_s() -> None:
    """Rows of q/k/v/gate/up, columns of o/down, padded vocabulary rows; a model the ranks cannot split is
    refused in one line."""
    tp = TensorParallel(group=None, rank=1, size=2, padded_vocab=102)
    full = Qwen3Decoder.random(SHAPE, seed=1).params
    q = full["model.layers.0.self_attn.q_proj.weight"]  # 4 q heads of 16 over 2 KV heads: rank 1 = heads 2, 3
    assert torch.equal(tp.shard("model.layers.0.self_attn.q_proj.weight", q), q[32:])
    down = full["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(tp.shard("model.layers.0.mlp.down_proj.weight", down), down[:, 64:])
    head = tp.shard("lm_head.weight", full["lm_head.weight"])
    assert head.shape == (51, 64) and torch.equal(head[:50], full["lm_head.weight"][51:])
    assert not head[50].any()
    norm = full["model.layers.0.input_layernorm.weight"]
    assert tp.shard("model.layers.0.input_layernorm.weight", norm) is norm
    with pytest.raises(ValueError, match="3 ranks must divide num_key_value_heads=2"):
        TensorParallel(group=None, rank=0, size=3, padded_vocab=102).check(SHAPE)


def test_an_engine_awaiting_its_weights_generates_after_a_refit() -> None:
    """The trainer's engine: storage only until update_weights fills every tensor; then it is the engine built
    over those weights. A tensor of neither the whole nor the local shape is refused naming both."""
    engine = TorchRolloutEngine.awaiting_weights(
        Qwen3Decoder.empty(SHAPE), dense_layers=1, attention_backend="torch"
    )
    with pytest.raises(RuntimeError, match="built awaiting a refit"):
        engine.generate(_prompts(), GREEDY, SPARSE)
    engine.update_weights(Qwen3Decoder.random(SHAPE, seed=1).params)
    got = engine.generate(_prompts(), GREEDY, SPARSE)
    want = _engine(None).generate(_prompts(), GREEDY, SPARSE)
    assert [s.response_ids.tolist() for s in got.samples] == [s.response_ids.tolist() for s in want.samples]
    tp = TensorParallel(group=None, rank=0, size=2, padded_vocab=102)
    sharded = Qwen3Decoder.empty(SHAPE, tensor_parallel=tp)
    with pytest.raises(
        ValueError,
        match=r"'lm_head.weight' has shape \(7, 64\), expected \(51, 64\) \(this rank's shard\) or \(101, 64\)",
    ):
        sharded.load_state({"lm_head.weight": torch.zeros(7, 64)})
