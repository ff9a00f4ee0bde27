"""Mining hard negatives: ours against sentence-transformers' ``mine_hard_negatives``, side by side, and our search's
memory against the corpus size and the block size.

    python bench/mine.py --out bench/results/mine.md                  # CPU: 20k documents, 2k queries, fixture model
    python bench/mine.py --gpu --out bench/results/mine_gpu.md        # one GPU: Qwen2.5-7B shape, bf16, 50k documents
    python bench/mine.py --gpu --dry-run                              # the GPU path on the CPU, tiny shape and corpus

Each measured run is its own process, runs alternate (ours; ours with a token budget per batch, which
sentence-transformers does not have; theirs; ...), and each reports the mining call's wall and CPU time (the model
already loaded: encoding, search, filters, output) and its peak RSS. Both sides get the same
model (the fixture encoder, exported with our sentence-transformers export, loaded by sentence-transformers with its
stock modules), the same texts, batch size 32 and the same settings (top sampling, range_max 50, relative_margin
0.05, 3 negatives, sentence-transformers' n-tuple output); the negatives are compared record by record.

The memory rows run our search and filters alone, over stores of random vectors, in a fresh process each: the
growth of RSS during the search, at two corpus sizes and two block sizes.

The texts are synthetic (a fixed pseudo-word vocabulary, seeded): documents of 20-80 words (passage length), each
query the first 12 words of its positive document. Wall time and CPU time (all the process's threads) are both
reported: on a machine shared with other work the CPU time moves less than the wall time.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "llm2vec_parity" / "llama"
TOKENIZER = ROOT / "tests" / "fixtures" / "dream_reference"
SETTINGS = {"range_max": 50, "relative_margin": 0.05, "num_negatives": 3}
#: Our token budget per batch in the third row (sentence-transformers batches by count only).
TOKENS = 16384


def words(seed: int = 0, size: int = 3000) -> list[str]:
    rng = random.Random(seed)
    syllables = [a + b for a in "bdfgklmnprstvz" for b in ("a", "e", "i", "o", "u", "ar", "en", "is", "on")]
    return ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(size)]


def write_inputs(folder: Path, num_docs: int, num_queries: int, min_words: int, max_words: int) -> None:
    rng = random.Random(1)
    vocab = words()
    weights = [1 / (i + 1) for i in range(len(vocab))]  # Zipf-like, so documents share words
    docs = [" ".join(rng.choices(vocab, weights, k=rng.randint(min_words, max_words))) for _ in range(num_docs)]
    with open(folder / "corpus.jsonl", "w") as f:
        for i, text in enumerate(docs):
            f.write(json.dumps({"_id": f"d{i}", "title": "", "text": text}) + "\n")
    with open(folder / "pairs.jsonl", "w") as f:
        for i in range(num_queries):
            f.write(json.dumps({"query": " ".join(docs[i].split()[:12]), "positive": docs[i]}) + "\n")


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_mib(field: str = "VmRSS") -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


class AnonymousPeak:
    """The most anonymous memory (RssAnon: not file pages, which the kernel may drop) the process held while
    running, sampled every 5 ms."""

    def __init__(self):
        import threading

        self.peak = rss_mib("RssAnon")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss_mib("RssAnon"))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_mib("RssAnon"))


# ----------------------------------------------------------------------------------------------- child processes


def child_ours(folder: Path, device: str, dtype: str, gpu: bool, tokens: int | None = None) -> dict:
    from diffusion_embedder.mining.mine import finish, prepare
    from diffusion_embedder.mining.options import MineArguments

    if gpu:
        import torch

        from diffusion_embedder.random_models import SHAPES_7B, TINY_SHAPE, random_encoder

        model_type, dims = TINY_SHAPE if device == "cpu" else SHAPES_7B["qwen2.5-7b"]
        encoder = random_encoder(model_type, dims, TOKENIZER, device=device, dtype=getattr(torch, dtype),
                                 max_length=512, pooling_mode="mean")
    else:
        from diffusion_embedder import Encoder

        encoder = Encoder.from_pretrained(str(FIXTURE), skip_instruction=False, pooling_mode="mean", device=device)
    args = MineArguments(pairs=str(folder / "pairs.jsonl"), corpus=str(folder / "corpus.jsonl"),
                         output_dir=str(folder / f"ours-{time.time_ns()}"), base_model_name_or_path=str(FIXTURE),
                         batch_size=64 if gpu else 32, max_tokens_per_batch=tokens, show_progress_bar=False,
                         **SETTINGS)
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()
    start, cpu = time.perf_counter(), time.process_time()
    prepared = prepare(args, encoder)
    encoded = time.perf_counter()
    summary = finish(prepared)
    done = time.perf_counter()
    records = [json.loads(line) for line in open(summary.path)]
    return {"wall": done - start, "cpu": time.process_time() - cpu, "encode": encoded - start,
            "search": done - encoded, "peak_mib": peak_mib(),
            "records": {f"{r['query']}\t{r['positive']}": r["negatives"] for r in records},
            "documents": prepared.manifests["documents"]["corpus"]["num_rows"],
            "queries": prepared.manifests["queries"]["corpus"]["num_rows"]}


def child_st(folder: Path, device: str) -> dict:
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.util import mine_hard_negatives

    model = SentenceTransformer(str(folder / "st_model"), device=device)
    pairs = [json.loads(line) for line in open(folder / "pairs.jsonl")]
    corpus = [json.loads(line)["text"] for line in open(folder / "corpus.jsonl")]
    start, cpu = time.perf_counter(), time.process_time()
    out = mine_hard_negatives(Dataset.from_list(pairs), model, corpus=corpus, sampling_strategy="top",
                              output_format="n-tuple", batch_size=32, verbose=False, **SETTINGS)
    done = time.perf_counter()
    records = {f"{r['query']}\t{r['positive']}": [r[f"negative_{i}"] for i in (1, 2, 3)] for r in out}
    return {"wall": done - start, "cpu": time.process_time() - cpu, "peak_mib": peak_mib(), "records": records}


def child_search(folder: Path, block: int) -> dict:
    from diffusion_embedder.evaluation.store import EmbeddingStore
    from diffusion_embedder.mining.search import search

    documents, queries = EmbeddingStore(str(folder / "documents")), EmbeddingStore(str(folder / "queries"))
    before, anonymous = rss_mib(), rss_mib("RssAnon")
    start = time.perf_counter()
    with AnonymousPeak() as sampled:
        for _ in search(queries, documents, 60, "cosine", query_block=1024, document_block=block):
            pass
    return {"wall": time.perf_counter() - start, "growth_mib": peak_mib() - before,
            "anonymous_mib": sampled.peak - anonymous, "documents": documents.num_rows}


def random_stores(folder: Path, num_docs: int, num_queries: int, dim: int) -> None:
    """Stores of random vectors in encode's layout (chunks of 1024 rows), written without a model."""
    import numpy as np

    from diffusion_embedder.evaluation.store import FORMAT, identity, write_chunk

    rng = np.random.default_rng(0)
    for name, rows in (("documents", num_docs), ("queries", num_queries)):
        spans = [(lo, min(lo + 1024, rows)) for lo in range(0, rows, 1024)]
        manifest = {"format": FORMAT, "embedding_dim": dim, "corpus": {"num_rows": rows},
                    "chunks": {"num_chunks": len(spans), "chunk_size": 1024}}
        (folder / name).mkdir(parents=True)
        (folder / name / "manifest.json").write_text(json.dumps(manifest))
        for index, (lo, hi) in enumerate(spans):
            write_chunk(str(folder / name), index, [str(i) for i in range(lo, hi)], (lo, hi),
                         rng.normal(size=(hi - lo, dim)).astype(np.float32), identity(manifest))


