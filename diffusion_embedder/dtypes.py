"""The one ``torch_dtype`` parser, shared by the encoder, the training config and the eval CLI.

Kept free of heavy imports so CLIs can list the choices without loading torch.
"""

from __future__ import annotations

from typing import Any

from diffusion_embedder.values import choice_problem

#: ``torch_dtype`` names accepted everywhere; "auto" keeps the checkpoint's dtype.
TORCH_DTYPES: tuple[str, ...] = ("auto", "bfloat16", "float16", "float32")


def resolve_dtype(value: Any) -> Any:
    """None is float32 (predictable on CPU); a name from ``TORCH_DTYPES`` or a floating ``torch.dtype`` is kept;
    anything else is a ValueError listing the choices (a name, in the words of every other choice's refusal)."""
    import torch

    if value is None:
        return torch.float32
    if isinstance(value, torch.dtype) and value.is_floating_point:
        return value
    if isinstance(value, str) and value in TORCH_DTYPES:
        return value if value == "auto" else getattr(torch, value)
    if isinstance(value, str):  # a name, as a config or a command line gives it
        raise ValueError(choice_problem("torch_dtype", value, TORCH_DTYPES))
    raise ValueError(f"torch_dtype: {value!r} is neither a floating torch.dtype nor one of {list(TORCH_DTYPES)}")
