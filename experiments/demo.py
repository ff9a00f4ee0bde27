"""The main job in miniature: bidirectional vs causal, trained and evaluated on this machine.

1. one tiny Dream-format checkpoint (tokenizer trained on the shipped ReasonAug text, random
   weights): the bidirectional and the causal arm start from the very same weights;
2. both arms trained by the real training entry point (``torchrun``, 2 CPU processes,
   HardNegativeNLLLoss) on the ReasonAug training split, from ``train_configs/demo/``;
3. the untrained and trained encoders evaluated through the real evaluation path (a local BEIR
   task through mteb) on the held-out ReasonAug concepts;
4. one table (nDCG@10 and Recall@100 per model, before and after training) and the report
   (markdown, CSV, bar charts) in the output folder, next to the checkpoints.

    python experiments/demo.py --output_dir runs/demo      # or: make demo
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from tiny_dream import TinyModelConfig, make_tiny_dream
from tiny_runs import (
    DEMO_CONFIGS,
    HELDOUT_SPLIT,
    TRAIN_SPLIT,
    build_heldout_task,
    chance_loss,
    corpus_texts,
    evaluate_models,
    final_training_loss,
    learned,
    read_jsonl_gz,
    torchrun,
    training_settings,
)

from diffusion_embedder import clihelp
from diffusion_embedder.files import folder_problem
from diffusion_embedder.values import AT_LEAST_ONE, text_type

logger = logging.getLogger(__name__)

ARMS = ("bidirectional", "causal")


@dataclass
class DemoSettings:
    output_dir: Path
    config_dir: Path = DEMO_CONFIGS
    max_queries: int = 200
    nproc: int = 2
    max_steps: int | None = None
    seed: int = 0
    model: TinyModelConfig = TinyModelConfig()


def train_arm(arm: str, init: Path, output_dir: Path, settings: DemoSettings) -> Path:
    """Run the real training entry point under torchrun; returns the final checkpoint folder."""
    overrides = ["--model_name_or_path", str(init), "--output_dir", str(output_dir), "--seed", str(settings.seed)]
    if settings.max_steps is not None:  # a checkpoint at the last step keeps its loss log
        overrides += ["--max_steps", str(settings.max_steps), "--save_steps", str(settings.max_steps)]
    logger.info("Training the %s arm", arm)
    torchrun("run_supervised.py", settings.config_dir / f"{arm}.json", settings.nproc, *overrides)
    return output_dir


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
        prog="python experiments/demo.py", description=__doc__, formatter_class=clihelp.HelpFormatter
    )
    parser.add_argument("--output_dir", default="runs/demo", help="checkpoints, results and report go here")
    parser.add_argument("--max_queries", type=text_type("max_queries", int, bounds=AT_LEAST_ONE), default=200)
    parser.add_argument("--max_steps", type=text_type("max_steps", int, bounds=AT_LEAST_ONE), default=None,
                        help="override the demo configs' step count")
    parser.add_argument("--nproc", type=text_type("nproc", int, bounds=AT_LEAST_ONE), default=2,
                        help="training processes (torchrun --nproc_per_node)")
    args = parser.parse_args(argv)
    if folder_problem(args.output_dir, "--output_dir"):  # before any run starts
        parser.error(folder_problem(args.output_dir, "--output_dir"))
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
