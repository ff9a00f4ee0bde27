"""``encode``: a corpus's embeddings written to disk with their ids, in chunks, resumable, shared out over processes.

The input is a BEIR ``corpus.jsonl`` (``_id``, ``title``, ``text``), any JSONL with an id and a text field
(``--id_field``, ``--text_field``; ``--title_field ""`` when there is no title), or an mteb task's corpus
(``--task_name``; mteb is needed only then). A document is encoded as the evaluation encodes it: its title and
text joined as mteb joins them (``document_text``), no instruction. The output folder is an embedding store
(``store.py``: a manifest, then per chunk its float32 rows and a record written last).

Chunks, not shards, are the unit on disk: they are ``sharding.plan_chunks`` over the corpus, whatever the number
of processes, and process ``s`` of ``n`` (``--num_shards``/``--shard_index``, times torchrun's ranks) encodes
chunks ``s, s + n, ...``. So any sharding writes the same files with the same vectors, and a rerun, with as
many processes as are at hand, encodes only the chunks not yet complete and intact. A folder made for another
model, settings, dtype or corpus is refused, naming what differs. The model is what it computes (the hash of
its weights, an adapter folded in, and its settings, as the results ledger defines it), not where it was loaded
from: the same checkpoint copied to another path resumes the run. ``store.load_embeddings`` reads the folder back
in corpus order and checks every chunk.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
from dataclasses import dataclass, field

from diffusion_embedder import __version__, clihelp, distributed
from diffusion_embedder.clihelp import UsageError
from diffusion_embedder.data.jsonl import Field, read_jsonl_rows
from diffusion_embedder.evaluation.options import (
    EXIT_STATUS,
    CorpusFieldOptions,
    ModelOptions,
    ShardOptions,
    check_folder,
    check_model_options,
    check_shares,
    command_parser,
    encoder_overrides,
    option,
    process_share,
    with_encoder_settings,
)
from diffusion_embedder.evaluation.results import backbone_hash, computed_settings, weights_hash
from diffusion_embedder.evaluation.sharding import CHUNK_CHARS, encode_chunk, load_checkpoint, plan_chunks
from diffusion_embedder.evaluation.store import (
    FORMAT,
    MANIFEST,
    OtherEmbeddings,
    check_chunk,
    check_corpus_there,
    chunk_name,
    claim_folder,
    identity,
    write_chunk,
)
from diffusion_embedder.files import check_file, read_json_object

logger = logging.getLogger(__name__)

#: Starts the fingerprint of a store of queries, so it never equals a documents' store of the same texts.
QUERIES_HEADER = b"queries: [id, instruction, text], encoded as training encodes them\n"


@dataclass
class _EncodeOptions(ShardOptions, CorpusFieldOptions, ModelOptions):
    """Every ``encode`` option, once (the model's are ``ModelOptions``, shared with ``eval``; the corpus fields and
    shares are shared with ``mine``)."""

    corpus: str | None = option(help="BEIR corpus.jsonl, or any JSONL (.gz too) with an id and a text field")
    task_name: str | None = option(help="an mteb task whose corpus to encode, instead of --corpus")
    split: str | None = option(help="the mteb task's split (default: its first evaluation split)")
    subset: str | None = option(help="the mteb task's subset (default: its first)")
    data_dir: str | None = option(help="folder with datasets downloaded beforehand (clones of the hub repos)")
    output_dir: str | None = option(help="the embeddings folder (required)")


#: The ``encode`` options plus every ``EncoderConfig`` setting (None: the checkpoint's own).
EncodeArguments = with_encoder_settings(_EncodeOptions, "EncodeArguments", __name__)


#: ``encode``'s exit statuses (``clihelp.run_command``): 0 done (every chunk of this process's share written or
#: found complete); 2 the run could not start, the message alone: a flag (``evaluation/options.py``'s
#: ``EXIT_STATUS``), the corpus file, the checkpoint's files, or an output folder that is a file or holds other
#: embeddings (``OtherEmbeddings``). Anything else is a bug, with its traceback.
ENCODE_EXIT_STATUS: dict[type[Exception], int] = {**EXIT_STATUS, OtherEmbeddings: 2}


@dataclass
class Corpus:
    """The texts to encode, in order, and what identifies them: a corpus's documents, or queries with their
    instructions (``instructions``), which are encoded as training encodes an ``[instruction, text]`` pair: the
    whole query kept up to ``max_length`` tokens, where documents are cut at ``doc_max_length`` as the evaluation
    cuts them."""

    source: str
    ids: list[str]
    texts: list[str]
    instructions: list[str] | None = None
    #: each document's text field alone, before its title was joined (what ``mine`` matches positives against too);
    #: not part of what is encoded or its fingerprint
    bodies: list[str] | None = None

    @property
    def fingerprint(self) -> str:
        """SHA-256 of every (id, text) in order (with its instruction, for queries): what is encoded, however it
        was read."""
        digest = hashlib.sha256()
        rows = zip(self.ids, self.texts, strict=True)
        if self.instructions is not None:
            digest.update(QUERIES_HEADER)
            rows = zip(self.ids, self.instructions, self.texts, strict=True)
        for row in rows:
            digest.update(json.dumps(list(row), ensure_ascii=False).encode() + b"\n")
        return digest.hexdigest()

    def inputs(self, start: int, end: int) -> list[list[str]]:
        """``[instruction, text]`` of rows ``start .. end - 1`` (no instruction for documents)."""
        instructions = self.instructions[start:end] if self.instructions is not None else [""] * (end - start)
        return [[i, t] for i, t in zip(instructions, self.texts[start:end], strict=True)]

    def chunks(self, chunk_size: int) -> list[tuple[int, int]]:
        """The chunk plan: ``sharding.plan_chunks`` over the inputs' lengths (instructions count)."""
        lengths = [len(t) for t in self.texts]
        if self.instructions is not None:
            lengths = [n + len(i) for n, i in zip(lengths, self.instructions, strict=True)]
        return plan_chunks(lengths, chunk_size)

    def encode_kwargs(self, encoder) -> dict:
        """What ``Encoder.encode`` needs beyond the inputs: queries are cut at ``max_length`` only, as training's
        ``Encoder.tokenize`` cuts them."""
        return {} if self.instructions is None else {"doc_max_length": encoder.config.max_length}


