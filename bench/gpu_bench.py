"""7B-shaped encoders on one GPU: our ``encode`` against the plain Hugging Face loop on the same model object
(part (c) of ``bench/gpu_run.sh``).

One process; per model shape (random bf16 weights, Qwen2.5-7B / Dream-7B shape by default; ``--shapes`` adds
LLaDA-8B), every configuration on the same model, real strings through the public ``encode``:

- ``hf-loop``: what LLM2Vec and sentence-transformers run: length-sorted batches of 32 (8 for the long
  set), the tokenizer's call with right padding and ``truncation=True`` on the critical path, one
  forward, masked mean, each batch's output copied to the CPU;
- ``ours``: ``encode`` with its defaults (on CUDA in bf16: packed rows, their sdpa forwards run on the varlen
  kernel); ``ours-padded``: padded rows (the default before packing ran on the varlen kernel: the "before" of
  the same run); ``ours-compiled``: each decoder layer compiled (``encode(compile=True)``; the warm-up holds the
  compile time, the row records dynamo's graph breaks and graphs, and the layers run eagerly again after it).

Each configuration's vectors are compared with the loop's on the same texts (``min_cosine``), and its peak
memory is recorded. Document sets (token counts for the fixture tokenizer): ``mixed`` 768 texts of 64-512 tokens,
``cut`` 384 texts of 1-2k tokens cut to 512, ``long`` 64 texts of 1-4k tokens, ``one32k`` one 32,768-token text.
``PLAN`` orders the rows, most telling first; ``--deadline-s`` skips what would start after that many seconds.
Every row is appended to ``--jsonl`` as soon as it is measured (a run cut off by a time limit keeps what it
measured); the table is printed last.

    python bench/gpu_bench.py --jsonl OUT/encode.jsonl               # on the GPU machine (bench/gpu_run.sh)
    python bench/gpu_bench.py --dry_run --jsonl /tmp/dry.jsonl      # a tiny shape on the CPU, seconds
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "tests" / "fixtures" / "llm2vec_parity" / "llama"
CORPUS = REPO / "tests" / "fixtures" / "beir" / "reasonaug" / "corpus.jsonl"
#: Dense bf16 peaks (TFLOP/s) by device name fragment, for MFU.
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}
#: (texts, shortest, longest tokens, max_length of the call, HF loop batch size) per set; the dry run's are tiny.
#: Texts of n tokens make rows of n + 1 (the BOS), so the long sets end one token short of max_length.
SETS = {"mixed": (768, 64, 512, 512, 32), "cut": (384, 1024, 2048, 512, 32), "long": (64, 1024, 4095, 4096, 8),
        "one32k": (1, 32767, 32767, 32768, 1)}
DRY_SETS = {"mixed": (12, 16, 96, 96, 4), "cut": (6, 150, 300, 64, 4), "long": (3, 200, 399, 400, 2),
            "one32k": (1, 1023, 1023, 1024, 1)}
CONFIGS = {  # name: encode keyword arguments; hf-loop (None) is the baseline
    "hf-loop": None,
    "ours": {},
    "ours-padded": {"packing": False},
    "ours-compiled": {"compile": True},
}
#: (set, configuration) in the order they run, most telling first: the deadline skips the last ones. A set's loop
#: runs before the rows compared with it; the one 32k text is one forward whatever the batching.
PLAN = [("mixed", "hf-loop"), ("mixed", "ours"), ("mixed", "ours-padded"), ("one32k", "ours"), ("long", "hf-loop"),
        ("long", "ours"), ("mixed", "ours-compiled"), ("cut", "hf-loop"), ("cut", "ours"), ("cut", "ours-padded")]


# ------------------------------------------------------------------------------------------- texts
def make_texts(tokenizer, count: int, shortest: int, longest: int, seed: int = 0) -> list[str]:
    """Real strings of a chosen token count: slices of the fixture corpus cut at token boundaries."""
    import random

    base = " ".join(json.loads(line)["text"] for line in CORPUS.read_text().splitlines())
    encoded = tokenizer(base, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    repeats = 1 + (longest + 1) // max(1, len(encoded))
    text = " ".join([base] * repeats)
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        n = rng.randint(shortest, longest)
        start = rng.randint(0, len(offsets) - n)
        texts.append(text[offsets[start][0] : offsets[start + n - 1][1]])
    return texts


# ------------------------------------------------------------------------------------------- runs
def hf_loop(model, tokenizer, texts: list[str], batch_size: int, max_length: int, device: str):
    """sentence-transformers' / LLM2Vec's loop: sort by length, tokenize, pad right, forward, masked mean."""
    import torch

    order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
    out = torch.empty((len(texts), model.config.hidden_size))
    with torch.inference_mode():
        for start in range(0, len(texts), batch_size):
            batch = order[start : start + batch_size]
            features = tokenizer([texts[i] for i in batch], padding=True, truncation=True, max_length=max_length,
                                 return_tensors="pt").to(device)
            hidden = model(**features).last_hidden_state
            mask = features["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            out[batch] = ((hidden * mask).sum(1) / mask.sum(1)).float().cpu()
    return out


def set_attention(model, attn: str) -> None:
    if getattr(model.config, "_attn_implementation", None) == attn:
        return
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(attn)
    else:
        model.config._attn_implementation = attn


def run_row(encoder, plain_tokenizer, texts: list[str], set_spec: tuple, config: str, device: str):
    """One configuration on one set: a warm-up on the set's first eighth, then the timed call; its vectors."""
    import torch

    count, _, _, max_length, hf_batch = set_spec
    kwargs = CONFIGS[config]
    if kwargs is None:
        run = partial(hf_loop, encoder.model, plain_tokenizer, batch_size=hf_batch, max_length=max_length,
                      device=device)  # fmt: skip
    else:
        run = partial(encoder.encode, batch_size=hf_batch if config != "ours-compiled" else 32, max_length=max_length,
                      doc_max_length=max_length, show_progress_bar=False, **kwargs)  # fmt: skip
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    start = time.perf_counter()
    run(texts[: max(2, count // 8)])  # warm-up (compile=True compiles here), the longest texts' shapes
    sync()
    warm_up = time.perf_counter() - start
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    out = run(texts)
    sync()
    return out, time.perf_counter() - start, warm_up


def worker(shape: str, dry_run: bool, jsonl: Path, deadline: float) -> None:
    import copy

    import torch
    from torch._dynamo.utils import counters

    from diffusion_embedder import compilation, varlen
    from diffusion_embedder.random_models import SHAPES_7B, TINY_SHAPE, random_encoder

    device, dtype = ("cpu", torch.float32) if dry_run else ("cuda", torch.bfloat16)
    if dry_run:  # the CPU checks the plumbing: compile where encode refuses it, without inductor's minutes
        compilation.BACKEND = "aot_eager"
        compilation.REFUSED_ON.pop("cpu", None)
    model_type, dims = TINY_SHAPE if dry_run else SHAPES_7B[shape]
    encoder = random_encoder(model_type, dims, TOKENIZER, device=device, dtype=dtype, attn="sdpa")
    plain_tokenizer = copy.deepcopy(encoder.tokenizer)
    plain_tokenizer.padding_side = "right"
    embedding = dims["vocab_size"] * dims["hidden_size"]
    params = sum(p.numel() for p in encoder.model.parameters() if p.dim() > 1) - embedding
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    peak = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    head_dim = dims["hidden_size"] // dims["num_attention_heads"]
    environment = {"shape": shape, "device": name, "torch": torch.__version__,
                   "varlen_kernel": varlen.kernel_problem(torch.device(device), dtype, head_dim) or "runs"}
    append(jsonl, {"event": "start", **environment})
    sets = DRY_SETS if dry_run else SETS
    texts, loops = {}, {}
    for set_name, config in PLAN:
        count, shortest, longest, max_length, _ = sets[set_name]
        if set_name not in texts:
            texts[set_name] = make_texts(encoder.tokenizer, count, shortest, longest)
        lengths = [min(len(ids), max_length) for ids in encoder.tokenizer(texts[set_name])["input_ids"]]
        real = sum(lengths)
        row = {"shape": shape, "set": set_name, "config": config, "texts": count, "tokens": real}
        if time.time() > deadline:
            append(jsonl, {**row, "skipped": "deadline"})
            continue
        flops = 2 * params * real + sum(4 * n * n * dims["hidden_size"] * dims["num_hidden_layers"] for n in lengths)
        torch._dynamo.reset()
        counters.clear()
        try:
            out, seconds, warm_up = run_row(encoder, plain_tokenizer, texts[set_name], sets[set_name], config, device)
            row.update(seconds=seconds, warm_up_s=warm_up, tokens_per_s=real / seconds,
                       finite=bool(torch.isfinite(out).all()), mfu=flops / seconds / 1e12 / peak if peak else None,
                       peak_gib=torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None)  # fmt: skip
            if config == "ours-compiled":
                row.update(graphs=counters["stats"]["unique_graphs"],
                           graph_breaks=sum(counters["graph_break"].values()),
                           break_reasons=sorted({r.splitlines()[0][:120] for r in counters["graph_break"]}))
            if config == "hf-loop":
                loops[set_name] = out
            elif set_name in loops:
                cosines = torch.nn.functional.cosine_similarity(out.float(), loops[set_name], dim=-1)
                row["min_cosine"] = cosines.min().item()
        except Exception as error:  # noqa: BLE001 - recorded, and the next configuration runs
            row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
            if device == "cuda":
                torch.cuda.empty_cache()
        finally:
            compilation.uncompile_layers(encoder.model)  # compiled in place: the next configuration runs eagerly
        append(jsonl, row)
    del encoder
    if device == "cuda":
        torch.cuda.empty_cache()


def append(jsonl: Path, row: dict) -> None:
    with jsonl.open("a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


# ------------------------------------------------------------------------------------------- report
def table(rows: list[dict]) -> str:
    lines = ["| shape | documents | configuration | tokens | tokens/s | vs HF loop | MFU | peak GiB | min cosine | "
             "warm-up s | notes |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    baseline = {(r["shape"], r["set"]): r.get("tokens_per_s") for r in rows if r.get("config") == "hf-loop"}
    for r in rows:
        if "config" not in r:
            continue
        head = f"| {r['shape']} | {r['set']} | {r['config']} | {r['tokens']} |"
        if "tokens_per_s" not in r:
            lines.append(f"{head} {r.get('error') or 'skipped: ' + r.get('skipped', '?')} | | | | | | |")
            continue
        base = baseline.get((r["shape"], r["set"]))
        ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else "–"
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "–"
        peak = f"{r['peak_gib']:.1f}" if r.get("peak_gib") is not None else "–"
        cos = f"{r['min_cosine']:.4f}" if r.get("min_cosine") is not None else "–"
        notes = f"{r['graphs']} graphs, {r['graph_breaks']} graph breaks" if "graphs" in r else ""
        lines.append(f"{head} {r['tokens_per_s']:.0f} | {ratio} | {mfu} | {peak} | {cos} | {r['warm_up_s']:.1f} | "
                     f"{notes} |")
    return "\n".join(lines)


def main() -> int:
    from diffusion_embedder.random_models import SHAPES_7B

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["qwen2.5-7b"], choices=list(SHAPES_7B))
    parser.add_argument("--jsonl", type=Path, required=True, help="appended: one line per row, as measured")
    parser.add_argument("--deadline-s", type=float, default=150.0, help="skip what would start after this")
    parser.add_argument("--dry_run", action="store_true", help="a tiny shape on the CPU: checks the script")
    args = parser.parse_args()
    args.jsonl.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.time() + args.deadline_s
    first = len(args.jsonl.read_text().splitlines()) if args.jsonl.exists() else 0
    for shape in ["tiny"] if args.dry_run else args.shapes:
        worker(shape, args.dry_run, args.jsonl, deadline)
    rows = [json.loads(line) for line in args.jsonl.read_text().splitlines()[first:]]
    print(table(rows))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
