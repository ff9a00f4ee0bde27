"""The real mteb task classes (FollowIR, LongEmbed passkey, BRIGHT v1.1) read through ``--data_dir`` from
folders laid out like their hub repositories, so the offline path runs mteb's own loaders and scoring."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from diffusion_embedder.evaluation import run
from diffusion_embedder.evaluation.mteb_model import MTEBEncoder
from diffusion_embedder.evaluation.tasks import load_instructions

LENGTHS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


class VectorStandIn:
    """Embeds the vector written in each text (``v=1,0``); records inputs and the lengths in force."""

    def __init__(self):
        self.config = SimpleNamespace(max_length=512, doc_max_length=400, to_dict=lambda: {"kind": "vectors"})
        self.calls: list[dict] = []

    def encode(self, sentences, batch_size=32, show_progress_bar=True, convert_to_numpy=False, **kwargs):
        length = kwargs.get("max_length", self.config.max_length)
        self.calls.append({"inputs": [list(s) for s in sentences], "max_length": length})
        return np.array([[float(x) for x in re.search(r"v=([\d,]+)", t).group(1).split(",")] for _, t in sentences])


def write_repo(folder: Path, configs: dict[str, dict[str, list[dict]]]) -> None:
    """A dataset repo: one jsonl per (config, split) and the README ``configs:`` that maps them."""
    folder.mkdir(parents=True)
    lines = ["---", "configs:"]
    for config, splits in configs.items():
        lines += [f"- config_name: {config}", "  data_files:"]
        for split, rows in splits.items():
            path = f"{config}/{split}.jsonl"
            (folder / config).mkdir(exist_ok=True)
            (folder / path).write_text("".join(json.dumps(r) + "\n" for r in rows))
            lines += [f"  - split: {split}", f"    path: {path}"]
    (folder / "README.md").write_text("\n".join([*lines, "---", ""]))


def write_core17(folder: Path, qrel_diff: dict[str, list[str]]) -> None:
    """A Core17 repo with two topics over four one-hot documents. Ranks: topic 1's d1 goes from 1st (og) to 4th
    (changed); topic 2's d3 from 2nd to 1st, its d4 from 1st to 2nd. ``qrel_diff``: topic -> changed documents."""
    docs = [{"_id": f"d{i}", "title": "", "text": f"document {i} v={v}"}
            for i, v in enumerate(["1,0,0,0", "0,1,0,0", "0,0,1,0", "0,0,0,1"], 1)]
    vectors = {"1-og": "4,3,2,1", "1-changed": "1,3,2,4", "2-og": "1,2,3,4", "2-changed": "2,1,4,3"}
    qrels = [("1-og", "d1"), ("1-og", "d2"), ("1-changed", "d2"),
             ("2-og", "d2"), ("2-og", "d3"), ("2-og", "d4"), ("2-changed", "d2")]
    write_repo(folder, {
        "corpus": {"corpus": docs},
        "queries": {"queries": [{"_id": q, "text": f"topic {q[0]}"} for q in vectors]},
        "instruction": {
            "instruction": [{"query-id": q, "instruction": f"narrative v={v}"} for q, v in vectors.items()]
        },
        "default": {"test": [{"query-id": q, "corpus-id": d, "score": 1} for q, d in qrels]},
        "top_ranked": {"top_ranked": [{"query-id": q, "corpus-ids": ["d1", "d2", "d3", "d4"]} for q in vectors]},
        "qrel_diff": {"qrel_diff": [{"query-id": q, "corpus-ids": ids} for q, ids in qrel_diff.items()]},
    })


