"""Smoke run of the real training entry points on one GPU: ``torchrun --nproc_per_node 1`` of the
supervised stage and of the masked-diffusion (MDM) LM stage on a random checkpoint saved locally
(part (d) of ``bench/gpu_run.sh``).

    python bench/gpu_smoke_train.py --out DIR              # GPU: Qwen2.5-1.5B shape (Dream format), bf16
    python bench/gpu_smoke_train.py --out DIR --dry-run    # CPU: tiny shape, float32
    python bench/gpu_smoke_train.py --out DIR --parts checks --jsonl OUT/smoke.jsonl   # what gpu_run.sh runs

Every run is a real ``experiments/run_*.py`` under torchrun, from a JSON config, within a time budget
(``Plan.budget``: each run's timeout is what is left of it). ``--parts`` picks:

- ``checks``, on a small shape (4 layers of width 256 on a GPU: a run costs its start-up, about 12 s), in three
  lanes at once (``--lanes``): the NaN guard (learning rate 1e20, warmup 2, a checkpoint every step: exit status
  1 naming checkpoint-1 as the last finite one, which must be complete and finite), then the MDM stage (LoRA, LM
  head, bf16, activation checkpointing, a checkpoint); an uninterrupted GradCache run (LoRA dropout 0.1), then the
  same without GradCache; and the GradCache run stopped at its first checkpoint (``stop_after_n_steps``) and
  resumed with ``--resume_from_checkpoint last``. The resumed run's final LoRA weights must be the uninterrupted
  run's bit for bit, or, where two uninterrupted runs differ (the kernels' own nondeterminism, measured by a second
  one), within 3x their difference;
- ``timed``: supervised at the Qwen2.5-1.5B shape, bf16 weights and autocast, activation checkpointing, LoRA
  dropout 0.1: GradCache (``chunk`` texts per chunk) and direct, their seconds per step and the ratio.

Random checkpoints are in the Dream layout (Qwen2 weights as safetensors, Dream's config.json with its mask token,
the Dream fixture's tokenizer), the data local JSONL (triples: queries of 16-64 tokens, passages of 128-400;
plain text for the LM stage). Every figure and verdict is appended to ``DIR/results.jsonl`` (and ``--jsonl``) and
``DIR/summary.md`` as it is known; each run's log is in ``DIR/logs``, and a failed check prints the end of its
runs' logs. The exit status is 0 only if every verdict passed. Nothing here needs ``datasets``, ``mteb``,
``bm25s`` or flash-attn (the environment record says which are present).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DREAM_FIXTURE = REPO / "tests" / "fixtures" / "dream_reference"
TOKENIZER_FILES = ("vocab.json", "merges.txt", "special_tokens_map.json", "tokenizer_config.json")
#: Qwen2.5-1.5B's shape (Dream-7B's family) for the timed runs, a small one (4 layers, Qwen2.5's vocabulary) for the
#: checks; the CPU dry run takes ``random_models.TINY_SHAPE``.
SHAPES = {
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936),
    "small": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=151936),  # the checks': each run is its start-up time
}  # fmt: skip
OPTIONAL = ("datasets", "mteb", "bm25s", "flash_attn")


@dataclasses.dataclass
class Plan:
    """Sizes of one smoke run: the GPU's, or the dry run's (tiny, float32, on the CPU)."""

    shape: str  # the timed supervised runs' (GradCache and direct)
    checks: str  # the shape of the NaN guard, the MDM stage and the resume, which need no large model
    dtype: str | None  # torch_dtype of the weights; None = float32
    bf16: bool  # autocast
    batch: int  # triples per step
    chunk: int  # GradCache texts per chunk
    query_tokens: tuple[int, int]
    passage_tokens: tuple[int, int]
    steps: int  # max_steps of the supervised runs; the resume's checkpoints at steps/2 and steps
    block: int  # LM-stage tokens per block
    lm_batch: int
    lm_steps: int
    timeout: int  # seconds per run at most
    budget: int  # seconds for the whole smoke run


GPU = Plan("qwen2.5-1.5b", "small", "bfloat16", True, 8, 4, (16, 64), (128, 400), 4, 256, 8, 2, 90, 180)
DRY = Plan("tiny", "tiny", None, False, 4, 2, (8, 16), (16, 48), 4, 32, 4, 2, 300, 3000)  # a loaded CPU: no real budget


class Report:
    """Appends each figure and verdict to results.jsonl (and ``jsonl``) and rewrites summary.md, as it goes; a
    failed check prints the end of its runs' logs."""

    def __init__(self, out: Path, jsonl: Path | None = None):
        self.out, self.jsonl = out, jsonl
        self.rows: list[dict] = []
        self.lock = threading.Lock()  # checks run in lanes at once
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.jsonl").write_text("")

    def add(self, check: str, ok: bool | None, **figures) -> bool:
        row = {"check": check, "verdict": {True: "pass", False: "FAIL", None: "info"}[ok], **figures}
        with self.lock:
            self.rows.append(row)
            for path in (self.out / "results.jsonl", self.jsonl):
                if path is not None:
                    with open(path, "a", encoding="utf-8") as f:
                        f.write(json.dumps(row) + "\n")
            lines = ["# Training smoke run (bench/gpu_smoke_train.py)", "", "| check | verdict | figures |"]
            lines.append("|---|---|---|")
            for r in self.rows:
                figures_text = "; ".join(f"{k}: {v}" for k, v in r.items() if k not in ("check", "verdict"))
                lines.append(f"| {r['check']} | {r['verdict']} | {figures_text} |")
            (self.out / "summary.md").write_text("\n".join(lines) + "\n")
            print(f"[smoke] {check}: {row['verdict']} {json.dumps(figures)}", flush=True)
            if ok is False:
                for log in logs_of(figures):
                    tail = (self.out / log).read_text(errors="replace").splitlines()[-40:]
                    print(f"[smoke] end of {log}:\n" + "\n".join(tail), flush=True)
        return ok is not False

    @property
    def passed(self) -> bool:
        return all(r["verdict"] != "FAIL" for r in self.rows)


