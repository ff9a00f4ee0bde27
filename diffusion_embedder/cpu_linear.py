"""oneDNN for the linear layers of CPU inference: the same float32 maths, about 1.8x faster matmuls.

PyTorch's CPU wheels run ``nn.Linear`` through MKL's sgemm; on the AVX-512 machines we measured
(AMD EPYC, 2 threads) oneDNN's fp32 matmul, which PyTorch ships for its compiler, is about 1.8x
faster at the shapes an encoder runs (tokens x 256..4096), and a whole forward 1.4x faster, with
results equal to float32 rounding (max relative difference ~1e-6). ``encode`` therefore runs its
forwards inside :func:`onednn_linear` on CPU (bench/results/encode.md). The op has no autograd, so
training never uses it; it is only switched on under ``torch.inference_mode``/``no_grad``. The gated MLPs
of Llama, Mistral and Qwen2/3 (LLaDA and Dream run on these) also fuse their SiLU and product into the
matmuls (oneDNN post-ops), saving two passes over the widest activations.

A model whose layers ``compilation.compile_layers`` compiled keeps PyTorch's path (the compiler fuses them itself;
swapping their ``forward`` would make it recompile).

Set ``DIFFUSION_EMBEDDER_ONEDNN_LINEAR=0`` to keep PyTorch's own path. Where the op is missing, or
its first result disagrees with ``F.linear``, the default path is kept (logged once).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from diffusion_embedder.compilation import compiled_layers

logger = logging.getLogger(__name__)

ENV_SWITCH = "DIFFUSION_EMBEDDER_ONEDNN_LINEAR"
_checked: bool | None = None


#: transformers' MLP classes whose forward is ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``.
GATED_MLPS = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"})
SILU = frozenset({"SiLU", "SiLUActivation"})


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, post_op: str = "none") -> torch.Tensor:
    """``post_op(x @ weight.T + bias)``; ``"swish"`` is SiLU."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, post_op, [], "")


def _onednn_times(x: torch.Tensor, other: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """``(x @ weight.T + bias) * other`` in one pass."""
    return torch.ops.mkldnn._linear_pointwise.binary(x, other, weight, bias, "mul")


def _self_check() -> bool:
    generator = torch.Generator().manual_seed(0)
    x, w, b, other = (torch.randn(*shape, generator=generator) for shape in ((2, 5, 64), (48, 64), (48,), (2, 5, 48)))
    with torch.no_grad():
        return (
            torch.allclose(_onednn(x, w, b), F.linear(x, w, b), rtol=1e-4, atol=1e-5)
            and torch.allclose(_onednn(x, w, b, "swish"), F.silu(F.linear(x, w, b)), rtol=1e-4, atol=1e-5)
            and torch.allclose(_onednn_times(x, other, w, b), F.linear(x, w, b) * other, rtol=1e-4, atol=1e-5)
        )


def available() -> bool:
    """Whether the oneDNN op exists here and agrees with ``F.linear`` (checked once per process)."""
    global _checked
    if _checked is None:
        _checked = False
        op = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None
        if op is None:
            logger.info("oneDNN linear not available in this PyTorch build; using F.linear.")
        else:
            try:
                ok = _self_check()
            except RuntimeError as error:
                ok = False
                logger.info("oneDNN linear failed its self-check (%s); using F.linear.", error)
            _checked = bool(ok)
    return _checked


def wanted(device: torch.device) -> bool:
    return device.type == "cpu" and os.environ.get(ENV_SWITCH, "1") != "0" and available()


def _eligible(module: nn.Module) -> bool:
    """Plain float32 CPU linears whose ``forward`` nobody has replaced (accelerate's hooks do)."""
    return (
        type(module) is nn.Linear
        and "forward" not in module.__dict__
        and module.weight.dtype == torch.float32
        and module.weight.device.type == "cpu"
    )


def _fusable_mlp(module: nn.Module) -> bool:
    return (
        type(module).__name__ in GATED_MLPS
        and "forward" not in module.__dict__
        and type(getattr(module, "act_fn", None)).__name__ in SILU
        and all(_eligible(getattr(module, name, None)) for name in ("gate_proj", "up_proj", "down_proj"))
    )


def _gated_mlp(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    gate = _onednn(x, mlp.gate_proj.weight, mlp.gate_proj.bias, "swish")
    return mlp.down_proj(_onednn_times(x, gate, mlp.up_proj.weight, mlp.up_proj.bias))


#: Models switched now -> (blocks inside ``onednn_linear`` for it, layers switched, the modules switched): two
#: ``encode`` calls in two threads share one switch, undone when the last leaves.
_switched: dict[int, tuple[int, int, tuple[nn.Module, ...]]] = {}
_SWITCHING = threading.Lock()


@contextlib.contextmanager
def onednn_linear(model: nn.Module, device: torch.device) -> Iterator[int]:
    """Within the block, the model's plain float32 ``nn.Linear`` layers run on oneDNN (inference only).

    Yields how many layers were switched (0 when not on CPU, switched off, or unavailable).
    """
    if torch.is_grad_enabled():
        raise RuntimeError("onednn_linear is for inference: the oneDNN op has no gradient; use torch.no_grad()")
    switch = wanted(device) and not compiled_layers(model)  # a compiled layer is the compiler's to fuse
    with _SWITCHING:
        count, layers, switched = _switched.get(id(model), (0, 0, ()))
        if count == 0 and switch:
            mlps = [m for m in model.modules() if _fusable_mlp(m)]
            plain = [m for m in model.modules() if _eligible(m)]
            for mlp in mlps:
                mlp.forward = lambda x, mlp=mlp: _gated_mlp(mlp, x)
            for layer in plain:
                layer.forward = lambda x, layer=layer: _onednn(x, layer.weight, layer.bias)
            layers, switched = len(plain), (*mlps, *plain)
        if switched:
            _switched[id(model)] = (count + 1, layers, switched)
    try:
        yield layers
    finally:
        with _SWITCHING:
            if switched:
                count = _switched[id(model)][0] - 1
                if count:
                    _switched[id(model)] = (count, layers, switched)
                else:
                    del _switched[id(model)]
                    for module in switched:
                        del module.forward
