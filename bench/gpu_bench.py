"""7B-shaped encoders on one GPU: tokens/s, model FLOPs utilisation, peak memory; padded vs packed; sdpa vs flex.

Random bf16 weights in the Qwen2.5-7B (Dream-7B) and LLaDA-8B shapes; documents of mixed lengths
(uniform between 64 and ``--max-length`` tokens) and of exactly ``--max-length`` tokens. Every
configuration runs in a fresh process so its peak memory is its own. Called by bench/gpu.sh:

    python bench/gpu_bench.py --out bench/results/gpu_bench.md
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "tests" / "fixtures" / "llm2vec_parity" / "llama"
#: Dense bf16 peaks (TFLOP/s) by device name fragment, for MFU.
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


def worker(shape: str, attn: str, packing: bool, lengths_kind: str, max_length: int, docs: int, budget: int) -> dict:
    import torch

    from diffusion_embedder.inference import Tokenized, length_batches
    from diffusion_embedder.packing import plan_batches, row_length
    from diffusion_embedder.random_models import SHAPES_7B, random_encoder

    model_type, dims = SHAPES_7B[shape]
    encoder = random_encoder(model_type, dims, TOKENIZER, device="cuda", dtype=torch.bfloat16, attn=attn)
    generator = torch.Generator().manual_seed(0)
    if lengths_kind == "fixed":
        lengths = [max_length] * docs
    else:
        lengths = torch.randint(64, max_length + 1, (docs,), generator=generator).tolist()
    items = [Tokenized(torch.randint(10, dims["vocab_size"], (n,), generator=generator).tolist(), n)
             for n in lengths]
    if packing:
        width = row_length(lengths, "cuda")
        batches = plan_batches(lengths, width, max(1, budget // width))
        collate = lambda batch: encoder._collate_packed(batch, width)  # noqa: E731
    else:
        batches = length_batches(lengths, 10**9, budget)
        collate = encoder._collate
    features = [{k: v.cuda() for k, v in collate([items[i] for i in b]).items()} for b in batches]
    processed = sum(int(f["input_ids"].numel()) for f in features)
    with torch.inference_mode():
        encoder(features[0])  # warm-up (flex compiles here)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        for f in features:
            encoder(f)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    embedding = dims["vocab_size"] * dims["hidden_size"]
    params = sum(p.numel() for p in encoder.model.parameters() if p.dim() > 1) - embedding
    real = sum(lengths)
    # Useful FLOPs: 2 x non-embedding params per real token, plus attention (QK^T and AV) within each text.
    flops = 2 * params * real + sum(4 * n * n * dims["hidden_size"] * dims["num_hidden_layers"] for n in lengths)
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    return dict(shape=shape, attn=attn, packing=packing, lengths=lengths_kind, max_length=max_length, docs=docs,
                real_tokens=real, padding_efficiency=real / processed, seconds=seconds, tokens_per_s=real / seconds,
                mfu=flops / seconds / 1e12 / peak if peak else None,
                peak_gib=torch.cuda.max_memory_allocated() / 2**30, device=name)


def main() -> None:
    from diffusion_embedder.random_models import SHAPES_7B

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES_7B), choices=list(SHAPES_7B))
    parser.add_argument("--attn", nargs="+", default=["sdpa", "flex_attention"])
    parser.add_argument("--max-length", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--docs", type=int, default=256)
    parser.add_argument("--budget", type=int, default=65536, help="tokens per forward")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(**json.loads(args.worker))))
        return
    rows = []
    for shape in args.shapes:
        for max_length in args.max_length:
            for lengths_kind in ("fixed", "mixed"):
                for attn in args.attn:
                    for packing in (False, True):
                        spec = dict(shape=shape, attn=attn, packing=packing, lengths_kind=lengths_kind,
                                    max_length=max_length, docs=args.docs, budget=args.budget)
                        out = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)],
                                             capture_output=True, text=True, cwd=REPO)
                        if out.returncode:
                            print(f"FAILED {spec}:\n{out.stderr[-2000:]}", flush=True)
                            rows.append(dict(spec, error=out.stderr.strip().splitlines()[-1][:200]))
                            continue
                        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
                        print(rows[-1], flush=True)
    lines = ["| shape | doc tokens | attention | batching | padding efficiency | tokens/s | MFU | peak GiB |",
             "|---|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        docs = f"{r['lengths']} {r['max_length']}" if "lengths" in r else f"{r['lengths_kind']} {r['max_length']}"
        batching = "packed" if r["packing"] else "padded"
        if "error" in r:
            lines.append(f"| {r['shape']} | {docs} | {r['attn']} | {batching} | failed: {r['error']} | | | |")
            continue
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
        lines.append(f"| {r['shape']} | {docs} | {r['attn']} | {batching} | {r['padding_efficiency']:.3f} | "
                     f"{r['tokens_per_s']:.0f} | {mfu} | {r['peak_gib']:.1f} |")
    report = "\n".join(lines)
    print(report)
    if args.out:
        args.out.write_text(report + "\n")


if __name__ == "__main__":
    main()
