"""The one ``torch_dtype`` parser, shared by the encoder, the training config and the eval CLI.

Kept free of heavy imports so CLIs can list the choices without loading torch.
"""

from __future__ import annotations

from typing import Any

#: ``torch_dtype`` names accepted everywhere; "auto" keeps the checkpoint's dtype.
TORCH_DTYPES: tuple[str, ...] = ("auto", "bfloat16", "float16", "float32")


def resolve_dtype(value: Any) -> Any:
    """None is float32 (predictable on CPU); a name from ``TORCH_DTYPES`` or a floating ``torch.dtype`` is kept;
    anything else is a ValueError listing the choices."""
    import torch

    if value is None:
        return torch.float32
    if isinstance(value, torch.dtype) and value.is_floating_point:
        return value
    if isinstance(value, str) and value in TORCH_DTYPES:
        return value if value == "auto" else getattr(torch, value)
    raise ValueError(
        f"Invalid torch_dtype {value!r}; choose one of {', '.join(TORCH_DTYPES)} (or a floating torch.dtype)."
    )
