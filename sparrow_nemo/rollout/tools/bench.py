"""``sparrow bench rollout``: decode throughput of dense vs sparse schedules, and the mismatch they cost.

Two measurements on one engine (random weights unless a checkpoint dir is given):

- :func:`decode_throughput`: decode tokens/s at fixed cached lengths (e.g. 512 / 1K / 2K / 4K), dense
  and sparse, each next to the memory-bound limit of dense decode: the bytes one dense step must read
  (every layer's keys and values of every row, plus the weights) over the machine's copy bandwidth,
  measured in the same run. The cache is filled with random keys and values (no prefill), so the rows
  time the decode step alone (embeddings, layers, attention, LM head, sampling).
- :func:`bench_rollout`: a batch of random prompts generated with EOS ignored, once densely and once per
  schedule; tokens/s and, from the rollout re-scored densely
  (:func:`sparrow_nemo.rollout.scoring.measure_mismatch`), the acceptance-rate summary of
  ``sparrow_nemo.sparse.mismatch.summarize`` (mean, p5 per bin of cached length).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from sparrow_nemo.model_shapes import Qwen3Shape, get_shape
from sparrow_nemo.rollout.engine import SamplingParams
from sparrow_nemo.rollout.scoring import measure_mismatch
from sparrow_nemo.rollout.torch.block_manager import BlockManager
from sparrow_nemo.rollout.torch.cuda_graphs import DecodeGraphs
from sparrow_nemo.rollout.torch.engine import TorchRolloutEngine
from sparrow_nemo.rollout.torch.generation import now_fn
from sparrow_nemo.rollout.torch.paged_cache import fill_block_table
from sparrow_nemo.sparse.mismatch import summarize
from sparrow_nemo.sparse.schedule import BudgetSchedule


def _as_schedule(spec: str | BudgetSchedule) -> BudgetSchedule:
    """A schedule object, a ``*.yaml``/``*.yml`` schedule file, or a preset name."""
    if isinstance(spec, BudgetSchedule):
        return spec
    if spec.endswith((".yaml", ".yml")):
        if not Path(spec).is_file():
            raise FileNotFoundError(f"schedule file {spec} not found")
        return BudgetSchedule.from_yaml(Path(spec))
    return BudgetSchedule.from_preset(spec)


def make_engine(
    shape: Qwen3Shape | str,
    model_dir: str | Path | None = None,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    **engine_kwargs,
) -> TorchRolloutEngine:
    """The engine a benchmark runs: an HF checkpoint dir, else random weights of ``shape`` (a Qwen3Shape or
    preset name) seeded by ``seed``; ``engine_kwargs`` go to :class:`TorchRolloutEngine` (dense_layers,
    page_size, sink_pages, local_pages, attention_backend, ...)."""
    if model_dir is not None:
        return TorchRolloutEngine.from_hf_dir(model_dir, dtype=dtype, device=device, **engine_kwargs)
    model_shape = get_shape(shape) if isinstance(shape, str) else shape
    return TorchRolloutEngine.from_shape(model_shape, seed=seed, dtype=dtype, device=device, **engine_kwargs)


def bench_rollout(
    engine: TorchRolloutEngine,
    batch: int = 8,
    prompt_len: int = 64,
    gen_len: int = 256,
    schedules: Sequence[str | BudgetSchedule] = ("fixed:64",),
    seed: int = 0,
    tail_bin_tokens: int | None = None,
    logprobs_topk: int | None = None,
    print_fn: Callable[[str], None] | None = print,
) -> list[dict[str, float | str | int]]:
    """Measure dense and per-schedule rollout throughput and mismatch on ``engine``.

    Args:
        engine: the engine (see :func:`make_engine`); its page size must be the schedules'.
        batch, prompt_len, gen_len: sequences, prompt tokens (random ids), generated tokens per sequence.
        schedules: sparse schedules: objects, preset names ("fixed:64", "qwen3-1.7b-0.86") or YAML files.
        seed: prompts and sampling.
        tail_bin_tokens: bin width (tokens of cached length) for the acceptance-rate tail, the same
            for every row; default: the smallest bin width among ``schedules``.
        logprobs_topk: top-K kept per token for the acceptance rate; None = the whole vocabulary when it
            has <= 1024 tokens (exact alpha, needed for the flat distributions of small random models),
            else 20 (the paper's lower bound).
        print_fn: where the table goes (None: print nothing).

    Returns:
        One flat dict per configuration (the dense run first): configuration fields (``page_score`` the
        engine's), ``tokens_per_s``,
        ``decode_tokens_per_s``, ``speedup_vs_dense``, ``kept_kv_fraction`` (mean budget / cached length
        over sparse decode steps, capped at 1) and the ``acceptance/*`` metrics of ``summarize``.
    """
    if batch <= 0 or prompt_len <= 0 or gen_len <= 0:
        raise ValueError(f"batch, prompt_len and gen_len must be > 0, got {batch}, {prompt_len}, {gen_len}")
    if prompt_len + gen_len > engine.shape.max_position_embeddings:
        raise ValueError(
            f"prompt_len + gen_len = {prompt_len + gen_len} exceeds the model's "
            f"{engine.shape.max_position_embeddings} positions"
        )
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, engine.shape.vocab_size, (batch, prompt_len), generator=gen).tolist()
    vocab = engine.shape.vocab_size
    topk = logprobs_topk or (vocab if vocab <= 1024 else 20)
    sampling = SamplingParams(
        max_new_tokens=gen_len, temperature=1.0, seed=seed, stop_token_ids=(), logprobs_topk=topk
    )
    sparse = [_as_schedule(s) for s in schedules]
    bin_tokens = tail_bin_tokens or min(
        (s.bin_tokens for s in sparse), default=BudgetSchedule.dense().bin_tokens
    )
    dense = BudgetSchedule.dense(bin_tokens, engine.page_size)
    engine.generate(prompts[:1], SamplingParams(max_new_tokens=4, stop_token_ids=()), dense)
    rows: list[dict[str, float | str | int]] = []
    dense_tps = float("nan")
    for schedule in [dense, *sparse]:
        out = engine.generate(prompts, sampling, schedule)
        mismatch = measure_mismatch(engine, out)
        tps = out.tokens_per_second()
        dense_tps = tps if schedule.is_dense else dense_tps
        decode_tokens = out.num_response_tokens - len(out.samples)  # the first token comes from prefill
        budget = torch.cat([s.kv_budget[1:] for s in out.samples]).double()
        cached = torch.cat([s.cached_len[1:] for s in out.samples]).double()
        rows.append(
            {
                "schedule": schedule.name or "custom",
                "budgets": "dense" if schedule.is_dense else ",".join(str(b) for b in schedule.budgets),
                "bin_tokens": bin_tokens,
                "device": str(engine.device),
                "backend": engine.backend,
                "dtype": str(engine.model.dtype).removeprefix("torch."),
                "batch": batch,
                "prompt_len": prompt_len,
                "gen_len": gen_len,
                "dense_layers": engine.dense_layers,
                "page_score": engine.page_score,
                "num_layers": engine.shape.num_layers,
                "tokens": out.num_response_tokens,
                "logprobs_topk": topk,
                "tokens_per_s": tps,
                "decode_tokens_per_s": decode_tokens / out.decode_s if out.decode_s > 0 else float("nan"),
                "speedup_vs_dense": tps / dense_tps,
                "kept_kv_fraction": float((budget / cached).clamp(max=1.0).mean()) if cached.numel() else 1.0,
                **summarize(
                    mismatch.alpha,
                    mismatch.cached_len,
                    bin_tokens,
                    mismatch.train_logprobs,
                    mismatch.gen_logprobs,
                ),
            }
        )
    if print_fn is not None:
        print_fn(format_table(rows))
    return rows


def format_table(rows: Sequence[dict[str, float | str | int]]) -> str:
    """A fixed-width text table: throughput, kept KV fraction, acceptance mean and p5 per bin."""
    bins = sorted({int(k.rsplit("_", 1)[1]) for r in rows for k in r if k.startswith("acceptance/p5/bin_")})
    head = ["schedule", "tok/s", "x dense", "kept KV", "alpha mean", "min p5", *(f"p5 bin{b}" for b in bins)]
    lines = []
    for r in rows:
        cells = [
            str(r["schedule"]),
            f"{r['tokens_per_s']:.1f}",
            f"{r['speedup_vs_dense']:.2f}",
            f"{r['kept_kv_fraction']:.2f}",
            f"{r.get('acceptance/mean', float('nan')):.4f}",
            f"{r.get('acceptance/min_p5', float('nan')):.4f}",
            *(f"{r.get(f'acceptance/p5/bin_{b}', float('nan')):.4f}" for b in bins),
        ]
        lines.append(cells)
    widths = [max(len(h), *(len(c[i]) for c in lines)) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    first = rows[0] if rows else {}
    title = (
        f"rollout bench: batch {first.get('batch')}, prompt {first.get('prompt_len')}, gen {first.get('gen_len')}, "
        f"{first.get('device')} {first.get('dtype')}, attention {first.get('backend')}, page score "
        f"{first.get('page_score')}; "
        f"acceptance-rate p5 per bin of {first.get('bin_tokens')} cached tokens"
    )
    return "\n".join([title, fmt.format(*head), *(fmt.format(*c) for c in lines)])


# ---------------------------------------------------------------------------------------------- throughput
def copy_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Host memory copy bandwidth, bytes/s counting the bytes read and the bytes written (best of
    ``repeats``; the buffer is larger than the CPU's caches)."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def dense_step_bytes(engine: TorchRolloutEngine, batch: int, cached: float) -> float:
    """Bytes one dense decode step must read: K and V of ``cached`` tokens in every layer of every row,
    plus every weight once (the embedding table only for the ``batch`` looked-up rows)."""
    s = engine.shape
    elt = engine.model.dtype.itemsize
    kv = 2 * s.num_layers * s.num_key_value_heads * s.head_dim * elt * batch * cached
    weights = sum(t.numel() * t.element_size() for t in engine.model.params.values())
    embed = engine.model.params["model.embed_tokens.weight"]
    if not s.tie_word_embeddings:
        weights -= embed.numel() * embed.element_size() - batch * s.hidden_size * elt
    return kv + weights


def fill_random_cache(engine: TorchRolloutEngine, batch: int, context: int, extra: int, seed: int):
    """The engine's KV pool with ``batch`` rows holding ``context`` random tokens in every layer and pages for
    ``extra`` more -> (cache, block_table [B, P] int32, seq_len [B] int64, the scratch page: the pool's last,
    which no row holds)."""
    ps, s = engine.page_size, engine.shape
    pages = math.ceil((context + extra) / ps)
    cache = engine._pool(batch * pages)
    blocks = BlockManager(cache.num_pages - 1, ps)
    table = torch.full((batch, pages), -1, dtype=torch.int32, device=engine.device)
    seq_len = torch.full((batch,), context, dtype=torch.int64, device=engine.device)
    fill_block_table(blocks, table, seq_len + extra)
    gen = torch.Generator(device=engine.device).manual_seed(seed)
    shape = (batch, context, engine.model.heads[1], s.head_dim)  # this rank's KV heads
    for layer in range(s.num_layers):
        k, v = (torch.randn(shape, generator=gen, device=engine.device, dtype=engine.dtype) for _ in "kv")
        cache.write_prefill(layer, table, k, v, seq_len)
    return cache, table, seq_len, cache.num_pages - 1


@torch.no_grad()  # as generate() decodes (the CPU layer kernels run only without autograd)
def time_decode_steps(
    engine: TorchRolloutEngine,
    context: int,
    configs: Sequence[BudgetSchedule],
    batch: int,
    steps: int,
    seed: int = 0,
    repeats: int = 3,
    between_turns: Callable[[], None] | None = None,
) -> tuple[list[float], list[float]]:
    """Seconds of ``steps`` decode steps of ``batch`` rows at ``context`` cached tokens, per configuration.

    Every configuration decodes from the same cache of random keys and values (:func:`fill_random_cache`),
    one untimed step first, with the engine's own decode-and-sample step over the static buffers its step loop
    uses (:class:`~sparrow_nemo.rollout.torch.cuda_graphs.DecodeGraphs`: replayed from a CUDA graph on the
    triton backend, eager elsewhere; no stop checks); the configurations take turns ``repeats`` times
    (``between_turns`` runs after each turn) and each keeps its best time, so a burst of load on a shared machine
    hits all of them alike and rarely the kept number. The timed steps run at cached lengths
    ``context + 2 .. context + steps + 1``.

    Returns (kept KV fraction per configuration: mean budget / cached length capped at 1, best seconds).
    """
    sampling = SamplingParams(max_new_tokens=steps + 1, temperature=1.0, stop_token_ids=(), logprobs_topk=20)
    _, table, seq_len, scratch = fill_random_cache(engine, batch, context, steps + 2, seed)
    capture = engine.device.type == "cuda" and engine.backend == "triton"
    graphs = DecodeGraphs(engine._step_fn, engine.device, batch, table.shape[1], capture=capture)
    gen = torch.Generator().manual_seed(seed)
    now = now_fn(engine.device)
    best, kept = [math.inf] * len(configs), [1.0] * len(configs)
    for _ in range(repeats):
        for i, schedule in enumerate(configs):
            if not schedule.is_dense:
                graphs.budget_of.load(schedule)
            lengths = seq_len.clone()
            tokens = torch.randint(3, engine.shape.vocab_size, (batch,), generator=gen).to(engine.device)
            fractions = []
            t0 = 0.0
            for step in range(steps + 1):  # step 0 is the untimed one
                if step == 1:
                    t0 = now()
                lengths += 1
                uniforms = torch.rand(batch, generator=gen, dtype=torch.float64)
                out = graphs.run(table, tokens, lengths, uniforms, schedule.is_dense, sampling, 20, scratch)
                tokens = out.tokens
                if step:
                    fractions.append((out.budgets.double() / lengths.double()).clamp(max=1.0).mean())
            best[i] = min(best[i], now() - t0)
            kept[i] = float(torch.stack(fractions).mean())
        if between_turns is not None:
            between_turns()
    engine._cache = None  # the random cache is no one's
    return kept, best


def decode_throughput(
    engine: TorchRolloutEngine,
    contexts: Sequence[int],
    schedules: Callable[[int], Sequence[BudgetSchedule]],
    batch: int = 64,
    steps: int = 32,
    seed: int = 0,
    bandwidth: float | None = None,
    repeats: int = 3,
) -> list[dict[str, float | str | int]]:
    """Decode tokens/s at each cached length, dense and under ``schedules(context)``, with the memory bound.

    Every configuration decodes ``steps`` tokens per row from a cache holding ``context`` random tokens per
    row, timed by :func:`time_decode_steps`. ``bandwidth`` (bytes/s, read + written) defaults to the best :func:`copy_bandwidth` measured in the
    same turns (a higher bandwidth is a stricter bound).

    Returns one row per (context, schedule), dense first: ``context``, ``schedule``, ``tokens_per_s``,
    ``page_score`` (the engine's), ``speedup_vs_dense``, ``kept_kv_fraction`` (mean budget / cached length,
    capped at 1), and on every row
    of the context the dense bound: ``bound_tokens_per_s`` (batch / (dense_step_bytes / bandwidth)) and
    ``dense_vs_bound`` (bound / dense tokens/s: 1.0 = at the memory bound), plus ``bandwidth_gb_s``.
    """
    if batch <= 0 or steps <= 0 or repeats <= 0 or not contexts:
        raise ValueError(
            f"decode_throughput: batch, steps and repeats must be > 0 and contexts given, got {batch}, "
            f"{steps}, {repeats}"
        )
    bw = bandwidth or copy_bandwidth()
    measured: list[tuple[int, list[str], list[float], list[float]]] = []  # context, names, kept KV, seconds
    for context in contexts:
        configs = [BudgetSchedule.dense(engine.page_size * 8, engine.page_size), *schedules(context)]

        def between_turns() -> None:  # the copy takes its turns too: the bound uses the best bandwidth seen
            nonlocal bw
            if bandwidth is None:
                bw = max(bw, copy_bandwidth(repeats=1))

        kept, best = time_decode_steps(engine, context, configs, batch, steps, seed, repeats, between_turns)
        measured.append((context, [c.name or "custom" for c in configs], kept, best))
    rows: list[dict[str, float | str | int]] = []
    for context, names, kept, best in measured:
        mean_cached = context + (steps + 3) / 2  # the timed steps run at cached lengths +2 .. +steps+1
        bound = batch / (dense_step_bytes(engine, batch, mean_cached) / bw)
        dense_tps = batch * steps / best[0]
        for name, fraction, seconds in zip(names, kept, best):
            tps = batch * steps / seconds
            rows.append(
                {
                    "context": context,
                    "schedule": name,
                    "page_score": engine.page_score,
                    "batch": batch,
                    "steps": steps,
                    "repeats": repeats,
                    "tokens_per_s": tps,
                    "speedup_vs_dense": tps / dense_tps,
                    "kept_kv_fraction": fraction,
                    "bound_tokens_per_s": bound,
                    "dense_vs_bound": bound / dense_tps,
                    "bandwidth_gb_s": bw / 1e9,
                }
            )
    return rows


def format_throughput(rows: Sequence[dict[str, float | str | int]]) -> str:
    """The decode-throughput table: per context, dense and the memory bound, then each sparse schedule."""
    sparse = list(dict.fromkeys(str(r["schedule"]) for r in rows if r["schedule"] != "dense"))
    head = ["context", "dense tok/s", "bound tok/s", "bound/dense"]
    for name in sparse:
        head += [f"{name} tok/s", "x dense", "kept KV"]
    lines = []
    for context in dict.fromkeys(int(r["context"]) for r in rows):
        mine = {str(r["schedule"]): r for r in rows if r["context"] == context}
        d = mine["dense"]
        cells = [
            str(context),
            f"{d['tokens_per_s']:.0f}",
            f"{d['bound_tokens_per_s']:.0f}",
            f"{d['dense_vs_bound']:.2f}",
        ]
        for name in sparse:
            r = mine.get(name)
            cells += (
                [f"{r['tokens_per_s']:.0f}", f"{r['speedup_vs_dense']:.2f}", f"{r['kept_kv_fraction']:.2f}"]
                if r
                else ["-", "-", "-"]
            )
        lines.append(cells)
    widths = [max(len(h), *(len(c[i]) for c in lines)) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    first = rows[0] if rows else {}
    title = (
        f"decode throughput: batch {first.get('batch')}, {first.get('steps')} steps per context (best of "
        f"{first.get('repeats')}), page score {first.get('page_score')}; memory bound = "
        f"dense bytes per step / copy bandwidth {first.get('bandwidth_gb_s', float('nan')):.1f} GB/s "
        "(read + written, this run)"
    )
    return "\n".join([title, fmt.format(*head), *(fmt.format(*c) for c in lines)])
