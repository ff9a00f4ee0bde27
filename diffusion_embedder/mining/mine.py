"""Hard negatives mined with the encoder: pairs and a corpus in, the custom loader's JSONL out.

Mining is a client of what exists: the documents and the queries go through ``encode``'s chunk store
(``OUTPUT_DIR/documents``, ``OUTPUT_DIR/queries``: the same manifest and identity rules, chunks shared over
torchrun ranks and ``--num_shards``/``--shard_index``, a rerun encodes only what is missing), ``search.py`` ranks
each query's candidates, ``filters.py`` picks its negatives, ``output.py`` writes them. ``prepare`` runs on every
process (check, load, encode its share); ``finish`` on one, once both stores are complete (search, filter, write).
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from diffusion_embedder import distributed
from diffusion_embedder.evaluation.encode_corpus import (
    Corpus,
    EncodeStats,
    corpus_manifest,
    encode_chunks,
    store_manifest,
)
from diffusion_embedder.evaluation.options import encoder_overrides, process_share
from diffusion_embedder.evaluation.sharding import load_checkpoint
from diffusion_embedder.evaluation.store import EmbeddingStore, check_corpus_there, check_manifest, chunk_name
from diffusion_embedder.mining import output
from diffusion_embedder.mining.filters import REASONS, query_seed, select
from diffusion_embedder.mining.inputs import MiningInputs, read_inputs
from diffusion_embedder.mining.options import MineArguments, MiningError, check_options
from diffusion_embedder.mining.search import score_pairs, search

if TYPE_CHECKING:
    from diffusion_embedder.encoder import Encoder

logger = logging.getLogger(__name__)

#: The two stores, as subfolders of ``--output_dir``.
STORES = ("documents", "queries")


@dataclass
class Prepared:
    """What ``prepare`` leaves for ``finish``: the inputs, the stores' manifests, the mining manifest, the
    encoder's similarity and device (where the search runs), and whether the negatives on disk are reused."""

    args: object
    inputs: MiningInputs
    manifests: dict[str, dict]
    made: dict
    similarity: str
    device: str | None
    reused: dict | None = None
    encoded: dict[str, EncodeStats] = field(default_factory=dict)


@dataclass
class MiningSummary:
    """What a run did: ``status`` (``mined``, ``reused`` or ``incomplete``: other shards still to run), the
    negatives' path, records written and dropped, and every dropped candidate by reason."""

    status: str
    path: str
    records_written: int = 0
    records_dropped: int = 0
    candidates_dropped: dict[str, int] = field(default_factory=dict)


def _corpus(inputs: MiningInputs, name: str) -> Corpus:
    return inputs.documents if name == "documents" else inputs.queries


def prepare(args, encoder=None) -> Prepared:
    """Check every option and input and that neither store holds another corpus (before the model loads or anything
    is written), load the model, check the stores are this model's and settings', then encode this process's share
    of both."""
    check_options(args)
    inputs = read_inputs(args)
    load_device, encode_device = distributed.placement(args.device)
    shard, num_shards = process_share(args)
    folders = {name: os.path.join(args.output_dir, name) for name in STORES}
    for name in STORES:
        check_corpus_there(folders[name], corpus_manifest(_corpus(inputs, name), args.chunk_size))
    if encoder is not None:
        _check_unused(args)
    else:
        encoder = load_checkpoint(args.base_model_name_or_path, args.peft_model_name_or_path, args.torch_dtype,
                                  load_device, **encoder_overrides(args))
    manifests = {name: store_manifest(encoder, _corpus(inputs, name), args.chunk_size, args.base_model_name_or_path,
                                      args.peft_model_name_or_path, num_shards) for name in STORES}
    for name in STORES:
        check_manifest(folders[name], manifests[name])
    made = output.manifest(args, manifests, inputs.pairs_fingerprint, len(inputs.records))
    prepared = Prepared(args, inputs, manifests, made, encoder.config.similarity_fn_name, str(encoder.device))
    prepared.reused = output.reusable(args.output_dir, made)
    if prepared.reused is None:
        for name in STORES:
            prepared.encoded[name] = encode_chunks(
                encoder, _corpus(inputs, name), folders[name], manifests[name], shard, num_shards, encode_device,
                args.batch_size, args.max_tokens_per_batch, args.show_progress_bar)
    return prepared


