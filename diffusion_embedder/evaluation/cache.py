"""Document embeddings on disk, keyed by model identity, encoding settings and the text itself.

FollowIR scores the same corpus under original and changed instructions, BRIGHT domains are rerun
while tuning instructions, and an interrupted run restarts: none of that should re-encode documents.
One folder per (model identity, settings) key; inside, append-only shards of ``.npy`` rows with a key
file beside them: the SHA-256 of each text and of the ``.npy`` file's bytes. A shard counts only once its
key file exists (written last), so a run killed mid-write leaves the cache valid; a shard damaged later
(truncated, emptied, missing, bytes changed, a bad key file, or one written without a checksum) is
discarded with a warning naming the file, and its texts are encoded again.

``get_or_encode`` is the whole cycle for one process; the sharded evaluation (``sharding.py``) runs its steps
apart: rank 0 asks which texts are ``missing``, every rank ``write``s the shards of the chunks it encodes, and
rank 0 ``adopt``s the others' shards so later calls find them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

logger = logging.getLogger(__name__)


KEYS_SUFFIX = ".keys.json"
_HASH = re.compile(r"^[0-9a-f]{64}$")


class BadRows(ValueError):
    """Rows on disk that cannot be trusted: ``path`` is the file at fault, the message says why."""

    def __init__(self, path: str, reason: str):
        super().__init__(reason)
        self.path = path


def save_rows(base: str, vectors: np.ndarray) -> str:
    """Write ``vectors`` to ``base.npy`` through a temporary file renamed into place; the SHA-256 of its bytes.

    The caller writes the record holding that digest afterwards, so a record always names complete rows.
    """
    tmp = f"{base}.{uuid.uuid4().hex}.tmp.npy"
    np.save(tmp, vectors)
    digest = file_sha256(tmp)
    os.replace(tmp, base + ".npy")
    return digest


def load_rows(path: str, digest: str, num_rows: int, dim: int | None = None) -> np.ndarray:
    """The memory-mapped float32 rows ``save_rows`` wrote, checked, or ``BadRows``: a missing, truncated,
    mis-shaped or altered file (its bytes no longer hash to ``digest``) never serves rows."""
    try:
        rows = np.load(path, mmap_mode="r")
    except FileNotFoundError:
        raise BadRows(path, "missing") from None
    except (OSError, ValueError, EOFError) as e:
        raise BadRows(path, f"unreadable or truncated: {e}") from None
    if rows.ndim != 2 or rows.dtype != np.float32 or rows.shape[0] != num_rows or dim not in (None, rows.shape[1]):
        expected = f"({num_rows}, {dim})" if dim is not None else f"with {num_rows} rows"
        raise BadRows(path, f"array {rows.dtype}{rows.shape}, expected float32 {expected}")
    if file_sha256(path) != digest:
        raise BadRows(path, "its bytes changed since it was written (SHA-256 differs from its record)")
    return rows


def _read_shard(folder: str, shard: str) -> tuple[list[str], np.ndarray]:
    """The text hashes and the (memory-mapped) rows of one shard, or ``BadRows`` naming the broken file.

    Checked: the key file is a JSON object with the SHA-256 of each text and of the ``.npy`` file; the
    ``.npy`` exists, is a 2-D float32 array with one row per key, and its bytes hash to the stored digest.
    A truncated, emptied, mismatched or altered file never serves rows. Shards of older versions, whose key
    file is a bare list without a digest, cannot be verified and are treated as damaged (rebuilt once).
    """
    keys_path = os.path.join(folder, shard + KEYS_SUFFIX)
    try:
        with open(keys_path, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadRows(keys_path, f"unreadable key file: {e}") from None
    if not isinstance(record, dict) or not isinstance(record.get("rows_sha256"), str):
        raise BadRows(keys_path, "the key file has no checksum of the rows (damaged, or an older cache version)")
    hashes = record.get("texts")
    if not isinstance(hashes, list) or not all(isinstance(h, str) and _HASH.match(h) for h in hashes):
        raise BadRows(keys_path, "the key file's 'texts' is not a list of SHA-256 text hashes")
    return hashes, load_rows(os.path.join(folder, f"{shard}.npy"), record["rows_sha256"], len(hashes))


def file_sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def text_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def settings_key(identity: str, settings: dict) -> str:
    """Folder name for one model identity under one set of encoding settings."""
    blob = json.dumps({"identity": identity, "settings": settings}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:24]


@dataclass
class CacheStats:
    """Texts served from disk vs. encoded, summed over calls (the benchmark and tests read these)."""

    hits: int = 0
    encoded: int = 0
    calls: list[tuple[int, int]] = field(default_factory=list)

    def count(self, hits: int, encoded: int) -> None:
        """Record one call: ``hits`` texts served from disk, ``encoded`` encoded."""
        self.hits += hits
        self.encoded += encoded
        self.calls.append((hits, encoded))


class EmbeddingCache:
    """Per-text embedding store under ``root``; ``get_or_encode`` encodes only the texts it lacks."""

    def __init__(self, root: str):
        self.root = root
        self.stats = CacheStats()
        self._index: dict[str, dict[str, tuple[str, int]]] = {}

    def _folder(self, key: str) -> str:
        return os.path.join(self.root, key)

    def _load_index(self, key: str) -> dict[str, tuple[str, int]]:
        if key in self._index:
            return self._index[key]
        index: dict[str, tuple[str, int]] = {}
        folder = self._folder(key)
        dim: int | None = None
        if os.path.isdir(folder):
            for name in sorted(os.listdir(folder)):
                if not name.endswith(KEYS_SUFFIX):
                    continue
                shard = name[: -len(KEYS_SUFFIX)]
                try:
                    hashes, rows = _read_shard(folder, shard)
                    if dim is not None and rows.shape[1] != dim:
                        raise BadRows(os.path.join(folder, f"{shard}.npy"), f"{rows.shape[1]} columns, not {dim}")
                except BadRows as bad:
                    logger.warning("Embedding cache: discarding %s (%s); its texts are encoded again.", bad.path, bad)
                    for path in (os.path.join(folder, name), os.path.join(folder, f"{shard}.npy")):
                        with contextlib.suppress(FileNotFoundError):
                            os.remove(path)
                    continue
                dim = rows.shape[1]
                for row, h in enumerate(hashes):
                    index.setdefault(h, (shard, row))
        self._index[key] = index
        return index

    def missing(self, texts: Sequence[str], identity: str, settings: dict) -> list[str]:
        """The distinct texts of ``texts`` not stored yet, in order of first appearance."""
        index = self._load_index(settings_key(identity, settings))
        return list(dict.fromkeys(t for t in texts if text_hash(t) not in index))

    def write(self, texts: Sequence[str], vectors: np.ndarray, identity: str, settings: dict) -> str:
        """Store one row per text as a new shard (readers see it only once complete); returns the shard's name."""
        vectors = np.asarray(vectors, dtype=np.float32)
        if vectors.shape[0] != len(texts):
            raise ValueError(f"The encoder returned {vectors.shape[0]} rows for {len(texts)} texts.")
        key = settings_key(identity, settings)
        folder = self._folder(key)
        os.makedirs(folder, exist_ok=True)
        meta_path = os.path.join(folder, "settings.json")
        if not os.path.exists(meta_path):
            with open(meta_path, "w", encoding="utf-8") as f:
                json.dump(settings, f, indent=2, sort_keys=True, default=str)
        shard = uuid.uuid4().hex
        digest = save_rows(os.path.join(folder, shard), vectors)
        hashes = [text_hash(t) for t in texts]
        with open(os.path.join(folder, f"{shard}.keys.tmp"), "w", encoding="utf-8") as f:
            json.dump({"rows_sha256": digest, "texts": hashes}, f)
        os.replace(os.path.join(folder, f"{shard}.keys.tmp"), os.path.join(folder, shard + KEYS_SUFFIX))
        if key in self._index:  # a rank that only writes (a sharded evaluation's worker) never reads the folder
            self.adopt(shard, texts, identity, settings)
        return shard

    def adopt(self, shard: str, texts: Sequence[str], identity: str, settings: dict) -> None:
        """Index a shard just written for ``texts`` (by this process, or by another rank of this run)."""
        index = self._load_index(settings_key(identity, settings))
        for row, text in enumerate(texts):
            index.setdefault(text_hash(text), (shard, row))

    def read(self, texts: Sequence[str], identity: str, settings: dict) -> np.ndarray:
        """The stored rows of ``texts``, in order (every one must be stored)."""
        key = settings_key(identity, settings)
        index = self._load_index(key)
        by_shard: dict[str, list[tuple[int, int]]] = {}
        for i, text in enumerate(texts):
            shard, row = index[text_hash(text)]
            by_shard.setdefault(shard, []).append((i, row))
        out: np.ndarray | None = None
        for shard, pairs in by_shard.items():
            data = np.load(os.path.join(self._folder(key), f"{shard}.npy"), mmap_mode="r")
            if out is None:
                out = np.empty((len(texts), data.shape[1]), dtype=np.float32)
            positions, rows = zip(*pairs, strict=True)
            out[list(positions)] = data[list(rows)]
        if out is None:
            return np.zeros((0, 0), dtype=np.float32)
        return out

    def get_or_encode(
        self,
        texts: Sequence[str],
        encode: Callable[[list[str]], np.ndarray],
        identity: str,
        settings: dict,
    ) -> np.ndarray:
        """Embeddings of ``texts`` in order; ``encode`` is called once, on the distinct missing texts only."""
        missing = self.missing(texts, identity, settings)
        if missing:
            self.write(missing, encode(missing), identity, settings)
        self.stats.count(len(texts) - len(missing), len(missing))
        logger.info("Embedding cache %s: %d texts from disk, %d encoded.",
                    settings_key(identity, settings), len(texts) - len(missing), len(missing))
        return self.read(texts, identity, settings)