@dataclass
class EncodeStats:
    """What one process did: chunks encoded (their indices and texts), chunks found complete on disk."""

    encoded_texts: int = 0
    skipped_chunks: int = 0
    chunks: list[int] = field(default_factory=list)

    @property
    def encoded_chunks(self) -> int:
        return len(self.chunks)


def document_text(title: str | None, text: str) -> str:
    """A document as mteb's retrieval evaluation hands it to a model (its ``_corpus_to_dict``): title, space, text."""
    return (title + " " + text).strip() if title else text.strip()


def read_corpus_file(path: str, id_field: str = "_id", text_field: str = "text", title_field: str = "title") -> Corpus:
    """A JSONL corpus, validated: a bad record, an empty file or a repeated id is a ``file:line`` error."""
    fields = [Field(id_field, "int|str"), Field(text_field)]
    if title_field:
        fields.append(Field(title_field, required=False, nullable=True))
    rows = read_jsonl_rows(path, fields, id_field)
    return Corpus(os.path.abspath(path), [str(r[id_field]) for r in rows],
                  [document_text(r.get(title_field) if title_field else None, r[text_field]) for r in rows],
                  bodies=[r[text_field] for r in rows])


def read_task_corpus(name: str, split: str | None = None, subset: str | None = None,
                     data_dir: str | None = None) -> Corpus:
    """The corpus of an mteb retrieval task (a local copy with ``data_dir``), as its evaluation reads it."""
    from diffusion_embedder.evaluation.tasks import get_mteb_task

    task = get_mteb_task(name, data_dir)
    task.load_data()
    subset = subset or next(iter(task.dataset))
    split = split or task.metadata.eval_splits[0]
    try:
        corpus = task.dataset[subset][split]["corpus"]
    except (KeyError, TypeError):
        raise ValueError(f"{name}: no corpus for subset {subset!r}, split {split!r} (subsets: "
                         f"{sorted(task.dataset)}; splits: {task.metadata.eval_splits}).") from None
    titles = corpus["title"] if "title" in corpus.column_names else [None] * len(corpus)
    texts = [document_text(title, text) for title, text in zip(titles, corpus["text"], strict=True)]
    return Corpus(f"mteb:{name}/{subset}/{split}@{task.metadata.revision}", [str(i) for i in corpus["id"]], texts)