def logs_of(figures: dict) -> list[str]:
    """The run logs named in a check's figures (a run's own, or those of the runs it holds)."""
    found = [figures["log"]] if isinstance(figures.get("log"), str) else []
    for value in figures.values():
        if isinstance(value, dict):
            found += logs_of(value)
    return found


def environment(device: str) -> dict:
    from importlib import metadata

    import torch

    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    present = [m for m in OPTIONAL if importlib.util.find_spec(m) is not None]
    versions = {m: metadata.version(m) for m in ("transformers", "peft", "accelerate")}  # without importing them
    return dict(device=name, torch=torch.__version__, **versions, optional_present=present or "none")


def make_checkpoint(folder: Path, plan: Plan, shape: str, device: str) -> dict:
    """Random Qwen2 weights (seed 0) saved as safetensors under Dream's config.json, and Dream's tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from diffusion_embedder.random_models import TINY_SHAPE

    start = time.perf_counter()
    dims = {**SHAPES, "tiny": TINY_SHAPE[1]}[shape]
    config = AutoConfig.for_model("qwen2", **dims, max_position_embeddings=32768, tie_word_embeddings=False)
    torch.manual_seed(0)
    dtype = getattr(torch, plan.dtype or "float32")
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(folder, safe_serialization=True)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    dream = json.loads((DREAM_FIXTURE / "config.json").read_text())
    dream.update(dims, torch_dtype=plan.dtype or "float32", max_position_embeddings=32768)
    (folder / "config.json").write_text(json.dumps(dream, indent=2))
    for name in TOKENIZER_FILES:
        shutil.copy(DREAM_FIXTURE / name, folder / name)
    size = sum(p.stat().st_size for p in folder.iterdir()) / 2**30
    return dict(seconds=round(time.perf_counter() - start, 1), size_gib=round(size, 2), shape=shape)


def random_text(tokenizer, tokens: int, generator) -> str:
    import torch

    ids = torch.randint(10, len(tokenizer) - 10, (tokens,), generator=generator).tolist()
    return tokenizer.decode(ids, skip_special_tokens=True)


def make_data(folder: Path, plan: Plan, checkpoint: Path) -> dict:
    """Local JSONL: triples for the supervised stage, plain text for the LM stage."""
    import torch

    from diffusion_embedder.backbones import load_tokenizer

    tokenizer = load_tokenizer(str(checkpoint))
    g = torch.Generator().manual_seed(0)

    def length(bounds: tuple[int, int]) -> int:
        return int(torch.randint(bounds[0], bounds[1] + 1, (1,), generator=g))

    folder.mkdir(parents=True, exist_ok=True)
    samples = plan.batch * plan.steps
    with open(folder / "triples.jsonl", "w", encoding="utf-8") as f:
        for _ in range(samples):
            record = {
                "instruction": "Given a question, retrieve the passage that answers it",
                "query": random_text(tokenizer, length(plan.query_tokens), g),
                "positive": random_text(tokenizer, length(plan.passage_tokens), g),
                "negatives": [random_text(tokenizer, length(plan.passage_tokens), g)],
            }
            f.write(json.dumps(record) + "\n")
    blocks = plan.lm_batch * plan.lm_steps + 2
    with open(folder / "text.jsonl", "w", encoding="utf-8") as f:
        for _ in range(blocks):
            f.write(json.dumps({"text": random_text(tokenizer, plan.block + 8, g)}) + "\n")
    return dict(triples=samples, text_records=blocks)


def configs(out: Path, plan: Plan, checkpoint: Path, name: str) -> tuple[Path, Path]:
    """The supervised and MDM configs of one checkpoint (files NAME_supervised.json, NAME_mdm.json)."""
    common = {
        "model_name_or_path": str(checkpoint),
        "torch_dtype": plan.dtype,
        "bf16": plan.bf16,
        "activation_checkpointing": True,  # read as gradient_checkpointing on transformers 5.17
        "attn_implementation": "sdpa",
        "lora_r": 16,
        "seed": 42,
        "learning_rate": 2e-4,
        "warmup_steps": 1,
        "logging_steps": 1,
        "save_only_model": False,
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
        "report_to": "none",
        "stop_after_n_steps": None,
        "output_dir": str(out / "runs"),
    }
    supervised = {
        **common,
        "bidirectional": True,
        "pooling_mode": "mean",
        "max_seq_length": 512,
        "doc_max_length": 512,
        "skip_instruction": True,
        "dataset_name": "Custom",
        "dataset_file_path": str(out / "data" / "triples.jsonl"),
        "num_negatives": 1,
        "loss_class": "HardNegativeNLLLoss",
        "lora_dropout": 0.1,
        "per_device_train_batch_size": plan.batch,
        "max_steps": plan.steps,
        "save_steps": plan.steps // 2,
        "remove_unused_columns": False,
    }
    lm = {
        **common,
        "objective": "mdm",
        "mdm_shift": True,
        "train_file": [str(out / "data" / "text.jsonl")],
        "text_column": "text",
        "max_seq_length": plan.block,
        "per_device_train_batch_size": plan.lm_batch,
        "max_steps": plan.lm_steps,
        "save_steps": plan.lm_steps // 2,
    }
    paths = out / f"{name}_supervised.json", out / f"{name}_mdm.json"
    for path, values in zip(paths, (supervised, lm), strict=True):
        path.write_text(json.dumps(values, indent=2))
    return paths


def torchrun(out: Path, log_name: str, script: str, config: Path, timeout: int, *overrides: str) -> dict:
    """One run of ``script`` under ``torchrun --standalone --nproc_per_node 1``, its run folder named by the
    ``--experiment_id`` in ``overrides``; its log goes to logs/LOG_NAME.log."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
               str(REPO / "experiments" / script), str(config), *overrides]  # fmt: skip
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    (out / "logs").mkdir(exist_ok=True)
    log = out / "logs" / f"{log_name}.log"
    start = time.perf_counter()
    for attempt in range(2):  # runs in lanes at once: a rendezvous port taken by another gets one more try
        try:
            done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                                  timeout=max(1, timeout - (time.perf_counter() - start)))  # fmt: skip
            code, text = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as err:
            code, text = "timeout", "".join(x.decode(errors="replace") if isinstance(x, bytes) else x or ""
                                            for x in (err.stdout, err.stderr))  # fmt: skip
        if code == 0 or attempt or "address already in use" not in text.lower():
            break
    log.write_text(" ".join(command) + "\n\n" + text)
    return dict(exit=code, seconds=round(time.perf_counter() - start, 1), log=str(log.relative_to(out)))