def _check_unused(args) -> None:
    """With an ``Encoder`` given, the options that would load one must not be: they could not reach it."""
    given = [name for name in ("peft_model_name_or_path", "torch_dtype") if getattr(args, name) is not None]
    given += list(encoder_overrides(args))
    if given:
        raise MiningError(f"encoder= is given, so {', '.join(given)} would not reach it: load the encoder with "
                          f"them (Encoder.from_pretrained(..., {given[-1]}=...)), or leave encoder out.")


def _complete(prepared: Prepared) -> bool:
    folder = prepared.args.output_dir
    return all(os.path.exists(os.path.join(folder, name, chunk_name(i) + ".json"))
               for name in STORES for i in range(prepared.manifests[name]["chunks"]["num_chunks"]))


def _negatives(prepared: Prepared) -> tuple[list[tuple[np.ndarray, np.ndarray, np.ndarray, dict]], Counter]:
    """Per query: its negatives (document indices, scores, ranks) and its positives' scores; dropped counts."""
    args, inputs = prepared.args, prepared.inputs
    documents = EmbeddingStore(os.path.join(args.output_dir, "documents"))
    queries = EmbeddingStore(os.path.join(args.output_dir, "queries"))
    seeds = [query_seed(args.seed, i, t) for i, t in zip(inputs.queries.instructions, inputs.queries.texts,
                                                         strict=True)]
    per_query: list = [None] * queries.num_rows
    counts: Counter = Counter({reason: 0 for reason in REASONS})
    blocks = search(queries, documents, args.range_max + inputs.max_excluded, prepared.similarity,
                    method=args.search, query_block=args.query_block_size, document_block=args.document_block_size,
                    device=prepared.device, faiss_index=args.faiss_index, groups=inputs.groups)
    if args.show_progress_bar:
        from tqdm.auto import tqdm

        blocks = tqdm(blocks, total=-(-queries.num_rows // args.query_block_size), desc="Mining query blocks")
    for rows, block in blocks:
        span = range(block.start, block.start + rows.shape[0])
        own = [inputs.positive_documents[q] for q in span]
        padded = np.full((len(own), max(map(len, own))), -1, dtype=np.int64)
        for row, docs in enumerate(own):
            padded[row, :len(docs)] = docs
        scores = score_pairs(rows, documents, padded, prepared.similarity)
        positive = np.where(padded >= 0, scores, np.inf).min(1)
        chosen, dropped = select(block, inputs.groups, inputs.excluded_groups[span.start:span.stop], positive,
                                 seeds[span.start:span.stop], args)
        counts.update(dropped)
        for row, (q, picks) in enumerate(zip(span, chosen, strict=True)):
            per_query[q] = (block.indices[row, picks], block.scores[row, picks], picks,
                            dict(zip(own[row], scores[row, :len(own[row])].tolist(), strict=True)))
    return per_query, counts


def finish(prepared: Prepared) -> MiningSummary:
    """Mine and write the negatives once both stores are complete (or report the reused ones)."""
    args, inputs = prepared.args, prepared.inputs
    path = os.path.join(args.output_dir, output.NEGATIVES)
    if prepared.reused is not None:
        counts = prepared.reused.get("counts", {})
        logger.info("%s holds negatives mined with this model, these settings and inputs: reused.", path)
        dropped = counts.get("candidates_dropped", {})
        return MiningSummary("reused", path, counts.get("records_written", 0), counts.get("records_dropped", 0),
                             {reason: dropped[reason] for reason in REASONS if reason in dropped})
    if not _complete(prepared):
        return MiningSummary("incomplete", path)
    per_query, dropped = _negatives(prepared)
    texts, ids = inputs.documents.texts, inputs.documents.ids
    records, too_few = [], 0
    for r in inputs.records:
        indices, scores, ranks, positive = per_query[r.query_index]
        if len(indices) < args.num_negatives:
            too_few += 1
            if not args.keep_fewer:
                continue
        record = {"query": r.query, "positive": r.positive}
        if r.instruction is not None:
            record["instruction"] = r.instruction
        record |= {"negatives": [texts[i] for i in indices], "negative_ids": [ids[i] for i in indices]}
        if args.output_scores:
            record |= {"positive_score": positive[r.positive_index], "negative_scores": scores.tolist(),
                       "negative_ranks": ranks.tolist()}
        records.append(record)
    dropped_records = 0 if args.keep_fewer else too_few
    if too_few:
        logger.warning("%d of %d records got fewer than %d negatives: %s (--keep_fewer %s).", too_few,
                       len(inputs.records), args.num_negatives, "kept" if args.keep_fewer else "dropped",
                       "on" if args.keep_fewer else "off")
    counts = {"records_written": len(records), "records_dropped": dropped_records, "records_with_fewer": too_few,
              "queries": len(per_query), "candidates_dropped": dict(dropped)}
    logger.info("Dropped candidates by reason: %s", ", ".join(f"{k} {v}" for k, v in dropped.items()))
    output.write(args.output_dir, records, {**prepared.made, "counts": counts})
    return MiningSummary("mined", path, len(records), dropped_records, dict(dropped))


def mine_hard_negatives(pairs: str, output_dir: str, corpus: str | None = None, *, encoder: Encoder | None = None,
                        **options: Any) -> MiningSummary:
    """Mine hard negatives for ``pairs`` from ``corpus`` into ``output_dir/negatives.jsonl``, in this process.

    The notebook form of ``diffusion-embedder mine``: the same checks, stores, filters and output, and the same
    reuse rule (a rerun with the same model, settings and inputs returns the negatives on disk).

    Args:
        pairs: A JSONL of (query, positive[, instruction]) records: our custom training format, or any JSONL whose
            fields ``query_field``, ``positive_field`` and ``instruction_field`` name.
        output_dir: Where the negatives, their manifest and the two embedding stores (``documents/``,
            ``queries/``) go.
        corpus: A JSONL of candidate documents (a BEIR ``corpus.jsonl`` or any JSONL with ``id_field`` and
            ``text_field``); None mines from the pairs' own positives.
        encoder: An ``Encoder`` already loaded, used with its own settings (``peft_model_name_or_path``,
            ``torch_dtype`` or an encoder setting given with it is refused); None loads ``base_model_name_or_path``
            (with those options) as ``diffusion-embedder mine`` loads it.
        **options: Any other ``diffusion-embedder mine`` option by its name (``num_negatives=3``,
            ``relative_margin=0.05``, ``sampling="top"``, ...), with the command's defaults and checks.

    Returns:
        What was done: ``status`` (``mined`` or ``reused``), the negatives' path, records written and dropped, and
        the dropped candidates by reason.

    Raises:
        MiningError: An option outside its rules, an unknown option name, or a loading option with ``encoder``.
        OptionError: A value that does not fit its option (type, choices, range).
        DataFormatError: A bad line in ``pairs`` or ``corpus``, named by file and line.
        OtherEmbeddings: ``output_dir`` holds the embeddings of another model, settings or inputs.
    """
    fields = {"pairs": pairs, "output_dir": output_dir, "corpus": corpus, **options}
    if encoder is not None and not fields.get("base_model_name_or_path"):
        fields["base_model_name_or_path"] = getattr(encoder, "name_or_path", None) or "(an Encoder object)"
    try:
        args = MineArguments(**fields)
    except TypeError as e:
        raise MiningError(f"mine_hard_negatives: {e}") from None
    return finish(prepare(args, encoder))
