"""Measured memory of one policy training step on CPU, in a fresh process (``python _measure_step.py CASES``).

(Run from the tests folder's parent with ``tests`` on ``sys.path``, as pytest runs it.)

``CASES`` is a JSON list of cases; each builds a one-rank fp32 megatron policy of the given shape and
memory settings, and measures one training step (forward, fused chunked logprobs, the GRPO loss,
backward) on one micro-batch of ``rows`` x ``seq_len`` random tokens. Printed: one JSON line per case with

- ``peak``: the most bytes torch's CPU allocator held during the step above what it held before (the
  model's weights); from the profiler's allocation events, which see every torch allocation;
- ``grads``: bytes of the parameter gradients after the step (part of the model's own memory);
- ``saved``: bytes of the distinct tensors autograd saved for backward in the step's forward, parameters
  excluded (the activations, measured independently of any formula).
"""

from __future__ import annotations

import itertools
import json
import sys
import warnings
from pathlib import Path

import torch


def peak_allocated(fn) -> int:
    """Peak bytes allocated by torch (CPU) while ``fn()`` runs, above the level at its start."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
        key=lambda e: e.start_ns(),
    )
    return max(itertools.accumulate(e.nbytes() for e in events), default=0)


def _saved_bytes(fn, params: set[int]) -> int:
    """Bytes of the distinct non-parameter storages autograd saves while ``fn()`` runs its forward."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def measure(case: dict) -> dict:
    from sparrow_nemo.grpo.losses import LossNormalizer, PolicyLossConfig
    from sparrow_nemo.grpo.objective import grpo_loss_fn
    from sparrow_nemo.model_shapes import Qwen3Shape
    from sparrow_nemo.policy.batch import PolicyBatch
    from sparrow_nemo.policy.logprobs import policy_outputs
    from sparrow_nemo.policy.memory import MemorySettings
    from sparrow_nemo.policy.model import build_model
    from sparrow_nemo.policy.parallel import ParallelLayout, destroy_parallel, initialize_parallel
    from sparrow_nemo.policy.pipeline import run_microbatches

    shape = Qwen3Shape(**case["shape"])
    memory = MemorySettings(**case["memory"])
    layout = ParallelLayout()
    initialize_parallel(layout, shape)
    model, spec = build_model(shape, layout, "float32", memory=memory)
    model.train()
    rows, width = case["rows"], case["seq_len"]
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, shape.vocab_size, (rows, width), generator=g)
    mask = torch.ones(rows, width - 1, dtype=torch.bool)
    extras = {
        "mask": mask,
        "old_logprobs": torch.full(mask.shape, -3.0),
        "rollout_logprobs": torch.full(mask.shape, -3.0),
        "advantages": torch.randn(rows, generator=g),
    }
    batch = PolicyBatch(tokens, torch.full((rows,), width), extras)
    loss_fn = grpo_loss_fn(PolicyLossConfig(), LossNormalizer.of(mask))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def forward_loss():
        hidden = model(*batch.model_inputs())
        return loss_fn(policy_outputs(model, hidden, batch, spec), batch)[0]

    saved = _saved_bytes(forward_loss, params)
    peak = peak_allocated(lambda: run_microbatches(model, spec, [batch], loss_fn))
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    destroy_parallel()
    return {"peak": peak, "grads": grads, "saved": saved}


def _selection_margins(policy, batch, plan, pattern, prompt_len: int, kv_budget: torch.Tensor) -> list[float]:
    """Per response token, the smallest relative score gap (over KV heads of the last layer) between the last
    page the selection keeps and the first it drops: near 0 the choice is decided by fp32 rounding, and two
    exact implementations that sum in different orders may pick different pages."""
    from sparrow_nemo.policy import sparse_forward

    captured = {}
    original = sparse_forward.block_sparse_attention

    def spy(q, k, v, plan_, pattern_):  # records the sparse layer's q, k (as attention sees them)
        captured["q"], captured["k"] = q.detach().double(), k.detach().double()
        return original(q, k, v, plan_, pattern_)

    sparse_forward.block_sparse_attention = spy
    try:
        policy.sparse_logprobs([batch], [plan], pattern)
    finally:
        sparse_forward.block_sparse_attention = original
    q, k, ps = captured["q"][0], captured["k"][0], pattern.page_size
    centroids = sparse_forward.page_landmarks(k[None].float(), pattern)[0][0].double()  # [Hkv, P, D]
    heads = k.shape[0]
    margins = []
    for i, budget in enumerate(kv_budget.tolist()):
        t = prompt_len - 1 + i
        pages = (t + ps) // ps
        q_mean = q[:, t].view(heads, -1, q.shape[-1]).mean(dim=1)
        scores = torch.einsum("hd,hpd->hp", q_mean, centroids[:, :pages])[
            :, pattern.sink_pages : pages - pattern.local_pages
        ]
        keep = budget // ps - pattern.sink_pages - pattern.local_pages
        if keep >= scores.shape[1]:  # every page fits the budget (e.g. the prefill's dense token): no choice
            margins.append(float("inf"))
            continue
        ranked = torch.sort(scores, dim=-1, descending=True).values
        gap = (ranked[:, keep - 1] - ranked[:, keep]).abs() / ranked[:, keep - 1].abs()
        margins.append(float(gap.min()))
    return margins


