"""MS MARCO with instructions (``samaya-ai/msmarco-w-instructions``), as the fork trained on it.

Tevatron-style rows: ``query`` (already containing the instruction text), ``positive_passages``,
``negative_passages`` and ``new_negatives`` (passages made negative by the instruction), each a list
of ``{docid, title, text}``. Per query: the first positive and 15 negatives, namely the first <= 3
``new_negatives`` then a random draw from ``negative_passages`` (without replacement, or with
replacement when too few). The first 16,000 rows, in hub order, are used.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Iterator

from .jsonl import Field, RecordError, load_records
from .sample import ContrastiveDataset, TrainSample, train_instruction

logger = logging.getLogger(__name__)

MSMARCO_HUB_NAME = "samaya-ai/msmarco-w-instructions"
#: The one query instruction of the fork (the row's query carries the specific instruction).
MSMARCO_INSTRUCTION = "Retrieve text based on user query"

_FIELDS = (
    Field("query"),
    Field("positive_passages", kind="list[dict]"),
    Field("negative_passages", kind="list[dict]"),
    Field("new_negatives", kind="list[dict]", required=False),
)

_FILE_BUILDERS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv"}


def passage_text(passage: dict, field: str, position: int) -> str:
    """``title + " " + text`` (just ``text`` when the title is empty or absent)."""
    where = f"{field}[{position}]"
    text = passage.get("text")
    if not isinstance(text, str):
        raise RecordError(f"{where} lacks a string 'text'")
    title = passage.get("title")
    if title is not None and not isinstance(title, str):
        raise RecordError(f"{where}.title must be a string, got {type(title).__name__}")
    return f"{title} {text}" if title else text


def load_hub_or_local(path: str | os.PathLike, split: str):
    """``datasets.load_dataset`` on a hub name, a data folder, or one parquet/json/jsonl/csv file."""
    from datasets import load_dataset

    path = os.fspath(path)
    suffix = os.path.splitext(path)[1].lower()
    if os.path.isfile(path):
        if suffix not in _FILE_BUILDERS:
            raise ValueError(f"unsupported data file type {suffix!r} for {path}; use one of {sorted(_FILE_BUILDERS)}")
        return load_dataset(_FILE_BUILDERS[suffix], data_files={split: path}, split=split)
    return load_dataset(path, split=split)


class MSMARCO(ContrastiveDataset):
    """Instruction-following training data: 1 positive + ``num_negatives`` negatives per query.

    ``path`` is the hub name (default), a local folder in the hub layout, or a single data file with
    the same columns. One group (one instruction), so homogeneous batching is plain shuffling.
    """

    def __init__(
        self,
        path: str | os.PathLike = MSMARCO_HUB_NAME,
        *,
        split: str = "train",
        max_rows: int | None = 16000,
        num_negatives: int = 15,
        num_instruction_negatives: int = 3,
        seed: int = 42,
        skip_bad_lines: bool = False,
    ):
        if num_negatives < 1 or not 0 <= num_instruction_negatives <= num_negatives:
            raise ValueError(
                f"need num_negatives >= 1 and 0 <= num_instruction_negatives <= num_negatives, "
                f"got {num_negatives} and {num_instruction_negatives}"
            )
        rows = load_hub_or_local(path, split)
        if max_rows is not None and len(rows) > max_rows:
            rows = rows.select(range(max_rows))
        rng = random.Random(seed)
        instruction = train_instruction(MSMARCO_INSTRUCTION)

        def convert(row: dict, index: int) -> TrainSample:
            if not row["positive_passages"]:
                raise RecordError("'positive_passages' is empty")
            positive = passage_text(row["positive_passages"][0], "positive_passages", 0)
            pool = [passage_text(p, "negative_passages", i) for i, p in enumerate(row["negative_passages"])]
            new = [passage_text(p, "new_negatives", i) for i, p in enumerate(row.get("new_negatives") or [])]
            negatives = new[:num_instruction_negatives]
            wanted = num_negatives - len(negatives)
            if wanted and not pool:
                raise RecordError(f"'negative_passages' is empty but {wanted} more negative(s) are needed")
            negatives += rng.sample(pool, wanted) if len(pool) >= wanted else rng.choices(pool, k=wanted)
            return TrainSample(
                query=(instruction, row["query"]),
                positive=("", positive),
                negatives=[("", n) for n in negatives],
                group=instruction,
            )

        def items() -> Iterator[tuple[str, int, dict]]:
            for i, row in enumerate(rows):
                yield f"{os.fspath(path)} ({split}) row {i}", i, row

        samples, bad = load_records(items(), _FIELDS, convert, source=os.fspath(path), skip_bad_lines=skip_bad_lines)
        super().__init__(samples, name="MSMARCO", num_bad_records=bad)
