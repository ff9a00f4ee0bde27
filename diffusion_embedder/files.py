"""The lowest floor: finding a checkpoint's files (local folder or hub repo), reading JSON objects and text lines.

Every settings file the package reads (``config.json``, ``encoder_config.json``, training configs,
``task.json``, instruction maps...) goes through ``read_json_object``, so a broken file is always
named the same way: ``path:line: not valid JSON (...)``. Every JSONL and plain-text data file (gzipped
or not) is read line by line through ``iter_lines``, so a damaged gzip, UTF-16 or invalid UTF-8 is
named the same way too: ``path:line: what is wrong; how to fix it``.
"""

from __future__ import annotations

import codecs
import gzip
import json
import os
import zlib
from collections.abc import Iterator
from contextlib import contextmanager

from transformers.utils import cached_file

#: The keyword arguments of ``from_pretrained`` that say where a hub file comes from.
HUB_KWARGS = ("revision", "token", "cache_dir", "local_files_only")


def hub_kwargs_of(kwargs: dict) -> dict:
    """The hub-location keywords among ``kwargs`` (the rest belong to the model)."""
    return {k: kwargs[k] for k in HUB_KWARGS if k in kwargs}


def find_file(name_or_path: str, filename: str, **hub_kwargs) -> str | None:
    """Path of ``filename`` in a local folder or hub repo, or None when it isn't there."""
    if os.path.isdir(name_or_path):
        path = os.path.join(name_or_path, filename)
        return path if os.path.isfile(path) else None
    try:
        return cached_file(name_or_path, filename, _raise_exceptions_for_missing_entries=False, **hub_kwargs)
    except OSError:
        return None


def parse_json_object(text: str, source: str, error: type[Exception] = ValueError) -> dict:
    """The JSON object in ``text``; a syntax error or a non-object is ``error`` naming ``source`` and the line."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{source}:{e.lineno}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}).") from None
    if not isinstance(value, dict):
        raise error(f"{source}: expected a JSON object, got {type(value).__name__}.")
    return value


def read_json_object(path: str | os.PathLike, error: type[Exception] = ValueError) -> dict:
    """The JSON object in file ``path``; a missing, undecodable or broken file is ``error`` naming it."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise error(f"{path}: file not found.") from None
    except IsADirectoryError:
        raise error(f"{path}: is a folder, expected a JSON file.") from None
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8 JSON.") from None
    return parse_json_object(text, str(path), error)


def read_optional_json_object(path: str | os.PathLike | None, error: type[Exception] = ValueError) -> dict:
    """``read_json_object``, or {} where there is no file (``path`` None or absent)."""
    if path is None or not os.path.isfile(path):
        return {}
    return read_json_object(path, error)


