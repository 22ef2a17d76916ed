"""Is a recipe's sparse tail limited by the page ranking or by the model? Teacher-forced tails per ranking
and per set of sparse layers.

Samples ``--prompts`` held-out problems densely from the recipe's warm-start (the engine, the recipe's
sampling), then re-runs each sequence teacher-forced with sparse attention, every decode position choosing
its pages by the sparse rule (:func:`sparrow_nemo.sparse.attention.select_pages_from_scores`: sink, local,
top-k middle pages per KV head) in the layers ``--sparse-layers`` and attending densely in the others. The
keys and values each layer writes come from that sparse forward, as in a sparse rollout. Rankings:

- ``minmax``: the recipe's, Quest's key-bound score of the GQA group's mean query
  (:func:`~sparrow_nemo.sparse.attention.key_bound_scores`);
- ``centroid``: the paper's, the group's mean query . the page's mean key;
- ``keymax``: each query head's largest logit in the page, as a share of an attention over the pages' largest
  logits, summed over the group's heads (:func:`key_max_scores`): what a scorer reading every key exactly would
  choose (no decode step reads them all; a compressed copy of the keys could approximate it);
- ``oracle``: the pages holding the most of this layer's softmax attention mass (summed over the group's
  query heads): the best page choice a ranking can make for the layer, which no decode step can afford.

Per (ranking, sparse layers, budget) it prints p1 and p5 of alpha (the exact acceptance rate
sum_v min(p_dense, p_sparse)) per bin of cached length, and appends one JSON line with them, the tokens per
bin, the machine and the date to ``benchmarks/results/page_choice_oracle.jsonl``. If ``oracle`` does no
better than the recipe's ranking at a budget, no ranking can: the model's attention itself is too spread.
Per (ranking, sparse layers) it also prints the schedule the recipe's calibration rule (``sparsity.threshold``,
``quantile``, ``min_bin_tokens``) would choose from these tails (``calibrated`` in the rows): timed with
``decode_profile.py`` (the time of a budget does not depend on which pages fill it), the oracle's schedule
bounds the speedup any page ranking can buy under the rule.

The forward builds [S, S] masks per layer: an analysis tool for the tiny recipes (sequences up to
``MAX_TOKENS``), not a rollout path.

Example (docs/METHOD.md, "Which layers stay dense"; ~3 min on one core):
    python benchmarks/page_choice_oracle.py --prompts 24 --budgets 128 192 256 \
        --rankings minmax oracle --sparse-layers 0,1,2,3 1,2,3 0 1 2 3
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rollout_throughput import machine_info

from sparrow_nemo.grpo.recipe import SparrowConfig, load_config
from sparrow_nemo.rollout.torch.qwen3 import Qwen3Decoder
from sparrow_nemo.sparse.attention import (
    group_mean_query,
    key_bound_scores,
    page_centroids,
    page_key_bounds,
    select_pages_from_scores,
    selected_token_mask,
)
from sparrow_nemo.sparse.calibration import calibrate_schedule
from sparrow_nemo.sparse.mismatch import acceptance_rate, binned_quantiles, tail_name
from sparrow_nemo.sparse.pattern import SparsePattern

RESULTS = Path(__file__).resolve().parent / "results" / "page_choice_oracle.jsonl"
RANKINGS = ("minmax", "centroid", "keymax", "oracle")
#: longest sequence the [S, S] forward takes (the tiny recipes' responses end below 2,300 tokens)
MAX_TOKENS = 4096
QUANTILES = (0.01, 0.05)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="recipe (name or YAML path; default: the default recipe)")
    p.add_argument("--prompts", type=int, default=24, help="held-out problems, one dense sample each")
    p.add_argument("--budgets", type=int, nargs="+", default=[128, 192, 256], help="KV budgets, tokens")
    p.add_argument("--rankings", nargs="+", default=["minmax", "oracle"], choices=RANKINGS)
    p.add_argument(
        "--sparse-layers",
        nargs="+",
        default=["all"],
        help="each a comma list of the layers that attend sparsely ('all' = every layer), one pass each",
    )
    p.add_argument("--out", type=Path, default=RESULTS, help="JSONL file to append to")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="recipe overrides")
    return p.parse_args(argv)


def layer_sets(specs: list[str], num_layers: int) -> list[tuple[int, ...]]:
    """'all' or '1,2,3' -> sorted layer tuples; a layer outside the model is a ValueError naming it."""
    sets = []
    for spec in specs:
        layers = (
            tuple(range(num_layers)) if spec == "all" else tuple(sorted({int(x) for x in spec.split(",")}))
        )
        bad = [i for i in layers if not 0 <= i < num_layers]
        if bad:
            raise ValueError(
                f"--sparse-layers {spec!r}: layer(s) {bad} outside the model's 0..{num_layers - 1}"
            )
        sets.append(layers)
    return sets


def page_scores(
    ranking: str, q: torch.Tensor, k: torch.Tensor, probs: torch.Tensor, page_size: int
) -> torch.Tensor:
    """Every position's score of every page: q [S, Hq, D], k [S, Hkv, D], probs [Hq, S, S] (this layer's dense
    attention, for ``oracle``) -> [S, Hkv, P] float32."""
    seq, num_kv = k.shape[0], k.shape[1]
    if ranking == "oracle":
        num_pages = -(-seq // page_size)
        mass = torch.nn.functional.pad(probs, (0, num_pages * page_size - seq))
        mass = mass.view(num_kv, -1, seq, num_pages, page_size).sum(dim=(1, 4))  # [Hkv, S, P]
        return mass.permute(1, 0, 2)
    if ranking == "keymax":
        return key_max_scores(q, k, page_size)
    keys = k.permute(1, 0, 2)[None]  # [1, Hkv, S, D]: the whole sequence's pages, scored by every position
    full = torch.tensor([seq])
    q_mean = group_mean_query(q, num_kv)  # [S, Hkv, D]
    if ranking == "minmax":
        k_min, k_max = page_key_bounds(keys, full, page_size)
        return key_bound_scores(q_mean, k_min.expand(seq, -1, -1, -1), k_max.expand(seq, -1, -1, -1))
    centroids = page_centroids(keys, full, page_size)[0]  # [Hkv, P, D]
    return torch.einsum("shd,hpd->shp", q_mean, centroids.float())


def key_max_scores(q: torch.Tensor, k: torch.Tensor, page_size: int) -> torch.Tensor:
    """The ``keymax`` score: q [S, Hq, D], k [S, Hkv, D] -> [S, Hkv, P] float32.

    For position s and query head h, m[h, p] = max over the keys t <= s of page p of q_h . k_t / sqrt(D) (a page
    wholly after s: -inf); the page's score is log sum over the group's heads h of softmax_p(m[h, :])[p], the
    group's summed share of an attention over the page maxima, so that every head's best page ranks high
    whatever the scale of its logits."""
    seq, num_kv, d = k.shape
    group, num_pages = q.shape[1] // num_kv, -(-seq // page_size)
    logits = torch.einsum("shgd,thd->shgt", q.float().view(seq, num_kv, group, d), k.float()) / math.sqrt(d)
    future = torch.ones(seq, seq, dtype=torch.bool).triu(1)[:, None, None]  # key t after position s
    logits = logits.masked_fill(future, -math.inf)
    logits = torch.nn.functional.pad(logits, (0, num_pages * page_size - seq), value=-math.inf)
    page_max = logits.view(seq, num_kv, group, num_pages, page_size).amax(-1)  # [S, Hkv, G, P]
    return torch.logsumexp(torch.log_softmax(page_max, -1), dim=2)


def teacher_forced_logprobs(
    model: Qwen3Decoder,
    ids: list[int],
    ranking: str | None,
    sparse_layers: tuple[int, ...],
    budget: int,
    pattern: SparsePattern,
) -> torch.Tensor:
    """[S, V] next-token log-probs of ``ids`` with the sparse rule in ``sparse_layers`` (``ranking`` None: dense).

    Position t decodes with t + 1 cached tokens; a page that position t's rule would see as a middle page is
    complete at t, so scoring the whole sequence's pages once and masking per position is the decode rule."""
    shape = model.shape
    seq, group = len(ids), shape.num_attention_heads // shape.num_key_value_heads
    positions = torch.arange(seq)
    rope = model.rope(positions, model.dtype)
    h = model.embed(torch.tensor(ids))
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    cached = positions + 1
    for layer in range(shape.num_layers):
        q, k, v = model.attention_inputs(layer, h, positions, rope)  # [S, H, D]
        logits = (q.permute(1, 0, 2) @ k.permute(1, 2, 0).repeat_interleave(group, 0)) / math.sqrt(
            shape.head_dim
        )  # [Hq, S, S]
        mask = causal
        if ranking is not None and layer in sparse_layers:
            probs = torch.softmax(logits.masked_fill(~causal, -math.inf), -1)
            scores = page_scores(ranking, q, k, probs, pattern.page_size)
            pages = select_pages_from_scores(
                scores, cached, budget, pattern.page_size, pattern.sink_pages, pattern.local_pages
            )
            kept = selected_token_mask(pages, cached, seq, pattern.page_size)  # [S, Hkv, S]
            mask = causal & kept.permute(1, 0, 2).repeat_interleave(group, 0)
        weights = torch.softmax(logits.masked_fill(~mask, -math.inf), -1)
        attn = weights @ v.permute(1, 0, 2).repeat_interleave(group, 0)  # [Hq, S, D]
        h = model.attention_output(layer, h, attn.permute(1, 0, 2).contiguous())
    return torch.log_softmax(model.logits(h), -1)


