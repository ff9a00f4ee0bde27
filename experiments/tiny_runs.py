"""What the demo and the study share: the shipped ReasonAug splits, the held-out-concepts task, stage runs under
``torchrun`` (the real training entry points, ``experiments/run_*.py``), loss against chance, evaluation through mteb.
"""

from __future__ import annotations

import gzip
import json
import logging
import math
import os
import random
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]
TRAIN_SPLIT = REPO / "ReasonAug" / "ReasonAug_train.jsonl.gz"
HELDOUT_SPLIT = REPO / "ReasonAug" / "ReasonAug_heldout.jsonl.gz"
DEMO_CONFIGS = REPO / "train_configs" / "demo"
#: Held-out task: a problem as query, every problem/solution document of its concept relevant.
TASK_TYPES = ("p2ps", "ps2ps")


def read_jsonl_gz(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def corpus_texts(records: list[dict]) -> list[str]:
    """Every text of the records (query, positive, hard negative): the tokenizer's and the LM stages' text."""
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


def torchrun(script: str, config: Path, nproc: int, *overrides: str) -> None:
    """One stage run of ``experiments/<script>``; the demo and the study rebuild everything, so a rerun replaces the
    previous run's folders."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        str(REPO / "experiments" / script), str(config), *overrides, "--overwrite_output_dir",
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    logger.info("Running %s", " ".join(command))
    subprocess.run(command, check=True, env=env, cwd=REPO)


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
