"""MS MARCO with instructions (``samaya-ai/msmarco-w-instructions``), as the fork trained on it.

Tevatron-style rows: ``query`` (already containing the instruction text), ``positive_passages``,
``negative_passages`` and ``new_negatives`` (passages made negative by the instruction), each a list
of ``{docid, title, text}``. Per query: the first positive and 15 negatives, namely the first <= 3
``new_negatives`` then a random draw from ``negative_passages`` (without replacement, or with
replacement when too few). The first 16,000 rows, in hub order, are used.
"""

from __future__ import annotations

import json
import logging
import os
import random
from collections.abc import Iterator

from diffusion_embedder.files import check_file

from .hub import error_chain, load_with_datasets
from .jsonl import DataFormatError, Field, RecordError, iter_jsonl_lines, load_records
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


def _looks_local(path: str) -> bool:
    """A path that cannot be a hub name (``owner/name``): a data-file suffix, absolute, or relative by dots."""
    suffix = os.path.splitext(path)[1].lower()
    return suffix in _FILE_BUILDERS or os.path.isabs(path) or path.startswith((".", "~")) or path.count("/") > 1


def _first_bad_line(path: str, parse: bool) -> str | None:
    """``path:line: problem`` for the first line that is not UTF-8 text (or, with ``parse``, not JSON), else None."""
    where = path
    try:
        for where, _, text in iter_jsonl_lines(path):
            if isinstance(text, RecordError):
                return f"{where}: {text}"
            if parse:
                json.loads(text)
    except json.JSONDecodeError as e:
        return f"{where}: invalid JSON ({e.msg} at column {e.colno})"
    except DataFormatError as e:
        return str(e)
    return None


def load_hub_or_local(path: str | os.PathLike, split: str):
    """``datasets.load_dataset`` on a hub name, a data folder, or one parquet/json/jsonl/csv file; a file
    that cannot be read is a ``DataFormatError`` naming it (and its first line that is not UTF-8 text, or
    for JSON lines not JSON); a hub name that cannot be loaded is a ``DatasetUnavailableError``."""
    path = os.fspath(path)
    suffix = os.path.splitext(path)[1].lower()
    if os.path.isfile(path):
        if suffix not in _FILE_BUILDERS:
            raise ValueError(f"unsupported data file type {suffix!r} for {path}; use one of {sorted(_FILE_BUILDERS)}")
        from datasets import load_dataset

        try:
            return load_dataset(_FILE_BUILDERS[suffix], data_files={split: path}, split=split)
        except Exception as e:
            found = None if suffix == ".parquet" else _first_bad_line(path, parse=suffix == ".jsonl")
            *_, cause = error_chain(e)  # the innermost exception
            why = found or f"{path}: cannot be read as a {suffix[1:]} file ({type(cause).__name__}: {cause})"
            raise DataFormatError(why) from e
    if not os.path.isdir(path) and _looks_local(path):
        check_file(path, "MSMARCO data (dataset_file_path)")
    local = "dataset_file_path: a local copy (a parquet, json, jsonl or csv file, or a folder in the hub layout)"
    return load_with_datasets(f"MSMARCO data {path!r}", path, split=split, local=local)


def _located_rows(rows, path: str, split: str) -> Iterator[tuple[str, int, dict]]:
    """``(location, index, row)`` per row; text that is not UTF-8 (pyarrow finds it only when a row is read)
    is a ``DataFormatError`` naming the file's line, or the row."""
    index = 0
    try:
        for index, row in enumerate(rows):
            yield f"{path} ({split}) row {index}", index, row
    except UnicodeDecodeError as e:
        found = _first_bad_line(path, parse=False) if os.path.isfile(path) else None
        raise DataFormatError(found or f"{path} ({split}) row {index + 1}: not valid UTF-8 text ({e.reason})") from e


#: Negatives per sample that are its query under another instruction (instruction-following negatives).
MSMARCO_INSTRUCTION_NEGATIVES = 3


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
        num_instruction_negatives: int = MSMARCO_INSTRUCTION_NEGATIVES,
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

        samples, bad = load_records(
            _located_rows(rows, os.fspath(path), split), _FIELDS, convert, source=os.fspath(path),
            skip_bad_lines=skip_bad_lines,
        )
        super().__init__(samples, name="MSMARCO", num_bad_records=bad)
