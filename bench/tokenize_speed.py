"""Tokenization throughput: our pipeline against the tokenizer's own batch call with ``truncation=True``.

(Named ``tokenize_speed.py``, not ``tokenize.py``: a script's folder comes first on ``sys.path``, and a
``tokenize.py`` there would shadow the standard library module that ``linecache`` and ``inspect`` import.)

Realistic tokenizers, trained in seconds on the ReasonAug text and cached under ``--cache`` (default: a
folder in the system's temp directory; nothing is committed): a byte-level BPE with Qwen2's
pre-tokenizer regex and no BOS (Qwen/Dream-like), and a Metaspace (sentencepiece-style) BPE with byte
fallback and a ``<s>`` BOS (Llama-like). The corpus is ``bench/encode.py``'s, in three sets: short (the
first 16 words of each text), mixed (the texts as they are, tens to ~1,800 tokens) and over-long (texts
joined to at least 2,048 tokens, cut to 512).

For each tokenizer and set it prints seconds (best of ``--repeats``, runs interleaved) and the ratio of
the tokenizer's call's time to ours (>= 0.8 is the goal; > 1 is faster than the tokenizer's call):

- ``documents``: plain texts, ``max_length`` 512 and ``doc_max_length`` 512 (one call);
- ``queries``: every text with an instruction (full call + text-alone call);
- ``template``: plain texts in Qwen's chat template (text-alone + full + span calls);
- ``before``: the pipeline before issue 19 on the documents (``tests/test_tokenization.py``'s oracle).

It also counts how often a cut document's row differs from the old rule's (the cut string tokenized again).

    python bench/tokenize_speed.py --out bench/results/tokenize.md
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "tests"))

from encode import DEFAULT_DATA, load_corpus  # noqa: E402

#: Qwen2's pre-tokenizer split (tokenizer.json of Qwen/Qwen2.5-7B).
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
              r"\s+(?!\S)|\s+")
VOCAB = 32000
MAX_LENGTH = 512


def train_tokenizers(texts: list[str], cache: Path) -> dict:
    """The two benchmark tokenizers as Hugging Face fast tokenizers, trained once and cached."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    cache.mkdir(parents=True, exist_ok=True)
    qwen_file, llama_file = cache / "qwen_like.json", cache / "llama_like.json"
    if not qwen_file.exists():
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
        tok.decoder = decoders.ByteLevel()
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
        tok.train_from_iterator(texts, trainers.BpeTrainer(
            vocab_size=VOCAB, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        tok.save(str(qwen_file))
    if not llama_file.exists():
        tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
        tok.decoder = decoders.Sequence([decoders.Metaspace(), decoders.ByteFallback()])
        bytes_ = [f"<0x{b:02X}>" for b in range(256)]
        tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>",
                                                                                               *bytes_]))
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", tok.token_to_id("<s>"))])
        tok.save(str(llama_file))
    qwen = PreTrainedTokenizerFast(tokenizer_file=str(qwen_file), eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   mask_token="<|mask|>", padding_side="left")
    llama = PreTrainedTokenizerFast(tokenizer_file=str(llama_file), bos_token="<s>", eos_token="</s>",
                                    unk_token="<unk>", pad_token="</s>", padding_side="left")
    return {"qwen-like BPE": qwen, "llama-like Metaspace": llama}


def corpora(texts: list[str], count: int, tokenizer) -> dict[str, list[str]]:
    mixed = texts[:: max(1, len(texts) // count)][:count]
    short = [" ".join(t.split()[:16]) for t in mixed]
    long, current = [], ""
    for text in texts:
        current = f"{current}\n\n{text}" if current else text
        if len(current) > 9000 and len(tokenizer(current, add_special_tokens=False)["input_ids"]) >= 2048:
            long.append(current)
            current = ""
        if len(long) == count // 2:
            break
    return {"short": short, "mixed": mixed, "over-long": long}


def first_difference(a: list[int], b: list[int]) -> int:
    return next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def best(function, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "diffusion_embedder_bench")
    parser.add_argument("--count", type=int, default=768, help="texts per set (the over-long set has half)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    from test_tokenization import reference_tokenize

    from diffusion_embedder.config import EncoderConfig
    from diffusion_embedder.templates import DEFAULT_TEMPLATES, parse_inputs
    from diffusion_embedder.tokenization import tokenize_items

    texts = load_corpus(args.data, 10**9)
    plain = EncoderConfig().replace(max_length=MAX_LENGTH)
    template = plain.replace(prompt_template=DEFAULT_TEMPLATES["Qwen/Qwen2-7B-Instruct"])
    lines = ["| tokenizer | set | texts | tokens (untruncated) | tokenizer call (s) | documents (s) | ratio | "
             "queries (s) | ratio | template (s) | ratio | before (s) | ratio |", "|---|---|---:|---:|" + "---:|" * 9]
    moved_lines = []
    for name, tokenizer in train_tokenizers(texts, args.cache).items():
        for set_name, batch in corpora(texts, args.count, tokenizer).items():
            documents = parse_inputs([["", t] for t in batch])
            queries = parse_inputs([["Given a question, retrieve passages that answer it", t] for t in batch])
            runs = {
                "call": partial(tokenizer, batch, truncation=True, max_length=MAX_LENGTH),
                "documents": partial(tokenize_items, tokenizer, plain, [], documents, MAX_LENGTH, warn=False),
                "queries": partial(tokenize_items, tokenizer, plain, [], queries, MAX_LENGTH, warn=False),
                "template": partial(tokenize_items, tokenizer, template, [], documents, MAX_LENGTH, warn=False),
                "before": partial(reference_tokenize, tokenizer, plain, [], documents, MAX_LENGTH),
            }
            seconds = {key: [] for key in runs}
            for _ in range(args.repeats):  # interleaved, so a change in machine load hits every pipeline
                for key, run in runs.items():
                    seconds[key].append(best(run, 1))
            t = {key: min(v) for key, v in seconds.items()}
            tokens = sum(len(ids) for ids in tokenizer(batch, add_special_tokens=False)["input_ids"])
            row = f"| {name} | {set_name} | {len(batch)} | {tokens} | {t['call']:.3f} |"
            for key in ("documents", "queries", "template", "before"):
                row += f" {t[key]:.3f} | {t['call'] / t[key]:.2f}x |"
            lines.append(row)
            print(row, flush=True)
            for doc_max in (400, MAX_LENGTH):
                mine = tokenize_items(tokenizer, plain, [], documents, doc_max, warn=False)
                old, _ = reference_tokenize(tokenizer, plain, [], documents, doc_max)
                own = tokenizer(batch, add_special_tokens=False)["input_ids"]
                cut = [i for i, ids in enumerate(own) if len(ids) > min(doc_max, MAX_LENGTH - 1)]
                moved = [i for i in cut if mine[i] != old[i]]
                last = sum(first_difference(mine[i].input_ids, old[i].input_ids) >= len(mine[i].input_ids) - 3
                           for i in moved)
                if cut:
                    moved_lines.append(f"| {name} | {set_name} | {doc_max} | {len(cut)} | {len(moved)} "
                                       f"({len(moved) / len(cut):.0%}) | {last} |")
    report = "\n".join([
        *lines, "",
        "Cut documents whose row differs from the old rule's (the cut string tokenized again):", "",
        "| tokenizer | set | doc_max_length | cut texts | rows that differ | of which only in the last 3 tokens |",
        "|---|---|---:|---:|---:|---:|", *moved_lines,
    ])
    print(report)
    if args.out:
        args.out.write_text(report + "\n")


if __name__ == "__main__":
    main()
