#!/usr/bin/env bash
# Do folders saved with Encoder.save(path, merge_before_save=True) load in LLM2Vec 0.2.3 with the same vectors?
#   PYTHON=.venv/bin/python LLM2VEC_ENV=/path/to/env bench/compat_llm2vec.sh [OUT_DIR]
# PYTHON: our environment (default: python). LLM2VEC_ENV: the reference environment, built there if absent
# (default: .llm2vec-env, git-ignored). OUT_DIR: where the folders go (default: a temporary folder).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
ENV="${LLM2VEC_ENV:-.llm2vec-env}"
if [ ! -x "$ENV/bin/python" ]; then
  python3 -m venv "$ENV"
  "$ENV/bin/pip" install torch==2.13.0 transformers==4.44.2 tokenizers==0.19.1 llm2vec==0.2.3 peft==0.12.0 \
    accelerate==0.33.0 "numpy<2"
fi
OUT="${1:-$(mktemp -d)}"
"$PYTHON" bench/compat_llm2vec.py save "$OUT"
PYTHONPATH= "$ENV/bin/python" bench/compat_llm2vec.py check "$OUT"
