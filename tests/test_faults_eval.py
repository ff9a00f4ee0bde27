"""Fault injection for evaluation: edited local data, conflicting results, damaged cache and result files, bad
BEIR folders. Each case must end in a correct score or a clear error naming the file, never a stale number."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("MTEB_CACHE", tempfile.mkdtemp(prefix="mteb_cache_"))
os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix="hf_datasets_"))

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from diffusion_embedder.data.jsonl import DataFormatError  # noqa: E402
from diffusion_embedder.evaluation import report, result_table, results, run, tasks  # noqa: E402
from diffusion_embedder.evaluation.cache import EmbeddingCache, settings_key, text_hash  # noqa: E402
from diffusion_embedder.evaluation.local import load_local_task  # noqa: E402
from diffusion_embedder.evaluation.mteb_model import MTEBEncoder  # noqa: E402

TASK = "HandRetrieval"
INSTRUCTION = "Find the matching note:"


class VectorStandIn:
    """Embeds the vector written in each text (``v=1,0,0``) and records every input it receives."""

    def __init__(self):
        self.config = SimpleNamespace(max_length=512, doc_max_length=400, to_dict=lambda: {"kind": "vectors"})
        self.calls: list[list[list[str]]] = []

    def encode(self, sentences, batch_size=32, show_progress_bar=True, convert_to_numpy=False, **kwargs):
        self.calls.append([list(s) for s in sentences])
        return np.array([[float(x) for x in re.search(r"v=([\d,]+)", t).group(1).split(",")] for _, t in sentences])


def write_task(folder: Path) -> Path:
    """Four documents, three queries; ranks: q1 d1 first, q2 d3 first, q3 its relevant d2 second."""
    docs = {"d1": "1,0,0", "d2": "0,1,0", "d3": "0,0,1", "d4": "2,1,0"}
    queries = {"q1": "1,0,0", "q2": "0,1,2", "q3": "1,2,3"}  # no ties next to a relevant document
    (folder / "qrels").mkdir(parents=True)
    (folder / "corpus.jsonl").write_text("".join(
        json.dumps({"_id": d, "title": "", "text": f"note {d} v={v}"}) + "\n" for d, v in docs.items()))
    (folder / "queries.jsonl").write_text("".join(
        json.dumps({"_id": q, "text": f"ask {q} v={v}"}) + "\n" for q, v in queries.items()))
    (folder / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1\t1\nq2\td3\t1\nq3\td2\t1\n")
    (folder / "task.json").write_text(json.dumps({"name": TASK, "instruction": INSTRUCTION}))
    return folder


def vec(text: str) -> np.ndarray:
    return np.array([float(x) for x in re.search(r"v=([\d,]+)", text).group(1).split(",")])


def hand_ndcg_at_10(folder: Path) -> float:
    """nDCG@10 from the files themselves: cosine ranking, binary gains, log2 discount, mean over queries."""
    docs = [json.loads(line) for line in (folder / "corpus.jsonl").read_text().splitlines()]
    queries = [json.loads(line) for line in (folder / "queries.jsonl").read_text().splitlines()]
    relevant: dict[str, set[str]] = {}
    for line in (folder / "qrels" / "test.tsv").read_text().splitlines()[1:]:
        qid, did, score = line.split("\t")
        if int(score) > 0:
            relevant.setdefault(qid, set()).add(did)
    values = []
    for q in queries:
        qv = vec(q["text"])
        sims = [qv @ vec(d["text"]) / np.linalg.norm(qv) / np.linalg.norm(vec(d["text"])) for d in docs]
        ranked = [docs[i]["_id"] for i in np.argsort(-np.array(sims), kind="stable")][:10]
        dcg = sum(1 / np.log2(r + 2) for r, d in enumerate(ranked) if d in relevant[q["_id"]])
        values.append(dcg / sum(1 / np.log2(r + 2) for r in range(min(10, len(relevant[q["_id"]])))))
    return float(np.mean(values))


def evaluate(folder: Path, out: Path, overwrite: bool = False):
    args = run.EvalArguments(output_dir=str(out), local_task=[str(folder)], no_embedding_cache=True,
                             overwrite=overwrite, show_progress_bar=False)
    stand_in = VectorStandIn()
    model = MTEBEncoder(stand_in, name="test/vectors", revision="hand")
    outcome = run.evaluate(model, run.task_factories(args), args)
    return SimpleNamespace(outcome=outcome, calls=stand_in.calls, score=outcome.scores.get(TASK))


def edit_qrels(folder: Path) -> None:  # q3's relevant document becomes d4, its third
    path = folder / "qrels" / "test.tsv"
    path.write_text(path.read_text().replace("q3\td2\t1", "q3\td4\t1"))


def edit_corpus(folder: Path) -> None:  # d3 moves away from q2 (now its second)
    path = folder / "corpus.jsonl"
    path.write_text(path.read_text().replace("note d3 v=0,0,1", "note d3 v=2,0,1"))


def edit_queries(folder: Path) -> None:  # q1 now ranks its relevant d1 last
    path = folder / "queries.jsonl"
    path.write_text(path.read_text().replace("ask q1 v=1,0,0", "ask q1 v=0,3,1"))


def edit_task_json(folder: Path) -> None:
    (folder / "task.json").write_text(json.dumps({"name": TASK, "instruction": "Another instruction:"}))


# ------------------------------------------------------------------ edited local data scores again
@pytest.mark.parametrize("edit", [edit_qrels, edit_corpus, edit_queries, edit_task_json], ids=lambda f: f.__name__)
def test_editing_a_local_task_file_scores_the_task_again(tmp_path, edit):
    folder, out = write_task(tmp_path / "task"), tmp_path / "out"
    first = evaluate(folder, out)
    assert first.score == pytest.approx(hand_ndcg_at_10(folder), abs=1e-5)
    unchanged = evaluate(folder, out)
    assert unchanged.calls == [] and unchanged.score == first.score  # a finished task is skipped
    edit(folder)
    second = evaluate(folder, out)
    assert second.calls, "the edited task must be scored again, not served from the stored result"
    assert second.score == pytest.approx(hand_ndcg_at_10(folder), abs=1e-5)
    if edit is edit_task_json:
        assert {i for call in second.calls for i, _ in call} >= {"Another instruction:"}
    else:
        assert second.score != pytest.approx(first.score)
    stored = json.loads(next(out.rglob(f"{TASK}.json")).read_text())
    assert stored["dataset_revision"] == load_local_task(str(folder)).metadata.revision


def test_a_hub_task_scores_again_when_its_dataset_revision_differs(tmp_path):
    """Hub tasks carry mteb's dataset revision (plus, for a --data_dir copy, a fingerprint of its files); a stored
    result of another revision is not reused."""
    from test_eval_hub_layout import write_repo

    write_repo(tmp_path / "data" / "mteb" / "BRIGHT", {
        "documents": {"biology": [{"id": "x1", "content": "mitosis v=1,0"}, {"id": "x2", "content": "enzymes v=0,1"}]},
        "examples": {"biology": [{"id": "b1", "query": "why do cells divide? v=1,0", "reasoning": "",
                                  "excluded_ids": ["N/A"], "gold_ids": ["x1"], "gold_ids_long": ["x1"]}]},
    })
    args = run.EvalArguments(output_dir=str(tmp_path / "out"), data_dir=str(tmp_path / "data"), no_embedding_cache=True,
                             task_name=["BrightBiologyRetrieval"], show_progress_bar=False)

    def score():
        stand_in = VectorStandIn()
        model = MTEBEncoder(stand_in, name="test/vectors", revision="hub")
        outcome = run.evaluate(model, run.task_factories(args), args)
        return outcome, stand_in.calls

    first, encoded = score()
    assert encoded  # scored: the model was asked for vectors
    assert first.scores["BrightBiologyRetrieval"] == pytest.approx(1.0)
    result = next((tmp_path / "out").rglob("BrightBiologyRetrieval.json"))
    revision = json.loads(result.read_text())["dataset_revision"]
    assert revision == run.task_factories(args)[0][1]().metadata.revision  # mteb's own revision of the task
    _, calls = score()
    assert calls == []  # same revision: reused
    stored = json.loads(result.read_text())
    result.write_text(json.dumps({**stored, "dataset_revision": "an-older-revision"}))
    _, calls = score()
    assert calls, "a result of another dataset revision must not be reused"
    assert json.loads(result.read_text())["dataset_revision"] == revision
    # an edited local copy (--data_dir) is other data: scored again, on the edited rows (not datasets' old cache)
    examples = tmp_path / "data" / "mteb" / "BRIGHT" / "examples" / "biology.jsonl"
    examples.write_text(examples.read_text().replace("why do cells divide? v=1,0", "why do cells divide? v=0,1"))
    edited, calls = score()
    assert calls and {t for call in calls for _, t in call} >= {"why do cells divide? v=0,1"}
    assert edited.scores["BrightBiologyRetrieval"] == pytest.approx(1 / np.log2(3), abs=1e-5)  # x1 now second


def test_an_edited_followir_copy_scores_p_mrr_with_its_edited_qrel_diff(tmp_path, monkeypatch):
    """mteb's FollowIR tasks read ``qrel_diff`` while scoring, after ``load_data``: that read must come from the
    edited copy too, not from ``datasets``' cache of the copy as it was."""
    import datasets
    from test_eval_hub_layout import write_core17

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_datasets")
    repo = tmp_path / "data" / "mteb" / "Core17InstructionRetrieval"
    write_core17(repo, {"1": ["d1"], "2": ["d3", "d4"]})
    args = run.EvalArguments(output_dir=str(tmp_path / "out"), data_dir=str(tmp_path / "data"),
                             no_embedding_cache=True, task_name=["Core17InstructionRetrieval"], show_progress_bar=False)

    def score():
        outcome = run.evaluate(MTEBEncoder(VectorStandIn(), name="test/vectors", revision="hub"),
                               run.task_factories(args), args)
        assert not outcome.failures, outcome.failures
        return outcome.scores["Core17InstructionRetrieval"]

    # by hand (FollowIR's rank score): topic 1's d1, 1st -> 4th: 1 - 1/4 = 0.75; topic 2's d3, 2nd -> 1st:
    # (1/2) / 1 - 1 = -0.5, its d4, 1st -> 2nd: 1 - 1/2 = 0.5. p-MRR is the mean over topics of their mean.
    assert score() == pytest.approx((0.75 + (-0.5 + 0.5) / 2) / 2)
    (repo / "qrel_diff" / "qrel_diff.jsonl").write_text(json.dumps({"query-id": "1", "corpus-ids": ["d1"]}) + "\n"
                                                        + json.dumps({"query-id": "2", "corpus-ids": ["d3"]}) + "\n")
    assert score() == pytest.approx((0.75 - 0.5) / 2)  # topic 2's changed document is d3 alone now