def measure_sparse(case: dict) -> dict:
    """DistillSparse's sparse forward on one long rollout of the torch rollout engine.

    ``case``: ``hf_dir`` (a tiny HF checkpoint), ``prompt_len``, ``new_tokens``, ``budget`` (tokens of a
    fixed schedule, 16-token pages), ``dense_layers``. Returns the peak of the sparse scoring pass and of one
    LoRA training step through it (bytes above the model and adapter), and per response token the abs
    difference between the policy's sparse logprob and the engine's and the selection margin
    (:func:`_selection_margins`).
    """
    from policy.test_sparse_forward import random_lora
    from sparrow_nemo.grpo.rollout_step import pad_pairs
    from sparrow_nemo.policy.batch import PolicyBatch
    from sparrow_nemo.policy.optim import OptimizerSettings
    from sparrow_nemo.policy.parallel import ParallelLayout
    from sparrow_nemo.policy.policy import MegatronPolicy
    from sparrow_nemo.policy.sparse_forward import SparsePlan
    from sparrow_nemo.rollout.engine import SamplingParams
    from sparrow_nemo.rollout.torch.engine import TorchRolloutEngine
    from sparrow_nemo.sparse.pattern import SparsePattern
    from sparrow_nemo.sparse.schedule import BudgetSchedule

    ps, dense = 16, case["dense_layers"]
    engine = TorchRolloutEngine.from_hf_dir(
        case["hf_dir"],
        dense_layers=dense,
        page_size=ps,
        sink_pages=1,
        local_pages=2,
        attention_backend="torch",
    )
    shape = engine.shape
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, shape.vocab_size, (case["prompt_len"],), generator=g)
    schedule = BudgetSchedule(bin_tokens=2048, budgets=(case["budget"],), page_size=ps, name="fixed")
    sampling = SamplingParams(max_new_tokens=case["new_tokens"], temperature=1.0, seed=3, stop_token_ids=())
    sample = engine.generate([prompt], sampling, schedule).samples[0]
    del engine
    tokens, lengths, mask = pad_pairs([sample.prompt_ids], [sample.response_ids])
    adv = torch.tensor([1.0])
    batch = PolicyBatch(tokens, lengths, {"mask": mask, "adv": adv})
    plan = SparsePlan.from_rollouts([sample.prompt_ids.numel()], [sample.kv_budget], tokens.shape[1])
    pattern = SparsePattern(page_size=ps, sink_pages=1, local_pages=2, dense_layers=dense)
    policy = MegatronPolicy(
        shape, ParallelLayout(), OptimizerSettings(lr=1e-3), "float32", hf_dir=case["hf_dir"]
    )
    out = {}
    scored = []
    out["peak_score"] = peak_allocated(
        lambda: scored.append(policy.sparse_logprobs([batch], [plan], pattern)[0])
    )
    out["diffs"] = (scored[0].logprobs[mask] - sample.logprobs).abs().tolist()
    out["margins"] = _selection_margins(
        policy, batch, plan, pattern, sample.prompt_ids.numel(), sample.kv_budget
    )
    policy.enable_lora(*random_lora(seed=5))
    optimizer = policy.lora_optimizer(OptimizerSettings(lr=1e-3, weight_decay=0.0))

    def loss(o, b):
        m = b.extras["mask"].float()
        return -(b.extras["adv"][:, None] * o.logprobs * m).sum() / m.sum(), {}

    policy.lora_train_step([batch], [plan], pattern, loss, optimizer)  # AdamW state exists before measuring
    out["peak_train"] = peak_allocated(
        lambda: policy.lora_train_step([batch], [plan], pattern, loss, optimizer)
    )
    out["width"] = tokens.shape[1]
    policy.close()
    return out


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests folder, as under pytest
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from sparrow_nemo.grpo.world import one_rank_world

    for case in json.loads(sys.argv[1]):
        with one_rank_world():
            result = measure_sparse(case) if case.get("kind") == "sparse" else measure(case)
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
