"""Liger Kernel on the backbone (the optional extra ``pip install 'diffusion-embedder[liger]'``): Triton kernels
for RMSNorm, rotary embeddings and the SwiGLU MLP, switched on by TrainingArguments' own ``use_liger_kernel``.

The Trainer applies Liger only to a ``PreTrainedModel`` (or peft around one) and only warns otherwise, so for our
``Encoder`` it would do nothing; this module applies it to the backbone under the adapter instead, and clears the
flag so the Trainer does not try again. Liger patches the family's classes in transformers (every model of that
family in the process), and the instance's modules. What cannot be honoured stops the run naming the field: the
package missing (it needs triton, so a CUDA machine) and a loss kernel asked for in ``liger_kernel_config`` (our LM
losses read the logits at the masked positions: Liger's fused linear cross-entropy is not wired to them) with the
config, before any model loads; a family Liger has no kernels for here once the model is loaded.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from torch import nn

from diffusion_embedder.training.schema import ConfigError

logger = logging.getLogger(__name__)

#: model_type -> Liger's function for that family (Dream loads as qwen2, LLaDA as llama).
LIGER_FAMILIES = {
    "llama": "apply_liger_kernel_to_llama",
    "mistral": "apply_liger_kernel_to_mistral",
    "qwen2": "apply_liger_kernel_to_qwen2",
    "qwen3": "apply_liger_kernel_to_qwen3",
    "gemma": "apply_liger_kernel_to_gemma",
    "gemma2": "apply_liger_kernel_to_gemma2",
}
KERNELS = {"rope": True, "rms_norm": True, "swiglu": True, "cross_entropy": False, "fused_linear_cross_entropy": False}
NOT_WIRED = ("cross_entropy", "fused_linear_cross_entropy")
INSTALL = "pip install 'diffusion-embedder[liger]' (liger-kernel needs triton, i.e. a CUDA machine)"


def config_problems(values: dict[str, Any]) -> list[str]:
    """A kernel of ``liger_kernel_config`` that is not wired to our losses, refused with the config (before any model
    loads; every stage's rules); ``apply_liger`` checks the family once the model is there."""
    options = values.get("liger_kernel_config")
    asked = [name for name in NOT_WIRED if isinstance(options, dict) and options.get(name)]
    if not asked:
        return []
    return [f"liger_kernel_config: {', '.join(asked)} is not wired to our losses (they read the logits at the "
            "masked positions); leave it false"]


def apply_liger(model: nn.Module, training_args) -> str | None:
    """Liger's kernels on ``model``'s backbone if ``use_liger_kernel``; returns the family function applied."""
    if not getattr(training_args, "use_liger_kernel", False):
        return None
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    model_type = base.config.model_type
    if model_type not in LIGER_FAMILIES:
        raise ConfigError(f"use_liger_kernel: Liger Kernel is not wired for the {model_type!r} family (wired: "
                          f"{', '.join(LIGER_FAMILIES)}); set use_liger_kernel: false")  # fmt: skip
    options = {**KERNELS, **(training_args.liger_kernel_config or {})}  # NOT_WIRED ones refused with the config
    try:
        module = importlib.import_module("liger_kernel.transformers")
    except ImportError as err:
        raise ConfigError(f"use_liger_kernel: true needs the liger-kernel package, which does not import here "
                          f"({err}); {INSTALL}, or set use_liger_kernel: false") from err  # fmt: skip
    name = LIGER_FAMILIES[model_type]
    getattr(module, name)(model=base, **options)
    training_args.use_liger_kernel = False  # applied here; the Trainer's own finds no PreTrainedModel in an Encoder
    logger.info("Liger Kernel on the %s backbone: %s(%s).", model_type, name,
                ", ".join(f"{k}={v}" for k, v in options.items()))  # fmt: skip
    return name
