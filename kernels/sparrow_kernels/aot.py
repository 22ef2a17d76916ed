"""Compile every kernel ahead of time for a CUDA architecture, without a GPU.

Triton's interpreter (the CPU test path) accepts programs the GPU compiler rejects (tl.dot tile
sizes, loop-carried type changes, shared-memory overflow), and says nothing about registers.
This module lowers each kernel at Qwen3 decode sizes (D = 128, bf16 cache, GQA group 4) through
Triton's full pipeline to a cubin for ``--arch`` (default 90 = H100/H200) and reports the
resources ptxas assigned. It needs triton's bundled ptxas/cuobjdump, not a GPU or a driver.

    python -m sparrow_kernels.aot [--arch 90]     (TRITON_INTERPRET must be unset)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

#: (kernel module, kernel name, pointer/float argument types, constexprs, launch options). Arguments not
#: listed are 32-bit integers (strides, sizes).
_BF16, _F32, _I32 = "*bf16", "*fp32", "*i32"
_DECODE_PTRS = {"block_table": _I32, "seq_len": _I32, "page_idx": _I32, "counts": _I32, "o_part": _F32,
                "lse_part": _F32, "scale_log2": "fp32"}  # fmt: skip
_DECODE_CONST = {"GROUP": 4, "G_PAD": 16, "D": 128, "PAGE": 16, "PAGES_PER_ITER": 4, "UPCAST": False}
SPECS: list[tuple[str, str, dict[str, str], dict[str, Any], dict[str, int]]] = [
    ("append", "_append_kv_kernel",
     {"k_pages": _BF16, "v_pages": _BF16, "centroids": _F32, "block_table": _I32, "positions": _I32,
      "k_new": _BF16, "v_new": _BF16},
     {"D": 128, "PAGE": 16}, {"num_warps": 4}),
    ("selection", "_page_scores_kernel",
     {"q": _BF16, "centroids": _F32, "block_table": _I32, "seq_len": _I32, "scores": _F32},
     {"GROUP": 4, "GROUP_POW2": 4, "D": 128, "PAGE": 16, "BLOCK_P": 64}, {"num_warps": 4}),
    ("selection", "_select_pages_kernel",
     {"scores": _F32, "seq_len": _I32, "budget": _I32, "page_idx": _I32, "counts": _I32},
     {"PAGE": 16, "BLOCK_P": 4096}, {"num_warps": 8}),
    ("decode", "_split_decode_kernel", {"q": _BF16, "k_pages": _BF16, "v_pages": _BF16, **_DECODE_PTRS},
     {**_DECODE_CONST, "IEEE": False}, {"num_warps": 4, "num_stages": 2}),
    ("decode", "_split_decode_kernel", {"q": _F32, "k_pages": _F32, "v_pages": _F32, **_DECODE_PTRS},
     {**_DECODE_CONST, "IEEE": True}, {"num_warps": 4, "num_stages": 2}),
    ("decode", "_merge_splits_kernel", {"o_part": _F32, "lse_part": _F32, "out": _BF16},
     {"D": 128, "SPLITS_POW2": 4}, {"num_warps": 4}),
]  # fmt: skip


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


def compile_all(arch: int = 90) -> list[dict[str, Any]]:
    """Compile every entry of SPECS for sm_<arch>; one dict per kernel variant with its resources."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise RuntimeError("unset TRITON_INTERPRET: ahead-of-time compilation needs the compiled kernels")
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    results = []
    for module_name, kernel_name, types, constexprs, options in SPECS:
        fn = getattr(importlib.import_module(f"sparrow_kernels.{module_name}"), kernel_name)
        signature = {a: "constexpr" if a in constexprs else types.get(a, "i32") for a in fn.arg_names}
        compiled = triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", arch, 32),
                                  options=options)  # fmt: skip
        ptx = compiled.asm["ptx"]
        results.append({
            "kernel": kernel_name,
            "dtype": types.get("k_pages", types.get("q", "")).lstrip("*"),
            "arch": arch,
            **options,
            "static_shared_bytes": compiled.metadata.shared,
            "tensor_core_mma": bool(re.search(r"\b(w?gmma|mma)\.", ptx)),
            "async_copies": "cp.async" in ptx,
            **_resource_usage(compiled.asm["cubin"], cuobjdump),
        })  # fmt: skip
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x10 (90 = H100/H200)")
    args = parser.parse_args(argv)
    for row in compile_all(args.arch):
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