def run_figures(run: Path) -> dict:
    """Losses and step time from the newest checkpoint's trainer_state.json."""
    from diffusion_embedder.training.checkpoints import COMPLETE_MARKER, list_checkpoints

    checkpoints = list_checkpoints(run)
    if not checkpoints:
        return dict(checkpoints=0)
    newest = Path(checkpoints[0])
    state = json.loads((newest / "trainer_state.json").read_text())
    losses = [e["loss"] for e in state["log_history"] if "loss" in e]
    return dict(step=state["global_step"], losses=[round(x, 4) for x in losses],
                complete=(newest / COMPLETE_MARKER).is_file(), checkpoints=len(checkpoints))  # fmt: skip


def trained_ok(result: dict, figures: dict, steps: int) -> bool:
    import math

    return (result["exit"] == 0 and figures.get("step") == steps and figures.get("complete", False)
            and all(math.isfinite(x) for x in figures.get("losses", [float("nan")])))  # fmt: skip


def weight_difference(a: Path, b: Path) -> dict:
    """How far two trainable.safetensors files are apart: bit-exact, largest |difference|, and the
    difference's L2 norm relative to the second's (kernel noise touches few elements, a wrong resume all)."""
    import torch
    from safetensors.torch import load_file

    x, y = load_file(a), load_file(b)
    if x.keys() != y.keys():
        return dict(same_keys=False, bit_exact=False, rel_l2=float("inf"))
    diff = torch.stack([(x[k].float() - y[k].float()).norm() for k in x]).norm().item()
    norm = torch.stack([y[k].float().norm() for k in y]).norm().item()
    worst = max((x[k].float() - y[k].float()).abs().max().item() for k in x)
    return dict(same_keys=True, bit_exact=all(x[k].equal(y[k]) for k in x), max_abs=worst, rel_l2=diff / norm)


