"""Homogeneous batching: one group per optimizer step across ranks and accumulation, under accelerate's split."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from accelerate.data_loader import prepare_data_loader
from torch.utils.data import DataLoader

from diffusion_embedder.data import E5, HomogeneousSampler, ReasonAug, homogeneous_order

DATA = Path(__file__).parent / "fixtures" / "data"

# 5 groups of uneven sizes: remainders get dropped, small groups may vanish.
GROUPS = ["a"] * 37 + ["b"] * 50 + ["c"] * 9 + ["d"] * 24 + ["e"] * 3
GROUPS = [GROUPS[(i * 7) % len(GROUPS)] for i in range(len(GROUPS))]  # interleave (7 is coprime with 123)


def rank_batches(sampler, per_device: int, world_size: int) -> list[list[list[int]]]:
    """Per-rank lists of per-device batches, split by accelerate exactly as the Trainer's dataloader is."""
    loader = DataLoader(list(range(len(sampler.groups))), batch_size=per_device, sampler=sampler,
                        collate_fn=lambda items: items)
    out = []
    for rank in range(world_size):
        shard = prepare_data_loader(loader, num_processes=world_size, process_index=rank, put_on_device=False)
        shard.set_epoch(sampler.epoch)
        out.append(list(shard))
    return out


def optimizer_steps(per_rank: list[list[list[int]]], accumulation: int) -> list[list[int]]:
    """Indices consumed by each optimizer step: ``accumulation`` micro-batches on every rank."""
    n_micro = len(per_rank[0])
    assert all(len(batches) == n_micro for batches in per_rank), "ranks got different numbers of batches"
    assert n_micro % accumulation == 0, "a partial accumulation step at the end"
    return [
        [i for batches in per_rank for b in batches[k * accumulation : (k + 1) * accumulation] for i in b]
        for k in range(n_micro // accumulation)
    ]


@pytest.mark.parametrize(
    "world_size, per_device, accumulation", [(1, 4, 1), (2, 2, 2), (4, 1, 3), (3, 2, 1), (2, 3, 2)]
)
def test_every_optimizer_step_comes_from_one_group(world_size, per_device, accumulation):
    sampler = HomogeneousSampler(GROUPS, per_device, world_size=world_size,
                                 gradient_accumulation_steps=accumulation, seed=7)
    global_batch = world_size * per_device * accumulation
    steps = optimizer_steps(rank_batches(sampler, per_device, world_size), accumulation)
    assert all(len(step) == global_batch for step in steps)
    assert all(len({GROUPS[i] for i in step}) == 1 for step in steps)
    used = [i for step in steps for i in step]
    assert len(used) == len(set(used)) == len(sampler)  # each sample at most once per epoch
    sizes = Counter(GROUPS)
    assert Counter(GROUPS[i] for i in used) == {
        g: n - n % global_batch for g, n in sizes.items() if n >= global_batch
    }  # only incomplete tails are dropped
    # Steps are shuffled across groups, not one group after another.
    assert len(steps) > 2 and len({GROUPS[s[0]] for s in steps[: len(steps) // 2]}) > 1


def test_device_grouping_reproduces_the_fork():
    sampler = HomogeneousSampler(GROUPS, 2, world_size=2, gradient_accumulation_steps=2, group_by="device", seed=0)
    per_rank = rank_batches(sampler, 2, 2)
    assert all(len({GROUPS[i] for i in b}) == 1 for batches in per_rank for b in batches)
    steps = optimizer_steps(per_rank, 2)
    assert any(len({GROUPS[i] for i in step}) > 1 for step in steps)  # global batches mix groups
    assert len(sampler) % 8 == 0


def test_order_is_deterministic_per_seed_and_epoch():
    a = HomogeneousSampler(GROUPS, 2, world_size=2, seed=1)
    b = HomogeneousSampler(GROUPS, 2, world_size=2, seed=1)
    c = HomogeneousSampler(GROUPS, 2, world_size=2, seed=2)
    assert list(a) == list(b) and list(a) != list(c)
    first = list(a)
    a.set_epoch(1)
    second = list(a)
    assert second != first and len(second) == len(first)
    assert all(len({GROUPS[i] for i in second[k : k + 4]}) == 1 for k in range(0, len(second), 4))
    a.set_epoch(0)
    assert list(a) == first  # resuming replays the same order
    assert homogeneous_order(GROUPS, 4, seed=1, epoch=0) == first


def test_group_by_none_mixes_groups_in_full_global_batches():
    sampler = HomogeneousSampler(GROUPS, 4, world_size=2, gradient_accumulation_steps=2, group_by="none", seed=3)
    steps = optimizer_steps(rank_batches(sampler, 4, 2), 2)
    assert len(sampler) == len(GROUPS) - len(GROUPS) % 16 and all(len(step) == 16 for step in steps)
    used = [i for step in steps for i in step]
    assert len(set(used)) == len(used)
    assert sum(len({GROUPS[i] for i in step}) > 1 for step in steps) == len(steps)  # every step mixes groups
    again = HomogeneousSampler(GROUPS, 4, world_size=2, gradient_accumulation_steps=2, group_by="none", seed=3)
    assert list(again) == list(sampler)  # seeded: a resume replays the order
    again.set_epoch(1)
    assert list(again) != list(sampler)


def test_errors():
    with pytest.raises(ValueError, match="no group has 64 samples"):
        HomogeneousSampler(GROUPS, 8, world_size=8)
    with pytest.raises(ValueError, match="group_by must be one of 'global', 'device', 'none', got 'rank'"):
        HomogeneousSampler(GROUPS, 2, group_by="rank")
    with pytest.raises(ValueError, match="gradient_accumulation_steps must be >= 1"):
        HomogeneousSampler(GROUPS, 2, gradient_accumulation_steps=0)


@pytest.mark.parametrize("make, per_device, world_size", [
    (lambda: E5(DATA / "e5"), 1, 3),
    (lambda: ReasonAug(DATA / "reasonaug.jsonl"), 1, 2),
])
def test_with_real_readers(make, per_device, world_size):
    ds = make()
    sampler = HomogeneousSampler(ds.groups, per_device, world_size=world_size, seed=42)
    steps = optimizer_steps(rank_batches(sampler, per_device, world_size), 1)
    assert steps and all(len({ds[i].group for i in step}) == 1 for step in steps)
    full = {g for g, n in ds.group_sizes().items() if n >= per_device * world_size}
    assert {ds[i].group for step in steps for i in step} == full and len(full) > 1
