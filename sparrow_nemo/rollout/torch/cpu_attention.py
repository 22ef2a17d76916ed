"""Paged decode attention on the CPU that reads the KV cache in place (no per-step gather of pages).

``paged_decode_attention(q, cache, layer, block_table, seq_len, page_idx)`` computes exactly what
:func:`sparrow_nemo.sparse.attention.decode_attention` computes over the gathered pages, but in a small C
kernel (``cpu_attention.c``) that follows the block table to each page of the pool, so every key and value
is read once from where it lives, one fused pass per row (scores, fp32 softmax, p.V): dense decode (every page
of every row) streams each row's pages in order, sparse decode (a given page list, a few scattered pages per
row) touches the pages of a later row before it computes the current one. ``sparse_decode_attention`` is the engine's
sparse step: the page choice (:func:`select_pages`' rule) and that attention in one pass over the batch, the
choice a few rows ahead so the chosen pages are touched before they are read. All use the same arithmetic per
page and slot, so a budget that covers the sequence gives the dense result bit for bit.

The kernel is compiled on first use with the system C compiler (``$CC``, default ``cc``; ``-O3
-march=native``) into ``$SPARROW_CACHE/cpu_kernels/`` (default ``~/.cache/sparrow_nemo/cpu_kernels/``),
keyed by the source, the flags, the compiler and the CPU (:func:`library_path`), and loaded with ctypes (no torch headers, ~1 s). Without a
compiler, or for caches that are not fp32, :func:`available` is False and the engine keeps the torch
gather path (logged once).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch

from sparrow_nemo.rollout.torch.paged_cache import PagedKVCache

log = logging.getLogger(__name__)

#: the C sources of the one library: the decode attention (this module) and the decoder layer's elementwise
#: work (sparrow_nemo.rollout.torch.cpu_layer)
SOURCES = (Path(__file__).with_name("cpu_attention.c"), Path(__file__).with_name("cpu_layer.c"))
#: compile flags (the link step gets no -ffast-math-like flag: nothing changes the process's FP state)
CFLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp-simd", "-fPIC", "-std=c11")

_P, _I64, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


def cache_dir() -> Path:
    """``$SPARROW_CACHE/cpu_kernels``, else ``~/.cache/sparrow_nemo/cpu_kernels``."""
    base = os.environ.get("SPARROW_CACHE")
    return (Path(base) if base else Path.home() / ".cache" / "sparrow_nemo") / "cpu_kernels"


def _cpu_id() -> str:
    """The CPU model and feature flags (``-march=native`` code is only valid on the same kind of CPU)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return platform.machine() + "\n" + "\n".join(sorted(set(keep)))


def _compiler() -> tuple[str, str]:
    """(compiler command, its version line); raises OSError / CalledProcessError when there is none."""
    cc = os.environ.get("CC", "cc")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True, timeout=60)
    return cc, version.stdout.splitlines()[0] if version.stdout else cc


def library_path(cc: str, version: str) -> Path:
    """Where the library built from ``SOURCES`` with ``CFLAGS`` by compiler ``cc`` (``version``: its first
    ``--version`` line) for this CPU is cached: the file name hashes all four."""
    spec = b"\0".join(
        [
            *(source.read_bytes() for source in SOURCES),
            " ".join(CFLAGS).encode(),
            cc.encode(),
            version.encode(),
            _cpu_id().encode(),
        ]
    )
    return cache_dir() / f"cpu_attention-{hashlib.sha256(spec).hexdigest()[:16]}.so"


def _build() -> Path:
    """The compiled shared library (compiled and cached first when missing); raises on failure."""
    cc, version = _compiler()
    target = library_path(cc, version)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objs, lib = [Path(tmp) / f"k{i}.o" for i in range(len(SOURCES))], Path(tmp) / "k.so"
        compiles = [[cc, *CFLAGS, "-c", str(src), "-o", str(obj)] for src, obj in zip(SOURCES, objs)]
        for cmd in (*compiles, [cc, "-shared", *map(str, objs), "-o", str(lib)]):
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            if done.returncode:
                raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[:500]}")
        os.replace(lib, target)  # atomic: a concurrent build of the same key writes the same bytes
    log.info("compiled the CPU decode-attention kernel into %s", target)
    return target


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The loaded kernel library, or None (reason logged once) when it cannot be built here."""
    try:
        lib = ctypes.CDLL(str(_build()))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("CPU decode-attention kernel unavailable, using the torch gather path: %s", exc)
        return None
    lib.sparrow_paged_attention.argtypes = [
        _P,
        _P,
        *[_I64] * 3,
        _P,
        *[_I64] * 3,
        _P,
        _I64,
        _P,
        _P,
        *[_I64] * 6,
        _F32,
        _P,
        _P,
    ]
    lib.sparrow_paged_append.argtypes = [
        _P,
        _P,
        *[_I64] * 6,
        _P,
        _P,
        _P,
        _I64,
        _I64,
        _P,
        _I64,
        _P,
        _P,
        _P,
        *[_I64] * 4,
    ]
    lib.sparrow_select_pages.argtypes = [
        _P,
        _P,
        _P,
        _I64,
        _I64,
        _P,
        _I64,
        _P,
        _P,
        *[_I64] * 7,
        _P,
        _P,
        _P,
        _P,
        _P,
    ]
    lib.sparrow_sparse_attention.argtypes = [
        _P,
        _P,
        _P,
        _I64,
        _I64,
        _P,
        *[_I64] * 3,
        _P,
        *[_I64] * 3,
        _P,
        _I64,
        _P,
        _P,
        *[_I64] * 8,
        _F32,
        *[_P] * 7,
    ]
    for fn in (
        lib.sparrow_sparse_attention,
        lib.sparrow_paged_attention,
        lib.sparrow_paged_append,
    ):
        fn.restype = None
    lib.sparrow_select_pages.restype = None
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded library of :data:`SOURCES` (None, logged once, when it cannot be built here)."""
    return _library()


