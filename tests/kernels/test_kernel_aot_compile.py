"""Every kernel compiles for sm_90 (H100/H200) through Triton's real GPU pipeline, without a GPU.

The interpreter tests prove the arithmetic; this proves the same source is a valid compiled Triton
program (tile sizes, types, shared memory) and that the attention kernel is what it was designed
to be: tensor-core MMAs, pipelined asynchronous page gathers, and no register spills.
Skipped where CUDA is present: there the native tests compile the kernels anyway.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

H100_SHARED_BYTES = 227 * 1024


@pytest.mark.skipif(torch.cuda.is_available(), reason="the native GPU tests compile the kernels")
def test_kernels_compile_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "sparrow_kernels.aot", "--arch", "90"], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    names = {(r["kernel"], r["dtype"]) for r in rows}
    assert {("_append_kv_kernel", "bf16"), ("_page_scores_kernel", "bf16"), ("_select_pages_kernel", ""),
            ("_split_decode_kernel", "bf16"), ("_split_decode_kernel", "fp32"), ("_merge_splits_kernel", "")} == names  # fmt: skip
    for row in rows:
        assert row["local"] == 0, f"register spills in {row}"
        assert row["static_shared_bytes"] < H100_SHARED_BYTES, row
    (attention,) = [r for r in rows if r["kernel"] == "_split_decode_kernel" and r["dtype"] == "bf16"]
    assert attention["tensor_core_mma"] and attention["async_copies"], attention
