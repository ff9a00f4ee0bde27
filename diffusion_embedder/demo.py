"""The main job in miniature: bidirectional vs causal, trained and evaluated on this machine.

1. one tiny Dream-format checkpoint (tokenizer trained on the shipped ReasonAug text, random
   weights): the bidirectional and the causal arm start from the very same weights;
2. both arms trained by the real training entry point (``torchrun``, 2 CPU processes,
   HardNegativeNLLLoss) on the ReasonAug training split, from ``train_configs/demo/``;
3. the untrained and trained encoders evaluated through the real evaluation path (a local BEIR
   task through mteb) on the held-out ReasonAug concepts;
4. one table (nDCG@10 and Recall@100 per model, before and after training) and the report
   (markdown, CSV, bar charts) in the output folder, next to the checkpoints.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import math
import os
import random
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from diffusion_embedder import clihelp
from diffusion_embedder.demo_model import TinyModelConfig, make_tiny_dream

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]
TRAIN_SPLIT = REPO / "ReasonAug" / "ReasonAug_train.jsonl.gz"
HELDOUT_SPLIT = REPO / "ReasonAug" / "ReasonAug_heldout.jsonl.gz"
DEMO_CONFIGS = REPO / "train_configs" / "demo"
ARMS = ("bidirectional", "causal")
#: Held-out task: a problem as query, every problem/solution document of its concept relevant.
TASK_TYPES = ("p2ps", "ps2ps")


@dataclass
class DemoSettings:
    output_dir: Path
    config_dir: Path = DEMO_CONFIGS
    max_queries: int = 200
    nproc: int = 2
    max_steps: int | None = None
    seed: int = 0
    model: TinyModelConfig = TinyModelConfig()


def read_jsonl_gz(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def corpus_texts(records: list[dict]) -> list[str]:
    """Every text of the training split, for the tokenizer."""
    return [r[k] for r in records for k in ("user_query", "positive_document", "hard_negative_document")]


def build_heldout_task(records: list[dict], folder: Path, max_queries: int, seed: int) -> dict:
    """A BEIR folder: held-out problems as queries, the held-out documents as corpus, same concept = relevant."""
    docs: dict[str, tuple[str, str]] = {}
    for r in records:
        if r["task_type"] in TASK_TYPES:
            docs.setdefault(r["positive_document"], (f"d{len(docs)}", r["instance"]))
            if r.get("hard_negative_document"):
                docs.setdefault(r["hard_negative_document"], (f"d{len(docs)}", r["negative_instance"]))
    by_concept: dict[str, list[str]] = defaultdict(list)
    for doc_id, concept in docs.values():
        by_concept[concept].append(doc_id)
    seen, queries = set(), []
    for r in records:
        if r["task_type"] == "p2ps" and r["user_query"] not in seen and r["instance"] in by_concept:
            seen.add(r["user_query"])
            queries.append(r)
    random.Random(seed).shuffle(queries)
    queries = sorted(queries[:max_queries], key=lambda r: r["id"])

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "qrels").mkdir(exist_ok=True)
    with open(folder / "corpus.jsonl", "w", encoding="utf-8") as f:
        for text, (doc_id, _) in docs.items():
            f.write(json.dumps({"_id": doc_id, "title": "", "text": text}) + "\n")
    with open(folder / "queries.jsonl", "w", encoding="utf-8") as f, open(
        folder / "qrels" / "test.tsv", "w", encoding="utf-8"
    ) as q:
        q.write("query-id\tcorpus-id\tscore\n")
        for i, r in enumerate(queries):
            f.write(json.dumps({"_id": f"q{i}", "text": r["user_query"]}) + "\n")
            for doc_id in by_concept[r["instance"]]:
                if docs.get(r["user_query"], ("",))[0] != doc_id:
                    q.write(f"q{i}\t{doc_id}\t1\n")
    task = {
        "name": "ReasonAugHeldoutConcepts",
        "instruction": "Given a problem, retrieve the relevant problems that can be solved by the similar concept.",
    }
    (folder / "task.json").write_text(json.dumps(task, indent=2))
    return {"queries": len(queries), "documents": len(docs), "concepts": len(by_concept)}


def train_arm(arm: str, init: Path, output_dir: Path, settings: DemoSettings) -> Path:
    """Run the real training entry point under torchrun; returns the final checkpoint folder."""
    script = REPO / "experiments" / "run_supervised.py"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={settings.nproc}",
        str(script), str(settings.config_dir / f"{arm}.json"),
        "--model_name_or_path", str(init), "--output_dir", str(output_dir), "--seed", str(settings.seed),
        "--overwrite_output_dir",  # the demo rebuilds everything: a rerun replaces the previous run
    ]
    if settings.max_steps is not None:  # a checkpoint at the last step keeps its loss log
        command += ["--max_steps", str(settings.max_steps), "--save_steps", str(settings.max_steps)]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    logger.info("Training the %s arm: %s", arm, " ".join(command))
    subprocess.run(command, check=True, env=env, cwd=REPO)
    return output_dir


def final_training_loss(run_dir: Path) -> float:
    """The last logged training loss of a run (from its newest checkpoint's trainer state)."""
    states = sorted(run_dir.glob("checkpoint-*/trainer_state.json"), key=lambda p: int(p.parent.name.split("-")[1]))
    if not states:
        raise FileNotFoundError(f"{run_dir} has no checkpoint with a trainer_state.json")
    losses = [entry["loss"] for entry in json.loads(states[-1].read_text())["log_history"] if "loss" in entry]
    if not losses:
        raise ValueError(f"{states[-1]} logged no training loss (logging_steps larger than the run)")
    return losses[-1]


def chance_loss(config: Path, nproc: int) -> float:
    """InfoNCE loss of an encoder that cannot tell candidates apart: ln(global batch x (1 + one hard negative))."""
    values = json.loads(config.read_text())
    global_batch = values["per_device_train_batch_size"] * nproc * values.get("gradient_accumulation_steps", 1)
    return math.log(2 * global_batch)


def learned(final_loss: float, chance: float) -> bool:
    """An arm whose training loss ends within 10% of chance did not learn its training task."""
    return final_loss < 0.9 * chance


def scores_of(results_dir: str, task_name: str) -> dict[str, float]:
    """nDCG@10 and Recall@100 from the mteb result file of ``task_name`` under ``results_dir``."""
    path = next(Path(results_dir).rglob(f"{task_name}.json"))
    split = json.loads(path.read_text())["scores"]["test"][0]
    return {"ndcg_at_10": split["ndcg_at_10"], "recall_at_100": split["recall_at_100"]}


def training_settings(config: Path) -> dict:
    """The encoder settings a training config gives its checkpoints, so an untrained model is scored the same way
    (lengths, pooling, instruction handling): otherwise "trained vs untrained" also compares settings."""
    values = json.loads(config.read_text())
    return {
        "max_length": values.get("max_length", values.get("max_seq_length")),
        "doc_max_length": values["doc_max_length"],
        "skip_instruction": values["skip_instruction"],
        "pooling_mode": values["pooling_mode"],
    }


def evaluate_models(models: dict[str, tuple], task: Path, output_dir: Path) -> dict[str, dict]:
    """Evaluate each ``label -> (checkpoint, bidirectional[, settings])`` on the local task through mteb."""
    from diffusion_embedder.evaluation import run as evaluation

    scores = {}
    for label, (checkpoint, bidirectional, *settings) in models.items():
        args = evaluation.EvalArguments(
            base_model_name_or_path=checkpoint,
            local_task=[str(task)],
            output_dir=str(output_dir / "eval" / label),
            enable_bidirectional=bidirectional,
            batch_size=64,
            model_name=f"demo/{label}",
            show_progress_bar=True,
            **(settings[0] if settings else {}),
        )
        model = evaluation.wrap_encoder(evaluation.load_encoder(args), args)
        outcome = evaluation.evaluate(model, evaluation.task_factories(args), args)
        if outcome.failures:
            raise RuntimeError(f"Evaluation of {label} failed: {outcome.failures}")
        scores[label] = scores_of(outcome.results_dir, json.loads((task / "task.json").read_text())["name"])
    return scores


def results_table(scores: dict[str, dict]) -> str:
    lines = [
        "| model | attention | training | nDCG@10 | Recall@100 | final train loss (chance) |",
        "|---|---|---|---|---|---|",
    ]
    for label, s in scores.items():
        arm, stage = label.rsplit("-", 1)
        loss = ""
        if "final_loss" in s:
            verdict = "" if learned(s["final_loss"], s["chance_loss"]) else ": near chance, did not learn"
            loss = f"{s['final_loss']:.3f} ({s['chance_loss']:.3f}){verdict}"
        row = f"| {label} | {arm} | {stage} | {100 * s['ndcg_at_10']:.2f} | {100 * s['recall_at_100']:.2f} | {loss} |"
        lines.append(row)
    return "\n".join(lines)


def run_demo(settings: DemoSettings) -> dict[str, dict]:
    """The whole job; returns ``label -> scores`` and writes everything under ``settings.output_dir``."""
    out = settings.output_dir
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    train_records = read_jsonl_gz(TRAIN_SPLIT)
    init = make_tiny_dream(out / "init", corpus_texts(train_records), settings.model)
    task = out / "heldout_task"
    stats = build_heldout_task(read_jsonl_gz(HELDOUT_SPLIT), task, settings.max_queries, settings.seed)
    logger.info("Held-out task: %s", stats)

    checkpoints = {arm: train_arm(arm, init, out / "checkpoints" / arm, settings) for arm in ARMS}
    models = {}
    for arm in ARMS:
        settings_ = training_settings(settings.config_dir / f"{arm}.json")
        models[f"{arm}-untrained"] = (str(init), arm == "bidirectional", settings_)
        models[f"{arm}-trained"] = (str(checkpoints[arm]), arm == "bidirectional")
    scores = evaluate_models(models, task, out)
    for arm in ARMS:
        scores[f"{arm}-trained"]["final_loss"] = final_training_loss(checkpoints[arm])
        scores[f"{arm}-trained"]["chance_loss"] = chance_loss(settings.config_dir / f"{arm}.json", settings.nproc)

    from diffusion_embedder.evaluation.report import write_report

    table = results_table(scores)
    write_report([str(out / "eval" / label) for label in models], str(out / "report"))
    (out / "report").mkdir(exist_ok=True)
    (out / "report" / "demo.md").write_text(
        f"# Demo: bidirectional vs causal\n\nHeld-out task: {stats}\n\n{table}\n\n"
        f"Wall time: {time.perf_counter() - start:.0f} s\n"
    )
    with open(out / "report" / "demo.csv", "w", encoding="utf-8") as f:
        f.write("model,ndcg_at_10,recall_at_100\n")
        for label, s in scores.items():
            f.write(f"{label},{s['ndcg_at_10']:.6f},{s['recall_at_100']:.6f}\n")
    return scores


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=clihelp.prog("demo"), description=__doc__, formatter_class=clihelp.HelpFormatter
    )
    parser.add_argument("--output_dir", default="runs/demo", help="checkpoints, results and report go here")
    parser.add_argument("--max_queries", type=int, default=200)
    parser.add_argument("--max_steps", type=int, default=None, help="override the demo configs' step count")
    parser.add_argument("--nproc", type=int, default=2, help="training processes (torchrun --nproc_per_node)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = DemoSettings(Path(args.output_dir), max_queries=args.max_queries, nproc=args.nproc,
                            max_steps=args.max_steps)
    start = time.perf_counter()
    scores = run_demo(settings)
    print(f"\nHeld-out ReasonAug concepts, {len(scores)} models ({time.perf_counter() - start:.0f} s):\n")
    print(results_table(scores))
    print(f"\nReport, checkpoints and results: {settings.output_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
