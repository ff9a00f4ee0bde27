"""``bash bench/gpu_run.sh`` dry-run on the CPU (``DRY_RUN=1``: tiny shapes, float32), so the one GPU command can't rot
between the rare runs on a GPU: every part runs and writes its figures, a part stopped at its limit is recorded as
such and fails the run while the parts after it still run, at most 8 files come back in OUT, and nothing needs
datasets, mteb, bm25s or flash-attn (made unimportable in every process, as on the GPU machine)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

from conftest import ROOT

BLOCKED = ("datasets", "mteb", "bm25s", "flash_attn")
PARTS = ["versions", "tests", "encode", "train (default)", "smoke checks", "train (GradCache, before, Liger)",
         "smoke timed"]  # fmt: skip
#: Given a 1-second limit below: a stopped part is reported and fails the run, and the test stays cheap (their row
#: names are checked below; the timed smoke runs are the checks' runs at another shape).
CUT = {"TRAIN_MORE_S": "train (GradCache, before, Liger)", "SMOKE_TIMED_S": "smoke timed"}
#: What comes back from OUT (at most 8 files, names of letters, digits and ._-).
FILES = {"summary.md", "versions.txt", "tests.log", "numerics.log", "encode.jsonl", "train.jsonl", "smoke.jsonl",
         "run.log"}  # fmt: skip


def test_the_gpu_run_dry_run_reaches_every_part_and_reports_a_stopped_one(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(
        "import sys\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in BLOCKED)
    )
    limits = {name: "900" for name in ("VERSIONS_S", "TESTS_S", "ENCODE_S", "TRAIN_S", "SMOKE_S")}
    env = dict(os.environ, **limits, **dict.fromkeys(CUT, "1"), DRY_RUN="1", PYTHON=sys.executable,
               OMP_NUM_THREADS="1", TOTAL_S="3600", SCRATCH=str(tmp_path / "scratch"), COMMIT="test")  # fmt: skip
    env["PYTHONPATH"] = os.pathsep.join([str(blocker), env.get("PYTHONPATH", "")])
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(ROOT / "bench" / "gpu_run.sh"), str(out)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=1800)  # fmt: skip
    log = (out / "run.log").read_text() if (out / "run.log").is_file() else ""
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:] + log[-6000:]  # the parts stopped

    files = {p.name for p in out.iterdir() if p.is_file()}
    assert files == {p.name for p in out.iterdir()} and files <= FILES and len(FILES) <= 8
    assert files == FILES - {"numerics.log"}  # written by the tests' comparisons, which skip without CUDA
    parts = dict(re.findall(r"^@@ \| (.+?) \| (.+?) \|", log, flags=re.M))
    assert list(parts) == PARTS, log[-6000:]
    stopped = {name: parts.pop(name) for name in CUT.values()}
    assert stopped["smoke timed"] == "124 (time limit)"  # killed at its limit while it starts
    assert stopped[CUT["TRAIN_MORE_S"]] in ("1", "124 (time limit)")  # at its 1-second budget or at the limit
    assert set(parts.values()) == {"0"}, log[-6000:]

    versions = (out / "versions.txt").read_text()
    assert "optional packages present: none" in versions  # the blocker worked: nothing below needed them
    assert "varlen_attn: found" in versions and "enable_gqa=True" in versions and "reference path" in versions
    tests = (out / "tests.log").read_text()
    ran = re.findall(r"^tests/test_gpu.py::(\w+)\S* SKIPPED", tests, flags=re.M)  # every one skips without CUDA
    words = re.search(r'GPU_FIRST="([^"]+)"', (ROOT / "bench" / "gpu_run.sh").read_text()).group(1).split()
    rank = [next((i for i, word in enumerate(words) if word in name), len(words)) for name in ran]
    assert len(ran) > 60 and rank == sorted(rank) and rank.count(0) > 5 and rank.count(1) > 5, ran

    encode = [json.loads(line) for line in (out / "encode.jsonl").read_text().splitlines()]
    measured = {(r["set"], r["config"]): r for r in encode if "tokens_per_s" in r}
    spec = importlib.util.spec_from_file_location("gpu_bench", ROOT / "bench" / "gpu_bench.py")
    gpu_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_bench)
    assert set(measured) == set(gpu_bench.PLAN) and all(r["finite"] for r in measured.values()), encode
    assert all(r["min_cosine"] > 0.99 for (s, c), r in measured.items() if c != "hf-loop" and s != "one32k")
    assert measured["mixed", "ours-compiled"]["graph_breaks"] == 0 < measured["mixed", "ours-compiled"]["graphs"]
    trained = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    assert [r["config"] for r in trained if "tokens_per_s" in r] == ["packed, varlen, ckpt auto, direct"]

    smoke = {r["check"]: r for r in map(json.loads, (out / "smoke.jsonl").read_text().splitlines())}
    expected = ["NaN guard at learning rate 1e20", "MDM stage (LM head, LoRA)",
                "supervised, uninterrupted (the resume's reference)", "supervised, direct (checks' shape)",
                "supervised, stopped then resumed", "resume continues exactly", "total"]  # fmt: skip
    assert {check: smoke.get(check, {}).get("verdict") for check in expected} == dict.fromkeys(expected, "pass")
    assert smoke["resume continues exactly"]["why"] == "bit-exact"  # on the CPU

    summary = (out / "summary.md").read_text()
    assert "| smoke timed | 124 (time limit) |" in summary
    assert "| every CUDA test passes |" in summary
    assert gpu_bench.table(encode) in summary and "| resume continues exactly | pass |" in summary


def test_the_gpu_runs_training_rows_are_bench_train_configurations(monkeypatch):
    """Every row the script names is one bench/train.py accepts (a wrong name would stop that part on the GPU)."""
    script = (ROOT / "bench" / "gpu_run.sh").read_text()
    rows = re.findall(r'--rows "([^"]+)"', script)
    spec = importlib.util.spec_from_file_location("bench_train", ROOT / "bench" / "train.py")
    bench_train = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench_train)  # its dataclasses look their module up there
    spec.loader.exec_module(bench_train)
    assert len(rows) == 4 and set(rows) <= set(bench_train.GPU_CONFIGS), set(rows) - set(bench_train.GPU_CONFIGS)
