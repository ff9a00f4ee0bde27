"""What ``mine`` reads: the pairs, the corpus, and which documents each query must never get back as a negative.

The pairs are one record per line: a query, its positive and optionally its instruction (our custom format's
``query``/``positive``/``instruction``, or any fields named on the command line) and the positive's corpus id.
Records with the same query and instruction are one query with several positives, as sentence-transformers groups
them. The candidate documents are the corpus (a document is its title and text joined as the evaluation joins
them), followed by the positives whose text it does not hold, as sentence-transformers adds them; without a corpus
they are the positives alone.

A query never gets back one of its positives, by id or by text, nor its own text. Texts are compared normalized
(``normalize_text``: Unicode NFKC, case folded, runs of whitespace as one space), because corpora repeat documents
with small differences: every document whose normalized text is a positive's, the text of a positive's id, or the
query's is excluded. Documents with one normalized text form a group; a query's exclusions are whole groups.

A positive is the document its positive id names, where that document's text or text field is the positive's; else
the corpus document with its exact text, else its normalized text; else the one whose text field alone (before its
title was joined), normalized, is the positive's, since pairs usually give a positive without its title. Only a
positive that matches no document is added. Every document whose normalized text, or text field, is the positive's
is excluded as well; so is every one that is the query's own text either way.
"""

from __future__ import annotations

import hashlib
import json
import os
import unicodedata
from dataclasses import dataclass

import numpy as np

from diffusion_embedder.data.custom import custom_instruction
from diffusion_embedder.data.jsonl import DataFormatError, Field, RecordError, read_jsonl
from diffusion_embedder.evaluation.encode_corpus import Corpus, read_corpus_file
from diffusion_embedder.files import check_file
from diffusion_embedder.mining.options import MiningError

#: Ids of positives added to the documents: this prefix and the line of the first record holding the text.
ADDED_PREFIX = "pairs:"


def normalize_text(text: str) -> str:
    """The text two documents are the same by: NFKC, case folded, whitespace runs as one space, stripped."""
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


@dataclass(frozen=True)
class PairRecord:
    """One line of the pairs: as written (``instruction`` None where absent), and where it went."""

    line: int
    query: str
    positive: str
    instruction: str | None
    positive_id: str | None
    query_index: int = -1
    positive_index: int = -1


@dataclass
class MiningInputs:
    """The pairs, the two stores' inputs and the exclusions, read and checked before any model loads."""

    records: list[PairRecord]
    #: one row per distinct (instruction, query), with the instruction as training formats it
    queries: Corpus
    #: the corpus's documents, then the positives it lacks
    documents: Corpus
    #: per document, its normalized text's group
    groups: np.ndarray
    #: per query, the groups it never gets back (its positives', its own text's)
    excluded_groups: list[np.ndarray]
    #: per query, its records' positive documents (the positive scores)
    positive_documents: list[list[int]]
    #: the most groups excluded for one query: room the search leaves above the window (ST's max_positives)
    max_excluded: int
    #: SHA-256 of what was read from the pairs (each record's line and fields)
    pairs_fingerprint: str


def read_pairs(path: str, query_field: str, positive_field: str, instruction_field: str,
               positive_id_field: str | None, corpus_ids: set[str] | None) -> list[PairRecord]:
    """The records of ``path``, each checked: fields present and of the right type, a non-empty query and positive,
    a positive id the corpus holds. A bad record is a ``DataFormatError`` naming file, line and field."""
    fields = [Field(query_field), Field(positive_field)]
    if instruction_field:
        fields.append(Field(instruction_field, required=False, nullable=True))
    if positive_id_field:
        fields.append(Field(positive_id_field, "int|str", required=False, nullable=True))

    def convert(record: dict, index: int) -> PairRecord:
        for name in (query_field, positive_field):
            if not record[name].strip():
                raise RecordError(f"field {name!r} is empty: a pair needs a query and a positive")
        positive_id = record.get(positive_id_field) if positive_id_field else None
        positive_id = None if positive_id is None else str(positive_id)
        if positive_id is not None and positive_id not in corpus_ids:
            raise RecordError(f"field {positive_id_field!r}: {positive_id!r} is not an id of --corpus")
        instruction = record.get(instruction_field) if instruction_field else None
        return PairRecord(index + 1, record[query_field], record[positive_field], instruction, positive_id)

    records, _ = read_jsonl(path, fields, convert, what="--pairs")
    if not records:
        raise DataFormatError(f"{path}: no records (the file is empty).")
    return records


def _fingerprint(records: list[PairRecord]) -> str:
    digest = hashlib.sha256()
    for r in records:
        row = [r.line, r.query, r.positive, r.instruction, r.positive_id]
        digest.update(json.dumps(row, ensure_ascii=False).encode() + b"\n")
    return digest.hexdigest()


def _fields(corpus: Corpus | None) -> list[str]:
    """Each corpus document's text field, before its title was joined (its text where no field was kept)."""
    return list((corpus.bodies or corpus.texts) if corpus else [])


