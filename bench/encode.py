"""Encode throughput, padding efficiency and peak memory: fixed batch size vs ``max_tokens_per_batch``.

The corpus is real mixed-length text: ReasonAug's GPT-4o-mini problems, solutions and concept
definitions. Each configuration runs in a fresh process so peak memory is its own.

    python bench/encode.py                                  # tiny random Qwen2 on CPU
    python bench/encode.py --preset qwen2.5-7b --device cuda --dtype bfloat16 --attn sdpa flash_attention_2
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import time
from pathlib import Path

from diffusion_embedder.random_models import SHAPES_7B

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared" / "data" / "reasonaug"
TOKENIZER = REPO / "tests" / "fixtures" / "dream_reference"

PRESETS = {
    # A small Qwen2-shaped model for CPU runs.
    "tiny": ("qwen2", dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=1024)),
    # Dream-7B / Qwen2.5-7B shape.
    "qwen2.5-7b": SHAPES_7B["qwen2.5-7b"],
}


def load_corpus(data_dir: Path, limit: int) -> list[str]:
    """Problems, full problem+solution answers and definitions, interleaved for a realistic length mix."""
    texts: list[str] = []
    for path in sorted((data_dir / "gen_problem_solution" / "outputs").glob("*.jsonl")):
        for line in path.open(encoding="utf-8"):
            content = json.loads(line)["response"]["body"]["choices"][0]["message"]["content"]
            problem = content.split("**Solution**")[0].replace("**Problem**", "").strip()
            texts.extend([problem, content])
    for line in (data_dir / "gen_instance_definition" / "instance_definition_output.jsonl").open(encoding="utf-8"):
        texts.append(json.loads(line)["response"]["body"]["choices"][0]["message"]["content"])
    step = max(1, len(texts) // limit)
    return texts[::step][:limit]


def build_encoder(preset: str, device: str, dtype: str, attn: str, max_length: int):
    import torch

    from diffusion_embedder.random_models import random_encoder

    model_type, dims = PRESETS[preset]
    return random_encoder(model_type, dims, TOKENIZER, device=device, dtype=getattr(torch, dtype), attn=attn,
                          max_length=max_length, base_model_name_or_path=f"random-{preset}")


def run_one(args: argparse.Namespace, budget: int | None, attn: str, queue) -> None:
    import torch

    from diffusion_embedder.inference import length_batches
    from diffusion_embedder.templates import parse_inputs

    torch.set_num_threads(args.threads)
    encoder = build_encoder(args.preset, args.device, args.dtype, attn, args.max_length)
    texts = load_corpus(Path(args.data), args.num_texts)
    items = [["", t] for t in texts]
    tokenized = encoder._tokenize_items(parse_inputs(items), doc_max_length=args.max_length)
    lengths = [len(t.input_ids) for t in tokenized]
    batches = length_batches(lengths, args.batch_size, budget)
    in_order = [list(range(i, min(i + args.batch_size, len(lengths)))) for i in range(0, len(lengths), args.batch_size)]
    naive = sum(lengths) / sum(len(b) * max(lengths[i] for i in b) for b in in_order)
    real = sum(lengths)
    processed = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    encoder.encode(items[: min(8, len(items))], batch_size=4, show_progress_bar=False)  # warm-up
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    encoder.encode(items, batch_size=args.batch_size, max_tokens_per_batch=budget, show_progress_bar=False)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = (torch.cuda.max_memory_allocated() / 2**20 if args.device.startswith("cuda")
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    params = sum(p.numel() for p in encoder.model.parameters())
    # Forward FLOPs ~ 2 * params * tokens (+ attention, quadratic, counted on processed tokens).
    cfg = encoder.model.config
    attn_flops = sum(4 * len(b) * max(lengths[i] for i in b) ** 2 * cfg.hidden_size * cfg.num_hidden_layers
                     for b in batches)
    flops = 2 * params * processed + attn_flops
    queue.put(dict(mode=f"max_tokens_per_batch={budget}" if budget else f"batch_size={args.batch_size}",
                   attn=attn, texts=len(texts), batches=len(batches), real_tokens=real,
                   processed_tokens=processed, padding_efficiency=real / processed, naive_efficiency=naive,
                   seconds=seconds,
                   tokens_per_s=real / seconds, peak_mib=peak, tflops=flops / seconds / 1e12))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--attn", nargs="+", default=["sdpa"])
    parser.add_argument("--data", default=str(DEFAULT_DATA))
    parser.add_argument("--num-texts", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16384)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="device peak for MFU (H100 bf16 dense)")
    args = parser.parse_args()

    context = mp.get_context("spawn")
    rows = []
    for attn in args.attn:
        for budget in (None, args.max_tokens):
            queue = context.Queue()
            process = context.Process(target=run_one, args=(args, budget, attn, queue))
            process.start()
            rows.append(queue.get())
            process.join()
    print(f"preset={args.preset} device={args.device} dtype={args.dtype} max_length={args.max_length}")
    print(f"(input-order batches of {args.batch_size}, no length sorting: padding efficiency "
          f"{rows[0]['naive_efficiency']:.3f})")
    header = "| attention | batching | batches | real tokens | padding efficiency | tokens/s | peak MiB |"
    if args.device.startswith("cuda"):
        header += " MFU |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for r in rows:
        line = (f"| {r['attn']} | {r['mode']} | {r['batches']} | {r['real_tokens']} | "
                f"{r['padding_efficiency']:.3f} | {r['tokens_per_s']:.0f} | {r['peak_mib']:.0f} |")
        if args.device.startswith("cuda"):
            line += f" {r['tflops'] / args.peak_tflops:.1%} |"
        print(line)


if __name__ == "__main__":
    main()
