"""Where rollout time goes, dense and under a schedule, and the most a sparse schedule can then buy.

The recipe's engine generates its held-out prompts under dense and under the schedule in ABBA order (as
``schedule_ab.py``, whose options it takes), its attention backend wrapped in a timer (``append`` + ``attend``
per layer, wall seconds). Per arm, per generated token: the attention of each layer and the rest (embedding,
projections, norms, MLP, LM head, sampling, bookkeeping, prefill). With ``T`` the dense arm's time per token,
``S`` its sparse layers' attention (the layers from ``sparsity.dense_layers`` on) and ``F`` the schedule arm's
time outside its sparse layers (its dense layers' attention and its rest: less than the dense arm's, since
streaming the whole cache also evicts the weights and activations), a schedule whose sparse layers take a
fraction ``r`` of their dense attention time runs

    speedup(r) = T / (F + r * S)

faster than dense (Amdahl). It prints the measured ``r`` and speedup, ``speedup(0)`` (free sparse attention: the
ceiling of any schedule on this model, task and machine) and the ``r`` a ``--target`` speedup needs. One JSON
line goes to ``benchmarks/results/decode_profile.jsonl``. The timer reads the host clock around each call; on a
GPU the numbers would need a synchronise per call (not done: it is the CPU engine's profile).

Example (docs/results.md: the default run's final schedule on its warm-start, ~3 min):
    python benchmarks/decode_profile.py --repeats 2 control.calibrate=false \
        "sparsity.budgets=[192,192,192,256,512,2147483647]"
"""

from __future__ import annotations

import os
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rollout_throughput import machine_info
from schedule_ab import alternate, append_row, check_counts, parser, prepare

from sparrow_nemo.rollout.torch.decode_step import DecodeAttention
from sparrow_nemo.rollout.torch.paged_cache import PagedKVCache

RESULTS = Path(__file__).resolve().parent / "results" / "decode_profile.jsonl"


class TimedAttention:
    """A decode-attention backend that passes every call to ``inner`` and adds its wall seconds to
    ``seconds[layer]`` (the key/value append and the attention together)."""

    def __init__(self, inner: DecodeAttention) -> None:
        self.inner = inner
        self.seconds: defaultdict[int, float] = defaultdict(float)

    @contextmanager
    def _timed(self, layer: int) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.seconds[layer] += time.perf_counter() - start

    def append(self, cache: PagedKVCache, layer: int, *args: torch.Tensor) -> None:
        with self._timed(layer):
            self.inner.append(cache, layer, *args)

    def attend(self, q: torch.Tensor, cache: PagedKVCache, layer: int, *args) -> torch.Tensor:
        with self._timed(layer):
            return self.inner.attend(q, cache, layer, *args)


def amdahl(total: float, fixed: float, sparse: float, r: float) -> float:
    """``speedup(r) = total / (fixed + r * sparse)`` (any one time unit): ``total`` the dense time, ``fixed`` the
    schedule's time outside its sparse layers, ``sparse`` the dense time of those layers' attention."""
    return total / (fixed + r * sparse)


def needed_r(total: float, fixed: float, sparse: float, target: float) -> float:
    """The ``r`` with ``amdahl(total, fixed, sparse, r) == target`` (negative: out of reach even at r = 0)."""
    return (total / target - fixed) / sparse


def split(per_layer: dict[int, float], wall: float, tokens: int, dense_layers: int) -> dict[str, float]:
    """One arm's time per generated token (microseconds): ``rest``, ``dense`` (attention of the layers below
    ``dense_layers``), ``sparse`` (the others') and ``total``."""
    us = 1e6 / tokens
    dense = sum(s for layer, s in per_layer.items() if layer < dense_layers)
    sparse = sum(s for layer, s in per_layer.items() if layer >= dense_layers)
    return {
        "total": wall * us,
        "rest": (wall - dense - sparse) * us,
        "dense": dense * us,
        "sparse": sparse * us,
    }


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__, RESULTS)
    p.add_argument("--target", type=float, default=1.5, help="speedup whose needed r is printed")
    args = check_counts(p, p.parse_args(argv))
    arms = prepare(args)
    step = arms.engine.decode_step
    timer = step.attention = TimedAttention(step.attention)
    dense_layers = step.dense_layers
    load_start = os.getloadavg()[0]
    totals = {arm: {"tokens": 0, "wall": 0.0, "layers": defaultdict(float)} for arm in arms.schedules}
    for pair, arm, tokens, seconds in alternate(arms, args.repeats):
        acc = totals[arm]
        acc["tokens"] += tokens
        acc["wall"] += seconds
        for layer, s in timer.seconds.items():
            acc["layers"][layer] += s
        timer.seconds.clear()
        print(f"pair {pair} {arm}: {tokens / seconds:,.0f} tok/s", flush=True)
    per_token = {
        arm: split(acc["layers"], acc["wall"], acc["tokens"], dense_layers) for arm, acc in totals.items()
    }
    d, s = per_token["dense"], per_token["sparse"]
    r = s["sparse"] / d["sparse"]
    parts = (d["total"], s["rest"] + s["dense"], d["sparse"])
    row = {
        "benchmark": "decode_profile",
        "recipe": arms.config.name,
        "overrides": args.overrides,
        "schedule": arms.schedules["sparse"].to_dict(),
        "dense_layers": dense_layers,
        "prompts": len(arms.prompts),
        "repeats": args.repeats,
        "us_per_token": per_token,
        "layer_seconds": {arm: dict(sorted(acc["layers"].items())) for arm, acc in totals.items()},
        "tokens": {arm: acc["tokens"] for arm, acc in totals.items()},
        "measured_speedup": d["total"] / s["total"],
        "sparse_attention_ratio": r,
        "ceiling_speedup": amdahl(*parts, 0.0),
        "target": args.target,
        "needed_ratio": needed_r(*parts, args.target),
        **machine_info("cpu"),
        "load_avg_1m_start": load_start,
        "load_avg_1m": os.getloadavg()[0],
    }
    total = d["total"]
    print(
        f"dense, per token: rest {d['rest'] / total:.0%}, dense layers' attention {d['dense'] / total:.0%}, "
        f"sparse layers' attention {d['sparse'] / total:.0%} of {total:.1f} us; the schedule: "
        f"{s['rest'] + s['dense']:.1f} us outside its sparse layers"
    )
    print(
        f"sparse layers' attention at {r:.2f} of dense: {row['measured_speedup']:.2f}x; ceiling (r = 0) "
        f"{row['ceiling_speedup']:.2f}x; {args.target:g}x needs r <= {row['needed_ratio']:.2f}"
    )
    append_row(args.out, row)
    return row


if __name__ == "__main__":
    main()
