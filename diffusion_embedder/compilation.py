"""Regional ``torch.compile``: each decoder layer compiled once, for ``encode(..., compile=True)`` and the
training stages' ``compile_layers`` field.

Compiling the repeated block rather than the whole model keeps the compile time to one layer's (the layers share
their code, so dynamo compiles one graph and reuses it with each layer's weights) and leaves the Python around the
layers (pooling, packing, GradCache, the loss) as it is. Shapes are dynamic from the first call, so batches of other
lengths and row counts reuse the graph instead of recompiling per batch (packed rows on CUDA also come in powers of
two, ``packing.BOUNDED_SHAPES``). Off by default: compiling costs seconds to minutes and pays only over many batches
(``bench/results/encode.md``). ``encode(compile=True)`` is refused where it cannot pay (``encode_problem``).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from diffusion_embedder import varlen

logger = logging.getLogger(__name__)

#: The compiler backend (tests set "aot_eager": the same graphs, traced without inductor's code generation).
BACKEND = "inductor"
#: Set on a layer once compiled, so a second request (another encode call) compiles nothing again.
COMPILED = "_compiled_by_diffusion_embedder"
#: Device types where ``encode(compile=True)`` is refused, and why (measured; bench/results/encode.md).
REFUSED_ON = {
    "cpu": "on the CPU compiled layers ran no faster than eager ones (0.6-1.3x the eager calls over four lengths, "
           "after a first call of 104 s that compiled; bench/results/encode.md), so compiling there only costs time; "
           "compile on CUDA",
}  # fmt: skip


def encode_problem(model: nn.Module, device: torch.device) -> str | None:
    """Why ``encode(compile=True)`` is refused for ``model`` on ``device``; None when it compiles.

    Refused on the devices of ``REFUSED_ON``, and for ``attn_implementation="varlen"`` where its kernel does not
    run: the reference path attends one text at a time over offsets read on the host, so every layer's graph
    breaks there and a new length compiles again.
    """
    if device.type in REFUSED_ON:
        return REFUSED_ON[device.type]
    config = model.config
    if getattr(config, "_attn_implementation", None) == varlen.NAME:
        weight = model.get_input_embeddings().weight
        problem = varlen.kernel_problem(device, weight.dtype, varlen.head_dim(config))
        if problem:
            return (f"attn_implementation='varlen' runs its reference path here ({problem}), which attends one text "
                    "at a time over offsets read on the host: every compiled layer would break its graph there; "
                    f"load the model for the kernel ({varlen.FAST}) or with attn_implementation='sdpa'")
    return None


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks (transformers' checkpointable layers), in order."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def compile_layers(model: nn.Module, backend: str | None = None) -> int:
    """Compile every decoder layer of ``model`` in place (``nn.Module.compile``, dynamic shapes); returns how many
    layers are compiled. A model without such layers is refused: nothing would be compiled."""
    backend = backend or BACKEND
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"compile: {type(model).__name__} has no decoder layers to compile")
    fresh = [layer for layer in layers if not getattr(layer, COMPILED, False)]
    for layer in fresh:
        layer.compile(backend=backend, dynamic=True)
        setattr(layer, COMPILED, True)
    if fresh:
        logger.info("Compiling %d decoder layers (torch.compile, backend %s, dynamic shapes) on first use.",
                    len(fresh), backend)  # fmt: skip
    return len(layers)


def compiled_layers(model: nn.Module) -> int:
    """How many of ``model``'s decoder layers ``compile_layers`` compiled."""
    return sum(bool(getattr(layer, COMPILED, False)) for layer in decoder_layers(model))


def uncompile_layers(model: nn.Module) -> None:
    """Run ``model``'s decoder layers eagerly again (what ``compile_layers`` did, undone): a benchmark compares the
    compiled layers with the same model object's eager ones."""
    for layer in decoder_layers(model):
        if getattr(layer, COMPILED, False):
            layer._compiled_call_impl = None  # what ``nn.Module.compile`` set
            delattr(layer, COMPILED)
