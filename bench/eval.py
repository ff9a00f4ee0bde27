"""Wall time of a local instruction-retrieval evaluation (original + changed instructions), with and without
the document embedding cache, and the number of documents encoded per pass. Goal: a second pass encodes none.

The task is FollowIR-shaped and built from real ReasonAug text: a topic's query is one problem of a concept A;
the corpus holds other problems of the chosen concepts. The original instruction accepts problems of A and of
a second concept B, the changed instruction only A, so B's documents change relevance (p-MRR).

    python bench/eval.py                     # tiny random Llama (hidden 256, 4 layers) on CPU
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared" / "data"
TOKENIZER = REPO / "tests" / "fixtures" / "llm2vec_parity" / "llama"
PROBLEM = re.compile(r"\*\*Problem:?\*\*:?\s*(.*?)\s*\*\*Solution", re.S)


def build_task(data: Path, out: Path, topics: int, docs_per_concept: int) -> tuple[int, int]:
    """Write the BEIR folder; returns (number of documents, number of queries)."""
    names = [json.loads(x)["instance"] for x in (data / "reasonaug_instances" / "instances.jsonl").open()]
    rounds: dict[int, dict[int, str]] = {}
    for r in range(1, docs_per_concept + 2):
        path = data / "reasonaug" / "gen_problem_solution" / "outputs" / f"problem_solution_output_{r}.jsonl"
        rounds[r] = {}
        for line in path.open(encoding="utf-8"):
            rec = json.loads(line)
            m = PROBLEM.search(rec["response"]["body"]["choices"][0]["message"]["content"])
            if m:
                rounds[r][int(rec["custom_id"].split("-")[1])] = m.group(1).strip()[:1500].strip()
    concepts = [c for c in range(1, 301) if all(c in rounds[r] for r in rounds)]
    concepts = concepts[:: max(1, len(concepts) // (topics + 1))][: topics + 1]
    corpus, queries, qrels = [], [], []
    for c in concepts:
        for r in range(2, docs_per_concept + 2):
            corpus.append({"_id": f"c{c}r{r}", "title": "", "text": rounds[r][c]})
    for a, b in zip(concepts, concepts[1:], strict=False):
        query = rounds[1][a]
        og = f"Relevant problems are solved with the same method as this one, or use {names[b - 1]}."
        changed = (
            f"Relevant problems are solved with the same method as this one; problems using {names[b - 1]} are not."
        )
        queries += [{"_id": f"{a}-og", "text": query, "instruction": og},
                    {"_id": f"{a}-changed", "text": query, "instruction": changed}]
        for r in range(2, docs_per_concept + 2):
            qrels += [(f"{a}-og", f"c{a}r{r}"), (f"{a}-og", f"c{b}r{r}"), (f"{a}-changed", f"c{a}r{r}")]
    (out / "qrels").mkdir(parents=True, exist_ok=True)
    (out / "corpus.jsonl").write_text("".join(json.dumps(x) + "\n" for x in corpus))
    (out / "queries.jsonl").write_text("".join(json.dumps(x) + "\n" for x in queries))
    lines = "".join(f"{q}\t{d}\t1\n" for q, d in qrels)
    (out / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n" + lines)
    (out / "task.json").write_text(json.dumps({"name": "ReasonAugInstructionRetrieval"}))
    return len(corpus), len(queries)


def build_checkpoint(folder: Path, hidden: int, layers: int) -> None:
    import torch
    from transformers import AutoConfig, AutoModel

    config = AutoConfig.for_model("llama", vocab_size=1024, hidden_size=hidden, intermediate_size=hidden * 2,
                                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    AutoModel.from_config(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(TOKENIZER / name, folder / name)


class DocumentCounter:
    """Counts the documents (inputs without an instruction) that reach the encoder."""

    def __init__(self, encoder):
        self.encoder, self.documents = encoder, 0

    def __getattr__(self, name):
        return getattr(self.encoder, name)

    def encode(self, sentences, **kwargs):
        self.documents += sum(1 for instruction, _ in sentences if not instruction)
        return self.encoder.encode(sentences, **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=str(DEFAULT_DATA))
    parser.add_argument("--topics", type=int, default=40)
    parser.add_argument("--docs-per-concept", type=int, default=7)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch CPU threads")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench_eval_"))
    os.environ.setdefault("MTEB_CACHE", str(work / "mteb"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import torch

    from diffusion_embedder import Encoder
    from diffusion_embedder.evaluation import run

    torch.set_num_threads(args.threads)
    n_docs, n_queries = build_task(Path(args.data), work / "task", args.topics, args.docs_per_concept)
    build_checkpoint(work / "model", args.hidden, args.layers)
    encoder = Encoder.from_pretrained(str(work / "model"), torch_dtype=torch.float32, device="cpu")
    print(f"task: {n_docs} documents, {n_queries} queries ({n_queries // 2} topics x og/changed); "
          f"model: llama hidden {args.hidden}, {args.layers} layers")
    task = [str(work / "task")]
    warmup = run.EvalArguments(output_dir=str(work / "warmup"), no_embedding_cache=True, local_task=task)
    run.evaluate(run.wrap_encoder(encoder, warmup), run.task_factories(warmup), warmup)  # mteb's first-call imports

    rows = []
    for cached in (False, True):
        out = work / ("cached" if cached else "uncached")
        for pass_no in (1, 2):
            eval_args = run.EvalArguments(output_dir=str(out), batch_size=args.batch_size, overwrite=True,
                                          local_task=task, no_embedding_cache=not cached)
            counter = DocumentCounter(encoder)
            model = run.wrap_encoder(counter, eval_args)
            start = time.perf_counter()
            outcome = run.evaluate(model, run.task_factories(eval_args), eval_args)
            wall = time.perf_counter() - start
            assert not outcome.failures, outcome.failures
            score = outcome.scores["ReasonAugInstructionRetrieval"]
            rows.append((cached, pass_no, wall, counter.documents, score))
            print(f"cache={'on ' if cached else 'off'} pass {pass_no}: {wall:6.2f} s, "
                  f"documents encoded {counter.documents:4d}, p-MRR {score:+.4f}")
    print("\n| corpus cache | pass | wall s | documents encoded | p-MRR |\n|---|---|---|---|---|")
    for cached, pass_no, wall, docs, score in rows:
        print(f"| {'on' if cached else 'off'} | {pass_no} | {wall:.2f} | {docs} | {score:+.4f} |")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