def build_parser() -> argparse.ArgumentParser:
    """The ``encode`` command line: one flag per ``_EncodeOptions`` field, then one per encoder setting."""
    return command_parser("encode", "Write a corpus's embeddings to OUTPUT_DIR (chunk files and their ids), "
                                    "resumable; --num_shards/--shard_index for job arrays, and torchrun's ranks "
                                    "share the work too.", _EncodeOptions)


def parse_args(argv: list[str] | None = None) -> EncodeArguments:
    """``EncodeArguments`` from the command line (``argv``, else ``sys.argv``)."""
    return EncodeArguments(**vars(build_parser().parse_args(argv)))


def check_arguments(args) -> None:
    """Every flag, before any model loads or any file is written (argparse has read and checked each value)."""
    check_model_options(args, _EncodeOptions)
    if not args.output_dir:
        raise UsageError("--output_dir is required.")
    check_folder(args.output_dir, "--output_dir")
    if bool(args.corpus) == bool(args.task_name):
        raise UsageError("Give one of --corpus (a JSONL file) or --task_name (an mteb task).")
    if args.corpus:
        check_file(args.corpus, "--corpus")
    check_shares(args)


def _read_corpus(args) -> Corpus:
    if args.task_name:
        return read_task_corpus(args.task_name, args.split, args.subset, args.data_dir)
    return read_corpus_file(args.corpus, args.id_field, args.text_field, args.title_field)


def corpus_manifest(corpus: Corpus, chunk_size: int) -> dict:
    """The part of a store's manifest known before the model loads: the corpus and its chunk plan."""
    return {
        "corpus": {"source": corpus.source, "fingerprint": corpus.fingerprint, "num_rows": len(corpus.ids)},
        "chunks": {"chunk_size": chunk_size, "chunk_chars": CHUNK_CHARS, "num_chunks": len(corpus.chunks(chunk_size))},
    }


def store_manifest(encoder, corpus: Corpus, chunk_size: int, base_model_name_or_path: str | None,
                   peft_model_name_or_path: str | None = None, num_shards: int = 1) -> dict:
    """The manifest of ``corpus``'s embeddings by ``encoder`` in chunks of ``chunk_size``: the model (paths for
    provenance, weights hash), its settings, dtype and dimension, the corpus and the chunk plan."""
    return {
        "format": FORMAT,
        "version": __version__,
        "model": {"base_model_name_or_path": base_model_name_or_path,
                  "peft_model_name_or_path": peft_model_name_or_path,
                  "weights_sha256": weights_hash(encoder), "backbone_sha256": backbone_hash(encoder)},
        "settings": computed_settings(encoder.config.to_dict()),
        "torch_dtype": str(next(encoder.parameters()).dtype).removeprefix("torch."),
        "embedding_dim": encoder.embedding_dim,
        **corpus_manifest(corpus, chunk_size),
        "num_shards": num_shards,
    }


