"""Our ``encode`` against LLM2Vec 0.2.3 on the same CPU, model weights and texts, in one run.

A random 4-layer, 256-wide bidirectional Llama (the llm2vec_parity tokenizer, vocab 1024) encodes
512 real mixed-length ReasonAug texts with mean pooling, max_length 512, doc_max_length 400,
batch size 32, 2 threads. Every run is a fresh process; the runs are interleaved (ours, LLM2Vec,
ours, ...) so a change in machine load hits both, and the load average is printed with each run.
``ours-packed-mkl`` is ours packed with ``DIFFUSION_EMBEDDER_ONEDNN_LINEAR=0`` (PyTorch's own MKL linear
layers), which isolates what the oneDNN linear layers bring.
LLM2Vec runs in its own virtual environment (transformers 4.44.2), built on first use at
``$LLM2VEC_ENV`` (default ``.llm2vec-env``, git-ignored; the same one bench/compat_llm2vec.sh uses):

    LLM2VEC_ENV=/work/refenv/llm2vec python bench/encode_vs_llm2vec.py --out bench/results/encode_vs_llm2vec.md

Where that environment can't be built (no index), ``--reference hf-loop`` compares against the plain
Hugging Face loop instead (sentence-transformers' and LLM2Vec's: length-sorted batches, the tokenizer's
call with ``truncation=True`` at 401 tokens, i.e. the 400-token cut plus BOS, right padding, one forward,
masked mean), on the same weights in this environment. ``--before DIR`` adds ``ours-before``: our
padded encode from another source tree (e.g. ``git archive`` of an older commit), in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: diffusion_embedder.cpu_linear.ENV_SWITCH, spelled out: the package is not importable in LLM2Vec's environment.
ONEDNN_SWITCH = "DIFFUSION_EMBEDDER_ONEDNN_LINEAR"
TOKENIZER = REPO / "tests" / "fixtures" / "llm2vec_parity" / "llama"
DEFAULT_DATA = REPO.parent / "shared" / "data" / "reasonaug"
REFENV_PACKAGES = [
    "torch==2.13.0", "transformers==4.44.2", "tokenizers==0.19.1", "llm2vec==0.2.3", "peft==0.12.0",
    "accelerate==0.33.0", "numpy<2",
]
MODEL = dict(vocab_size=1024, hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=2)
SETTINGS = dict(pooling_mode="mean", max_length=512, doc_max_length=400, skip_instruction=True)


def refenv_python() -> Path:
    """The reference environment's interpreter, building the environment first if it is missing."""
    env = Path(os.environ.get("LLM2VEC_ENV", REPO / ".llm2vec-env"))
    python = env / "bin" / "python"
    if not python.exists():
        print(f"Building the LLM2Vec reference environment at {env} ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(env)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", *REFENV_PACKAGES], check=True)
    return python


def load_texts(data: Path, limit: int) -> list[str]:
    sys.path.insert(0, str(REPO / "bench"))
    from encode import load_corpus

    return load_corpus(data, limit)


# ----------------------------------------------------------------------------------- workers
def run_llm2vec(work: Path, threads: int, batch_size: int) -> dict:
    import torch
    from llm2vec import LLM2Vec
    from llm2vec.models import LlamaBiModel
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, LlamaConfig

    torch.set_num_threads(threads)
    config = LlamaConfig(**MODEL)
    config._attn_implementation = "sdpa"
    model = LlamaBiModel(config)
    model.load_state_dict(load_file(str(work / "model.safetensors")))
    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER))
    tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    encoder = LLM2Vec(model.eval(), tokenizer, **SETTINGS)
    pairs = [["", t] for t in json.loads((work / "texts.json").read_text())]
    features = encoder.tokenize([encoder._convert_to_str(*p) for p in pairs])
    tokens = int(features["attention_mask"].sum())
    encoder.encode(pairs[:8], batch_size=4, show_progress_bar=False)  # warm-up
    start = time.perf_counter()
    out = encoder.encode(pairs, batch_size=batch_size, show_progress_bar=False)
    return {"seconds": time.perf_counter() - start, "tokens": tokens, "embeddings": out.tolist()}


