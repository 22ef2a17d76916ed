"""Probe a chain-task checkpoint on haystack problems: is the look-up learned, and can page selection find it?

    python scripts/haystack_probe.py CHECKPOINT --filler 0 600 1000 --problems 48

For each filler length (task.filler_tokens = [n, n]; the other task knobs as given), teacher-forced with the
dense model (every token of the reference trace given):

- ``accuracy``: top-1 accuracy of the trace's looked-up successor, its digit and the running sum (per hop), and
  the share of traces whose every token is top-1 (greedy decoding would write the whole trace);
- ``pages`` (with ``--pages``): per layer and KV head, the largest attention weight a query head of its group
  puts on the needed key (the successor's table position, where an induction head reads), and the rank of that
  key's page among the non-reserved pages (not the sink page, not the two local pages) under three page scores:
  ``centroid`` = the group-mean query . the page's mean key (``sparsity.page_score=centroid``, the paper's rule),
  ``bound`` = ``sparrow_nemo.sparse.attention.key_bound_scores`` of the group-mean query over the page's
  per-channel key bounds (``page_key_bounds``; ``sparsity.page_score=minmax``, after Quest) and ``key_max`` = the
  largest q . k over the page's keys and the group's query heads (what ``bound`` bounds from above, for one query
  head at a time). ``top`` = the share of hops whose page ranks below k, for k in ``TOP_K``.

Prints one JSON line per filler length. Runs one torch thread; the page probe builds [heads, T, T] scores per
layer (~50 MB at 1.5K tokens).
"""

from __future__ import annotations

import argparse
import json
import math
import re

import torch

from sparrow_nemo.rollout.torch.engine import TorchRolloutEngine
from sparrow_nemo.rollout.torch.qwen3 import Qwen3Decoder
from sparrow_nemo.sparse.attention import group_mean_query, key_bound_scores, page_key_bounds
from sparrow_nemo.tasks.chain import ChainProblem, ChainTask, ChainTaskConfig
from sparrow_nemo.tasks.tokenizer import CharTokenizer

#: the page scores compared, in the order each entry lists them
SCORES = ("centroid", "bound", "key_max")
#: page ranks reported: top-1, top-4 and top-21 (a 384-token budget of 16-token pages: 1 sink + 2 local + 21)
TOP_K = (1, 4, 8, 21)
_HOP = re.compile(r"([A-Z])([a-z])(\d)=(\d)")


def trace_accuracy(engine: TorchRolloutEngine, problems: list[ChainProblem]) -> dict[str, float]:
    """Teacher-forced top-1 accuracy of each hop's successor / digit / running sum, and the share of traces
    whose every token (eos included) is top-1."""
    tok = CharTokenizer()
    seqs = [tok.encode(p.prompt, True) + tok.encode(p.trace) + [tok.eos_token_id] for p in problems]
    hits = {"successor": [], "digit": [], "sum": []}
    exact = 0
    for p, scored in zip(problems, engine.score(seqs, topk=1)):
        top = scored.top_ids[len(p.prompt) :, 0]  # top[j] predicts trace character j (bos shifts by one)
        want = torch.tensor([*tok.encode(p.trace), tok.eos_token_id])
        for m in _HOP.finditer(p.trace):
            for key, group in (("successor", 2), ("digit", 3), ("sum", 4)):
                hits[key].append(bool(top[m.start(group)] == want[m.start(group)]))
        exact += bool((top == want).all())
    return {k: sum(v) / len(v) for k, v in hits.items()} | {"greedy_exact": exact / len(problems)}


def _needed(p: ChainProblem) -> tuple[list[int], list[int]]:
    """(query positions, needed key positions) of a problem's hops, in token positions (bos = 0)."""
    table = p.prompt[: p.prompt.index(")")]
    queries, keys = [], []
    for m in _HOP.finditer(p.trace):
        queries.append(1 + len(p.prompt) + m.start(1))  # the node in the trace: it predicts the successor
        keys.append(1 + table.index(m.group(1)) + 1)  # the successor after the node's only table occurrence
    return queries, keys