def test_a_changed_shipped_instruction_scores_the_task_again(tmp_path, monkeypatch, caplog):
    """Without --task_to_instructions_fp the shipped file decides the query instruction; a package upgrade that
    changes it (here: an edited copy of the shipped file) must score the task again, at the standard path."""
    shipped = tmp_path / "package"
    shipped.mkdir()
    mapping = shipped / "task_to_instructions.json"

    def files(package):
        assert package == "diffusion_embedder.evaluation"
        return shipped

    monkeypatch.setattr(tasks, "resources", SimpleNamespace(files=files))
    folder, out = write_task(tmp_path / "task"), tmp_path / "out"
    args = run.EvalArguments(output_dir=str(out), local_task=[str(folder)], no_embedding_cache=True,
                             show_progress_bar=False, model_name="test/vectors", revision="hand")

    def score(instructions: dict[str, str]) -> set[str]:
        mapping.write_text(json.dumps(instructions))
        stand_in = VectorStandIn()
        outcome = run.evaluate(run.wrap_encoder(stand_in, args), run.task_factories(args), args)
        assert outcome.scores[TASK] == pytest.approx(hand_ndcg_at_10(folder), abs=1e-5)
        return {i for call in stand_in.calls for i, _ in call}

    assert score({TASK: "Old shipped instruction:"}) >= {"Old shipped instruction:"}
    assert score({TASK: "Old shipped instruction:"}) == set()  # unchanged: reused, nothing encoded
    with caplog.at_level(logging.WARNING, logger="diffusion_embedder.evaluation.run"):
        assert score({TASK: "New shipped instruction:"}) >= {"New shipped instruction:"}
    assert "query instruction changed" in caplog.text and "New shipped instruction:" in caplog.text
    assert score({}) >= {INSTRUCTION}  # gone from the file: the task's own prompt (task.json), scored again
    (next(out.rglob(results.INSTRUCTIONS_FILE))).unlink()  # a result of an older version: no record, not trusted
    assert score({}) >= {INSTRUCTION}
    assert score({}) == set()
    assert len(list(out.rglob(f"{TASK}.json"))) == 1 and not list(out.rglob("experiments"))