def run_hf_loop(work: Path, threads: int, batch_size: int) -> dict:
    import torch
    from gpu_bench import hf_loop  # bench/ is this worker's script folder
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, LlamaConfig, LlamaModel

    from diffusion_embedder.backbones import set_bidirectional

    torch.set_num_threads(threads)
    model = LlamaModel(LlamaConfig(**MODEL, attn_implementation="sdpa"))
    model.load_state_dict(load_file(str(work / "model.safetensors")))
    set_bidirectional(model, True)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER))
    tokenizer.pad_token, tokenizer.padding_side = tokenizer.eos_token, "right"
    texts = json.loads((work / "texts.json").read_text())
    cut = SETTINGS["doc_max_length"] + 1

    def loop(batch_texts):
        return hf_loop(model, tokenizer, batch_texts, batch_size, cut, "cpu")

    tokens = sum(min(len(ids), cut) for ids in tokenizer(texts)["input_ids"])
    loop(texts[:8])  # warm-up
    start = time.perf_counter()
    out = loop(texts)
    return {"seconds": time.perf_counter() - start, "tokens": tokens, "embeddings": out.tolist()}


def run_ours(work: Path, threads: int, batch_size: int, packing: bool) -> dict:
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaModel

    from diffusion_embedder import Encoder
    from diffusion_embedder.backbones import check_attention, load_tokenizer, set_bidirectional

    torch.set_num_threads(threads)
    model = LlamaModel(LlamaConfig(**MODEL, attn_implementation="sdpa"))
    model.load_state_dict(load_file(str(work / "model.safetensors")))
    set_bidirectional(model, True)
    check_attention(model, expect_bidirectional=True)
    encoder = Encoder(model.eval(), load_tokenizer(str(TOKENIZER)), model_type="llama", **SETTINGS)
    pairs = [["", t] for t in json.loads((work / "texts.json").read_text())]
    from diffusion_embedder.templates import parse_inputs

    lengths = [len(t.input_ids) for t in encoder._tokenize_items(parse_inputs(pairs), 400, warn=False)]
    tokens = sum(lengths)
    processed = padded_size(encoder, parse_inputs(pairs), lengths, batch_size, packing)
    encoder.encode(pairs[:8], batch_size=4, show_progress_bar=False, packing=packing)  # warm-up
    start = time.perf_counter()
    out = encoder.encode(pairs, batch_size=batch_size, show_progress_bar=False, packing=packing)
    return {"seconds": time.perf_counter() - start, "tokens": tokens, "efficiency": tokens / processed,
            "embeddings": out.tolist()}


def padded_size(encoder, items, lengths: list[int], batch_size: int, packing: bool) -> int:
    """Tokens the forwards process (rows x width summed over batches), as encode batches them on CPU."""
    from diffusion_embedder import inference
    from diffusion_embedder import packing as packing_mod

    if hasattr(inference, "planned_batches"):  # issue 19: planned step by step while tokenizing
        plan = inference.BatchPlan(batch_size, None, packing, "cpu")
        return sum(int(f["input_ids"].numel()) for _, f in inference.planned_batches(encoder, items, encoder.config,
                                                                                       plan))
    if not packing:
        return sum(len(b) * max(lengths[i] for i in b) for b in inference.length_batches(lengths, batch_size))
    width = packing_mod.row_length(lengths, "cpu")
    total = 0
    for batch in packing_mod.plan_batches(lengths, width, batch_size):
        rows = packing_mod.pack_rows([lengths[i] for i in batch], width)
        fills = [sum(lengths[batch[i]] for i in row) for row in rows]
        total += len(rows) * max(fills)
    return total


# ----------------------------------------------------------------------------------- driver
def make_weights(work: Path, texts: list[str]) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    model = LlamaModel(LlamaConfig(**MODEL))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(work / "model.safetensors"))
    (work / "texts.json").write_text(json.dumps(texts))


