#!/usr/bin/env bash
# One prepared GPU check of the rollout engine's fast decode path and its speedup (issue 11), sized for
# ONE device call under 8 minutes on an H200 (run it with a call timeout of ~500 s):
#   1. versions and import hygiene (the rollout engine and the kernels import neither megatron nor transformers);
#   2. the fast-decode tests natively on the GPU (static loop = compact loop, CUDA-graph replay = eager,
#      fused kernels = torch path), limit 90 s;
#   3. the page_score=minmax kernel tests natively (key-bound append, selection and fused decode against
#      the method layer), limit 60 s;
#   4. benchmarks/rollout_speedup.py: Qwen3 1.7B and 8B (then 4B, 14B while time is left), batch 64 (or what
#      fits), prompt 512, generation 32K and 16K, dense vs the 0.86 preset, with the minmax selection and
#      append timed beside the centroid's; no configuration starts after 260 s, limit 350 s.
# Output: benchmarks/results/ (or $RESULTS_DIR): gpu_rollout_check_<mode>.log, gpu_rollout_check_<mode>_tests.xml,
# gpu_rollout_check_<mode>_minmax_tests.xml, rollout_speedup.jsonl; all copied to $OUT when set.
#
# Usage:  bash benchmarks/gpu_rollout_check.sh          # GPU (the image's python3; PYTHONPATH only, installs nothing)
#         bash benchmarks/gpu_rollout_check.sh --tiny   # CPU, TRITON_INTERPRET=1: the same tests + tiny benchmark
#         bash benchmarks/gpu_rollout_check.sh --dry    # CPU: collect the tests only + tiny benchmark (what CI tests)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

CHECK_NAME=gpu_rollout_check
GPU_RESULTS=("rollout_speedup.jsonl")
# shellcheck source=benchmarks/gpu_common.sh
source benchmarks/gpu_common.sh "$@"

log_header "rollout fast-decode check"
import_stage 60 sparrow_nemo.rollout.torch.engine sparrow_nemo.rollout.torch.cuda_graphs sparrow_nemo.sparse.cost_model

TESTS=(tests/rollout/test_decode_graphs.py tests/rollout/test_fast_decode_bench.py tests/rollout/test_kernel_path.py)
PYTEST=("$PY" -m pytest -q -p no:cacheprovider "${TESTS[@]}" --junitxml "$RESULTS/gpu_rollout_check_${MODE}_tests.xml")
MINMAX=("$PY" -m pytest -q -p no:cacheprovider tests/kernels/test_kernel_minmax.py
        --junitxml "$RESULTS/gpu_rollout_check_${MODE}_minmax_tests.xml")
BENCH=("$PY" benchmarks/rollout_speedup.py)
case "$MODE" in
  gpu)
    step tests 90 "${PYTEST[@]}"
    step minmax 60 "${MINMAX[@]}"
    step benchmark 350 "${BENCH[@]}" --time-budget-s 260 --out "$RESULTS/rollout_speedup.jsonl"
    ;;
  tiny)
    step tests 600 "${PYTEST[@]}"
    step minmax 300 "${MINMAX[@]}"
    step benchmark 300 "${BENCH[@]}" --tiny --device cpu --out "$RESULTS/gpu_rollout_check_tiny_bench.jsonl"
    ;;
  dry)
    step tests 120 "${PYTEST[@]}" --collect-only
    step minmax 120 "${MINMAX[@]}" --collect-only
    step benchmark 300 "${BENCH[@]}" --tiny --device cpu --e2e-tokens 0 \
      --out "$RESULTS/gpu_rollout_check_dry_bench.jsonl"
    ;;
esac
exit "$FAILED"