# ------------------------------------------------------------------ two results for one column
def test_report_refuses_two_different_results_for_one_checkpoint_and_task(tmp_path):
    folder = write_task(tmp_path / "task")
    before = hand_ndcg_at_10(folder)
    evaluate(folder, tmp_path / "before")
    shutil.copytree(tmp_path / "before", tmp_path / "copy")
    edit_qrels(folder)
    evaluate(folder, tmp_path / "after")
    with pytest.raises(ValueError, match="Two different results") as err:
        result_table.load_results([str(tmp_path / "before"), str(tmp_path / "after")])
    files = [str(p) for p in (tmp_path / "before").rglob(f"{TASK}.json")] + [
        str(p) for p in (tmp_path / "after").rglob(f"{TASK}.json")]
    assert all(f in str(err.value) for f in files)
    # the same result twice (a copied folder) is one column, not a conflict
    table = result_table.load_results([str(tmp_path / "before"), str(tmp_path / "copy")])
    assert len(table.models) == 1
    assert table.scores[table.models[0]][TASK] == pytest.approx(100 * before, abs=1e-3)


@pytest.mark.parametrize("main_score, label", [("precision_at_1", "Precision@1"), ("recall_at_1", "Recall@1")])
def test_the_report_labels_a_local_task_with_the_metric_its_task_json_names(tmp_path, main_score, label):
    """With one relevant document per query, found first for q1 and q2 and second for q3, precision@1, recall@1
    and nDCG@1 are all 2/3: the row carries the metric task.json names, not one whose value matches."""
    folder, out = write_task(tmp_path / "task"), tmp_path / "out"
    (folder / "task.json").write_text(json.dumps({"name": TASK, "instruction": INSTRUCTION, "main_score": main_score}))
    assert evaluate(folder, out).score == pytest.approx(2 / 3, abs=1e-5)
    markdown, _ = report.write_report([str(out)])
    assert f"| local | {TASK} | {label} | 66.67 |" in markdown


