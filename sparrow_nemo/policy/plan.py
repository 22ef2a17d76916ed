"""``sparrow plan``: the parallel layout of a run and a per-GPU memory estimate, or a clear refusal.

The estimate prices the objects the run builds: the model shape and layout, and the
:class:`~sparrow_nemo.policy.memory.MemorySettings` (recompute, sequence parallelism, logprob chunk,
micro-batch token budget) that ``build_model`` turns into the megatron config. Bytes per GPU of the
busiest rank (CUDA context, NCCL buffers and allocator slack not included), with ``e`` the bytes of the
training dtype, ``T`` the tokens of a micro-batch (``max_tokens_per_micro_batch``, else
``micro_batch x seq_len``) and ``Vl`` the vocab rows of one TP rank:

- weights: parameters on the rank x ``e`` (the first stage holds the embedding, the last the final
  norm and output layer; a tied output layer is copied on the last stage when pp > 1);
- gradients: 4 bytes per parameter (megatron DDP reduces grads in fp32);
- optimizer: Adam moments m, v (8 bytes) plus an fp32 master copy (4 bytes) when ``e < 4``; divided by
  dp for the distributed optimizer;
- activations: what the decoder layers keep for backward, per token and layer (:func:`layer_activations`:
  the tensors counted on megatron's local layer spec with SDPA attention; flash attention keeps no
  ``S x S`` tensor) x ``T`` x the ``pp - stage`` micro-batches 1F1B keeps in flight; full recompute
  keeps only each recomputed layer's input; selective recompute drops the MLP's; sequence parallelism
  divides the norm / residual part by tp;
- recompute: the activations of one recomputed group (full) or MLP (selective) while the backward
  recomputes it;
- logits/logprob buffers (last stage; :func:`head_bytes`): the fused chunked output layer holds one
  chunk of fp32 logits plus a quarter of it for ``exp`` (``1.25 x chunk x Vl x 4``), the saved final
  hidden states and per-token outputs, the input gradient, and in bf16 the output-weight gradient's
  fp32 accumulator. The output layer's backward is over before the layers' begins, so the total counts
  the larger of this and the recompute line;
- DistillSparse (when enabled): the adapter's parameters, gradients and AdamW moments, and in its
  sparse forward the fp32 keys/values and page landmarks each sparse layer keeps plus one query block's
  scores;
- rollout (the process model of :mod:`sparrow_nemo.grpo.process_model`: one engine per rank, or per
  ``rollout.tensor_parallel_size`` ranks, :class:`~sparrow_nemo.policy.engine_memory.RolloutSpec`): the engine
  sleeps while the policy trains (weights and KV pool released, nothing copied), so the training phase above
  has no engine term; during rollout a GPU holds the engine's weights shard and KV pool next to the policy's
  weights, and its gradient buffers and optimizer shard unless ``policy.offload_during_rollout`` frees the
  former and keeps the latter in pinned host memory (:mod:`sparrow_nemo.policy.offload`; the node's host then
  holds ``gpus_per_node`` optimizer shards); how many full-length sequences the pool holds
  (:mod:`sparrow_nemo.policy.engine_memory`).

``tests/policy/test_plan_measured.py`` measures a CPU training step's peak at several sizes against
these formulas.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sparrow_nemo.model_shapes import Qwen3Shape
from sparrow_nemo.policy.engine_memory import DTYPE_BYTES, RolloutMemory, RolloutSpec, rollout_memory
from sparrow_nemo.policy.logprobs import TOP_K, VOCAB_BLOCKS
from sparrow_nemo.policy.memory import DEFAULT_MEMORY, MemorySettings
from sparrow_nemo.policy.model import padded_vocab_size
from sparrow_nemo.policy.parallel import LayoutError, ParallelLayout, stage_layer_range
from sparrow_nemo.policy.sparse_forward import QUERY_BLOCK

GIB = 1024**3
OPTIMIZERS = ("adam", "distributed_adam")
#: bytes of one KV-cache element of the rollout engine (bf16)
KV_BYTES = 2


@dataclass(frozen=True)
class RankPlacement:
    """Where one global rank sits."""

    rank: int
    node: int
    local_gpu: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    layers: range


@dataclass(frozen=True)
class DistillSpec:
    """The DistillSparse adapter the plan counts (recipe ``distill``; None in :func:`plan` = off).

    Attributes:
        rank: LoRA rank.
        targets: megatron linear names adapted (``sparrow_nemo.policy.lora.TARGETS`` keys).
        sparse_layers_from: first decoder layer that runs sparse attention (``sparsity.dense_layers``).
        page_size: tokens per KV page.
        page_score: ``sparsity.page_score`` (the landmarks its sparse forward keeps per page).
    """

    rank: int
    targets: tuple[str, ...]
    sparse_layers_from: int
    page_size: int
    page_score: str = "centroid"


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-GPU bytes of the busiest rank in one phase (training, or DistillSparse's adapter step).

    ``activations`` is what the layers keep for backward; ``recompute`` what one recomputed group holds
    while it runs in the backward; ``logits`` the fused output layer's peak. ``lora`` (adapter parameters,
    gradients, AdamW moments) and ``sparse_attention`` (one query block of the sparse forward) are 0
    outside the DistillSparse phase.
    """

    weights: int
    gradients: int
    optimizer: int
    activations: int
    logits: int
    recompute: int = 0
    lora: int = 0
    sparse_attention: int = 0

    @property
    def total(self) -> int:
        """The peak: the output layer's buffers are freed before the layers' backward (and its recompute,
        or a sparse query block) runs, so only the larger of the two is live at once."""
        transient = max(self.logits, self.recompute + self.sparse_attention)
        return self.weights + self.gradients + self.optimizer + self.activations + transient + self.lora


