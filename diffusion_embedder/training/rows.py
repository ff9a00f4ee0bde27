"""Which rows a contrastive run trains on (padded or packed), and on which attention.

``pack_length: "auto"`` (the default) follows ``packing.AUTO_PACKING`` for the run's device and attention, as
``encode(packing="auto")`` does: on CUDA, packed rows of ``AUTO_PACK_LENGTH`` tokens where they run on the varlen
kernel (bf16/fp16 weights, torch >= 2.10, no attention dropout), else padded; on the CPU, padded. Packed rows on
CUDA of a model loaded with ``sdpa`` train on ``attn_implementation="varlen"`` for the whole run (the same
attention as sdpa's block mask, without the mask): every forward of the run, GradCache's two per chunk and
activation checkpointing's recomputation included, then runs the same kernel. Attention dropout (SimCSE's
``simcse_dropout``) has no varlen kernel: such a run keeps sdpa and its rows padded unless ``pack_length`` is given,
and a config naming ``varlen`` with it is refused. Every choice is logged.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from diffusion_embedder import packing, varlen
from diffusion_embedder.backbones import check_attention
from diffusion_embedder.training.schema import ConfigError

logger = logging.getLogger(__name__)

#: Row width of ``pack_length: "auto"`` (varlen has no mask, so a wide row costs nothing by itself; the row
#: bounds the tokens of one forward together with the batch size).
AUTO_PACK_LENGTH = packing.MAX_ROW_LENGTH["cuda"]


def _dropout_problem(config) -> str | None:
    dropout = getattr(config, "attention_dropout", 0.0) or 0.0
    if not dropout:
        return None
    return f"the model trains with attention dropout {dropout} (simcse_dropout), and the varlen kernel has none"


def varlen_problem(model: nn.Module) -> str | None:
    """Why a training forward of ``model`` cannot run on the varlen kernel; None when it can."""
    weight = model.get_input_embeddings().weight
    return (
        varlen.kernel_problem(weight.device, weight.dtype, varlen.head_dim(model.config))
        or varlen.config_problem(model.config)
        or _dropout_problem(model.config)
    )


def training_rows(pack_length: int | str | None, encoder: nn.Module) -> int | None:
    """The run's pack length (None: padded), resolved from the config's; switches packed sdpa rows on CUDA to varlen."""
    model = encoder.model
    impl = packing.attention_implementation(model)
    device = model.get_input_embeddings().weight.device.type
    if impl == varlen.NAME and _dropout_problem(model.config):
        raise ConfigError(f"attn_implementation: 'varlen' cannot train this model: {_dropout_problem(model.config)}; "
                          "use attn_implementation 'sdpa'.")
    auto = packing.AUTO_PACKING.get((device, impl), False)
    if pack_length == "auto":
        problem = varlen_problem(model) if auto == packing.VARLEN_KERNEL else None
        pack_length = AUTO_PACK_LENGTH if auto and problem is None else None
        rows = f"rows of {pack_length} tokens" if pack_length else "padded rows"
        logger.info("pack_length 'auto' on %s with %s attention: %s%s.", device, impl, rows,
                    f" ({problem})" if problem else "")
    if pack_length is not None and auto == packing.VARLEN_KERNEL:  # sdpa on CUDA: packed rows pay on varlen only
        problem = varlen_problem(model)
        if problem is None:
            model.config._attn_implementation = varlen.NAME
            check_attention(model, expect_bidirectional=encoder.config.enable_bidirectional)
            logger.info("Packed rows on CUDA: training on attn_implementation='varlen' (sdpa's attention, no mask).")
        else:
            logger.info("Packed rows keep sdpa's block mask: %s.", problem)
    return pack_length


def row_rules(values: dict[str, Any]) -> list[str]:
    """Varlen with SimCSE's attention dropout: refused before any model loads."""
    errors = []
    if values.get("attn_implementation") == varlen.NAME and values.get("simcse_dropout"):
        errors.append(f"attn_implementation: 'varlen' has no attention dropout, and simcse_dropout is "
                      f"{values['simcse_dropout']}; use attn_implementation 'sdpa' for SimCSE (its two views differ by "
                      "that dropout)")
    return errors
