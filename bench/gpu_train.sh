#!/usr/bin/env bash
# Training on one GPU (issue 20), in the order the issue spends a GPU on: the GradCache tests on CUDA,
# the smoke run of the real entry points (torchrun), then, with BENCH=1, the 7B throughput benchmark.
# Everything is written under OUT_DIR as it goes; OUT_DIR/summary.md gathers it at the end.
#
#   bash bench/gpu_train.sh [OUT_DIR]     # default bench/results/gpu_train: ~1 min of tests + ~3 min smoke
#   BENCH=1 bash bench/gpu_train.sh       # + python bench/train.py --gpu (~6 min on an H100; QUICK=1: ~3 min)
#   SKIP_TESTS=1 bash bench/gpu_train.sh  # when bench/gpu.sh already ran tests/test_gpu.py (they are in it)
#   DRY_RUN=1 bash bench/gpu_train.sh     # the same plumbing on a CPU: tiny shapes, float32 (~3 min on 2 cores)
#
# Needs torch, transformers, peft, accelerate and pytest (the GPU machines have them; bench/gpu.sh checks the
# versions); not datasets, mteb, bm25s or flash-attn. Exit status 0 only if every part passed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
OUT_DIR="${1:-bench/results/gpu_train}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT_DIR"
status=0
dry=()
[[ "${DRY_RUN:-0}" == 1 ]] && dry=(--dry-run)

# 1. GradCache on CUDA: replay bit for bit, equal to the direct step, checkpointing, compile, NaN-check device.
if [[ "${SKIP_TESTS:-0}" != 1 ]]; then
  "$PY" -m pytest -q -m gpu tests/test_gpu.py -k "grad_cache or rand_state or nan_check" 2>&1 \
    | tee "$OUT_DIR/grad_cache_tests.log"
  ((PIPESTATUS[0])) && status=1
fi

# 2. The real entry points under torchrun: supervised (GradCache on/off), resume, MDM, NaN guard.
rm -rf "$OUT_DIR/smoke"
timeout 600 "$PY" bench/gpu_smoke_train.py --out "$OUT_DIR/smoke" "${dry[@]}" || status=1

# 3. Throughput (optional): the 7B LoRA step, padded/packed, checkpointing, GradCache, 32/512 triples.
if [[ "${BENCH:-0}" == 1 ]]; then
  "$PY" bench/train.py --gpu ${QUICK:+--quick} "${dry[@]}" --out "$OUT_DIR/bench.md" || status=1
fi

{
  echo "# Training on a GPU (bench/gpu_train.sh, $(date -u +%Y-%m-%d)), exit status $status"
  echo
  "$PY" -c "import torch, transformers, peft; print(f'Device: {torch.cuda.get_device_name() if torch.cuda.is_available() else \"cpu (dry run)\"}; torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}.')"
  if [[ -f "$OUT_DIR/grad_cache_tests.log" ]]; then
    echo
    echo "## GradCache tests (tests/test_gpu.py -k 'grad_cache or rand_state or nan_check')"
    echo
    echo '```'
    tail -n 12 "$OUT_DIR/grad_cache_tests.log"
    echo '```'
  fi
  echo
  sed 's/^# /## /' "$OUT_DIR/smoke/summary.md" 2>/dev/null || echo "## Smoke run: no summary (see $OUT_DIR/smoke)"
  if [[ -f "$OUT_DIR/bench.md" ]]; then
    echo
    echo "## Throughput (bench/train.py --gpu)"
    echo
    cat "$OUT_DIR/bench.md"
  fi
} > "$OUT_DIR/summary.md"
echo "Wrote $OUT_DIR/summary.md"
exit "$status"
