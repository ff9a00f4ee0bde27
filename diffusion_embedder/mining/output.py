"""``mine``'s output: ``negatives.jsonl`` in the custom loader's format, and the manifest that says what made it.

Each kept pair record is written once, in the pairs' order: ``query``, ``positive``, ``instruction`` (where the
record has one), ``negatives`` (texts, best first) and ``negative_ids``; with ``--output_scores`` also
``positive_score``, ``negative_scores`` and ``negative_ranks`` (0: the query's most similar document in the whole
corpus). ``data.Custom`` reads it as it is, ``num_negatives`` unchanged, and ignores the extra fields.

``manifest.json`` holds the model (paths, weights hash), its settings, both stores' identities, the inputs' paths
and fingerprints, every option that shapes the negatives, the counts by reason of every dropped candidate and
record, and the SHA-256 of ``negatives.jsonl``. Its ``identity`` is the hash of what the negatives depend on: a
rerun with the same identity and an intact file reuses them; any difference mines again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import uuid

from diffusion_embedder import __version__
from diffusion_embedder.evaluation.cache import file_sha256
from diffusion_embedder.evaluation.store import identity as store_identity
from diffusion_embedder.files import read_json_object
from diffusion_embedder.mining.filters import FILTER_OPTIONS

logger = logging.getLogger(__name__)

FORMAT = "diffusion_embedder.negatives/1"
NEGATIVES = "negatives.jsonl"
MANIFEST = "manifest.json"
#: The rules that turn candidates into negatives, numbered: a new number whenever the same stores, pairs and
#: options would give other negatives, so negatives mined by older rules are mined again, never reused (2: the
#: search counts distinct texts; a positive given without its title is its titled corpus document. 3: a positive is
#: the document its id names; every copy of a positive, whole text or text field, is excluded).
RULES = 3
#: Options beyond the filters' that change what is written.
OUTPUT_OPTIONS = ("keep_fewer", "output_scores", "search", "faiss_index")


def mining_options(args) -> dict:
    """Every option the negatives depend on, by name (``faiss_index`` only with ``--search faiss``)."""
    options = {name: getattr(args, name) for name in (*FILTER_OPTIONS, *OUTPUT_OPTIONS)}
    if args.search != "faiss":
        options.pop("faiss_index")
    return options


def manifest(args, stores: dict[str, dict], pairs_fingerprint: str, num_records: int) -> dict:
    """The manifest before mining (counts and the file's hash come after): ``identity`` and what it covers."""
    documents = stores["documents"]
    covered = {"stores": {name: store_identity(m) for name, m in stores.items()}, "pairs": pairs_fingerprint,
               "options": mining_options(args), "rules": RULES}
    return {
        "format": FORMAT,
        "version": __version__,
        "identity": hashlib.sha256(json.dumps(covered, sort_keys=True).encode()).hexdigest(),
        **covered,
        "model": documents["model"],
        "settings": documents["settings"],
        "torch_dtype": documents["torch_dtype"],
        "inputs": {"pairs": {"path": os.path.abspath(args.pairs), "fingerprint": pairs_fingerprint,
                             "records": num_records},
                   "corpus": {"path": os.path.abspath(args.corpus) if args.corpus else None,
                              "documents": documents["corpus"]}},
    }


def reusable(folder: str, new: dict) -> dict | None:
    """The stored manifest when ``folder``'s negatives were made with ``new``'s identity and are intact, else None
    (with the reason logged)."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.exists(path):
        return None
    try:
        old = read_json_object(path, ValueError)
    except ValueError as e:
        logger.warning("Mining again: %s", e)
        return None
    if old.get("identity") != new["identity"]:
        changed = [f"option {k}: {old.get('options', {}).get(k)!r} there, {v!r} now"
                   for k, v in new["options"].items() if old.get("options", {}).get(k) != v]
        changed += [f"{name} embeddings" for name, v in new["stores"].items() if old.get("stores", {}).get(name) != v]
        changed += ["the pairs"] if old.get("pairs") != new["pairs"] else []
        changed += [f"the mining rules ({old.get('rules', 1)} there, {new['rules']} now)"] if old.get(
            "rules", 1) != new["rules"] else []
        logger.info("Mining again into %s: %s changed.", folder, "; ".join(changed) or "the manifest's format")
        return None
    negatives = os.path.join(folder, NEGATIVES)
    if not os.path.exists(negatives) or file_sha256(negatives) != old.get("negatives_sha256"):
        logger.warning("Mining again: %s is missing or was changed since it was written.", negatives)
        return None
    return old


def _atomic_write(path: str, lines) -> None:
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for line in lines:
            f.write(line)
    os.replace(tmp, path)


def write(folder: str, records: list[dict], made: dict) -> str:
    """``negatives.jsonl`` (the records) then ``manifest.json`` (``made`` with the file's hash), each written to a
    temporary file and renamed into place; the path of the negatives."""
    os.makedirs(folder, exist_ok=True)
    negatives = os.path.join(folder, NEGATIVES)
    _atomic_write(negatives, (json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    made = {**made, "negatives_sha256": file_sha256(negatives)}
    _atomic_write(os.path.join(folder, MANIFEST), [json.dumps(made, indent=2, sort_keys=True)])
    return negatives
