"""Any BEIR-format folder as an mteb retrieval task, scored by mteb's own evaluator.

Layout (BEIR): ``corpus.jsonl`` (``_id``, ``title``, ``text``), ``queries.jsonl`` (``_id``, ``text``,
optional ``instruction``), ``qrels/<split>.tsv`` (``query-id  corpus-id  score``, header line).
Optional: ``task.json`` (``name``, ``instruction`` for the queries, ``main_score``) and
``top_ranked.jsonl`` (``query-id``, ``corpus-ids``: candidates to rerank, as FollowIR does).

Instruction retrieval (FollowIR style): every topic appears twice, ``<qid>-og`` with its original
instruction and ``<qid>-changed`` with the changed one. The documents whose relevance the change
affects come from ``qrel_diff.jsonl`` (``query-id``, ``corpus-ids``) or, without it, are derived as
the documents relevant under the original instruction and not under the changed one. The task's
main score is then p-MRR, computed by mteb's ``evaluate_p_mrr_change``.
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Any

from datasets import Dataset
from mteb._evaluators.retrieval_metrics import evaluate_p_mrr_change
from mteb.abstasks import AbsTaskRetrieval
from mteb.abstasks.retrieval_dataset_loaders import RetrievalSplitData
from mteb.abstasks.task_metadata import TaskMetadata

from diffusion_embedder.data.jsonl import DataFormatError, Field, read_jsonl_rows
from diffusion_embedder.files import read_json_object

logger = logging.getLogger(__name__)

OG, CHANGED = "-og", "-changed"


CORPUS_FIELDS = (Field("_id", "int|str"), Field("text"), Field("title", required=False, nullable=True))
QUERY_FIELDS = (Field("_id", "int|str"), Field("text"), Field("instruction", required=False, nullable=True))
ID_LIST_FIELDS = (Field("query-id", "int|str"), Field("corpus-ids", "list[str]"))
#: ``task.json`` keys and their types; anything else is a typo we refuse rather than ignore.
TASK_KEYS: dict[str, type] = {"name": str, "instruction": str, "main_score": str, "description": str}


def _read_rows(path: str, fields: tuple[Field, ...], id_key: str | None = None) -> list[dict]:
    """Validated rows of a JSONL file: an empty file or a repeated id is a ``file:line`` error too."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"Missing {path}.")
    return read_jsonl_rows(path, fields, id_key)


def read_task_config(folder: str) -> dict:
    """``task.json`` of a local task, validated; an absent file means every default."""
    path = os.path.join(folder, "task.json")
    if not os.path.exists(path):
        return {}
    config = read_json_object(path, DataFormatError)
    unknown = sorted(set(config) - set(TASK_KEYS))
    if unknown:
        raise DataFormatError(f"{path}: unknown key(s) {unknown}; known: {sorted(TASK_KEYS)}.")
    for key, value in config.items():
        if not isinstance(value, TASK_KEYS[key]):
            raise DataFormatError(f"{path}: {key!r} must be a string, got {type(value).__name__}: {value!r:.80}.")
    return config


def _read_qrels(path: str) -> dict[str, dict[str, int]]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"Missing {path} (qrels: query-id, corpus-id, score; tab-separated, with header).")
    qrels: dict[str, dict[str, int]] = {}
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            parts = line.rstrip("\n").split("\t")
            if line_no == 1 and parts[0] == "query-id":
                continue
            if not line.strip():
                continue
            if len(parts) != 3:
                raise ValueError(f"{path}, line {line_no}: expected 3 tab-separated fields, got {len(parts)}.")
            try:
                score = int(parts[2])
            except ValueError as e:
                raise ValueError(f"{path}, line {line_no}: score {parts[2]!r} is not an integer.") from e
            qrels.setdefault(parts[0], {})[parts[1]] = score
    return qrels