@dataclass(frozen=True)
class PlanReport:
    """What ``sparrow plan`` prints.

    ``rollout_policy``: the policy's bytes per GPU during rollout (weights; gradients and optimizer too unless
    offloaded); ``host_offload``: the optimizer bytes per GPU kept in host memory during rollout (0 without
    the offload).
    """

    shape_name: str
    shape: Qwen3Shape
    layout: ParallelLayout
    nodes: int
    gpus_per_node: int
    micro_batch: int
    seq_len: int
    tokens_per_micro_batch: int
    dtype: str
    optimizer: str
    gpu_memory_gb: float
    total_parameters: int
    params_per_stage: tuple[int, ...]
    memory: MemoryEstimate
    placements: tuple[RankPlacement, ...]
    settings: MemorySettings = DEFAULT_MEMORY
    distill: MemoryEstimate | None = None
    rollout: RolloutMemory | None = None
    rollout_policy: int = 0
    host_offload: int = 0
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def peak(self) -> MemoryEstimate:
        """The phase that needs the most memory (DistillSparse's when it is on and larger)."""
        if self.distill is not None and self.distill.total > self.memory.total:
            return self.distill
        return self.memory


def stage_parameters(shape: Qwen3Shape, layout: ParallelLayout, stage: int) -> int:
    """Parameters held by one rank of pipeline ``stage`` (TP-split weights divided by tp, norms replicated)."""
    h, d, tp = shape.hidden_size, shape.head_dim, layout.tp
    split = (
        shape.num_attention_heads * d * h * 2
        + shape.num_key_value_heads * d * h * 2
        + 3 * h * shape.intermediate_size
    ) // tp
    per_layer = split + 2 * h + 2 * d
    layers = len(stage_layer_range(shape.num_layers, layout.pp, stage))
    vocab_rows = padded_vocab_size(shape.vocab_size, tp) // tp
    params = layers * per_layer
    first, last = stage == 0, stage == layout.pp - 1
    if first:
        params += vocab_rows * h
    if last:
        params += h
        if not shape.tie_word_embeddings or not first:
            params += vocab_rows * h
    return params


@dataclass(frozen=True)
class LayerActivations:
    """Bytes per token one decoder layer keeps for backward.

    Attributes:
        full: everything (no recompute).
        layer_input: what full recompute keeps (the layer's input hidden state).
        mlp: the MLP's share (dropped by selective recompute).
    """

    full: int
    layer_input: int
    mlp: int


