"""The refit of tensor-parallel engines over the policy's TP group hands each rank its own megatron shard.

On 2 gloo ranks, a tiny MegatronPolicy at TP2 (vocabulary 96 padded to megatron's 256: rank 1's slice is all
padding), and on 4 at TP2 x PP2 (each stage broadcasts its ranks' slices to the same TP rank of the other
stage), fills two TP2 engines built empty (``awaiting_weights``): one by the local refit (each rank's shards
as HF-named slices, no all-gather), one by the full pieces each engine slices. Checked on every rank:

- the two engines hold the same weights (every tensor equal; the vocabulary tensors on their real rows);
- the local refit sends each rank only its shard: the tensors it yields have the engine's local shapes and
  together hold half the non-replicated elements of the full model;
- the local-refit engine's greedy tokens equal a one-rank engine's over the gathered full weights.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from policy._helpers import make_hf_checkpoint, run_distributed
from sparrow_nemo.model_shapes import PRESETS
from sparrow_nemo.policy.optim import OptimizerSettings
from sparrow_nemo.policy.parallel import ParallelLayout
from sparrow_nemo.policy.policy import MegatronPolicy
from sparrow_nemo.policy.refit import holds_megatron_shard, pieces
from sparrow_nemo.rollout.engine import SamplingParams
from sparrow_nemo.rollout.torch.engine import TorchRolloutEngine
from sparrow_nemo.rollout.torch.qwen3 import Qwen3Decoder
from sparrow_nemo.rollout.torch.tensor_parallel import REPLICATED, TensorParallel, weight_layout
from sparrow_nemo.sparse.schedule import BudgetSchedule

pytestmark = pytest.mark.multiproc

SHAPE = PRESETS["tiny-test"]
#: seconds for the 2 processes (start, megatron imports, the refits) on 2 loaded cores
TIMEOUT = 300


def _rank(rank: int, pp: int, ckpt: str, out_dir: str) -> None:
    from megatron.core import parallel_state as ps

    layout = ParallelLayout.for_world(int(os.environ["WORLD_SIZE"]), tp=2, pp=pp)
    policy = MegatronPolicy(SHAPE, layout, OptimizerSettings(lr=1e-3), "float32", hf_dir=ckpt)
    try:
        tp = TensorParallel.over(
            ps.get_tensor_model_parallel_group(), SHAPE.vocab_size, policy.spec.padded_vocab
        )
        engines = {
            how: TorchRolloutEngine.awaiting_weights(
                Qwen3Decoder.empty(SHAPE, tensor_parallel=tp), dense_layers=1, attention_backend="torch"
            )
            for how in ("local", "full")
        }
        assert holds_megatron_shard(policy, engines["local"])
        sent = policy.refit(engines["local"])
        for piece in pieces(policy):  # the full pieces, each sliced by the engine
            engines["full"].update_weights(piece)
        shapes = {n: tuple(t.shape) for piece in pieces(policy, local=True) for n, t in piece.items()}
        one = TorchRolloutEngine(  # TP1 over the gathered weights, in this process (no collective inside)
            _tp1_decoder({n: t for piece in pieces(policy) for n, t in piece.items()}),
            dense_layers=1,
            attention_backend="torch",
        )
        prompts = [[5, 17, 33, 2, 60, 61], [7] * 20]
        greedy = SamplingParams(max_new_tokens=24, temperature=0.0)
        sparse = BudgetSchedule(bin_tokens=16, budgets=(16, 32), name="t")
        torch.save(
            {
                "sent": sent,
                "shapes": shapes,
                "local": engines["local"].model.params,
                "full": engines["full"].model.params,
                "tokens": [
                    s.response_ids.tolist()
                    for s in engines["local"].generate(prompts, greedy, sparse).samples
                ],
                "tp1_tokens": [
                    s.response_ids.tolist() for s in one.generate(prompts, greedy, sparse).samples
                ],
                "vocab_start": tp.rank * tp.vocab_rows,
            },
            Path(out_dir) / f"rank{rank}.pt",
        )
    finally:
        policy.close()


def _tp1_decoder(weights):
    return Qwen3Decoder(SHAPE, {n: t.clone() for n, t in weights.items()})


@pytest.mark.parametrize("pp", [1, 2])
def test_local_refit_equals_gather_then_slice(pp: int, tmp_path: Path) -> None:
    ckpt = make_hf_checkpoint(SHAPE, tmp_path / "hf")
    run_distributed(_rank, 2 * pp, pp, str(ckpt), str(tmp_path), timeout=TIMEOUT)
    full_elements = sum(
        t.numel()
        for n, t in TorchRolloutEngine.from_shape(SHAPE).model.params.items()
        if weight_layout(n) != REPLICATED
    )
    for rank in range(2 * pp):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        local, full = got["local"], got["full"]
        assert got["sent"] == len(local) == len(full)
        real = max(0, SHAPE.vocab_size - got["vocab_start"])  # this rank's rows that are real tokens
        for name, tensor in local.items():
            assert got["shapes"][name] == tuple(tensor.shape), name  # the local refit sends the local shard
            if weight_layout(name) == "vocab":
                assert torch.equal(tensor[:real], full[name][:real]), name
            else:
                assert torch.equal(tensor, full[name]), name
        sent = sum(t.numel() for n, t in local.items() if weight_layout(n) not in (REPLICATED, "vocab"))
        vocab = sum(t.numel() for n, t in local.items() if weight_layout(n) == "vocab")
        assert 2 * sent + SHAPE.vocab_size * SHAPE.hidden_size * 2 == full_elements
        assert vocab == 2 * 128 * SHAPE.hidden_size  # megatron's 256 padded rows over 2 ranks, embed and head
        assert got["tokens"] == got["tp1_tokens"]
