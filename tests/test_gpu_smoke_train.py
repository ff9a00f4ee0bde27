"""The GPU smoke run of the training entry points (bench/gpu_smoke_train.py), dry-run on the CPU with a tiny
shape so it can't rot: every check must pass, and nothing may need datasets, mteb, bm25s or flash-attn
(they are made unimportable in every process, as on the GPU machines)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import ROOT

BLOCKED = ("datasets", "mteb", "bm25s", "flash_attn")


def test_smoke_dry_run_passes_without_the_optional_packages(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(
        "import sys\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in BLOCKED)
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(blocker), str(ROOT), env.get("PYTHONPATH", "")])
    out = tmp_path / "smoke"
    command = [sys.executable, str(ROOT / "bench" / "gpu_smoke_train.py"), "--out", str(out), "--dry-run"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    verdicts = {row["check"]: row["verdict"] for row in rows}
    assert rows[0]["optional_present"] == "none"  # the blocker worked: the runs below needed none of them
    expected = [
        "NaN guard at learning rate 1e20",
        "MDM stage (LM head, LoRA)",
        "supervised, uninterrupted (the resume's reference)",
        "supervised, stopped then resumed",
        "resume continues exactly",
        "supervised, GradCache chunk 2",
        "supervised, direct",
        "total",  # within the plan's time budget
    ]
    assert {check: verdicts.get(check) for check in expected} == dict.fromkeys(expected, "pass")
    checks = [row["check"] for row in rows if row["check"] in expected]
    assert checks == expected  # the cheap checks first, the timed runs last
    assert next(r for r in rows if r["check"] == "resume continues exactly")["why"] == "bit-exact"  # on the CPU
    assert (out / "summary.md").read_text().count("| pass |") == len(expected)


def test_gpu_train_script_dry_run_stops_each_part_at_its_limit_and_still_reports(tmp_path):
    """bench/gpu_train.sh on the CPU: a part past its limit is stopped and recorded as such, the parts after it
    still run (one throughput row here, within what is left of the total), and the summary is written."""
    env = dict(os.environ, OMP_NUM_THREADS="1", DRY_RUN="1", SMOKE_S="2", NUMERICS_S="2",
               TESTS_S="400", TOTAL_S="900", ROWS="padded, direct", PYTHON=sys.executable)  # fmt: skip
    out = tmp_path / "gpu_train"
    done = subprocess.run(["bash", str(ROOT / "bench" / "gpu_train.sh"), str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1500)  # fmt: skip
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]  # two parts were stopped
    parts = {line.split(" | ")[0].strip("| "): line for line in (out / "parts.md").read_text().splitlines()[2:]}
    assert list(parts) == ["smoke run", "GradCache CUDA tests", "GradCache numerics", "throughput rows"]
    assert "(time limit)" in parts["smoke run"] and "(time limit)" in parts["GradCache numerics"]
    assert parts["GradCache CUDA tests"].startswith("| GradCache CUDA tests | 0 |")  # skipped without CUDA
    assert parts["throughput rows"].startswith("| throughput rows | 0 |"), parts["throughput rows"]
    bench = (out / "bench.md").read_text()
    assert "| padded, direct | 8 |" in bench and "--budget" in bench
    summary = (out / "summary.md").read_text()
    assert "| smoke run | 124 (time limit) |" in summary and "## Throughput" in summary


def test_gpu_train_scripts_default_rows_are_bench_train_configurations(monkeypatch):
    """The rows gpu_train.sh measures by default are names bench/train.py accepts (a wrong one stops that part)."""
    import importlib.util
    import re

    script = (ROOT / "bench" / "gpu_train.sh").read_text()
    rows = re.search(r'DEFAULT_ROWS="([^"]*)"', script).group(1).splitlines()
    spec = importlib.util.spec_from_file_location("bench_train", ROOT / "bench" / "train.py")
    bench_train = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench_train)  # its dataclasses look their module up there
    spec.loader.exec_module(bench_train)
    assert len(rows) >= 4 and set(rows) <= set(bench_train.GPU_CONFIGS), set(rows) - set(bench_train.GPU_CONFIGS)
