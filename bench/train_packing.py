"""One training step (forward + backward, LoRA, HardNegativeNLLLoss) padded vs packed, on mixed-length texts.

Tiny Llama fixture, CPU; texts from ~20 to ~500 tokens, so padding costs what it does on real data.
Reports the processed tokens (rows x width summed over the columns), the padding efficiency and the
step time, alternating padded and packed steps so a change in machine load hits both:

    python bench/train_packing.py --batch 32 --pack-length 1024 --steps 5
"""

from __future__ import annotations

import argparse
import os
import time

from train import FILLER, MODEL


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--pack-length", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch

    from diffusion_embedder.data import ContrastiveCollator, TrainSample
    from diffusion_embedder.losses import HardNegativeNLLLoss
    from diffusion_embedder.training.arguments import validate
    from diffusion_embedder.training.supervised import prepare_encoder
    from diffusion_embedder.training.trainer import assemble, text_columns

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = validate({"model_name_or_path": str(MODEL), "dataset_name": "Custom", "output_dir": "/tmp/bench_train",
                    "report_to": "none", "max_seq_length": 512, "lora_r": 4, "use_cpu": True})
    encoder = prepare_encoder(cfg.model, cfg.custom, cfg.training)
    samples = [
        TrainSample(
            query=("Retrieve the passage;", f"Which object number {i} is it?" + FILLER * (i % 3)),
            positive=("", f"Object number {i} is the one." + FILLER * (1 + (7 * i) % 24)),
            negatives=[("", f"Object number {i + 1} is another one." + FILLER * (1 + (5 * i) % 24))],
        )
        for i in range(args.batch)
    ]
    loss_fn = HardNegativeNLLLoss()
    collators = {
        "padded": ContrastiveCollator(encoder),
        "packed": ContrastiveCollator(encoder, pack_length=args.pack_length),
    }
    inputs = {name: collate(samples) for name, collate in collators.items()}
    real = sum(int(c["attention_mask"].sum()) for c in text_columns(inputs["padded"])[0])
    times: dict[str, list[float]] = {name: [] for name in inputs}
    for step in range(args.steps + 1):
        for name, batch in inputs.items():
            start = time.perf_counter()
            columns, k = text_columns(batch)
            loss_fn(*assemble([encoder(c) for c in columns], k)).backward()
            encoder.zero_grad()
            if step:  # the first step warms up
                times[name].append(time.perf_counter() - start)
    print(f"batch {args.batch} (+{args.batch} positives and negatives), {real} real tokens, "
          f"pack_length {args.pack_length}, {args.threads} threads, load average {os.getloadavg()[0]:.2f}")
    print("| batching | processed tokens | padding efficiency | step (s), median | all steps (s) |")
    print("|---|---:|---:|---:|---|")
    for name, batch in inputs.items():
        processed = sum(int(c["input_ids"].numel()) for c in text_columns(batch)[0])
        steps = sorted(times[name])
        print(f"| {name} | {processed} | {real / processed:.3f} | {steps[len(steps) // 2]:.3f} | "
              f"{', '.join(f'{t:.2f}' for t in times[name])} |")


if __name__ == "__main__":
    main()
