"""A Qwen3 dense decoder in plain torch, with weights held under their Hugging Face names.

The rollout engine drives this decoder one piece at a time (attention inputs, attention output,
logits) so that it can put its own paged KV cache and sparse attention in between. Numerics follow
``transformers``' Qwen3 (RMSNorm in fp32, per-head q/k RMSNorm before rotary, SwiGLU MLP, no biases).

LoRA (DistillSparse) is applied inside :meth:`Qwen3Decoder.linears` as
``y = x @ W.T + scaling * (x @ A.T) @ B.T``; the base weights are never modified.

The q/k/v projections of a layer, and its gate/up projections, are stored as one stacked matrix each
(``Qwen3Decoder.fused``) and run as one matmul; the HF-named ``params`` entries are row views of it, so a
refit through them (``load_state``) updates the stacked matrix in place.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
import torch.nn.functional as F

import sparrow_nemo.rollout.torch.cpu_layer as cpu_layer
from sparrow_nemo.hf_qwen3 import (
    LoraAdapter,
    SafetensorsDir,
    expected_weight_shapes,
    shape_from_hf_config,
)
from sparrow_nemo.model_shapes import Qwen3Shape

#: projections that read the same input and run as one stacked matmul: (group name, HF modules)
FUSED_GROUPS = (
    ("self_attn.qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("mlp.gate_up", ("mlp.gate_proj", "mlp.up_proj")),
)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, statistics in fp32, result in ``x.dtype`` times ``weight`` (HF Qwen3's
    order of operations; torch's fused ``rms_norm`` on the fp32 copy, fewer ops per decode step)."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


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
        self.fused: dict[str, torch.Tensor] = {}
        self._fuse()
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

    def _fuse(self) -> None:
        """Stack each layer's :data:`FUSED_GROUPS` weights into ``fused`` and make ``params`` views of it."""
        for i in range(self.shape.num_layers):
            for group, modules in FUSED_GROUPS:
                names = [f"model.layers.{i}.{m}.weight" for m in modules]
                stacked = torch.cat([self.params[n] for n in names])
                start = 0
                for n in names:
                    rows = self.params[n].shape[0]
                    self.params[n] = stacked[start : start + rows]
                    start += rows
                self.fused[f"model.layers.{i}.{group}"] = stacked

    @property
    def weight_bytes(self) -> int:
        """Bytes the weights hold (0 after :meth:`release`)."""
        stacked = {id(t) for t in self.fused.values()}
        loose = [t for t in self.params.values() if t._base is None or id(t._base) not in stacked]
        return sum(t.numel() * t.element_size() for t in [*self.fused.values(), *loose])

    def release(self) -> None:
        """Free every weight (no copy is kept): the rollout engine's sleep. :meth:`allocate` and a refit restore."""
        self.params, self.fused = {}, {}

    def allocate(self, device: str | torch.device, dtype: torch.dtype) -> None:
        """Storage for every weight, uninitialised (the refit fills it): each fused group as one stacked matrix,
        its modules' entries views of it, as :meth:`_fuse` lays them out."""
        shapes = expected_weight_shapes(self.shape)
        grouped = {
            f"model.layers.{i}.{m}.weight"
            for i in range(self.shape.num_layers)
            for _, ms in FUSED_GROUPS
            for m in ms
        }
        self.params = {
            n: torch.empty(shp, dtype=dtype, device=device) for n, shp in shapes.items() if n not in grouped
        }
        for i in range(self.shape.num_layers):
            for group, modules in FUSED_GROUPS:
                names = [f"model.layers.{i}.{m}.weight" for m in modules]
                rows = [shapes[n][0] for n in names]
                stacked = torch.empty(sum(rows), shapes[names[0]][1], dtype=dtype, device=device)
                self.fused[f"model.layers.{i}.{group}"] = stacked
                for n, part in zip(names, stacked.split(rows)):
                    self.params[n] = part

    # ----------------------------------------------------------------- forward pieces
    def linear(self, module: str, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` for HF module ``module`` plus the LoRA delta when an adapter targets it."""
        return self._lora(module, x, F.linear(x, self.params[module + ".weight"]))

    def linears(self, layer: int, group: str, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The projections of :data:`FUSED_GROUPS` ``group`` of ``layer`` on ``x``, one matmul: a tuple in the
        group's module order, each with its LoRA delta (equal to :meth:`linear` of each module)."""
        return self.stacked(layer, group, x).split(self._group_sizes(layer, group), dim=-1)

    def stacked(self, layer: int, group: str, x: torch.Tensor) -> torch.Tensor:
        """:meth:`linears` side by side in one tensor ``[..., sum of the out features]`` (LoRA deltas added)."""
        prefix = f"model.layers.{layer}."
        y = F.linear(x, self.fused[prefix + group])
        if self.lora is not None:
            start = 0
            for m, size in zip(dict(FUSED_GROUPS)[group], self._group_sizes(layer, group)):
                part = y[..., start : start + size]
                part.copy_(self._lora(prefix + m, x, part))
                start += size
        return y

    def _group_sizes(self, layer: int, group: str) -> list[int]:
        prefix = f"model.layers.{layer}."
        return [self.params[prefix + m + ".weight"].shape[0] for m in dict(FUSED_GROUPS)[group]]

    def _lora(self, module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` plus the adapter's delta for ``module`` on input ``x`` (``y`` itself without one)."""
        if self.lora is not None and module in self.lora.weights:
            a, b = self.lora.weights[module]
            y = y + self.lora.scaling * F.linear(F.linear(x, a), b)
        return y

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids ``[...]`` int64 -> hidden ``[..., hidden]``."""
        return F.embedding(ids, self.params["model.embed_tokens.weight"])

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary (cos, sin) ``[..., T, 1, D]`` in ``dtype`` for absolute ``positions [..., T]``: computed
        once per forward and shared by every layer (angles in fp32)."""
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[..., None, :], emb.sin().to(dtype)[..., None, :]

    def rotary(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Rotate ``x [..., T, H, D]`` by :meth:`rope` tables (HF ``rotate_half`` convention)."""
        cos, sin = rope
        return x * cos + _rotate_half(x) * sin

    def attention_inputs(
        self,
        layer: int,
        h: torch.Tensor,
        positions: torch.Tensor,
        rope: tuple[torch.Tensor, ...] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Hidden ``h [..., T, hidden]`` at ``positions [..., T]`` -> (q ``[..., T, Hq, D]``, k, v ``[..., T, Hkv, D]``).

        q and k are RMS-normalised per head and rotated: exactly what the KV cache stores. ``rope``:
        :meth:`rope` of ``positions`` when the caller shares it over layers (computed here otherwise).
        """
        s, p = self.shape, f"model.layers.{layer}."
        if cpu_layer.supports(h) and s.head_dim <= cpu_layer.MAX_HEAD_DIM:  # one kernel per elementwise stage
            x = cpu_layer.rms_norm(h, self.params[p + "input_layernorm.weight"], s.rms_norm_eps)
            qkv = self.stacked(layer, "self_attn.qkv", x)
            q, k = cpu_layer.qk_norm_rope(
                qkv,
                (s.num_attention_heads, s.num_key_value_heads),
                self.params[p + "self_attn.q_norm.weight"],
                self.params[p + "self_attn.k_norm.weight"],
                rope or self.rope(positions, qkv.dtype),
                s.rms_norm_eps,
            )
            v = qkv[..., (s.num_attention_heads + s.num_key_value_heads) * s.head_dim :]
            return q, k, v.unflatten(-1, (s.num_key_value_heads, s.head_dim))
        x = rms_norm(h, self.params[p + "input_layernorm.weight"], s.rms_norm_eps)
        lead = x.shape[:-1]
        q, k, v = self.linears(layer, "self_attn.qkv", x)
        q = q.view(*lead, s.num_attention_heads, s.head_dim)
        k = k.view(*lead, s.num_key_value_heads, s.head_dim)
        v = v.view(*lead, s.num_key_value_heads, s.head_dim)
        q = rms_norm(q, self.params[p + "self_attn.q_norm.weight"], s.rms_norm_eps)
        k = rms_norm(k, self.params[p + "self_attn.k_norm.weight"], s.rms_norm_eps)
        rope = rope or self.rope(positions, q.dtype)
        return self.rotary(q, rope), self.rotary(k, rope), v

    def attention_output(self, layer: int, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual stream after the layer: ``h [..., hidden]``, ``attn [..., Hq, D]`` -> ``[..., hidden]``."""
        s, p = self.shape, f"model.layers.{layer}."
        o = self.linear(p + "self_attn.o_proj", attn.flatten(-2))
        norm = self.params[p + "post_attention_layernorm.weight"]
        if cpu_layer.supports(h):
            h, x = cpu_layer.add_rms_norm(h, o, norm, s.rms_norm_eps)
            act = cpu_layer.silu_mul(self.stacked(layer, "mlp.gate_up", x))
        else:
            h = h + o
            gate, up = self.linears(layer, "mlp.gate_up", rms_norm(h, norm, s.rms_norm_eps))
            act = F.silu(gate) * up
        return h + self.linear(p + "mlp.down_proj", act)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: ``[..., hidden]`` -> fp32 logits ``[..., vocab]``."""
        norm = cpu_layer.rms_norm if cpu_layer.supports(h) else rms_norm
        x = norm(h, self.params["model.norm.weight"], self.shape.rms_norm_eps)
        head = "model.embed_tokens.weight" if self.shape.tie_word_embeddings else "lm_head.weight"
        return F.linear(x, self.params[head]).float()
