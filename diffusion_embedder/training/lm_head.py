"""The LM stages' fused head (``fused_head``): the head and the cross-entropy at the positions the objective reads
only, instead of logits at every position.

An MNTP batch reads about a fifth of its positions (``mlm_probability``), so the plain path computes most of its
batch x length x vocabulary logits (151,936 columns for Qwen2.5 / Dream) for nothing and keeps them, with their
float32 copy, for the backward. The fused head computes the rows it needs; with ``use_liger_kernel`` Liger's fused
linear cross-entropy computes them chunk by chunk without ever holding them (its gradient in the same pass). The
loss is the objective's own (``objectives.Targets``), so both give the plain path's value.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from diffusion_embedder.objectives import Targets, reduce_targets, targets_loss
from diffusion_embedder.training.schema import ConfigError

HeadLoss = Callable[[torch.Tensor, nn.Module, Targets], torch.Tensor]


def plain_rows(rows: torch.Tensor, head: nn.Module, targets: Targets) -> torch.Tensor:
    """The head on the rows the loss reads, then the objective's loss."""
    return targets_loss(F.linear(rows, head.weight, head.bias), targets)


def liger_rows(rows: torch.Tensor, head: nn.Module, targets: Targets) -> torch.Tensor:
    """Liger's fused linear cross-entropy (per token, float32 accumulation), reduced as the objective does."""
    module = importlib.import_module("liger_kernel.transformers")
    fused = module.LigerFusedLinearCrossEntropyLoss(reduction="none")
    return reduce_targets(fused(head.weight, rows, targets.ids, head.bias).float(), targets)


def head_loss(use_liger_kernel: bool) -> HeadLoss:
    """The fused head's loss: Liger's kernel with ``use_liger_kernel`` (refused where it does not import), else
    the head on the needed rows."""
    if not use_liger_kernel:
        return plain_rows
    try:
        importlib.import_module("liger_kernel.transformers")
    except ImportError as err:
        raise ConfigError(f"fused_head with use_liger_kernel: true needs the liger-kernel package ({err}); pip "
                          "install 'diffusion-embedder[liger]', or set use_liger_kernel: false") from err  # fmt: skip
    return liger_rows
