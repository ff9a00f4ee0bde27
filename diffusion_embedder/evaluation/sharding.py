"""One ``encode`` call cut into chunks, the chunks spread over torchrun's ranks; the encoder each rank loads.

``plan_chunks`` cuts a call's texts in order: at most ``chunk_size`` texts and about ``CHUNK_CHARS``
characters, so a few very long documents (LongEmbed's) still spread over the ranks. The plan depends on the
texts alone, never on the number of ranks, and a chunk is one ``Encoder.encode`` call. A text's vector can
change in its last bits with the batch it shares (measured: 2e-7 on CPU), so it is the same batches, not just
the same texts, that make the vectors of N ranks identical to those of one process.

Rank 0 runs mteb. In each of its encode calls it sends every rank its chunks (chunk ``i`` to rank
``i % world_size``; a scatter), encodes its own and collects the others' vectors (a gather). Documents are
stored in the embedding cache chunk by chunk by the rank that encoded them, so a rank that dies leaves only
complete shards and a rerun encodes what is missing. The other ranks wait in ``serve`` until rank 0 leaves
(``stop_workers``), finished or failed; a rank whose chunk fails sends the error through the gather, so no rank
is left waiting, and rank 0 raises it (mteb then records the task as failed and the run goes on).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from diffusion_embedder import distributed
from diffusion_embedder.evaluation.cache import KEYS_SUFFIX, EmbeddingCache, settings_key

logger = logging.getLogger(__name__)

#: Most texts in a chunk: large enough for full, length-sorted batches, small enough to share a call out.
CHUNK_SIZE = 1024
#: Most characters in a chunk (about 250k tokens), so 32k-token documents make chunks of a few.
CHUNK_CHARS = 2**20
#: What rank 0 sends instead of a job when it leaves.
STOP = "stop"


def text_length(item: str | Sequence[str]) -> int:
    """Characters of a text or of an ``[instruction, text]`` pair (the chunk plan's measure)."""
    return len(item) if isinstance(item, str) else sum(len(part) for part in item)


def plan_chunks(lengths: Sequence[int], chunk_size: int = CHUNK_SIZE,
                chunk_chars: int = CHUNK_CHARS) -> list[tuple[int, int]]:
    """``(start, end)`` of each chunk over texts of these lengths, in order; a text longer than
    ``chunk_chars`` is a chunk of its own."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an integer >= 1, got {chunk_size!r}.")
    chunks: list[tuple[int, int]] = []
    start = chars = 0
    for i, n in enumerate(lengths):
        if i > start and (i - start >= chunk_size or chars + n > chunk_chars):
            chunks.append((start, i))
            start, chars = i, 0
        chars += n
    if start < len(lengths):
        chunks.append((start, len(lengths)))
    return chunks


def load_checkpoint(base_model_name_or_path: str, peft_model_name_or_path: str | None = None,
                    torch_dtype: str | None = None, device: str | None = None, **overrides: Any):
    """The ``Encoder`` evaluation and corpus encoding use: the base with its adapter (if any) merged,
    ``overrides`` on its settings."""
    from diffusion_embedder import Encoder

    return Encoder.from_pretrained(
        base_model_name_or_path,
        peft_model_name_or_path=peft_model_name_or_path,
        merge_peft=peft_model_name_or_path is not None,
        torch_dtype=torch_dtype,
        device=device,
        **overrides,
    )


def encode_chunk(encoder, pairs: list, device: str | list[str] | None = None, **kwargs: Any) -> np.ndarray:
    """One chunk through ``encoder.encode``, as float32 rows; ``device`` None leaves encode's own choice."""
    if device is not None:
        kwargs["device"] = device
    return np.asarray(encoder.encode(pairs, convert_to_numpy=True, **kwargs), dtype=np.float32)


@dataclass
class _Store:
    """Where a rank stores the document chunks it encodes: the cache folder and the key's two parts."""

    root: str
    identity: str
    settings: dict


@dataclass
class _Job:
    """One rank's part of an encode call: its chunks (index, inputs), encode's settings, where to store."""

    chunks: list[tuple[int, list]]
    kwargs: dict
    store: _Store | None


@dataclass
class _Done:
    """What a rank sends back: each chunk's vectors and cache shard, or the error that stopped it."""

    vectors: dict[int, np.ndarray] = field(default_factory=dict)
    shards: dict[int, str] = field(default_factory=dict)
    error: str | None = None


def stop_workers() -> None:
    """Rank 0, on its way out (finished or failed): release the ranks waiting in ``serve``."""
    if distributed.is_distributed() and distributed.is_main():
        distributed.scatter([STOP] * distributed.world_size())


class ShardedEncoder:
    """An encoder's ``encode`` calls in chunks, over every rank of a torchrun job (or this process alone)."""

    def __init__(self, encoder, device: str | list[str] | None = None, chunk_size: int = CHUNK_SIZE):
        plan_chunks([], chunk_size)  # validates chunk_size
        self.encoder = encoder
        self.device = device
        self.chunk_size = chunk_size
        self._caches: dict[str, EmbeddingCache] = {}

    def encode(self, pairs: list, **kwargs: Any) -> np.ndarray:
        """The vectors of ``pairs`` in order (rank 0, or a lone process); ``kwargs`` go to ``Encoder.encode``."""
        if not pairs:
            return encode_chunk(self.encoder, pairs, self.device, **kwargs)
        return self._distribute(pairs, kwargs, None)

    def encode_documents(self, texts: list[str], cache: EmbeddingCache, identity: str, settings: dict,
                         **kwargs: Any) -> np.ndarray:
        """Document vectors through ``cache``: only missing texts are encoded, each chunk stored by its rank."""
        self._caches[cache.root] = cache
        if not texts:
            return cache.read(texts, identity, settings)
        missing = cache.missing(texts, identity, settings)
        fresh: dict[str, np.ndarray] = {}
        if missing:
            vectors = self._distribute([["", t] for t in missing], kwargs, _Store(cache.root, identity, settings))
            fresh = dict(zip(missing, vectors, strict=True))
        cache.stats.count(len(texts) - len(missing), len(missing))
        logger.info("Embedding cache %s: %d texts from disk, %d encoded.",
                    settings_key(identity, settings), len(texts) - len(missing), len(missing))
        stored = [t for t in texts if t not in fresh]
        rows = iter(cache.read(stored, identity, settings)) if stored else iter(())
        return np.stack([fresh[t] if t in fresh else next(rows) for t in texts])

    def serve(self) -> None:
        """Ranks other than 0: encode the chunks rank 0 sends until it says stop."""
        while True:
            job = distributed.scatter(None)
            if job == STOP:
                return
            distributed.gather(self._run(job))

    def _cache(self, root: str) -> EmbeddingCache:
        if root not in self._caches:
            self._caches[root] = EmbeddingCache(root)
        return self._caches[root]

    def _distribute(self, pairs: list, kwargs: dict, store: _Store | None) -> np.ndarray:
        chunks = plan_chunks([text_length(p) for p in pairs], self.chunk_size)
        world = distributed.world_size()
        quiet = {**kwargs, "show_progress_bar": False}
        jobs = [_Job([(i, pairs[s:e]) for i, (s, e) in enumerate(chunks) if i % world == r],
                     kwargs if r == 0 else quiet, store) for r in range(world)]
        done = distributed.gather(self._run(distributed.scatter(jobs)))
        errors = [f"rank {r}: {d.error}" for r, d in enumerate(done) if d.error]
        if errors:
            raise RuntimeError(f"Encoding failed on {len(errors)} rank(s): {'; '.join(errors)}")
        lost = sorted(set(range(len(chunks))).difference(*(d.vectors for d in done)))
        if lost:
            raise RuntimeError(f"Encoding chunk(s) {lost} came back from no rank.")
        out: np.ndarray | None = None
        for r, d in enumerate(done):
            for i, vectors in d.vectors.items():
                start, end = chunks[i]
                if out is None:
                    out = np.empty((len(pairs), vectors.shape[1]), dtype=np.float32)
                out[start:end] = vectors
                if store is not None and r != distributed.rank():
                    self._adopt(store, d.shards[i], [t for _, t in pairs[start:end]])
        if world > 1:
            counts = [sum(chunks[i][1] - chunks[i][0] for i in d.vectors) for d in done]
            logger.info("Encoded %d texts in %d chunks over %d ranks (texts per rank: %s).",
                        len(pairs), len(chunks), world, counts)
        return out

    def _adopt(self, store: _Store, shard: str, texts: list[str]) -> None:
        """Index another rank's shard, where this rank sees it (a shared file system), for later calls."""
        folder = os.path.join(store.root, settings_key(store.identity, store.settings))
        if os.path.exists(os.path.join(folder, shard + KEYS_SUFFIX)):
            self._cache(store.root).adopt(shard, texts, store.identity, store.settings)

    def _run(self, job: _Job) -> _Done:
        """Encode (and store) this rank's chunks; under torchrun an error is returned for rank 0 to raise."""
        done = _Done()
        try:
            chunks = job.chunks
            kwargs = job.kwargs
            if len(chunks) > 1 and kwargs.get("show_progress_bar"):
                from tqdm.auto import tqdm

                chunks = tqdm(chunks, desc="Encoding chunks")
                kwargs = {**kwargs, "show_progress_bar": False}
            for i, pairs in chunks:
                vectors = encode_chunk(self.encoder, pairs, self.device, **kwargs)
                if job.store is not None:
                    done.shards[i] = self._cache(job.store.root).write(
                        [t for _, t in pairs], vectors, job.store.identity, job.store.settings)
                done.vectors[i] = vectors
        except Exception as e:
            if not distributed.is_distributed():
                raise
            logger.exception("Encoding failed on %s", distributed.launch())
            done = _Done(error=f"{type(e).__name__}: {e}")
        return done
