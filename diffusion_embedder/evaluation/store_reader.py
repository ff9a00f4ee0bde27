"""An ``encode`` folder read block by block: the two embedding stores the hard-negative search takes.

``load_embeddings`` gives a whole folder as one matrix; a search over a large corpus needs only a block of it at a
time. ``EmbeddingStore`` checks every chunk once when it opens the folder (complete, intact, made under the
manifest's identity, rows in order) and then reads the rows a caller asks for from the chunk files, each read its
own copy, so memory holds the blocks in use and never the whole corpus.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np

from diffusion_embedder.evaluation.encode_corpus import FORMAT, MANIFEST, _check_chunk, chunk_name, identity
from diffusion_embedder.files import read_json_object


class EmbeddingStore:
    """The rows of a complete ``encode`` folder, in corpus order, read on demand.

    :param folder: the folder ``diffusion-embedder encode`` (or ``mine``) wrote; every chunk must be complete.
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
            record, rows = _check_chunk(folder, index, self.dim, made_by)
            del rows  # checked; read again where needed
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

    def _chunk_rows(self, index: int, start: int, end: int) -> np.ndarray:
        """Rows ``start .. end - 1`` of chunk ``index`` (chunk-relative), copied out of the file."""
        rows = np.load(os.path.join(self.folder, chunk_name(index) + ".npy"), mmap_mode="r")
        return np.array(rows[start:end], dtype=np.float32)

    def block(self, start: int, end: int) -> np.ndarray:
        """Rows ``start .. end - 1`` as one float32 array."""
        first = int(np.searchsorted(self._starts, start, side="right")) - 1
        parts = []
        index = first
        while index < len(self._starts) - 1 and self._starts[index] < end:
            lo, hi = self._starts[index], self._starts[index + 1]
            parts.append(self._chunk_rows(index, max(start, lo) - lo, min(end, hi) - lo))
            index += 1
        return np.concatenate(parts) if parts else np.zeros((0, self.dim), dtype=np.float32)

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
            rows = np.load(os.path.join(self.folder, chunk_name(int(index)) + ".npy"), mmap_mode="r")
            out[where] = rows[flat[where] - self._starts[index]]
        return out.reshape(*np.shape(indices), self.dim)
