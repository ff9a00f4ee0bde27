"""End to end through mteb.evaluate on local BEIR folders: scores against independent computations."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import LLAMA_FIXTURE

from diffusion_embedder import Encoder
from diffusion_embedder.evaluation import report, run
from diffusion_embedder.evaluation.local import load_local_task

BEIR = Path(__file__).parent / "fixtures" / "beir"
REASONAUG = BEIR / "reasonaug"
INSTRUCTIONS = BEIR / "instructions"
REASONAUG_INSTRUCTION = "Given a problem, retrieve the relevant problems that can be solved by the similar concept:"


class Recording:
    """Delegates to a real Encoder and records every list of inputs ``encode`` receives."""

    def __init__(self, encoder):
        self.encoder = encoder
        self.calls: list[list] = []

    def __getattr__(self, name):
        return getattr(self.encoder, name)

    def encode(self, sentences, **kwargs):
        self.calls.append([list(s) for s in sentences])
        return self.encoder.encode(sentences, **kwargs)


class VectorStandIn:
    """Reads the vector written in each text (``v=4,3,2,1``), so every rank in the hand fixture is known."""

    def __init__(self):
        self.config = SimpleNamespace(max_length=512, doc_max_length=400, to_dict=lambda: {"kind": "vectors"})

    def encode(self, sentences, batch_size=32, show_progress_bar=True, convert_to_numpy=False, **kwargs):
        return np.array([[float(x) for x in re.search(r"v=([\d,]+)", t).group(1).split(",")] for _, t in sentences])


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def ndcg_at_10(query_emb: np.ndarray, doc_emb: np.ndarray, qrels: list[set[int]]) -> float:
    """Cosine ranking, binary gains, log2 discount; averaged over queries."""
    q = query_emb / np.linalg.norm(query_emb, axis=1, keepdims=True)
    d = doc_emb / np.linalg.norm(doc_emb, axis=1, keepdims=True)
    return ranked_ndcg_at_10(q @ d.T, qrels)


def ranked_ndcg_at_10(scores: np.ndarray, qrels: list[set[int]]) -> float:
    """nDCG@10 of a (queries x documents) score matrix: binary gains, log2 discount; averaged over queries."""
    values = []
    for i, relevant in enumerate(qrels):
        top = np.argsort(-scores[i])[:10]
        dcg = sum(1.0 / np.log2(rank + 2) for rank, doc in enumerate(top) if doc in relevant)
        idcg = sum(1.0 / np.log2(rank + 2) for rank in range(min(10, len(relevant))))
        values.append(dcg / idcg)
    return float(np.mean(values))


@pytest.fixture(scope="module")
def encoder():
    return Encoder.from_pretrained(str(LLAMA_FIXTURE), torch_dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def reasonaug_runs(encoder, tmp_path_factory):
    """Two passes of the ReasonAug task (and a broken task in the first) with the recorded tiny Encoder."""
    out = tmp_path_factory.mktemp("eval")
    broken = tmp_path_factory.mktemp("broken")
    for name in ("corpus.jsonl", "queries.jsonl", "task.json"):
        (broken / name).write_text((REASONAUG / name).read_text())
    (broken / "qrels").mkdir()
    (broken / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq1\tmissing-doc\t1\n")
    args = run.EvalArguments(output_dir=str(out), batch_size=8, local_task=[str(broken), str(REASONAUG)])
    passes = []
    for overwrite in (False, True):
        args.overwrite = overwrite
        recorded = Recording(encoder)
        model = run.wrap_encoder(recorded, args)
        outcome = run.evaluate(model, run.task_factories(args), args)
        passes.append(SimpleNamespace(outcome=outcome, calls=recorded.calls, cache=model.cache, model=model, out=out))
        args.local_task = [str(REASONAUG)]
    return passes


def test_mteb_ndcg_equals_an_independent_numpy_computation(reasonaug_runs, encoder):
    first = reasonaug_runs[0].outcome
    queries, corpus = read_jsonl(REASONAUG / "queries.jsonl"), read_jsonl(REASONAUG / "corpus.jsonl")
    assert len(queries) == 20 and len(corpus) == 100
    doc_index = {d["_id"]: i for i, d in enumerate(corpus)}
    qrels = [{doc_index[f"c{q['_id'][1:]}r{r}"] for r in range(2, 7)} for q in queries]
    query_emb = encoder.encode([[REASONAUG_INSTRUCTION, q["text"]] for q in queries], convert_to_numpy=True)
    doc_emb = encoder.encode([["", d["text"]] for d in corpus], convert_to_numpy=True)
    expected = ndcg_at_10(query_emb, doc_emb, qrels)
    assert first.scores["ReasonAugConceptRetrieval"] == pytest.approx(expected, abs=1e-5)
    assert 0.1 < expected < 1.0  # a real ranking, not a degenerate one


@pytest.mark.parametrize("similarity", ["dot", "euclidean", "manhattan"])
def test_results_are_scored_with_the_encoders_similarity_function(similarity, encoder, tmp_path):
    queries, corpus = read_jsonl(REASONAUG / "queries.jsonl"), read_jsonl(REASONAUG / "corpus.jsonl")
    doc_index = {d["_id"]: i for i, d in enumerate(corpus)}
    qrels = [{doc_index[f"c{q['_id'][1:]}r{r}"] for r in range(2, 7)} for q in queries]
    q = encoder.encode([[REASONAUG_INSTRUCTION, x["text"]] for x in queries], convert_to_numpy=True).astype(np.float64)
    d = encoder.encode([["", x["text"]] for x in corpus], convert_to_numpy=True).astype(np.float64)
    differences = q[:, None, :] - d[None, :, :]
    scores = {"dot": q @ d.T, "euclidean": -np.sqrt((differences**2).sum(-1)),
              "manhattan": -np.abs(differences).sum(-1)}[similarity]
    expected = ranked_ndcg_at_10(scores, qrels)
    assert expected != pytest.approx(ndcg_at_10(q, d, qrels), abs=1e-4)  # the ranking is not cosine's
    assert run.main(["--base_model_name_or_path", str(LLAMA_FIXTURE), "--local_task", str(REASONAUG),
                     "--output_dir", str(tmp_path), "--device", "cpu", "--torch_dtype", "float32",
                     "--similarity_fn_name", similarity, "--no_progress_bar"]) == 0
    (saved,) = tmp_path.rglob(f"experiments/similarity_fn_name_{similarity}/ReasonAugConceptRetrieval.json")
    assert json.loads(saved.read_text())["scores"]["test"][0]["ndcg_at_10"] == pytest.approx(expected, abs=1e-5)


def test_documents_never_carry_the_query_instruction(reasonaug_runs):
    calls = reasonaug_runs[0].calls
    doc_texts = {d["text"] for d in read_jsonl(REASONAUG / "corpus.jsonl")}
    query_texts = {q["text"] for q in read_jsonl(REASONAUG / "queries.jsonl")}
    doc_calls = [c for c in calls if {t for _, t in c} <= doc_texts]
    query_calls = [c for c in calls if {t for _, t in c} <= query_texts]
    assert sum(len(c) for c in doc_calls) == 100 and sum(len(c) for c in query_calls) == 20
    assert all(instruction == "" for c in doc_calls for instruction, _ in c)
    assert all(instruction == REASONAUG_INSTRUCTION for c in query_calls for instruction, _ in c)


def test_second_pass_encodes_no_document(reasonaug_runs):
    first, second = reasonaug_runs
    assert first.cache.stats.encoded == 100
    assert second.cache.stats.encoded == 0 and second.cache.stats.hits == 100
    assert all(len(c) == 20 for c in second.calls)  # only the queries reached the encoder
    assert second.outcome.scores == pytest.approx(first.outcome.scores, abs=1e-6)


def test_a_failing_task_does_not_lose_the_others(reasonaug_runs):
    outcome = reasonaug_runs[0].outcome
    assert len(outcome.failures) == 1
    assert "missing-doc" in next(iter(outcome.failures.values()))
    saved = Path(outcome.results_dir) / "ReasonAugConceptRetrieval.json"
    assert json.loads(saved.read_text())["task_name"] == "ReasonAugConceptRetrieval"


def test_another_checkpoint_gets_its_own_results(reasonaug_runs, family_checkpoint):
    first = reasonaug_runs[0]
    args = run.EvalArguments(output_dir=str(first.out), batch_size=8, local_task=[str(REASONAUG)])
    other = Encoder.from_pretrained(str(family_checkpoint("llama")), torch_dtype=torch.float32, device="cpu")
    recorded = Recording(other)
    outcome = run.evaluate(run.wrap_encoder(recorded, args), run.task_factories(args), args)
    assert outcome.results_dir != first.outcome.results_dir
    assert recorded.calls, "the other checkpoint must be evaluated, not served from the first one's results"
    name = "ReasonAugConceptRetrieval"
    assert outcome.scores[name] != pytest.approx(first.outcome.scores[name])
    # the same name and revision forced onto other weights is refused
    forced = run.EvalArguments(**{**vars(args), "model_name": first.model.identity["name"],
                                  "revision": first.model.identity["revision"]})
    with pytest.raises(RuntimeError, match="another checkpoint"):
        run.evaluate(run.wrap_encoder(other, forced), run.task_factories(forced), forced)
    # the report puts both models side by side, scores x 100, with the benchmark average
    markdown, table = report.write_report([args.output_dir], str(Path(args.output_dir) / "report"))
    assert len(table.models) == 2
    for model in table.models:
        score = table.scores[model]["ReasonAugConceptRetrieval"]
        assert table.average(model, "local") == pytest.approx(score)
    assert f"{100 * outcome.scores['ReasonAugConceptRetrieval']:.2f}" in markdown
    assert (Path(args.output_dir) / "report" / "local.png").stat().st_size > 1000
    assert (Path(args.output_dir) / "report" / "report.csv").read_text().startswith("benchmark,task,")


def test_pmrr_equals_the_hand_computation(tmp_path):
    """Ranks from the fixture's vectors (cosine against one-hot documents d1..d4):

    topic 1  og      v=4,3,2,1 -> d1 1st, d2, d3, d4      changed v=1,3,2,4 -> d4, d2, d3, d1 4th
    topic 2  og      v=1,2,3,4 -> d4 1st, d3 2nd, d2, d1  changed v=2,1,4,3 -> d3 1st, d4 2nd, d1, d2
    Changed documents (relevant under og, not under changed): topic 1 {d1}; topic 2 {d3, d4}.
    Per document: og_rank < new_rank -> 1 - og_rank/new_rank; otherwise new_rank/og_rank - 1.
      topic 1: d1 1 -> 4: 1 - 1/4 = 0.75
      topic 2: d3 2 -> 1: 1/2 - 1 = -0.5;  d4 1 -> 2: 1 - 1/2 = 0.5;  mean 0
      p-MRR = mean over topics = (0.75 + 0) / 2 = 0.375
    With --top_k 2 a document outside the kept list gets rank len + 1 = 3 (the paper's truncation effect):
      topic 1: d1 1 -> 3: 1 - 1/3;  topic 2 unchanged (all within the top 2): 0;  p-MRR = (2/3) / 2 = 1/3
    """
    from diffusion_embedder.evaluation.mteb_model import MTEBEncoder

    expected = {None: 0.375, 2: 1 / 3}
    for top_k, value in expected.items():
        args = run.EvalArguments(output_dir=str(tmp_path / f"top{top_k}"), top_k=top_k,
                                 local_task=[str(INSTRUCTIONS)], no_embedding_cache=True)
        model = MTEBEncoder(VectorStandIn(), revision="hand", name="test/vectors")
        outcome = run.evaluate(model, run.task_factories(args), args)
        assert not outcome.failures
        assert outcome.scores["HandInstructionRetrieval"] == pytest.approx(value, abs=1e-9)
    task = load_local_task(str(INSTRUCTIONS))
    assert task.metadata.main_score == "p-MRR"
    # the report shows the original-instruction MAP@1000 under p-MRR: every relevant document of both og
    # queries sits above every non-relevant one (topic 1: d1, d2 first; topic 2: d4, d3, d2 first) -> AP 1
    markdown, _ = report.write_report([str(tmp_path / "topNone")])
    assert "| local | HandInstructionRetrieval | p-MRR | 37.50 |" in markdown
    assert "| local | HandInstructionRetrieval (og map_at_1000) |  | 100.00 |" in markdown
    assert "| local | **Average** |  | 37.50 |" in markdown


def test_cli_reports_failures_with_a_non_zero_exit(tmp_path, capsys):
    (tmp_path / "nope").mkdir()  # a folder without a corpus: the task fails when it runs, the others still run
    code = run.main([
        "--base_model_name_or_path", str(LLAMA_FIXTURE), "--local_task", str(INSTRUCTIONS), str(tmp_path / "nope"),
        "--output_dir", str(tmp_path / "out"), "--batch_size", "4", "--device", "cpu",
    ])
    assert code == 1
    err = capsys.readouterr().err
    assert "1 task(s) failed" in err and "nope" in err
    assert list((tmp_path / "out").rglob("HandInstructionRetrieval.json"))
    assert run.main(["--base_model_name_or_path", str(LLAMA_FIXTURE), "--task_name", "News21InstructionRetreival"]) == 2
    err = capsys.readouterr().err
    assert "Did you mean: News21InstructionRetrieval" in err and "Traceback" not in err
