"""``mine`` end to end: two torchrun ranks write the file one process writes; a killed run resumes without encoding
its finished chunks again; the docs page's example (mine, train with ``num_negatives: 3`` through
``run_supervised.py``, evaluate) runs as written; sentence-transformers' ``mine_hard_negatives`` on our export of the
same encoder gives the same negatives."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import LLAMA_FIXTURE, ROOT

from diffusion_embedder.evaluation import encode_corpus, store
from diffusion_embedder.mining import mine_hard_negatives

BEIR = ROOT / "tests" / "fixtures" / "beir" / "reasonaug"
SCRIPT = ROOT / "experiments" / "mine_negatives.py"


def env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
                PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))


def beir_pairs(folder: Path) -> Path:
    """The BEIR fixture's 20 queries with their 100 judged documents as positives: 100 pairs."""
    corpus = {d["_id"]: d["text"] for d in map(json.loads, (BEIR / "corpus.jsonl").read_text().splitlines())}
    queries = {d["_id"]: d["text"] for d in map(json.loads, (BEIR / "queries.jsonl").read_text().splitlines())}
    rows = [line.split("\t") for line in (BEIR / "qrels" / "test.tsv").read_text().splitlines()[1:]]
    path = folder / "pairs.jsonl"
    path.write_text("".join(json.dumps({"query": queries[q], "positive": corpus[c],
                                        "instruction": "Retrieve the problems"}) + "\n" for q, c, _ in rows))
    return path


def argv(pairs: Path, out: Path, *extra: str) -> list[str]:
    return ["--base_model_name_or_path", str(LLAMA_FIXTURE), "--pairs", str(pairs), "--corpus",
            str(BEIR / "corpus.jsonl"), "--output_dir", str(out), "--chunk_size", "16", "--batch_size", "8",
            "--no_progress_bar", "--relative_margin", "null", "--range_max", "12", "--output_scores", *extra]


def torchrun(script: Path, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
               *args]  # --standalone: a free port of its own
    return subprocess.run(command, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)


def test_two_torchrun_ranks_write_the_file_one_process_writes(tmp_path):
    from diffusion_embedder.mining.cli import main

    pairs = beir_pairs(tmp_path)
    assert main(argv(pairs, tmp_path / "one")) == 0
    result = torchrun(SCRIPT, *argv(pairs, tmp_path / "two"))
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]
    assert result.stdout.count("records mined") == 1  # rank 0 mines and prints
    one, two = (tmp_path / name / "negatives.jsonl" for name in ("one", "two"))
    assert two.read_bytes() == one.read_bytes() and len(one.read_text().splitlines()) == 100
    for name in ("documents", "queries"):
        ids, vectors = store.load_embeddings(str(tmp_path / "one" / name))
        ids2, vectors2 = store.load_embeddings(str(tmp_path / "two" / name))
        assert ids == ids2 and (vectors == vectors2).all()
    shards = json.loads((tmp_path / "two" / "documents" / "manifest.json").read_text())["num_shards"]
    assert shards == 2  # the chunks were shared out


DYING = """
import os, signal, sys
from diffusion_embedder.mining.cli import main

real_replace, records = os.replace, []

def replace(src, dst):
    real_replace(src, dst)
    if os.fspath(dst).endswith(".json") and "chunk-" in os.fspath(dst):
        records.append(dst)
        if len(records) == 3:  # killed with three document chunks complete
            os.kill(os.getpid(), signal.SIGKILL)

os.replace = replace
sys.exit(main(sys.argv[1:]))
"""


def test_a_killed_run_resumes_without_encoding_its_finished_chunks_again(tmp_path, monkeypatch):
    pairs = beir_pairs(tmp_path)
    script = tmp_path / "dying.py"
    script.write_text(textwrap.dedent(DYING))
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, str(script), *argv(pairs, out)], cwd=ROOT, env=env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and not (out / "negatives.jsonl").exists()
    done = sorted(p.name for p in (out / "documents").glob("chunk-*.json"))
    assert done == ["chunk-000000.json", "chunk-000001.json", "chunk-000002.json"]
    encoded = []
    real = encode_corpus.encode_chunk
    monkeypatch.setattr(encode_corpus, "encode_chunk", lambda e, pairs_, *a, **k: encoded.append(pairs_[0][1])
                        or real(e, pairs_, *a, **k))
    from diffusion_embedder.mining.cli import main

    assert main(argv(pairs, out)) == 0
    documents = [json.loads(line)["text"] for line in (BEIR / "corpus.jsonl").read_text().splitlines()]
    num_chunks = json.loads((out / "documents" / "manifest.json").read_text())["chunks"]["num_chunks"]
    queries = json.loads((out / "queries" / "manifest.json").read_text())["chunks"]["num_chunks"]
    assert len(encoded) == num_chunks - 3 + queries  # every document chunk but the three finished, the queries
    assert not {documents[0], documents[16], documents[32]} & set(encoded)  # the finished chunks' first texts
    assert main(argv(pairs, tmp_path / "fresh")) == 0
    assert (out / "negatives.jsonl").read_bytes() == (tmp_path / "fresh" / "negatives.jsonl").read_bytes()


def bash_blocks(page: str) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", (ROOT / page).read_text(encoding="utf-8"), flags=re.S | re.M)


