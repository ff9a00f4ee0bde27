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
