"""Data read through ``datasets`` (a hub dataset or file, a dataset folder): what it cannot load, in our words.

``datasets`` reports a dataset that is not in the local cache while the hub is out of reach (offline
mode, no network) as one of several library tracebacks; here it is one ``DatasetUnavailableError``
naming the setting, the dataset, why, and the local-file way round. The library's exception stays as
the cause.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

#: Exception class names that mean "the hub could not be reached" (datasets, huggingface_hub, httpx).
_UNREACHABLE = ("Connect", "Timeout", "Offline", "LocalEntryNotFound")


class DatasetUnavailableError(FileNotFoundError):
    """A ``datasets`` source that cannot be loaded: the message names it, says why and how to pass a local file."""


def hub_offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` or ``HF_DATASETS_OFFLINE`` is set (as ``datasets`` read them)."""
    from datasets import config

    return bool(config.HF_HUB_OFFLINE)


def error_chain(error: BaseException | None) -> Iterator[BaseException]:
    """``error``, then its cause (or context), and so on; each exception once, so a cycle ends the walk."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def _unreachable(error: BaseException | None) -> bool:
    return any(isinstance(e, ConnectionError | TimeoutError) or any(w in type(e).__name__ for w in _UNREACHABLE)
               for e in error_chain(error))


def load_with_datasets(named: str, *args, local: str, **kwargs):
    """``datasets.load_dataset(*args, **kwargs)``; a failure is a ``DatasetUnavailableError`` saying why,
    naming the data as ``named`` (the setting and its value) and pointing at ``local``, the way to pass
    local files instead."""
    from datasets import load_dataset

    try:
        return load_dataset(*args, **kwargs)
    except Exception as e:
        source = kwargs.get("data_files") or args[0]  # a builder name ("text") with data_files names no local data
        if (isinstance(source, str) and os.path.exists(source)) or not (hub_offline() or _unreachable(e)):
            why = f"could not be loaded through datasets ({type(e).__name__}: {e}). Check it,"
        elif hub_offline():
            why = (
                "is not in the local datasets cache, and offline mode (HF_HUB_OFFLINE or HF_DATASETS_OFFLINE) "
                "keeps the hub from being asked. Load it once with network access,"
            )
        else:
            why = (
                f"is not in the local datasets cache, and the hub cannot be reached ({type(e).__name__}: {e}). "
                "Load it once with network access,"
            )
        raise DatasetUnavailableError(f"{named} {why} or pass {local}.") from e
