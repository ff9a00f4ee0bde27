"""Turns a list of ``TrainSample`` into tokenized features, one dict per text column.

Each column (queries, positives, the k-th negatives) is tokenized with ``Encoder.tokenize`` on
``[instruction, text]`` pairs, so the training text format is exactly the one used at encode time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from diffusion_embedder.packed_chunks import pack_chunks
from diffusion_embedder.values import AT_LEAST_ONE, AT_LEAST_ZERO, require

from .sample import Pair, TrainSample

Features = dict[str, torch.Tensor]
TokenizeFn = Callable[[list[list[str]]], Features]


class ContrastiveCollator:
    """``collate(samples) -> {"query": f, "positive": f, "negatives": ...}``.

    ``tokenizer``: an ``Encoder`` (its ``tokenize`` is used) or any function mapping a list of
    ``[instruction, text]`` pairs to a feature dict. Each sample contributes its first
    ``num_negatives`` negatives (an error names the sample's group if it has fewer); with
    ``num_negatives=0`` the output has no ``"negatives"`` key. ``"negatives"`` is one feature dict of
    ``B * num_negatives`` rows, sample-major (rows ``i*k .. i*k+k-1`` belong to sample ``i``), so
    ``embeddings.view(B, k, -1)`` gives the (B, K, d) negatives the losses take: one shape from the
    collator to the loss, whatever K is.

    ``pack_length``: padding-free training. Each column's texts are packed into rows of at most this
    many tokens (``diffusion_embedder.packing``; the callable is then called with ``pack_length=``);
    the encoder's forward gives the same embeddings, so losses and gradients are the padded path's.

    ``chunk_size`` (GradCache's texts per chunk, with ``pack_length``): each column is packed chunk by chunk
    (``packed_chunks.pack_chunks``), so GradCache cuts it into its chunks on the device without reading it back.
    """

    def __init__(
        self, tokenizer: Any, num_negatives: int = 1, pack_length: int | None = None, chunk_size: int | None = None
    ):
        require("num_negatives", num_negatives, int, bounds=AT_LEAST_ZERO)
        require("pack_length", pack_length, int | None, bounds=AT_LEAST_ONE)
        require("chunk_size", chunk_size, int | None, bounds=AT_LEAST_ONE)
        self.pack_length = pack_length
        self.chunk_size = chunk_size
        tokenize = getattr(tokenizer, "tokenize", tokenizer)
        if not callable(tokenize):
            raise TypeError(f"tokenizer must be an Encoder or a callable, got {type(tokenizer).__name__}")
        self.tokenize: TokenizeFn = tokenize
        self.num_negatives = num_negatives

    def _features(self, pairs: Sequence[Pair]) -> Features:
        if self.pack_length is None:
            return self.tokenize([list(p) for p in pairs])
        if self.chunk_size is None:
            return self.tokenize([list(p) for p in pairs], pack_length=self.pack_length)
        k = self.chunk_size
        chunks = [self.tokenize([list(p) for p in pairs[i : i + k]], pack_length=self.pack_length)
                  for i in range(0, len(pairs), k)]  # fmt: skip
        return pack_chunks(chunks)

    def __call__(self, samples: Sequence[TrainSample]) -> dict[str, Features]:
        if not samples:
            raise ValueError("cannot collate an empty batch")
        k = self.num_negatives
        for s in samples:
            if len(s.negatives) < k:
                raise ValueError(
                    f"a sample of group {s.group!r} has {len(s.negatives)} negative(s), the collator needs {k}"
                )
        batch: dict[str, Features] = {
            "query": self._features([s.query for s in samples]),
            "positive": self._features([s.positive for s in samples]),
        }
        if k == 0:
            return batch
        batch["negatives"] = self._features([n for s in samples for n in s.negatives[:k]])
        return batch
