#!/usr/bin/env bash
# Training on one GPU in at most 8 minutes (issue 26), cheapest and most telling first, every part under a hard
# time limit so the script always finishes and always writes what it measured:
#   1. the smoke run of the real entry points (torchrun): NaN guard, MDM stage, stop and resume, GradCache and
#      direct at the 1.5B shape (bench/gpu_smoke_train.py; its own budget is 3 minutes)      limit SMOKE_S=200
#   2. the GradCache CUDA tests (tests/test_gpu.py -k "grad_cache or rand_state or nan_check") limit TESTS_S=90
#   3. GradCache vs direct vs float64 on the GradCache test's inputs (bench/grad_cache_numerics.py): the
#      kernels' own run-to-run difference and rounding, against which the packed test's difference is read
#                                                                                            limit NUMERICS_S=45
#   4. the throughput rows of bench/train.py --gpu (ROWS: a list of its configurations, one per line; default
#      DEFAULT_ROWS below, before and after issues 25-26 first: a 7B row takes about 90 s, so 2-3 fit; QUICK=1:
#      its --quick rows) with what is left of TOTAL_S=480 seconds as their budget: a row still running then is
#      stopped and the rows after it are reported as not run.
# Each part writes under OUT_DIR as it goes; OUT_DIR/summary.md gathers them at the end.
#
#   bash bench/gpu_train.sh [OUT_DIR]     # default bench/results/gpu_train
#   DRY_RUN=1 bash bench/gpu_train.sh     # the same plumbing on a CPU: tiny shapes, float32, no time limits
#                                         # (TOTAL_S etc. still apply if set; tests/test_gpu.py skips there)
#   SKIP_TESTS=1 bash bench/gpu_train.sh  # when bench/gpu.sh already ran tests/test_gpu.py (they are in it)
#
# Needs torch, transformers, peft, accelerate and pytest; not datasets, mteb, bm25s or flash-attn.
# Exit status 0 only if every part passed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
OUT_DIR="${1:-bench/results/gpu_train}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT_DIR"
status=0
dry=()
big=3600  # the dry run's limits: a CPU is slower than the GPU the limits are sized for
if [[ "${DRY_RUN:-0}" == 1 ]]; then dry=(--dry-run); fi
SMOKE_S="${SMOKE_S:-$([[ ${#dry[@]} -gt 0 ]] && echo $big || echo 200)}"
TESTS_S="${TESTS_S:-$([[ ${#dry[@]} -gt 0 ]] && echo $big || echo 90)}"
NUMERICS_S="${NUMERICS_S:-$([[ ${#dry[@]} -gt 0 ]] && echo $big || echo 45)}"
TOTAL_S="${TOTAL_S:-$([[ ${#dry[@]} -gt 0 ]] && echo $((4 * big)) || echo 480)}"
START=$SECONDS
part() {  # part NAME LIMIT COMMAND...: run under a hard limit, record its exit status and seconds
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@"
  local rc=$?
  ((rc)) && status=1
  echo "| $name | $rc$([[ $rc == 124 || $rc == 137 ]] && echo ' (time limit)') | $((SECONDS - t0)) | $limit |" \
    >> "$OUT_DIR/parts.md"
}
printf '| part | exit status | seconds | limit |\n|---|---|---:|---:|\n' > "$OUT_DIR/parts.md"

# 1. The real entry points under torchrun.
rm -rf "$OUT_DIR/smoke"
part "smoke run" "$SMOKE_S" "$PY" bench/gpu_smoke_train.py --out "$OUT_DIR/smoke" "${dry[@]}"

# 2. GradCache on CUDA: replay bit for bit, equal to the direct step, checkpointing, compile, NaN-check device.
if [[ "${SKIP_TESTS:-0}" == 1 ]]; then  # bench/gpu.sh ran tests/test_gpu.py already
  echo "| GradCache CUDA tests | skipped (SKIP_TESTS=1) | 0 | |" >> "$OUT_DIR/parts.md"
else part "GradCache CUDA tests" "$TESTS_S" bash -c "\"$PY\" -m pytest -q -m gpu tests/test_gpu.py \
  -k 'grad_cache or rand_state or nan_check' 2>&1 | tee '$OUT_DIR/grad_cache_tests.log'; exit \${PIPESTATUS[0]}"
fi

# 3. How far apart GradCache, the direct step, and float64 are on the same inputs.
part "GradCache numerics" "$NUMERICS_S" "$PY" bench/grad_cache_numerics.py --out "$OUT_DIR/numerics" "${dry[@]}"

# 4. Throughput rows, with what is left of the total.
DEFAULT_ROWS="packed, ckpt, direct
packed, varlen, ckpt auto, direct
packed, varlen, GradCache
packed, GradCache
packed, varlen, ckpt auto, compile, direct
packed, varlen, ckpt auto, Liger, direct"
rows=()
[[ -n "${QUICK:-}" ]] && rows=(--quick)
if [[ ${#rows[@]} == 0 ]]; then
  while IFS= read -r row; do [[ -n "$row" ]] && rows+=(--rows "$row"); done <<< "${ROWS:-$DEFAULT_ROWS}"
fi
left=$((TOTAL_S - (SECONDS - START) - 15))
if ((left > 30)); then
  part "throughput rows" "$((left + 10))" "$PY" bench/train.py --gpu "${dry[@]}" "${rows[@]}" --budget "$left" \
    --out "$OUT_DIR/bench.md"
else
  echo "| throughput rows | not run: ${left} s left | 0 | |" >> "$OUT_DIR/parts.md"
  status=1
fi

{
  echo "# Training on a GPU (bench/gpu_train.sh, $(date -u +%Y-%m-%d)), exit status $status, $((SECONDS - START)) s"
  echo
  "$PY" -c "import torch, transformers, peft; print(f'Device: {torch.cuda.get_device_name() if torch.cuda.is_available() else \"cpu (dry run)\"}; torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}.')"
  echo
  cat "$OUT_DIR/parts.md"
  echo
  sed 's/^# /## /' "$OUT_DIR/smoke/summary.md" 2>/dev/null || echo "## Smoke run: no summary (see $OUT_DIR/smoke)"
  if [[ -f "$OUT_DIR/grad_cache_tests.log" ]]; then
    echo
    echo "## GradCache tests (tests/test_gpu.py -k 'grad_cache or rand_state or nan_check')"
    echo
    echo '```'
    tail -n 12 "$OUT_DIR/grad_cache_tests.log"
    echo '```'
  fi
  echo
  sed 's/^# /## /' "$OUT_DIR/numerics/grad_cache_numerics.md" 2>/dev/null || echo "## GradCache numerics: none"
  if [[ -f "$OUT_DIR/bench.md" ]]; then
    echo
    echo "## Throughput (bench/train.py --gpu)"
    echo
    cat "$OUT_DIR/bench.md"
  fi
} > "$OUT_DIR/summary.md"
echo "Wrote $OUT_DIR/summary.md"
exit "$status"
