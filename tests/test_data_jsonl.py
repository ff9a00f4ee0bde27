"""Malformed input: every bad line is reported with file, line number and the problem, or counted when skipped."""

from __future__ import annotations

import json
import logging

import pytest

from diffusion_embedder.data import Custom, DataFormatError
from diffusion_embedder.data.jsonl import Field, read_jsonl

GOOD = {"query": "q", "positive": "p", "negatives": ["n"]}


def write_lines(path, lines: list[str]):
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize(
    "line, problem",
    [
        ('{"query": "q", "positive": ', "invalid JSON"),
        ('["q", "p"]', "expected a JSON object, got list"),
        ('{"query": "q", "negatives": ["n"]}', "missing field 'positive'"),
        ('{"query": "q", "positive": "p", "negatives": "n"}', "field 'negatives' must be list[str], got str"),
        (
            '{"query": "q", "positive": "p", "negatives": ["n", 3]}',
            "field 'negatives' must be list[str], but item 1 is int: 3",
        ),
        ('{"query": null, "positive": "p", "negatives": ["n"]}', "field 'query' is null, expected str"),
        ('{"query": "q", "positive": "p", "negatives": ["n"], "instruction": 5}', "field 'instruction' must be str"),
    ],
)
def test_bad_line_names_file_line_and_problem(tmp_path, line, problem):
    path = write_lines(tmp_path / "train.jsonl", [json.dumps(GOOD), "", line, json.dumps(GOOD)])
    with pytest.raises(DataFormatError) as err:
        Custom(path)
    # Blank lines are ignored but still counted in line numbers: the bad line is line 3.
    assert str(err.value).startswith(f"{path}:3: {problem}")


def test_invalid_utf8_is_reported_on_its_line(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n" + b'{"query": "\xff"}\n')
    with pytest.raises(DataFormatError, match=r"train\.jsonl:2: not valid UTF-8"):
        Custom(path)


def test_skip_bad_lines_counts_and_warns(tmp_path, caplog):
    lines = [json.dumps(GOOD), "{oops", json.dumps({"query": "q"}), json.dumps(GOOD), "[]"]
    path = write_lines(tmp_path / "train.jsonl", lines)
    with caplog.at_level(logging.WARNING):
        ds = Custom(path, skip_bad_lines=True)
    assert len(ds) == 2 and ds.num_bad_records == 3
    assert f"skipped 3 malformed record(s) in {path} (first: {path}:2: invalid JSON" in caplog.text


def test_missing_file_and_empty_result(tmp_path):
    with pytest.raises(FileNotFoundError, match="data file not found: .*nope.jsonl"):
        Custom(tmp_path / "nope.jsonl")
    with pytest.raises(ValueError, match="no training samples were read"):
        Custom(write_lines(tmp_path / "empty.jsonl", ["", "  "]))


def test_read_jsonl_limit_and_filtered_records(tmp_path):
    path = write_lines(tmp_path / "x.jsonl", [json.dumps({"v": str(i)}) for i in range(10)])
    indices = []

    def convert(record, index):
        indices.append(index)
        return None if int(record["v"]) % 2 else record["v"]

    values, bad = read_jsonl(path, [Field("v")], convert, limit=3)
    assert values == ["0", "2", "4"] and bad == 0
    assert indices == [0, 1, 2, 3, 4]  # reading stops once the limit is reached


def test_field_kind_is_validated():
    with pytest.raises(ValueError, match="unknown field kind"):
        Field("x", kind="float")


def test_gzipped_jsonl_and_corrupt_gzip(tmp_path):
    import gzip

    lines = [json.dumps(GOOD)] * 50
    packed = gzip.compress(("\n".join(lines) + "\n").encode())
    (tmp_path / "train.jsonl.gz").write_bytes(packed)
    assert len(Custom(tmp_path / "train.jsonl.gz")) == 50
    (tmp_path / "cut.jsonl.gz").write_bytes(packed[: len(packed) // 2])
    with pytest.raises(DataFormatError, match=r"cut\.jsonl\.gz:\d+: cannot read the file further"):
        Custom(tmp_path / "cut.jsonl.gz")
