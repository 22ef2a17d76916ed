#!/usr/bin/env bash
# One prepared GPU check of lossless speculative rollout (issue 18) at the Qwen3 1.7B and 8B shapes with
# 32K-token contexts, sized for ONE device call under 10 minutes on an H200 (run it with a call timeout of
# ~560 s; the stage limits sum to 510 s):
#   1. versions and import hygiene (the rollout engine and the kernels import neither megatron nor transformers);
#   2. the verify kernel's tests natively on the GPU (tests/rollout/test_speculative_kernel.py), limit 90 s;
#   3. benchmarks/speculative_rollout.py at qwen3-1.7b, batch 16, then qwen3-8b, batch 8: random bf16 weights,
#      32,512-token prompts (prefilled by the engine) + 256 sampled tokens, the first 2 layers dense; dense vs
#      the 10 % schedule vs speculative k = 8 drafting with that schedule and with a fixed 1,024-token budget;
#      one repeat each (limits 200 s each). The dense and sparse arms decode from a CUDA graph; the
#      speculative arms run eagerly with the Triton verify kernel, so the dense baseline is the fast one.
# Output: benchmarks/results/ (or $RESULTS_DIR): gpu_speculative_check_<mode>.log,
# gpu_speculative_check_<mode>_stages.jsonl, gpu_speculative_check_<mode>_tests.xml and (GPU)
# speculative_rollout_gpu.jsonl; all copied to $OUT when set.
#
# The GPU image needs torch, triton, pytest and pyyaml (gpu_common.sh links the venv's pure-Python pytest and
# pyyaml where they are missing: carry .venv/lib/python3.11/site-packages/{_pytest,pytest,pluggy,iniconfig,
# packaging,yaml}).
#
# Usage:  bash benchmarks/gpu_speculative_check.sh          # GPU (the image's python3; PYTHONPATH only)
#         bash benchmarks/gpu_speculative_check.sh --tiny   # CPU, TRITON_INTERPRET=1: the tests + a tiny run of
#                                                           # the benchmark on the Triton path (~3 min)
#         bash benchmarks/gpu_speculative_check.sh --dry    # CPU: collect the tests + a tiny torch run (what CI tests)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

CHECK_NAME=gpu_speculative_check
GPU_RESULTS=("speculative_rollout_gpu.jsonl")
# shellcheck source=benchmarks/gpu_common.sh
source benchmarks/gpu_common.sh "$@"

log_header "speculative rollout check"
import_stage 60 sparrow_nemo.rollout.torch.engine sparrow_nemo.rollout.torch.speculative sparrow_nemo.rollout.torch.extend

PYTEST=("$PY" -m pytest -q -p no:cacheprovider tests/rollout/test_speculative_kernel.py
        --junitxml "$RESULTS/gpu_speculative_check_${MODE}_tests.xml")
BENCH=("$PY" benchmarks/speculative_rollout.py --repeats 1)
# the 1.7B and 8B shapes at 32K: 2,048-token bins (the paper's), 16-token pages, the paper's 2 dense layers
LONG=(--device cuda --dtype bf16 --prompt-len 32512 --gen-len 256 --bin-tokens 2048 --page-size 16
      --dense-layers 2 --fraction 0.1 --ks 8 --draft-budgets 1024 --out "$RESULTS/speculative_rollout_gpu.jsonl")
TINY=(--shape tiny-test --batch 2 --prompt-len 64 --gen-len 16 --bin-tokens 32 --page-size 16 --ks 4
      --draft-budgets 32)
case "$MODE" in
  gpu)
    step tests 90 "${PYTEST[@]}"
    step bench_1.7b 200 "${BENCH[@]}" "${LONG[@]}" --shape qwen3-1.7b --batch 16
    step bench_8b 200 "${BENCH[@]}" "${LONG[@]}" --shape qwen3-8b --batch 8
    ;;
  tiny)
    step tests 600 "${PYTEST[@]}"
    step bench_tiny 600 "${BENCH[@]}" "${TINY[@]}" --backend triton \
      --out "$RESULTS/gpu_speculative_check_tiny_bench.jsonl"
    ;;
  dry)
    step tests 120 "${PYTEST[@]}" --collect-only
    step bench_tiny 300 "${BENCH[@]}" "${TINY[@]}" --backend torch \
      --out "$RESULTS/gpu_speculative_check_dry_bench.jsonl"
    ;;
esac
