"""Build the Qwen3 decoder as a megatron-core ``GPTModel`` for this rank's tensor/pipeline shard.

Layer spec: megatron-core's Transformer Engine spec (fused kernels, bf16, optional FP8) when a GPU
and Transformer Engine are present, else its local spec with causal SDPA core attention and
SP-capable norms (:mod:`sparrow_nemo.policy.local_spec`; megatron's local ``DotProductAttention``
would build ``[S, S]`` scores). The two specs name
two parameters differently (TE fuses the pre-attention / pre-MLP RMSNorm into the following linear);
:mod:`sparrow_nemo.policy.hf_import` maps both to the same Hugging Face names, so checkpoints are
interchangeable.

The model (:class:`~sparrow_nemo.policy.hidden_model.HiddenStateGPTModel`) returns the final hidden states ``[S, B, H]`` on the last
stage instead of logits: the output layer runs fused with the logprobs, in chunks
(:func:`sparrow_nemo.policy.logprobs.policy_outputs`), so the ``[S, V]`` logits never exist. Activation
recompute and sequence parallelism come from :class:`~sparrow_nemo.policy.memory.MemorySettings`, the
object ``sparrow plan`` prices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sparrow_nemo._optional import is_available
from sparrow_nemo.hf_qwen3 import resolve_dtype
from sparrow_nemo.model_shapes import Qwen3Shape
from sparrow_nemo.policy.memory import DEFAULT_MEMORY, MemorySettings
from sparrow_nemo.policy.parallel import ParallelLayout

#: megatron's default ``make_vocab_size_divisible_by``: the padded vocab is a multiple of this times tp.
VOCAB_MULTIPLE = 128


def padded_vocab_size(vocab_size: int, tp: int, multiple: int = VOCAB_MULTIPLE) -> int:
    """Vocab rows in the megatron model: ``vocab_size`` rounded up to a multiple of ``multiple * tp``.

    The extra rows are never real tokens: :mod:`sparrow_nemo.policy.logprobs` masks them out.
    """
    step = multiple * tp
    return -(-vocab_size // step) * step


@dataclass(frozen=True)
class PolicyModelSpec:
    """What was built on this rank (for import/export and logprobs).

    Attributes:
        shape: the model.
        layout: the parallel layout.
        padded_vocab: vocab rows of the megatron embedding / output layer (all TP shards together).
        use_te: built with the Transformer Engine layer spec.
        pp_rank, tp_rank: this rank's pipeline stage and tensor-parallel index.
        memory: the recompute / sequence-parallel / logprob-chunk settings it was built with.
    """

    shape: Qwen3Shape
    layout: ParallelLayout
    padded_vocab: int
    use_te: bool
    pp_rank: int
    tp_rank: int
    memory: MemorySettings = DEFAULT_MEMORY

    @property
    def sequence_multiple(self) -> int:
        """Micro-batch widths are padded to a multiple of this (tp under sequence parallelism, else 1)."""
        return self.layout.tp if self.memory.sequence_parallel else 1

    @property
    def pre_process(self) -> bool:
        """This stage holds the input embedding."""
        return self.pp_rank == 0

    @property
    def post_process(self) -> bool:
        """This stage holds the final norm and the output layer."""
        return self.pp_rank == self.layout.pp - 1


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The ``GPTModel`` inside wrappers such as megatron's ``DistributedDataParallel`` (``.module`` chain)."""
    while hasattr(model, "module"):
        model = model.module
    return model


def transformer_engine_usable() -> bool:
    """True when a GPU and Transformer Engine are both present."""
    return torch.cuda.is_available() and is_available("transformer_engine")


def build_transformer_config(
    shape: Qwen3Shape,
    layout: ParallelLayout,
    dtype: str | torch.dtype = "float32",
    fp8: str | None = None,
    memory: MemorySettings = DEFAULT_MEMORY,
):
    """megatron-core ``TransformerConfig`` equal to Hugging Face's Qwen3 architecture.

    Args:
        shape: the model.
        layout: tensor / pipeline sizes.
        dtype: parameter and compute dtype (``float32`` on CPU tests, ``bfloat16`` on GPU).
        fp8: ``None``, ``"e4m3"`` or ``"hybrid"``; only with Transformer Engine on GPU.
        memory: activation recompute and sequence parallelism (validated against the layout).
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch_dtype = resolve_dtype(dtype)
    on_gpu = torch.cuda.is_available()
    if fp8 is not None and not transformer_engine_usable():
        raise ValueError(f"fp8={fp8!r} needs a GPU with Transformer Engine installed")
    memory.validate(shape.num_layers, layout)
    return TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.intermediate_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_key_value_heads,
        kv_channels=shape.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=shape.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        qk_layernorm=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        params_dtype=torch_dtype,
        pipeline_dtype=torch_dtype,
        bf16=torch_dtype == torch.bfloat16,
        fp16=torch_dtype == torch.float16,
        fp8=fp8,
        use_cpu_initialization=not on_gpu,
        # micro-batches are cut to their own longest row: pipeline stages exchange shapes first
        variable_seq_lengths=layout.pp > 1,
        moe_token_dispatcher_type="alltoall",  # no MoE here; megatron refuses the default with the above
        **memory.transformer_config_kwargs(),
    )


def build_model(
    shape: Qwen3Shape,
    layout: ParallelLayout,
    dtype: str | torch.dtype = "float32",
    use_te: bool | None = None,
    fp8: str | None = None,
    memory: MemorySettings = DEFAULT_MEMORY,
):
    """This rank's ``GPTModel`` shard (parallel_state must be initialized; see ``initialize_parallel``).

    Args:
        use_te: ``None`` = Transformer Engine spec when usable, else local; ``True`` requires it.
        memory: activation recompute, sequence parallelism and the logprob chunk.

    Returns:
        ``(model, spec)``: the ``HiddenStateGPTModel`` (on CUDA when available) and a
        :class:`PolicyModelSpec`.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    from sparrow_nemo.policy.hidden_model import HiddenStateGPTModel
    from sparrow_nemo.policy.local_spec import local_block_spec

    if use_te is None:
        use_te = transformer_engine_usable()
    elif use_te and not transformer_engine_usable():
        raise ValueError("use_te=True needs a GPU with Transformer Engine installed")
    if memory.sequence_parallel and not torch.cuda.is_available():
        raise ValueError(
            "policy.sequence_parallel needs a GPU: megatron-core allocates its sequence-parallel "
            "all-gather / reduce-scatter buffers on CUDA"
        )
    config = build_transformer_config(shape, layout, dtype, fp8, memory)
    if use_te:
        layer_spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=True)
    else:
        layer_spec = local_block_spec(config, parallel_state.get_pipeline_model_parallel_rank())
    spec = PolicyModelSpec(
        shape=shape,
        layout=layout,
        padded_vocab=padded_vocab_size(shape.vocab_size, layout.tp),
        use_te=use_te,
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        memory=memory,
    )
    model = HiddenStateGPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=spec.padded_vocab,
        max_sequence_length=shape.max_position_embeddings,
        pre_process=spec.pre_process,
        post_process=spec.post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=shape.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(shape.rope_theta),
    )
    if torch.cuda.is_available():
        model = model.cuda()
    return model, spec
