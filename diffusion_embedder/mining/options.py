"""``mine``'s options, each defined once (a dataclass field, its flag derived), and their checks.

Every check here runs before the model loads or any file is written: a bad value stops the run naming the flag
and the value. Each value is read and checked as every other command's are (``values``: its type, choices and
range); the rules between options are here. The filters have sentence-transformers' names and meanings
(``util.mine_hard_negatives``).
"""

from __future__ import annotations

from dataclasses import dataclass

from diffusion_embedder.evaluation.options import (
    CorpusFieldOptions,
    ModelOptions,
    ShardOptions,
    check_folder,
    check_model_options,
    check_shares,
    option,
    with_encoder_settings,
)
from diffusion_embedder.values import AT_LEAST_ONE, AT_LEAST_ZERO, Bounds

#: ``--sampling``: the first ``num_negatives`` of the window, or ``num_negatives`` of it drawn with ``--seed``.
SAMPLINGS = ("top", "random")
#: ``--search``: exact blocked top-k (torch, on the encoding device), or a FAISS index (the ``[faiss]`` extra).
SEARCHES = ("exact", "faiss")
#: ``--relative_margin``: a fraction of the positive's score, 0 (inclusive) to 1 (exclusive).
FRACTION: Bounds = ((0, True), (1, False))
#: ``--max_score``/``--min_score``: unbounded, but a range all the same, so NaN is refused (``values.range_problem``).
ANY_NUMBER: Bounds = (None, None)


class MiningError(ValueError):
    """Mining cannot run as asked: the message names the flag, file or line, and the value."""


@dataclass
class MiningOptions:
    """What is mined and how: inputs, filters, output, search (the model's options are ``ModelOptions``)."""

    pairs: str | None = option(help="training JSONL of (query, positive) pairs (.gz too): our custom format, or any "
                                    "JSONL with the fields named below (required)")
    corpus: str | None = option(help="candidate documents: a BEIR corpus.jsonl or any JSONL with an id and a text "
                                     "field (default: the pairs' own positives); positives it lacks are added")
    output_dir: str | None = option(help="OUTPUT_DIR/negatives.jsonl, its manifest.json and the two embedding "
                                         "stores (documents/, queries/) (required)")
    query_field: str = option("query", "the --pairs field holding each record's query")
    positive_field: str = option("positive", "the --pairs field holding each record's positive document")
    instruction_field: str = option("instruction", "the query's instruction, encoded with it as training encodes "
                                                   "it; '' for none")
    positive_id_field: str | None = option(help="the positive's --corpus id (where a record has it), excluded from "
                                                "its query's negatives like its text (default: by text only)")
    num_negatives: int = option(3, "negatives per record", bounds=AT_LEAST_ONE)
    range_min: int = option(0, "skip the first range_min candidates left after the filters", bounds=AT_LEAST_ZERO)
    range_max: int = option(50, "consider only the first range_max candidates left after the filters",
                            bounds=AT_LEAST_ONE)
    relative_margin: float | None = option(0.05, "drop a candidate scoring above positive - |positive| * margin "
                                                 "(NV-Retriever's rule: 0.05 keeps 95 percent); null: off",
                                           bounds=FRACTION)
    absolute_margin: float | None = option(help="drop a candidate scoring above positive - margin; null: off",
                                           bounds=AT_LEAST_ZERO)
    max_score: float | None = option(help="drop a candidate scoring above this; null: off",
                                     bounds=ANY_NUMBER)
    min_score: float | None = option(help="drop a candidate scoring below this; null: off",
                                     bounds=ANY_NUMBER)
    sampling: str = option("top", "top: the best num_negatives of the window; random: drawn from it with --seed",
                           choices=SAMPLINGS)
    seed: int = option(42, "seed of --sampling random (each query draws from its own stream)")
    keep_fewer: bool = option(False, "keep a record with fewer than num_negatives negatives (default: dropped)")
    output_scores: bool = option(False, "also write each record's positive_score, negative_scores and "
                                        "negative_ranks")
    search: str = option("exact", "exact: every score, in blocks; faiss: a FAISS index (the [faiss] extra)",
                         choices=SEARCHES)
    faiss_index: str = option("Flat", "FAISS index factory string for --search faiss (Flat: exact)")
    query_block_size: int = option(1024, "queries scored at once: with document_block_size, bounds the search's "
                                         "memory", bounds=AT_LEAST_ONE)
    document_block_size: int = option(16384, "documents scored at once", bounds=AT_LEAST_ONE)


@dataclass
class _MineOptions(MiningOptions, ShardOptions, CorpusFieldOptions, ModelOptions):
    """Every ``mine`` option: the model's (as ``encode`` and ``eval``), the corpus fields and shares (as
    ``encode``), then mining's own."""


#: The ``mine`` options plus every ``EncoderConfig`` setting (None: the checkpoint's own).
MineArguments = with_encoder_settings(_MineOptions, "MineArguments", __name__)


def check_options(args) -> None:
    """Every ``mine`` option, before the model loads or anything is written: each value as its flag reads it (the
    model's too: a checkpoint, devices this machine has), then the rules between them (``MiningError`` names the
    flags and values)."""
    check_model_options(args, _MineOptions)
    for name in ("pairs", "output_dir"):
        if not getattr(args, name):
            raise MiningError(f"--{name} is required.")
    check_folder(args.output_dir, "--output_dir")
    if args.range_min >= args.range_max:
        raise MiningError(f"--range_min {args.range_min} must be below --range_max {args.range_max}.")
    if args.num_negatives > args.range_max - args.range_min:
        raise MiningError(f"--num_negatives {args.num_negatives} is more than the window holds: --range_max "
                          f"{args.range_max} - --range_min {args.range_min} = {args.range_max - args.range_min}.")
    check_shares(args)
    if args.max_score is not None and args.min_score is not None and args.min_score > args.max_score:
        raise MiningError(f"--min_score {args.min_score} is above --max_score {args.max_score}: nothing could pass.")
    if not args.query_field or not args.positive_field:
        raise MiningError("--query_field and --positive_field must name fields of --pairs.")
    if args.search == "faiss":
        try:
            import faiss  # noqa: F401
        except ImportError:
            raise MiningError("--search faiss needs FAISS: pip install 'diffusion_embedder[faiss]' (faiss-cpu), or "
                              "the GPU build; --search exact needs nothing more.") from None
