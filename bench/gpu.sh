#!/usr/bin/env bash
# GPU checks and 7B benchmarks on one GPU machine; writes bench/results/gpu.md.
#
#   bash bench/gpu.sh                 # from the repository root, on the GPU machine
#
# The GPU machines have torch 2.11 and transformers 5.17 but not our other dependencies, and they
# fetch nothing from the internet. Bring the missing ones as wheels, downloaded where there is
# internet into the git-ignored .whl/ folder (never committed), and carry that folder along:
#
#   pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 --no-deps \
#       -d .whl peft==0.21.2 accelerate==1.15.0 psutil pytest==9.2.0 iniconfig pluggy
#
# This script checks the versions first, installs from .whl/ (no index) whatever does not import,
# runs the tests marked gpu (tests/test_gpu.py), then bench/gpu_bench.py (Qwen2.5-7B and LLaDA-8B
# shapes, bf16: tokens/s, MFU, peak memory; padded vs packed; sdpa vs flex_attention).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
OUT="${OUT:-bench/results/gpu.md}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# 1. Versions: CUDA visible, torch >= 2.5 (flex_attention), transformers >= 5.2 (config.is_causal).
"$PY" - <<'PYEOF'
import sys
import torch, transformers
from packaging.version import Version
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}")
problems = []
if not torch.cuda.is_available():
    problems.append("no CUDA device is visible")
if Version(torch.__version__.split("+")[0]) < Version("2.5"):
    problems.append(f"torch {torch.__version__} < 2.5 (flex_attention)")
if Version(transformers.__version__) < Version("5.2"):
    problems.append(f"transformers {transformers.__version__} < 5.2 (config.is_causal)")
if problems:
    sys.exit("Cannot run the GPU checks: " + "; ".join(problems))
for i in range(torch.cuda.device_count()):
    print(f"cuda:{i} {torch.cuda.get_device_name(i)}")
PYEOF

# 2. Missing dependencies from .whl/ (no index: the machine fetches nothing).
missing=()
for module in peft accelerate psutil pytest; do
  "$PY" -c "import $module" 2>/dev/null || missing+=("$module")
done
if ((${#missing[@]})); then
  if [[ ! -d .whl ]]; then
    echo "Missing ${missing[*]} and no .whl/ folder: download the wheels as the header of this script says." >&2
    exit 2
  fi
  "$PY" -m pip install --no-index --find-links .whl "${missing[@]}"
fi

# 3. The GPU tests, then 4. the benchmarks (a failed test does not stop the benchmarks; both are recorded).
tests_log=$(mktemp)
set +e
"$PY" -m pytest -q -m gpu tests/test_gpu.py 2>&1 | tee "$tests_log"
tests_status=${PIPESTATUS[0]}
set -e
bench_table=$(mktemp)
"$PY" bench/gpu_bench.py --out "$bench_table"

{
  echo "# GPU checks and 7B benchmarks"
  echo
  echo "Command: \`bash bench/gpu.sh\` ($(date -u +%Y-%m-%d))."
  echo
  "$PY" -c "import sys, torch, transformers; print(f'Device: {torch.cuda.get_device_name()} x{torch.cuda.device_count()}; python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}.')"
  echo
  echo "## make test-gpu (tests/test_gpu.py), exit status $tests_status"
  echo
  echo '```'
  tail -n 15 "$tests_log"
  echo '```'
  echo
  echo "## 7B-shaped encoders, bf16 (bench/gpu_bench.py)"
  echo
  cat "$bench_table"
} > "$OUT"
echo "Wrote $OUT"
exit "$tests_status"
