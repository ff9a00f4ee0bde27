"""Contamination check: same decisions as upstream's difflib loop, removal, input formats, BRIGHT loader."""

import json
import random
from difflib import SequenceMatcher

import pytest

from diffusion_embedder.reasonaug import cli
from diffusion_embedder.reasonaug.contamination import (
    find_contaminated,
    load_benchmark_queries,
    load_bright_queries,
    remove_contaminated,
)
from diffusion_embedder.reasonaug.llm import read_jsonl


def upstream_flag(query, refs, threshold=0.7):
    """Upstream ``check_content_overlap`` (bright_verify.py), verbatim semantics."""
    best = 0
    for ref in refs:
        best = max(best, SequenceMatcher(None, query.lower(), ref.lower()).ratio())
        if best >= threshold:
            return True
    return False


def test_same_decisions_as_the_plain_difflib_loop():
    rng = random.Random(0)
    vocab = "prime modulo triangle area graph path array sum sort tree node edge root".split()
    refs = [" ".join(rng.choice(vocab) for _ in range(rng.randint(4, 14))) for _ in range(40)]
    queries = [" ".join(rng.choice(vocab) for _ in range(rng.randint(4, 14))) for _ in range(120)]
    queries += [refs[3].upper(), refs[7] + " extra", refs[9][: len(refs[9]) // 2]]
    flagged, report = find_contaminated(queries, refs, 0.7)
    expected = {q for q in queries if upstream_flag(q, refs)}
    assert flagged == expected
    assert refs[3].upper() in flagged and refs[7] + " extra" in flagged
    assert 0 < len(flagged) < len(set(queries))
    for m in report.matches:
        assert m.similarity == max(SequenceMatcher(None, m.query.lower(), r.lower()).ratio() for r in refs)


def test_hand_computed_threshold():
    # "abcd" vs "abcx": 3 matching chars, ratio = 2*3/8 = 0.75
    assert find_contaminated(["abcd"], ["abcx"], 0.75)[0] == {"abcd"}
    assert find_contaminated(["abcd"], ["abcx"], 0.76)[0] == set()


def test_remove_contaminated_records_and_report():
    records = [
        {"id": "1", "user_query": "Find the area of a triangle with sides 3, 4 and 5."},
        {"id": "2", "user_query": "Sort the array using merge sort."},
        {"id": "3", "user_query": "Find the area of a triangle with sides 3, 4 and 5."},
    ]
    bench = ["find the area of the triangle with sides 3, 4, 5.", "What is 2+2?"]
    kept, report = remove_contaminated(records, bench)
    assert [r["id"] for r in kept] == ["2"]
    d = report.as_dict()
    assert d["checked_queries"] == 2 and d["contaminated_queries"] == 1
    assert d["matches"][0]["benchmark_query"] == bench[0] and d["max_similarity"] >= 0.7


def test_benchmark_query_files(tmp_path):
    (tmp_path / "q.jsonl").write_text(json.dumps({"query": "a"}) + "\n" + json.dumps({"query": "b"}) + "\n")
    (tmp_path / "q.json").write_text(json.dumps(["a", "b"]))
    (tmp_path / "q.txt").write_text("a\n\nb\n")
    for name in ("q.jsonl", "q.json", "q.txt"):
        assert load_benchmark_queries(tmp_path / name) == ["a", "b"]
    (tmp_path / "bad.jsonl").write_text(json.dumps({"text": "a"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: missing field 'query'"):
        load_benchmark_queries(tmp_path / "bad.jsonl")


def test_bright_loader_reads_a_local_copy_in_hub_layout(tmp_path):
    """Same call as for the hub (config "examples", one split per subset), pointed at a local folder."""
    (tmp_path / "examples").mkdir()
    for subset in ("leetcode", "aops"):
        rows = [{"id": f"{subset}-{i}", "query": f"{subset} question {i}", "gold_ids": []} for i in range(2)]
        (tmp_path / "examples" / f"{subset}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "README.md").write_text(
        "---\nconfigs:\n- config_name: examples\n  data_files:\n"
        "  - split: leetcode\n    path: examples/leetcode.jsonl\n"
        "  - split: aops\n    path: examples/aops.jsonl\n---\n"
    )
    queries = load_bright_queries(str(tmp_path), subsets=("leetcode", "aops"))
    assert queries == ["leetcode question 0", "leetcode question 1", "aops question 0", "aops question 1"]


def test_cli_contamination(tmp_path):
    data = tmp_path / "ra.jsonl"
    data.write_text(
        "".join(json.dumps({"id": str(i), "user_query": q}) + "\n" for i, q in enumerate(["two sum problem", "zzz"]))
    )
    (tmp_path / "bench.txt").write_text("Two Sum Problem!\n")
    args = ["contamination", "--input", str(data), "--output", str(tmp_path / "clean.jsonl")]
    assert cli.main(args + ["--report", str(tmp_path / "rep.json"), "--benchmark", str(tmp_path / "bench.txt")]) == 0
    assert [r["id"] for _, r in read_jsonl(tmp_path / "clean.jsonl")] == ["1"]
    assert json.loads((tmp_path / "rep.json").read_text())["contaminated_queries"] == 1
