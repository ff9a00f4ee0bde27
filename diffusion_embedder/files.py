"""The lowest floor: finding a checkpoint's files (local folder or hub repo) and reading JSON objects.

Every settings file the package reads (``config.json``, ``encoder_config.json``, training configs,
``task.json``, instruction maps...) goes through ``read_json_object``, so a broken file is always
named the same way: ``path:line: not valid JSON (...)``.
"""

from __future__ import annotations

import json
import os

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
