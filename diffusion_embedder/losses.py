"""Contrastive losses for supervised embedding training, correct under DDP.

Every loss returns the mean over the *global* batch (all queries on all ranks) and every rank
computes that same value: embeddings, or per-query losses, are gathered with
``all_gather_with_grad``. Its backward sums the gradient of the gathered tensor over ranks before
handing each rank its own slice, so a rank's local gradient is ``world_size`` times the gradient
of the global loss; DDP then averages parameter gradients over ranks, which cancels that factor
exactly. Without ``torch.distributed`` (or with one process) the gather is the identity and the
losses are the plain single-process computation.

Several hard negatives per query are all stacked into the candidate set (see
``HardNegativeNLLLoss``); ``RepllamaLoss`` scores each query against its own K negatives only.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from diffusion_embedder.values import checked

logger = logging.getLogger(__name__)

Negatives = torch.Tensor | Sequence[torch.Tensor] | None


def distributed_world() -> tuple[int, int]:
    """(rank, world_size) of the default process group, (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _AllGatherWithGrad(torch.autograd.Function):
    """Concatenate every rank's rows (sizes may differ); backward returns this rank's slice of the summed grad."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        rank, world = distributed_world()
        size = torch.tensor([tensor.shape[0]], dtype=torch.long, device=tensor.device)
        sizes = [torch.zeros_like(size) for _ in range(world)]
        dist.all_gather(sizes, size)
        counts = [int(s.item()) for s in sizes]
        padded = tensor.new_zeros((max(counts), *tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        gathered = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(gathered, padded)
        ctx.counts, ctx.rank = counts, rank
        return torch.cat([g[:n] for g, n in zip(gathered, counts, strict=True)], dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        start = sum(ctx.counts[: ctx.rank])
        return grad[start : start + ctx.counts[ctx.rank]]


def all_gather_with_grad(tensor: torch.Tensor) -> torch.Tensor:
    """All ranks' rows concatenated in rank order, differentiable; the identity without distributed.

    Ranks may hold different numbers of rows (padded to the largest, gathered, trimmed). Works on
    any backend (gloo on CPU, NCCL on GPU): tensors stay on the device they came from.
    """
    _, world = distributed_world()
    if world == 1:
        return tensor
    return _AllGatherWithGrad.apply(tensor.contiguous())


def _stack_negatives(negatives: Negatives, batch: int) -> torch.Tensor | None:
    """Negatives as a (B, K, d) tensor from None, (B, d), (B, K, d) or a list of K (B, d) tensors."""
    if negatives is None:
        return None
    if not isinstance(negatives, torch.Tensor):
        negatives = list(negatives)
        if not negatives:
            return None
        negatives = torch.stack(negatives, dim=1)
    if negatives.dim() == 2:
        negatives = negatives.unsqueeze(1)
    if negatives.dim() != 3 or negatives.shape[0] != batch:
        raise ValueError(
            f"Negatives must be (B, d), (B, K, d) or K tensors of (B, d) with B={batch} queries; "
            f"got shape {tuple(negatives.shape)}."
        )
    return negatives


class HardNegativeNLLLoss:
    """InfoNCE over cosine similarities times ``scale`` (50 = temperature 0.02, the paper's setting).

    The candidates of every query are all positives and all hard negatives of the global batch
    (every rank's, gathered with gradient); the target of query i is positive i. With K negatives
    per query all of them are stacked into the candidates (K=1 is upstream's setting).

    Args:
        scale: What the cosine similarities are multiplied by (1 / temperature); the config's ``loss_scale``.
    """

    def __init__(self, scale: float = 50.0):
        self.scale = scale

    def __call__(self, q_reps: torch.Tensor, d_reps_pos: torch.Tensor, d_reps_neg: Negatives = None) -> torch.Tensor:
        negatives = _stack_negatives(d_reps_neg, q_reps.shape[0])
        q = all_gather_with_grad(q_reps.float())
        candidates = [all_gather_with_grad(d_reps_pos.float())]
        if negatives is not None:
            candidates.append(all_gather_with_grad(negatives.float().flatten(0, 1)))
        docs = torch.cat(candidates, dim=0)
        scores = F.normalize(q, dim=-1) @ F.normalize(docs, dim=-1).T * self.scale
        labels = torch.arange(q.shape[0], device=scores.device)
        return F.cross_entropy(scores, labels)


class RepllamaLoss:
    """Dot-product softmax of each query over its positive and its K hard negatives (Tevatron / RepLLaMA).

    ``scale_by_dim`` multiplies every embedding by 1/sqrt(d), so logits are q.d / d (the paper's IF
    configs). ``in_batch_negatives`` adds every other passage of the batch as a candidate;
    ``cross_device_negatives`` (which needs in-batch negatives) gathers them from all ranks. Both
    are off by default as upstream. The returned value is always the mean over the global batch.

    Args:
        scale_by_dim: Multiply every embedding by 1/sqrt(d).
        in_batch_negatives: Add every other passage of the batch as a candidate.
        cross_device_negatives: Gather those passages from every rank (needs ``in_batch_negatives``).

    Raises:
        ValueError: ``cross_device_negatives`` without ``in_batch_negatives``.
    """

    @checked
    def __init__(
        self, scale_by_dim: bool = True, in_batch_negatives: bool = False, cross_device_negatives: bool = False
    ):
        if cross_device_negatives and not in_batch_negatives:
            raise ValueError("cross_device_negatives=True needs in_batch_negatives=True.")
        self.scale_by_dim = scale_by_dim
        self.in_batch_negatives = in_batch_negatives
        self.cross_device_negatives = cross_device_negatives

    def __call__(self, q_reps: torch.Tensor, d_reps_pos: torch.Tensor, d_reps_neg: Negatives = None) -> torch.Tensor:
        negatives = _stack_negatives(d_reps_neg, q_reps.shape[0])
        q, pos = q_reps.float(), d_reps_pos.float()
        passages = pos.unsqueeze(1) if negatives is None else torch.cat([pos.unsqueeze(1), negatives.float()], 1)
        if self.scale_by_dim:
            factor = 1.0 / math.sqrt(q.shape[-1])
            q, passages = q * factor, passages * factor
        if self.in_batch_negatives:
            group = passages.shape[1]
            flat = passages.flatten(0, 1)
            if self.cross_device_negatives:
                q, flat = all_gather_with_grad(q), all_gather_with_grad(flat)
            scores = q @ flat.T
            labels = torch.arange(q.shape[0], device=scores.device) * group
            per_query = F.cross_entropy(scores, labels, reduction="none")
            if self.cross_device_negatives:
                return per_query.mean()
        else:
            scores = torch.einsum("bd,bkd->bk", q, passages)
            labels = torch.zeros(q.shape[0], dtype=torch.long, device=scores.device)
            per_query = F.cross_entropy(scores, labels, reduction="none")
        return all_gather_with_grad(per_query).mean()


@dataclass(frozen=True)
class LossSpec:
    """A registered loss: its class and which training-config field feeds each constructor argument.

    Args:
        loss: The loss class.
        options: ``constructor argument -> training-config field``.
    """

    loss: type
    options: dict[str, str] = field(default_factory=dict)


#: ``loss_class`` values; adding a loss is one entry here (the training config's choices are read from it).
LOSSES: dict[str, LossSpec] = {
    "HardNegativeNLLLoss": LossSpec(HardNegativeNLLLoss, {"scale": "loss_scale"}),
    "RepllamaLoss": LossSpec(
        RepllamaLoss,
        {a: a for a in ("scale_by_dim", "in_batch_negatives", "cross_device_negatives")},
    ),
}


def loss_from_config(loss_class: str, settings: object) -> HardNegativeNLLLoss | RepllamaLoss:
    """The loss named ``loss_class`` with the options it registered, read from a config object's fields.

    Args:
        loss_class: A key of ``LOSSES``.
        settings: An object with the config's fields (e.g. ``CustomArguments``).

    Returns:
        The loss object, called as ``loss(q_reps, d_reps_pos, d_reps_neg)``.

    Raises:
        ValueError: A name ``LOSSES`` does not hold.
    """
    if loss_class not in LOSSES:
        raise ValueError(f"Unknown loss_class {loss_class!r}; choose one of {sorted(LOSSES)}.")
    spec = LOSSES[loss_class]
    return spec.loss(**{arg: getattr(settings, name) for arg, name in spec.options.items()})
