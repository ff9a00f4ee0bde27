"""Similarity functions by name, with sentence-transformers' names and definitions."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch


def _as_matrix(x: torch.Tensor | np.ndarray | list) -> torch.Tensor:
    """A float (n x d) tensor from a tensor, an array, a list of vectors or one vector."""
    if isinstance(x, list | tuple) and x and torch.is_tensor(x[0]):
        x = torch.stack(list(x))
    x = x if torch.is_tensor(x) else torch.as_tensor(np.asarray(x))
    x = x if x.is_floating_point() else x.float()
    return x.unsqueeze(0) if x.dim() == 1 else x


def cosine(a, b) -> torch.Tensor:
    a, b = _as_matrix(a), _as_matrix(b)
    return torch.nn.functional.normalize(a, dim=1) @ torch.nn.functional.normalize(b, dim=1).T


def dot(a, b) -> torch.Tensor:
    a, b = _as_matrix(a), _as_matrix(b)
    return a @ b.T


def euclidean(a, b) -> torch.Tensor:
    """Negative Euclidean distance (higher is more similar)."""
    return -torch.cdist(_as_matrix(a), _as_matrix(b), p=2.0)


def manhattan(a, b) -> torch.Tensor:
    """Negative Manhattan distance (higher is more similar)."""
    return -torch.cdist(_as_matrix(a), _as_matrix(b), p=1.0)


SIMILARITY_FUNCTIONS: dict[str, Callable[..., torch.Tensor]] = {
    "cosine": cosine,
    "dot": dot,
    "euclidean": euclidean,
    "manhattan": manhattan,
}


def check_similarity_fn_name(name: str) -> str:
    if name not in SIMILARITY_FUNCTIONS:
        raise ValueError(f"Unknown similarity_fn_name {name!r}; choose one of {', '.join(SIMILARITY_FUNCTIONS)}.")
    return name


def pairwise_cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (torch.nn.functional.normalize(a, dim=-1) * torch.nn.functional.normalize(b, dim=-1)).sum(-1)


def pairwise_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a * b).sum(-1)


def pairwise_euclidean(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return -(a - b).norm(dim=-1)


def pairwise_manhattan(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return -(a - b).abs().sum(-1)


#: The same functions on vectors paired one to one (sentence-transformers' ``similarity_pairwise``): tensors of
#: shape (..., d) broadcast against each other give (...) scores, e.g. queries (B, 1, d) with their own
#: candidates (B, K, d).
SIMILARITY_PAIRWISE: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "cosine": pairwise_cosine,
    "dot": pairwise_dot,
    "euclidean": pairwise_euclidean,
    "manhattan": pairwise_manhattan,
}
