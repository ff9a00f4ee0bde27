"""``diffusion-embedder export CHECKPOINT OUT``: load a checkpoint as an Encoder and write it in an ``export`` format.

Apart from ``export`` because it loads an ``Encoder``, whose ``save(format=...)`` writes through ``export``:
this module sits above both, so neither imports the other's importer.
"""

from __future__ import annotations

import argparse

from diffusion_embedder import clihelp
from diffusion_embedder.clihelp import UsageError
from diffusion_embedder.dtypes import TORCH_DTYPES
from diffusion_embedder.export import FORMATS, ExportRefused, export
from diffusion_embedder.files import folder_problem
from diffusion_embedder.release_configs import BackboneConfigError
from diffusion_embedder.values import OptionError

#: ``export``'s exit statuses (``clihelp.run_command``): 0 written; 2 nothing written, the message alone: an OUTPUT
#: that is a file, a checkpoint whose files are missing or unreadable, settings the format cannot hold with
#: ``--stock_only``. Anything else is a bug, with its traceback.
EXIT_STATUS: dict[type[Exception], int] = {
    UsageError: 2, OptionError: 2, FileNotFoundError: 2, BackboneConfigError: 2, ExportRefused: 2,
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=clihelp.prog("export"),
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
    """CLI entry; exit status ``EXIT_STATUS``."""
    args = build_parser().parse_args(argv)
    return clihelp.run_command(lambda: _run(args), EXIT_STATUS)


def _run(args: argparse.Namespace) -> int:
    problem = folder_problem(args.output, "OUTPUT")  # before loading the checkpoint, which can take minutes
    if problem:
        raise UsageError(problem)
    from diffusion_embedder.encoder import Encoder

    encoder = Encoder.from_pretrained(
        args.checkpoint,
        peft_model_name_or_path=args.peft_model_name_or_path,
        merge_peft=args.peft_model_name_or_path is not None,
        torch_dtype=args.torch_dtype,
        device="cpu",
    )
    export(encoder, args.output, args.format, stock_only=args.stock_only)
    print(f"wrote {args.format} folder {args.output}")
    return 0
