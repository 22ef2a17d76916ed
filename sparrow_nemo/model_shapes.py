"""Qwen3 decoder shapes: named presets from the public model configs, plus tiny CPU sizes.

One framework-free description of the architecture that the policy (megatron-core), the
rollout engines and the cost model all read. Units: counts of elements, never bytes,
except where a method name says ``bytes``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

from sparrow_nemo.config.schema import Invalid, Section, choices, knob, suggest


@dataclass(frozen=True)
class Qwen3Shape:
    """The shape of a Qwen3 dense decoder (RMSNorm, SwiGLU, rotary, GQA, per-head q/k RMSNorm).

    Attributes:
        num_layers: decoder layers.
        hidden_size: residual stream width.
        num_attention_heads: query heads (Hq).
        num_key_value_heads: key/value heads (Hkv); Hq must be a multiple of it.
        head_dim: width of one attention head (Qwen3: 128, independent of hidden_size).
        intermediate_size: SwiGLU inner width.
        vocab_size: embedding rows / output classes.
        tie_word_embeddings: the output projection shares the input embedding.
        rms_norm_eps: epsilon of every RMSNorm.
        rope_theta: rotary base.
        max_position_embeddings: longest supported context, tokens.
        eos_token_id: end-of-sequence token id of the tokenizer the preset ships with.
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40_960
    eos_token_id: int = 151_645

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "max_position_embeddings",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"Qwen3Shape.{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"Qwen3Shape: num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads} (GQA needs whole groups)"
            )

    @property
    def gqa_group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_attention_heads // self.num_key_value_heads

    def layer_parameters(self) -> int:
        """Parameters of one decoder layer (attention, MLP, the two norms, q/k norms)."""
        h, d = self.hidden_size, self.head_dim
        q = h * self.num_attention_heads * d
        kv = 2 * h * self.num_key_value_heads * d
        o = self.num_attention_heads * d * h
        mlp = 3 * h * self.intermediate_size
        norms = 2 * h + 2 * d
        return q + kv + o + mlp + norms

    def num_parameters(self) -> int:
        """All parameters, counting a tied embedding once."""
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        return embed + head + self.num_layers * self.layer_parameters() + self.hidden_size

    def non_embedding_parameters(self) -> int:
        """Parameters touched per token apart from the embedding lookup (includes the LM head)."""
        return self.num_layers * self.layer_parameters() + self.vocab_size * self.hidden_size

    def kv_elements_per_token(self) -> int:
        """KV-cache elements one token occupies over all layers (keys and values)."""
        return 2 * self.num_layers * self.num_key_value_heads * self.head_dim

    def replace(self, **changes: object) -> Qwen3Shape:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


def _qwen3(layers: int, hidden: int, heads: int, intermediate: int, tied: bool) -> Qwen3Shape:
    return Qwen3Shape(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=intermediate,
        vocab_size=151_936,
        tie_word_embeddings=tied,
    )


#: Public Qwen3 configs (docs/METHOD.md table) and tiny CPU sizes. ``tiny`` is what the embedded
#: default recipe trains; ``tiny-test`` is the smallest shape the unit tests build.
PRESETS: dict[str, Qwen3Shape] = {
    "qwen3-0.6b": _qwen3(28, 1024, 16, 3072, tied=True),
    "qwen3-1.7b": _qwen3(28, 2048, 16, 6144, tied=True),
    "qwen3-4b": _qwen3(36, 2560, 32, 9728, tied=True),
    "qwen3-8b": _qwen3(36, 4096, 32, 12288, tied=False),
    "qwen3-14b": _qwen3(40, 5120, 40, 17408, tied=False),
    "tiny": Qwen3Shape(
        num_layers=4,
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=384,
        vocab_size=128,
        tie_word_embeddings=False,
        rope_theta=10_000.0,
        max_position_embeddings=4096,
        eos_token_id=2,
    ),
    "tiny-test": Qwen3Shape(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=96,
        tie_word_embeddings=False,
        rope_theta=10_000.0,
        max_position_embeddings=1024,
        eos_token_id=2,
    ),
}


def get_shape(name: str) -> Qwen3Shape:
    """The preset called ``name`` (case-insensitive); a clear error lists the known names."""
    key = name.lower()
    if key not in PRESETS:
        raise KeyError(f"unknown model preset '{name}'; known presets: {', '.join(PRESETS)}")
    return PRESETS[key]


# ----- the recipe's ``model`` section ------------------------------------------------------------
@dataclass(frozen=True)
class ModelConfig(Section):
    """The Qwen3 architecture and its weights."""

    preset: str | None = knob(
        "tiny",
        "shape preset (sparrow_nemo.model_shapes.PRESETS); null = every shape field in shape_overrides",
    )
    shape_overrides: dict[str, Any] = knob(
        doc="Qwen3Shape fields that replace the preset's (e.g. {num_layers: 2}); add keys with ++",
        factory=dict,
    )
    hf_checkpoint: str | None = knob(
        None, "Hugging Face Qwen3 checkpoint folder (config.json + safetensors); null = random init"
    )
    dtype: Literal["fp32", "bf16", "fp16"] = knob("fp32", "dtype of the weights the rollout engine holds")

    def shape(self) -> Qwen3Shape:
        """The resolved :class:`Qwen3Shape` (preset plus overrides)."""
        if self.preset is None:
            return Qwen3Shape(**self.shape_overrides)
        return PRESETS[self.preset.lower()].replace(**self.shape_overrides)

    def check(self) -> None:
        if self.preset is not None and self.preset.lower() not in PRESETS:
            raise self.invalid("preset", f"one of {choices(PRESETS)}{suggest(self.preset, PRESETS)}")
        fields = dataclasses.fields(Qwen3Shape)
        names = [f.name for f in fields]
        types_ = {f.name: f.type for f in fields}
        for key, value in self.shape_overrides.items():
            if key not in names:
                raise self.invalid(
                    f"shape_overrides.{key}", f"a Qwen3Shape field ({', '.join(names)}){suggest(key, names)}"
                )
            expected = _SHAPE_TYPES[types_[key]]
            if not _is_shape_value(value, types_[key]):
                raise Invalid("ModelConfig", f"shape_overrides.{key}", value, expected)
        if self.preset is None:
            missing = [
                f.name
                for f in fields
                if f.default is dataclasses.MISSING and f.name not in self.shape_overrides
            ]
            if missing:
                raise self.invalid(
                    "shape_overrides",
                    f"every required Qwen3Shape field when preset=null; missing: {', '.join(missing)}",
                )
        try:
            self.shape()
        except ValueError as exc:
            raise self.invalid("shape_overrides", f"a valid Qwen3Shape ({exc})") from exc


#: Qwen3Shape field annotation (a string under ``from __future__ import annotations``) -> its words
_SHAPE_TYPES = {"int": "an integer", "float": "a number", "bool": "true or false"}


def _is_shape_value(value: Any, annotation: str) -> bool:
    if annotation == "bool":
        return isinstance(value, bool)
    if annotation == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
