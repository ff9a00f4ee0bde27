"""diffusion_embedder: language models (diffusion and autoregressive) as bidirectional text embedders."""

from importlib import import_module
from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["Encoder", "LLM2Vec", "load_backbone", "SUPPORTED_MODEL_TYPES"]

# Imported lazily so that light sub-packages (reasonaug, report) don't pay for torch + transformers.
_LAZY = {
    "Encoder": "diffusion_embedder.encoder",
    "LLM2Vec": "diffusion_embedder.encoder",
    "load_backbone": "diffusion_embedder.backbones",
    "SUPPORTED_MODEL_TYPES": "diffusion_embedder.backbones",
}

if TYPE_CHECKING:
    from diffusion_embedder.backbones import SUPPORTED_MODEL_TYPES, load_backbone
    from diffusion_embedder.encoder import Encoder, LLM2Vec


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'diffusion_embedder' has no attribute {name!r}")