def encode_chunks(encoder, corpus: Corpus, folder: str, manifest: dict, shard: int = 0, num_shards: int = 1,
                  device: str | list[str] | None = None, batch_size: int = 32,
                  max_tokens_per_batch: int | None = None, show_progress_bar: bool = False) -> EncodeStats:
    """Encode chunks ``shard, shard + num_shards, ...`` of ``corpus`` into ``folder`` (claimed for ``manifest``
    first), skipping those already complete and intact."""
    claim_folder(folder, manifest)
    made_by = identity(manifest)
    chunks = corpus.chunks(manifest["chunks"]["chunk_size"])
    stats = EncodeStats()
    mine = range(shard, len(chunks), num_shards)
    if show_progress_bar and distributed.is_main():
        from tqdm.auto import tqdm

        mine = tqdm(mine, desc=f"Encoding chunks of {folder} (shard {shard} of {num_shards})")
    for index in mine:
        start, end = chunks[index]
        ids = corpus.ids[start:end]
        try:
            check_chunk(folder, index, encoder.embedding_dim, made_by, ids)
            stats.skipped_chunks += 1
            continue
        except ValueError as e:
            if os.path.exists(os.path.join(folder, chunk_name(index) + ".json")):
                logger.warning("Encoding chunk %d again: %s", index, e)
        vectors = encode_chunk(encoder, corpus.inputs(start, end), device, batch_size=batch_size,
                               show_progress_bar=False, max_tokens_per_batch=max_tokens_per_batch,
                               **corpus.encode_kwargs(encoder))
        write_chunk(folder, index, ids, (start, end), vectors, made_by)
        stats.encoded_texts += end - start
        stats.chunks.append(index)
    return stats


def encode_corpus(args) -> EncodeStats:
    """Encode this process's chunks of the corpus into ``args.output_dir``, skipping those already complete."""
    check_arguments(args)
    load_device, encode_device = distributed.placement(args.device)
    shard, num_shards = process_share(args)
    corpus = _read_corpus(args)
    check_corpus_there(args.output_dir, corpus_manifest(corpus, args.chunk_size))
    encoder = load_checkpoint(args.base_model_name_or_path, args.peft_model_name_or_path, args.torch_dtype,
                              load_device, **encoder_overrides(args))
    manifest = store_manifest(encoder, corpus, args.chunk_size, args.base_model_name_or_path,
                              args.peft_model_name_or_path, num_shards)
    return encode_chunks(encoder, corpus, args.output_dir, manifest, shard, num_shards, encode_device,
                         args.batch_size, args.max_tokens_per_batch, args.show_progress_bar)


def main(argv: list[str] | None = None) -> int:
    """CLI entry: every process encodes its chunks; one (rank 0 under torchrun) prints what was done. Exit status:
    ``ENCODE_EXIT_STATUS``."""
    distributed.configure_logging()
    args = parse_args(argv)
    return clihelp.run_command(lambda: _run(args), ENCODE_EXIT_STATUS)


def _run(args) -> int:
    check_arguments(args)  # before any process starts waiting for the others
    distributed.init()
    try:
        everyone = distributed.gather(encode_corpus(args))
        distributed.barrier()  # every rank done talking before the group goes: an exit race can abort a rank
    finally:
        distributed.shutdown()
    if everyone is None:
        return 0
    encoded = sum(s.encoded_chunks for s in everyone)
    print(f"Encoded {encoded} chunks ({sum(s.encoded_texts for s in everyone)} texts); "
          f"{sum(s.skipped_chunks for s in everyone)} chunks were complete already.")
    manifest = read_json_object(os.path.join(args.output_dir, MANIFEST))
    total = manifest["chunks"]["num_chunks"]
    done = sum(os.path.exists(os.path.join(args.output_dir, chunk_name(i) + ".json")) for i in range(total))
    state = "complete" if done == total else "other shards still to run (or rerun to finish)"
    print(f"{args.output_dir}: {done} of {total} chunks, {state}; read it with "
          "diffusion_embedder.evaluation.store.load_embeddings.")
    return 0
