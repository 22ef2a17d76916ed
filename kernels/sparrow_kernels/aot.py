"""Compile every kernel ahead of time for a CUDA architecture, without a GPU, as the JIT would.

Triton's interpreter (the CPU test path) accepts programs the GPU compiler rejects (tl.dot tile
sizes, loop-carried type changes, shared-memory overflow), and says nothing about registers or
whether the K/V tiles really stream. This module runs the real entry points at the Qwen3-8B decode
shape (Hq 32, Hkv 8, D 128, bf16 cache and centroids, 32K-token block tables) on CPU tensors
inside ``recorded_launches()``, so every launch is configured exactly as on the GPU; then it gives
each recorded launch to Triton's own argument binder, which applies the JIT's specialisation (16-
divisible integers and 16-byte aligned pointers get ``tt.divisibility = 16``, integers equal to 1
become constants), and lowers it through the full pipeline to a cubin for ``--arch`` (default 90 =
H100/H200). Per kernel it reports:

- ``reg``, ``local`` (spill bytes), ``shared`` (bytes, Triton's allocation) and ``blocks_per_sm``
  (the occupancy limit from registers, shared memory and threads, H100/H200 SM limits);
- ``tensor_core_mma``: MMA instructions in the PTX;
- ``async_tile_copies``: asynchronous global->shared copies of [tile, D] tiles of the cache dtype
  in the pipelined IR (K and V tiles for attention, centroid or key_min and key_max tiles for the selection),
  ``ring_depth`` (shared-memory buffers per ring) and ``wait_depth`` (copy groups left in flight
  at the loop's wait: > 0 means the next tiles load while the current one is computed).

It needs triton's bundled ptxas/cuobjdump, not a GPU or a driver. Triton internals used (Triton
3.9): ``triton.runtime.jit.create_function_from_signature`` and ``JITFunction._pack_args``.

    python -m sparrow_kernels.aot [--arch 90] > benchmarks/results/aot_sm90.jsonl   (TRITON_INTERPRET unset)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

#: SM limits of H100/H200 (sm_90): registers, shared memory incl. the 1 KB per block the driver reserves,
#: resident warps and blocks.
_REGS_PER_SM, _SMEM_PER_SM, _SMEM_RESERVED, _WARPS_PER_SM, _BLOCKS_PER_SM = 65536, 233472, 1024, 64, 32


def qwen3_8b_launches() -> Iterator[tuple[str, Any]]:
    """(label, Launch) for every kernel variant of one Qwen3-8B decode step, a dense layer, a split
    merge, an fp32 cache, a k = 8 verify pass, and the ``minmax`` page score's append and selection
    (bf16 key bounds), recorded from the public entry points."""
    import sparrow_kernels as sk

    batch, hq, hkv, d, page = 2, 32, 8, 128, 16
    max_pages = 32768 // page
    num_pages = 4  # never read: the launches are only compiled

    def pages(dtype: torch.dtype, *shape: int) -> torch.Tensor:
        """A small pool: its strides are the real ones (they do not depend on the page count)."""
        return torch.zeros(num_pages, *shape, dtype=dtype)

    block_table = torch.zeros(batch, max_pages, dtype=torch.int32)
    seq_len = torch.zeros(batch, dtype=torch.int32)
    budget = torch.zeros(batch, dtype=torch.int64)  # the schedule's int64 budgets, read as they are
    with sk.recorded_launches() as launches:
        k, v, cent = (
            pages(torch.bfloat16, hkv, page, d),
            pages(torch.bfloat16, hkv, page, d),
            pages(torch.bfloat16, hkv, d),
        )
        kv_new = torch.zeros(batch, hkv, d, dtype=torch.bfloat16)
        q = torch.zeros(batch, hq, d, dtype=torch.bfloat16)
        sk.append_kv(k, v, cent, block_table, seq_len, kv_new, kv_new)
        selection = sk.page_selection(q, cent, block_table, seq_len, budget)
        sk.decode_attention_paged(q, k, v, block_table, seq_len, selection, num_splits=1)
        sk.decode_attention_paged(q, k, v, block_table, seq_len, selection, num_splits=4)
        sk.decode_attention_paged(q, k, v, block_table, seq_len, None, num_splits=1)
        sk.verify_attention_paged(torch.zeros(batch, 9, hq, d, dtype=torch.bfloat16), k, v, block_table, seq_len,
                                  num_splits=1)  # fmt: skip
        k32, v32 = pages(torch.float32, hkv, page, d), pages(torch.float32, hkv, page, d)
        sk.decode_attention_paged(q.float(), k32, v32, block_table, seq_len, selection, num_splits=1)
        bounds = sk.KeyBounds(pages(torch.bfloat16, hkv, d), pages(torch.bfloat16, hkv, d))
        sk.append_kv(k, v, bounds, block_table, seq_len, kv_new, kv_new)
        sk.page_selection(q, bounds, block_table, seq_len, budget)
    labels = ["append", "select", "decode_sparse", "decode_sparse_split4", "decode_dense", "verify_k8",
              "decode_sparse_fp32", "append_minmax", "select_minmax"]  # fmt: skip
    yield from zip(labels, launches, strict=True)


def _resource_usage(cubin: bytes, cuobjdump: Path) -> dict[str, int]:
    """REG / LOCAL (spill) / SHARED counts of a cubin, from ``cuobjdump --dump-resource-usage``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        text = subprocess.run([str(cuobjdump), "--dump-resource-usage", f.name], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip
    finally:
        os.unlink(f.name)
    return {key.lower(): int(val) for key, val in re.findall(r"\b(REG|LOCAL|SHARED):(\d+)", text)}


def blocks_per_sm(regs: int, shared: int, num_warps: int) -> int:
    """Resident blocks per sm_90 SM: limited by registers (allocated per warp in units of 256), shared
    memory (plus 1 KB reserved per block), warps (64) and blocks (32)."""
    regs_per_warp = math.ceil(max(regs, 1) * 32 / 256) * 256
    by_regs = (_REGS_PER_SM // regs_per_warp) // num_warps
    by_smem = _SMEM_PER_SM // (shared + _SMEM_RESERVED)
    return min(by_regs, by_smem, _WARPS_PER_SM // num_warps, _BLOCKS_PER_SM)


def tile_streaming(ttgir: str, cache_dtype: str) -> dict[str, int]:
    """How the pipelined IR moves 2-D tiles of the cache dtype (K/V tiles, centroid tiles): asynchronous
    global->shared copies, the ring depth (buffers per ring) and the in-flight depth of the loop's wait."""
    copies = re.findall(r"ttg\.async_copy_global_to_local .*?: tensor<(\d+)x(\d+)x!tt\.ptr<(\w+)>", ttgir)
    rings = [int(m) for m in re.findall(rf"!ttg\.memdesc<(\d+)x\d+x\d+x{cache_dtype}", ttgir)]
    waits = [int(n) for n in re.findall(r"ttg\.async_wait .*?\{num = (\d+) : i32\}", ttgir)]
    return {
        "async_tile_copies": sum(c[2] == cache_dtype for c in copies),
        "ring_depth": max(rings, default=0),
        "wait_depth": max(waits, default=0),
    }


def compile_launch(launch: Any, arch: int) -> Any:
    """Compile one recorded launch for sm_<arch> with the JIT's own specialisation of its arguments."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = launch.kernel
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound_args, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, launch.kwargs, bound_args, specialization,
                                                          options)  # fmt: skip
    return triton.compile(
        ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__
    )


def compile_all(arch: int = 90) -> list[dict[str, Any]]:
    """Compile every recorded launch of :func:`qwen3_8b_launches`; one dict per kernel variant."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise RuntimeError("unset TRITON_INTERPRET: ahead-of-time compilation needs the compiled kernels")
    import triton

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    rows = []
    for label, launch in qwen3_8b_launches():
        compiled = compile_launch(launch, arch)
        usage = _resource_usage(compiled.asm["cubin"], cuobjdump)
        num_warps = compiled.metadata.num_warps
        row = {
            "variant": label,
            "kernel": launch.kernel.__name__,
            "arch": arch,
            "triton": triton.__version__,
            "num_warps": num_warps,
            "num_stages": compiled.metadata.num_stages,
            "grid": list(launch.grid),
            **usage,
            "shared": compiled.metadata.shared,
            "blocks_per_sm": blocks_per_sm(usage.get("reg", 0), compiled.metadata.shared, num_warps),
            "tensor_core_mma": bool(re.search(r"\b(w?gmma|mma)\.", compiled.asm["ptx"])),
        }
        row.update(tile_streaming(compiled.asm["ttgir"], "f32" if label.endswith("fp32") else "bf16"))
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x10 (90 = H100/H200)")
    args = parser.parse_args(argv)
    for row in compile_all(args.arch):
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
