"""``OUT/summary.md`` of a ``bench/gpu_run.sh`` run, from the files in OUT as they stand (the script rewrites it after
each part, so a run cut off still has its summary): the parts and their exit statuses, the goals against what was
measured, the versions, the tests' outcome, the encode, training and smoke tables, and the errors the tests
measured (``numerics.log``). Imports no torch: it runs in a fraction of a second.

    python bench/gpu_report.py OUT
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_bench  # noqa: E402 - bench/ is not a package
import train  # noqa: E402

#: The GPU goals (7B shape, bf16, one H100 or H200), checked against the figures.
ENCODE_GOALS = {"mixed": (1.8, 42_000), "cut": (1.15, None), "long": (1.15, None), "one32k": (None, 20_000)}
MIN_COSINE = 0.995
TRAIN_GOALS = {"packed, varlen, ckpt auto, direct": 12_000, "packed, varlen, GradCache": 9_000}
GRAD_CACHE_TIME_RATIO = 1.3  # GradCache's step time at most 1.3x the direct step's (per token)
SYNCS_PER_CHUNK = 2


def rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def parts(log: Path) -> list[str]:
    header = ["| part | exit status | seconds | limit |", "|---|---|---:|---:|"]
    lines = [line[3:] for line in log.read_text().splitlines() if line.startswith("@@ ")] if log.is_file() else []
    return header + lines


def verdict(ok: bool | None) -> str:
    return {True: "met", False: "NOT met", None: "not measured"}[ok]


def goals(encode: list[dict], trained: list[dict], smoke: list[dict], tests: str, plan) -> list[str]:
    """One line per goal: the figure and whether it is met."""
    out = ["| goal | measured | |", "|---|---|---|"]
    measured = {(r["set"], r["config"]): r for r in encode if "tokens_per_s" in r}
    for name, (ratio, speed) in ENCODE_GOALS.items():
        ours, loop = measured.get((name, "ours")), measured.get((name, "hf-loop"))
        if ratio is not None:
            got = ours["tokens_per_s"] / loop["tokens_per_s"] if ours and loop else None
            out.append(f"| encode {name}: >= {ratio}x the loop | {f'{got:.2f}x' if got else '-'} | "
                       f"{verdict(None if got is None else got >= ratio)} |")
        if speed is not None:
            got = ours["tokens_per_s"] if ours else None
            out.append(f"| encode {name}: >= {speed:,} tokens/s | {f'{got:,.0f}' if got else '-'} | "
                       f"{verdict(None if got is None else got >= speed)} |")
    cosines = [r["min_cosine"] for r in encode if r.get("min_cosine") is not None]
    low = min(cosines) if cosines else None
    out.append(f"| encode: min cosine to the loop >= {MIN_COSINE} | {f'{low:.4f}' if low else '-'} | "
               f"{verdict(None if low is None else low >= MIN_COSINE)} |")
    done = {r["config"]: r for r in trained if "tokens_per_s" in r}
    for name, speed in TRAIN_GOALS.items():
        got = done[name]["tokens_per_s"] if name in done else None
        out.append(f"| training {name}: >= {speed:,} tokens/s | {f'{got:,.0f}' if got else '-'} | "
                   f"{verdict(None if got is None else got >= speed)} |")
    cached, direct = done.get("packed, varlen, GradCache"), done.get("packed, varlen, ckpt auto, direct")
    ratio = direct["tokens_per_s"] / cached["tokens_per_s"] if cached and direct else None
    met = None if ratio is None else ratio <= GRAD_CACHE_TIME_RATIO
    out.append(f"| GradCache step time <= {GRAD_CACHE_TIME_RATIO}x the direct step's (per token) | "
               f"{f'{ratio:.2f}x' if ratio else '-'} | {verdict(met)} |")
    if cached and cached.get("host_syncs") is not None:
        chunks = 3 * -(-cached["triples"] // plan.chunk)  # three columns of triples, chunk texts each
        per = cached["host_syncs"] / chunks
        out.append(f"| host waits per GradCache chunk <= {SYNCS_PER_CHUNK} | {per:.1f} ({cached['host_syncs']} per "
                   f"step) | {verdict(per <= SYNCS_PER_CHUNK)} |")
    else:
        out.append(f"| host waits per GradCache chunk <= {SYNCS_PER_CHUNK} | - | {verdict(None)} |")
    outcomes = test_outcomes(tests)
    said = ", ".join(f"{n} {word.lower()}" for word, n in outcomes.items()) or "-"
    ran = outcomes.get("PASSED", 0) + outcomes.get("FAILED", 0) + outcomes.get("ERROR", 0)
    out.append(f"| every CUDA test passes | {said} | "
               f"{verdict(None if not ran else not outcomes.get('FAILED') and not outcomes.get('ERROR'))} |")
    checks = [r for r in smoke if r["verdict"] != "info"]
    failed = [r["check"] for r in checks if r["verdict"] == "FAIL"]
    out.append(f"| the smoke run completes | {len(checks) - len(failed)} of {len(checks)} checks passed"
               f"{': failed ' + ', '.join(failed) if failed else ''} | "
               f"{verdict(None if not checks else not failed)} |")
    return out


def test_outcomes(log: str) -> dict[str, int]:
    """How many tests pytest -v said PASSED, FAILED, SKIPPED or ERROR for (a run cut off at its limit too)."""
    counts: dict[str, int] = {}
    for match in re.finditer(r"^tests/\S+::\S+ (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)", log, flags=re.M):
        counts[match.group(1)] = counts.get(match.group(1), 0) + 1
    return counts


def numerics(log: Path) -> list[str]:
    """The largest error each test measured, in eps of its dtype, against its bound."""
    worst: dict[str, tuple[float, str]] = defaultdict(lambda: (float("-inf"), ""))
    if log.is_file():
        for line in log.read_text().splitlines():
            test, _, ratio, bound = (line.split("\t") + ["", "", "", ""])[:4]
            if ratio and float(ratio) > worst[test][0]:
                worst[test] = (float(ratio), bound)
    return ["| test | largest error (eps) | bound (eps) |", "|---|---:|---:|"] + [
        f"| {test} | {ratio:.2f} | {bound} |" for test, (ratio, bound) in sorted(worst.items())
    ]


def smoke_table(smoke: list[dict]) -> list[str]:
    out = ["| check | verdict | figures |", "|---|---|---|"]
    for r in smoke:
        figures = "; ".join(f"{k}: {v}" for k, v in r.items() if k not in ("check", "verdict"))
        out.append(f"| {r['check']} | {r['verdict']} | {figures[:400]} |")
    return out


def summary(out: Path) -> str:
    log = out / "run.log"
    first = log.read_text().splitlines()[0] if log.is_file() else ""
    dry = "dry_run 1" in first
    versions = (out / "versions.txt").read_text() if (out / "versions.txt").is_file() else "(not written)\n"
    tests = (out / "tests.log").read_text() if (out / "tests.log").is_file() else ""
    encode, trained, smoke = rows(out / "encode.jsonl"), rows(out / "train.jsonl"), rows(out / "smoke.jsonl")
    plan = train.DRY_PLAN if dry else train.GPU_PLAN
    lines = [
        "# GPU run (bench/gpu_run.sh)", "", f"`{first}`", "", "## Parts", "", *parts(log), "",
        "## Goals (7B shape, bf16, one H100 or H200)" + (" (a dry run: tiny shapes on a CPU)" if dry else ""), "",
        *goals(encode, trained, smoke, tests, plan), "", "## Versions", "", "```", versions.rstrip(), "```", "",
        "## tests/test_gpu.py (the end of tests.log)", "", "```", *tests.splitlines()[-30:], "```", "",
        "## Errors the tests measured (numerics.log)", "", *numerics(out / "numerics.log"), "",
        "## encode beside the plain Hugging Face loop (encode.jsonl)", "", gpu_bench.table(encode), "",
        "## Training steps (train.jsonl)", "",
        train.gpu_report(trained, plan, "bench/train.py --gpu (rows of bench/gpu_run.sh)") if trained else "none", "",
        "## Smoke run of the training entry points (smoke.jsonl)", "", *smoke_table(smoke), "",
    ]  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    out = Path(sys.argv[1])
    (out / "summary.md").write_text(summary(out))


if __name__ == "__main__":
    main()
