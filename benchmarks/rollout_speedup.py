"""Rollout speedup of Sparrow's sparse decode over dense on one GPU, at Qwen3 shapes (issue 11).

For each model (random bf16 weights of a Qwen3 preset), generation length and batch it compares the
dense schedule with the paper's 0.86 preset on the torch rollout engine's fast decode path (fused Triton
kernels, static-shape decode step replayed from a CUDA graph, no host sync; EOS ignored) and reports:
dense and sparse tokens/s, the speedup, the cost model's predicted speedup and memory-bound limit for
the same run, the dense engine against the memory-bound limit of dense decoding at the measured copy
bandwidth, and per-stage decode-step timings at the final cached length (including the ``minmax`` page
score's selection and append, timed beside the centroid's: ``"minmax"`` in each line).

Method (stated in every JSON line as "method"): a 16K-32K generation is 16K-32K decode steps per arm,
which does not fit the 8-minute device call. So the KV cache is filled with random keys/values (with
their page centroids) for prompt + generation tokens, and the CUDA-graph decode step is timed at both
ends of every region of cached lengths where the schedule's budget is constant (the 2,000-token bins,
split where a budget starts to bind); the step time is linear in the cached length inside a region, so
the generation's decode time is the sum over regions of (steps x step time at the region's centre).
Response token i is one step at cached length prompt + i (i = 0 .. gen-1), as in the cost model.
An end-to-end check runs ``engine.generate`` for a short generation with the same code path and
compares its decode time with the step-time model over the same steps. The batch is the requested one
when the full KV cache fits in GPU memory, else the largest that fits (stated as batch vs
batch_requested).

GPU:  PYTHONPATH=kernels:. python benchmarks/rollout_speedup.py
CPU:  PYTHONPATH=kernels:. python benchmarks/rollout_speedup.py --tiny --device cpu   (interpreter, seconds)
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_targets import PAPER_SPEEDUP, cache_bytes_per_token
from sparse_attention import copy_bandwidth, environment, make_timer

from sparrow_nemo.hf_qwen3 import expected_weight_shapes
from sparrow_nemo.model_shapes import Qwen3Shape, get_shape
from sparrow_nemo.rollout.engine import SamplingParams
from sparrow_nemo.rollout.sampling import sample_tokens, token_logprobs
from sparrow_nemo.rollout.torch.block_manager import BlockManager
from sparrow_nemo.rollout.torch.cuda_graphs import DecodeGraphs
from sparrow_nemo.rollout.torch.engine import TorchRolloutEngine
from sparrow_nemo.rollout.torch.paged_cache import fill_block_table
from sparrow_nemo.rollout.torch.qwen3 import Qwen3Decoder
from sparrow_nemo.sparse.cost_model import HARDWARE, DecodeCostModel, Hardware
from sparrow_nemo.sparse.schedule import DENSE_BUDGET, BudgetSchedule

RESULTS = Path(__file__).resolve().parent / "results"
METHOD = (
    "step-time integration: CUDA-graph decode steps timed at both ends of every constant-budget region "
    "of cached length over a random-filled KV cache, summed over all gen steps (linear within regions)"
)
#: The CPU smoke configuration: the 2-layer "tiny-test" shape (1 dense + 1 sparse layer) and a
#: schedule scaled to its short context.
TINY_SCHEDULE = BudgetSchedule(bin_tokens=32, budgets=(32, 48), name="tiny-steps")


@dataclass(frozen=True)
class Region:
    """Cached lengths lo..hi (inclusive) over which the sparse budget is constant and does not start
    or stop binding: the decode-step time is linear in the cached length there."""

    lo: int
    hi: int

    @property
    def steps(self) -> int:
        return self.hi - self.lo + 1


def regions(first: int, last: int, schedule: BudgetSchedule) -> list[Region]:
    """Split cached lengths first..last at the schedule's bin edges and where a bin's budget starts to
    bind (cached length = budget tokens: beyond it pages are selected, below it all are kept)."""
    cuts = {first, last + 1}
    for b, budget in enumerate(schedule.budgets):
        edge = b * schedule.bin_tokens
        cuts.add(edge)
        if budget != DENSE_BUDGET:
            cuts.add(budget + 1)
    inner = sorted(c for c in cuts if first <= c <= last + 1)
    return [Region(a, b - 1) for a, b in itertools.pairwise(inner)]


def random_decoder(
    shape: Qwen3Shape, dtype: torch.dtype, device: torch.device, seed: int = 0
) -> Qwen3Decoder:
    """Random weights generated on ``device`` (seconds for 8B on a GPU; values do not affect timing):
    N(0, 0.02) matrices, 1 + N(0, 0.1) norm weights."""
    gen = torch.Generator(device=device).manual_seed(seed)
    params = {}
    for name, shp in expected_weight_shapes(shape).items():
        t = torch.empty(shp, dtype=dtype, device=device)
        if name.endswith("norm.weight"):
            t.normal_(1.0, 0.1, generator=gen)
        else:
            t.normal_(0.0, 0.02, generator=gen)
        params[name] = t
    return Qwen3Decoder(shape, params)


def fit_batch(
    requested: int, tokens_per_seq: int, per_token: float, device: torch.device, headroom: int
) -> int:
    """The requested batch, or the most sequences whose full KV cache fits in free memory - headroom."""
    if device.type != "cuda":
        return requested
    free = torch.cuda.mem_get_info(device)[0] - headroom
    return max(0, min(requested, int(free // (per_token * tokens_per_seq))))


def fill_random_cache(engine: TorchRolloutEngine, seed: int) -> None:
    """Random N(0, 1) keys and values in every page, centroids = the mean of each page's keys."""
    cache = engine._cache
    gen = torch.Generator(device=engine.device).manual_seed(seed)
    for k, v, c in zip(cache.k_pages, cache.v_pages, cache.centroids):
        k.normal_(generator=gen)
        v.normal_(generator=gen)
        for lo in range(0, k.shape[0], 4096):  # bounded fp32 temporaries
            c[lo : lo + 4096] = k[lo : lo + 4096].float().mean(dim=2)


