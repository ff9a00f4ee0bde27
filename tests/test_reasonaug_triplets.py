"""Triplet invariants on the shipped ReasonAug files, the BM25 skip rule, the split, and rebuild determinism."""

import gzip
import json
from collections import Counter
from pathlib import Path

import pytest

from diffusion_embedder.reasonaug import cli
from diffusion_embedder.reasonaug.concepts import load_concepts
from diffusion_embedder.reasonaug.llm import read_jsonl
from diffusion_embedder.reasonaug.prompts import QUESTION_TYPES, TASK_TYPES, task_instruction
from diffusion_embedder.reasonaug.rebuild import STATS_BEGIN, STATS_END, load_generation
from diffusion_embedder.reasonaug.triplets import (
    RECORD_FIELDS,
    ConceptData,
    TripletConfig,
    build_triplets,
    negative_candidates,
    split_concepts,
)

ROOT = Path(__file__).resolve().parents[1] / "ReasonAug"


def _read(name):
    return [r for _, r in read_jsonl(ROOT / name)]


@pytest.fixture(scope="module")
def shipped():
    return {"train": _read(cli.TRAIN_FILE), "heldout": _read(cli.HELDOUT_FILE)}


@pytest.fixture(scope="module")
def generation():
    data, report = load_generation(ROOT / "generation", load_concepts(ROOT / "concepts.jsonl"))
    return {c.instance: c for c in data}, report


def test_rebuild_counts(generation):
    _, report = generation
    assert report.generated_pairs == 2398 and report.malformed_pairs == 2
    assert report.missing_verdicts == 1  # pair 641 has no verdict in solution_check_output.jsonl
    assert dict(report.rejected) == {"coding": 198, "math": 363, "physics": 220, "finance": 35}
    assert report.misaligned_code == 84
    assert report.verified_pairs == 2398 - 1 - 198 - 363 - 220 - 35 - 84 == 1497


@pytest.mark.parametrize("side", ["train", "heldout"])
def test_schema_and_basic_invariants(shipped, side):
    records = shipped[side]
    assert [r["id"] for r in records] == [str(i) for i in range(1, len(records) + 1)]
    assert {r["task_type"] for r in records} == set(TASK_TYPES)
    assert {r["domain"] for r in records} == set(QUESTION_TYPES)
    for r in records:
        assert tuple(r) == RECORD_FIELDS
        assert all(isinstance(r[k], str) and r[k] for k in RECORD_FIELDS)
        assert r["task"] == task_instruction(r["task_type"], r["domain"], QUESTION_TYPES[r["domain"]])
        assert "Gievn" not in r["task"]
        assert r["negative_instance"] != r["instance"]
        assert r["hard_negative_document"] != r["positive_document"]


def test_split_by_concept(shipped):
    split = json.loads((ROOT / "split.json").read_text())
    train, held = set(split["train"]), set(split["heldout"])
    assert not train & held
    for side, names in (("train", train), ("heldout", held)):
        used = {r["instance"] for r in shipped[side]} | {r["negative_instance"] for r in shipped[side]}
        assert used <= names, side  # neither query concepts nor negatives cross the split
    per_domain = Counter(c.domain for c in load_concepts(ROOT / "concepts.jsonl") if c.instance in held)
    assert len(held) / (len(train) + len(held)) == pytest.approx(0.2, abs=0.02)
    assert set(per_domain) == set(QUESTION_TYPES)


def test_positive_shares_the_query_concept_and_negative_does_not(shipped, generation):
    data, _ = generation

    def docs(c: ConceptData) -> set[str]:
        if c.question_type == "coding":
            return set(c.solutions)
        return {p + "\n" + s for p, s in zip(c.problems, c.solutions, strict=True)}

    for r in shipped["train"] + shipped["heldout"]:
        own, neg = data[r["instance"]], data[r["negative_instance"]]
        assert own.domain == neg.domain == r["domain"]
        if r["task_type"] == "p2i":
            assert r["user_query"] in own.problems
            assert r["positive_document"] in (own.definition, own.instance)
            assert r["hard_negative_document"] in (neg.definition, neg.instance)
            # the definition form pairs with the definition form, the name with the name
            assert (r["positive_document"] == own.instance) == (r["hard_negative_document"] == neg.instance)
            continue
        assert r["positive_document"] in docs(own)
        assert r["hard_negative_document"] in docs(neg)
        assert r["hard_negative_document"] not in docs(own)
        if r["task_type"] == "i2ps":
            assert r["user_query"] == own.instance
        elif r["task_type"] == "p2ps":
            assert r["user_query"] in own.problems
        else:
            head, _, tail = r["user_query"].partition("\n")
            assert any(r["user_query"].startswith(p + "\n") for p in own.problems), head
            assert r["user_query"] != r["positive_document"] and tail


