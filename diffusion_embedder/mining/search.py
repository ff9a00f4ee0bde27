"""Each query's best documents: two embedding stores in, ranked candidates out, one block of queries at a time.

The exact search scores a block of queries against a block of documents at a time with the encoder's similarity
function (float32, on the given device) and keeps a running top-k, so its memory is bounded by the two block
sizes and k, never by the corpus. ``--search faiss`` asks a FAISS index instead (``Flat`` is exact; any factory
string FAISS knows, trained on the corpus when it needs training); it holds the corpus in memory, as FAISS does.

Either way the candidates, a few more than asked for (``SLACK``), are scored again in float64 and ordered by
score, then by corpus position: float32 products in different orders (blocks, FAISS's kernels) differ in their
last bits, and this makes the ranking, and so the negatives, the same for both searches and for any block size.
Two candidates whose float64 scores are equal are a tie; the earlier document in the corpus ranks first.

With ``groups`` (a group per document: mining's documents of one normalized text), ``k`` counts groups: each
query gets its best documents up to its k-th distinct group, as sentence-transformers de-duplicates its corpus before
searching, so copies of a document do not use up the candidates.

The float32 search alone cannot promise that: where more than ``SLACK`` documents tie, or nearly tie, with a
query's k-th candidate (a document repeated many times in the corpus), it keeps an arbitrary few of them. So each
query's weakest float32 score is compared with its k-th float64 score, allowing twice the largest float32 rounding
measured in its block: where a document the search did not return could still reach the k-th place, that query
is searched again with twice as many candidates, until none could or the whole corpus was returned.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
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
           device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices of the ``k`` best documents of each query and their float32 scores (unordered among themselves):
    each block's top k merged into the running top k, so one block of scores is held at a time."""
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
    return best_indices, best_scores


#: FAISS's distances as the similarity's scores: its L2 metric gives squared distances; inner products are scores.
_FAISS_SCORES = {"cosine": lambda d: d, "dot": lambda d: d, "euclidean": lambda d: -np.sqrt(np.maximum(d, 0)),
                 "manhattan": lambda d: -d}


class _Faiss:
    """A FAISS index over the documents, built once, with the metric that ranks as ``similarity`` does."""

    def __init__(self, documents: EmbeddingStore, similarity: str, factory: str, block: int):
        import faiss

        self.faiss = faiss
        self.similarity = similarity
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

    def nearest(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``k`` nearest documents' indices (-1: none) and their float32 scores on the similarity's scale."""
        distances, indices = self.index.search(self._prepare(queries), k)
        return indices, _FAISS_SCORES[self.similarity](distances.astype(np.float64))


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


def repeats(keys: np.ndarray) -> np.ndarray:
    """(B, K): the entries whose key an earlier entry of the row already has."""
    order = np.argsort(keys, axis=1, kind="stable")
    ordered = np.take_along_axis(keys, order, 1)
    repeat = np.zeros(keys.shape, dtype=bool)
    repeat[:, 1:] = ordered[:, 1:] == ordered[:, :-1]
    out = np.zeros_like(repeat)
    np.put_along_axis(out, order, repeat, 1)
    return out


def _ranked(queries: np.ndarray, documents: EmbeddingStore, k: int, wide: int, similarity: str,
            nearest: Callable[[np.ndarray, int], tuple[np.ndarray, np.ndarray]],
            groups: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Each query's best documents and their float64 scores, ordered by score, then by corpus position: the first
    ``k`` (with ``groups``: up to the k-th distinct group; -1 and -inf pad the rows). ``nearest`` is asked for
    ``wide`` candidates, and again with twice as many for the queries where a document it did not return could
    still be among those, or whose candidates hold fewer than ``k`` groups."""
    found, rough = nearest(queries, wide)
    valid = found >= 0
    scores = score_pairs(queries, documents, found, similarity)
    rough = np.asarray(rough, dtype=np.float64)
    rounding = np.abs(rough - scores)[valid].max(initial=0.0)  # the float32 search's, measured on this block
    weakest = np.where(valid, rough, np.inf).min(1)
    # a row with fewer candidates than asked holds all that an approximate index finds: asking again is no use
    returned = valid.all(1)
    order = np.lexsort((np.where(valid, found, np.iinfo(np.int64).max), -scores), axis=-1)
    found, scores = np.take_along_axis(found, order, 1), np.take_along_axis(scores, order, 1)
    valid = found >= 0
    short = np.zeros(len(found), dtype=bool)
    if groups is None:
        need = np.minimum(k, valid.sum(1))
    else:
        unique = -1 - np.arange(found.shape[1], dtype=np.int64)
        count = np.cumsum(valid & ~repeats(np.where(valid, groups[np.maximum(found, 0)], unique)), axis=1)
        short = count[:, -1] < k
        need = np.where(short, valid.sum(1), np.argmax(count >= k, axis=1) + 1)
    width = max(int(need.max(initial=0)), 1)
    keep = np.arange(width) < need[:, None]
    indices = np.where(keep, found[:, :width], -1)
    best = np.where(keep, scores[:, :width], -np.inf)
    if wide < documents.num_rows:
        last = scores[np.arange(len(need)), np.maximum(need - 1, 0)]
        again = np.flatnonzero(returned & (short | (weakest + 2 * rounding >= last)))
        if again.size:
            wider = min(2 * wide, documents.num_rows)
            logger.info("%d queries: a document not among their %d candidates could still be among their first "
                        "%d%s (ties or near-ties, or copies); searched again with %d.", again.size, wide, k,
                        " distinct texts" if groups is not None else "", wider)
            more, more_scores = _ranked(queries[again], documents, k, wider, similarity, nearest, groups)
            width = max(width, more.shape[1])
            indices, best = _pad(indices, width, -1), _pad(best, width, -np.inf)
            indices[again], best[again] = _pad(more, width, -1), _pad(more_scores, width, -np.inf)
    return indices, best


def _pad(rows: np.ndarray, width: int, fill) -> np.ndarray:
    return np.pad(rows, ((0, 0), (0, width - rows.shape[1])), constant_values=fill)


def search(queries: EmbeddingStore, documents: EmbeddingStore, k: int, similarity: str, *, method: str = "exact",
           query_block: int = 1024, document_block: int = 16384, device: str | None = None,
           faiss_index: str = "Flat", groups: np.ndarray | None = None) -> Iterator[tuple[np.ndarray, Candidates]]:
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
    :param groups: a group per document (documents of one text): ``k`` then counts distinct groups, each row
        holding every document up to its k-th group (-1 pads the rows).
    """
    if queries.dim != documents.dim:
        raise ValueError(f"queries of dimension {queries.dim}, documents of dimension {documents.dim}")
    k = min(k, documents.num_rows)
    if method == "faiss":
        nearest = _Faiss(documents, similarity, faiss_index, document_block).nearest
    else:
        target = torch.device(device or "cpu")

        def nearest(rows: np.ndarray, wide: int) -> tuple[np.ndarray, np.ndarray]:
            found, rough = _exact(torch.from_numpy(rows).to(target), documents, wide, similarity, document_block,
                                  target)
            return found.cpu().numpy(), rough.cpu().numpy()

    for start, rows in queries.blocks(query_block):
        indices, scores = _ranked(rows, documents, k, min(k + SLACK, documents.num_rows), similarity, nearest,
                                  groups)
        yield rows, Candidates(start, indices, scores)
