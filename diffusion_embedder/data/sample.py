"""The sample type every reader produces, and the dataset that holds them.

Texts stay ``(instruction, text)`` pairs: ``Encoder.tokenize`` joins them the LLM2Vec way
(``instruction.strip() + " " + text``), so a training instruction ``"Given a claim, ...;"`` yields the
upstream string ``"Given a claim, ...; <text>"``. Documents carry an empty instruction.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

from torch.utils.data import Dataset

logger = logging.getLogger(__name__)

Pair = tuple[str, str]


def train_instruction(instruction: str) -> str:
    """Upstream training format: the instruction followed by ``;`` (``"<inst>; <text>"`` once joined)."""
    return f"{instruction};"


@dataclass
class TrainSample:
    """One training example; ``group`` is the key that homogeneous batching keeps together."""

    query: Pair
    positive: Pair
    negatives: list[Pair] = field(default_factory=list)
    group: str = ""


class ContrastiveDataset(Dataset):
    """A list of ``TrainSample`` in reader order; ordering for training is the sampler's job."""

    def __init__(self, samples: list[TrainSample], name: str, num_bad_records: int = 0):
        if not samples:
            raise ValueError(f"{name}: no training samples were read")
        self.samples = samples
        self.name = name
        #: records skipped as malformed (``skip_bad_lines=True``)
        self.num_bad_records = num_bad_records
        sizes = self.group_sizes()
        logger.info("%s: %d samples in %d group(s)", name, len(samples), len(sizes))

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> TrainSample:
        return self.samples[index]

    @property
    def groups(self) -> list[str]:
        """Group key per sample, in dataset order (what ``HomogeneousSampler`` needs)."""
        return [s.group for s in self.samples]

    def group_sizes(self) -> dict[str, int]:
        return dict(Counter(self.groups))