def available() -> bool:
    """Whether the compiled kernel can run on this machine (builds it on the first call)."""
    return _library() is not None


def supports(q: torch.Tensor, cache: PagedKVCache) -> bool:
    """Whether this module's kernels take these tensors: CPU, fp32 queries/keys and cache (page landmarks
    included), head dim contiguous."""
    k = cache.k_pages[0]
    return (
        q.device.type == "cpu"
        and q.dtype == torch.float32
        and k.dtype == torch.float32
        and all(pool.dtype == torch.float32 for pool in cache.landmarks(0))
        and k.stride(-1) == 1
        and available()
    )


def _landmark_args(cache: PagedKVCache, layer: int) -> tuple[int, ...]:
    """The page choice's landmark arguments: (centroids or key minima, key maxima or NULL, page stride, head
    stride); the two bound pools of a ``minmax`` cache share one layout."""
    pools = cache.landmarks(layer)
    if len(pools) == 2 and pools[0].stride() != pools[1].stride():
        raise ValueError(f"key_min[{layer}] and key_max[{layer}] must share strides for the CPU kernel")
    return (pools[0].data_ptr(), pools[1].data_ptr() if len(pools) == 2 else None, *pools[0].stride()[:2])


def _pool_args(k_pages: torch.Tensor, v_pages: torch.Tensor, table: torch.Tensor) -> tuple[int, ...]:
    """The kernels' paged-cache arguments: the key pool's address and strides of its first three dims, the
    value pool's, the block table's address and row stride (``k_pages``/``v_pages`` [pages, Hkv, ps, D] fp32,
    ``table`` [B, P] int32)."""
    return (
        k_pages.data_ptr(),
        *k_pages.stride()[:3],
        v_pages.data_ptr(),
        *v_pages.stride()[:3],
        table.data_ptr(),
        table.stride(0),
    )


