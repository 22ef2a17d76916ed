#!/usr/bin/env bash
# One GPU window that counts (issue 38): everything the project has to measure on a GPU, in ONE device call.
# A window is 15 minutes of device time in all, machine start included, at most 10 minutes a command; the
# stage limits below sum to 475 s (<= 480), so the call fits a timeout of 540 s with room for a rerun.
# Stages, in priority order, each under its own time limit, each writing its results straight into $OUT:
#   env          (20 s)  versions, GPU, driver, commit -> env.json; import hygiene (the kernels and the rollout
#                        engine import neither megatron nor transformers); megatron-core installed from the
#                        wheel carried in .window/ (the image has none) into .window/site, and checked
#   correctness (130 s)  natively on the GPU: the kernel tests (selection, decode, append, verify, minmax, a
#                        CUDA-graph replay of a decode layer), the engine's Triton path vs its torch path and
#                        its bucketed CUDA-graph decode steps vs eager (tests/rollout/test_kernel_path.py,
#                        test_decode_graphs.py), the speculative verify kernel -> correctness.xml
#   kernels      (55 s)  sparse_attention.py --only-targets: 8B, batch 64, 32K and 4K, 10 % and 25 % kept,
#                        each row with its targets -> kernels.jsonl
#   rollout     (115 s)  engine_rollout.py: Qwen3 1.7B then 8B at 32K, dense vs the paper's 0.86 schedule, a
#                        GRPO-shaped request mix (twice the rows that fit) with EOS honoured, through
#                        engine.generate -> rollout.jsonl
#   speculative  (70 s)  speculative_rollout.py at 1.7B, batch 16 (one GRPO group), 32,512-token prompts + 256
#                        tokens: dense, the 10 % schedule, speculative k = 8 -> speculative.jsonl
#   train        (85 s)  gpu_train_step.py: MegatronPolicy (qwen3-1.7b, TP1, bf16, the recipe's recompute),
#                        one GRPO update at 16K and at 32K tokens with its peak memory beside sparrow plan's,
#                        one refit into the engine, one sleep/wake -> train_step.jsonl
# Weights are drawn on the device; every timed arm has an untimed warm-up first. Every results line carries
# the commit (--commit, as SPARROW_COMMIT: the device machine gets the working tree without git), the GPU and
# its kind, and the target it is judged by on that GPU with both kinds' memory-bound limits (gpu_targets.py).
# $OUT ends up with at most 8 files: window.log, stages.jsonl (one line per stage: rc, seconds, limit),
# env.json and the five results files above. Exit status: 0 only when every stage exited 0.
#
# Usage:  bash benchmarks/gpu_window.sh --commit HASH     # the device call (image python3; carry .window)
#         bash benchmarks/gpu_window.sh --tiny            # CPU rehearsal: TRITON_INTERPRET=1, tiny shapes
#         bash benchmarks/gpu_window.sh --dry             # CPU, what CI runs: tests collected, tiny torch runs
#         bash benchmarks/gpu_window.sh --limits          # print the GPU stage limits
# WINDOW_STAGE_LIMITS="stage=seconds,..." lowers limits (never raises them): how the test makes a stage fail.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

STAGES=(env correctness kernels rollout speculative train)
declare -A GPU_LIMIT=([env]=20 [correctness]=130 [kernels]=55 [rollout]=115 [speculative]=70 [train]=85)
declare -A TINY_LIMIT=([env]=120 [correctness]=900 [kernels]=300 [rollout]=300 [speculative]=600 [train]=300)
declare -A DRY_LIMIT=([env]=120 [correctness]=300 [kernels]=300 [rollout]=300 [speculative]=300 [train]=300)

MODE=gpu
COMMIT=""
while [ $# -gt 0 ]; do
  case "$1" in
    --tiny) MODE=tiny ;;
    --dry) MODE=dry ;;
    --commit) COMMIT=${2:-}; shift ;;
    --limits) for s in "${STAGES[@]}"; do echo "$s ${GPU_LIMIT[$s]}"; done; exit 0 ;;
    *) echo "usage: $0 [--commit HASH] [--tiny|--dry|--limits]" >&2; exit 2 ;;
  esac
  shift
done
[ -n "$COMMIT" ] || COMMIT=$(git rev-parse HEAD 2>/dev/null || true)
if [ -z "$COMMIT" ]; then
  echo "no --commit HASH and no git here: the device machine's copy has no .git, pass the commit" >&2
  exit 2
fi
export SPARROW_COMMIT=$COMMIT