def launch(python: Path, work: Path, name: str, args: argparse.Namespace) -> dict:
    command = [str(python), __file__, "--worker", name, "--work", str(work), "--threads", str(args.threads),
               "--batch-size", str(args.batch_size)]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS=str(args.threads))
    if name == "llm2vec":
        env.pop("PYTHONPATH", None)
    if name == "ours-before":
        env["PYTHONPATH"] = str(args.before)
    if name.endswith("-mkl"):
        env[ONEDNN_SWITCH] = "0"
    load = os.getloadavg()[0]
    out = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO)
    if out.returncode:
        raise RuntimeError(f"{name} worker failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result.update(name=name, load=load)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--num-texts", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--reference", choices=["llm2vec", "hf-loop"], default="llm2vec")
    parser.add_argument("--before", type=Path, default=None, help="another source tree, run as ours-before")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        if args.worker == "llm2vec":
            result = run_llm2vec(args.work, args.threads, args.batch_size)
        elif args.worker == "hf-loop":
            result = run_hf_loop(args.work, args.threads, args.batch_size)
        else:
            result = run_ours(args.work, args.threads, args.batch_size, packing="packed" in args.worker)
        print(json.dumps(result))
        return

    import numpy as np

    ref_name = args.reference
    reference = refenv_python() if ref_name == "llm2vec" else Path(sys.executable)
    names = [("ours-packed", sys.executable), (ref_name, reference), ("ours-padded", sys.executable)]
    if ref_name == "llm2vec":
        names.append(("ours-packed-mkl", sys.executable))
    if args.before:
        names.append(("ours-before", sys.executable))
    texts = load_texts(args.data, args.num_texts)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        make_weights(work, texts)
        runs = []
        for _ in range(args.repeats):
            for name, python in names:
                runs.append(launch(Path(python), work, name, args))
                r = runs[-1]
                print(f"{name}: {r['seconds']:.1f} s, {r['tokens'] / r['seconds']:.0f} tokens/s, "
                      f"load {r['load']:.2f}", flush=True)
    best = {}
    for r in runs:
        if r["name"] not in best or r["seconds"] < best[r["name"]]["seconds"]:
            best[r["name"]] = r
    ref = np.array(best[ref_name]["embeddings"])
    label = "LLM2Vec" if ref_name == "llm2vec" else "the HF loop"
    lines = ["| encoder | real tokens | padding efficiency | best of runs (s) | all runs (s) | median (s) | tokens/s | "
             f"speed-up vs {label} (best, median) | load average at start |",
             "|---|---:|---:|---:|---|---:|---:|---:|---|"]
    median = {name: float(np.median([x["seconds"] for x in runs if x["name"] == name])) for name in best}
    for name, _ in [(ref_name, None), *[n for n in names if n[0] != ref_name]]:
        r = best[name]
        times = ", ".join(f"{x['seconds']:.1f}" for x in runs if x["name"] == name)
        loads = ", ".join(f"{x['load']:.2f}" for x in runs if x["name"] == name)
        ratio = best[ref_name]["seconds"] / r["seconds"]
        ratio_median = median[ref_name] / median[name]
        efficiency = f"{r['efficiency']:.3f}" if "efficiency" in r else "–"
        lines.append(f"| {name} | {r['tokens']} | {efficiency} | {r['seconds']:.1f} | {times} | {median[name]:.1f} | "
                     f"{r['tokens'] / r['seconds']:.0f} | {ratio:.2f}x, {ratio_median:.2f}x | {loads} |")
    agreement = []
    for name in ("ours-padded", "ours-packed"):
        mine = np.array(best[name]["embeddings"])
        cos = (mine * ref).sum(-1) / np.linalg.norm(mine, axis=-1) / np.linalg.norm(ref, axis=-1)
        why = ("LLM2Vec cuts at 400 words, we cut at 400 tokens" if ref_name == "llm2vec"
               else "the HF loop pools the BOS too")
        agreement.append(f"- {name} vs {label}: cosine >= 0.99999 for {(cos >= 0.99999).sum()} of {len(cos)} texts "
                         f"({why})")
    report = "\n".join([*lines, "", *agreement])
    print(report)
    if args.out:
        args.out.write_text(report + "\n")


if __name__ == "__main__":
    main()
