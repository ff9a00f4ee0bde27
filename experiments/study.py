"""The paper's comparison in miniature: a diffusion-pretrained LM vs an autoregressive one, as embedders.

1. one random tiny Dream-format init (the demo's: BPE trained on the shipped ReasonAug text);
2. two LMs pretrained from it on the same ReasonAug training text with the same token budget, by the
   real LM stage (``run_mntp.py``): ``clm`` (causal) and ``mdm`` (masked diffusion, bidirectional);
   the AR model also gets LLM2Vec's recipe (bidirectional attention + MNTP);
3. every model (and the random init, as the control) trained as an embedder with the same supervised
   config (``train_configs/demo/``), then evaluated on the held-out ReasonAug concepts: the MDM model
   bidirectional, the AR model causal and LLM2Vec-style;
4. a table and a chart, each embedder's final training loss next to chance (ln of its candidates): an
   arm that ends near chance is reported as not learned, not as a result.

    python experiments/study.py --output_dir runs/study      # or: make study
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tiny_dream import TinyModelConfig, make_tiny_dream
from tiny_runs import (
    DEMO_CONFIGS,
    HELDOUT_SPLIT,
    REPO,
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

from diffusion_embedder import backbones
from diffusion_embedder.data import load_text_blocks
from diffusion_embedder.files import folder_problem
from diffusion_embedder.objectives import OBJECTIVES, ObjectiveOptions, mask_token_for
from diffusion_embedder.values import AT_LEAST_ONE, text_type

PRETRAIN_CONFIG = REPO / "train_configs" / "study" / "pretrain.json"
#: embedder label -> (the LM it starts from, bidirectional attention)
EMBEDDERS = {
    "random-bidirectional": ("init", True),
    "random-causal": ("init", False),
    "mdm-bidirectional": ("mdm", True),
    "clm-causal": ("clm", False),
    "clm-mntp-bidirectional": ("clm-mntp", True),
}


@dataclass
class StudySettings:
    output_dir: Path
    pretrain_steps: int = 400
    mntp_steps: int = 100
    embed_steps: int | None = None  # None: the demo configs' 150
    max_queries: int = 200
    nproc: int = 2
    seed: int = 0
    model: TinyModelConfig = field(default_factory=TinyModelConfig)


def pretrain(
    objective: str, base: Path, text_file: Path, output_dir: Path, steps: int, settings: StudySettings, *extra: str
) -> Path:
    """One LM stage run (same data, batch, length and steps for every arm); returns its output folder."""
    torchrun(
        "run_mntp.py", PRETRAIN_CONFIG, settings.nproc,
        "--model_name_or_path", str(base), "--objective", objective, "--train_file", json.dumps([str(text_file)]),
        "--output_dir", str(output_dir), "--experiment_id", objective, "--max_steps", str(steps),
        "--save_steps", str(steps), "--seed", str(settings.seed), *extra,
    )  # fmt: skip
    return output_dir / objective


def heldout_lm_loss(
    folder: Path, objective: str, texts: list[str], max_seq_length: int = 128, max_blocks: int = 32, seed: int = 0
) -> float:
    """The objective's mean loss on held-out text, masks drawn from a fixed generator (comparable across models)."""
    spec = OBJECTIVES[objective]
    model = backbones.load_backbone(str(folder), enable_bidirectional=spec.bidirectional, lm_head=True).eval()
    tokenizer = backbones.load_tokenizer(str(folder))
    mask_id = getattr(model.config, "mask_token_id", None)
    options = ObjectiveOptions(mask_id if mask_id is not None else mask_token_for(tokenizer), model.config.vocab_size)
    blocks = load_text_blocks(tokenizer, texts, max_seq_length, seed=seed, max_blocks=max_blocks).blocks
    generator = torch.Generator().manual_seed(seed)
    masker = spec.masker(options)
    losses = []
    with torch.no_grad():
        for batch in blocks.split(8):
            masked = masker(batch, generator=generator)
            logits = model(input_ids=masked.input_ids, attention_mask=masked.attention_mask).logits
            losses.append(spec.loss(logits, masked, options).item())
    return sum(losses) / len(losses)


def embed(label: str, model: Path, bidirectional: bool, settings: StudySettings) -> Path:
    """Supervised contrastive training with the demo's config for this attention; returns the run folder."""
    config = DEMO_CONFIGS / ("bidirectional.json" if bidirectional else "causal.json")
    output_dir = settings.output_dir / "embedders" / label
    overrides = ["--model_name_or_path", str(model), "--output_dir", str(output_dir), "--seed", str(settings.seed)]
    if settings.embed_steps is not None:
        steps, log_steps = str(settings.embed_steps), str(min(10, settings.embed_steps))
        overrides += ["--max_steps", steps, "--save_steps", steps, "--logging_steps", log_steps]
    torchrun("run_supervised.py", config, settings.nproc, *overrides)
    return output_dir


