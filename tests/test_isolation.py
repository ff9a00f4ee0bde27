"""The suite's own parallel run (``make test``: pytest-xdist): each worker on its share of the threads, ports held
for the servers a test starts, folders built once for all workers, and no test leaving process-wide state behind."""

from __future__ import annotations

import datetime
import errno
import os
import re
import socket
import threading
import time
from pathlib import Path

import conftest
import isolation
import pytest
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]


def test_make_test_runs_the_suite_on_xdist_workers_and_prints_the_15_slowest():
    """CI runs ``make test`` (``.ci/run``): its pytest line is the parallel, work-stealing run with the durations."""
    recipe = re.search(r"^test:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    [line] = [line for line in recipe.splitlines() if " -m pytest" in line]
    assert "-n $(PYTEST_WORKERS)" in line and "--dist worksteal" in line and "--durations=15" in line
    assert re.search(r"^PYTEST_WORKERS \?= 2$", (ROOT / "Makefile").read_text(), re.M)
    assert re.search(r"^pytest-xdist==", (ROOT / "requirements.txt").read_text(), re.M)


@pytest.mark.parametrize(("cores", "workers", "omp", "expected"), [
    (2, "2", None, 1),  # CI: two workers on two cores, one thread each
    (16, "4", None, 4),
    (2, "4", None, 1),  # never below one
    (2, "2", "3", 3),  # a user's OMP_NUM_THREADS wins
])
def test_each_worker_gets_its_share_of_the_cores(monkeypatch, cores, workers, omp, expected):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", workers)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.setenv(name, "")  # so that monkeypatch puts back what was there (or nothing)
        monkeypatch.delenv(name)
    if omp is not None:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    threads = torch.get_num_threads()
    try:
        conftest.pytest_configure(None)  # what each xdist worker runs at its start
        assert torch.get_num_threads() == expected
        assert os.environ["OMP_NUM_THREADS"] == os.environ["MKL_NUM_THREADS"] == str(expected)  # subprocesses too
    finally:
        torch.set_num_threads(threads)


def test_a_serial_run_keeps_torch_s_threads(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "64")
    threads = torch.get_num_threads()
    conftest.pytest_configure(None)
    assert torch.get_num_threads() == threads


def test_a_reserved_port_is_nobody_else_s_but_a_store_listens_there():
    with isolation.reserved_port() as port:
        with socket.socket() as other, pytest.raises(OSError) as taken:
            other.bind(("127.0.0.1", port))  # another program asking for this port
        assert taken.value.errno == errno.EADDRINUSE
        with socket.socket() as client:
            assert client.connect_ex(("127.0.0.1", port)) == errno.ECONNREFUSED  # held, not serving
        timeout = datetime.timedelta(seconds=30)
        server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timeout)  # as torchrun's rendezvous does
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
        client.set("key", "value")
        assert server.get("key") == b"value"
        del client, server


def test_a_folder_built_once_is_built_once_for_concurrent_workers(tmp_path_factory):
    builds = []

    def build(folder: Path) -> None:
        builds.append(folder)
        time.sleep(0.3)  # the second asker arrives while the first builds
        (folder / "result.txt").write_text("built")

    name = f"probe-{os.getpid()}-{time.monotonic_ns()}"
    tmp_path_factory.getbasetemp()  # made once, here: pytest makes it lazily, and not thread-safely
    got = []
    askers = [threading.Thread(target=lambda: got.append(isolation.built_once(tmp_path_factory, name, build)))
              for _ in range(2)]  # separate lock-file descriptions: flock makes them wait as two processes would
    for asker in askers:
        asker.start()
    for asker in askers:
        asker.join()
    assert len(builds) == 1 and got == [builds[0]] * 2
    assert (got[0] / "result.txt").read_text() == "built"


def test_a_failed_build_is_tried_again(tmp_path_factory):
    name = f"failing-{os.getpid()}-{time.monotonic_ns()}"

    def fail(folder: Path) -> None:
        (folder / "half.txt").write_text("half")
        raise RuntimeError("build failed")

    with pytest.raises(RuntimeError, match="build failed"):
        isolation.built_once(tmp_path_factory, name, fail)
    folder = isolation.built_once(tmp_path_factory, name, lambda f: (f / "whole.txt").write_text("whole"))
    assert sorted(p.name for p in folder.iterdir()) == ["whole.txt"]  # nothing of the failed build is reused


def test_state_a_test_leaves_behind_fails_it_and_is_undone(tmp_path, monkeypatch):
    monkeypatch.delenv("ISOLATION_PROBE", raising=False)
    cwd, dtype = os.getcwd(), torch.get_default_dtype()
    with pytest.raises(pytest.fail.Exception) as failed:
        with isolation.unchanged_global_state("this block"):
            os.environ["ISOLATION_PROBE"] = "1"
            torch.set_default_dtype(torch.float64)
            os.chdir(tmp_path)
    message = str(failed.value)
    assert "this block left process-wide state changed" in message
    for change in ("environment variable ISOLATION_PROBE: None -> '1'", "torch default dtype", "current directory"):
        assert change in message
    assert "ISOLATION_PROBE" not in os.environ and torch.get_default_dtype() == dtype and os.getcwd() == cwd


def test_what_torch_sets_for_itself_is_left_to_it(monkeypatch):
    """Inductor sets a variable at its first C++ compilation and its compiled code reads it for the rest of the
    process: taking it away would break every later compiled function."""
    monkeypatch.delenv("_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR", raising=False)
    with isolation.unchanged_global_state("this block"):
        os.environ["_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"] = "123"
    assert os.environ.pop("_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR") == "123"


def test_state_put_back_passes():
    with isolation.unchanged_global_state("this block"):
        torch.set_default_dtype(torch.float64)
        torch.set_default_dtype(torch.float32)
