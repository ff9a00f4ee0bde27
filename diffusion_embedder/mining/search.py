"""Each query's best documents: two embedding stores in, ranked candidates out, one block of queries at a time.

The exact search scores a block of queries against a block of documents at a time with the encoder's similarity
function (float32, on the given device) and keeps a running top-k, so its memory is bounded by the two block
sizes and k, never by the corpus. ``--search faiss`` asks a FAISS index instead (``Flat`` is exact; any factory
string FAISS knows, trained on the corpus when it needs training); it holds the corpus in memory, as FAISS does.

Either way the candidates, a few more than asked for (``SLACK``), are scored again in float64 and ordered by
score, then by corpus position: float32 products in different orders (blocks, FAISS's kernels) differ in their
last bits, and this makes the ranking, and so the negatives, the same for both searches and for any block size.
Two candidates whose float64 scores are equal are a tie; the earlier document in the corpus ranks first.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from diffusion_embedder.evaluation.store import EmbeddingStore
from diffusion_embedder.similarity import SIMILARITY_FUNCTIONS, SIMILARITY_PAIRWISE

logger = logging.getLogger(__name__)

#: Candidates taken beyond k before the float64 rescoring, so a candidate that float32 rounding moved just past
#: the k-th place is still seen.
SLACK = 16
#: Float64 values held at once by the rescoring (candidates x dimension x queries): 8 MiB per copy.
RESCORE_VALUES = 2**20


@dataclass
class Candidates:
    """A block of queries' candidates, best first: document indices (-1: none) and their float64 scores
    (-inf: none)."""

    start: int
    indices: np.ndarray
    scores: np.ndarray


def _exact(queries: torch.Tensor, documents: EmbeddingStore, k: int, similarity: str, block: int,
           device: torch.device) -> torch.Tensor:
    """Indices of the ``k`` best documents of each query (float32, unordered among themselves): each block's top k
    merged into the running top k, so one block of scores is held at a time."""
    best_scores = best_indices = None
    score = SIMILARITY_FUNCTIONS[similarity]
    for start, rows in documents.blocks(block):
        scores = score(queries, torch.from_numpy(rows).to(device))
        top_scores, top = torch.topk(scores, min(k, scores.shape[1]), dim=1)
        del scores
        top += start
        if best_scores is not None:
            top_scores, top = torch.cat([best_scores, top_scores], dim=1), torch.cat([best_indices, top], dim=1)
        best_scores, keep = torch.topk(top_scores, min(k, top_scores.shape[1]), dim=1)
        best_indices = torch.gather(top, 1, keep)
    return best_indices


class _Faiss:
    """A FAISS index over the documents, built once, with the metric that ranks as ``similarity`` does."""

    def __init__(self, documents: EmbeddingStore, similarity: str, factory: str, block: int):
        import faiss

        self.faiss = faiss
        self.normalize = similarity == "cosine"
        metrics = {"cosine": faiss.METRIC_INNER_PRODUCT, "dot": faiss.METRIC_INNER_PRODUCT,
                   "euclidean": faiss.METRIC_L2, "manhattan": faiss.METRIC_L1}
        self.index = faiss.index_factory(documents.dim, factory, metrics[similarity])
        if not self.index.is_trained:
            self.index.train(self._prepare(documents.block(0, documents.num_rows)))
        for _, rows in documents.blocks(block):
            self.index.add(self._prepare(rows))
        if hasattr(faiss, "get_num_gpus") and faiss.get_num_gpus() > 0:
            self.index = faiss.index_cpu_to_all_gpus(self.index)
        logger.info("FAISS index %r over %d documents (%s).", factory, self.index.ntotal, similarity)

    def _prepare(self, rows: np.ndarray) -> np.ndarray:
        rows = np.array(rows, dtype=np.float32, order="C")
        if self.normalize:
            self.faiss.normalize_L2(rows)
        return rows

    def nearest(self, queries: np.ndarray, k: int) -> np.ndarray:
        _, indices = self.index.search(self._prepare(queries), k)
        return indices


def score_pairs(queries: np.ndarray, documents: EmbeddingStore, indices: np.ndarray, similarity: str) -> np.ndarray:
    """Float64 scores of each query (row of ``queries``) with each of its documents (row of ``indices``; -1: none,
    scored -inf), in blocks that hold at most ``RESCORE_VALUES`` values."""
    pairwise = SIMILARITY_PAIRWISE[similarity]
    scores = np.full(indices.shape, -np.inf)
    rows = max(1, RESCORE_VALUES // max(1, indices.shape[1] * documents.dim))
    for lo in range(0, indices.shape[0], rows):
        part = indices[lo:lo + rows]
        valid = part >= 0
        vectors = torch.from_numpy(documents.take(np.where(valid, part, 0))).double()
        query = torch.from_numpy(queries[lo:lo + rows]).double().unsqueeze(1)
        scores[lo:lo + rows] = np.where(valid, pairwise(query, vectors).numpy(), -np.inf)
    return scores


def rescore(queries: np.ndarray, documents: EmbeddingStore, indices: np.ndarray, similarity: str,
            k: int) -> tuple[np.ndarray, np.ndarray]:
    """The candidates ``indices`` (rows: queries; -1: none) scored in float64 and ordered by score, then by corpus
    position; the first ``k`` of each row."""
    scores = score_pairs(queries, documents, indices, similarity)
    position = np.where(indices >= 0, indices, np.iinfo(np.int64).max)
    order = np.lexsort((position, -scores), axis=-1)[:, :k]
    return np.take_along_axis(indices, order, 1), np.take_along_axis(scores, order, 1)


def search(queries: EmbeddingStore, documents: EmbeddingStore, k: int, similarity: str, *, method: str = "exact",
           query_block: int = 1024, document_block: int = 16384, device: str | None = None,
           faiss_index: str = "Flat") -> Iterator[tuple[np.ndarray, Candidates]]:
    """The ``k`` best documents of every query, best first, one block of ``query_block`` queries at a time: the
    block's query vectors and its candidates.

    :param queries: the queries' store.
    :param documents: the documents' store.
    :param k: candidates per query (at most the number of documents are found).
    :param similarity: a ``similarity.SIMILARITY_FUNCTIONS`` name (the encoder's).
    :param method: ``exact`` or ``faiss``.
    :param query_block: queries scored at once.
    :param document_block: documents scored at once (exact), or added to the index at once (FAISS).
    :param device: where the exact search runs (default: CPU).
    :param faiss_index: the FAISS index factory string.
    """
    if queries.dim != documents.dim:
        raise ValueError(f"queries of dimension {queries.dim}, documents of dimension {documents.dim}")
    k = min(k, documents.num_rows)
    wide = min(k + SLACK, documents.num_rows)
    index = _Faiss(documents, similarity, faiss_index, document_block) if method == "faiss" else None
    target = torch.device(device or "cpu")
    for start, rows in queries.blocks(query_block):
        if index is not None:
            found = index.nearest(rows, wide)
        else:
            found = _exact(torch.from_numpy(rows).to(target), documents, wide, similarity, document_block,
                           target).cpu().numpy()
        indices, scores = rescore(rows, documents, found, similarity, k)
        yield rows, Candidates(start, indices, scores)
