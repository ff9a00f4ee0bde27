"""Sharded evaluation: torchrun ranks (2 processes, and 2 "nodes" on this machine) score exactly as one process.

The tiny llama fixture on the ReasonAug BEIR task, in chunks of 16 documents so both ranks encode some: the
scores and every cached document vector must equal those of one process, bit for bit. The protocol's failure
paths (a rank's error, rank 0 leaving) and the device placement are checked in one process by standing in for
torch.distributed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("MTEB_CACHE", tempfile.mkdtemp(prefix="mteb_cache_"))

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from conftest import LLAMA_FIXTURE, ROOT  # noqa: E402
from isolation import reserved_port  # noqa: E402

from diffusion_embedder import distributed  # noqa: E402
from diffusion_embedder.evaluation import run, sharding  # noqa: E402

REASONAUG = ROOT / "tests" / "fixtures" / "beir" / "reasonaug"
EVAL_SCRIPT = ROOT / "experiments" / "mteb_eval_custom.py"
TASK = "ReasonAugConceptRetrieval"


def eval_argv(out: Path) -> list[str]:
    return ["--base_model_name_or_path", str(LLAMA_FIXTURE), "--local_task", str(REASONAUG), "--output_dir", str(out),
            "--chunk_size", "16", "--batch_size", "8", "--no_progress_bar"]


def launch_env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")


def torchrun(script: Path, *args: str, nproc: int = 2, timeout: int = 300) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node nproc script args`` (CPU, gloo)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(script), *args]
    return subprocess.run(command, cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=timeout)


def two_nodes(script: Path, *args: str, timeout: int = 300) -> list[tuple[int, str]]:
    """Two torchrun "nodes" of one process each, started together, meeting by c10d rendezvous on 127.0.0.1 (a port
    held for them until they finish)."""
    with reserved_port() as port:
        procs = [subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}", "--nproc_per_node=1",
             "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=sharded-eval-test",
             str(script), *args],
            cwd=ROOT, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        ) for node in (0, 1)]
        try:
            return [(p.wait(timeout=timeout), p.stdout.read()) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()


def scores(out: Path) -> dict:
    [path] = out.rglob(f"{TASK}.json")
    return json.loads(path.read_text())["scores"]


def cached_vectors(out: Path) -> dict[str, np.ndarray]:
    """Text hash -> vector over every shard of the run's embedding cache."""
    vectors = {}
    for keys in (out / "embedding_cache").rglob("*.keys.json"):
        rows = np.load(str(keys).removesuffix(".keys.json") + ".npy")
        for text_hash, row in zip(json.loads(keys.read_text())["texts"], rows, strict=True):
            assert text_hash not in vectors, "a document was encoded twice"
            vectors[text_hash] = row
    return vectors


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("one_process")
    assert run.main(eval_argv(out) + ["--device", "cpu"]) == 0
    return out


def test_two_ranks_score_and_cache_exactly_as_one_process(one_process, tmp_path):
    result = torchrun(EVAL_SCRIPT, *eval_argv(tmp_path))
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-5000:]
    assert "over 2 ranks (texts per rank: [52, 48])" in log  # 7 chunks of <= 16 documents: 4 on rank 0, 3 on rank 1
    assert log.count("Results: ") == 1 and log.count(f"  {TASK}: ") == 1  # rank 0 alone prints
    assert scores(tmp_path) == scores(one_process)
    sharded, single = cached_vectors(tmp_path), cached_vectors(one_process)
    assert len(sharded) == 100 and sharded.keys() == single.keys()
    assert all(np.array_equal(sharded[h], single[h]) for h in single)
    assert len(list((tmp_path / "embedding_cache").rglob("*.keys.json"))) == 7  # one shard per chunk, as it goes


def test_two_nodes_on_one_machine_score_as_one_process(one_process, tmp_path):
    nodes = two_nodes(EVAL_SCRIPT, *eval_argv(tmp_path))
    assert [code for code, _ in nodes] == [0, 0], "\n".join(log[-3000:] for _, log in nodes)
    assert sum(log.count("Results: ") for _, log in nodes) == 1
    assert any("over 2 ranks (texts per rank: [52, 48])" in log for _, log in nodes)
    assert scores(tmp_path) == scores(one_process)
    sharded, single = cached_vectors(tmp_path), cached_vectors(one_process)
    assert sharded.keys() == single.keys() and all(np.array_equal(sharded[h], single[h]) for h in single)


# ------------------------------------------------------------------ the protocol, with torch.distributed stood in for
class Echo:
    """An encoder whose vector is the text's length; records the ``device`` of every call."""

    def __init__(self, fail_on: str | None = None):
        self.devices: list = []
        self.fail_on = fail_on

    def encode(self, sentences, batch_size=32, show_progress_bar=True, convert_to_numpy=False, **kwargs):
        self.devices.append(kwargs.get("device"))
        if any(t == self.fail_on for _, t in sentences):
            raise RuntimeError("out of memory")
        return np.array([[float(len(t)), 1.0] for _, t in sentences], dtype=np.float32)


