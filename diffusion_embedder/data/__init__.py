"""Training data: one reader per format, homogeneous batching, and the contrastive collator.

Typical use (what ``training`` does)::

    ds = load_train_dataset("ReasonAug", "ReasonAug/ReasonAug_train.jsonl.gz", domain="all", task="all")
    sampler = HomogeneousSampler(ds.groups, per_device_batch_size=4, world_size=4,
                                 gradient_accumulation_steps=1, group_by="global", seed=42)
    collator = ContrastiveCollator(encoder, num_negatives=1)
"""

from __future__ import annotations

import difflib
import os
from typing import Any

from .batching import HomogeneousSampler, homogeneous_order
from .collator import ContrastiveCollator
from .custom import Custom
from .e5 import E5, E5_DATASETS, E5_INSTRUCTIONS
from .jsonl import DataFormatError
from .msmarco import MSMARCO, MSMARCO_HUB_NAME, MSMARCO_INSTRUCTION
from .reasonaug import ReasonAug
from .sample import ContrastiveDataset, Pair, TrainSample, train_instruction

#: ``dataset_name`` values (upstream names kept: ``E5Mix`` is the fork's ReasonAug loader).
DATASET_READERS: dict[str, type[ContrastiveDataset]] = {
    "E5": E5,
    "MSMARCO": MSMARCO,
    "ReasonAug": ReasonAug,
    "E5Mix": ReasonAug,
    "Custom": Custom,
}

#: Where each reader looks when no path is given.
DEFAULT_PATHS: dict[str, str] = {
    "E5": "cache/echo-data",
    "MSMARCO": MSMARCO_HUB_NAME,
    "ReasonAug": "ReasonAug/ReasonAug_train.jsonl.gz",
    "E5Mix": "ReasonAug/ReasonAug_train.jsonl.gz",
}

#: Negatives per sample each reader yields (what the collator's ``num_negatives`` should be).
READER_NEGATIVES: dict[str, int | None] = {"E5": 1, "MSMARCO": 15, "ReasonAug": 1, "E5Mix": 1, "Custom": None}


def load_train_dataset(dataset_name: str, path: str | os.PathLike | None = None, **options: Any) -> ContrastiveDataset:
    """Build the reader named ``dataset_name`` on ``path`` (its default when None) with its options."""
    if dataset_name not in DATASET_READERS:
        close = difflib.get_close_matches(dataset_name, DATASET_READERS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown dataset_name {dataset_name!r}{hint}; choose from {', '.join(DATASET_READERS)}")
    if path is None:
        if dataset_name not in DEFAULT_PATHS:
            raise ValueError(f"dataset_name {dataset_name!r} needs a data file path")
        path = DEFAULT_PATHS[dataset_name]
    return DATASET_READERS[dataset_name](path, **options)


__all__ = [
    "DATASET_READERS",
    "DEFAULT_PATHS",
    "E5",
    "E5_DATASETS",
    "E5_INSTRUCTIONS",
    "MSMARCO",
    "MSMARCO_HUB_NAME",
    "MSMARCO_INSTRUCTION",
    "READER_NEGATIVES",
    "ContrastiveCollator",
    "ContrastiveDataset",
    "Custom",
    "DataFormatError",
    "HomogeneousSampler",
    "Pair",
    "ReasonAug",
    "TrainSample",
    "homogeneous_order",
    "load_train_dataset",
    "train_instruction",
]