@pytest.fixture(scope="module")
def hub_run(tmp_path_factory):
    data = tmp_path_factory.mktemp("data")
    write_core17(data / "mteb" / "Core17InstructionRetrieval", {"1": ["d1"], "2": ["d3", "d4"]})
    # passkey: at lengths up to 2048 the key is found (query matches p1), beyond it the other document wins
    write_repo(data / "mteb" / "LEMBPasskeyRetrieval", {
        "corpus": {f"test_{n}": [{"_id": "p1", "text": f"key doc v={'1,0' if n <= 2048 else '0,1'}"},
                                 {"_id": "p2", "text": f"other doc v={'0,1' if n <= 2048 else '1,0'}"}]
                   for n in LENGTHS},
        "queries": {f"test_{n}": [{"_id": "q", "text": "what is the pass key? v=1,0"}] for n in LENGTHS},
        "default": {f"test_{n}": [{"query-id": "q", "corpus-id": "p1", "score": 1}] for n in LENGTHS},
    })
    # dwzhu/LongEmbed: corpus, queries and qrels are splits of one config; every split carries all columns
    write_repo(data / "dwzhu" / "LongEmbed", {"qmsum": {
        "corpus": [{"doc_id": "m1", "qid": "", "text": "meeting one v=1,0"},
                   {"doc_id": "m2", "qid": "", "text": "meeting two v=0,1"}],
        "queries": [{"qid": "s1", "doc_id": "", "text": "summary one v=1,0"},
                    {"qid": "s2", "doc_id": "", "text": "summary two v=0,1"}],
        "qrels": [{"qid": "s1", "doc_id": "m1", "text": ""}, {"qid": "s2", "doc_id": "m2", "text": ""}],
    }})
    examples = [{"id": "b1", "query": "why do cells divide? v=1,0", "reasoning": "", "excluded_ids": ["N/A"],
                 "gold_ids": ["x1"], "gold_ids_long": ["x1"]},
                {"id": "b2", "query": "what do enzymes do? v=0,1", "reasoning": "", "excluded_ids": ["N/A"],
                 "gold_ids": ["x1"], "gold_ids_long": ["x1"]}]
    write_repo(data / "mteb" / "BRIGHT", {
        "documents": {"biology": [{"id": "x1", "content": "mitosis v=1,0"}, {"id": "x2", "content": "enzymes v=0,1"}]},
        "examples": {"biology": examples},
    })
    args = run.EvalArguments(output_dir=str(tmp_path_factory.mktemp("out")), data_dir=str(data), max_length_cap=4096,
                             task_name=["Core17InstructionRetrieval", "LEMBPasskeyRetrieval", "LEMBQMSumRetrieval",
                                        "BrightBiology"])
    stand_in = VectorStandIn()
    model = MTEBEncoder(stand_in, instructions=load_instructions(), revision="hub-layout", name="test/vectors",
                        max_length_cap=args.max_length_cap)
    outcome = run.evaluate(model, run.task_factories(args), args)
    return SimpleNamespace(outcome=outcome, calls=stand_in.calls)


def test_followir_class_reads_the_local_repo_and_scores_the_hand_pmrr(hub_run):
    assert not hub_run.outcome.failures, hub_run.outcome.failures
    # same ranks as tests/fixtures/beir/instructions (see test_eval_local): p-MRR = (0.75 + 0) / 2
    assert hub_run.outcome.scores["Core17InstructionRetrieval"] == pytest.approx(0.375)


def test_passkey_splits_are_encoded_at_their_own_length(hub_run):
    doc_calls = [c for c in hub_run.calls if c["inputs"][0][1].startswith(("key doc", "other doc"))]
    assert sorted(c["max_length"] for c in doc_calls) == sorted(min(n, 4096) for n in LENGTHS)
    # ndcg@1 is 1 at the four short lengths, 0 at the four long ones: the mean over splits is the main score
    assert hub_run.outcome.scores["LEMBPasskeyRetrieval"] == pytest.approx(0.5)
    query_calls = [c for c in hub_run.calls if c["inputs"][0][1].startswith("what is the pass key")]
    assert {c["inputs"][0][0] for c in query_calls} == {"Retrieve text based on user query:"}


def test_bright_queries_get_our_instruction_documents_none(hub_run):
    # nDCG@10: b1's gold x1 ranks 1st (1.0), b2's ranks 2nd (1 / log2(3))
    assert hub_run.outcome.scores["BrightBiologyRetrieval"] == pytest.approx((1.0 + 1 / np.log2(3)) / 2, abs=1e-5)
    bright = [c for c in hub_run.calls if "cells divide" in str(c["inputs"]) or "mitosis" in str(c["inputs"])]
    queries = next(c for c in bright if "cells divide" in str(c["inputs"]))
    documents = next(c for c in bright if "mitosis" in str(c["inputs"]))
    expected = load_instructions()["BrightBiologyRetrieval"]
    assert {i for i, _ in queries["inputs"]} == {expected}
    assert {i for i, _ in documents["inputs"]} == {""}


def test_longembed_real_task_reads_the_local_repo_at_the_checkpoint_lengths(hub_run):
    assert hub_run.outcome.scores["LEMBQMSumRetrieval"] == pytest.approx(1.0)  # each summary finds its meeting
    documents = next(c for c in hub_run.calls if "meeting one" in str(c["inputs"]))
    assert documents["max_length"] == 512 and {i for i, _ in documents["inputs"]} == {""}
