"""SimCSE's unsupervised data (``wiki1m_for_simcse.txt``): each sentence is its own positive.

The two views differ only by dropout (``simcse_dropout``), so a sample is the same text twice and has
no hard negative; the other sentences of the batch are the negatives.
"""

from __future__ import annotations

import os

from .sample import ContrastiveDataset, TrainSample
from .text import read_texts

#: Where SimCSE's authors publish the file; any local .txt (one sentence per line) works the same way.
WIKI1M_HUB_FILE = "hf://datasets/princeton-nlp/datasets-for-simcse/wiki1m_for_simcse.txt"


class Wiki1M(ContrastiveDataset):
    """One sample per non-blank line of a local file, or of the hub file through ``datasets``."""

    def __init__(self, path: str | os.PathLike = WIKI1M_HUB_FILE, *, skip_bad_lines: bool = False):
        path = os.fspath(path)
        if os.path.exists(path):
            texts = read_texts(train_files=[path])
        else:
            from datasets import load_dataset

            texts = [t for t in load_dataset("text", data_files=path, split="train")["text"] if t.strip()]
        samples = [TrainSample(query=("", t.strip()), positive=("", t.strip()), group="Wiki1M") for t in texts]
        super().__init__(samples, name=f"Wiki1M({path})")