def folder_hash(folder: str) -> str:
    """Hash of every file in the folder, so edited data never matches an older result."""
    digest = hashlib.sha256()
    for root, _, files in sorted(os.walk(folder)):
        for name in sorted(files):
            path = os.path.join(root, name)
            digest.update(os.path.relpath(path, folder).encode())
            with open(path, "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()[:16]


def is_instruction_task(query_ids: list[str]) -> bool:
    """True when the queries are og/changed pairs."""
    og = {q[: -len(OG)] for q in query_ids if q.endswith(OG)}
    changed = {q[: -len(CHANGED)] for q in query_ids if q.endswith(CHANGED)}
    return bool(og) and og == changed and len(og) * 2 == len(query_ids)


def derive_qrel_diff(qrels: dict[str, dict[str, int]]) -> dict[str, list[str]]:
    """Per topic: documents relevant under the original instruction but not under the changed one."""
    diff = {}
    for qid, docs in qrels.items():
        if not qid.endswith(OG):
            continue
        base = qid[: -len(OG)]
        changed = qrels.get(base + CHANGED, {})
        diff[base] = sorted(d for d, s in docs.items() if s > 0 and changed.get(d, 0) <= 0)
    return {k: v for k, v in diff.items() if v}


class LocalRetrievalTask(AbsTaskRetrieval):
    """Base for tasks made by ``load_local_task``; the data is read from ``folder`` on ``load_data``."""

    folder: str = ""
    split: str = "test"
    changed_qrels: dict[str, list[str]] | None = None

    def load_data(self, num_proc: int | None = None, **kwargs: Any) -> None:
        if self.data_loaded:
            return
        corpus, queries, qrels, top_ranked = read_beir(self.folder, self.split)
        corpus_ds = Dataset.from_list(
            [{"id": str(r["_id"]), "title": r.get("title") or "", "text": r["text"]} for r in corpus]
        )
        query_rows = [{"id": str(r["_id"]), "text": r["text"]} for r in queries]
        if any("instruction" in r for r in queries):
            for row, raw in zip(query_rows, queries, strict=True):
                row["instruction"] = raw.get("instruction") or ""
        self.dataset = {
            "default": {
                self.split: RetrievalSplitData(
                    corpus=corpus_ds,
                    queries=Dataset.from_list(query_rows),
                    relevant_docs=qrels,
                    top_ranked=top_ranked,
                )
            }
        }
        self.data_loaded = True

    def task_specific_scores(self, scores, qrels, results, hf_split: str, hf_subset: str) -> dict:
        if self.changed_qrels is None:
            return {}
        return evaluate_p_mrr_change(qrels, results, self.changed_qrels, self.k_values)


def read_beir(folder: str, split: str = "test"):
    """Corpus rows, query rows, qrels and optional candidate lists of a BEIR folder, validated."""
    corpus = _read_rows(os.path.join(folder, "corpus.jsonl"), CORPUS_FIELDS, "_id")
    queries = _read_rows(os.path.join(folder, "queries.jsonl"), QUERY_FIELDS, "_id")
    qrels = _read_qrels(os.path.join(folder, "qrels", f"{split}.tsv"))
    doc_ids = {str(r["_id"]) for r in corpus}
    query_ids = {str(r["_id"]) for r in queries}
    for qid, docs in qrels.items():
        if qid not in query_ids:
            raise ValueError(f"{folder}/qrels/{split}.tsv: query-id {qid!r} is not in queries.jsonl.")
        unknown = sorted(set(docs) - doc_ids)
        if unknown:
            raise ValueError(f"{folder}/qrels/{split}.tsv: corpus-id {unknown[0]!r} is not in corpus.jsonl.")
    top_ranked = None
    path = os.path.join(folder, "top_ranked.jsonl")
    if os.path.isfile(path):
        top_ranked = {str(r["query-id"]): [str(d) for d in r["corpus-ids"]] for r in
                      _read_rows(path, ID_LIST_FIELDS, "query-id")}
    return corpus, queries, qrels, top_ranked


def load_local_task(folder: str, name: str | None = None, split: str = "test") -> LocalRetrievalTask:
    """An mteb task over a BEIR folder (p-MRR instruction retrieval when queries come in og/changed pairs)."""
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"Local task folder {folder!r} does not exist.")
    config = read_task_config(folder)
    _, queries, qrels, top_ranked = read_beir(folder, split)
    query_ids = [str(r["_id"]) for r in queries]
    unjudged = [qid for qid in query_ids if not any(s > 0 for s in qrels.get(qid, {}).values())]
    if unjudged:
        logger.warning(
            "%d of %d queries in %s have no relevant document in %s (first: %r); check the qrels.",
            len(unjudged), len(query_ids), os.path.join(folder, "queries.jsonl"),
            os.path.join(folder, "qrels", f"{split}.tsv"), unjudged[0],
        )
    instruction_task = is_instruction_task(query_ids)
    changed = None
    if instruction_task:
        diff_path = os.path.join(folder, "qrel_diff.jsonl")
        if os.path.isfile(diff_path):
            changed = {str(r["query-id"]): [str(d) for d in r["corpus-ids"]]
                       for r in _read_rows(diff_path, ID_LIST_FIELDS, "query-id")}
        else:
            changed = derive_qrel_diff(qrels)
        if not changed:
            raise ValueError(f"{folder}: og/changed queries but no document changes relevance; p-MRR is undefined.")
    name = name or config.get("name") or os.path.basename(os.path.normpath(folder))
    if instruction_task:
        task_type = "InstructionReranking" if top_ranked else "InstructionRetrieval"
    else:
        task_type = "Retrieval"
    main_score = config.get("main_score") or ("p-MRR" if instruction_task else "ndcg_at_10")
    metadata = TaskMetadata(
        name=name,
        description=config.get("description") or f"Local BEIR folder {os.path.abspath(folder)}",
        dataset={"path": os.path.abspath(folder), "revision": folder_hash(folder)},
        type=task_type,
        category="t2t",
        modalities=["text"],
        eval_splits=[split],
        eval_langs=["eng-Latn"],
        main_score=main_score,
        prompt={"query": config["instruction"]} if config.get("instruction") else None,
    )
    attrs = {"metadata": metadata, "folder": folder, "split": split, "changed_qrels": changed}
    cls = type(f"Local_{name}", (LocalRetrievalTask,), attrs)
    logger.info("Local task %s (%s, main score %s) from %s", name, task_type, main_score, folder)
    return cls()
