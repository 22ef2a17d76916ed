"""``sparrow plan``: the parallel layout of a run and a per-GPU memory estimate, or a clear refusal.

Memory model (bytes per GPU, the busiest rank; CUDA context / allocator slack not included):

- weights: parameters on the rank x bytes of ``dtype`` (the first stage holds the embedding, the
  last the final norm and output layer; a tied output layer is copied on the last stage when pp > 1);
- gradients: 4 bytes per parameter (megatron DDP reduces grads in fp32);
- optimizer: Adam moments m, v (8 bytes) plus an fp32 master copy (4 bytes) when ``dtype`` is not
  fp32; divided by dp for the distributed optimizer;
- activations (1F1B schedule, flash attention so no ``S x S`` scores): per token and layer the
  tensors saved for backward, in elements: 5*h (norm inputs/outputs, residual)
  + (2*Hq + 3*Hkv)*D/tp (q, k, v, q/k-norm inputs, attention context) + 3*I/tp (fc1 out, fc2 in);
  with full recompute only the layer input (h) is kept, plus one layer's full set while it is
  recomputed. Times ``dtype`` bytes, micro_batch*seq_len, the layers of the stage, and the
  ``pp - stage`` micro-batches in flight; plus fp32 logits and their log-softmax on the last stage
  (2 x 4 bytes x micro_batch*seq_len*vocab/tp).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sparrow_nemo.model_shapes import Qwen3Shape
from sparrow_nemo.policy.model import padded_vocab_size
from sparrow_nemo.policy.parallel import LayoutError, ParallelLayout, stage_layer_range

GIB = 1024**3
_DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}
OPTIMIZERS = ("adam", "distributed_adam")


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
class MemoryEstimate:
    """Per-GPU bytes of the busiest rank."""

    weights: int
    gradients: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        """Sum of the four terms."""
        return self.weights + self.gradients + self.optimizer + self.activations


@dataclass(frozen=True)
class PlanReport:
    """What ``sparrow plan`` prints."""

    shape_name: str
    shape: Qwen3Shape
    layout: ParallelLayout
    nodes: int
    gpus_per_node: int
    micro_batch: int
    seq_len: int
    recompute: bool
    dtype: str
    optimizer: str
    gpu_memory_gb: float
    total_parameters: int
    params_per_stage: tuple[int, ...]
    memory: MemoryEstimate
    placements: tuple[RankPlacement, ...]
    notes: tuple[str, ...] = field(default_factory=tuple)


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


def _activation_bytes(
    shape: Qwen3Shape,
    layout: ParallelLayout,
    micro_batch: int,
    seq_len: int,
    dtype_bytes: int,
    stage: int,
    recompute: bool,
) -> int:
    h, d, tp = shape.hidden_size, shape.head_dim, layout.tp
    full_layer = (
        5 * h
        + (2 * shape.num_attention_heads + 3 * shape.num_key_value_heads) * d // tp
        + 3 * shape.intermediate_size // tp
    )
    layers = len(stage_layer_range(shape.num_layers, layout.pp, stage))
    in_flight = layout.pp - stage  # 1F1B: stage s keeps pp - s micro-batches of activations
    tokens = micro_batch * seq_len
    if recompute:
        acts = (h * layers * in_flight + full_layer) * dtype_bytes * tokens
    else:
        acts = full_layer * dtype_bytes * tokens * layers * in_flight
    if stage == layout.pp - 1:
        acts += 2 * 4 * micro_batch * seq_len * padded_vocab_size(shape.vocab_size, tp) // tp
    return acts


def _memory(
    shape: Qwen3Shape,
    layout: ParallelLayout,
    micro_batch: int,
    seq_len: int,
    dtype: str,
    optimizer: str,
    stage: int,
    recompute: bool,
) -> MemoryEstimate:
    params = stage_parameters(shape, layout, stage)
    nbytes = _DTYPE_BYTES[dtype]
    opt_per_param = 8 + (0 if nbytes == 4 else 4)
    opt = params * opt_per_param
    if optimizer == "distributed_adam":
        opt = -(-opt // layout.dp)
    return MemoryEstimate(
        weights=params * nbytes,
        gradients=params * 4,
        optimizer=opt,
        activations=_activation_bytes(shape, layout, micro_batch, seq_len, nbytes, stage, recompute),
    )


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
    recompute: bool = False,
) -> PlanReport:
    """Lay out ``nodes x gpus_per_node`` GPUs as tp x pp x dp and estimate per-GPU memory.

    ``recompute=True`` assumes megatron's full activation recomputation.

    Raises:
        LayoutError: sizes that do not divide (world, layers, heads, MLP width), an unknown dtype or
            optimizer, a sequence longer than the model supports, or a rank that does not fit in
            ``gpu_memory_gb``; the message says which and why.
    """
    for name, value in (
        ("nodes", nodes),
        ("gpus_per_node", gpus_per_node),
        ("micro_batch", micro_batch),
        ("seq_len", seq_len),
    ):
        if not isinstance(value, int) or value < 1:
            raise LayoutError(f"{name} must be a positive integer, got {value!r}")
    if dtype not in _DTYPE_BYTES:
        raise LayoutError(f"dtype must be one of {sorted(_DTYPE_BYTES)}, got {dtype!r}")
    if optimizer not in OPTIMIZERS:
        raise LayoutError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    if seq_len > shape.max_position_embeddings:
        raise LayoutError(
            f"seq_len={seq_len} exceeds the model's max_position_embeddings={shape.max_position_embeddings}"
        )
    world = nodes * gpus_per_node
    layout = ParallelLayout.for_world(world, tp=tp, pp=pp)
    layout.validate(shape, world_size=world)

    notes = []
    if tp > gpus_per_node:
        notes.append(
            f"tp={tp} spans nodes (gpus_per_node={gpus_per_node}): tensor-parallel all-reduces "
            "would cross the inter-node network; keep tp <= gpus_per_node"
        )
    per_stage = tuple(stage_parameters(shape, layout, s) for s in range(pp))
    estimates = [
        _memory(shape, layout, micro_batch, seq_len, dtype, optimizer, s, recompute) for s in range(pp)
    ]
    busiest = max(estimates, key=lambda m: m.total)
    if busiest.total > gpu_memory_gb * GIB:
        raise LayoutError(
            f"tp={tp} pp={pp} dp={layout.dp}: the busiest rank needs {busiest.total / GIB:.1f} GiB "
            f"(weights {busiest.weights / GIB:.1f}, grads {busiest.gradients / GIB:.1f}, optimizer "
            f"{busiest.optimizer / GIB:.1f}, activations {busiest.activations / GIB:.1f}) > "
            f"{gpu_memory_gb:g} GiB per GPU: raise tp or pp, use distributed_adam, or lower micro_batch/seq_len"
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
        shape_name,
        shape,
        layout,
        nodes,
        gpus_per_node,
        micro_batch,
        seq_len,
        recompute,
        dtype,
        optimizer,
        gpu_memory_gb,
        shape.num_parameters(),
        per_stage,
        busiest,
        tuple(placements),
        tuple(notes),
    )


def format_plan(report: PlanReport) -> str:
    """The text ``sparrow plan`` prints."""
    lay, mem = report.layout, report.memory
    name = f" {report.shape_name}" if report.shape_name else ""
    lines = [
        f"model{name}: {report.total_parameters / 1e9:.3f} B parameters "
        f"({report.shape.num_layers} layers, hidden {report.shape.hidden_size}, "
        f"{report.shape.num_attention_heads}q/{report.shape.num_key_value_heads}kv heads)",
        f"cluster: {report.nodes} nodes x {report.gpus_per_node} GPUs = {lay.world_size} ranks",
        f"layout: TP={lay.tp} PP={lay.pp} DP={lay.dp} (rank order tp, dp, pp)",
        "parameters per GPU by pipeline stage: "
        + ", ".join(f"stage {s}: {p / 1e6:.1f} M" for s, p in enumerate(report.params_per_stage)),
        f"memory per GPU (busiest rank; {report.dtype}, {report.optimizer}, micro_batch {report.micro_batch}, "
        f"seq_len {report.seq_len}, {'full' if report.recompute else 'no'} recompute):",
        f"  weights      {mem.weights / GIB:8.2f} GiB",
        f"  gradients    {mem.gradients / GIB:8.2f} GiB",
        f"  optimizer    {mem.optimizer / GIB:8.2f} GiB",
        f"  activations  {mem.activations / GIB:8.2f} GiB",
        f"  total        {mem.total / GIB:8.2f} GiB of {report.gpu_memory_gb:g} GiB",
        "ranks:",
        "  rank  node  gpu  tp  pp  dp  layers",
    ]
    for p in report.placements:
        lines.append(
            f"  {p.rank:4d}  {p.node:4d}  {p.local_gpu:3d}  {p.tp_rank:2d}  {p.pp_rank:2d}  {p.dp_rank:2d}"
            f"  {p.layers.start}-{p.layers.stop - 1}"
        )
    lines += [f"note: {n}" for n in report.notes]
    return "\n".join(lines)
