"""The megatron-core training step on CUDA: one GRPO update at 16K and 32K tokens, its peak memory beside
``sparrow plan``'s, one refit into the rollout engine and one sleep/wake.

It builds what the trainer builds, with the trainer's own functions (:func:`sparrow_nemo.grpo.setup.build_policy`
and ``build_engine``) from the recipe ``recipes/qwen3_1p7b_math.yaml`` at TP1 with random init
(``policy.tensor_model_parallel_size=1 model.hf_checkpoint=null``): MegatronPolicy for the qwen3-1.7b shape
in bf16 with fp32 master weights, the recipe's full recompute and 4,096-token logprob chunks, megatron's DDP and
distributed optimizer on CUDA (the torch equivalents on CPU). The engine is put to sleep before training (as
the trainer's process model does), so the GPU holds only the policy during the update. Per sequence length
(one row: a 512-token prompt and the rest response), with ``torch.cuda.max_memory_allocated`` reset first:

1. the old logprobs by a scoring pass (``policy.logprobs``; its peak is ``score_peak_bytes``);
2. one GRPO update (``update_policy``: the recipe's clipped policy-gradient loss, backward, optimizer step);
   its peak is ``measured_peak_bytes``, beside ``plan``: ``sparrow plan``'s training phase for the same
   recipe, layout and sequence length (:func:`sparrow_nemo.commands.plan.plan_config`), part by part.

Then the trainer's cycle: the engine wakes (storage for its weights, uninitialised: sleep released them), the
policy's weights are streamed into it (``refit``; one is compared with the policy's export), it generates 8
tokens, sleeps (weights and KV pool released), wakes, is refitted and generates the same 8 tokens again. One
JSON line per length and one for the refit, each written when it finishes. Targets: the measured peak <= 1.1 x
the plan's total (the plan sizes the job: it may overestimate, not underestimate much), and the plan's total
within each GPU kind's memory (``fits``); the refit line: the weights arrived, and the same tokens came after
sleep/wake/refit.

``--tiny``: the ``tiny`` shape in fp32 on CPU at 128/256 tokens: the same path, no memory numbers (CPU has
no ``max_memory_allocated``).

GPU: PYTHONPATH=kernels:.:<megatron-core site> python benchmarks/gpu_train_step.py --out train_step.jsonl
CPU: .venv/bin/python benchmarks/gpu_train_step.py --tiny
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_targets import KINDS, commit, judge, kind_of

RECIPE = "qwen3_1p7b_math"
GIB = 2**30


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--tiny", action="store_true", help="the tiny shape in fp32 on CPU (the path, no memory numbers)"
    )
    p.add_argument("--lengths", type=int, nargs="+", default=None, help="tokens per sequence (16384 32768)")
    p.add_argument("--out", type=Path, default=None, help="JSON lines file to append to")
    args = p.parse_args(argv)
    args.lengths = args.lengths or ([128, 256] if args.tiny else [16384, 32768])
    args.prompt_tokens = 32 if args.tiny else 512
    return args


def recipe_overrides(args: argparse.Namespace, seq_len: int) -> list[str]:
    """The recipe at TP1 with random init and ``seq_len``-token sequences (what ``sparrow plan`` prices)."""
    out = ["policy.tensor_model_parallel_size=1", "model.hf_checkpoint=null",
           f"data.max_prompt_tokens={args.prompt_tokens}", f"rollout.max_new_tokens={seq_len - args.prompt_tokens}"]  # fmt: skip
    if args.tiny:
        out += ["model.preset=tiny", "policy.precision=fp32", "model.dtype=fp32", "trainer.device=cpu"]
    return out


def plan_parts(config, gpu_gib: float) -> dict:
    """``sparrow plan``'s training phase for one GPU of ``gpu_gib``: its parts and total, bytes."""
    from sparrow_nemo.commands.plan import plan_config

    m = plan_config(config, 1, 1, gpu_gib).memory
    parts = {
        k: getattr(m, k) for k in ("weights", "gradients", "optimizer", "activations", "logits", "recompute")
    }
    return {**parts, "total": m.total}