def run_child(*args: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    result = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-4000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------------------------------- parent


def load_average() -> str:
    return ", ".join(f"{x:.1f}" for x in os.getloadavg())


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip()
    except OSError:
        return "?"


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "?"


def compare_st(args) -> list[str]:
    from diffusion_embedder import Encoder

    folder = Path(tempfile.mkdtemp(prefix="bench_mine_"))
    write_inputs(folder, args.num_docs, args.num_queries, 20, 80)
    Encoder.from_pretrained(str(FIXTURE), skip_instruction=False, pooling_mode="mean").save(
        str(folder / "st_model"), format="sentence-transformers")
    sides = {"ours": ("ours", ["0"]), f"ours, --max_tokens_per_batch {TOKENS}": ("ours", ["0", str(TOKENS)]),
             "sentence-transformers": ("st", [])}
    rows, results = [], {name: [] for name in sides}
    for repeat in range(args.repeats):
        for name, (kind, extra) in sides.items():
            load = load_average()
            result = run_child(kind, str(folder), "cpu", "float32", *extra)
            results[name].append(result)
            split = (f"encode {result['encode']:.1f} s, search+filters+output {result['search']:.1f} s"
                     if kind == "ours" else "")
            rows.append(f"| {repeat + 1} | {name} | {result['wall']:.1f} | {result['cpu']:.1f} | "
                        f"{result['peak_mib']:.0f} | {split} | {load} |")
            print(rows[-1], flush=True)
    st = results["sentence-transformers"]
    lines = [
        f"Corpus: {args.num_docs} synthetic documents (20-80 words), {args.num_queries} queries (the first 12 words "
        f"of their positive); settings: top sampling, range_max 50, relative_margin 0.05, 3 negatives, batch size 32.",
        "",
        "| run | miner | wall time (s) | CPU time (s) | peak RSS (MiB) | ours: split | load average at start |",
        "|---|---|---:|---:|---:|---|---|",
        *rows,
        "",
    ]
    for name, runs in results.items():
        if name != "sentence-transformers":
            wall = min(r["wall"] for r in st) / min(r["wall"] for r in runs)
            cpu = min(r["cpu"] for r in st) / min(r["cpu"] for r in runs)
            same = sum(runs[0]["records"].get(k) == v for k, v in st[0]["records"].items())
            lines.append(f"- {name}: best wall time {wall:.2f}x sentence-transformers', best CPU time {cpu:.2f}x "
                         f"(goal >= 1.5x); {same} of sentence-transformers' {len(st[0]['records'])} records have "
                         f"exactly our negatives (ours kept {len(runs[0]['records'])}).")
    return lines


def memory_rows(args) -> list[str]:
    rows = ["| documents | document block | search time (s) | peak RSS growth (MiB) | peak anonymous memory growth "
            "(MiB) |", "|---:|---:|---:|---:|---:|"]
    for num_docs in args.memory_docs:
        folder = Path(tempfile.mkdtemp(prefix="bench_mine_mem_"))
        random_stores(folder, num_docs, args.num_queries, args.memory_dim)
        for block in args.memory_blocks:
            result = run_child("search", str(folder), str(block))
            rows.append(f"| {num_docs} | {block} | {result['wall']:.1f} | {result['growth_mib']:.0f} | "
                        f"{result['anonymous_mib']:.0f} |")
            print(rows[-1], flush=True)
    corpus_mib = [n * args.memory_dim * 4 / 2**20 for n in args.memory_docs]
    return [f"Random float32 vectors of dimension {args.memory_dim} (the corpora: "
            f"{', '.join(f'{m:.0f} MiB' for m in corpus_mib)}), {args.num_queries} queries, 1024 queries per block, "
            "60 candidates per query, cosine.", "", *rows]


def gpu_rows(args) -> list[str]:
    import torch

    device = "cpu" if args.dry_run else "cuda"
    folder = Path(tempfile.mkdtemp(prefix="bench_mine_gpu_"))
    num_docs = 300 if args.dry_run else args.gpu_docs
    queries = 50 if args.dry_run else args.gpu_queries
    write_inputs(folder, num_docs, queries, 20, 60)
    result = run_child("ours", str(folder), device, "float32" if args.dry_run else "bfloat16", "1")
    name = "CPU dry run (tiny shape)" if args.dry_run else torch.cuda.get_device_name(0)
    texts = result["documents"] + result["queries"]
    return [f"Device: {name}; {result['documents']} documents (20-60 words) and {result['queries']} queries, "
            f"Qwen2.5-7B shape, bf16, batch 64{' (the dry run: tiny shape, float32)' if args.dry_run else ''}.", "",
            "| documents/s (whole mining) | texts encoded/s | search+filters+output share | wall (s) |",
            "|---:|---:|---:|---:|",
            f"| {result['documents'] / result['wall']:.0f} | {texts / result['encode']:.0f} | "
            f"{result['search'] / result['wall']:.1%} | {result['wall']:.1f} |"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--out", help="write the markdown here (default: print it)")
    parser.add_argument("--num-docs", type=int, default=20000)
    parser.add_argument("--num-queries", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--memory-docs", type=int, nargs="+", default=[20000, 160000])
    parser.add_argument("--memory-blocks", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--memory-dim", type=int, default=512)
    parser.add_argument("--memory-only", action="store_true", help="only the search memory rows")
    parser.add_argument("--gpu", action="store_true", help="the 7B-shape GPU throughput run instead")
    parser.add_argument("--dry-run", action="store_true", help="with --gpu: on the CPU, tiny shape and corpus")
    parser.add_argument("--gpu-docs", type=int, default=50000)
    parser.add_argument("--gpu-queries", type=int, default=5000)
    args = parser.parse_args()
    if args.child:
        kind, folder, *rest = args.child
        if kind == "ours":
            result = child_ours(Path(folder), rest[0], rest[1], rest[2] == "1", int(rest[3]) if len(rest) > 3 else None)
        elif kind == "st":
            result = child_st(Path(folder), rest[0])
        else:
            result = child_search(Path(folder), int(rest[0]))
        print(json.dumps(result))
        return
    import torch

    header = [f"Command: `python bench/mine.py {' '.join(sys.argv[1:])}`", "",
              f"Date {datetime.date.today()}, commit {commit()}, CPU {cpu_name()} ({os.cpu_count()} cores), "
              f"torch {torch.__version__}, load average at start {load_average()}.", ""]
    if args.gpu:
        lines = ["## GPU throughput (7B shape)", "", *header, *gpu_rows(args)]
    else:
        compared = [] if args.memory_only else ["## Ours vs sentence-transformers (CPU)", "", *header,
                                                *compare_st(args), ""]
        lines = [*compared, "## Search memory: bounded by the block, not the corpus", "",
                 *(header if args.memory_only else []), *memory_rows(args)]
    text = "\n".join(lines) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
