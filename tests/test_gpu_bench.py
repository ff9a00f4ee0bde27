"""``bench/gpu.sh bench`` runs end to end: its dry run (a tiny shape on the CPU) measures every configuration, so
the GPU benchmark can't rot between the rare sessions that have a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_benchmark_dry_run(tmp_path):
    env = dict(os.environ, DRY_RUN="1", PYTHON=sys.executable, OMP_NUM_THREADS="1")
    command = ["bash", str(ROOT / "bench" / "gpu.sh"), "bench", str(tmp_path)]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "gpu_bench.jsonl").read_text().splitlines()]
    listed = [r for r in rows if "config" in r]
    measured = [r for r in listed if "tokens_per_s" in r]
    assert measured and all(r["finite"] for r in measured), measured
    assert {r["config"] for r in measured} >= {"hf-loop", "ours", "ours-padded", "ours-varlen", "ours-budget",
                                               "ours-compiled"}
    assert {r["set"] for r in measured} == {"mixed", "cut", "long", "one32k"}
    # every configuration is compared with the loop on the same texts (tiny float32 model: vectors agree closely)
    assert all(r["min_cosine"] > 0.99 for r in measured if r["config"] != "hf-loop"), measured
    assert len(listed) == len(measured) + sum("skipped" in r for r in listed)  # nothing failed
    table = (tmp_path / "gpu_bench.md").read_text()
    assert table.count("\n") == len(listed) + 2 and table in result.stdout and "min cosine" in table
    summary = (tmp_path / "summary.md").read_text()
    assert "tests/test_gpu.py (exit status skipped)" in summary and table in summary