def page_ranks(model: Qwen3Decoder, problems: list[ChainProblem], page_size: int) -> dict[str, dict]:
    """Per ``"layer/kv_head"``: the mean over hops of the largest query-head weight on the needed key, and for
    each page score the share of hops whose needed page ranks in the top k (k in :data:`TOP_K`)."""
    s, tok = model.shape, CharTokenizer()
    group = s.num_attention_heads // s.num_key_value_heads
    acc: dict[tuple[int, int], dict[str, list]] = {}
    for p in problems:
        ids = torch.tensor(tok.encode(p.prompt, True) + tok.encode(p.trace))
        T, pages = len(ids), math.ceil(len(ids) / page_size)
        positions = torch.arange(T)
        queries, keys = _needed(p)
        h = model.embed(ids)
        rope = model.rope(positions, h.dtype)
        causal = torch.ones(T, T, dtype=torch.bool).triu(1)
        for layer in range(s.num_layers):
            q, k, v = model.attention_inputs(layer, h, positions, rope)  # [T, Hq | Hkv, D]
            kq, vq = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            w = (torch.einsum("thd,shd->hts", q, kq) / math.sqrt(s.head_dim)).masked_fill(causal, -math.inf)
            w = w.softmax(-1)  # [Hq, T, T]
            padded = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, pages * page_size - T))
            paged = padded.view(pages, page_size, s.num_key_value_heads, s.head_dim)
            filled = torch.tensor([min(page_size, T - i * page_size) for i in range(pages)])
            centroids = paged.sum(1) / filled[:, None, None]  # [pages, Hkv, D]
            k_min, k_max = page_key_bounds(k.transpose(0, 1)[None], torch.tensor([T]), page_size)
            q_mean = group_mean_query(q[queries], s.num_key_value_heads)  # [hops, Hkv, D]
            hops = (len(queries), -1, -1, -1)
            bounds = key_bound_scores(q_mean, k_min.expand(hops), k_max.expand(hops))  # [hops, Hkv, pages]
            for kv in range(s.num_key_value_heads):
                heads = slice(kv * group, (kv + 1) * group)
                entry = acc.setdefault((layer, kv), {"weight": [], **{name: [] for name in SCORES}})
                for hop, (qi, ki) in enumerate(zip(queries, keys)):
                    live = qi // page_size + 1
                    candidates = torch.arange(1, max(1, live - 2))  # not the sink, not the 2 local pages
                    if ki // page_size not in candidates:
                        continue
                    entry["weight"].append(float(w[heads, qi, ki].max()))
                    qg = q[qi, heads]  # [G, D]
                    scores = {
                        "centroid": centroids[candidates, kv] @ qg.mean(0),
                        "bound": bounds[hop, kv, candidates],
                        "key_max": torch.stack(
                            [(paged[c, : filled[c], kv] @ qg.T).max() for c in candidates.tolist()]
                        ),
                    }
                    target = int((candidates == ki // page_size).nonzero())
                    for name, score in scores.items():
                        entry[name].append(int((score > score[target]).sum()))
            h = model.attention_output(layer, h, torch.einsum("hts,shd->thd", w, vq))
    out = {}
    for (layer, kv), entry in sorted(acc.items()):
        n = max(1, len(entry["weight"]))
        out[f"{layer}/{kv}"] = {
            "hops": len(entry["weight"]),
            "weight_on_needed_key": sum(entry["weight"]) / n,
        } | {name: {f"top{k}": sum(r < k for r in entry[name]) / n for k in TOP_K} for name in SCORES}
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkpoint", help="HF checkpoint folder (e.g. a cached or shipped warm-start)")
    parser.add_argument("--filler", type=int, nargs="+", default=[0, 600, 1000], help="filler lengths")
    parser.add_argument("--problems", type=int, default=48, help="held-out problems per filler length")
    parser.add_argument("--num-nodes", type=int, nargs=2, default=[22, 26])
    parser.add_argument("--num-hops", type=int, nargs=2, default=[20, 25])
    parser.add_argument("--seed", type=int, default=777, help="task seed (the warm-start trains on seed 0)")
    parser.add_argument("--pages", action="store_true", help="also the page probe (slower)")
    parser.add_argument("--page-size", type=int, default=16)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model = Qwen3Decoder.from_hf_dir(args.checkpoint)
    engine = TorchRolloutEngine(model, page_size=args.page_size, dense_layers=model.shape.num_layers)
    lines = []
    for filler in args.filler:
        config = ChainTaskConfig(
            num_nodes=tuple(args.num_nodes),
            num_hops=tuple(args.num_hops),
            filler_tokens=(filler, filler),
            seed=args.seed,
        )
        problems = ChainTask(config).problems(args.problems)
        line = {"filler": filler, "problems": len(problems), "accuracy": trace_accuracy(engine, problems)}
        if args.pages:
            line["pages"] = page_ranks(model, problems, args.page_size)
        print(json.dumps(line), flush=True)
        lines.append(line)
    return lines


if __name__ == "__main__":
    main()
