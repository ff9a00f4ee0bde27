"""Data read through ``datasets`` (a hub dataset or file, a dataset folder): what it cannot load, in our words.

``datasets`` reports a dataset that is not in the local cache while the hub is out of reach (offline
mode, no network) as one of several library tracebacks; here it is one ``DatasetUnavailableError``
naming the setting, the dataset, why, and the local-file way round. The library's exception stays as
the cause.
"""

from __future__ import annotations

import os

#: Exception class names that mean "the hub could not be reached" (datasets, huggingface_hub, httpx).
_UNREACHABLE = ("Connect", "Timeout", "Offline", "LocalEntryNotFound")


class DatasetUnavailableError(FileNotFoundError):
    """A ``datasets`` source that cannot be loaded: the message names it, says why and how to pass a local file."""


def hub_offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` or ``HF_DATASETS_OFFLINE`` is set (as ``datasets`` read them)."""
    from datasets import config

    return bool(config.HF_HUB_OFFLINE)


def _unreachable(error: BaseException | None) -> bool:
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, ConnectionError | TimeoutError) or any(w in type(error).__name__ for w in _UNREACHABLE):
            return True
        error = error.__cause__ or error.__context__
    return False


def load_with_datasets(named: str, *args, local: str, **kwargs):
    """``datasets.load_dataset(*args, **kwargs)``; a failure is a ``DatasetUnavailableError`` saying why,
    naming the data as ``named`` (the setting and its value) and pointing at ``local``, the way to pass
    local files instead."""
    from datasets import load_dataset

    try:
        return load_dataset(*args, **kwargs)
    except Exception as e:
        if os.path.exists(args[0]) or not (hub_offline() or _unreachable(e)):
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
