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
from dataclasses import dataclass
from typing import Any

from .batching import HomogeneousSampler, homogeneous_order
from .collator import ContrastiveCollator
from .custom import Custom
from .e5 import E5, E5_DATASETS, E5_INSTRUCTIONS
from .jsonl import DataFormatError
from .msmarco import MSMARCO, MSMARCO_HUB_NAME, MSMARCO_INSTRUCTION, MSMARCO_INSTRUCTION_NEGATIVES
from .reasonaug import ReasonAug
from .sample import ContrastiveDataset, Pair, TrainSample, train_instruction
from .text import TextBlocks, load_text_blocks, read_texts
from .wiki1m import WIKI1M_HUB_FILE, Wiki1M


@dataclass(frozen=True)
class ReaderSpec:
    """A registered training-set reader: its class, where it looks by default, its negatives per sample,
    and which config options (``DataArguments`` fields, plus ``seed``) it takes."""

    reader: type[ContrastiveDataset]
    default_path: str | None
    #: hard negatives per sample it yields by default (0: in-batch negatives only)
    negatives: int
    options: tuple[str, ...] = ()
    #: the fewest hard negatives its samples can hold (MSMARCO's always include its instruction negatives)
    min_negatives: int = 0
    #: the ``DataArguments`` field holding its path (ReasonAug's upstream name is ``aug_file_path``)
    path_field: str = "dataset_file_path"

    @property
    def fixed_negatives(self) -> bool:
        """True when the data has exactly ``negatives`` per sample (no ``num_negatives`` option)."""
        return "num_negatives" not in self.options


_REASONAUG = ReaderSpec(
    ReasonAug, "ReasonAug/ReasonAug_train.jsonl.gz", 1, ("domain", "task"), path_field="aug_file_path"
)

#: ``dataset_name`` values (upstream names kept: ``E5Mix`` is the fork's ReasonAug loader). Adding a
#: reader is one entry here.
DATASET_READERS: dict[str, ReaderSpec] = {
    "E5": ReaderSpec(E5, "cache/echo-data", 1),
    "MSMARCO": ReaderSpec(MSMARCO, MSMARCO_HUB_NAME, 15, ("num_negatives", "seed"),
                          min_negatives=MSMARCO_INSTRUCTION_NEGATIVES),
    "ReasonAug": _REASONAUG,
    "E5Mix": _REASONAUG,
    "Custom": ReaderSpec(Custom, None, 1, ("num_negatives",)),
    "Wiki1M": ReaderSpec(Wiki1M, WIKI1M_HUB_FILE, 0),
}


def load_train_dataset(dataset_name: str, path: str | os.PathLike | None = None, **options: Any) -> ContrastiveDataset:
    """Build the reader named ``dataset_name`` on ``path`` (its default when None) with its options."""
    if dataset_name not in DATASET_READERS:
        close = difflib.get_close_matches(dataset_name, DATASET_READERS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown dataset_name {dataset_name!r}{hint}; choose from {', '.join(DATASET_READERS)}")
    spec = DATASET_READERS[dataset_name]
    if path is None:
        if spec.default_path is None:
            raise ValueError(f"dataset_name {dataset_name!r} needs a data file path")
        path = spec.default_path
    return spec.reader(path, **options)


__all__ = [
    "DATASET_READERS",
    "E5",
    "E5_DATASETS",
    "E5_INSTRUCTIONS",
    "MSMARCO",
    "MSMARCO_HUB_NAME",
    "MSMARCO_INSTRUCTION",
    "WIKI1M_HUB_FILE",
    "ReaderSpec",
    "TextBlocks",
    "Wiki1M",
    "load_text_blocks",
    "read_texts",
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