class Clock:
    """The smoke run's time budget: each run may take what is left of it (at most ``plan.timeout``)."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return round(time.perf_counter() - self.start, 1)

    def timeout(self) -> int:
        return max(1, min(self.plan.timeout, int(self.plan.budget - self.elapsed())))


def resume_verdict(out: Path, plan: Plan, supervised: Path, gc: list[str], clock: Clock) -> dict:
    """Is the resumed run's final adapter the uninterrupted run's (``ref``)? Bit-exact passes. Otherwise a second
    uninterrupted run measures the kernels' own nondeterminism, which must bound the resume's difference."""
    from diffusion_embedder.training.checkpoints import TRAINABLE_WEIGHTS

    runs, half = out / "runs", plan.steps // 2
    at_checkpoint = weight_difference(runs / "resume" / f"checkpoint-{half}" / TRAINABLE_WEIGHTS,
                                      runs / "ref" / f"checkpoint-{half}" / TRAINABLE_WEIGHTS)  # fmt: skip
    final = weight_difference(runs / "resume" / TRAINABLE_WEIGHTS, runs / "ref" / TRAINABLE_WEIGHTS)
    if final["bit_exact"]:
        return dict(ok=True, why="bit-exact", final=final)
    again = torchrun(out, "ref_again", "run_supervised.py", supervised, clock.timeout(), "--experiment_id",
                     "ref_again", *gc)  # fmt: skip
    noise = weight_difference(runs / "ref_again" / TRAINABLE_WEIGHTS, runs / "ref" / TRAINABLE_WEIGHTS)
    if noise["bit_exact"]:
        why = "two uninterrupted runs agree bit for bit, the resumed one does not: the resume is not exact"
        return dict(ok=False, why=why, final=final, at_checkpoint=at_checkpoint, second_run=again)
    ok = final["rel_l2"] <= 3 * noise["rel_l2"]
    why = ("the kernels are not deterministic (two uninterrupted runs differ); the resume's difference is "
           + ("within" if ok else "beyond") + " 3x theirs")  # fmt: skip
    return dict(ok=ok, why=why, final=final, uninterrupted_twice=noise, at_checkpoint=at_checkpoint, second_run=again)


def nan_guard(out: Path, report: Report, supervised: Path, gc: list[str], clock: Clock) -> None:
    from diffusion_embedder.training.checkpoints import TRAINABLE_WEIGHTS, find_last_checkpoint

    runs = out / "runs"
    result = torchrun(out, "nan", "run_supervised.py", supervised, clock.timeout(), "--experiment_id", "nan", *gc,
                      "--learning_rate", "1e20", "--warmup_steps", "2", "--save_steps", "1")  # fmt: skip
    good = runs / "nan" / "checkpoint-1"
    log = (out / result["log"]).read_text()
    named = f"last finite checkpoint is {good}" in log
    last = find_last_checkpoint(runs / "nan")
    finite = False
    if (good / TRAINABLE_WEIGHTS).is_file():
        from safetensors.torch import load_file

        finite = all(t.isfinite().all() for t in load_file(good / TRAINABLE_WEIGHTS).values())
    message = next((line.strip() for line in log.splitlines() if "training stopped" in line or "not finite" in line),
                   None)  # fmt: skip
    stopped_right = result["exit"] == 1 and named and last == str(good) and finite
    report.add("NaN guard at learning rate 1e20", stopped_right, exit=result["exit"], seconds=result["seconds"],
               names_checkpoint_1=named, last_complete=last, finite=finite, message=message)  # fmt: skip


def mdm_stage(out: Path, plan: Plan, report: Report, lm: Path, clock: Clock) -> None:
    result = torchrun(out, "mdm", "run_mntp.py", lm, clock.timeout(), "--experiment_id", "mdm")
    figures = run_figures(out / "runs" / "mdm")
    adapter = (out / "runs" / "mdm" / "adapter_model.safetensors").is_file()
    report.add("MDM stage (LM head, LoRA)", trained_ok(result, figures, plan.lm_steps) and adapter,
               **result, **figures, adapter_saved=adapter)  # fmt: skip


def reference_run(out: Path, plan: Plan, report: Report, supervised: Path, gc: list[str], clock: Clock) -> None:
    ref = torchrun(out, "ref", "run_supervised.py", supervised, clock.timeout(), "--experiment_id", "ref", *gc)
    figures = run_figures(out / "runs" / "ref")
    report.add("supervised, uninterrupted (the resume's reference)", trained_ok(ref, figures, plan.steps),
               **ref, **figures)  # fmt: skip


def direct_run(out: Path, plan: Plan, report: Report, supervised: Path, clock: Clock) -> None:
    """The supervised stage without GradCache (the reference run has it)."""
    result = torchrun(out, "direct_small", "run_supervised.py", supervised, clock.timeout(), "--experiment_id",
                      "direct_small")  # fmt: skip
    figures = run_figures(out / "runs" / "direct_small")
    report.add("supervised, direct (checks' shape)", trained_ok(result, figures, plan.steps), **result, **figures)


def stop_and_resume(out: Path, plan: Plan, report: Report, supervised: Path, gc: list[str], clock: Clock) -> None:
    again = ["--experiment_id", "resume", *gc]
    stopped = torchrun(out, "stopped", "run_supervised.py", supervised, clock.timeout(), *again,
                       "--stop_after_n_steps", str(plan.steps // 2))  # fmt: skip
    resumed = torchrun(out, "resumed", "run_supervised.py", supervised, clock.timeout(), *again,
                       "--resume_from_checkpoint", "last")  # fmt: skip
    figures = run_figures(out / "runs" / "resume")
    report.add("supervised, stopped then resumed", trained_ok(resumed, figures, plan.steps) and stopped["exit"] == 0,
               stopped=stopped, resumed=resumed, **figures)  # fmt: skip


def checks(out: Path, plan: Plan, report: Report, supervised: Path, lm: Path, gc: list[str], clock: Clock,
           lanes: int) -> None:
    """The NaN guard then the MDM stage, the uninterrupted GradCache run then a direct one, and the stopped-and-resumed
    run, in up to ``lanes`` lanes at once (each run is mostly its start-up); then whether the resume continued
    exactly."""
    work = [[lambda: nan_guard(out, report, supervised, gc, clock), lambda: mdm_stage(out, plan, report, lm, clock)],
            [lambda: reference_run(out, plan, report, supervised, gc, clock),
             lambda: direct_run(out, plan, report, supervised, clock)],
            [lambda: stop_and_resume(out, plan, report, supervised, gc, clock)]]  # fmt: skip
    groups = [[step for lane in work[i::lanes] for step in lane] for i in range(min(lanes, len(work)))]
    with ThreadPoolExecutor(len(groups)) as pool:
        for done in [pool.submit(lambda steps: [step() for step in steps], group) for group in groups]:
            done.result()
    try:
        verdict = resume_verdict(out, plan, supervised, gc, clock)
    except FileNotFoundError as err:
        verdict = dict(ok=False, why=f"missing {err.filename}")
    report.add("resume continues exactly", verdict.pop("ok"), **verdict)


def timed(out: Path, plan: Plan, report: Report, supervised: Path, gc: list[str], clock: Clock) -> None:
    """GradCache and direct at the timed shape: seconds per step by the Trainer's clock, and their ratio."""
    per_step = {}
    for name, extra in (("gc", gc), ("direct", [])):
        result = torchrun(out, name, "run_supervised.py", supervised, clock.timeout(), "--experiment_id", name, *extra)
        figures = run_figures(out / "runs" / name)
        runtime = re.search(r"'train_runtime': '?([0-9.]+)", (out / result["log"]).read_text())  # the Trainer's clock
        per_step[name] = round(float(runtime.group(1)) / plan.steps, 3) if runtime else None
        what = f"supervised, GradCache chunk {plan.chunk}" if extra else "supervised, direct"
        report.add(what, trained_ok(result, figures, plan.steps), **result, **figures, s_per_step=per_step[name],
                   shape=plan.shape)  # fmt: skip
    if all(per_step.values()):
        report.add("GradCache / direct, seconds per step", None, ratio=round(per_step["gc"] / per_step["direct"], 2),
                   note="includes each run's first step (warm-up) and its checkpoint writes")  # fmt: skip