def update_batch(vocab: int, seq_len: int, prompt: int, old_logprobs: torch.Tensor | None = None):
    """One row of ``seq_len`` random tokens, the response after ``prompt`` tokens; advantage 1."""
    from sparrow_nemo.grpo.update import UpdateBatch

    gen = torch.Generator().manual_seed(seq_len)
    tokens = torch.randint(3, vocab, (1, seq_len), generator=gen)
    mask = torch.zeros(1, seq_len - 1, dtype=torch.bool)
    mask[:, prompt - 1 :] = True
    old = torch.zeros(1, seq_len - 1) if old_logprobs is None else old_logprobs
    return UpdateBatch(tokens, torch.tensor([seq_len]), mask, torch.ones(1), old, old)


def peak(fn, cuda: bool) -> tuple[object, int | None, float]:
    """(``fn()``, the device's peak allocated bytes while it ran (None off CUDA), seconds)."""
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    out = fn()
    if cuda:
        torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() if cuda else None, time.perf_counter() - t0


def train_rows(policy, config, args, cuda: bool, meta: dict) -> Iterator[dict]:
    """One GRPO update per length -> its line (measured peak beside the plan's), yielded as each finishes."""
    from sparrow_nemo.grpo.recipe import load_config
    from sparrow_nemo.grpo.update import update_policy
    from sparrow_nemo.policy.batch import PolicyBatch

    vocab = config.model.shape().vocab_size
    for seq_len in args.lengths:
        cfg = load_config(RECIPE, recipe_overrides(args, seq_len))
        probe = update_batch(vocab, seq_len, args.prompt_tokens)
        scoring = [PolicyBatch(probe.tokens, probe.lengths, {"mask": probe.response_mask})]
        scored, score_peak, score_s = peak(lambda b=scoring: policy.logprobs(b)[0], cuda)
        batch = update_batch(vocab, seq_len, args.prompt_tokens, scored.logprobs.float())
        p = cfg.policy
        step = [cfg.grpo.loss, p.micro_batch_size, 1, p.max_tokens_per_micro_batch]
        result, step_peak, step_s = peak(lambda b=batch, a=step: update_policy(policy, b, *a), cuda)
        gpu_gib = torch.cuda.get_device_properties(0).total_memory / GIB if cuda else 80.0
        plan = plan_parts(cfg, gpu_gib)
        row = {
            **meta, "benchmark": "train_step", "seq_len": seq_len, "prompt_tokens": args.prompt_tokens,
            "precision": p.precision, "recompute": p.recompute_granularity, "logprob_chunk_tokens": p.logprob_chunk_tokens,
            "megatron_training": policy.optimizer.megatron_schedule, "score_s": score_s, "score_peak_bytes": score_peak,
            "step_s": step_s, "measured_peak_bytes": step_peak, "plan": plan,
            "measured_over_plan": None if step_peak is None else step_peak / plan["total"],
            "fits": {kind: plan["total"] <= k.memory_gib * GIB for kind, k in KINDS.items()},
            "updated": result.updated, "skipped": result.skipped,
            "loss": result.metrics.get("train/loss"), "grad_norm": result.metrics.get("train/grad_norm"),
        }  # fmt: skip
        row["target"] = None if step_peak is None else judge(row["measured_over_plan"], 1.1, "<=")
        shown = "-" if step_peak is None else f"{step_peak / GIB:.1f} GiB"
        print(f"train step {seq_len} tokens: {step_s:.1f} s, peak {shown} vs plan {plan['total'] / GIB:.1f} GiB, "
              f"loss {row['loss']}, updated {result.updated}", flush=True)  # fmt: skip
        yield row