class FixedSteps:
    """Decode steps of a fixed batch over the engine's static step buffers (:class:`DecodeGraphs`: the CUDA graph
    the engine replays at this batch's bucket on CUDA, the same step eagerly elsewhere), from ``seq_len``."""

    def __init__(
        self, engine: TorchRolloutEngine, table: torch.Tensor, schedule: BudgetSchedule, sampling
    ) -> None:
        batch = table.shape[0]
        capture = engine.device.type == "cuda" and engine.backend == "triton"
        self.graphs = DecodeGraphs(engine._step_fn, engine.device, batch, table.shape[1], capture=capture)
        if not schedule.is_dense:
            self.graphs.budget_of.load(schedule)
        self.table, self.dense, self.sampling = table, schedule.is_dense, sampling
        self.scratch = engine._cache.num_pages - 1
        self.seq_len = torch.ones(batch, dtype=torch.int64, device=engine.device)
        self.tokens = torch.randint(3, engine.shape.vocab_size, (batch,), device=engine.device)
        self.uniforms = torch.zeros(batch, dtype=torch.float64)

    @property
    def captured(self) -> bool:
        return bool(self.graphs._graphs)

    def run(self, n: int) -> None:
        for _ in range(n):
            self.seq_len += 1
            out = self.graphs.run(
                self.table,
                self.tokens,
                self.seq_len,
                self.uniforms,
                self.dense,
                self.sampling,
                20,
                self.scratch,
            )
            self.tokens = out.tokens


class StepClock:
    """Milliseconds per decode step of a :class:`FixedSteps` at given cached lengths."""

    def __init__(self, dec: FixedSteps, steps: int, now: Callable[[], float] = time.perf_counter) -> None:
        self.dec, self.steps, self.now = dec, steps, now  # now: host clock (seconds) off CUDA
        self.cuda = dec.seq_len.device.type == "cuda"

    def window(self, start: int, n: int) -> float:
        """Mean ms of the ``n`` steps at cached lengths start + 1 .. start + n (one untimed step at
        ``start`` first: it also leaves the previous window's state behind)."""
        dec = self.dec
        dec.seq_len.fill_(start - 1)
        dec.run(1)
        if self.cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            dec.run(n)
            end.record()
            end.synchronize()
            return begin.elapsed_time(end) / n
        t0 = self.now()
        dec.run(n)
        return (self.now() - t0) * 1e3 / n

    def region_ms(self, r: Region) -> tuple[float, list[tuple[float, float]]]:
        """Total ms of the region's steps and the measured (cached length, ms per step) points.

        A region of at most 2 * steps steps is timed whole (exact); a longer one in two windows of
        ``steps`` steps at its ends (lo .. lo+n-1 and hi-n+1 .. hi), whose mean is the step time at the
        region's centre when the time is linear in the cached length.
        """
        n = self.steps
        if r.steps <= 2 * n:
            t = self.window(max(r.lo - 1, 1), r.steps)
            return r.steps * t, [((r.lo + r.hi) / 2, t)]
        ta, tb = self.window(r.lo - 1, n), self.window(r.hi - n, n)
        return r.steps * (ta + tb) / 2, [(r.lo + (n - 1) / 2, ta), (r.hi - (n - 1) / 2, tb)]


