"""SimCSE's unsupervised data (``wiki1m_for_simcse.txt``): each sentence is its own positive.

The two views differ only by dropout (``simcse_dropout``), so a sample is the same text twice and has
no hard negative; the other sentences of the batch are the negatives.
"""

from __future__ import annotations

import os

from diffusion_embedder.files import check_file

from .hub import load_with_datasets
from .sample import ContrastiveDataset, TrainSample
from .text import read_texts

#: Where SimCSE's authors publish the file; any local .txt (one sentence per line) works the same way.
WIKI1M_HUB_FILE = "hf://datasets/princeton-nlp/datasets-for-simcse/wiki1m_for_simcse.txt"


class Wiki1M(ContrastiveDataset):
    """One sample per non-blank line of a local file, or of a URL (the hub file) through ``datasets``."""

    def __init__(self, path: str | os.PathLike = WIKI1M_HUB_FILE, *, skip_bad_lines: bool = False):
        path = os.fspath(path)
        if "://" in path:
            local = "dataset_file_path: a local copy of the file (one sentence per line)"
            rows = load_with_datasets(f"Wiki1M file {path!r}", "text", data_files=path, split="train", local=local)
            texts = [t for t in rows["text"] if t.strip()]
        else:
            check_file(path, "Wiki1M file (dataset_file_path)")
            texts = read_texts(train_files=[path])
        samples = [TrainSample(query=("", t.strip()), positive=("", t.strip()), group="Wiki1M") for t in texts]
        super().__init__(samples, name=f"Wiki1M({path})")
