"""Record validation shared by the readers: every bad record is reported as ``file:line: problem``.

Readers describe the fields they need (``Field``) and a ``convert`` function; ``load_records`` checks
each record, turns a bad one into a ``DataFormatError`` naming where it is and what is wrong, or, with
``skip_bad_lines=True``, counts it and logs one warning at the end.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from diffusion_embedder.files import NotTextError, check_file, decode_line, iter_lines

logger = logging.getLogger(__name__)

T = TypeVar("T")

_KINDS = ("str", "int|str", "list[str]", "list[dict]")


class DataFormatError(ValueError):
    """A data record is unusable; the message says where (file and line, or row) and why."""


class RecordError(ValueError):
    """Raised by a reader's ``convert`` for a bad record; ``load_records`` adds the location."""


@dataclass(frozen=True)
class Field:
    """One expected field: its JSON kind, whether it must be present, and whether null is allowed."""

    name: str
    kind: str = "str"
    required: bool = True
    nullable: bool = False

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"unknown field kind {self.kind!r}; expected one of {_KINDS}")


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def check_fields(record: Any, fields: Iterable[Field]) -> None:
    """Raise ``RecordError`` for a non-object record, a missing required field or a value of the wrong type."""
    if not isinstance(record, dict):
        raise RecordError(f"expected a JSON object, got {_type_name(record)}")
    for spec in fields:
        if spec.name not in record:
            if spec.required:
                raise RecordError(f"missing field {spec.name!r}")
            continue
        value = record[spec.name]
        if value is None:
            if spec.nullable or not spec.required:
                continue
            raise RecordError(f"field {spec.name!r} is null, expected {spec.kind}")
        if spec.kind == "str":
            ok = isinstance(value, str)
        elif spec.kind == "int|str":
            ok = isinstance(value, str | int) and not isinstance(value, bool)
        else:
            ok = isinstance(value, list)
        if not ok:
            raise RecordError(f"field {spec.name!r} must be {spec.kind}, got {_type_name(value)}: {value!r:.80}")
        if spec.kind.startswith("list["):
            item_type = str if spec.kind == "list[str]" else dict
            for i, item in enumerate(value):
                if not isinstance(item, item_type):
                    raise RecordError(
                        f"field {spec.name!r} must be {spec.kind}, but item {i} is {_type_name(item)}: {item!r:.80}"
                    )


def iter_jsonl_lines(
    path: str | os.PathLike, what: str = "data file"
) -> Iterator[tuple[str, int, str | RecordError]]:
    """``(location, index, text)`` per non-blank line; ``index`` is the 0-based line number. A missing
    file or a folder is a ``FileNotFoundError`` naming ``what`` (the setting that gave the path).

    Read through ``files.iter_lines`` (``.gz`` decompressed on the fly; a damaged gzip or a UTF-16 file
    is a ``DataFormatError`` naming file and line). Lines are decoded one at a time so a bad byte
    sequence is reported on its own line (and can be skipped with ``skip_bad_lines``).
    """
    check_file(path, what)
    for number, raw in iter_lines(path, DataFormatError):
        try:
            text: str | RecordError = decode_line(raw, number)
        except NotTextError as e:
            text = RecordError(str(e))
        if isinstance(text, str) and not text.strip():
            continue
        yield f"{path}:{number}", number - 1, text


def load_records(
    items: Iterable[tuple[str, int, str | dict | RecordError]],
    fields: Iterable[Field],
    convert: Callable[[dict, int], T | None],
    *,
    source: str,
    skip_bad_lines: bool = False,
    limit: int | None = None,
) -> tuple[list[T], int]:
    """Validate and convert records; returns ``(converted, number of bad records skipped)``.

    ``convert`` returns None to filter a good record out on purpose. ``items`` are
    ``(location, index, raw)`` with ``raw`` a JSON line, an already parsed row, or a ``RecordError``
    found while reading. Stops after ``limit`` converted records.
    """
    fields = tuple(fields)
    out: list[T] = []
    bad = 0
    first_bad = ""
    for where, index, raw in items:
        if limit is not None and len(out) >= limit:
            break
        try:
            if isinstance(raw, RecordError):
                raise raw
            if isinstance(raw, str):
                try:
                    record = json.loads(raw)
                except json.JSONDecodeError as e:
                    raise RecordError(f"invalid JSON ({e.msg} at column {e.colno})") from None
            else:
                record = raw
            check_fields(record, fields)
            converted = convert(record, index)
        except RecordError as e:
            if not skip_bad_lines:
                raise DataFormatError(f"{where}: {e}") from None
            bad += 1
            first_bad = first_bad or f"{where}: {e}"
            continue
        if converted is not None:
            out.append(converted)
    if bad:
        logger.warning("skipped %d malformed record(s) in %s (first: %s)", bad, source, first_bad)
    return out, bad


def read_jsonl(
    path: str | os.PathLike,
    fields: Iterable[Field],
    convert: Callable[[dict, int], T | None],
    *,
    skip_bad_lines: bool = False,
    limit: int | None = None,
    what: str = "data file",
) -> tuple[list[T], int]:
    """``load_records`` over a JSONL file; errors read ``path:line: problem``."""
    return load_records(
        iter_jsonl_lines(path, what), fields, convert, source=str(path), skip_bad_lines=skip_bad_lines, limit=limit
    )


def read_jsonl_rows(path: str | os.PathLike, fields: Iterable[Field], id_key: str | None = None) -> list[dict]:
    """Validated records of a JSONL file; an empty file, or a value of ``id_key`` repeated (compared as text),
    is a ``file:line`` error too (a BEIR corpus, queries, an encode corpus)."""
    numbered, _ = read_jsonl(path, fields, lambda record, index: (index + 1, record))
    if not numbered:
        raise DataFormatError(f"{path}: no records (the file is empty).")
    if id_key is not None:
        first_line: dict[str, int] = {}
        for line, row in numbered:
            key = str(row[id_key])
            if key in first_line:
                raise DataFormatError(f"{path}:{line}: duplicate {id_key} {key!r} (first on line {first_line[key]}).")
            first_line[key] = line
    return [row for _, row in numbered]
