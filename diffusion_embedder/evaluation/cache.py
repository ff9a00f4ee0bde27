"""Document embeddings on disk, keyed by model identity, encoding settings and the text itself.

FollowIR scores the same corpus under original and changed instructions, BRIGHT domains are rerun
while tuning instructions, and an interrupted run restarts: none of that should re-encode documents.
One folder per (model identity, settings) key; inside, append-only shards of ``.npy`` rows with the
SHA-256 of each text beside them. A shard counts only once its key file exists (written last), so a
run killed mid-write leaves the cache valid.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

logger = logging.getLogger(__name__)


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
        if os.path.isdir(folder):
            for name in sorted(os.listdir(folder)):
                if not name.endswith(".keys.json"):
                    continue
                shard = name[: -len(".keys.json")]
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    hashes = json.load(f)
                for row, h in enumerate(hashes):
                    index.setdefault(h, (shard, row))
        self._index[key] = index
        return index

    def _write_shard(self, key: str, settings: dict, hashes: list[str], vectors: np.ndarray) -> None:
        folder = self._folder(key)
        os.makedirs(folder, exist_ok=True)
        meta_path = os.path.join(folder, "settings.json")
        if not os.path.exists(meta_path):
            with open(meta_path, "w", encoding="utf-8") as f:
                json.dump(settings, f, indent=2, sort_keys=True, default=str)
        shard = uuid.uuid4().hex
        tmp = os.path.join(folder, f"{shard}.tmp.npy")
        np.save(tmp, vectors.astype(np.float32, copy=False))
        os.replace(tmp, os.path.join(folder, f"{shard}.npy"))
        with open(os.path.join(folder, f"{shard}.keys.tmp"), "w", encoding="utf-8") as f:
            json.dump(hashes, f)
        os.replace(os.path.join(folder, f"{shard}.keys.tmp"), os.path.join(folder, f"{shard}.keys.json"))
        index = self._load_index(key)
        for row, h in enumerate(hashes):
            index.setdefault(h, (shard, row))

    def get_or_encode(
        self,
        texts: Sequence[str],
        encode: Callable[[list[str]], np.ndarray],
        identity: str,
        settings: dict,
    ) -> np.ndarray:
        """Embeddings of ``texts`` in order; ``encode`` is called once, on the distinct missing texts only."""
        key = settings_key(identity, settings)
        index = self._load_index(key)
        hashes = [text_hash(t) for t in texts]
        missing: dict[str, int] = {}
        for i, h in enumerate(hashes):
            if h not in index and h not in missing:
                missing[h] = i
        if missing:
            new = np.asarray(encode([texts[i] for i in missing.values()]), dtype=np.float32)
            if new.shape[0] != len(missing):
                raise ValueError(f"The encoder returned {new.shape[0]} rows for {len(missing)} texts.")
            self._write_shard(key, settings, list(missing), new)
        self.stats.hits += len(texts) - len(missing)
        self.stats.encoded += len(missing)
        self.stats.calls.append((len(texts) - len(missing), len(missing)))
        logger.info("Embedding cache %s: %d texts from disk, %d encoded.", key, len(texts) - len(missing), len(missing))
        by_shard: dict[str, list[tuple[int, int]]] = {}
        for i, h in enumerate(hashes):
            shard, row = index[h]
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