def smoke(out: Path, plan: Plan, device: str, parts: list[str], lanes: int = 3, jsonl: Path | None = None) -> bool:
    report = Report(out, jsonl)
    clock = Clock(plan)
    report.add("environment", None, **environment(device), budget_s=plan.budget, parts=parts)
    gc = ["--grad_cache_chunk_size", str(plan.chunk)]
    shapes = {role: shape for role, shape in (("checks", plan.checks), ("timed", plan.shape))
              if role in parts}  # fmt: skip
    made: dict[str, Path] = {}
    for role, shape in shapes.items():
        same = next((path for r, path in made.items() if shapes[r] == shape), None)
        made[role] = same or out / f"model_{shape}"
        if same is None:
            report.add(f"random checkpoint {shape} (Dream layout, safetensors)", None,
                       **make_checkpoint(made[role], plan, shape, device))  # fmt: skip
    report.add("local JSONL data", None, **make_data(out / "data", plan, next(iter(made.values()))))
    if "checks" in parts:
        supervised, lm = configs(out, plan, made["checks"], "checks")
        checks(out, plan, report, supervised, lm, gc, clock, lanes)
    if "timed" in parts:
        timed_supervised, _ = configs(out, plan, made["timed"], "timed")
        timed(out, plan, report, timed_supervised, gc, clock)
    report.add("total", clock.elapsed() <= plan.budget, seconds=clock.elapsed(), budget_s=plan.budget)
    return report.passed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for the model, data, runs, logs and results")
    parser.add_argument("--dry-run", action="store_true", help="tiny shape, float32, on the CPU")
    parser.add_argument("--parts", nargs="+", choices=["checks", "timed"], default=["checks", "timed"])
    parser.add_argument("--lanes", type=int, default=3, help="check runs at once (1: one after the other)")
    parser.add_argument("--jsonl", type=Path, default=None, help="also append every row to this file")
    parser.add_argument("--budget", type=int, default=None, help="seconds for the whole smoke run (the plan's)")
    args = parser.parse_args()
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("No CUDA device: run with --dry-run on a CPU.")
    if args.out.exists() and any(args.out.iterdir()):
        sys.exit(f"{args.out} is not empty: give a new folder.")
    plan = DRY if args.dry_run else GPU
    plan = dataclasses.replace(plan, budget=args.budget) if args.budget else plan
    ok = smoke(args.out.resolve(), plan, "cpu" if args.dry_run else "cuda", args.parts, args.lanes, args.jsonl)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