def test_non_coding_i2ps_negative_is_problem_plus_solution(shipped, generation):
    """Upstream wrote the negative problem twice; here it is the negative pair (problem + solution)."""
    data, _ = generation
    checked = 0
    for r in shipped["train"]:
        if r["task_type"] != "i2ps" or data[r["instance"]].question_type == "coding":
            continue
        neg = data[r["negative_instance"]]
        pairs = {p + "\n" + s: p for p, s in zip(neg.problems, neg.solutions, strict=True)}
        problem = pairs[r["hard_negative_document"]]
        assert r["hard_negative_document"] != problem + "\n" + problem
        checked += 1
    assert checked > 500


def test_rebuild_reproduces_the_shipped_files(tmp_path):
    card = tmp_path / "README.md"
    card.write_text(f"x\n{STATS_BEGIN}\nold\n{STATS_END}\ny\n")
    assert cli.main(["rebuild", "--out-dir", str(tmp_path), "--card", str(card)]) == 0
    for name in (cli.TRAIN_FILE, cli.HELDOUT_FILE):
        assert gzip.decompress((tmp_path / name).read_bytes()) == gzip.decompress((ROOT / name).read_bytes())
        assert (tmp_path / name).read_bytes() == (ROOT / name).read_bytes()
    for name in ("split.json", "stats.json"):
        assert (tmp_path / name).read_text() == (ROOT / name).read_text()
    block = card.read_text().split(STATS_BEGIN)[1].split(STATS_END)[0]
    assert block in (ROOT / "README.md").read_text()
    assert card.read_text().startswith("x\n") and card.read_text().endswith("\ny\n")


def _concept(name, domain, problems, definition=None, qt="math"):
    return ConceptData(
        name, domain, qt, definition or f"{name} definition", tuple(problems), tuple(f"s {p}" for p in problems)
    )


def test_negative_candidates_skip_the_two_most_similar_same_domain_concepts():
    doc_concepts = ["A", "F", "B", "C", "B", "D", "E", "C"]
    domain_of = {"A": "m", "B": "m", "C": "m", "D": "m", "E": "m", "F": "p"}
    ranking = range(len(doc_concepts))
    # F is another domain; B and C (best-ranked same-domain others) are skipped, also their later docs
    assert negative_candidates(ranking, doc_concepts, "A", domain_of, skip=2) == [5, 6]
    assert negative_candidates(ranking, doc_concepts, "A", domain_of, skip=0) == [2, 3, 4, 5, 6, 7]
    # with only two other concepts, one is still kept
    assert negative_candidates(range(3), ["A", "B", "C"], "A", {"A": "m", "B": "m", "C": "m"}, 2) == [2]


def test_bm25_hard_negatives_on_a_toy_corpus():
    shared = "apple banana cherry"
    concepts = [
        _concept("A", "m", [f"{shared} alpha one", f"{shared} alpha two"]),
        _concept("B", "m", [f"{shared} beta", f"{shared} beta"], definition=f"{shared} apple apple"),
        _concept("C", "m", [f"{shared} gamma"], definition=f"{shared} apple"),
        _concept("D", "m", ["delta words"], definition="banana"),
        _concept("E", "m", ["epsilon words"], definition="unrelated"),
        _concept("F", "p", [f"{shared} {shared}"], definition=f"{shared} {shared} apple"),
    ]
    records = build_triplets(concepts, TripletConfig(seed=0))
    p2i_a = [r for r in records if r["task_type"] == "p2i" and r["instance"] == "A"]
    # B and C share most words with A's problems: skipped; F is another domain: never used
    assert [r["negative_instance"] for r in p2i_a] == ["D", "E", "D", "E"]
    assert all(r["negative_instance"] != "F" for r in records)
    # duplicate problems of a concept are used once
    assert sum(r["task_type"] == "p2i" and r["instance"] == "B" for r in records) == 2
    assert build_triplets(concepts, TripletConfig(seed=0)) == records
    assert build_triplets(concepts, TripletConfig(seed=1)) != records


def test_split_is_stratified_and_seeded():
    concepts = [_concept(f"{d}{i}", d, ["p"]) for d, n in (("x", 10), ("y", 5), ("z", 1)) for i in range(n)]
    train, held = split_concepts(concepts, 0.2, seed=0)
    assert Counter(c.domain for c in held) == {"x": 2, "y": 1}
    assert len(train) + len(held) == 16
    assert split_concepts(concepts, 0.2, seed=0) == (train, held)
    assert {c.instance for c in split_concepts(concepts, 0.2, seed=5)[1]} != {c.instance for c in held}
    with pytest.raises(ValueError, match="heldout_fraction"):
        split_concepts(concepts, 1.0)
