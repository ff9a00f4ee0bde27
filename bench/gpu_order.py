"""A pytest plugin for ``bench/gpu_run.sh`` (``-p bench.gpu_order``): tests whose function name contains a word of
``GPU_FIRST`` (space-separated, most telling first) run first, in the order of those words, the others after them in
their file order, so that one pytest process cut off at the run's time limit has run the most telling tests."""

from __future__ import annotations

import os


def pytest_collection_modifyitems(config, items) -> None:
    words = os.environ.get("GPU_FIRST", "").split()

    def rank(item) -> int:
        name = getattr(item, "originalname", item.name)
        return next((i for i, word in enumerate(words) if word in name), len(words))

    items.sort(key=rank)  # stable: file order within each rank