# ------------------------------------------------------------------ damaged files
def test_a_truncated_result_file_names_the_file_and_the_fix(tmp_path):
    folder, out = write_task(tmp_path / "task"), tmp_path / "out"
    evaluate(folder, out)
    result = next(out.rglob(f"{TASK}.json"))
    result.write_text(result.read_text()[:40])
    broken = evaluate(folder, out)
    assert broken.calls == [] and TASK not in broken.outcome.scores
    message = broken.outcome.failures[TASK]
    assert str(result) in message and "--overwrite" in message
    with pytest.raises(ValueError, match="--overwrite") as err:
        result_table.load_results([str(out)])
    assert str(result) in str(err.value)
    fixed = evaluate(folder, out, overwrite=True)
    assert fixed.score == pytest.approx(hand_ndcg_at_10(folder), abs=1e-5)


def test_report_check_names_what_mteb_result_cache_cannot_read(tmp_path, capsys):
    """The README sends users to mteb's ResultCache, which raises a bare JSONDecodeError on a truncated result:
    ``report --check`` names every such file first (exit 1), and says so when all read (exit 0)."""
    folder, out = write_task(tmp_path / "task"), tmp_path / "out"
    evaluate(folder, out)
    assert report.main([str(out), "--check"]) == 0
    assert "Every result file reads" in capsys.readouterr().out
    result = next(out.rglob(f"{TASK}.json"))
    result.write_text(result.read_text()[:40])
    import mteb

    with pytest.raises(json.JSONDecodeError):  # the premise: mteb's own reader does not name the file
        mteb.ResultCache(cache_path=str(out)).load_results()
    assert report.main([str(out), "--check", "--out_dir", str(tmp_path / "rep")]) == 1
    printed = capsys.readouterr().out
    assert str(result) in printed and "--overwrite" in printed and "1 unreadable" in printed
    assert not (tmp_path / "rep").exists()


