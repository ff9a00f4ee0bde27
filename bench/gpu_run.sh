#!/usr/bin/env bash
# The GPU run: every CUDA check and GPU figure of the project in one command, at most 9 minutes of wall time on one
# H100 or H200, most telling first, each part under a hard time limit (and never past what is left of TOTAL_S):
#
#   bash bench/gpu_run.sh OUT              # on the GPU machine (torch, transformers, peft, accelerate, pytest)
#   DRY_RUN=1 bash bench/gpu_run.sh OUT    # every part on a CPU: tiny shapes, float32 (tests/test_gpu_run.py)
#
#   part                  limit (s)        what
#   versions              VERSIONS_S=60    bench/gpu_versions.py: versions, devices, bf16 peak, varlen_attn and its
#                                          keywords, our call of it for each family's head layout
#   tests                 TESTS_S=180      tests/test_gpu.py: the varlen, packed-training and GradCache tests
#                                          first (bench/gpu_order.py), then the others
#   encode                ENCODE_S=180     bench/gpu_bench.py: Qwen2.5-7B shape, bf16, beside the plain HF loop
#   train (default)       TRAIN_S=150      bench/train.py --gpu: the default row (packed, varlen, ckpt auto)
#   smoke checks          SMOKE_S=120      bench/gpu_smoke_train.py: NaN guard, MDM stage, stop and resume,
#                                          GradCache and direct runs (small shape, three at once)
#   train (before, etc.)  TRAIN_MORE_S=240 the other rows: GradCache, padded sdpa (the before), Liger
#   smoke timed           SMOKE_TIMED_S=150  GradCache and direct at the 1.5B shape, seconds per step
#
# OUT receives at most 8 files, each written as its figures arrive (a run cut off keeps what it measured):
# summary.md (everything, rewritten after each part), versions.txt, tests.log, numerics.log (the errors the tests
# measured, tests/numerics.py), encode.jsonl, train.jsonl, smoke.jsonl, run.log (each part's command, output and
# exit status). Checkpoints, runs and their logs go to SCRATCH (default: a new folder under /tmp). The run needs no
# datasets, mteb, bm25s or flash-attn, and nothing from the network. Exit status: 0 when every part passed, 1
# otherwise, 2 when the machine lacks what the run needs (then nothing after the versions runs).
set -uo pipefail
if [[ $# -ne 1 ]]; then echo "usage: [DRY_RUN=1] bash bench/gpu_run.sh OUT" >&2; exit 2; fi
mkdir -p "$1" && OUT="$(cd "$1" && pwd)"
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
DRY_RUN="${DRY_RUN:-0}"
TOTAL_S="${TOTAL_S:-540}"
SCRATCH="${SCRATCH:-$(mktemp -d /tmp/gpu_run.XXXXXX)}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$SCRATCH"
if [[ -n "$(ls -A "$OUT")" ]]; then echo "$OUT is not empty: give a new folder." >&2; exit 2; fi
LOG="$OUT/run.log"
dry=()
[[ "$DRY_RUN" == 1 ]] && dry=(--dry-run)
COMMIT="$(git rev-parse --short HEAD 2>/dev/null || echo "${COMMIT:-unknown}")"
START=$SECONDS
status=0
echo "gpu_run $(date -u +%Y-%m-%dT%H:%M:%SZ) commit $COMMIT dry_run $DRY_RUN total ${TOTAL_S}s scratch $SCRATCH" > "$LOG"

report() { "$PY" bench/gpu_report.py "$OUT" >> "$LOG" 2>&1; }

# cap LIMIT: LIMIT, or what is left of TOTAL_S (less 5 s for the last summary) if that is less.
cap() {
  local left=$((TOTAL_S - (SECONDS - START) - 5))
  echo $(($1 < left ? $1 : left))
}

# part NAME LIMIT OUTPUT COMMAND...: runs COMMAND under min(LIMIT, what is left of TOTAL_S), its output appended to
# OUTPUT (run.log names the command); records the exit status (124/137: stopped at the limit) and the seconds.
part() {
  local name=$1 asked=$2 output=$3 limit
  limit=$(cap "$asked")
  shift 3
  if ((limit < 1 || (limit < 10 && limit < asked))); then  # what is left is too little to start anything
    echo "@@ | $name | not run: ${limit} s left | 0 | $asked |" >> "$LOG"
    status=1
    report
    return 1
  fi
  echo "== $name (limit ${limit}s): $*" >> "$LOG"
  local t0=$SECONDS
  timeout --kill-after=5 "$limit" "$@" >> "$output" 2>&1
  local rc=$?
  ((rc)) && status=1
  local why=""
  [[ $rc == 124 || $rc == 137 ]] && why=" (time limit)"
  echo "@@ | $name | $rc$why | $((SECONDS - t0)) | $limit |" >> "$LOG"
  report
  return "$rc"
}

# budget LIMIT: the seconds a part's own script may plan for, 10 s short of its limit (at least 1).
budget() {
  local limit
  limit=$(cap "$1")
  echo $((limit > 11 ? limit - 10 : 1))
}

# (a) What the machine has; nothing else runs without CUDA, peft, accelerate, pytest and transformers >= 5.2.
part versions "${VERSIONS_S:-60}" "$LOG" "$PY" bench/gpu_versions.py --out "$OUT/versions.txt" "${dry[@]}"
if [[ $? == 2 ]]; then exit 2; fi

# (b) The CUDA tests in one process, the varlen kernel, the packed training step and GradCache first (bench/gpu_order.py),
# each named as it passes or fails (-v), so a run cut off at the limit says which ran.
part tests "${TESTS_S:-180}" "$OUT/tests.log" env NUMERICS_LOG="$OUT/numerics.log" \
  GPU_FIRST="varlen grad_cache rand_state nan_check" "$PY" -m pytest -v -p no:cacheprovider -p bench.gpu_order -m gpu \
  --durations=15 tests/test_gpu.py

# (c) encode on the 7B shape beside the plain loop: the deadline stops starting rows 30 s before the limit.
encode_s="${ENCODE_S:-180}"
encode_dry=()
[[ "$DRY_RUN" == 1 ]] && encode_dry=(--dry_run)
encode_deadline=$(($(cap "$encode_s") - 30))
part encode "$encode_s" "$LOG" "$PY" bench/gpu_bench.py --jsonl "$OUT/encode.jsonl" \
  --deadline-s "$((encode_deadline > 1 ? encode_deadline : 1))" "${encode_dry[@]}"

# (d) Training: the default row, the smoke run's checks, the other rows, the timed smoke runs, with what is left;
# each script gets a budget 10 s short of its part's limit, so it stops its own runs and says what it did not run.
part "train (default)" "${TRAIN_S:-150}" "$LOG" "$PY" bench/train.py --gpu "${dry[@]}" --jsonl "$OUT/train.jsonl" \
  --budget "$(budget "${TRAIN_S:-150}")" --rows "packed, varlen, ckpt auto, direct"
part "smoke checks" "${SMOKE_S:-120}" "$LOG" "$PY" bench/gpu_smoke_train.py --out "$SCRATCH/smoke_checks" \
  --parts checks --jsonl "$OUT/smoke.jsonl" --budget "$(budget "${SMOKE_S:-120}")" "${dry[@]}"
part "train (GradCache, before, Liger)" "${TRAIN_MORE_S:-240}" "$LOG" "$PY" bench/train.py --gpu "${dry[@]}" \
  --jsonl "$OUT/train.jsonl" --budget "$(budget "${TRAIN_MORE_S:-240}")" --rows "packed, varlen, GradCache" \
  --rows "padded, ckpt, direct" --rows "packed, varlen, ckpt auto, Liger, direct"
part "smoke timed" "${SMOKE_TIMED_S:-150}" "$LOG" "$PY" bench/gpu_smoke_train.py --out "$SCRATCH/smoke_timed" \
  --parts timed --jsonl "$OUT/smoke.jsonl" --budget "$(budget "${SMOKE_TIMED_S:-150}")" "${dry[@]}"

echo "done in $((SECONDS - START)) s, exit status $status" >> "$LOG"
report
echo "Wrote $OUT/summary.md ($((SECONDS - START)) s, exit status $status)"
exit "$status"
