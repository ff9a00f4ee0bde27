"""An iterator run ahead in a thread, so the next batches are tokenized and collated while the device runs this one.

The tokenizers' Rust calls and PyTorch's kernels release the GIL, so the two overlap. A bounded queue
keeps the producer at most ``depth`` items ahead. An exception in the producer is raised in the
consumer (the original exception, with its traceback); a consumer that stops early (an exception, a
``break``) stops the producer, so no thread is left behind.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")

_END = object()
_POLL_S = 0.05


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


class Prefetcher(Generic[T]):
    """``with Prefetcher(items, depth) as ahead: for item in ahead: ...``"""

    def __init__(self, items: Iterable[T], depth: int = 2):
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, args=(items,), name="encode-prefetch", daemon=True)
        self._thread.start()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self, items: Iterable[T]) -> None:
        iterator = iter(items)
        try:
            for item in iterator:
                if not self._put(item):
                    return
        except BaseException as error:  # noqa: BLE001 - handed to the consumer, which raises it
            self._put(_Failure(error))
            return
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()  # a generator stopped early runs its cleanup in its own thread
        self._put(_END)

    def __iter__(self) -> Iterator[T]:
        while True:
            item = self._queue.get()
            if item is _END:
                return
            if isinstance(item, _Failure):
                raise item.error
            yield item

    def close(self) -> None:
        """Stop the producer and wait for it (it checks between items and while the queue is full)."""
        self._stop.set()
        while self._thread.is_alive():
            try:
                self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                pass
        self._thread.join()

    def __enter__(self) -> Prefetcher[T]:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
