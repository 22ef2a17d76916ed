"""``sparrow bench rollout``: decode throughput of dense vs sparse schedules, and the mismatch they cost.

For a model shape (random weights unless a checkpoint dir is given), a batch of random prompts is
generated with EOS ignored, once densely and once per schedule. Each row reports tokens/s and, from
the rollout re-scored densely (:func:`sparrow_nemo.rollout.scoring.measure_mismatch`), the
acceptance-rate summary of ``sparrow_nemo.sparse.mismatch.summarize`` (mean, p5 per bin of cached length).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from sparrow_nemo.model_shapes import Qwen3Shape, get_shape
from sparrow_nemo.rollout.engine import SamplingParams
from sparrow_nemo.rollout.scoring import measure_mismatch
from sparrow_nemo.rollout.torch_engine import TorchRolloutEngine
from sparrow_nemo.sparse.mismatch import summarize
from sparrow_nemo.sparse.pattern import PAGE_SIZE
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


def bench_rollout(
    shape: Qwen3Shape | str,
    batch: int = 8,
    prompt_len: int = 64,
    gen_len: int = 256,
    schedules: Sequence[str | BudgetSchedule] = ("fixed:64",),
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    dense_layers: int = 2,
    page_size: int = PAGE_SIZE,
    sink_pages: int = 1,
    local_pages: int = 2,
    tail_bin_tokens: int | None = None,
    model_dir: str | Path | None = None,
    attention_backend: str = "auto",
    logprobs_topk: int | None = None,
    print_fn: Callable[[str], None] | None = print,
) -> list[dict[str, float | str | int]]:
    """Measure dense and per-schedule rollout throughput and mismatch.

    Args:
        shape: a Qwen3Shape or preset name (random weights, seeded by ``seed``); ignored with model_dir.
        batch, prompt_len, gen_len: sequences, prompt tokens (random ids), generated tokens per sequence.
        schedules: sparse schedules: objects, preset names ("fixed:64", "qwen3-1.7b-0.86") or YAML files.
        device, dtype: where and in which precision the engine runs.
        dense_layers, page_size, sink_pages, local_pages: the sparse rule's constants (paper: 2, 16, 1, 2).
        tail_bin_tokens: bin width (tokens of cached length) for the acceptance-rate tail, the same
            for every row; default: the smallest bin width among ``schedules``.
        model_dir: optional HF Qwen3 checkpoint directory instead of random weights.
        attention_backend: "auto", "torch" or "triton" (see ``choose_backend``).
        logprobs_topk: top-K kept per token for the acceptance rate; None = the whole vocabulary when it
            has <= 1024 tokens (exact alpha, needed for the flat distributions of small random models),
            else 20 (the paper's lower bound).
        print_fn: where the table goes (None: print nothing).

    Returns:
        One flat dict per configuration (the dense run first): configuration fields, ``tokens_per_s``,
        ``decode_tokens_per_s``, ``speedup_vs_dense``, ``kept_kv_fraction`` (mean budget / cached length
        over sparse decode steps, capped at 1) and the ``acceptance/*`` metrics of ``summarize``.
    """
    if batch <= 0 or prompt_len <= 0 or gen_len <= 0:
        raise ValueError(f"batch, prompt_len and gen_len must be > 0, got {batch}, {prompt_len}, {gen_len}")
    kwargs = {
        "dense_layers": dense_layers,
        "page_size": page_size,
        "sink_pages": sink_pages,
        "local_pages": local_pages,
        "attention_backend": attention_backend,
    }
    if model_dir is not None:
        engine = TorchRolloutEngine.from_hf_dir(model_dir, dtype=dtype, device=device, **kwargs)
    else:
        model_shape = get_shape(shape) if isinstance(shape, str) else shape
        engine = TorchRolloutEngine.from_shape(model_shape, seed=seed, dtype=dtype, device=device, **kwargs)
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
    engine.generate(prompts[:1], SamplingParams(max_new_tokens=4, stop_token_ids=()), BudgetSchedule.dense())

    sparse = [_as_schedule(s) for s in schedules]
    bin_tokens = tail_bin_tokens or min(
        (s.bin_tokens for s in sparse), default=BudgetSchedule.dense().bin_tokens
    )
    rows: list[dict[str, float | str | int]] = []
    dense_tps = float("nan")
    for schedule in [BudgetSchedule.dense(), *sparse]:
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
                "dtype": str(dtype).removeprefix("torch."),
                "batch": batch,
                "prompt_len": prompt_len,
                "gen_len": gen_len,
                "dense_layers": dense_layers,
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
        f"{first.get('device')} {first.get('dtype')}, attention {first.get('backend')}; "
        f"acceptance-rate p5 per bin of {first.get('bin_tokens')} cached tokens"
    )
    return "\n".join([title, fmt.format(*head), *(fmt.format(*c) for c in lines)])
