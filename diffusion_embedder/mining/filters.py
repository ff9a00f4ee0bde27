"""The filters between a query's ranked candidates and its negatives: plain functions on a block of queries.

They have sentence-transformers' meanings (``util.mine_hard_negatives``, 6.2), in its order:

1. the query's known positives and its own text are removed (by group: every copy of the text), and a text that
   a better-ranked candidate already has (``duplicate``; sentence-transformers de-duplicates its corpus first, and
   the search counts distinct texts, so copies take no room from the window);
2. the score filters (``SCORE_FILTERS``), each where it is set: ``absolute_margin`` drops a candidate scoring
   above ``positive - margin``, ``relative_margin`` one scoring above ``positive - |positive| * margin`` (at 0.05,
   NV-Retriever's rule: at most 95% of a positive score), ``max_score`` one above it, ``min_score`` one below it;
   the positive score of a query with several positives is the lowest (the hardest positive);
3. what is left, best first, is ranked 0, 1, ...: ranks ``range_min`` .. ``range_max - 1`` are the window;
4. ``top`` takes the first ``num_negatives`` of the window; ``random`` draws ``num_negatives`` of it (each query
   from its own seeded stream, ``query_seed``) and orders them by score.

A dropped candidate is counted under the first reason that dropped it (``REASONS``).
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import Counter
from collections.abc import Callable

import numpy as np

from diffusion_embedder.mining.search import Candidates, repeats


def absolute_margin(scores: np.ndarray, positive: np.ndarray, margin: float) -> np.ndarray:
    return scores + margin > positive[:, None]


def relative_margin(scores: np.ndarray, positive: np.ndarray, margin: float) -> np.ndarray:
    return scores > (positive - np.abs(positive) * margin)[:, None]


def max_score(scores: np.ndarray, positive: np.ndarray, value: float) -> np.ndarray:
    return scores > value


def min_score(scores: np.ndarray, positive: np.ndarray, value: float) -> np.ndarray:
    return scores < value


#: Option name -> what it drops (``scores`` (B, K), the queries' positive scores (B,), the option's value), applied
#: in this order where the option is not None.
SCORE_FILTERS: dict[str, Callable[[np.ndarray, np.ndarray, float], np.ndarray]] = {
    "absolute_margin": absolute_margin,
    "relative_margin": relative_margin,
    "max_score": max_score,
    "min_score": min_score,
}
#: Why a candidate was dropped, in the order the reasons are checked.
REASONS = ("excluded", "duplicate", *SCORE_FILTERS, "range_min", "range_max", "not_sampled")
#: Every option the filters read (the mining manifest records them).
FILTER_OPTIONS = ("num_negatives", "range_min", "range_max", *SCORE_FILTERS, "sampling", "seed")


def query_seed(seed: int, instruction: str, text: str) -> int:
    """The seed of one query's draw: from ``--seed`` and the query itself, so it is the same in any order, block or
    shard."""
    digest = hashlib.sha256(json.dumps([seed, instruction, text], ensure_ascii=False).encode()).digest()
    return int.from_bytes(digest[:8], "big")


def sample_top(window: np.ndarray, n: int, seed: int) -> np.ndarray:
    return window[:n]


def sample_random(window: np.ndarray, n: int, seed: int) -> np.ndarray:
    picks = random.Random(seed).sample(range(len(window)), min(n, len(window)))
    return window[np.sort(np.asarray(picks, dtype=np.int64))]


#: ``--sampling`` -> (a row's window positions, best first; num_negatives; the query's seed) -> chosen positions.
SAMPLERS: dict[str, Callable[[np.ndarray, int, int], np.ndarray]] = {"top": sample_top, "random": sample_random}


def excluded(candidates: np.ndarray, groups: np.ndarray, excluded_groups: list[np.ndarray]) -> np.ndarray:
    """(B, K): candidates whose group is one their query excludes (-1 candidates are not)."""
    width = max(1, max(len(e) for e in excluded_groups))
    table = np.full((len(excluded_groups), width), -1, dtype=np.int64)
    for row, e in enumerate(excluded_groups):
        table[row, :len(e)] = e
    theirs = np.where(candidates >= 0, groups[np.maximum(candidates, 0)], -2)
    return (theirs[:, :, None] == table[:, None, :]).any(-1)


def duplicates(candidates: np.ndarray, groups: np.ndarray, alive: np.ndarray) -> np.ndarray:
    """(B, K): alive candidates whose group an earlier alive candidate of the row already has."""
    unique = -1 - np.arange(candidates.shape[1], dtype=np.int64)  # never equal to a group or to each other
    return repeats(np.where(alive, groups[np.maximum(candidates, 0)], unique))


def select(block: Candidates, groups: np.ndarray, excluded_groups: list[np.ndarray], positive: np.ndarray,
           seeds: list[int], options) -> tuple[list[np.ndarray], Counter]:
    """Each query's negatives: positions in its candidate row, best first; and the count of every dropped candidate
    by reason. ``options`` holds ``FILTER_OPTIONS`` (a ``MineArguments``)."""
    counts: Counter = Counter()
    alive = block.indices >= 0
    for reason, dropped in (("excluded", excluded(block.indices, groups, excluded_groups)),
                            ("duplicate", None)):
        dropped = duplicates(block.indices, groups, alive) if dropped is None else dropped & alive
        counts[reason] += int(dropped.sum())
        alive &= ~dropped
    for name, drops in SCORE_FILTERS.items():
        value = getattr(options, name)
        if value is not None:
            dropped = alive & drops(block.scores, positive, value)
            counts[name] += int(dropped.sum())
            alive &= ~dropped
    rank = np.cumsum(alive, axis=1) - 1
    counts["range_min"] += int((alive & (rank < options.range_min)).sum())
    counts["range_max"] += int((alive & (rank >= options.range_max)).sum())
    window = alive & (rank >= options.range_min) & (rank < options.range_max)
    sampler = SAMPLERS[options.sampling]
    chosen = [sampler(np.flatnonzero(row), options.num_negatives, seed)
              for row, seed in zip(window, seeds, strict=True)]
    counts["not_sampled"] += int(window.sum()) - sum(len(c) for c in chosen)
    return chosen, counts
