"""Two gloo processes (TP=2, TP=2 with full recompute and a 5-position logprob chunk, PP=2 with tied
embeddings, DP=2) match one process.

Checked: logprobs / entropy / top-k before and after one optimizer step, the step's loss and grad
norm, and every updated weight (exported to HF names). Also the vocab-parallel logprobs and their
gradients against a full-vocab ``torch.log_softmax``, and the fused chunked output layer + logprobs
on two vocab shards against the unchunked path on one (values and gradients of hidden states and
weight). All jobs share one 2-process spawn.
"""

from __future__ import annotations

import pytest
import torch

from policy._helpers import free_port, make_hf_checkpoint, run_distributed, single_rank_env
from policy._scenarios import train_once, two_rank_suite
from sparrow_nemo.model_shapes import PRESETS
from sparrow_nemo.policy.logprobs import vocab_parallel_logprobs
from sparrow_nemo.policy.memory import DEFAULT_MEMORY, MemorySettings
from sparrow_nemo.policy.plan import stage_parameters

ATOL = 1e-5  # fp32, different reduction orders
FULL_RECOMPUTE = MemorySettings(recompute_granularity="full", logprob_chunk_tokens=5)
LAYOUTS = {
    "tp2": (2, 1, False, DEFAULT_MEMORY),
    "tp2-recompute": (2, 1, False, FULL_RECOMPUTE),
    "pp2-tied": (1, 2, True, DEFAULT_MEMORY),
    "dp2": (1, 1, False, DEFAULT_MEMORY),
}
ROUNDTRIP = ("tp2", "pp2-tied")
LP_VOCAB, LP_PADDED = 40, 48  # real vocab, logits columns (8 padding columns on the last rank)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Reference (1 process, in this one) and 2-process results, keyed by layout id."""
    root = tmp_path_factory.mktemp("policy_par")
    ckpts, refs = {}, {}
    for tied in (False, True):
        ckpts[tied] = make_hf_checkpoint(
            PRESETS["tiny-test"].replace(tie_word_embeddings=tied), root / f"hf{tied}"
        )
        with single_rank_env():
            train_once(0, 1, 1, tied, str(ckpts[tied]), str(root / f"ref{tied}.pt"))
        refs[tied] = torch.load(root / f"ref{tied}.pt", weights_only=False)
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 6, LP_PADDED, generator=g) * 3
    targets = torch.randint(0, LP_VOCAB, (2, 6), generator=g)
    hidden, weight = torch.randn(11, 8, generator=g), torch.randn(LP_PADDED, 8, generator=g)
    head_targets = torch.randint(0, LP_VOCAB, (11,), generator=g)
    jobs = [
        ("logprobs_tp", free_port(), (logits, targets, LP_VOCAB, str(root))),
        ("chunked_head_tp", free_port(), (hidden, weight, head_targets, LP_VOCAB, str(root))),
    ]
    for name, (tp, pp, tied, memory) in LAYOUTS.items():
        out = str(root / f"{name}.pt")
        jobs.append(("train_once", free_port(), (tp, pp, tied, str(ckpts[tied]), out, memory)))
    for name in ROUNDTRIP:
        tp, pp, tied, _ = LAYOUTS[name]
        jobs.append(("roundtrip", free_port(), (tp, pp, tied, str(ckpts[tied]), str(root / f"rt_{name}.pt"))))
    run_distributed(two_rank_suite, 2, jobs)
    return {
        "root": root,
        "ckpts": ckpts,
        "refs": refs,
        "logits": logits,
        "targets": targets,
        "head": (hidden, weight, head_targets),
    }


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", ROUNDTRIP)
def test_import_export_round_trip_is_bit_exact(runs, layout):
    from safetensors.torch import load_file

    original = load_file(str(runs["ckpts"][LAYOUTS[layout][2]] / "model.safetensors"))
    for rank in range(2):  # the export is returned, complete, on every rank
        exported = torch.load(runs["root"] / f"rt_{layout}.pt.rank{rank}", weights_only=False)
        assert set(exported) == set(original)
        for name, tensor in original.items():
            assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name


