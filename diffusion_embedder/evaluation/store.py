"""The embedding store on disk: what ``encode`` (and ``mine``) write, and how it is read back.

A store is a folder holding

    manifest.json      the model (base, adapter, weights hash), every encoder setting, dtype and dimension, the
                       corpus (source, fingerprint, rows), the chunk plan, the package version
    chunk-000000.npy   float32 rows of the chunk's texts, in corpus order
    chunk-000000.json  their ids and rows, the SHA-256 of the .npy and of the manifest's identity (what the vectors
                       depend on); written last, so it marks the chunk complete

Every process claims the folder for its manifest (``claim_folder``: the first writes it, the others must match it),
so one folder never mixes two models', settings' or corpora's vectors, and a chunk is checked against its record
before it is trusted. ``load_embeddings`` reads a store whole; ``EmbeddingStore`` reads it block by block, so a
search over a corpus larger than memory holds only the blocks in use.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import uuid
from collections.abc import Iterator

import numpy as np

from diffusion_embedder.evaluation.cache import BadRows, load_rows, save_rows
from diffusion_embedder.files import read_json_object

MANIFEST = "manifest.json"
FORMAT = "diffusion_embedder.embeddings/1"
#: What a folder's vectors depend on: a rerun that differs in any of these is refused. The rest of the
#: manifest (paths, version, shard count) says where they came from.
IDENTITY_KEYS = ("format", "model.weights_sha256", "model.backbone_sha256", "settings", "torch_dtype",
                 "embedding_dim", "corpus.fingerprint", "corpus.num_rows", "chunks.chunk_size", "chunks.chunk_chars",
                 "chunks.num_chunks")


class OtherEmbeddings(ValueError):
    """An output folder holding the embeddings of another model, settings or corpus (never mixed with these)."""


def chunk_name(index: int) -> str:
    return f"chunk-{index:06d}"


def _flat(record: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in record.items():
        if isinstance(value, dict) and key != "settings":
            out |= _flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def _differences(stored: dict, manifest: dict, known_only: bool = False) -> list[str]:
    """What about the vectors differs between two manifests, one line each (settings named one by one); with
    ``known_only``, only what ``manifest`` holds (a manifest made before the model loads)."""
    old, new = _flat(stored), _flat(json.loads(json.dumps(manifest)))
    lines = []
    for key in IDENTITY_KEYS:
        if known_only and key not in new:
            continue
        if key == "settings":
            before, after = old.get(key) or {}, new[key]
            lines += [f"encoder setting {k}: {before.get(k)!r} there, {after.get(k)!r} now"
                      for k in sorted(set(before) | set(after)) if before.get(k) != after.get(k)]
        elif old.get(key) != new[key]:
            lines.append(f"{key}: {old.get(key)!r} there, {new[key]!r} now")
    return lines


#: Identity keys added after stores were first written: left out of ``identity`` where a manifest lacks them, so a
#: store written before still reads (a new run's manifest, which has them, still differs from its manifest).
LATER_IDENTITY_KEYS = ("model.backbone_sha256",)


def identity(manifest: dict) -> str:
    """SHA-256 of the manifest's ``IDENTITY_KEYS`` values: stored in every chunk record, so a chunk is never taken
    for another model's, settings' or corpus's, even where the manifest was deleted or replaced."""
    flat = _flat(json.loads(json.dumps(manifest)))
    values = [flat.get(k) for k in IDENTITY_KEYS if k in flat or k not in LATER_IDENTITY_KEYS]
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()


def claim_folder(folder: str, manifest: dict) -> None:
    """Write ``manifest.json`` (the first process to arrive does, atomically), or check the one there."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, MANIFEST)
    if not os.path.exists(path):
        tmp = f"{path}.{uuid.uuid4().hex}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=2, sort_keys=True)
        with contextlib.suppress(FileExistsError):  # another process made it first: compared below
            os.link(tmp, path)
        os.remove(tmp)
    check_manifest(folder, manifest)


def check_manifest(folder: str, manifest: dict) -> None:
    """Refuse ``folder`` (``OtherEmbeddings``) when its manifest is another model's, settings' or corpus's than
    ``manifest``; write nothing."""
    path = os.path.join(folder, MANIFEST)
    if os.path.exists(path):
        _refuse_other(folder, _differences(read_json_object(path, ValueError), manifest))


def _refuse_other(folder: str, differences: list[str]) -> None:
    if differences:
        raise OtherEmbeddings(f"{folder} holds the embeddings of another model, settings or corpus, which must not be "
                              f"mixed: {'; '.join(differences)}. Choose another --output_dir.")


def check_corpus_there(folder: str, manifest: dict) -> None:
    """Before the model loads: a folder whose manifest names another corpus or chunk plan than ``manifest`` (the
    part known without the model) is refused as ``claim_folder`` would refuse it after loading."""
    path = os.path.join(folder, MANIFEST)
    if os.path.isfile(path):
        _refuse_other(folder, _differences(read_json_object(path, OtherEmbeddings), manifest, known_only=True))


def check_chunk(
    folder: str, index: int, dim: int, made_by: str, ids: list[str] | None = None
) -> tuple[dict, np.ndarray]:
    """The record and memory-mapped rows of a complete, intact chunk made under identity ``made_by``, or
    ``ValueError`` naming the file and what is wrong."""
    record_path = os.path.join(folder, chunk_name(index) + ".json")
    if not os.path.exists(record_path):
        raise ValueError(f"{record_path}: missing (chunk {index} was not completed)")
    record = read_json_object(record_path, ValueError)
    if not isinstance(record.get("ids"), list) or not isinstance(record.get("sha256"), str):
        raise ValueError(f"{record_path}: not a chunk record (ids, rows, sha256)")
    if record.get("identity") != made_by:
        raise ValueError(f"{record_path}: made by another model, settings or corpus than the manifest's")
    if ids is not None and record["ids"] != ids:
        raise ValueError(f"{record_path}: its ids are not the corpus's ids for this chunk")
    try:
        rows = load_rows(os.path.join(folder, chunk_name(index) + ".npy"), record["sha256"], len(record["ids"]), dim)
    except BadRows as bad:
        raise ValueError(f"{bad.path}: {bad}") from None
    return record, rows


def write_chunk(folder: str, index: int, ids: list[str], rows: tuple[int, int], vectors: np.ndarray,
                 made_by: str) -> None:
    """The chunk's rows, then its record (temporary files renamed into place, the record last)."""
    base = os.path.join(folder, chunk_name(index))
    for leftover in glob.glob(f"{base}.*.tmp*"):  # from a killed run
        with contextlib.suppress(FileNotFoundError):
            os.remove(leftover)
    digest = save_rows(base, vectors)
    tmp = f"{base}.{uuid.uuid4().hex}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"ids": ids, "rows": list(rows), "sha256": digest, "identity": made_by}, f)
    os.replace(tmp, base + ".json")


