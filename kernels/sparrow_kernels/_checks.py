"""Shape, dtype and device checks for the paged-cache kernels (host side, no device sync).

Every check raises ``ValueError`` naming the tensor and what was expected. Value checks that
would need a device-to-host copy (e.g. seq_len <= capacity) are left out on purpose: the
kernels run once per decode step and must not stall the GPU.
"""

from __future__ import annotations

import torch

from sparrow_kernels._runtime import available
from sparrow_kernels.landmarks import KeyBounds, Landmarks

_CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _is_int(t: torch.Tensor) -> bool:
    return t.dtype in (torch.int32, torch.int64)


def check_device(**tensors: torch.Tensor) -> torch.device:
    """All tensors on one device where the kernels can run (for CUDA: the current device); returns it."""
    devices = {name: t.device for name, t in tensors.items()}
    first = next(iter(devices.values()))
    for name, dev in devices.items():
        if dev != first:
            raise ValueError(
                f"{name} is on {dev} but the other tensors are on {first}; put them on one device"
            )
    if not available(first):
        raise ValueError(
            f"sparrow_kernels cannot run on {first}: needs a CUDA device, or CPU tensors with TRITON_INTERPRET=1 "
            "set before sparrow_kernels is imported (check sparrow_kernels.available(device) first)"
        )
    if first.type == "cuda" and first.index is not None and first.index != torch.cuda.current_device():
        raise ValueError(
            f"the tensors are on {first} but the current CUDA device is cuda:{torch.cuda.current_device()}; "
            "Triton launches on the current device: call torch.cuda.set_device first"
        )
    return first


def check_last_dim_contiguous(**tensors: torch.Tensor) -> None:
    """The kernels address the last dimension (head dim, page slot, batch entry) with stride 1."""
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have stride 1 in its last dimension, got strides {t.stride()}")


def check_head_dim(head_dim: int) -> None:
    """Head dims the kernels support: powers of two >= 16 (Qwen3 uses 128)."""
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head dim D must be a power of two >= 16 (tl.dot tiles), got {head_dim}")


def check_pages(k_pages: torch.Tensor, v_pages: torch.Tensor) -> tuple[int, int, int, int]:
    """k_pages, v_pages [num_pages, Hkv, page_size, D]; returns those four sizes."""
    if k_pages.dim() != 4:
        raise ValueError(f"k_pages must be [num_pages, Hkv, page_size, D], got shape {tuple(k_pages.shape)}")
    if v_pages.shape != k_pages.shape:
        raise ValueError(
            f"v_pages shape {tuple(v_pages.shape)} must equal k_pages shape {tuple(k_pages.shape)}"
        )
    if k_pages.dtype not in _CACHE_DTYPES or v_pages.dtype != k_pages.dtype:
        raise ValueError(
            f"k_pages/v_pages must share one dtype among float32/float16/bfloat16, got {k_pages.dtype}/{v_pages.dtype}"
        )
    num_pages, num_kv_heads, page_size, head_dim = k_pages.shape
    check_head_dim(head_dim)
    return num_pages, num_kv_heads, page_size, head_dim


def check_centroids(
    centroids: torch.Tensor,
    num_pages: int,
    num_kv_heads: int,
    head_dim: int,
    key_dtype: torch.dtype | None = None,
    name: str = "centroids",
) -> None:
    """``name`` (centroids, key_min or key_max) [num_pages, Hkv, D] in float32 or the key cache's dtype
    (any of the three when key_dtype is None)."""
    expected = (num_pages, num_kv_heads, head_dim)
    allowed = _CACHE_DTYPES if key_dtype is None else tuple(dict.fromkeys((torch.float32, key_dtype)))
    if tuple(centroids.shape) != expected or centroids.dtype not in allowed:
        names = "/".join(str(d).removeprefix("torch.") for d in allowed)
        raise ValueError(
            f"{name} must be {names} [num_pages, Hkv, D]={expected}, got {centroids.dtype} {tuple(centroids.shape)}"
        )


def landmark_tensors(landmarks: Landmarks) -> dict[str, torch.Tensor]:
    """The tensors of ``landmarks`` by name: {"centroids": c}, or {"key_min": lo, "key_max": hi}
    for :class:`KeyBounds` (for the shape, device and stride checks)."""
    named = (
        dict(zip(("key_min", "key_max"), landmarks, strict=True))
        if isinstance(landmarks, KeyBounds)
        else {"centroids": landmarks}
    )
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(
                f"landmarks must be a centroid tensor or sparrow_kernels.KeyBounds of two tensors, got "
                f"{type(landmarks).__name__} ({name}: {type(t).__name__})"
            )
    return named


