"""Homogeneous batches: every optimizer step draws all its samples from one group (dataset or instruction).

In-batch negatives only make sense within a task, so LLM2Vec prepares the sample order itself and
trains with a sequential sampler. We do the same with a sampler that yields the full, precomputed
order.

Layout. Under the Hugging Face ``Trainer``, accelerate splits the sampler's order into per-device
batches ``b0, b1, b2, ...`` of ``per_device_batch_size`` and gives rank ``r`` batches
``b_r, b_{r+W}, b_{r+2W}, ...`` (W = world size). Micro-step ``s`` of every rank therefore reads
the consecutive batches ``b_{sW} .. b_{sW+W-1}``, and optimizer step ``k`` (``A`` accumulation
micro-steps) reads ``b_{kAW} .. b_{(k+1)AW-1}``: one consecutive block of ``W * A * per_device``
indices. So the order is made of consecutive blocks of that global size, each from one group:

* shuffle each group's indices, cut them into blocks of the global batch size, drop the incomplete
  tail of each group (logged), shuffle the blocks, concatenate.

``group_by="device"`` uses blocks of ``per_device_batch_size`` instead, which reproduces the
paper's fork (each rank, and each accumulation micro-step, may then see a different group).
``group_by="none"`` ignores the groups: every batch is a seeded draw from the whole dataset (Tevatron's and
sentence-transformers' default). Use it where a group holds many samples of the same target, so in-batch
"negatives" would often be positives: in ReasonAug 33-89% of a same-instruction batch of 32 shares its concept
with another query of the batch.
The order depends only on ``(seed, epoch)``; the Trainer calls ``set_epoch`` at each epoch, and
resuming replays the same order.
"""

from __future__ import annotations

import logging
import random
import typing
from collections.abc import Iterator, Sequence
from typing import Literal

from torch.utils.data import Sampler

logger = logging.getLogger(__name__)

GroupBy = Literal["global", "device", "none"]
GROUP_BY: tuple[str, ...] = typing.get_args(GroupBy)


def homogeneous_order(groups: Sequence[str], block_size: int, seed: int, epoch: int = 0) -> list[int]:
    """Indices into ``groups`` laid out in consecutive same-group blocks of ``block_size``.

    Incomplete blocks are dropped; raises if no group fills one block.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    rng = random.Random(f"homogeneous:{seed}:{epoch}")
    by_group: dict[str, list[int]] = {}
    for index, group in enumerate(groups):
        by_group.setdefault(group, []).append(index)
    blocks: list[list[int]] = []
    dropped: dict[str, int] = {}
    for group in sorted(by_group):
        indices = by_group[group]
        rng.shuffle(indices)
        full = len(indices) - len(indices) % block_size
        blocks.extend(indices[i : i + block_size] for i in range(0, full, block_size))
        if full < len(indices):
            dropped[group] = len(indices) - full
    if not blocks:
        sizes = {g: len(v) for g, v in sorted(by_group.items())}
        raise ValueError(f"no group has {block_size} samples to fill one batch; group sizes: {sizes}")
    if dropped and epoch == 0:
        logger.info(
            "homogeneous batching (block %d): dropped %d sample(s) that did not fill a block: %s",
            block_size,
            sum(dropped.values()),
            dropped,
        )
    rng.shuffle(blocks)
    return [i for block in blocks for i in block]


class HomogeneousSampler(Sampler[int]):
    """A sampler for the Trainer's training dataloader: one group per global batch.

    ``groups`` is the group key per dataset item (``ContrastiveDataset.groups``). Give the Trainer's
    ``per_device_train_batch_size``, ``world_size`` and ``gradient_accumulation_steps``; the order's
    length is a multiple of the global batch, so every rank gets the same number of full batches.
    """

    def __init__(
        self,
        groups: Sequence[str],
        per_device_batch_size: int,
        *,
        world_size: int = 1,
        gradient_accumulation_steps: int = 1,
        group_by: GroupBy = "global",
        seed: int = 42,
    ):
        for name, value in (
            ("per_device_batch_size", per_device_batch_size),
            ("world_size", world_size),
            ("gradient_accumulation_steps", gradient_accumulation_steps),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if group_by not in GROUP_BY:
            raise ValueError(f"group_by must be one of {', '.join(map(repr, GROUP_BY))}, got {group_by!r}")
        if group_by == "device":
            self.block_size = per_device_batch_size
        else:
            self.block_size = per_device_batch_size * world_size * gradient_accumulation_steps
        # "none": one group, so the order is a seeded shuffle of the whole dataset in full global batches.
        self.groups = [""] * len(groups) if group_by == "none" else list(groups)
        self.seed = seed
        self.epoch = 0
        self._order = homogeneous_order(self.groups, self.block_size, seed, 0)
        global_batch = per_device_batch_size * world_size * gradient_accumulation_steps
        if len(self._order) % global_batch:
            # group_by="device" with a block smaller than the global batch: trim the last partial step.
            self._order = self._order[: len(self._order) - len(self._order) % global_batch]
        self._length = len(self._order)
        if not self._length:
            raise ValueError(f"fewer than one global batch ({global_batch}) of samples after grouping")

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for ``epoch`` (called by accelerate's dataloader at each epoch)."""
        if epoch != self.epoch:
            self.epoch = epoch
            self._order = homogeneous_order(self.groups, self.block_size, self.seed, epoch)[: self._length]

    def __iter__(self) -> Iterator[int]:
        return iter(self._order)

    def __len__(self) -> int:
        return self._length