def dense_samples(config: SparrowConfig, count: int) -> tuple[Qwen3Decoder, list[tuple[int, list[int]]]]:
    """The recipe's start weights (its warm-start) and ``count`` dense samples of its first held-out problems:
    (prompt length, prompt + response ids) each."""
    from sparrow_nemo.grpo import setup
    from sparrow_nemo.grpo.prompts import build_prompt_source
    from sparrow_nemo.grpo.start import start_weights
    from sparrow_nemo.sparse.schedule import BudgetSchedule

    source = build_prompt_source(config)
    model = Qwen3Decoder(config.model.shape(), start_weights(config, source, show_progress=False))
    engine = setup.build_engine(config, model.params, source.tokenizer)
    items = source.eval_batch(count)
    s = config.sparsity
    batch = engine.generate(
        [i.prompt_ids for i in items],
        setup.sampling_params(config),
        BudgetSchedule.dense(s.bin_tokens, s.page_size),
        sample_seeds=list(range(len(items))),
    )
    samples = [(len(x.prompt_ids), list(x.prompt_ids) + list(x.response_ids)) for x in batch.samples]
    too_long = [len(ids) for _, ids in samples if len(ids) > MAX_TOKENS]
    if too_long:
        raise ValueError(f"a sample of {max(too_long)} tokens exceeds the probe's MAX_TOKENS={MAX_TOKENS}")
    return model, samples


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    torch.set_num_threads(1)
    config = load_config(args.config, args.overrides)
    s = config.sparsity
    load_start = os.getloadavg()[0]
    model, samples = dense_samples(config, args.prompts)
    sets = layer_sets(args.sparse_layers, model.shape.num_layers)
    runs = [(r, layers, b) for r in args.rankings for layers in sets for b in args.budgets]
    alphas: dict[tuple, list[torch.Tensor]] = {run: [] for run in runs}
    cached: list[torch.Tensor] = []
    start = time.perf_counter()
    with torch.no_grad():
        for n, (prompt_len, ids) in enumerate(samples, 1):
            dense = teacher_forced_logprobs(model, ids, None, (), 0, s)[prompt_len:-1]
            cached.append(torch.arange(prompt_len, len(ids) - 1) + 1)
            for ranking, layers, budget in runs:
                sparse = teacher_forced_logprobs(model, ids, ranking, layers, budget, s)[prompt_len:-1]
                alphas[(ranking, layers, budget)].append(acceptance_rate(dense, sparse))
            rate = n / (time.perf_counter() - start)
            print(
                f"\rsequence {n}/{len(samples)} ({rate:.2f}/s, ETA {(len(samples) - n) / rate:.0f} s)", end=""
            )
    print()
    cached_len = torch.cat(cached)
    bins = cached_len // s.bin_tokens
    calibrated = {
        (ranking, layers): calibrate_schedule(
            {b: (torch.cat(alphas[(ranking, layers, b)]), cached_len) for b in args.budgets},
            threshold=s.threshold,
            bin_tokens=s.bin_tokens,
            quantile=s.quantile,
            page_size=s.page_size,
            min_tokens=s.min_bin_tokens,
            name=f"{ranking}-calibrated",
        ).schedule
        for ranking in args.rankings
        for layers in sets
    }
    rows = []
    for ranking, layers, budget in runs:
        bin_ids, counts, table = binned_quantiles(
            torch.cat(alphas[(ranking, layers, budget)]), bins, QUANTILES
        )
        rows.append(
            {
                "benchmark": "page_choice_oracle",
                "recipe": config.name,
                "overrides": args.overrides,
                "prompts": len(samples),
                "ranking": ranking,
                "sparse_layers": list(layers),
                "budget": budget,
                "calibrated": calibrated[(ranking, layers)].to_dict(),
                "bin_tokens": s.bin_tokens,
                "tokens_per_bin": dict(zip(map(str, bin_ids.tolist()), counts.tolist(), strict=True)),
                **{
                    f"p{round(100 * q)}": dict(
                        zip(map(str, bin_ids.tolist()), table[i].tolist(), strict=True)
                    )
                    for i, q in enumerate(QUANTILES)
                },
                **machine_info("cpu"),
                "load_avg_1m_start": load_start,
                "load_avg_1m": os.getloadavg()[0],
            }
        )
    print_table(rows)
    print(
        f"\nschedules the calibration rule picks ({tail_name(s.quantile)} >= {s.threshold:g} per bin, budgets)"
    )
    for (ranking, layers), schedule in calibrated.items():
        budgets = " ".join(str(b) for b in schedule.to_dict()["budgets"])
        print(f"{ranking:8} {','.join(map(str, layers)):14} {budgets}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return rows


def print_table(rows: list[dict]) -> None:
    """p1 / p5 per bin for every run (bins with fewer than 100 tokens: '-')."""
    bins = sorted({int(b) for row in rows for b in row["tokens_per_bin"]})
    for name in ("p1", "p5"):
        print(f"\n{name} of alpha per bin of {rows[0]['bin_tokens']} cached tokens")
        print(f"{'ranking':8} {'sparse layers':14} {'budget':>6} " + " ".join(f"{b:>6}" for b in bins))
        for row in rows:
            cells = [
                f"{row[name][str(b)]:6.3f}" if row["tokens_per_bin"].get(str(b), 0) >= 100 else "     -"
                for b in bins
            ]
            layers = ",".join(map(str, row["sparse_layers"]))
            print(f"{row['ranking']:8} {layers:14} {row['budget']:6} " + " ".join(cells))
    print("tokens per bin:", rows[0]["tokens_per_bin"])


if __name__ == "__main__":
    main()