def decode_ms(
    engine: TorchRolloutEngine,
    block_table: torch.Tensor,
    schedule: BudgetSchedule,
    sampling: SamplingParams,
    region_list: list[Region],
    steps_per_window: int,
) -> tuple[float, list[tuple[float, float]], float, bool, float]:
    """(total decode ms over the regions, measured points, ms per step at the last cached length,
    whether the steps were replayed from a CUDA graph, seconds of the first step + graph capture)."""
    dec = FixedSteps(engine, block_table, schedule, sampling)
    dec.seq_len.fill_(region_list[0].lo - 1)
    t0 = time.perf_counter()
    dec.run(1)  # compiles the kernels and, on CUDA, captures the bucket's graph
    warm_s = time.perf_counter() - t0
    clock = StepClock(dec, steps_per_window)
    total, points = 0.0, []
    for r in region_list:
        ms, pts = clock.region_ms(r)
        total += ms
        points += pts
    last = clock.window(region_list[-1].hi - 1, 1)
    return total, points, last, dec.captured, warm_s


def stage_ms(
    engine: TorchRolloutEngine,
    block_table: torch.Tensor,
    cached: int,
    schedule: BudgetSchedule,
    sampling: SamplingParams,
    timer: Callable[[Callable[[], object]], float],
) -> dict[str, float]:
    """Per-layer kernel times at ``cached`` tokens (layer 0's pools; every layer has the same sizes):
    sparse select / attend / merge, dense (all pages) attend / merge, append, sampling + logprobs, and the
    ``minmax`` page score's select and append (key bounds of layer 0's keys)."""
    import sparrow_kernels as sk

    cache, s = engine._cache, engine.shape
    batch, dev, ps = block_table.shape[0], engine.device, engine.page_size
    q = torch.randn(batch, s.num_attention_heads, s.head_dim, dtype=engine.model.dtype, device=dev)
    seq = torch.full((batch,), cached, dtype=torch.int32, device=dev)
    k, v, cent = cache.k_pages[0], cache.v_pages[0], cache.centroids[0]
    out: dict[str, float] = {}
    arms = (("sparse", schedule.budgets_for(seq.long()).to(torch.int32)), ("dense", DENSE_BUDGET))
    for arm, budget in arms:
        args = (q, cent, block_table, seq, budget, ps, engine.sink_pages, engine.local_pages)
        # Dense layers launch no selection; the split merge is fused into the attention launch.
        sel = sk.page_selection(*args) if arm == "sparse" else None
        out[f"{arm}_select_ms"] = timer(lambda a=args: sk.page_selection(*a)) if arm == "sparse" else 0.0
        out[f"{arm}_attend_ms"] = timer(lambda s=sel: sk.decode_attention_paged(q, k, v, block_table, seq, s))
        out[f"{arm}_merge_ms"] = 0.0
    kv_new = torch.randn(batch, s.num_key_value_heads, s.head_dim, dtype=q.dtype, device=dev)
    pos = seq - 1
    out["append_ms"] = timer(lambda: sk.append_kv(k, v, cent, block_table, pos, kv_new, kv_new))
    # page_score=minmax: the same selection scored on per-page key bounds (two landmark tiles per page),
    # and the append that keeps them (the attention over the kept pages is the same kernel)
    bounds = sk.KeyBounds(k.amin(dim=2), k.amax(dim=2))
    minmax = (q, bounds, block_table, seq, arms[0][1], ps, engine.sink_pages, engine.local_pages)
    out["sparse_minmax_select_ms"] = timer(lambda: sk.page_selection(*minmax))
    out["append_minmax_ms"] = timer(lambda: sk.append_kv(k, v, bounds, block_table, pos, kv_new, kv_new))
    logits = torch.randn(batch, s.vocab_size, device=dev)
    uniforms = torch.rand(batch, dtype=torch.float64, device=dev)

    def sample() -> None:
        tokens = sample_tokens(logits, sampling, uniforms)
        token_logprobs(logits, tokens, sampling.logprobs_topk)

    out["sample_ms"] = timer(sample)
    return out