def write_json(path: str | os.PathLike, value, **dump_kwargs) -> None:
    """Write ``value`` as indented JSON (UTF-8)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2, **dump_kwargs)


# ------------------------------------------------------------------------------------------ text lines


#: How to fix a file that is not UTF-8 text.
_AS_UTF8 = "save it as UTF-8 (e.g. iconv -t UTF-8, or your editor's 'save with encoding')."


class NotTextError(ValueError):
    """A line that is not UTF-8 text; the message says why, the reader adds where (file and line)."""


def check_file(path: str | os.PathLike, what: str = "file") -> None:
    """Refuse a path that is missing or is a folder, naming ``what`` (the setting or role) and the path."""
    if os.path.isdir(path):
        raise FileNotFoundError(f"{what} {os.fspath(path)} is a folder, not a file; name a file inside it.")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{what} not found: {os.fspath(path)}")


def folder_problem(path: str | os.PathLike, what: str = "output folder") -> str | None:
    """Why ``path`` cannot be made a folder (it, or a folder above it, is a file), naming ``what``; None if it can."""
    path = os.path.abspath(os.fspath(path))
    here = path
    while not os.path.exists(here):
        parent = os.path.dirname(here)
        if parent == here:
            return None
        here = parent
    if os.path.isdir(here):
        return None
    where = "is a file" if here == path else f"lies under {here}, which is a file"
    return f"{what} {path} {where}, not a folder; choose another path, or move the file away."


def make_folder(path: str | os.PathLike, what: str = "output folder") -> None:
    """``os.makedirs(path, exist_ok=True)``, or a ``ValueError`` in our words where a file stands in the way."""
    problem = folder_problem(path, what)
    if problem:
        raise ValueError(problem)
    os.makedirs(path, exist_ok=True)


def _whole_lines_before_damage(path: str | os.PathLike) -> int:
    """How many complete lines gzip delivers from a damaged ``.gz`` before it fails (a buffered line
    reader fails on the block it reads ahead, which can be far earlier than the damage)."""
    lines = 0
    with gzip.open(path, "rb") as f:
        try:
            while piece := f.read1(1 << 16):  # one decompression step at a time: all it gave is counted
                lines += piece.count(b"\n")
        except (OSError, EOFError, zlib.error):
            pass
    return lines


def _gzip_problem(path: str | os.PathLike, error: Exception) -> str:
    """``path:line: what is wrong`` for a ``.gz`` that gzip could not read."""
    number = _whole_lines_before_damage(path) + 1
    if isinstance(error, EOFError):
        why = "the gzip data ends early (the file is truncated); copy or download it again."
    elif number == 1 and str(error).startswith("Not a gzipped file"):
        why = "not gzip data although the name ends in .gz; rename it without .gz, or gzip it."
    else:
        why = f"the gzip data is corrupted ({error}); copy or download it again."
    return f"{path}:{number}: cannot read the file further: {why}"


def iter_lines(path: str | os.PathLike, error: type[Exception] = ValueError) -> Iterator[tuple[int, bytes]]:
    """``(line number, bytes)`` per line of ``path`` (from 1, line ending kept), gunzipped when named ``.gz``.

    A UTF-16 file (its byte-order mark), or a ``.gz`` that is not gzip data, is cut short or is corrupted,
    is ``error`` naming the file and the line that could not be read.
    """
    compressed = os.fspath(path).endswith(".gz")
    with (gzip.open if compressed else open)(path, "rb") as f:
        try:
            for number, raw in enumerate(f, 1):
                if number == 1 and raw.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
                    raise error(f"{path}:1: UTF-16 text (the file starts with a UTF-16 byte-order mark); {_AS_UTF8}")
                yield number, raw
        except (OSError, EOFError, zlib.error) as e:
            if not compressed:
                raise
            raise error(_gzip_problem(path, e)) from e


def decode_line(raw: bytes, number: int) -> str:
    """One line as text without its line ending (a UTF-8 byte-order mark on line 1 dropped); else ``NotTextError``."""
    try:
        text = raw.decode("utf-8-sig" if number == 1 else "utf-8")
    except UnicodeDecodeError as e:
        raise NotTextError(
            f"not valid UTF-8 ({e.reason}: byte {raw[e.start]:#04x} at byte {e.start + 1} of the line); "
            f"{_AS_UTF8}"
        ) from None
    if "\x00" in text:
        raise NotTextError(f"contains NUL bytes (UTF-16 or binary data, not UTF-8 text); {_AS_UTF8}")
    return text.removesuffix("\n").removesuffix("\r")


def read_text_lines(
    path: str | os.PathLike, error: type[Exception] = ValueError, what: str = "file"
) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` per line of a UTF-8 text file (gunzipped when named ``.gz``); every problem
    is an error naming ``what``/the file (missing, a folder) or ``error`` naming the file and line."""
    check_file(path, what)
    for number, raw in iter_lines(path, error):
        try:
            text = decode_line(raw, number)
        except NotTextError as e:
            raise error(f"{path}:{number}: {e}") from None
        yield number, text


@contextmanager
def open_text(path: str | os.PathLike, error: type[Exception] = ValueError) -> Iterator[Iterator[str]]:
    """A UTF-8 text file (gunzipped when named ``.gz``) as its lines without line endings, read as
    ``read_text_lines`` reads them: ``with open_text(path) as lines: ...``."""
    check_file(path)
    lines = read_text_lines(path, error)
    try:
        yield (text for _, text in lines)
    finally:
        lines.close()