PY=${PYTHON:-python3}
if [ "$MODE" != gpu ]; then
  export TRITON_INTERPRET=1
  [ -x .venv/bin/python ] && PY=${PYTHON:-.venv/bin/python}
fi
export PYTHONPATH="kernels:.${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT=${OUT:-${TMPDIR:-/tmp}/gpu_window_$MODE}
mkdir -p "$OUT"
LOG="$OUT/window.log"
: > "$LOG"
: > "$OUT/stages.jsonl"
log() { echo "$@" | tee -a "$LOG"; }

limit_of() { # limit_of STAGE: this mode's limit, lowered by WINDOW_STAGE_LIMITS where that names the stage
  local s=$1 limit
  case "$MODE" in gpu) limit=${GPU_LIMIT[$s]} ;; tiny) limit=${TINY_LIMIT[$s]} ;; dry) limit=${DRY_LIMIT[$s]} ;; esac
  local pair list=${WINDOW_STAGE_LIMITS:-}
  for pair in ${list//,/ }; do
    if [ "${pair%%=*}" = "$s" ] && [ "${pair#*=}" -lt "$limit" ]; then limit=${pair#*=}; fi
  done
  echo "$limit"
}

FAILED=0
STATUS=()
START=$SECONDS
stage() { # stage NAME CMD...: run under the stage's limit, log its output, record rc / seconds / limit
  local name=$1 limit start rc
  shift
  limit=$(limit_of "$name")
  log "=== $name (limit ${limit}s, $((SECONDS - START))s into the window): $*"
  start=$SECONDS
  # SIGINT first: pytest still writes its JUnit file, a benchmark stops with its finished lines written
  timeout --signal=INT --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  log "=== $name: exit $rc after $((SECONDS - start))s"
  printf '{"stage": "%s", "rc": %d, "seconds": %d, "limit_s": %d, "mode": "%s", "commit": "%s"}\n' \
    "$name" "$rc" "$((SECONDS - start))" "$limit" "$MODE" "$COMMIT" >> "$OUT/stages.jsonl"
  STATUS+=("$name=$rc")
  [ "$rc" -eq 0 ] || FAILED=1
}

# ---- env: versions, hygiene, megatron-core from the carried wheel ------------------------------------------
MEGATRON_SITE=""
# shellcheck disable=SC2329  # run as `bash -c env_stage` (exported), under the stage's limit
env_stage() {
  "$PY" - "$OUT/env.json" "$MODE" <<'EOF' || return 1
import datetime, importlib, json, subprocess, sys
sys.path.insert(0, "benchmarks")
import torch, triton
from gpu_targets import commit, kind_of

for name in ("sparrow_kernels", "sparrow_kernels.decode", "sparrow_kernels.verify", "sparrow_nemo.rollout.torch.engine",
             "sparrow_nemo.rollout.torch.cuda_graphs", "sparrow_nemo.rollout.torch.speculative", "sparrow_nemo.sparse.cost_model"):
    importlib.import_module(name)
bad = sorted(m for m in sys.modules if m.split(".")[0] in ("megatron", "transformers"))
assert not bad, f"the kernels and the rollout engine must not import megatron/transformers, got {bad}"
cuda = torch.cuda.is_available()
smi = None
if cuda:
    q = "--query-gpu=name,driver_version,memory.total,memory.used"
    smi = subprocess.run(["nvidia-smi", q, "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
gpu = torch.cuda.get_device_name(0) if cuda else "cpu"
date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
env = {"commit": commit(), "date": date, "mode": sys.argv[2], "gpu": gpu, "gpu_kind": kind_of(gpu) if cuda else None, "nvidia_smi": smi,
       "driver": smi.split(", ")[1] if smi else None, "python": sys.version.split()[0], "torch": torch.__version__,
       "cuda": torch.version.cuda, "triton": triton.__version__, "interpreted": sys.modules["sparrow_kernels"].INTERPRETED,
       "gpu_memory_gib": torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else None}
json.dump(env, open(sys.argv[1], "w"))
print(json.dumps(env))
EOF
  # The GPU image has no megatron-core: its wheel travels in .window/ (benchmarks/README.md, "Running the window"), installed offline.
  local wheels=(.window/megatron_core-0.16.1-*.whl) wheel site
  wheel=${wheels[0]}
  if [ "$MODE" = gpu ]; then
    [ -f "$wheel" ] || { echo "no .window/megatron_core-0.16.1-*.whl: download it and carry .window (benchmarks/README.md)"; return 1; }
    echo "installing megatron-core from $wheel into .window/site (pip --no-index --no-deps --target)"
    if "$PY" -m pip --version >/dev/null 2>&1; then
      "$PY" -m pip install --quiet --no-index --no-deps --target .window/site "$wheel" || return 1
    else  # no pip in the image: a wheel is a zip of its installed files
      echo "no pip: unpacking the wheel instead"
      "$PY" -m zipfile -e "$wheel" .window/site || return 1
    fi
    site=$PWD/.window/site
  elif [ -f "$wheel" ]; then  # rehearsal: the same offline install of the cp312 wheel, for Python 3.12, not imported
    site=$(mktemp -d)
    "$PY" -m pip install --quiet --no-index --no-deps --python-version 3.12 --only-binary=:all: --target "$site" \
      "$wheel" || return 1
    [ -d "$site/megatron_core-0.16.1.dist-info" ] || { echo "the wheel did not install into $site"; return 1; }
    echo "the carried wheel installs offline into a --target folder ($wheel); this $MODE run imports the venv's"
    rm -rf "$site"
    site=""
  fi
  PYTHONPATH="$PYTHONPATH${site:+:$site}" "$PY" -c \
    "import megatron.core as m; assert m.__version__ == '0.16.1', m.__version__; print('megatron-core', m.__version__, m.__file__)"
}

log "=== GPU window, mode=$MODE, commit $COMMIT, $(date -u +%Y-%m-%dT%H:%M:%SZ), results in $OUT"
export -f env_stage
export PY OUT MODE
stage env bash -c env_stage
if [ "$MODE" = gpu ] && [ -d .window/site ]; then MEGATRON_SITE=$PWD/.window/site; fi

# ---- correctness: the native paths against their references ------------------------------------------------
TESTS=(tests/kernels tests/rollout/test_kernel_path.py tests/rollout/test_decode_graphs.py
       tests/rollout/test_speculative_kernel.py)
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -p no:randomly "${TESTS[@]}" --junitxml "$OUT/correctness.xml")
case "$MODE" in
  gpu|tiny) stage correctness "${PYTEST[@]}" ;;
  dry) stage correctness "${PYTEST[@]}" --collect-only ;;
