"""The elementwise work of a Qwen3 decoder layer on the CPU in one kernel call each (``cpu_layer.c``).

At rollout batch sizes a small model's decode step is bound by op launches, not arithmetic: RMSNorm, the
per-head q/k norms and rotary, SwiGLU and the residual adds are ~30 torch ops per layer of a few microseconds
each. :class:`~sparrow_nemo.rollout.torch.qwen3.Qwen3Decoder` calls these instead when :func:`supports` its
tensors (CPU, fp32, the compiled library of :mod:`~sparrow_nemo.rollout.torch.cpu_attention` available); the matmuls
(and any LoRA delta) stay torch's. Results equal the torch ops' to fp32 rounding (the summation order is the
kernel's); every caller of the decoder (prefill, decode, verify, scoring) takes the same path.
"""

from __future__ import annotations

import ctypes

import torch

import sparrow_nemo.rollout.torch.cpu_attention as cpu_attention

_P, _I64, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float

#: the largest head dim the fused q/k norm + rotary takes (its per-head scratch)
MAX_HEAD_DIM = 512


def _kernels() -> ctypes.CDLL | None:
    """The loaded library with this module's argument types set (once per loaded library), or None."""
    lib = cpu_attention.library()
    if lib is None or getattr(lib, "layer_types_set", False):
        return lib
    lib.sparrow_rms_norm.argtypes = [_P, _I64, _I64, _P, _F32, _P]
    lib.sparrow_add_rms_norm.argtypes = [_P, _P, _I64, _I64, _P, _F32, _P, _P]
    lib.sparrow_qk_norm_rope.argtypes = [_P, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _F32, _P, _P]
    lib.sparrow_silu_mul.argtypes = [_P, _I64, _I64, _P]
    for fn in (
        lib.sparrow_rms_norm,
        lib.sparrow_add_rms_norm,
        lib.sparrow_qk_norm_rope,
        lib.sparrow_silu_mul,
    ):
        fn.restype = None
    lib.layer_types_set = True
    return lib


def supports(x: torch.Tensor) -> bool:
    """Whether the fused layer kernels take activations like ``x``: CPU fp32, library built, autograd off
    (the kernels record no graph: a forward under autograd keeps the torch ops)."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and not torch.is_grad_enabled()
        and _kernels() is not None
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2, -1) + eps)``: ``x [..., H]``, ``weight [H]`` fp32 -> ``[..., H]``."""
    x, out = x.contiguous(), torch.empty_like(x, memory_format=torch.contiguous_format)
    _kernels().sparrow_rms_norm(
        x.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], weight.data_ptr(), eps, out.data_ptr()
    )
    return out


def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next RMSNorm: ``h [..., H] + delta`` and its :func:`rms_norm`."""
    h, delta = h.contiguous(), delta.contiguous()
    h_out, out = torch.empty_like(h), torch.empty_like(h)
    _kernels().sparrow_add_rms_norm(
        h.data_ptr(),
        delta.data_ptr(),
        h.numel() // h.shape[-1],
        h.shape[-1],
        weight.data_ptr(),
        eps,
        h_out.data_ptr(),
        out.data_ptr(),
    )
    return h_out, out


def qk_norm_rope(
    qkv: torch.Tensor,
    heads: tuple[int, int],
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm and rotary of the q and k parts of the stacked projection.

    Args:
        qkv: ``[..., (Hq + 2 Hkv) * D]`` the q/k/v projection (q heads, then k, then v); heads: (Hq, Hkv).
        q_weight, k_weight: ``[D]`` norm weights; rope: (cos, sin) broadcastable to ``[..., 1, D]``
            (:meth:`Qwen3Decoder.rope`); eps: the norms' epsilon.

    Returns:
        (q ``[..., Hq, D]``, k ``[..., Hkv, D]``) contiguous fp32.
    """
    hq, hkv = heads
    d = q_weight.shape[0]
    lead = qkv.shape[:-1]
    rows = qkv.numel() // qkv.shape[-1]
    qkv = qkv.contiguous()
    cos, sin = (t.expand(*lead, 1, d).reshape(rows, d).contiguous() for t in rope)
    q = torch.empty(*lead, hq, d, dtype=qkv.dtype)
    k = torch.empty(*lead, hkv, d, dtype=qkv.dtype)
    _kernels().sparrow_qk_norm_rope(
        qkv.data_ptr(),
        rows,
        hq,
        hkv,
        d,
        q_weight.data_ptr(),
        k_weight.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        eps,
        q.data_ptr(),
        k.data_ptr(),
    )
    return q, k


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's ``silu(gate) * up`` of the stacked gate/up projection ``[..., 2 I]`` -> ``[..., I]``."""
    gate_up = gate_up.contiguous()
    inter = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], inter, dtype=gate_up.dtype)
    _kernels().sparrow_silu_mul(
        gate_up.data_ptr(), gate_up.numel() // gate_up.shape[-1], inter, out.data_ptr()
    )
    return out