@pytest.fixture
def two_ranks(monkeypatch):
    """This process as rank 0 of 2; ``sent`` records what it scatters, ``peer`` is what rank 1 answers."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    state = {"sent": [], "peer": sharding._Done()}
    monkeypatch.setattr(distributed, "scatter", lambda jobs: state["sent"].append(jobs) or jobs[0])
    monkeypatch.setattr(distributed, "gather", lambda done: [done, state["peer"]])
    return state


def test_chunks_alternate_over_the_ranks_and_errors_reach_rank_0(two_ranks, monkeypatch):
    pairs = [["", "x" * n] for n in range(1, 6)]
    two_ranks["peer"] = sharding._Done(vectors={1: np.array([[3.0, 1.0], [4.0, 1.0]], dtype=np.float32)})
    out = sharding.ShardedEncoder(Echo(), "cpu", chunk_size=2).encode(pairs, batch_size=4)
    jobs = two_ranks["sent"][0]
    assert [[i for i, _ in job.chunks] for job in jobs] == [[0, 2], [1]]  # chunks (0,2) (2,4) (4,5): i % 2
    assert out[:, 0].tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
    two_ranks["peer"] = sharding._Done()  # a rank that answers without its chunk is an error, never unset rows
    with pytest.raises(RuntimeError, match=r"chunk\(s\) \[1\] came back from no rank"):
        sharding.ShardedEncoder(Echo(), "cpu", chunk_size=2).encode(pairs, batch_size=4)
    two_ranks["peer"] = sharding._Done(error="RuntimeError: out of memory")
    with pytest.raises(RuntimeError, match="rank 1: RuntimeError: out of memory"):
        sharding.ShardedEncoder(Echo(), "cpu", chunk_size=2).encode(pairs, batch_size=4)
    # rank 0's own failure still meets the gather (no rank left waiting), then is raised
    gathered = []
    monkeypatch.setattr(distributed, "gather", lambda done: gathered.append(done) or [done, sharding._Done()])
    with pytest.raises(RuntimeError, match="rank 0: RuntimeError: out of memory"):
        sharding.ShardedEncoder(Echo(fail_on="x"), "cpu", chunk_size=2).encode(pairs, batch_size=4)
    assert gathered and gathered[0].error


def test_workers_serve_until_rank_0_leaves_even_when_it_fails(two_ranks, monkeypatch):
    jobs = iter([sharding._Job([(1, [["", "abc"]])], {"batch_size": 2}, None), sharding.STOP])
    answered = []
    monkeypatch.setattr(distributed, "scatter", lambda _: next(jobs))
    monkeypatch.setattr(distributed, "gather", lambda done: answered.append(done))
    sharding.ShardedEncoder(Echo(), "cpu").serve()
    assert [d.vectors[1].tolist() for d in answered] == [[[3.0, 1.0]]]
    # rank 0 failing mid-evaluation still sends STOP to every rank on its way out
    sent = []
    monkeypatch.setattr(distributed, "scatter", lambda objects: sent.append(objects))
    monkeypatch.setattr(distributed, "barrier", lambda: sent.append("barrier"))
    monkeypatch.setattr(distributed, "init", lambda: True)
    monkeypatch.setattr(run, "evaluate", lambda *a: (_ for _ in ()).throw(RuntimeError("scoring failed")))
    with pytest.raises(RuntimeError, match="scoring failed"):
        run.main(eval_argv(Path(tempfile.mkdtemp())))
    # then it meets the workers (who return from serve with the stop) before the group goes
    assert sent == [[sharding.STOP, sharding.STOP], "barrier"]


def test_under_torchrun_every_encode_call_names_the_rank_s_own_device(two_ranks, monkeypatch):
    from diffusion_embedder.evaluation.mteb_model import MTEBEncoder

    two_ranks["peer"] = sharding._Done()
    encoder = Echo()
    run_args = run.parse_args(eval_argv(Path(tempfile.mkdtemp())))
    model = MTEBEncoder(encoder, revision="r", name="t/echo", device=distributed.placement(run_args.device)[1])
    model.chunks.encode([["", "a"]], batch_size=2)
    assert encoder.devices == ["cpu"]  # never None: encode would pool every visible GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert distributed.placement(None) == ("cuda:1", "cuda:1")
    assert distributed.placement("cuda") == ("cuda:1", "cuda:1")
    with pytest.raises(ValueError, match=r"--device cuda:0: .*cuda:1 for rank 0 of a torchrun job \(WORLD_SIZE=2\)"):
        distributed.placement("cuda:0")


def test_a_device_pool_under_torchrun_is_refused_naming_both(two_ranks, tmp_path, capsys):
    from diffusion_embedder.evaluation import encode_corpus

    pool = "--device cuda:0,cuda:1 asks for the device pool.*torchrun job \\(WORLD_SIZE=2\\)"
    assert run.main(eval_argv(tmp_path) + ["--device", "cuda:0,cuda:1"]) == 2
    assert re.search(pool, capsys.readouterr().err)
    assert encode_corpus.main(["--base_model_name_or_path", "m", "--corpus", "c.jsonl", "--output_dir", str(tmp_path),
                               "--device", "cuda:0,cuda:1"]) == 2
    assert re.search(pool, capsys.readouterr().err)
    assert not two_ranks["sent"]  # refused before any process group or job


def test_one_process_keeps_the_device_pool():
    assert distributed.placement(None) == (None, None)  # encode's own choice: every visible GPU
    assert distributed.placement("cuda:0,cuda:1") == ("cuda:0", ["cuda:0", "cuda:1"])
    assert distributed.placement("cpu") == ("cpu", None)


def test_the_chunk_plan_depends_on_the_texts_alone():
    assert sharding.plan_chunks([1] * 5, chunk_size=2) == [(0, 2), (2, 4), (4, 5)]
    # characters bound a chunk too: long documents make small chunks, a very long one a chunk of its own
    assert sharding.plan_chunks([400, 400, 400, 2000, 10], chunk_size=8, chunk_chars=1000) == [
        (0, 2), (2, 3), (3, 4), (4, 5)]
    assert sharding.plan_chunks([], chunk_size=3) == []
    with pytest.raises(ValueError, match="chunk_size must be an integer >= 1, got 0"):
        sharding.plan_chunks([1], chunk_size=0)