def step_breakdown(
    stages: dict[str, float], step_ms: float, shape: Qwen3Shape, dense_layers: int, arm: str
) -> dict:
    """Split one decode step (ms) into attention select / attend / merge over all layers, append, and
    the rest (embeddings, norms, projections, MLP, LM head, sampling: ``non_attention_ms``)."""
    sparse_layers = shape.num_layers - dense_layers if arm == "sparse" else 0
    dense = shape.num_layers - sparse_layers
    out = {
        stage: sparse_layers * stages[f"sparse_{stage}_ms"] + dense * stages[f"dense_{stage}_ms"]
        for stage in ("select", "attend", "merge")
    }
    out = {f"{k}_ms": v for k, v in out.items()}
    out["append_ms"] = shape.num_layers * stages["append_ms"]
    out["step_ms"] = step_ms
    out["non_attention_ms"] = step_ms - sum(
        out[k] for k in ("select_ms", "attend_ms", "merge_ms", "append_ms")
    )
    out["sample_ms"] = stages["sample_ms"]
    return out


def minmax_stages(
    stages: dict[str, float], sparse_step_ms: float, shape: Qwen3Shape, dense_layers: int
) -> dict:
    """The ``minmax`` page score at the final cached length: its per-layer select and append against the
    centroid's, and the sparse step it implies (the centroid step with every sparse layer's selection and
    every layer's append swapped; the attention over the kept pages is the same)."""
    sparse_layers = shape.num_layers - dense_layers
    extra = sparse_layers * (
        stages["sparse_minmax_select_ms"] - stages["sparse_select_ms"]
    ) + shape.num_layers * (stages["append_minmax_ms"] - stages["append_ms"])
    return {
        "select_ms": stages["sparse_minmax_select_ms"],
        "select_over_centroid": stages["sparse_minmax_select_ms"] / stages["sparse_select_ms"],
        "append_ms": stages["append_minmax_ms"],
        "extra_ms_per_step": extra,
        "sparse_step_ms_estimate": sparse_step_ms + extra,
    }


def cost_model_terms(
    shape: Qwen3Shape,
    schedule: BudgetSchedule,
    batch: int,
    prompt: int,
    gen: int,
    dense_layers: int,
    bandwidth: float,
) -> dict[str, float]:
    """The cost model on this run: predicted speedup (H200 constants), memory-bound speedup limit
    (bytes dense / bytes sparse), and dense decoding's memory-bound tokens/s at the measured bandwidth."""
    lengths = [gen] * batch
    h200 = DecodeCostModel(shape, HARDWARE["h200"], dense_layers=dense_layers)
    measured = DecodeCostModel(shape, Hardware("measured", 989e12, bandwidth), dense_layers=dense_layers)
    dense = BudgetSchedule.dense(schedule.bin_tokens, schedule.page_size)
    dense_cost = measured.rollout_cost(dense, lengths, prompt)
    return {
        "cost_model_predicted_speedup": h200.predicted_speedup(schedule, lengths, prompt),
        "memory_bound_speedup_limit": dense_cost.memory_s
        / measured.rollout_cost(schedule, lengths, prompt).memory_s,
        "dense_memory_bound_tok_s": dense_cost.tokens / dense_cost.memory_s,
    }


def linear_at(x: float, p: tuple[float, float], q: tuple[float, float]) -> float:
    """The line through points p and q (x, y) evaluated at x."""
    return p[1] + (q[1] - p[1]) * (x - p[0]) / (q[0] - p[0])


def summary(
    name: str, shape: Qwen3Shape, schedule: BudgetSchedule, batch: int, prompt: int, gen: int, dense_layers: int,
    bandwidth: float, dense_s: float, sparse_s: float,
) -> dict[str, float | None]:  # fmt: skip
    """Tokens/s, speedup and the cost-model columns of one batch size from the two arms' decode seconds."""
    out: dict[str, float | None] = {
        "dense_decode_s": dense_s,
        "sparse_decode_s": sparse_s,
        "dense_tok_s": batch * gen / dense_s,
        "sparse_tok_s": batch * gen / sparse_s,
        "speedup": dense_s / sparse_s,
    }
    out.update(cost_model_terms(shape, schedule, batch, prompt, gen, dense_layers, bandwidth))
    out["fraction_of_memory_bound_limit"] = out["speedup"] / out["memory_bound_speedup_limit"]
    out["dense_vs_memory_bound"] = out["dense_memory_bound_tok_s"] / out["dense_tok_s"]
    out["paper_speedup"] = PAPER_SPEEDUP.get(name)
    return out


