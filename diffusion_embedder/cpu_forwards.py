"""CPU encoding runs two forwards at once, in threads that share the model and split the cores between them.

A small model's forward is many short kernels. With every core on one forward, OpenMP's threads wait at the end
of each kernel and the Python between kernels runs on one core while the others idle. Two forwards at once,
each on half the cores, keep the cores busy: on 2 cores ``encode`` ran 1.1-1.3x faster, with the same vectors bit for
bit (bench/results/cpu_forward.md). Each forward is still one batch computed alone, so a text's vector does not
depend on what runs beside it.

The threads share the model, so only forwards that change no state run this way: ``sdpa`` and ``eager``
attention, eager layers (not ``torch.compile``'s), rotary embeddings that do not rescale themselves with the
length (``dynamic``, ``longrope``), no accelerate hooks (a ``device_map`` that offloads loads each layer's weights
in its forward and drops them after), no quantized weights. Anything else runs one forward at a time, as on a GPU.

By default two forwards run at once where the process has at least two intra-op threads
(``torch.get_num_threads()``), each forward on its share of them. ``DIFFUSION_EMBEDDER_CPU_FORWARDS`` sets the number
(``1``: one at a time); a number it sets is run as given (each forward gets at least one thread), and refused for a
model that cannot share its forward.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch
from torch import nn

from diffusion_embedder.compilation import compiled_layers

logger = logging.getLogger(__name__)

ENV_SETTING = "DIFFUSION_EMBEDDER_CPU_FORWARDS"
DEFAULT_FORWARDS = 2
#: Attention implementations whose forward reads the model and writes nothing shared.
STATELESS_ATTENTION = frozenset({"sdpa", "eager"})
#: Rotary embeddings that recompute their frequencies for a longer input, in place.
SELF_UPDATING_ROPE = frozenset({"dynamic", "longrope"})

T = TypeVar("T")
R = TypeVar("R")


def setting() -> int | None:
    """``DIFFUSION_EMBEDDER_CPU_FORWARDS``, checked; None when unset."""
    raw = os.environ.get(ENV_SETTING)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{ENV_SETTING}={raw!r}: expected a whole number >= 1 (1 runs one CPU forward at a time).")
    return value


def sharing_problem(model: nn.Module) -> str | None:
    """Why two threads may not run ``model``'s forward at once; None when they may."""
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    if impl not in STATELESS_ATTENTION:
        return f"attention {impl!r} (only {', '.join(sorted(STATELESS_ATTENTION))} run side by side)"
    if compiled_layers(model):
        return "compiled layers"
    if any(hasattr(m, "_hf_hook") for m in model.modules()):
        return "accelerate hooks (a device_map), which move weights in the forward"
    if getattr(model.config, "quantization_config", None) is not None:
        return "quantized weights"
    kinds = [getattr(m, "rope_type", None) for m in model.modules()]  # a dict per layer type (Gemma 3)
    updating = {k for kind in kinds for k in (kind.values() if isinstance(kind, dict) else [kind])} & SELF_UPDATING_ROPE
    if updating:
        return f"{', '.join(sorted(updating))} rotary embeddings, which update themselves in the forward"
    return None


def concurrent_forwards(model: nn.Module, device: torch.device) -> int:
    """How many forwards ``encode`` runs at once on ``device``: 1 off the CPU; the setting where one is given
    (refused for a model ``sharing_problem`` rules out); else ``DEFAULT_FORWARDS``, at most one per intra-op
    thread, and 1 where ``sharing_problem`` says so."""
    if device.type != "cpu":
        return 1
    chosen = setting()
    if chosen == 1:
        return 1
    problem = sharing_problem(model)
    if chosen is not None:
        if problem:
            raise ValueError(f"{ENV_SETTING}={chosen} cannot be honoured for this model: {problem}. "
                             f"Set it to 1, or unset it.")
        return chosen
    if problem:
        logger.debug("One CPU forward at a time: %s.", problem)
        return 1
    return max(1, min(DEFAULT_FORWARDS, torch.get_num_threads()))


class _ThreadDefault:
    """torch's intra-op thread count while forwards run side by side. Setting a thread's count also sets the
    default of threads started after, so the count is taken by the first run to start and put back by the last to
    end: a caller started while another run's forward threads were setting it would have taken theirs."""

    def __init__(self):
        self._lock = threading.Lock()
        self._running = 0
        self._threads = 1

    def enter(self) -> int:
        with self._lock:
            if not self._running:
                self._threads = torch.get_num_threads()
            self._running += 1
            return self._threads

    def leave(self) -> None:
        with self._lock:
            self._running -= 1
            if not self._running:
                torch.set_num_threads(self._threads)


_THREAD_DEFAULT = _ThreadDefault()


def run_concurrently(forward: Callable[[T], R], items: Iterable[T], count: int) -> Iterator[R]:
    """``forward(item)`` for each item, in order, ``count`` at a time in threads that share the intra-op threads
    (and in inference mode, which is per thread); at most ``count`` items are taken ahead of the results."""
    if count == 1:
        yield from map(forward, items)
        return
    threads = max(1, _THREAD_DEFAULT.enter() // count)

    def run(item: T) -> R:
        with torch.inference_mode():
            return forward(item)

    pool = ThreadPoolExecutor(count, initializer=torch.set_num_threads, initargs=(threads,),
                              thread_name_prefix="encode-forward")
    pending: collections.deque = collections.deque()
    try:
        for item in items:
            pending.append(pool.submit(run, item))
            if len(pending) >= count:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        _THREAD_DEFAULT.leave()