def refit_row(policy, engine, config, cuda: bool, meta: dict) -> dict:
    """The trainer's cycle after an update: wake (weight storage, uninitialised), refit, generate; then sleep
    (weights and KV pool released), wake, refit and generate again: the same tokens, so the round trip holds."""
    from sparrow_nemo.sparse.schedule import BudgetSchedule

    name = "model.layers.0.self_attn.q_proj.weight"
    from sparrow_nemo.grpo.setup import sampling_params

    sampling = replace(sampling_params(config), max_new_tokens=8, stop_token_ids=(), seed=7)

    def timed(fn) -> tuple[object, float]:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if cuda:
            torch.cuda.synchronize()
        return out, time.perf_counter() - t0

    _, wake_s = timed(engine.wake)
    tensors, refit_s = timed(lambda: policy.refit(engine))
    exported = policy.export_hf()[name]
    match = torch.equal(engine.model.params[name].to(exported.device, exported.dtype), exported)
    del exported
    first = engine.generate([[5, 6, 7, 8] * 4], sampling, BudgetSchedule.dense()).samples[0]
    awake = torch.cuda.memory_allocated() if cuda else None
    _, sleep_s = timed(engine.sleep)
    asleep = torch.cuda.memory_allocated() if cuda else None
    _, wake2_s = timed(engine.wake)
    policy.refit(engine)
    again = engine.generate([[5, 6, 7, 8] * 4], sampling, BudgetSchedule.dense()).samples[0]
    finite = bool(torch.isfinite(first.logprobs).all())
    same = torch.equal(first.response_ids, again.response_ids)
    row = {
        **meta, "benchmark": "refit_sleep_wake", "tensors": tensors, "refit_s": refit_s, "wake_s": wake_s,
        "sleep_s": sleep_s, "wake_again_s": wake2_s, "allocated_awake_bytes": awake, "allocated_asleep_bytes": asleep,
        "weights_match": match, "generated_tokens": int(first.response_ids.numel()), "logprobs_finite": finite,
        "same_tokens_after_sleep_wake": same,
    }  # fmt: skip
    ok = match and finite and same
    row["target"] = {"value": ok, "op": "==", "limit": True, "pass": ok}
    print(f"refit {tensors} tensors in {refit_s:.2f} s (weights match: {match}); sleep {sleep_s:.2f} s, wake "
          f"{wake2_s:.2f} s; the same {row['generated_tokens']} tokens after sleep/wake/refit: {same}", flush=True)  # fmt: skip
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    from sparrow_nemo.grpo.recipe import load_config
    from sparrow_nemo.grpo.setup import build_engine, build_policy

    cuda = torch.cuda.is_available() and not args.tiny
    config = load_config(RECIPE, recipe_overrides(args, max(args.lengths)))
    gpu = torch.cuda.get_device_name(0) if cuda else "cpu"
    import megatron.core

    meta = {"commit": commit(), "gpu": gpu, "gpu_kind": kind_of(gpu) if cuda else None, "torch": torch.__version__,
            "cuda": torch.version.cuda, "megatron_core": megatron.core.__version__, "recipe": RECIPE,
            "model": config.model.preset, "tp": 1, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}  # fmt: skip
    t0 = time.perf_counter()
    policy = build_policy(config, None)
    engine = build_engine(config, None)  # empty, as the trainer's: the refit fills it
    print(f"policy and engine built in {time.perf_counter() - t0:.1f} s ({meta['model']}, megatron-core "
          f"{meta['megatron_core']}, {gpu})", flush=True)  # fmt: skip
    engine.sleep()  # the policy trains alone on the GPU
    rows: list[dict] = []

    def keep(row: dict) -> None:  # written at once: a killed run keeps its finished lines
        rows.append(row)
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            with args.out.open("a") as f:
                f.write(json.dumps(row) + "\n")

    try:
        for row in train_rows(policy, config, args, cuda, meta):
            keep(row)
        keep(refit_row(policy, engine, config, cuda, meta))
    finally:
        policy.close()
    return rows


if __name__ == "__main__":
    main()
