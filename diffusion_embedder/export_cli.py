"""``diffusion-embedder export CHECKPOINT OUT``: load a checkpoint as an Encoder and write it in an ``export`` format.

Apart from ``export`` because it loads an ``Encoder``, whose ``save(format=...)`` writes through ``export``:
this module sits above both, so neither imports the other's importer.
"""

from __future__ import annotations

import argparse

from diffusion_embedder.dtypes import TORCH_DTYPES
from diffusion_embedder.export import FORMATS, export
from diffusion_embedder.files import folder_problem


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="diffusion-embedder export",
        description="Write an encoder (checkpoint, encoder folder or base + adapter) as a folder another library loads",
    )
    p.add_argument("checkpoint", help="encoder folder, training checkpoint, LLM2Vec folder or base model")
    p.add_argument("output", help="folder to write")
    p.add_argument("--format", choices=list(FORMATS), default="sentence-transformers",
                   help="sentence-transformers: a folder SentenceTransformer(...) loads; encoder: our own folder")
    p.add_argument("--peft_model_name_or_path", help="LoRA adapter over CHECKPOINT (merged into the export)")
    p.add_argument(
        "--torch_dtype", choices=TORCH_DTYPES, default="float32", help="dtype of the weights (auto: the checkpoint's)"
    )
    p.add_argument(
        "--stock_only",
        action="store_true",
        help="refuse settings that need diffusion_embedder's module instead of sentence-transformers' own",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    problem = folder_problem(args.output, "OUTPUT")  # before loading the checkpoint, which can take minutes
    if problem:
        print(f"error: {problem}")
        return 2
    from diffusion_embedder.encoder import Encoder

    encoder = Encoder.from_pretrained(
        args.checkpoint,
        peft_model_name_or_path=args.peft_model_name_or_path,
        merge_peft=args.peft_model_name_or_path is not None,
        torch_dtype=args.torch_dtype,
        device="cpu",
    )
    try:
        export(encoder, args.output, args.format, stock_only=args.stock_only)
    except ValueError as error:
        print(f"error: {error}")
        return 2
    print(f"wrote {args.format} folder {args.output}")
    return 0
