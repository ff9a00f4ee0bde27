"""Plain text for the language-model stages (MNTP, masked diffusion, causal LM) and SimCSE.

Texts come from a hub dataset through ``datasets`` (upstream MNTP: ``wikitext`` /
``wikitext-103-raw-v1``) or from local files: ``.txt`` (one text per line), ``.jsonl`` / ``.json``
(one object per line with a text field), optionally gzipped. For the LM stages they are tokenized,
concatenated and cut into blocks of ``max_seq_length`` tokens (the remainder dropped), as
``run_mntp.py`` does.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterator, Sequence
from itertools import chain

import torch

from diffusion_embedder.files import check_file, read_text_lines

from .hub import load_with_datasets
from .jsonl import DataFormatError

logger = logging.getLogger(__name__)


def _file_texts(path: str, text_column: str) -> Iterator[str]:
    """Non-blank texts of one local file; a bad JSON line or a missing field names the file and line."""
    stem = path[:-3] if path.endswith(".gz") else path
    is_json = stem.endswith((".jsonl", ".json"))
    for number, line in read_text_lines(path, DataFormatError, "train_file"):
        if not line.strip():
            continue
        if not is_json:
            yield line
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataFormatError(f"{path}:{number}: not valid JSON ({err.msg})") from err
        text = record.get(text_column) if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise DataFormatError(f"{path}:{number}: no string field {text_column!r}")
        if text.strip():
            yield text


def read_texts(
    dataset_name: str | None = None,
    dataset_config_name: str | None = None,
    train_files: Sequence[str] = (),
    text_column: str = "text",
    split: str = "train",
) -> list[str]:
    """Every non-blank text of a hub dataset (``dataset_name``) or of local ``train_files``."""
    if bool(dataset_name) == bool(train_files):
        raise ValueError("give either dataset_name (a hub dataset) or train_file (local files), not both or neither")
    if dataset_name:
        config = f" (config {dataset_config_name!r})" if dataset_config_name else ""
        dataset = load_with_datasets(
            f"dataset_name {dataset_name!r}{config}",
            dataset_name,
            dataset_config_name,
            split=split,
            local="train_file (local .txt, .jsonl or .json files, optionally .gz) instead of dataset_name",
        )
        if text_column not in dataset.column_names:
            raise DataFormatError(f"{dataset_name}: no column {text_column!r} (columns: {dataset.column_names})")
        return [t for t in dataset[text_column] if t and t.strip()]
    texts: list[str] = []
    for path in train_files:
        check_file(path, "train_file")  # every file before reading the first
    for path in train_files:
        texts.extend(_file_texts(path, text_column))
    if not texts:
        raise DataFormatError(f"no text in {list(train_files)}")
    return texts


#: The shortest block the LM objectives can train on (MNTP and CLM predict a token from the one before).
MIN_BLOCK_LENGTH = 2


def group_into_blocks(token_lists: Sequence[Sequence[int]], block_size: int) -> list[list[int]]:
    """Concatenate every text's tokens and cut blocks of ``block_size``, dropping the remainder."""
    if block_size < MIN_BLOCK_LENGTH:
        raise ValueError(f"block size (max_seq_length) must be >= {MIN_BLOCK_LENGTH}, got {block_size}")
    flat = list(chain.from_iterable(token_lists))
    return [flat[i : i + block_size] for i in range(0, len(flat) - block_size + 1, block_size)]


class TextBlocks(torch.utils.data.Dataset):
    """Token blocks of one length, in a seeded shuffled order (so a resumed run replays the same order)."""

    def __init__(self, blocks: list[list[int]], seed: int = 0):
        if not blocks:
            raise DataFormatError("the text gives no complete block of max_seq_length tokens; lower max_seq_length")
        order = list(range(len(blocks)))
        random.Random(seed).shuffle(order)
        self.blocks = torch.tensor([blocks[i] for i in order], dtype=torch.long)

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.blocks[index]


def load_text_blocks(
    tokenizer, texts: Sequence[str], max_seq_length: int, seed: int = 0, max_blocks: int | None = None
) -> TextBlocks:
    """Tokenize (with the tokenizer's special tokens, as upstream), group into blocks, shuffle."""
    ids = tokenizer(list(texts), add_special_tokens=True, verbose=False)["input_ids"]
    blocks = group_into_blocks(ids, max_seq_length)
    logger.info("%d texts -> %d blocks of %d tokens", len(texts), len(blocks), max_seq_length)
    dataset = TextBlocks(blocks, seed)
    if max_blocks is not None:
        dataset.blocks = dataset.blocks[:max_blocks]
    return dataset
