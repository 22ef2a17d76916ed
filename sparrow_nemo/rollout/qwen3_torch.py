"""A Qwen3 dense decoder in plain torch, with weights held under their Hugging Face names.

The rollout engine drives this decoder one piece at a time (attention inputs, attention output,
logits) so that it can put its own paged KV cache and sparse attention in between. Numerics follow
``transformers``' Qwen3 (RMSNorm in fp32, per-head q/k RMSNorm before rotary, SwiGLU MLP, no biases).

LoRA (DistillSparse) is applied inside :meth:`Qwen3Decoder.linear` as
``y = x @ W.T + scaling * (x @ A.T) @ B.T``; the base weights are never modified.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
import torch.nn.functional as F

from sparrow_nemo.hf_qwen3 import (
    LoraAdapter,
    SafetensorsDir,
    expected_weight_shapes,
    shape_from_hf_config,
)
from sparrow_nemo.model_shapes import Qwen3Shape


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, statistics in fp32, result in ``x.dtype`` times ``weight``."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Qwen3Decoder:
    """Qwen3 weights (HF names, in ``params``) and the per-layer forward pieces.

    Tensor conventions: hidden states ``[..., hidden]``; per-head tensors ``[..., heads, head_dim]``;
    positions are absolute token indices (int64). Everything runs in the weights' dtype except the
    RMSNorm statistics (fp32) and rotary angles (computed in fp32, cast to the activations' dtype).
    """

    def __init__(self, shape: Qwen3Shape, params: dict[str, torch.Tensor]) -> None:
        expected = expected_weight_shapes(shape)
        missing = sorted(set(expected) - set(params))
        if missing:
            raise ValueError(
                f"Qwen3 weights: missing tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}"
            )
        self.shape = shape
        self.params: dict[str, torch.Tensor] = {}
        for name, want in expected.items():
            got = tuple(params[name].shape)
            if got != want:
                raise ValueError(f"Qwen3 weights: tensor '{name}' has shape {got}, expected {want}")
            self.params[name] = params[name]
        d = shape.head_dim
        inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        self.inv_freq = inv_freq.to(self.params["model.embed_tokens.weight"].device)
        self.lora: LoraAdapter | None = None

    # ----------------------------------------------------------------- construction
    @classmethod
    def random(
        cls,
        shape: Qwen3Shape,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> Qwen3Decoder:
        """Random weights (normal, std 0.02; norm weights 1 + N(0, 0.1)) from a private generator."""
        gen = torch.Generator().manual_seed(seed)
        params = {}
        for name, shp in expected_weight_shapes(shape).items():
            if name.endswith("norm.weight"):
                t = 1.0 + 0.1 * torch.randn(shp, generator=gen)
            else:
                t = 0.02 * torch.randn(shp, generator=gen)
            params[name] = t.to(device=device, dtype=dtype)
        return cls(shape, params)

    @classmethod
    def from_hf_dir(
        cls, path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
    ) -> Qwen3Decoder:
        """Load an HF Qwen3 checkpoint directory (``config.json`` + single or sharded safetensors).

        Reads the config with :func:`sparrow_nemo.hf_qwen3.shape_from_hf_config` (one parser for the project) and refuses a
        sliding-window config, which this decoder does not implement. A tensor of the wrong shape is a
        ValueError naming it and both shapes; a missing one a KeyError naming it and the directory.
        """
        ckpt = SafetensorsDir(path)
        config = ckpt.config()
        if config.get("use_sliding_window"):
            raise ValueError(
                f"{path}/config.json: use_sliding_window=true is not supported by the rollout decoder"
            )
        shape = shape_from_hf_config(config)
        params = {}
        for name, want in expected_weight_shapes(shape).items():
            tensor = ckpt.get(name)
            if tuple(tensor.shape) != want:
                raise ValueError(
                    f"{path}: tensor '{name}' has shape {tuple(tensor.shape)}, expected {want} from config.json"
                )
            params[name] = tensor.to(device=device, dtype=dtype)
        return cls(shape, params)

    @property
    def device(self) -> torch.device:
        return self.params["model.embed_tokens.weight"].device

    @property
    def dtype(self) -> torch.dtype:
        return self.params["model.embed_tokens.weight"].dtype

    # ----------------------------------------------------------------- weights
    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Copy HF-named tensors into the existing parameters in place (a refit, no re-allocation).

        A subset of the names may be given. ``lm_head.weight`` is ignored when the embeddings are tied.
        Raises KeyError for an unknown name and ValueError naming the tensor and both shapes on mismatch.
        """
        for name, value in state.items():
            if name == "lm_head.weight" and self.shape.tie_word_embeddings:
                continue
            if name not in self.params:
                raise KeyError(f"update_weights: unknown tensor '{name}' for this Qwen3 shape")
            if tuple(value.shape) != tuple(self.params[name].shape):
                raise ValueError(
                    f"update_weights: tensor '{name}' has shape {tuple(value.shape)}, "
                    f"expected {tuple(self.params[name].shape)}"
                )
        with torch.no_grad():
            for name, value in state.items():
                if name in self.params:
                    self.params[name].copy_(value)

    def to(self, device: str | torch.device) -> None:
        """Move all weights (and the LoRA adapter) to ``device``."""
        self.params = {k: v.to(device) for k, v in self.params.items()}
        self.inv_freq = self.inv_freq.to(device)
        if self.lora is not None:
            self.lora = self.lora.to(device=device)

    # ----------------------------------------------------------------- forward pieces
    def linear(self, module: str, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` for HF module ``module`` plus the LoRA delta when an adapter targets it."""
        y = F.linear(x, self.params[module + ".weight"])
        if self.lora is not None and module in self.lora.weights:
            a, b = self.lora.weights[module]
            y = y + self.lora.scaling * F.linear(F.linear(x, a), b)
        return y

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids ``[...]`` int64 -> hidden ``[..., hidden]``."""
        return F.embedding(ids, self.params["model.embed_tokens.weight"])

    def rotary(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [..., T, H, D]`` by absolute ``positions [..., T]`` (HF ``rotate_half`` convention)."""
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype)[..., None, :], emb.sin().to(x.dtype)[..., None, :]
        return x * cos + _rotate_half(x) * sin

    def attention_inputs(
        self, layer: int, h: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Hidden ``h [..., T, hidden]`` -> (q ``[..., T, Hq, D]``, k, v ``[..., T, Hkv, D]``).

        q and k are RMS-normalised per head and rotated: exactly what the KV cache stores.
        """
        s, p = self.shape, f"model.layers.{layer}."
        x = rms_norm(h, self.params[p + "input_layernorm.weight"], s.rms_norm_eps)
        lead = x.shape[:-1]
        q = self.linear(p + "self_attn.q_proj", x).view(*lead, s.num_attention_heads, s.head_dim)
        k = self.linear(p + "self_attn.k_proj", x).view(*lead, s.num_key_value_heads, s.head_dim)
        v = self.linear(p + "self_attn.v_proj", x).view(*lead, s.num_key_value_heads, s.head_dim)
        q = rms_norm(q, self.params[p + "self_attn.q_norm.weight"], s.rms_norm_eps)
        k = rms_norm(k, self.params[p + "self_attn.k_norm.weight"], s.rms_norm_eps)
        return self.rotary(q, positions), self.rotary(k, positions), v

    def attention_output(self, layer: int, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual stream after the layer: ``h [..., hidden]``, ``attn [..., Hq, D]`` -> ``[..., hidden]``."""
        s, p = self.shape, f"model.layers.{layer}."
        h = h + self.linear(p + "self_attn.o_proj", attn.flatten(-2))
        x = rms_norm(h, self.params[p + "post_attention_layernorm.weight"], s.rms_norm_eps)
        gate = F.silu(self.linear(p + "mlp.gate_proj", x))
        return h + self.linear(p + "mlp.down_proj", gate * self.linear(p + "mlp.up_proj", x))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: ``[..., hidden]`` -> fp32 logits ``[..., vocab]``."""
        x = rms_norm(h, self.params["model.norm.weight"], self.shape.rms_norm_eps)
        head = "model.embed_tokens.weight" if self.shape.tie_word_embeddings else "lm_head.weight"
        return F.linear(x, self.params[head]).float()