def test_report_names_a_folder_without_results_and_writes_nothing(tmp_path, capsys):
    folder, out = write_task(tmp_path / "task"), tmp_path / "out"
    evaluate(folder, out)
    empty = tmp_path / "not_evaluated"
    empty.mkdir()
    assert report.main([str(out), str(empty), "--out_dir", str(tmp_path / "rep")]) == 2
    err = capsys.readouterr().err
    assert str(empty) in err and "no evaluation results" in err and "Traceback" not in err
    assert not (tmp_path / "rep").exists()


def test_a_damaged_model_meta_names_the_file(tmp_path):
    folder = tmp_path / "results" / "m" / "r"
    folder.mkdir(parents=True)
    (folder / "model_meta.json").write_text('{"name": "m",')
    with pytest.raises(ValueError, match=r"model_meta.json:1: not valid JSON"):
        result_table.load_results([str(tmp_path)])


def truncate_rows(folder: Path, shard: str) -> None:
    path = folder / f"{shard}.npy"
    path.write_bytes(path.read_bytes()[:-8])


def empty_rows(folder: Path, shard: str) -> None:
    (folder / f"{shard}.npy").write_bytes(b"")


def delete_rows(folder: Path, shard: str) -> None:
    (folder / f"{shard}.npy").unlink()


def truncate_keys(folder: Path, shard: str) -> None:
    path = folder / f"{shard}.keys.json"
    path.write_text(path.read_text()[:30])


def extra_key(folder: Path, shard: str) -> None:  # one key more than rows: every row after it would shift
    path = folder / f"{shard}.keys.json"
    record = json.loads(path.read_text())
    path.write_text(json.dumps({**record, "texts": ["0" * 64, *record["texts"]]}))


def flip_a_byte(folder: Path, shard: str) -> None:  # one float's bits change; size, header and shape stay intact
    path = folder / f"{shard}.npy"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10
    path.write_bytes(bytes(data))
    rows = np.load(path)
    assert rows.shape == (2, 2) and rows.dtype == np.float32 and np.isfinite(rows).all()


def without_checksum(folder: Path, shard: str) -> None:  # the key file of older versions: a bare list of hashes
    path = folder / f"{shard}.keys.json"
    path.write_text(json.dumps(shard_text_hashes(path)))


def shard_text_hashes(keys_file: Path) -> list[str]:
    record = json.loads(keys_file.read_text())
    return record["texts"] if isinstance(record, dict) else record


@pytest.mark.parametrize("damage", [truncate_rows, empty_rows, delete_rows, truncate_keys, extra_key, flip_a_byte,
                                    without_checksum], ids=lambda f: f.__name__)