esac

# ---- kernels: the targets at 32K (and 4K), 10 % and 25 % kept ----------------------------------------------
case "$MODE" in
  gpu) stage kernels "$PY" benchmarks/sparse_attention.py --only-targets --reps 20 --out "$OUT/kernels.jsonl" ;;
  *) stage kernels "$PY" benchmarks/sparse_attention.py --tiny --device cpu --reps 1 --out "$OUT/kernels.jsonl" ;;
esac

# ---- rollout: the engine at 32K, dense vs the paper's schedule ---------------------------------------------
case "$MODE" in
  gpu) stage rollout "$PY" benchmarks/engine_rollout.py --time-budget-s 60 --out "$OUT/rollout.jsonl" ;;
  tiny) stage rollout "$PY" benchmarks/engine_rollout.py --tiny --device cpu --backend triton --out "$OUT/rollout.jsonl" ;;
  dry) stage rollout "$PY" benchmarks/engine_rollout.py --tiny --device cpu --backend torch --out "$OUT/rollout.jsonl" ;;
esac

# ---- speculative: 1.7B at 32K --------------------------------------------------------------------------------
SPEC=("$PY" benchmarks/speculative_rollout.py --repeats 1 --out "$OUT/speculative.jsonl")
case "$MODE" in
  gpu) stage speculative "${SPEC[@]}" --device cuda --dtype bf16 --shape qwen3-1.7b --batch 16 --group 16 \
         --prompt-len 32512 --gen-len 256 --bin-tokens 2048 --page-size 16 --dense-layers 2 --fraction 0.1 --ks 8 \
         --warmup-tokens 16 ;;
  *) stage speculative "${SPEC[@]}" --shape tiny-test --batch 2 --group 2 --prompt-len 48 --gen-len 10 --bin-tokens 32 \
       --page-size 16 --ks 4 --warmup-tokens 2 --backend "$([ "$MODE" = tiny ] && echo triton || echo torch)" ;;
esac

# ---- train: the megatron-core step, refit and sleep/wake ------------------------------------------------------
TRAIN=(env "PYTHONPATH=$PYTHONPATH${MEGATRON_SITE:+:$MEGATRON_SITE}" "$PY" benchmarks/gpu_train_step.py
       --out "$OUT/train_step.jsonl")
case "$MODE" in
  gpu) stage train "${TRAIN[@]}" ;;
  *) stage train "${TRAIN[@]}" --tiny ;;
esac

log "=== summary: ${STATUS[*]} (total $((SECONDS - START))s); results in $OUT: $(cd "$OUT" && echo *)"
exit "$FAILED"