def test_the_docs_page_s_example_mines_trains_with_three_negatives_and_evaluates(tmp_path):
    """docs/mining.md's first block runs as written from a checkout's root (here a folder with the checkout's
    fixtures, configs and scripts): the mined file trains (diffusion-embedder train) with num_negatives 3."""
    pytest.importorskip("mteb")
    for name in ("tests", "train_configs", "experiments"):
        (tmp_path / name).symlink_to(ROOT / name)
    block = bash_blocks("docs/mining.md")[0]
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, env=env(), capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    mined = [json.loads(line) for line in (tmp_path / "mined" / "negatives.jsonl").read_text().splitlines()]
    assert len(mined) > 80 and all(len(r["negatives"]) == 3 for r in mined)
    config = json.loads((ROOT / "train_configs" / "tiny" / "mined.json").read_text())
    assert config["dataset_file_path"] == "mined/negatives.jsonl" and config["num_negatives"] == 3
    # the training read every mined record with its three negatives (none dropped for having fewer)
    assert f"Custom(mined/negatives.jsonl): {len(mined)} samples" in result.stderr
    assert "record(s) with fewer than 3 negatives" not in result.stderr
    trained = tmp_path / "output" / "tiny" / "tiny_mined"
    assert (trained / "adapter_model.safetensors").exists()
    assert "ReasonAugConceptRetrieval: " in result.stdout
    # the trainer's batches held three negatives per query: the collator's column is 3 x the batch
    from diffusion_embedder.data import ContrastiveCollator, Custom

    samples = Custom(tmp_path / "mined" / "negatives.jsonl", num_negatives=config["num_negatives"])
    assert [s.negatives for s in samples.samples[:2]] == [[("", n) for n in r["negatives"]] for r in mined[:2]]
    batch = ContrastiveCollator(lambda pairs: {"n": len(pairs)}, num_negatives=3)(samples.samples[:4])
    assert batch["negatives"] == {"n": 12}


def test_sentence_transformers_mines_the_same_negatives_from_our_export(tmp_path):
    """sentence-transformers 6.2's mine_hard_negatives on the exported fixture encoder (its stock modules) and ours
    give the same negatives, query by query, for top sampling with a range window and each score filter. ST has no
    instructions for queries: the pairs have none. Ties: none within the float32 rounding of these scores (checked)."""
    st = pytest.importorskip("sentence_transformers")
    from datasets import Dataset
    from sentence_transformers.util import mine_hard_negatives as st_mine

    from diffusion_embedder import Encoder

    encoder = Encoder.from_pretrained(str(LLAMA_FIXTURE), skip_instruction=False, pooling_mode="mean", device="cpu")
    encoder.save(str(tmp_path / "st"), format="sentence-transformers")
    model = st.SentenceTransformer(str(tmp_path / "st"), device="cpu")
    assert [type(m).__name__ for m in model] == ["Transformer", "Pooling"]  # stock modules, no remote code
    rows = [json.loads(line) for line in beir_pairs(tmp_path).read_text().splitlines()]
    pairs = [{"query": r["query"], "positive": r["positive"]} for r in rows]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    corpus = [json.loads(line)["text"] for line in (BEIR / "corpus.jsonl").read_text().splitlines()]
    settings = [{"range_min": 2, "range_max": 12}, {"range_max": 10, "relative_margin": 0.01},
                {"range_max": 10, "absolute_margin": 0.005}, {"range_min": 1, "range_max": 15, "max_score": 0.8},
                {"range_max": 10, "min_score": 0.75}]
    for options in settings:
        theirs = st_mine(Dataset.from_list(pairs), model, corpus=corpus, num_negatives=3, output_format="triplet",
                         output_scores=True, verbose=False, cache_folder=str(tmp_path / "st_cache"), **options)
        expected: dict[tuple[str, str], list[str]] = {}
        for r in theirs:
            expected.setdefault((r["query"], r["positive"]), []).append(r["negative"])
        out = tmp_path / "ours"  # the stores are encoded once, each setting mined from them
        mine_hard_negatives(str(tmp_path / "pairs.jsonl"), str(out), str(BEIR / "corpus.jsonl"), encoder=encoder,
                            num_negatives=3, keep_fewer=True, output_scores=True,
                            **({"relative_margin": None} | options))
        ours = {(r["query"], r["positive"]): r for r in map(json.loads, (out / "negatives.jsonl").read_text()
                                                              .splitlines())}
        assert {k: r["negatives"] for k, r in ours.items() if r["negatives"]} == expected, options
        # no tie decided by rounding: neighbouring negatives' scores differ by far more than float32 rounding
        for r in ours.values():
            gaps = [a - b for a, b in zip(r["negative_scores"], r["negative_scores"][1:], strict=False)]
            assert all(g > 1e-5 for g in gaps)


def test_the_gpu_benchmark_s_dry_run_mines_and_reports_its_throughput():
    """``bench/mine.py --gpu --dry-run`` runs the GPU path (a random encoder of the tiny shape, the whole mining call)
    on the CPU and prints the throughput row, so the GPU run does not meet its first error on the GPU."""
    result = subprocess.run([sys.executable, "bench/mine.py", "--gpu", "--dry-run"], cwd=ROOT, env=env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "Device: CPU dry run (tiny shape); 300 documents" in result.stdout
    row = re.search(r"^\| ([\d.]+) \| ([\d.]+) \| ([\d.]+)% \| ([\d.]+) \|$", result.stdout, re.M)
    assert row and float(row[1]) > 0 and float(row[2]) > 0 and 0 < float(row[3]) < 100