def layer_activations(
    shape: Qwen3Shape, tp: int, dtype_bytes: int, sequence_parallel: bool
) -> LayerActivations:
    """Per-token saved activations of one layer, counted tensor by tensor (elements x ``dtype_bytes``):

    - 6h: input-norm input and output, the attention output and residual, pre-MLP norm input and output
      (divided by tp under sequence parallelism);
    - (Hq + 2 Hkv) D: the fused qkv projection output (its k, v views feed the attention);
    - 4 Hq D + 2 Hkv D: q copy, q/k norm outputs after rotary, attention output, its re-layout for the
      output projection;
    - 5 I: fc1 output (2I), SwiGLU's silu output, product and fc2 input;
    - fp32: the rotary cos/sin tables of q and k (4 D), the norms' inverse RMS (2 + Hq + Hkv) and the
      attention's log-sum-exp (Hq).

    Head counts and I are this rank's (divided by tp).
    """
    h, d, i = shape.hidden_size, shape.head_dim, shape.intermediate_size
    hq, hkv = shape.num_attention_heads // tp, shape.num_key_value_heads // tp
    split = tp if sequence_parallel else 1
    hidden = 6 * h * dtype_bytes // split
    attention = ((hq + 2 * hkv) * d + 4 * hq * d + 2 * hkv * d) * dtype_bytes
    mlp = 5 * i // tp * dtype_bytes
    fp32 = 4 * (4 * d + 2 + 2 * hq + hkv)
    return LayerActivations(hidden + attention + mlp + fp32, h * dtype_bytes // split, mlp)


def stage_activations(
    shape: Qwen3Shape,
    layout: ParallelLayout,
    tokens: int,
    dtype_bytes: int,
    stage: int,
    memory: MemorySettings,
) -> tuple[int, int]:
    """Bytes the decoder layers of pipeline ``stage`` keep for backward, and the bytes one recomputed group
    (full) or MLP (selective) holds while it is recomputed (0 without recompute)."""
    per = layer_activations(shape, layout.tp, dtype_bytes, memory.sequence_parallel)
    layers = len(stage_layer_range(shape.num_layers, layout.pp, stage))
    in_flight = layout.pp - stage  # 1F1B: stage s keeps pp - s micro-batches of activations
    recomputed = memory.recomputed_layers(layers)
    if memory.recompute_granularity == "full":
        group = memory.recompute_num_layers if memory.recompute_method == "uniform" else 1
        kept = recomputed * per.layer_input + (layers - recomputed) * per.full
        running = group * per.full  # one recomputed group's activations while its backward runs
    elif memory.recompute_granularity == "selective":
        kept, running = layers * (per.full - per.mlp), per.mlp
    else:
        kept, running = layers * per.full, 0
    outside = 2 * shape.hidden_size * dtype_bytes if stage == layout.pp - 1 else 0  # final norm
    return (kept * in_flight + outside) * tokens, running * tokens


def head_bytes(shape: Qwen3Shape, layout: ParallelLayout, tokens: int, dtype_bytes: int, chunk: int) -> int:
    """Peak bytes of the fused chunked output layer + logprobs (the last stage's logits/logprob buffers).

    Saved for backward: the gathered final hidden states ``T x h`` and per-token float32 normaliser,
    entropy, logprob and entropy outputs, top-k ids / logprobs (compact and in the batch grid). In the
    backward: one chunk of fp32 logits (turned into its gradient in place) plus ``1 / VOCAB_BLOCKS`` of it
    for ``exp``, the chunk's gradient in the model dtype when that is not fp32, the hidden states'
    gradient, and (bf16) the output weight's fp32 accumulator and one chunk product.
    """
    h = shape.hidden_size
    local_v = padded_vocab_size(shape.vocab_size, layout.tp) // layout.tp
    c = min(chunk, tokens)
    saved = tokens * (h * dtype_bytes + 4 * 4 + TOP_K * (8 + 4) * 2)
    logits = c * local_v * 4 + -(-c * local_v // VOCAB_BLOCKS) * 4
    if dtype_bytes != 4:
        logits += c * local_v * dtype_bytes + local_v * h * (4 + dtype_bytes)
    return saved + logits + tokens * h * dtype_bytes


def lora_parameters(shape: Qwen3Shape, layout: ParallelLayout, stage: int, distill: DistillSpec) -> int:
    """Adapter parameters on one rank of ``stage`` (A and B of every adapted linear, TP shards)."""
    from sparrow_nemo.policy.lora import TARGETS, lora_shapes

    layers = len(stage_layer_range(shape.num_layers, layout.pp, stage))
    per_layer = 0
    for target in distill.targets:
        if target not in TARGETS:
            raise LayoutError(f"unknown LoRA target {target!r}; known: {sorted(TARGETS)}")
        a, b = lora_shapes(shape, target, distill.rank, layout.tp)
        per_layer += a[0] * a[1] + b[0] * b[1]
    return layers * per_layer


def _distill_terms(
    shape: Qwen3Shape,
    layout: ParallelLayout,
    tokens: int,
    seq_len: int,
    dtype_bytes: int,
    stage: int,
    memory: MemorySettings,
    distill: DistillSpec,
) -> tuple[int, int, int]:
    """(adapter bytes, extra activation bytes, one query block's bytes) of DistillSparse on ``stage``.

    Extra activations per layer and token: the adapter's ``x @ A.T`` per target, and in a sparse layer the
    fp32 keys and values every query block gathers from plus the page landmarks; kept for the layers full
    recompute does not recompute, and for one recomputed group while it runs.
    """
    from sparrow_nemo.rollout.trtllm.kv_cache import landmarks_per_page

    lora = lora_parameters(shape, layout, stage, distill) * dtype_bytes * 4  # param, grad, AdamW m and v
    layers = list(stage_layer_range(shape.num_layers, layout.pp, stage))
    hq, hkv, d = (
        shape.num_attention_heads // layout.tp,
        shape.num_key_value_heads // layout.tp,
        shape.head_dim,
    )
    adapter = 2 * distill.rank * len(distill.targets) * dtype_bytes
    sparse = int(hkv * d * 4 * (2 + landmarks_per_page(distill.page_score) / distill.page_size))
    extra = [adapter + (sparse if layer >= distill.sparse_layers_from else 0) for layer in layers]
    recomputed = memory.recomputed_layers(len(layers))
    group = memory.recompute_num_layers if memory.recompute_method == "uniform" else 1
    running = max(extra[:recomputed], default=0) * min(group, recomputed)
    kept = sum(extra[recomputed:]) * (layout.pp - stage) + running
    # one block: scores and probabilities of Hq x QUERY_BLOCK queries over up to seq_len keys, the mask,
    # and the gathered keys / values
    block = QUERY_BLOCK * seq_len * (hq * 4 * 2 + hkv) + 2 * hkv * seq_len * d * 4
    return lora, kept * tokens, block


def estimate_memory(
    shape: Qwen3Shape,
    layout: ParallelLayout,
    tokens: int,
    seq_len: int,
    dtype: str,
    optimizer: str,
    stage: int,
    memory: MemorySettings = DEFAULT_MEMORY,
    distill: DistillSpec | None = None,
) -> MemoryEstimate:
    """Per-GPU bytes of one rank of ``stage`` for micro-batches of ``tokens`` tokens (rows of <= seq_len).

    With ``distill``, the DistillSparse adapter step instead of the policy's training step.
    """
    params = stage_parameters(shape, layout, stage)
    nbytes = DTYPE_BYTES[dtype]
    opt = params * (8 + (0 if nbytes == 4 else 4))
    if optimizer == "distributed_adam":
        opt = -(-opt // layout.dp)
    activations, running = stage_activations(shape, layout, tokens, nbytes, stage, memory)
    last = stage == layout.pp - 1
    logits = head_bytes(shape, layout, tokens, nbytes, memory.logprob_chunk_tokens) if last else 0
    lora = block = 0
    if distill is not None:
        lora, extra, block = _distill_terms(shape, layout, tokens, seq_len, nbytes, stage, memory, distill)
        activations += extra
    return MemoryEstimate(params * nbytes, params * 4, opt, activations, logits, running, lora, block)


def plan(
    shape: Qwen3Shape,
    nodes: int,
    gpus_per_node: int,
    tp: int,
    pp: int,
    micro_batch: int,
    seq_len: int,
    dtype: str = "bf16",
    optimizer: str = "distributed_adam",
    gpu_memory_gb: float = 80.0,
    shape_name: str = "",
    memory: MemorySettings = DEFAULT_MEMORY,
    distill: DistillSpec | None = None,
    rollout: RolloutSpec | None = None,
    offload_during_rollout: bool = False,
) -> PlanReport:
    """Lay out ``nodes x gpus_per_node`` GPUs as tp x pp x dp and estimate per-GPU memory.

    Args:
        memory: the recipe's recompute / sequence-parallel / chunk / token-budget settings.
        distill: count DistillSparse's adapter phase (None: off).
        rollout: the colocated rollout engine to size (None: no engine).
        offload_during_rollout: ``policy.offload_during_rollout`` (gradients and optimizer off the GPU
            while the engine runs).

    Raises:
        LayoutError: sizes that do not divide (world, layers, heads, MLP width, recompute groups), an
            unknown dtype or optimizer, a sequence longer than the model supports or than the micro-batch
            token budget, a rank that does not fit in ``gpu_memory_gb``, or a rollout KV pool that holds
            no full-length sequence; the message says which and why.
    """
    for name, value in (
        ("nodes", nodes),
        ("gpus_per_node", gpus_per_node),
        ("micro_batch", micro_batch),
        ("seq_len", seq_len),
    ):
        if not isinstance(value, int) or value < 1:
            raise LayoutError(f"{name} must be a positive integer, got {value!r}")
    if dtype not in DTYPE_BYTES:
        raise LayoutError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    if optimizer not in OPTIMIZERS:
        raise LayoutError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    if seq_len > shape.max_position_embeddings:
        raise LayoutError(
            f"seq_len={seq_len} exceeds the model's max_position_embeddings={shape.max_position_embeddings}"
        )
    budget = memory.max_tokens_per_micro_batch
    if budget is not None and budget < seq_len:
        raise LayoutError(
            f"max_tokens_per_micro_batch={budget} is below the longest sequence ({seq_len} tokens)"
        )
    tokens = budget if budget is not None else micro_batch * seq_len
    world = nodes * gpus_per_node
    layout = ParallelLayout.for_world(world, tp=tp, pp=pp)
    layout.validate(shape, world_size=world)
    memory.validate(shape.num_layers, layout)

    notes = []
    if tp > gpus_per_node:
        notes.append(
            f"tp={tp} spans nodes (gpus_per_node={gpus_per_node}): tensor-parallel all-reduces "
            "would cross the inter-node network; keep tp <= gpus_per_node"
        )
    per_stage = tuple(stage_parameters(shape, layout, s) for s in range(pp))

    def busiest(distill_spec: DistillSpec | None) -> MemoryEstimate:
        stages = [
            estimate_memory(shape, layout, tokens, seq_len, dtype, optimizer, s, memory, distill_spec)
            for s in range(pp)
        ]
        return max(stages, key=lambda m: m.total)

    train = busiest(None)
    distilled = busiest(distill) if distill is not None else None
    gpu_bytes = int(gpu_memory_gb * GIB)
    for phase, est in (("training", train), ("DistillSparse", distilled)):
        if est is not None and est.total > gpu_bytes:
            raise LayoutError(
                f"tp={tp} pp={pp} dp={layout.dp}: the busiest rank needs {est.total / GIB:.1f} GiB in the "
                f"{phase} phase ({_terms(est)}) > {gpu_memory_gb:g} GiB per GPU: raise tp or pp, use "
                "distributed_adam, recompute, or lower micro_batch/seq_len"
            )
    engine, resident, host = None, 0, 0
    if rollout is not None:  # the policy's weights stay for the refit; the rest unless offloaded
        host = train.optimizer if offload_during_rollout else 0
        resident = train.weights + (0 if offload_during_rollout else train.gradients + train.optimizer)
        engine = rollout_memory(shape, seq_len, rollout, resident, gpu_bytes)
        if engine.sequences < 1:
            raise LayoutError(
                f"the rollout engine has {engine.kv_pool / GIB:.1f} GiB of KV cache per GPU next to "
                f"{resident / GIB:.1f} GiB of policy memory and {engine.engine_weights / GIB:.1f} GiB of engine "
                f"weights: no room for one {seq_len}-token sequence; raise tp, pp or rollout.tensor_parallel_size"
                + ("" if offload_during_rollout else ", or set policy.offload_during_rollout")
            )
    placements = []
    for rank in range(world):
        tp_rank, rest = rank % tp, rank // tp
        dp_rank, pp_rank = rest % layout.dp, rest // layout.dp
        placements.append(
            RankPlacement(
                rank,
                rank // gpus_per_node,
                rank % gpus_per_node,
                tp_rank,
                pp_rank,
                dp_rank,
                stage_layer_range(shape.num_layers, pp, pp_rank),
            )
        )
    return PlanReport(
        shape_name=shape_name,
        shape=shape,
        layout=layout,
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        micro_batch=micro_batch,
        seq_len=seq_len,
        tokens_per_micro_batch=tokens,
        dtype=dtype,
        optimizer=optimizer,
        gpu_memory_gb=gpu_memory_gb,
        total_parameters=shape.num_parameters(),
        params_per_stage=per_stage,
        memory=train,
        placements=tuple(placements),
        settings=memory,
        distill=distilled,
        rollout=engine,
        rollout_policy=resident,
        host_offload=host,
        notes=tuple(notes),
    )


def _terms(m: MemoryEstimate) -> str:
    parts = [
        ("weights", m.weights),
        ("grads", m.gradients),
        ("optimizer", m.optimizer),
        ("activations", m.activations),
        ("recompute", m.recompute),
        ("logits", m.logits),
        ("lora", m.lora),
        ("sparse attention", m.sparse_attention),
    ]
    return ", ".join(f"{name} {value / GIB:.1f}" for name, value in parts if value)


def _recompute_text(settings: MemorySettings) -> str:
    if settings.recompute_granularity == "full":
        return f"full recompute ({settings.recompute_method}, {settings.recompute_num_layers} layer(s))"
    if settings.recompute_granularity == "selective":
        return "selective recompute (mlp)"
    return "no recompute"


def format_plan(report: PlanReport) -> str:
    """The text ``sparrow plan`` prints."""
    lay, mem, cfg = report.layout, report.memory, report.settings
    name = f" {report.shape_name}" if report.shape_name else ""
    lines = [
        f"model{name}: {report.total_parameters / 1e9:.3f} B parameters "
        f"({report.shape.num_layers} layers, hidden {report.shape.hidden_size}, "
        f"{report.shape.num_attention_heads}q/{report.shape.num_key_value_heads}kv heads)",
        f"cluster: {report.nodes} nodes x {report.gpus_per_node} GPUs = {lay.world_size} ranks",
        f"layout: TP={lay.tp} PP={lay.pp} DP={lay.dp} (rank order tp, dp, pp)",
        "parameters per GPU by pipeline stage: "
        + ", ".join(f"stage {s}: {p / 1e6:.1f} M" for s, p in enumerate(report.params_per_stage)),
        f"memory per GPU (busiest rank; {report.dtype}, {report.optimizer}, {report.tokens_per_micro_batch} "
        f"tokens per micro-batch, seq_len {report.seq_len}, {_recompute_text(cfg)}, sequence parallel "
        f"{'on' if cfg.sequence_parallel else 'off'}, logprob chunk {cfg.logprob_chunk_tokens}):",
        f"  weights      {mem.weights / GIB:8.2f} GiB",
        f"  gradients    {mem.gradients / GIB:8.2f} GiB",
        f"  optimizer    {mem.optimizer / GIB:8.2f} GiB",
        f"  activations  {mem.activations / GIB:8.2f} GiB  (kept for backward)",
        f"  recompute    {mem.recompute / GIB:8.2f} GiB  (one recomputed layer group in the backward)",
        f"  logits       {mem.logits / GIB:8.2f} GiB  (chunked output layer + logprob buffers; never live "
        "with the recompute)",
    ]
    if report.distill is not None:
        d = report.distill
        lines += [
            f"  distill      {(d.total - mem.total) / GIB:8.2f} GiB  (DistillSparse step: adapter "
            f"{d.lora / GIB:.2f}, sparse-forward activations +{(d.activations - mem.activations) / GIB:.2f}, "
            f"query block {d.sparse_attention / GIB:.2f})",
        ]
    lines.append(f"  total        {report.peak.total / GIB:8.2f} GiB of {report.gpu_memory_gb:g} GiB")
    if report.rollout is not None:
        r = report.rollout
        kept = "weights only: gradients freed, optimizer on host" if report.host_offload else "all of it"
        lines.append(
            f"rollout (one {r.backend} engine per {r.tensor_parallel} GPU(s), asleep while training): policy "
            f"{report.rollout_policy / GIB:.2f} GiB ({kept}), engine weights {r.engine_weights / GIB:.2f} GiB, "
            f"KV cache {r.kv_pool / GIB:.2f} GiB per GPU = {r.pool_tokens:,} tokens, {r.sequences} sequences of "
            f"{report.seq_len} tokens at once per engine"
        )
        if report.host_offload:
            lines.append(
                f"host memory per node during rollout: {report.gpus_per_node} x {report.host_offload / GIB:.2f} GiB "
                f"= {report.gpus_per_node * report.host_offload / GIB:.1f} GiB of pinned optimizer state"
            )
    lines += ["ranks:", "  rank  node  gpu  tp  pp  dp  layers"]
    for p in report.placements:
        lines.append(
            f"  {p.rank:4d}  {p.node:4d}  {p.local_gpu:3d}  {p.tp_rank:2d}  {p.pp_rank:2d}  {p.dp_rank:2d}"
            f"  {p.layers.start}-{p.layers.stop - 1}"
        )
    lines += [f"note: {n}" for n in report.notes]
    return "\n".join(lines)