def _documents(corpus: Corpus | None, records: list[PairRecord], pairs: str) -> tuple[Corpus, list[int]]:
    """The candidate documents and each record's positive document: the one its positive id names where that
    document's text or text field is the positive's (normalized); else the first with the positive's exact text,
    then normalized text, then normalized text field; else the positive itself, added to the documents."""
    ids, texts = (list(corpus.ids), list(corpus.texts)) if corpus else ([], [])
    fields = _fields(corpus)
    exact: dict[str, int] = {}
    whole: dict[str, int] = {}
    bodies: dict[str, int] = {}
    for i, (text, field_text) in enumerate(zip(texts, fields, strict=True)):
        exact.setdefault(text, i)
        whole.setdefault(normalize_text(text), i)
        bodies.setdefault(normalize_text(field_text), i)
    doc_of_id = {doc_id: i for i, doc_id in enumerate(ids)}
    taken = set(ids)
    placed = []
    for r in records:
        key = normalize_text(r.positive)
        named = doc_of_id.get(r.positive_id) if r.positive_id is not None else None
        if named is not None and key in (normalize_text(texts[named]), normalize_text(fields[named])):
            placed.append(named)
        elif r.positive in exact:
            placed.append(exact[r.positive])
        elif key in whole:
            placed.append(whole[key])
        elif key in bodies:
            placed.append(bodies[key])
        else:
            doc_id = f"{ADDED_PREFIX}{r.line}"
            if doc_id in taken:
                raise MiningError(f"--corpus has an id {doc_id!r}, the id given to the positive of {pairs}:{r.line} "
                                  "that the corpus lacks; rename that corpus id.")
            exact[r.positive] = whole[key] = len(texts)  # a later positive of the same text is this document
            placed.append(len(texts))
            ids.append(doc_id)
            texts.append(r.positive)
    pairs = os.path.abspath(pairs)
    source = f"{corpus.source} + the positives of {pairs}" if corpus else f"the positives of {pairs}"
    return Corpus(source, ids, texts), placed


def collect(records: list[PairRecord], corpus: Corpus | None, pairs: str) -> MiningInputs:
    """Group the records into queries, build the documents and each query's exclusions."""
    documents, positive_of = _documents(corpus, records, pairs)
    group_of: dict[str, int] = {}
    groups = np.asarray([group_of.setdefault(normalize_text(t), len(group_of)) for t in documents.texts],
                        dtype=np.int64)
    doc_of_id = {doc_id: i for i, doc_id in enumerate(documents.ids)}
    same: dict[str, set[int]] = {}  # a normalized text -> the groups of the documents that are it, or whose field is
    for i, field_text in enumerate(_fields(corpus)):
        same.setdefault(normalize_text(field_text), set()).add(int(groups[i]))
    for text, group in group_of.items():
        same.setdefault(text, set()).add(group)
    query_of: dict[tuple[str, str], int] = {}
    q_ids, q_instructions, q_texts = [], [], []
    excluded: list[set[int]] = []
    positives: list[list[int]] = []
    placed = []
    for r, doc in zip(records, positive_of, strict=True):
        instruction = custom_instruction(r.instruction)
        key = (instruction, r.query)
        if key not in query_of:
            query_of[key] = len(q_ids)
            q_ids.append(f"q:{r.line}")
            q_instructions.append(instruction)
            q_texts.append(r.query)
            excluded.append(set(same.get(normalize_text(r.query), ())))  # its own text, either way
            positives.append([])
        q = query_of[key]
        excluded[q] |= {int(groups[doc]), *same.get(normalize_text(r.positive), ())}  # every copy, either way
        if r.positive_id is not None:
            excluded[q].add(int(groups[doc_of_id[r.positive_id]]))
        if doc not in positives[q]:
            positives[q].append(doc)
        placed.append(PairRecord(r.line, r.query, r.positive, r.instruction, r.positive_id, q, doc))
    excluded_groups = [np.asarray(sorted(e), dtype=np.int64) for e in excluded]
    queries = Corpus(f"the queries of {os.path.abspath(pairs)}", q_ids, q_texts, q_instructions)
    return MiningInputs(placed, queries, documents, groups, excluded_groups, positives,
                        max(len(e) for e in excluded_groups), _fingerprint(records))


def read_inputs(args) -> MiningInputs:
    """``args.pairs`` and ``args.corpus`` read and checked (file and line named on error)."""
    if args.positive_id_field and not args.corpus:
        raise MiningError("--positive_id_field names the positive's --corpus id: give --corpus too.")
    corpus = None
    if args.corpus:
        check_file(args.corpus, "--corpus")
        corpus = read_corpus_file(args.corpus, args.id_field, args.text_field, args.title_field)
    records = read_pairs(args.pairs, args.query_field, args.positive_field, args.instruction_field,
                         args.positive_id_field, set(corpus.ids) if corpus else None)
    return collect(records, corpus, args.pairs)