def load_embeddings(output_dir: str) -> tuple[list[str], np.ndarray]:
    """Read what ``diffusion-embedder encode`` wrote: the ids and their embeddings, in corpus order.

    Args:
        output_dir: The folder ``diffusion-embedder encode`` wrote.

    Returns:
        The document ids, and a float32 ``(N, d)`` array whose row i is document i's embedding.

    Raises:
        ValueError: A chunk missing, damaged or written by another model or settings (finish it by running the
            same command again), named with its file.
    """
    store = EmbeddingStore(output_dir)
    return store.ids, store.block(0, store.num_rows)


class EmbeddingStore:
    """The rows of a complete store, in corpus order, read on demand.

    Every chunk is checked once when the folder opens (complete, intact, made under the manifest's identity, rows
    in order); the rows a caller asks for are then read from the chunk files, each read its own copy.

    Args:
        folder: The folder ``diffusion-embedder encode`` (or ``mine``) wrote; every chunk must be complete.

    Raises:
        ValueError: A chunk missing, damaged or written by another model or settings (finish it by running the
            same command again), named with its file.
    """

    def __init__(self, folder: str):
        self.folder = folder
        self.manifest = read_json_object(os.path.join(folder, MANIFEST), ValueError)
        if self.manifest.get("format") != FORMAT:
            raise ValueError(f"{os.path.join(folder, MANIFEST)}: format {self.manifest.get('format')!r}, "
                             f"not {FORMAT!r}")
        self.dim: int = self.manifest["embedding_dim"]
        made_by = identity(self.manifest)
        self.ids: list[str] = []
        starts = [0]
        for index in range(self.manifest["chunks"]["num_chunks"]):
            try:
                record, _ = check_chunk(folder, index, self.dim, made_by)
            except ValueError as e:
                raise ValueError(f"{e}; rerun the command that wrote {folder} to finish it.") from None
            if record.get("rows") != [len(self.ids), len(self.ids) + len(record["ids"])]:
                raise ValueError(f"{os.path.join(folder, chunk_name(index))}.json: rows {record.get('rows')}, "
                                 f"expected to start at {len(self.ids)}")
            self.ids += record["ids"]
            starts.append(len(self.ids))
        if len(self.ids) != self.manifest["corpus"]["num_rows"]:
            raise ValueError(f"{folder}: {len(self.ids)} rows in the chunks, the manifest says "
                             f"{self.manifest['corpus']['num_rows']}")
        self._starts = np.asarray(starts, dtype=np.int64)

    @property
    def num_rows(self) -> int:
        return len(self.ids)

    def _rows(self, index: int) -> np.ndarray:
        """Chunk ``index``'s rows, memory-mapped (nothing read until sliced and copied)."""
        return np.load(os.path.join(self.folder, chunk_name(index) + ".npy"), mmap_mode="r")

    def block(self, start: int, end: int) -> np.ndarray:
        """Rows ``start .. end - 1`` as one float32 array (one copy, made from the memory-mapped chunks)."""
        first = int(np.searchsorted(self._starts, start, side="right")) - 1
        parts = []
        index = first
        while index < len(self._starts) - 1 and self._starts[index] < end:
            lo, hi = self._starts[index], self._starts[index + 1]
            parts.append(self._rows(index)[max(start, lo) - lo:min(end, hi) - lo])
            index += 1
        return np.concatenate(parts).astype(np.float32, copy=False) if parts else np.zeros((0, self.dim), np.float32)

    def blocks(self, size: int) -> Iterator[tuple[int, np.ndarray]]:
        """``(start, rows)`` of consecutive blocks of at most ``size`` rows."""
        for start in range(0, self.num_rows, size):
            yield start, self.block(start, min(start + size, self.num_rows))

    def take(self, indices: np.ndarray) -> np.ndarray:
        """The rows at ``indices`` (any shape, any order), shape ``indices.shape + (dim,)``."""
        flat = np.asarray(indices, dtype=np.int64).reshape(-1)
        out = np.empty((flat.size, self.dim), dtype=np.float32)
        chunk_of = np.searchsorted(self._starts, flat, side="right") - 1
        for index in np.unique(chunk_of):
            where = np.nonzero(chunk_of == index)[0]
            out[where] = self._rows(int(index))[flat[where] - self._starts[index]]
        return out.reshape(*np.shape(indices), self.dim)