@pytest.mark.multiproc
def test_vocab_parallel_logprobs_match_full_softmax(runs):
    logits, targets = runs["logits"].clone().requires_grad_(True), runs["targets"]
    logp = torch.log_softmax(logits[..., :LP_VOCAB], dim=-1)
    ref_lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ref_ent = -(logp.exp() * logp).sum(-1)
    (ref_lp.sum() + 0.5 * ref_ent.sum()).backward()
    ref_top, ref_ids = logp.detach().topk(5, dim=-1)
    shards = [torch.load(runs["root"] / f"lp_rank{r}.pt", weights_only=False) for r in range(2)]
    for shard in shards:  # every TP rank holds the same (replicated) outputs
        out = shard["out"]
        torch.testing.assert_close(out.logprobs, ref_lp.detach(), atol=1e-5, rtol=0)
        torch.testing.assert_close(out.entropy, ref_ent.detach(), atol=1e-5, rtol=0)
        torch.testing.assert_close(out.topk_logprobs, ref_top, atol=1e-5, rtol=0)
        assert torch.equal(out.topk_ids, ref_ids)
    grad = torch.cat([s["grad"] for s in shards], dim=-1)
    torch.testing.assert_close(grad[..., :LP_VOCAB], logits.grad[..., :LP_VOCAB], atol=1e-5, rtol=0)
    assert torch.count_nonzero(grad[..., LP_VOCAB:]) == 0  # padding columns get no gradient


@pytest.mark.multiproc
def test_chunked_head_on_two_shards_matches_the_unchunked_path(runs):
    hidden, weight, targets = runs["head"]
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    ref = vocab_parallel_logprobs((h @ w.T)[None], targets[None], LP_VOCAB, top_k=5)
    (ref.logprobs.sum() + 0.5 * ref.entropy.sum()).backward()
    shards = [torch.load(runs["root"] / f"head_rank{r}.pt", weights_only=False) for r in range(2)]
    for shard in shards:
        out = shard["out"]
        torch.testing.assert_close(out.logprobs, ref.logprobs[0].detach(), atol=1e-5, rtol=0)
        torch.testing.assert_close(out.entropy, ref.entropy[0].detach(), atol=1e-5, rtol=0)
        torch.testing.assert_close(out.topk_logprobs, ref.topk_logprobs[0], atol=1e-5, rtol=0)
        assert torch.equal(out.topk_ids, ref.topk_ids[0])
    # hidden is replicated over TP: its gradient is the sum of the ranks' partials (megatron's
    # copy_to_tensor_model_parallel_region does that all-reduce in the model)
    torch.testing.assert_close(shards[0]["grad_hidden"] + shards[1]["grad_hidden"], h.grad, atol=1e-5, rtol=0)
    grad_w = torch.cat([s["grad_weight"] for s in shards])
    torch.testing.assert_close(grad_w, w.grad, atol=1e-5, rtol=0)
    assert torch.count_nonzero(grad_w[LP_VOCAB:]) == 0


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_ranks_match_one(runs, layout):
    from safetensors.torch import load_file

    tied = LAYOUTS[layout][2]
    ref = runs["refs"][tied]
    got = torch.load(runs["root"] / f"{layout}.pt", weights_only=False)
    for key in ("before", "after"):
        for g, r in zip(got[key], ref[key], strict=True):
            torch.testing.assert_close(g.logprobs, r.logprobs, atol=ATOL, rtol=0)
            torch.testing.assert_close(g.entropy, r.entropy, atol=ATOL, rtol=0)
            torch.testing.assert_close(g.topk_logprobs, r.topk_logprobs, atol=ATOL, rtol=0)
            assert torch.equal(g.topk_ids, r.topk_ids)
    assert got["loss"] == pytest.approx(ref["loss"], abs=ATOL)
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    assert ref["grad_norm"] > 0.5, "clipping must be exercised (grad_clip=0.5)"
    assert set(got["weights"]) == set(ref["weights"])
    for name, w in ref["weights"].items():
        torch.testing.assert_close(got["weights"][name], w, atol=ATOL, rtol=0, msg=name)
    init = load_file(str(runs["ckpts"][tied] / "model.safetensors"))
    moved = max((ref["weights"][n] - w).abs().max().item() for n, w in init.items())
    assert moved > 1e-3, "the optimizer step must change the weights"
    # the planner's parameter count for rank 0 (stage 0, tp rank 0) is what megatron built
    shape = PRESETS["tiny-test"].replace(tie_word_embeddings=tied)
    assert got["numel"] == stage_parameters(shape, got["layout"], 0)
    assert ref["numel"] == stage_parameters(shape, ref["layout"], 0)


@pytest.mark.multiproc
@pytest.mark.slow
def test_tp2_pp2_four_ranks_match_one(runs, tmp_path):
    """TP and PP together (4 processes): activations cross stages between matching TP ranks."""
    ckpt = runs["ckpts"][False]
    run_distributed(train_once, 4, 2, 2, False, str(ckpt), str(tmp_path / "got.pt"))
    got, ref = torch.load(tmp_path / "got.pt", weights_only=False), runs["refs"][False]
    for g, r in zip(got["after"], ref["after"], strict=True):
        torch.testing.assert_close(g.logprobs, r.logprobs, atol=ATOL, rtol=0)
    assert got["loss"] == pytest.approx(ref["loss"], abs=ATOL)
    for name, w in ref["weights"].items():
        torch.testing.assert_close(got["weights"][name], w, atol=ATOL, rtol=0, msg=name)