def e2e_check(
    engine: TorchRolloutEngine,
    batch: int,
    prompt: int,
    gen: int,
    schedule: BudgetSchedule,
    sampling: SamplingParams,
) -> dict[str, float]:
    """``engine.generate`` (the fast path: prefill, then bucketed CUDA-graph decode) for ``gen`` tokens from
    random prompts; its decode time covers steps 1 .. gen-1 (cached lengths prompt + 1 .. prompt + gen - 1)."""
    gen_ids = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(3, engine.shape.vocab_size, (prompt,), generator=gen_ids).tolist() for _ in range(batch)
    ]
    params = SamplingParams(
        max_new_tokens=gen,
        temperature=sampling.temperature,
        stop_token_ids=(),
        seed=3,
        logprobs_topk=sampling.logprobs_topk,
    )
    out = engine.generate(prompts, params, schedule)
    return {"e2e_gen": gen, "e2e_decode_s": out.decode_s, "e2e_tok_s": batch * (gen - 1) / out.decode_s}


def run_config(
    engine: TorchRolloutEngine,
    name: str,
    batch_requested: int,
    batch: int,
    prompt: int,
    gen: int,
    schedule: BudgetSchedule,
    sampling: SamplingParams,
    args: argparse.Namespace,
    timer: Callable[[Callable[[], object]], float],
    bandwidth: float,
) -> dict:
    """Measure one (model, gen length, batch): both arms, stages, cost model, optional e2e check."""
    shape, ps = engine.shape, engine.page_size
    pages_per_seq = math.ceil((prompt + gen) / ps)
    engine._cache = None
    if engine.device.type == "cuda":
        torch.cuda.empty_cache()
    cache = engine._pool(batch * pages_per_seq)
    blocks = BlockManager(cache.num_pages - 1, ps)
    block_table = torch.full((batch, pages_per_seq), -1, dtype=torch.int32, device=engine.device)
    fill_block_table(blocks, block_table, torch.full((batch,), prompt + gen, dtype=torch.int64))
    fill_random_cache(engine, args.seed)
    first, last = prompt, prompt + gen - 1
    region_list = regions(first, last, schedule)
    dense = BudgetSchedule.dense(schedule.bin_tokens, ps)
    row: dict = {"benchmark": "rollout_speedup", "model": name, "batch_requested": batch_requested, "batch": batch,
                 "prompt_len": prompt, "gen_len": gen, "schedule": schedule.name, "method": METHOD,
                 "dtype": str(engine.model.dtype).removeprefix("torch."), "dense_layers": engine.dense_layers,
                 "temperature": sampling.temperature, "regions": len(region_list),
                 "engine_cuda_graph": engine.runner.graphs is not None}  # fmt: skip
    steps_ms, e2e_model, decode_s = {}, {}, {}
    e2e_regions = regions(prompt + 1, prompt + args.e2e_tokens - 1, schedule) if args.e2e_tokens > 1 else []
    for arm, sched in (("dense", dense), ("sparse", schedule)):
        total_ms, points, last_ms, graphed, warm_s = decode_ms(
            engine, block_table, sched, sampling, region_list, args.steps_per_window
        )
        row[f"{arm}_cuda_graph"] = graphed
        row[f"{arm}_first_step_and_capture_s"] = warm_s  # includes kernel compilation on first use
        decode_s[arm] = total_ms / 1e3
        row[f"{arm}_points_ms"] = [[round(x, 1), round(t, 4)] for x, t in points]
        steps_ms[arm] = last_ms
        if e2e_regions:  # the step-time model over the e2e check's steps
            e2e_ms, *_, e2e_capture_s = decode_ms(
                engine, block_table, sched, sampling, e2e_regions, args.steps_per_window
            )
            e2e_model[arm] = (e2e_ms / 1e3, e2e_capture_s)
    common = (name, shape, schedule)
    row.update(
        summary(
            *common, batch, prompt, gen, engine.dense_layers, bandwidth, decode_s["dense"], decode_s["sparse"]
        )
    )
    if args.extrapolate and batch_requested > batch >= 2:
        # The requested batch does not fit: time half the batch too and extrapolate each arm's decode
        # time linearly in the batch (weights are read once per step, KV bytes grow with the batch).
        half = batch // 2
        at_req = {}
        for arm, sched in (("dense", dense), ("sparse", schedule)):
            half_s = (
                decode_ms(engine, block_table[:half], sched, sampling, region_list, args.steps_per_window)[0]
                / 1e3
            )
            at_req[arm] = linear_at(batch_requested, (half, half_s), (batch, decode_s[arm]))
            row[f"{arm}_decode_s_half_batch"] = half_s
        row["extrapolated"] = {
            "batch": batch_requested,
            "from_batches": [half, batch],
            "how": "decode time per arm linear in batch through the two measured batches",
            **summary(*common, batch_requested, prompt, gen, engine.dense_layers, bandwidth, at_req["dense"],
                      at_req["sparse"]),
        }  # fmt: skip
    stages = stage_ms(engine, block_table, last, schedule, sampling, timer)
    row["stages_at_cached_len"] = last
    for arm in ("dense", "sparse"):
        row[f"{arm}_step_breakdown"] = step_breakdown(stages, steps_ms[arm], shape, engine.dense_layers, arm)
    row["minmax"] = minmax_stages(stages, steps_ms["sparse"], shape, engine.dense_layers)
    engine._cache = None  # the random cache is no one's: generate() sizes its own
    for arm, sched in (("dense", dense), ("sparse", schedule)) if e2e_regions else ():
        try:
            check = e2e_check(engine, batch, prompt, args.e2e_tokens, sched, sampling)
        except RuntimeError as exc:
            traceback.print_exc()
            row[f"{arm}_e2e"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            continue
        model_s, capture_s = e2e_model[arm]
        row[f"{arm}_e2e"] = {
            **check,
            "model_decode_s": model_s,
            "capture_s": capture_s,  # one eager step + graph capture per generate() wave
            "e2e_over_model": check["e2e_decode_s"] / (model_s + capture_s),
        }
    return row


def target_lines(row: dict, tag: str) -> list[str]:
    """The issue's targets for one row (or its ``extrapolated`` part), as PASS/FAIL lines."""
    lines = []
    paper = row["paper_speedup"]
    if paper is not None:
        ok = row["speedup"] > paper
        lines.append(f"{'PASS' if ok else 'FAIL'} {tag}: speedup {row['speedup']:.2f}x vs paper {paper:.2f}x")
    frac = row["fraction_of_memory_bound_limit"]
    lines.append(
        f"{'PASS' if frac >= 0.8 else 'FAIL'} {tag}: {frac:.0%} of the memory-bound limit "
        f"{row['memory_bound_speedup_limit']:.2f}x (>= 80%)"
    )
    ratio = row["dense_vs_memory_bound"]
    lines.append(
        f"{'PASS' if ratio <= 1.5 else 'FAIL'} {tag}: dense {row['dense_tok_s']:.0f} tok/s, "
        f"{ratio:.2f}x below the dense memory-bound {row['dense_memory_bound_tok_s']:.0f} tok/s (<= 1.5x)"
    )
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", help="cuda, or cpu (Triton interpreter; use with --tiny)")
    p.add_argument("--tiny", action="store_true", help="tiny shape and short context: a CPU smoke run")
    p.add_argument("--models", nargs="+", default=["qwen3-1.7b", "qwen3-8b", "qwen3-4b", "qwen3-14b"])
    p.add_argument("--batches", type=int, nargs="+", default=None, help="default 64 128 (tiny: 2)")
    p.add_argument("--max-batch", type=int, default=None, help="cap on the batch actually run (tests)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen-lens", type=int, nargs="+", default=[32768, 16384])
    p.add_argument("--dense-layers", type=int, default=2, help="leading dense layers (the paper: 2)")
    p.add_argument("--threshold", default="0.86", help="preset suffix: qwen3-<size>-<threshold>")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy; RL samples at 1.0")
    p.add_argument("--steps-per-window", type=int, default=4, help="timed steps per measurement window")
    p.add_argument(
        "--e2e-tokens", type=int, default=256, help="tokens of the engine.generate check (0 = skip)"
    )
    p.add_argument(
        "--no-extrapolate", dest="extrapolate", action="store_false",
        help="do not estimate the requested batch from two smaller measured batches when it does not fit",
    )  # fmt: skip
    p.add_argument(
        "--headroom-gib", type=float, default=8.0, help="GPU memory kept free besides the KV cache"
    )
    p.add_argument("--time-budget-s", type=float, default=390.0, help="start no configuration after this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="JSON lines file to append to")
    args = p.parse_args(argv)
    if args.tiny:
        args.models, args.prompt_len, args.gen_lens = ["tiny-test"], 16, [80]
        args.steps_per_window, args.e2e_tokens, args.dense_layers = 1, min(args.e2e_tokens, 4), 1
    args.batches = args.batches or ([2] if args.tiny else [64, 128])
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before sparrow_kernels is imported
        torch.set_num_threads(1)
    import sparrow_kernels as sk

    if not sk.available(device):
        raise SystemExit(f"sparrow_kernels cannot run on {device} (CPU needs TRITON_INTERPRET=1 at import)")
    started = time.perf_counter()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    timer = make_timer(device, 20 if device.type == "cuda" else 1)
    bandwidth = copy_bandwidth(device, (2 << 30) if device.type == "cuda" else (16 << 20), timer)
    env = environment(sk, device)
    out = args.out or RESULTS / ("rollout_speedup_tiny.jsonl" if args.tiny else "rollout_speedup.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    sampling = SamplingParams(max_new_tokens=1, temperature=args.temperature, stop_token_ids=())
    rows, skipped = [], []
    print(f"{env['gpu']} driver {env['driver']} torch {env['torch']} triton {env['triton']}; copy "
          f"{bandwidth / 1e9:.0f} GB/s; {METHOD}", flush=True)  # fmt: skip
    for name in args.models:
        shape = get_shape(name)
        schedule = TINY_SCHEDULE if args.tiny else BudgetSchedule.from_preset(f"{name}-{args.threshold}")
        if time.perf_counter() - started > args.time_budget_s:
            skipped.append(f"{name}: time budget")
            continue
        engine = TorchRolloutEngine(
            random_decoder(shape, dtype, device, args.seed),
            dense_layers=args.dense_layers,
            attention_backend="triton",
        )
        per_token = cache_bytes_per_token(shape, torch.finfo(dtype).bits // 8, engine.page_size)
        for gen in args.gen_lens:
            done: set[int] = set()
            for want in args.batches:
                if time.perf_counter() - started > args.time_budget_s:
                    skipped.append(f"{name} gen {gen} batch {want}: time budget")
                    continue
                engine._cache = None
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                headroom = int(args.headroom_gib * 2**30)
                batch = fit_batch(want, args.prompt_len + gen, per_token, device, headroom)
                batch = min(batch, args.max_batch or batch)
                if batch in done or batch == 0:
                    skipped.append(f"{name} gen {gen} batch {want}: fits only {batch}")
                    continue
                done.add(batch)
                t0 = time.perf_counter()
                try:
                    row = run_config(engine, name, want, batch, args.prompt_len, gen, schedule, sampling, args,
                                     timer, bandwidth)  # fmt: skip
                except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:  # keep the other configurations
                    traceback.print_exc()
                    skipped.append(f"{name} gen {gen} batch {batch}: {type(exc).__name__}: {exc}"[:300])
                    engine._cache = None
                    continue
                row.update(env, copy_bandwidth_GBps=bandwidth / 1e9, wall_s=time.perf_counter() - t0)
                rows.append(row)
                with out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(f"{name} b{batch}/{want} gen {gen}: dense {row['dense_tok_s']:.0f} tok/s, sparse "
                      f"{row['sparse_tok_s']:.0f} tok/s, speedup {row['speedup']:.2f}x (cost model "
                      f"{row['cost_model_predicted_speedup']:.2f}x, memory-bound limit "
                      f"{row['memory_bound_speedup_limit']:.2f}x) [{row['wall_s']:.0f}s]", flush=True)  # fmt: skip
                lines = target_lines(row, f"{name} b{batch} gen {gen}")
                if "extrapolated" in row:
                    lines += target_lines(row["extrapolated"], f"{name} b{want} (extrapolated) gen {gen}")
                for line in [] if args.tiny else lines:
                    print("  " + line, flush=True)
        engine._cache = None
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for s in skipped:
        print(f"skipped {s}")
    print(f"wrote {len(rows)} lines to {out} in {time.perf_counter() - started:.0f}s")
    return rows


if __name__ == "__main__":
    main()