def study_table(rows: dict[str, dict]) -> str:
    lines = [
        "| embedder | starts from | attention | nDCG@10 untrained | nDCG@10 trained | Recall@100 untrained "
        "| Recall@100 trained | final train loss (chance) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, r in rows.items():
        verdict = "" if learned(r["final_loss"], r["chance_loss"]) else ": near chance, did not learn"
        lines.append(
            f"| {label} | {r['lm']} | {'bidirectional' if r['bidirectional'] else 'causal'} "
            f"| {100 * r['untrained']['ndcg_at_10']:.2f} | {100 * r['trained']['ndcg_at_10']:.2f} "
            f"| {100 * r['untrained']['recall_at_100']:.2f} | {100 * r['trained']['recall_at_100']:.2f} "
            f"| {r['final_loss']:.3f} ({r['chance_loss']:.3f}){verdict} |"
        )
    return "\n".join(lines)


def plot(rows: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(rows)
    x = range(len(labels))
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    left.bar([i - 0.2 for i in x], [100 * rows[k]["untrained"]["ndcg_at_10"] for k in labels], 0.4, label="untrained")
    left.bar([i + 0.2 for i in x], [100 * rows[k]["trained"]["ndcg_at_10"] for k in labels], 0.4, label="trained")
    left.set_title("Held-out ReasonAug concepts: nDCG@10")
    right.bar(list(x), [rows[k]["final_loss"] for k in labels], 0.6, color="gray")
    chance = rows[labels[0]]["chance_loss"]
    right.axhline(chance, color="red", linestyle="--", label=f"chance = ln {round(math.exp(chance))}")
    right.set_title("Final embedder training loss")
    for axis in (left, right):
        axis.set_xticks(list(x))
        axis.set_xticklabels(labels, rotation=20, ha="right")
        axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_study(settings: StudySettings) -> dict[str, dict]:
    out = settings.output_dir
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    train_records = read_jsonl_gz(TRAIN_SPLIT)
    texts = list(dict.fromkeys(corpus_texts(train_records)))
    init = make_tiny_dream(out / "init", texts, settings.model)
    text_file = out / "pretrain_text.jsonl"
    with open(text_file, "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    task = out / "heldout_task"
    heldout_records = read_jsonl_gz(HELDOUT_SPLIT)
    stats = build_heldout_task(heldout_records, task, settings.max_queries, settings.seed)

    lms = {"init": init}
    for objective in ("clm", "mdm"):
        lms[objective] = pretrain(objective, init, text_file, out / "lm", settings.pretrain_steps, settings,
                                  "--full_training", "true")  # fmt: skip
    # LLM2Vec's MNTP trains a LoRA adapter (the config's lora_r), not all weights as the two pretraining runs do.
    lms["clm-mntp"] = pretrain("mntp", lms["clm"], text_file, out / "lm-clm", settings.mntp_steps, settings,
                               "--full_training", "false")  # fmt: skip
    heldout_texts = list(dict.fromkeys(corpus_texts(heldout_records)))
    lm_losses = {
        f"{name} ({objective})": heldout_lm_loss(lms[name], objective, heldout_texts)
        for name, objective in (("init", "clm"), ("clm", "clm"), ("init", "mdm"), ("mdm", "mdm"))
    }

    checkpoints = {label: embed(label, lms[lm], bidi, settings) for label, (lm, bidi) in EMBEDDERS.items()}
    models = {}
    for label, (lm, bidi) in EMBEDDERS.items():
        config = DEMO_CONFIGS / ("bidirectional.json" if bidi else "causal.json")
        models[f"{label}-untrained"] = (str(lms[lm]), bidi, training_settings(config))
        models[f"{label}-trained"] = (str(checkpoints[label]), bidi)
    scores = evaluate_models(models, task, out)
    rows = {}
    for label, (lm, bidi) in EMBEDDERS.items():
        config = DEMO_CONFIGS / ("bidirectional.json" if bidi else "causal.json")
        rows[label] = {
            "lm": lm,
            "bidirectional": bidi,
            "untrained": scores[f"{label}-untrained"],
            "trained": scores[f"{label}-trained"],
            "final_loss": final_training_loss(checkpoints[label]),
            "chance_loss": chance_loss(config, settings.nproc),
        }
    report = out / "report"
    report.mkdir(exist_ok=True)
    plot(rows, report / "study.png")
    lm_lines = "\n".join(f"| {k} | {v:.3f} |" for k, v in lm_losses.items())
    (report / "study.md").write_text(
        f"# Study: diffusion vs autoregressive pretraining, as embedders\n\nHeld-out task: {stats}\n\n"
        f"Held-out LM loss (same masks for every model):\n\n| model (objective) | loss |\n|---|---|\n{lm_lines}\n\n"
        f"{study_table(rows)}\n\nWall time: {time.perf_counter() - start:.0f} s\n"
    )
    (report / "study.json").write_text(json.dumps({"lm_losses": lm_losses, "embedders": rows}, indent=2))
    return {"lm_losses": lm_losses, "embedders": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default="runs/study")
    for name, default in (("pretrain_steps", 400), ("mntp_steps", 100), ("embed_steps", None), ("max_queries", 200),
                          ("nproc", 2)):
        parser.add_argument(f"--{name}", type=text_type(name, int, bounds=AT_LEAST_ONE), default=default,
                            help="override the demo configs' 150 steps" if name == "embed_steps" else None)
    args = parser.parse_args(argv)
    if folder_problem(args.output_dir, "--output_dir"):  # before any run starts
        parser.error(folder_problem(args.output_dir, "--output_dir"))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = StudySettings(
        Path(args.output_dir), args.pretrain_steps, args.mntp_steps, args.embed_steps, args.max_queries, args.nproc
    )
    result = run_study(settings)
    print((settings.output_dir / "report" / "study.md").read_text())
    print(f"Chart: {settings.output_dir / 'report' / 'study.png'}")
    return 0 if result else 1


if __name__ == "__main__":
    raise SystemExit(main())