def select_pages(
    q: torch.Tensor,
    cache: PagedKVCache,
    layer: int,
    block_table: torch.Tensor,
    seq_len: torch.Tensor,
    budget_tokens: torch.Tensor,
    sink_pages: int,
    local_pages: int,
) -> torch.Tensor:
    """The pages :func:`sparrow_nemo.sparse.attention.select_pages_from_centroids` (a ``minmax`` cache:
    ``select_pages_from_key_bounds``) keeps, scored on the cache's landmarks in place (no gather): [B, Hkv, n]
    int64 ascending, -1 padded. Scores are fp32 dots of the GQA group's mean query with each centroid (or its
    key-bound score); their summation order is the kernel's, so a choice between two pages whose scores agree
    to the last bits may differ from the method layer's."""
    lib = _library()
    if lib is None:
        raise RuntimeError("select_pages: the CPU kernel is not available (see available())")
    batch, hq, d = q.shape
    hkv = cache.k_pages[layer].shape[1]
    q_mean = q.float().view(batch, hkv, hq // hkv, d).mean(dim=2).contiguous()  # [B, Hkv, D]
    seq_len = seq_len.to(torch.int64).contiguous()
    table = block_table.to(torch.int32).contiguous()
    num_pages = -(-int(seq_len.max()) // cache.page_size)
    budget = budget_tokens.to(torch.int64).contiguous()
    out = torch.empty(batch, hkv, num_pages, dtype=torch.int64)
    counts = torch.empty(batch * hkv, dtype=torch.int64)
    scores = torch.empty(hkv, num_pages, dtype=torch.float32)
    scratch = torch.empty(hkv, num_pages, dtype=torch.int64)
    keep = torch.empty(hkv, num_pages, dtype=torch.uint8)
    lib.sparrow_select_pages(
        q_mean.data_ptr(),
        *_landmark_args(cache, layer),
        table.data_ptr(),
        table.stride(0),
        seq_len.data_ptr(),
        budget.data_ptr(),
        batch,
        hkv,
        d,
        num_pages,
        cache.page_size,
        sink_pages,
        local_pages,
        out.data_ptr(),
        counts.data_ptr(),
        scores.data_ptr(),
        scratch.data_ptr(),
        keep.data_ptr(),
    )
    return out[..., : int(counts.max())]


def sparse_decode_attention(
    q: torch.Tensor,
    cache: PagedKVCache,
    layer: int,
    block_table: torch.Tensor,
    seq_len: torch.Tensor,
    budget_tokens: torch.Tensor,
    sink_pages: int,
    local_pages: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sparse decode step of attention in one kernel pass over the batch: each row's page choice
    (:func:`select_pages`' rule on the cache's landmarks, the group-mean query summed then divided by G)
    and its attention over the kept pages (:func:`paged_decode_attention`'s arithmetic), the choice running a
    few rows ahead so that the chosen pages are already on their way when they are read.

    Args: as :func:`paged_decode_attention` and :func:`select_pages` (``budget_tokens [B]`` integer tokens).

    Returns:
        (``[B, Hq, D]`` fp32 attention, ``[B, Hkv, n]`` int64 the kept pages ascending, -1 padded).
    """
    lib = _library()
    if lib is None:
        raise RuntimeError("sparse_decode_attention: the CPU kernel is not available (see available())")
    k_pages, v_pages = cache.k_pages[layer], cache.v_pages[layer]
    batch, hq, d = q.shape
    hkv, ps = k_pages.shape[1], cache.page_size
    group = hq // hkv
    seq_len = seq_len.to(torch.int64).contiguous()
    table = block_table.to(torch.int32).contiguous()
    budget = budget_tokens.to(torch.int64).contiguous()
    q = q.float().contiguous()
    num_pages = -(-int(seq_len.max()) // ps)
    out = torch.empty(batch, hq, d, dtype=torch.float32)
    page_idx = torch.empty(batch, hkv, num_pages, dtype=torch.int64)
    counts = torch.empty(batch * hkv, dtype=torch.int64)
    work = torch.empty(hkv * (group * num_pages * ps + d), dtype=torch.float32)
    scores = torch.empty(hkv, num_pages, dtype=torch.float32)
    scratch = torch.empty(hkv, num_pages, dtype=torch.int64)
    keep = torch.empty(hkv, num_pages, dtype=torch.uint8)
    lib.sparrow_sparse_attention(
        q.data_ptr(),
        *_landmark_args(cache, layer),
        *_pool_args(k_pages, v_pages, table),
        seq_len.data_ptr(),
        budget.data_ptr(),
        batch,
        hkv,
        group,
        d,
        num_pages,
        ps,
        sink_pages,
        local_pages,
        1.0 / d**0.5,
        out.data_ptr(),
        page_idx.data_ptr(),
        counts.data_ptr(),
        work.data_ptr(),
        scores.data_ptr(),
        scratch.data_ptr(),
        keep.data_ptr(),
    )
    return out, page_idx


def paged_append(
    cache: PagedKVCache,
    layer: int,
    block_table: torch.Tensor,
    positions: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
) -> None:
    """:meth:`PagedKVCache.append` in one kernel call: ``k_new, v_new [B, Hkv, D]`` fp32 stored at
    ``positions [B]`` (pages reserved in ``block_table``), each page's landmarks (centroid or key bounds)
    updated incrementally."""
    lib = _library()
    if lib is None:
        raise RuntimeError("paged_append: the CPU kernel is not available (see available())")
    k_pages, v_pages = cache.k_pages[layer], cache.v_pages[layer]
    marks, key_max, *mark_strides = _landmark_args(cache, layer)
    centroids, key_min = (None, marks) if key_max else (marks, None)
    table = block_table.to(torch.int32).contiguous()
    positions = positions.to(torch.int64).contiguous()
    k_new, v_new = k_new.float().contiguous(), v_new.float().contiguous()
    batch, hkv, d = k_new.shape
    lib.sparrow_paged_append(
        k_pages.data_ptr(),
        v_pages.data_ptr(),
        *k_pages.stride()[:3],
        *v_pages.stride()[:3],
        centroids,
        key_min,
        key_max,
        *mark_strides,
        table.data_ptr(),
        table.stride(0),
        positions.data_ptr(),
        k_new.data_ptr(),
        v_new.data_ptr(),
        batch,
        hkv,
        d,
        cache.page_size,
    )


def paged_decode_attention(
    q: torch.Tensor,
    cache: PagedKVCache,
    layer: int,
    block_table: torch.Tensor,
    seq_len: torch.Tensor,
    page_idx: torch.Tensor | None,
) -> torch.Tensor:
    """One decode step of attention over the pages of each (row, KV head), read in place.

    Args:
        q: [B, Hq, D] fp32 queries (Hq a multiple of the cache's KV heads).
        cache, layer: the paged cache (fp32) and the layer to read; the current token already appended.
        block_table: [B, max_pages] int32; seq_len: [B] tokens incl. the current one (>= 1).
        page_idx: [B, Hkv, n] int64 logical pages per (row, KV head), -1 padded (the sparse rule's choice);
            None = every page of every row (dense).

    Returns:
        [B, Hq, D] fp32: softmax(q.K / sqrt(D)) . V over the valid slots of those pages.
    """
    lib = _library()
    if lib is None:
        raise RuntimeError("paged_decode_attention: the CPU kernel is not available (see available())")
    k_pages, v_pages = cache.k_pages[layer], cache.v_pages[layer]
    batch, hq, d = q.shape
    hkv, ps = k_pages.shape[1], cache.page_size
    group = hq // hkv
    seq_len = seq_len.to(torch.int64).contiguous()
    table = block_table.to(torch.int32).contiguous()
    q = q.contiguous()
    out = torch.empty(batch, hq, d, dtype=torch.float32)
    if page_idx is None:  # dense: pages 0 .. n-1 of every row, in order
        n = -(-int(seq_len.max()) // ps)
    else:  # sparse: the listed pages, those of a later row touched first
        page_idx = page_idx.to(torch.int64).contiguous()
        n = page_idx.shape[-1]
    work = torch.empty(hkv, group, n * ps, dtype=torch.float32)
    lib.sparrow_paged_attention(
        q.data_ptr(),
        *_pool_args(k_pages, v_pages, table),
        seq_len.data_ptr(),
        None if page_idx is None else page_idx.data_ptr(),
        n,
        batch,
        hkv,
        group,
        d,
        ps,
        1.0 / d**0.5,
        out.data_ptr(),
        work.data_ptr(),
    )
    return out


@functools.cache
def _verify_kernel():
    """``sparrow_paged_verify_attention`` of the loaded library with its argument types (None without one)."""
    lib = _library()
    if lib is None:
        return None
    fn = lib.sparrow_paged_verify_attention
    fn.argtypes = [_P, _P, *[_I64] * 3, _P, *[_I64] * 3, _P, _I64, _P, _P, *[_I64] * 6, _F32, _P, _P]
    fn.restype = None
    return fn


def paged_verify_attention(
    q: torch.Tensor,
    cache: PagedKVCache,
    layer: int,
    block_table: torch.Tensor,
    start: torch.Tensor,
    num_queries: torch.Tensor,
) -> torch.Tensor:
    """Dense causal attention of a few query positions per row over the paged cache, read in place (the
    speculative verify pass): query i of row b sits at cache position ``start[b] + i`` and attends to
    positions 0 .. start[b] + i, whose keys/values are already stored.

    Args:
        q: [B, T, Hq, D] fp32 (Hq a multiple of the cache's KV heads).
        cache, layer: the paged cache (fp32) and the layer to read.
        block_table: [B, max_pages] int32 with pages for positions below ``start + num_queries``.
        start: [B] int64 tokens cached before the first query; num_queries: [B] int64 in 1 .. T, the queries
            of each row that are computed (the rest of the output is 0, and their positions are never read).

    Returns:
        [B, T, Hq, D] fp32: per query softmax(q.K / sqrt(D)) . V over its visible positions. Every key and
        value of a (row, KV head) is read once for all of its queries and query heads.
    """
    fn = _verify_kernel()
    if fn is None:
        raise RuntimeError("paged_verify_attention: the CPU kernel is not available (see available())")
    k_pages, v_pages = cache.k_pages[layer], cache.v_pages[layer]
    batch, t, hq, d = q.shape
    hkv, ps = k_pages.shape[1], cache.page_size
    start = start.to(torch.int64).contiguous()
    num_queries = num_queries.to(torch.int64).contiguous()
    table = block_table.to(torch.int32).contiguous()
    q = q.float().contiguous()
    out = torch.empty(batch, t, hq, d, dtype=torch.float32)
    group = hq // hkv
    vectors = -(-t * group // 16)  # query rows per KV head on the kernel's 16 lanes
    work = torch.empty(2 * hkv * vectors * d * 16, dtype=torch.float32)
    fn(
        q.data_ptr(),
        *_pool_args(k_pages, v_pages, table),
        start.data_ptr(),
        num_queries.data_ptr(),
        batch,
        t,
        hkv,
        group,
        d,
        ps,
        1.0 / d**0.5,
        out.data_ptr(),
        work.data_ptr(),
    )
    return out
