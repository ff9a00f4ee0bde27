"""Training step time and peak memory against global batch size, direct vs GradCache (tiny model, CPU).

Each configuration runs in a fresh subprocess: peak memory is the process's max RSS
(``resource.getrusage``), reported whole and as the increase over the RSS after setup (model loaded,
batch tokenized), which is what the step itself costs. One step = forward + backward of one global
batch (queries, positives, one hard negative each) with HardNegativeNLLLoss, LoRA r=4.

    python bench/train.py --out bench/results/train.md
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "tests" / "fixtures" / "llm2vec_parity" / "llama"
FILLER = " It was described in the old notes together with its colour, size, age and where it was last seen."


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def worker(batch: int, chunk: int | None, steps: int, max_length: int) -> dict:
    import torch

    from diffusion_embedder.data import ContrastiveCollator, TrainSample
    from diffusion_embedder.losses import HardNegativeNLLLoss
    from diffusion_embedder.training.arguments import validate
    from diffusion_embedder.training.supervised import prepare_encoder
    from diffusion_embedder.training.trainer import EncoderTrainer

    torch.manual_seed(0)
    cfg = validate(
        {
            "model_name_or_path": str(MODEL),
            "dataset_name": "Custom",
            "output_dir": "/tmp/bench_train",
            "report_to": "none",
            "bidirectional": True,
            "max_seq_length": max_length,
            "lora_r": 4,
            "use_cpu": True,
            "per_device_train_batch_size": batch,
        }
    )
    encoder = prepare_encoder(cfg.model, cfg.custom, cfg.training)
    samples = [
        TrainSample(
            query=("Retrieve the passage;", f"Which object number {i} is it?" + FILLER),
            positive=("", f"Object number {i} is the one." + FILLER * 2),
            negatives=[("", f"Object number {i + 1} is another one." + FILLER * 2)],
            group="g",
        )
        for i in range(batch)
    ]
    trainer = EncoderTrainer(
        model=encoder,
        args=cfg.training,
        train_dataset=samples,
        data_collator=ContrastiveCollator(encoder),
        loss_fn=HardNegativeNLLLoss(),
        grad_cache_chunk_size=chunk,
    )
    inputs = trainer.data_collator(samples)
    tokens = int(inputs["positive"]["input_ids"].shape[1])
    baseline = rss_mib()
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        trainer.training_step(trainer.model, inputs)
        encoder.zero_grad()
        times.append(time.perf_counter() - start)
    return {"step_s": sum(times[1:]) / steps, "peak_mib": rss_mib(), "baseline_mib": baseline, "doc_tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    parser.add_argument("--chunk", type=int, default=16, help="GradCache chunk size")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--worker", type=str, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        batch, chunk = json.loads(args.worker)
        print(json.dumps(worker(batch, chunk, args.steps, args.max_length)))
        return

    rows = []
    for batch in args.batches:
        for chunk in (None, args.chunk):
            spec = json.dumps([batch, chunk])
            command = [sys.executable, __file__, "--worker", spec, "--steps", str(args.steps)]
            command += ["--max-length", str(args.max_length)]
            out = subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT)
            result = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append({"batch": batch, "mode": "direct" if chunk is None else f"GradCache ({chunk})", **result})
            print(rows[-1], flush=True)

    lines = [
        "| global batch | mode | step (s) | peak RSS (MiB) | step's increase over setup RSS (MiB) |",
        "|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        increase = r["peak_mib"] - r["baseline_mib"]
        lines.append(f"| {r['batch']} | {r['mode']} | {r['step_s']:.3f} | {r['peak_mib']:.0f} | {increase:.1f} |")
    growth = {}
    for mode in {r["mode"] for r in rows}:
        mine = [r for r in rows if r["mode"] == mode]
        growth[mode] = (mine[-1]["peak_mib"] / mine[0]["peak_mib"] - 1) * 100
    span = f"from batch {args.batches[0]} to {args.batches[-1]}"
    summary = [f"- peak RSS growth {span}, {m}: {g:+.1f}%" for m, g in sorted(growth.items())]
    report = "\n".join(
        [
            "# Training step: time and peak memory vs global batch (CPU, tiny model)",
            "",
            "Command (from the repository root):",
            "",
            "```",
            f"python bench/train.py --batches {' '.join(map(str, args.batches))} --chunk {args.chunk} "
            f"--steps {args.steps} --max-length {args.max_length} --out bench/results/train.md",
            "```",
            "",
            f"Machine: {platform.processor() or platform.machine()}, {platform.system()}, Python "
            f"{platform.python_version()}; single process, CPU. Model: the tiny Llama fixture (hidden 64, 2 layers) "
            f"with LoRA r=4; max length {args.max_length}; texts of ~{rows[0]['doc_tokens']} tokens; one hard negative "
            "per query; HardNegativeNLLLoss. Step = forward + backward (no optimizer). Each row is a fresh process.",
            "",
            *lines,
            "",
            *summary,
            "",
            "No GPU was lent to this task, so the 7B-shaped GPU measurement (LoRA, bf16, lengths 512 and 4096) "
            "was not run.",
            "",
        ]
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report)
    print(report)


if __name__ == "__main__":
    main()
