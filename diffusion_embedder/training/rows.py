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


def _dropout_problem(config, simcse_dropout: float | None = None) -> str | None:
    """Why the model's attention dropout keeps a training forward off the varlen kernel, naming where it was set:
    SimCSE's ``simcse_dropout``, or the model's own config (LLaDA's default is 0.1 where config.json has none)."""
    dropout = getattr(config, "attention_dropout", 0.0) or 0.0
    if not dropout:
        return None
    if simcse_dropout:
        return f"simcse_dropout {simcse_dropout} is the model's attention dropout, and the varlen kernel has none"
    source = getattr(config, "_name_or_path", "") or "the model"
    return (f"the model's own config sets attention_dropout {dropout} ({source}/config.json), and the varlen kernel "
            "has none; set it to 0.0 there to train on varlen")


def varlen_problem(model: nn.Module, simcse_dropout: float | None = None) -> str | None:
    """Why a training forward of ``model`` cannot run on the varlen kernel; None when it can."""
    weight = model.get_input_embeddings().weight
    return (
        varlen.kernel_problem(weight.device, weight.dtype, varlen.head_dim(model.config))
        or varlen.config_problem(model.config)
        or _dropout_problem(model.config, simcse_dropout)
    )


def training_rows(pack_length: int | str | None, encoder: nn.Module, simcse_dropout: float | None = None) -> int | None:
    """The run's pack length (None: padded), resolved from the config's; switches packed sdpa rows on CUDA to varlen.
    ``simcse_dropout``: the run's, so a refusal names where the attention dropout comes from."""
    model = encoder.model
    impl = packing.attention_implementation(model)
    device = model.get_input_embeddings().weight.device.type
    dropout = _dropout_problem(model.config, simcse_dropout)
    if impl == varlen.NAME and dropout:
        raise ConfigError(f"attn_implementation: 'varlen' cannot train this model: {dropout}; or use "
                          "attn_implementation 'sdpa', which applies the dropout.")
    auto = packing.AUTO_PACKING.get((device, impl), False)
    if pack_length == "auto":
        problem = varlen_problem(model, simcse_dropout) if auto == packing.VARLEN_KERNEL else None
        pack_length = AUTO_PACK_LENGTH if auto and problem is None else None
        rows = f"rows of {pack_length} tokens" if pack_length else "padded rows"
        logger.info("pack_length 'auto' on %s with %s attention: %s%s.", device, impl, rows,
                    f" ({problem})" if problem else "")
    if pack_length is not None and auto == packing.VARLEN_KERNEL:  # sdpa on CUDA: packed rows pay on varlen only
        problem = varlen_problem(model, simcse_dropout)
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
