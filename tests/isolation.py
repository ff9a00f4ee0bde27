"""What keeps tests independent when pytest-xdist runs them in parallel (``make test``): each worker's share of the
cores, ports held for the servers a test starts, folders built once per run for all workers, and the process-wide
state a test must leave as it found it. A light module (no torch import at import time): processes that a test
spawns import it too."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest


def worker_threads() -> int:
    """Threads for one test process: its share of the cores the run may use, at least 1 (2 workers on CI's 2 cores:
    1 each, so two workers' OpenMP pools never fight over the cores); OMP_NUM_THREADS, if set, wins."""
    if "OMP_NUM_THREADS" in os.environ:
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, len(os.sched_getaffinity(0)) // workers)


@contextlib.contextmanager
def reserved_port(host: str = "127.0.0.1") -> Iterator[int]:
    """A TCP port on ``host`` that stays ours until the block ends: the socket is bound with SO_REUSEADDR and never
    listens, so the system hands the port to no other program (another xdist worker, another job on the machine)
    and a connection to it is refused, while a server started on it inside the block (torchrun's c10d rendezvous,
    ``init_process_group``'s TCPStore: both bind with SO_REUSEADDR) can listen there. A port merely found free and
    released can be taken by anyone before the launch binds it."""
    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind((host, 0))
        yield held.getsockname()[1]


def built_once(tmp_path_factory, name: str, build: Callable[[Path], object]) -> Path:
    """The folder ``build(folder)`` fills, built once per test run however many xdist workers ask for it: the first
    builds it under a file lock in the run's shared temporary folder, the others wait for it and reuse it (a session
    fixture alone would build it once per worker). Readers must not change it: copy it to change it. A build that
    failed is tried again by the next worker that asks."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if "PYTEST_XDIST_WORKER" in os.environ else base  # xdist: the run's own temporary folder
    folder, done = shared / f"once-{name}", shared / f"once-{name}.done"
    with open(shared / f"once-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also when this process dies
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # what a failed build left
            folder.mkdir()
            build(folder)
            done.touch()
    return folder


#: Variables libraries set on their first import, for their own later use, once per process: torch's (inductor's
#: compiled C++ code reads the first and fails without it; the others configure inductor's builds and the
#: profiler), scikit-learn's OpenMP settings and polars' allocator settings (both imported by mteb). Neither
#: compared nor put back: which test imports a library first depends on the order the tests run in.
LIBRARY_ENV = frozenset({"_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR", "KMP_DUPLICATE_LIB_OK", "TORCH_WARM_POOL",
                         "CUDA_HOME", "DISABLE_CUPTI_LAZY_REINIT", "TEARDOWN_CUPTI", "KMP_INIT_AT_FORK",
                         "_RJEM_MALLOC_CONF"})
#: pytest's own, set anew for each phase of each test.
PYTEST_ENV = "PYTEST_CURRENT_TEST"
#: (level, disabled, propagate) of a logger nothing has configured.
_NEW_LOGGER = (logging.NOTSET, False, True)


def _pytest_handler(handler: logging.Handler) -> bool:
    return type(handler).__module__.startswith("_pytest")


def global_state() -> dict[str, object]:
    """Process-wide state a test could leave behind for the tests after it (on its xdist worker)."""
    import torch
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    loggers = {name: (lg.level, lg.disabled, lg.propagate) for name, lg in logging.root.manager.loggerDict.items()
               if isinstance(lg, logging.Logger) and name.split(".")[0] == "diffusion_embedder"}
    loggers = {name: state for name, state in loggers.items() if state != _NEW_LOGGER}  # a first import makes some
    return {
        "current directory": os.getcwd(),
        "environment": {k: v for k, v in os.environ.items() if k not in LIBRARY_ENV and k != PYTEST_ENV},
        "torch default dtype": torch.get_default_dtype(),
        "torch threads": torch.get_num_threads(),
        "grad mode": torch.is_grad_enabled(),
        "deterministic algorithms": torch.are_deterministic_algorithms_enabled(),
        "attention implementations": dict(AttentionInterface._global_mapping),
        "attention masks": dict(AttentionMaskInterface._global_mapping),
        "root logger": (logging.root.level, [h for h in logging.root.handlers if not _pytest_handler(h)]),
        "logging.disable": logging.root.manager.disable,
        "our loggers": loggers,
    }


def _restore(before: dict[str, object]) -> None:
    import torch

    os.chdir(before["current directory"])
    for name in set(os.environ) - set(before["environment"]) - LIBRARY_ENV - {PYTEST_ENV}:
        del os.environ[name]
    os.environ.update(before["environment"])
    torch.set_default_dtype(before["torch default dtype"])
    torch.set_num_threads(before["torch threads"])
    torch.set_grad_enabled(before["grad mode"])
    torch.use_deterministic_algorithms(before["deterministic algorithms"])


def _changes(before: dict[str, object], after: dict[str, object]) -> list[str]:
    changed = []
    for key, was in before.items():
        now = after[key]
        if key == "environment":
            keys = sorted(k for k in was.keys() | now.keys() if was.get(k) != now.get(k))
            changed += [f"environment variable {k}: {was.get(k)!r} -> {now.get(k)!r}" for k in keys]
        elif now != was:
            changed.append(f"{key}: {was!r} -> {now!r}")
    return changed


@contextlib.contextmanager
def unchanged_global_state(where: str) -> Iterator[None]:
    before = global_state()
    yield
    changed = _changes(before, global_state())
    if changed:
        _restore(before)  # the tests after this one start clean either way
        pytest.fail(f"{where} left process-wide state changed (use monkeypatch, or undo it): " + "; ".join(changed),
                    pytrace=False)