def check_landmarks(
    landmarks: Landmarks,
    num_pages: int,
    num_kv_heads: int,
    head_dim: int,
    key_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Centroids, or :class:`KeyBounds` whose two tensors each pass :func:`check_centroids` (named
    key_min / key_max) and share one dtype. Returns the two tensors a kernel reads: (centroids,
    centroids) or (key_min, key_max)."""
    named = landmark_tensors(landmarks)
    for name, t in named.items():
        check_centroids(t, num_pages, num_kv_heads, head_dim, key_dtype, name=name)
    tensors = list(named.values())
    first, second = tensors[0], tensors[-1]  # a centroid tensor is read as both
    if first.dtype != second.dtype:
        raise ValueError(f"key_min and key_max must share one dtype, got {first.dtype} and {second.dtype}")
    return first, second


def check_block_table(block_table: torch.Tensor, batch: int | None = None) -> int:
    """block_table integer [B, max_pages_per_seq] (any B when batch is None); returns max_pages_per_seq."""
    wrong_batch = batch is not None and block_table.dim() == 2 and block_table.shape[0] != batch
    if block_table.dim() != 2 or wrong_batch or not _is_int(block_table):
        raise ValueError(
            f"block_table must be an int32/int64 [{'B' if batch is None else f'B={batch}'}, max_pages_per_seq] tensor, "
            f"got {block_table.dtype} {tuple(block_table.shape)}"
        )
    return block_table.shape[1]


def check_per_seq(name: str, t: torch.Tensor, batch: int) -> None:
    """An integer [B] tensor (seq_len, positions, budget_tokens); int32 or int64 are read as they are."""
    if t.shape != (batch,) or not _is_int(t):
        raise ValueError(
            f"{name} must be an int32/int64 [B]=[{batch}] tensor, got {t.dtype} {tuple(t.shape)}"
        )


def check_query(q: torch.Tensor, num_kv_heads: int, head_dim: int) -> int:
    """q [B, Hq, D] with Hq a multiple of Hkv; returns the GQA group size G = Hq // Hkv."""
    if q.dim() != 3 or q.shape[2] != head_dim:
        raise ValueError(f"q must be [B, Hq, D={head_dim}], got shape {tuple(q.shape)}")
    if q.dtype not in _CACHE_DTYPES:
        raise ValueError(f"q must be float32/float16/bfloat16, got {q.dtype}")
    if q.shape[1] % num_kv_heads:
        raise ValueError(f"q heads Hq={q.shape[1]} must be a multiple of KV heads Hkv={num_kv_heads}")
    return q.shape[1] // num_kv_heads


def check_page_args(
    page_size: int, sink_pages: int = 0, local_pages: int = 0, cache_page_size: int | None = None
) -> None:
    """page_size a power of two (matching the cache's page dimension when given); sink/local >= 0."""
    if cache_page_size is not None and page_size != cache_page_size:
        raise ValueError(f"page_size={page_size} does not match the cache's page dimension {cache_page_size}")
    if page_size < 1 or page_size & (page_size - 1):
        raise ValueError(f"page_size must be a power of two, got {page_size}")
    if sink_pages < 0 or local_pages < 0:
        raise ValueError(f"sink_pages and local_pages must be >= 0, got {sink_pages} and {local_pages}")


def check_budget(budget_tokens: int | torch.Tensor, batch: int) -> None:
    """budget_tokens: an int >= 0 or an integer [B] tensor (tokens; the kernels clamp it to
    [0, capacity] on the device, so a negative tensor entry keeps the sink and local pages only)."""
    if isinstance(budget_tokens, torch.Tensor):
        check_per_seq("budget_tokens", budget_tokens, batch)
        return
    if isinstance(budget_tokens, bool) or not isinstance(budget_tokens, int):
        raise ValueError(
            f"budget_tokens must be an int or an integer [B] tensor, got {type(budget_tokens).__name__}"
        )
    if budget_tokens < 0:
        raise ValueError(f"budget_tokens must be >= 0 tokens, got {budget_tokens}")