def test_a_damaged_cache_shard_is_discarded_named_and_rebuilt(tmp_path, caplog, damage):
    first, second = ["alpha v=1,2", "beta v=3,1"], ["gamma v=0,5", "delta v=2,2"]
    texts = first + second
    expected = np.stack([vec(t) for t in texts]).astype(np.float32)
    encoded: list[str] = []

    def encode(batch):
        encoded.extend(batch)
        return np.stack([vec(t) for t in batch])

    settings = {"role": "document"}
    cache = EmbeddingCache(str(tmp_path))
    cache.get_or_encode(first, encode, "model@rev", settings)  # shard 1
    cache.get_or_encode(second, encode, "model@rev", settings)  # shard 2
    folder = tmp_path / settings_key("model@rev", settings)
    shards = {p.name[: -len(".keys.json")]: shard_text_hashes(p) for p in folder.glob("*.keys.json")}
    damaged = next(s for s, keys in shards.items() if text_hash(first[0]) in keys)
    damage(folder, damaged)
    encoded.clear()
    with caplog.at_level(logging.WARNING, logger="diffusion_embedder.evaluation.cache"):
        out = EmbeddingCache(str(tmp_path)).get_or_encode(texts, encode, "model@rev", settings)
    np.testing.assert_array_equal(out, expected)
    assert encoded == first  # only the damaged shard's texts were encoded again
    assert damaged in caplog.text and "discarding" in caplog.text
    encoded.clear()
    again = EmbeddingCache(str(tmp_path)).get_or_encode(texts, encode, "model@rev", settings)
    np.testing.assert_array_equal(again, expected)
    assert encoded == []  # rebuilt once, no loop


# ------------------------------------------------------------------ bad BEIR folders
def good_folder(tmp_path: Path) -> Path:
    return write_task(tmp_path / "task")


@pytest.mark.parametrize(
    ("file", "content", "message"),
    [
        ("corpus.jsonl", "", r"corpus.jsonl: no records \(the file is empty\)"),
        ("queries.jsonl", "\n", r"queries.jsonl: no records \(the file is empty\)"),
        ("corpus.jsonl", '{"_id": "d1", "text": "a v=1,0,0"}\n{"_id": "d2", "text": null}\n',
         r"corpus.jsonl:2: field 'text' is null"),
        ("queries.jsonl", '{"_id": "q1", "text": null}\n', r"queries.jsonl:1: field 'text' is null"),
        ("corpus.jsonl", '{"_id": "d1", "text": "a"}\n{"_id": "d2", "text": "b"}\n{"_id": "d1", "text": "c"}\n',
         r"corpus.jsonl:3: duplicate _id 'd1' \(first on line 1\)"),
        ("queries.jsonl", '{"_id": "q1", "text": "a"}\n\n{"_id": "q1", "text": "b"}\n',
         r"queries.jsonl:3: duplicate _id 'q1' \(first on line 1\)"),
        ("task.json", '{"name": "X",\n "instruction": }', r"task.json:2: not valid JSON"),
        ("task.json", '["X"]', r"task.json: expected a JSON object"),
        ("task.json", '{"nmae": "X"}', r"task.json: unknown key\(s\) \['nmae'\]"),
        ("task.json", '{"name": 3}', r"task.json: 'name' must be a string, got int"),
    ],
    ids=["empty-corpus", "empty-queries", "null-doc", "null-query", "dup-doc", "dup-query", "task-json-syntax",
         "task-json-list", "task-json-key", "task-json-type"],
)
def test_bad_beir_folders_are_errors_naming_file_and_line(tmp_path, file, content, message):
    folder = good_folder(tmp_path)
    (folder / file).write_text(content)
    with pytest.raises(DataFormatError, match=message) as err:
        load_local_task(str(folder))
    assert str(folder / file) in str(err.value)


def test_a_query_without_relevant_documents_is_a_warning_with_the_count(tmp_path, caplog):
    folder = good_folder(tmp_path)
    (folder / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1\t1\nq2\td3\t0\n")
    with caplog.at_level(logging.WARNING, logger="diffusion_embedder.evaluation.local"):
        load_local_task(str(folder))
    assert "2 of 3 queries" in caplog.text and "queries.jsonl" in caplog.text and "'q2'" in caplog.text
