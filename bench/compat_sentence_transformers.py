"""Max |difference| between Encoder.encode and SentenceTransformer(exported folder).encode, per setting.

    python bench/compat_sentence_transformers.py [--out bench/results/compat_sentence_transformers.md]

Exports the tiny Llama and Dream fixtures under every pooling mode, skip_instruction on and off, with a
query prompt (max_length = doc_max_length = 512), loads each folder with sentence-transformers (with
trust_remote_code=True only where modules.json names our EncoderModule) and prints a markdown table; exits 1
if any difference reaches 1e-5.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from sentence_transformers import SentenceTransformer

from diffusion_embedder import Encoder
from diffusion_embedder.export import ENCODER_MODULE
from diffusion_embedder.pooling import POOLING_MODES

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
CHECKPOINTS = {"llama": FIXTURES / "llm2vec_parity" / "llama", "Dream": FIXTURES / "dream_reference"}
PROMPTS = {"query": "Given a math problem, retrieve the relevant theorem"}
TEXTS = [
    "A triangle has sides 3, 4 and 5. Find its area.",
    "Heron's formula gives the area of a triangle from its three sides. " * 12,
    " leading space",
    "(parenthesis first) then words",
    "x",
    "",  # no token at all on Dream (no BOS): the encoder's stand-in token, hence EncoderModule there
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="also write the table to this markdown file")
    args = p.parse_args(argv)
    rows = [
        "| backbone | pooling | skip_instruction | modules | max diff | max diff, query prompt |",
        "|---|---|---|---|---|---|",
    ]
    worst = 0.0
    for family, checkpoint in CHECKPOINTS.items():
        for mode in POOLING_MODES:
            if mode == "mask_token" and family != "Dream":
                continue
            for skip in (False, True):
                encoder = Encoder.from_pretrained(
                    str(checkpoint),
                    pooling_mode=mode,
                    skip_instruction=skip,
                    prompts=PROMPTS,
                    doc_max_length=512,  # = max_length: prompts then don't force EncoderModule
                    device="cpu",
                )
                with tempfile.TemporaryDirectory() as folder:
                    encoder.save(folder, format="sentence-transformers")
                    custom = json.loads((Path(folder) / "modules.json").read_text())[0]["type"] == ENCODER_MODULE
                    model = SentenceTransformer(folder, device="cpu", trust_remote_code=custom)
                    diffs = [
                        (
                            torch.as_tensor(model.encode(TEXTS, **kw))
                            - encoder.encode(TEXTS, show_progress_bar=False, **kw)
                        )
                        .abs()
                        .max()
                        .item()
                        for kw in ({}, {"prompt_name": "query"})
                    ]
                worst = max(worst, *diffs)
                kind = "EncoderModule" if custom else "Transformer + Pooling"
                rows.append(f"| {family} | {mode} | {skip} | {kind} | {diffs[0]:.1e} | {diffs[1]:.1e} |")
    table = "\n".join(rows) + f"\n\nWorst: {worst:.1e}\n"
    print(table)
    if args.out:
        Path(args.out).write_text(table)
    return 0 if worst < 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
