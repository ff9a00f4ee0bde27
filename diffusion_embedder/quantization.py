"""Embedding precision (``float32``, ``int8``, ``uint8``, ``binary``, ``ubinary``) as sentence-transformers defines it.

``int8``/``uint8`` map each dimension's [min, max] over the embeddings of the call (or given ``ranges``) onto
256 buckets; ``binary``/``ubinary`` pack the signs into bits (8 dimensions per byte, ``binary`` offset by -128).
"""

from __future__ import annotations

import logging

import numpy as np

logger = logging.getLogger(__name__)

PRECISIONS = ("float32", "int8", "uint8", "binary", "ubinary")


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"Unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}.")
    return precision


def quantization_ranges(embeddings: np.ndarray, precision: str) -> np.ndarray:
    """Per-dimension [min; max] (2 x d) of the embeddings themselves: the buckets need more than one vector."""
    if embeddings.ndim == 1 or embeddings.shape[0] == 1:
        raise ValueError(
            f"Cannot compute {precision} quantization ranges from a single embedding; encode a representative "
            "batch or pass ranges computed from one."
        )
    if embeddings.shape[0] < 100:
        logger.warning("Computing %s quantization buckets from only %d embeddings.", precision, embeddings.shape[0])
    return np.vstack((embeddings.min(axis=0), embeddings.max(axis=0)))


def quantize_embeddings(embeddings: np.ndarray, precision: str, ranges: np.ndarray | None = None) -> np.ndarray:
    """Float embeddings (n x d) in ``precision``; int8/uint8 buckets come from ``ranges`` or the embeddings."""
    check_precision(precision)
    embeddings = np.asarray(embeddings)
    if embeddings.dtype in (np.int8, np.uint8):
        raise ValueError("Embeddings to quantize must be float, not int8 or uint8.")
    if precision == "float32":
        return embeddings.astype(np.float32)
    if precision in ("int8", "uint8"):
        ranges = (quantization_ranges(embeddings, precision) if ranges is None else ranges).astype(np.float32)
        starts = ranges[0]
        steps = (ranges[1] - starts) / 255
        steps = np.where(steps == 0, 1, steps)
        buckets = np.clip(np.floor((embeddings - starts) / steps), 0, 255)
        return buckets.astype(np.uint8) if precision == "uint8" else (buckets - 128).astype(np.int8)
    packed = np.packbits(embeddings > 0, axis=-1)
    return packed if precision == "ubinary" else (packed - 128).astype(np.int8)
