"""Tolerances from the arithmetic: norm-relative error in units of the compared dtype's epsilon.

Two float computations of the same quantity in different orders (batched vs one text, packed vs padded,
GradCache vs direct, two ranks vs one process, AVX-512 vs AVX2 kernels) differ by rounding, which scales
with the tensor's size, not with each element's: an element near zero can carry the rounding of its
large neighbours. So a comparison is ``||actual - expected|| / ||expected|| <= k * eps(dtype)``, with k
set from a measurement (each bound below says what was measured) and a margin for other machines. A real
bug (a dropped term, a wrong scale, a wrong span) moves the error by orders of magnitude more: about
1e-2 or worse, against bounds of at most a few thousand eps (a few 1e-4).

Set ``NUMERICS_LOG=/some/file`` to append every observed error (in eps) with its test: that is how the
bounds here were measured, and how to measure them on a new machine.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

# The bounds, in float32 eps, by kind of comparison; each says what was measured (AMD EPYC 2 cores, torch 2.13, ATen
# AVX2; the packing, backbone and linear-kernel files also under ATEN_CPU_CAPABILITY=default and oneDNN SSE4.1 on
# one thread) and leaves a margin for other kernels. A real bug is ~1e-2 (~1e5 eps).

#: The same float32 model and texts under another batch composition, padding, packing, chunking, device pool or
#: stream, or another kernel for the same product (rows: each text's vector). Measured: at most 3.6 eps (ATen AVX2),
#: 4.0 (packed vs padded, ATen default). 64 leaves 16x; it is 7.6e-6 relative, where the last token of each packed
#: text given its neighbour's position (a hand-made bug) measured 40,000 eps.
ORDER_EPS = 64
#: Our encoder against outputs stored from the reference implementations (LLM2Vec, Dream's and LLaDA's own
#: code, run elsewhere in float32), or a hand-written forward. Measured: at most 3.1 eps. 64 leaves 20x (the
#: atol=1e-4 it replaces allowed ~840 eps on unit-scale states).
REFERENCE_EPS = 64
#: A LoRA adapter merged into the weights (W + BA) against the unmerged adapter (Wx + BAx). Measured: at most 8.2.
MERGE_EPS = 64
#: Small computations (a pooling, a normalisation, a similarity, a loss) against the same done by hand, in
#: float32 or float64. Measured: at most 1.9 eps.
HAND_EPS = 16
#: A GradCache step against the direct step: the loss and each trainable gradient tensor. Measured: loss up to 3.5,
#: gradients 13.8 (ATen AVX2), 14.7 (ATen default) and 17.7 eps (ATen default, oneDNN SSE4.1, MKL SSE4.2, one
#: thread); the Intel AVX-512/AMX run where atol=1e-5 failed (3.8e-5 on gradients of 20-35) is ~1e-6 relative,
#: ~10 eps. 128 leaves ~7x. A cached gradient scaled by 1.001 (a wrong scale) measured 8,390 eps.
GRAD_EPS = 128

__all__ = [
    "GRAD_EPS", "HAND_EPS", "MERGE_EPS", "ORDER_EPS", "REFERENCE_EPS",
    "assert_all_close_normwise", "assert_close_normwise", "eps", "log_normwise", "normwise_error",
]


def eps(dtype: torch.dtype = torch.float32) -> float:
    return torch.finfo(dtype).eps


def _as_tensor(x) -> torch.Tensor:
    return torch.as_tensor(x).detach().to("cpu", torch.float64)


def normwise_error(actual, expected, rows: bool = False) -> float:
    """``||actual - expected|| / ||expected||`` in float64 (the absolute error where expected is zero); with
    ``rows``, the largest such error over the rows (the last dimension is a vector: one text's embedding)."""
    a, e = _as_tensor(actual), _as_tensor(expected)
    assert a.shape == e.shape, f"shapes differ: {tuple(a.shape)} vs {tuple(e.shape)}"
    if rows:
        a, e = a.reshape(-1, a.shape[-1]), e.reshape(-1, e.shape[-1])
        return max(normwise_error(x, y) for x, y in zip(a, e, strict=True))
    scale = e.norm().item()
    diff = (a - e).norm().item()
    return diff / scale if scale > 0 else diff


def _log(label: str, ratio: float, bound: float) -> None:
    path = os.environ.get("NUMERICS_LOG")
    if path:
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
        with open(path, "a") as f:
            f.write(f"{test}\t{label}\t{ratio:.3f}\t{bound:g}\n")


def log_normwise(
    actual, expected, *, dtype: torch.dtype = torch.float32, rows: bool = False, msg: object = ""
) -> float:
    """``normwise_error`` in eps of ``dtype``, logged to NUMERICS_LOG with no bound: what a comparison checked
    another way (a cosine) saw, from which its bound is to be set."""
    ratio = normwise_error(actual, expected, rows) / eps(dtype)
    _log(str(msg), ratio, float("nan"))
    return ratio


def assert_close_normwise(
    actual, expected, *, eps_multiple: float, dtype: torch.dtype = torch.float32, rows: bool = False, msg: object = ""
) -> None:
    """Assert ``normwise_error(actual, expected, rows) <= eps_multiple * eps(dtype)`` (shapes must match too)."""
    error = normwise_error(actual, expected, rows)
    ratio = error / eps(dtype)
    _log(str(msg), ratio, eps_multiple)
    assert ratio <= eps_multiple, (
        f"{msg}: norm-relative error {error:.3g} = {ratio:.1f} eps({dtype}) > bound {eps_multiple} eps"
    )


def assert_all_close_normwise(
    actual: dict | Sequence, expected: dict | Sequence, *, eps_multiple: float, dtype: torch.dtype = torch.float32,
    msg: object = "",
) -> None:
    """Every tensor of two dicts (same keys) or sequences (same length), each against its own norm."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), (msg, set(actual) ^ set(expected))
        pairs = [(name, actual[name], expected[name]) for name in expected]
    else:
        assert len(actual) == len(expected), msg
        pairs = [(i, a, e) for i, (a, e) in enumerate(zip(actual, expected, strict=True))]
    for name, a, e in pairs:
        assert_close_normwise(a, e, eps_multiple=eps_multiple, dtype=dtype, msg=f"{msg} {name}".strip())
