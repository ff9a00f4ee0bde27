"""Damaged training data: every reader names the file, the line and the fix, and the stages stop before a model loads.

Each data file every reader takes (JSONL, plain text, gzipped or not, and the datasets route of
MSMARCO) is damaged in each way users meet: invalid UTF-8, UTF-16 with and without its byte-order
mark, a ``.gz`` that is not gzip, cut short or corrupt, a folder where a file belongs. Hub datasets
that are not cached while the hub is out of reach are refused in our words. The stages read their data
before the model (a missing model folder would be named otherwise) and write nothing.
"""

from __future__ import annotations

import gzip
import json
import random
import zlib
from pathlib import Path

import pytest
from conftest import ROOT

from diffusion_embedder import cli
from diffusion_embedder.data import MSMARCO, Custom, DataFormatError, ReasonAug, Wiki1M, read_texts
from diffusion_embedder.data.hub import DatasetUnavailableError
from diffusion_embedder.files import open_text
from diffusion_embedder.reasonaug.contamination import load_benchmark_queries

DATA = Path(__file__).parent / "fixtures" / "data"
CUSTOM_RECORD = {"query": "q", "positive": "p", "negatives": ["n"]}


def records(kind: str, count: int) -> list[bytes]:
    """``count`` good lines (with their newline) of a reader's format; texts vary so gzip cannot shrink them away."""
    rng = random.Random(0)
    if kind == "msmarco":
        row = json.loads((DATA / "msmarco" / "train.jsonl").read_text().splitlines()[0])
        lines = [json.dumps({**row, "query": f"{row['query']} {rng.random()}"}) for _ in range(count)]
    elif kind == "reasonaug":
        row = json.loads((DATA / "reasonaug.jsonl").read_text().splitlines()[0])
        lines = [json.dumps({**row, "user_query": f"query {rng.random()}"}) for _ in range(count)]
    elif kind == "text":
        lines = [f"sentence {i} {rng.random()} {rng.random()}" for i in range(count)]
    else:
        lines = [json.dumps({**CUSTOM_RECORD, "query": f"q {rng.random()}"}) for _ in range(count)]
    return [line.encode() + b"\n" for line in lines]


#: reader name -> (format of its lines, file suffix, how to read a file, the setting that names the file)
READERS = {
    "Custom": ("custom", ".jsonl", lambda path: Custom(path), "dataset_file_path"),
    "ReasonAug": ("reasonaug", ".jsonl", lambda path: ReasonAug(path), "aug_file_path"),
    "read_texts (MNTP .txt)": ("text", ".txt", lambda path: read_texts(train_files=[str(path)]), "train_file"),
    "read_texts (MNTP .jsonl)": (
        "custom",
        ".jsonl",
        lambda path: read_texts(train_files=[str(path)], text_column="query"),
        "train_file",
    ),
    "Wiki1M (SimCSE)": ("text", ".txt", lambda path: Wiki1M(path), "dataset_file_path"),
    "MSMARCO (datasets)": ("msmarco", ".jsonl", lambda path: MSMARCO(path), "dataset_file_path"),
}
#: readers whose files may be gzipped (MSMARCO takes parquet/json/jsonl/csv through datasets)
GZIP_READERS = [name for name in READERS if not name.startswith("MSMARCO")]


def write(tmp_path: Path, reader: str, content: bytes, gz: bool = False) -> Path:
    suffix = READERS[reader][1] + (".gz" if gz else "")
    path = tmp_path / f"train{suffix}"
    path.write_bytes(content)
    return path


def refused(reader: str, path: Path, error: type[Exception] = DataFormatError) -> str:
    with pytest.raises(error) as caught:
        READERS[reader][2](path)
    message = str(caught.value)
    assert str(path) in message, message
    return message


# ------------------------------------------------------------------------------------ text encoding


@pytest.mark.parametrize("reader", READERS)
def test_invalid_utf8_names_file_and_line(tmp_path, reader):
    lines = records(READERS[reader][0], 5)
    lines[2] = lines[2].replace(b"1", b"\xff", 1)  # a digit of the random number: any line has one
    message = refused(reader, write(tmp_path, reader, b"".join(lines)))
    assert f"{tmp_path / 'train'}{READERS[reader][1]}:3: not valid UTF-8" in message
    assert "save it as UTF-8" in message


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("encoding, problem", [("utf-16", "UTF-16 text"), ("utf-16-le", "contains NUL bytes")])
def test_utf16_is_named_not_read_as_garbage(tmp_path, reader, encoding, problem):
    """With its byte-order mark or without (then every other byte is NUL, which UTF-8 would accept)."""
    text = b"".join(records(READERS[reader][0], 3)).decode()
    message = refused(reader, write(tmp_path, reader, text.encode(encoding)))
    assert f":1: {problem}" in message and "save it as UTF-8" in message


@pytest.mark.parametrize("reader", ["Custom", "read_texts (MNTP .txt)"])
def test_utf8_byte_order_mark_and_windows_line_ends_are_read(tmp_path, reader):
    lines = records(READERS[reader][0], 3)
    crlf = b"\xef\xbb\xbf" + b"".join(line.replace(b"\n", b"\r\n") for line in lines)
    plain = tmp_path / "plain"
    plain.mkdir()
    expected = READERS[reader][2](write(plain, reader, b"".join(lines)))
    got = READERS[reader][2](write(tmp_path, reader, crlf))
    if reader == "Custom":
        expected, got = [s.query for s in expected], [s.query for s in got]
    assert got == expected and len(got) == 3


# ---------------------------------------------------------------------------------------- gzip files


@pytest.mark.parametrize("reader", GZIP_READERS)
def test_gz_that_is_not_gzip(tmp_path, reader):
    message = refused(reader, write(tmp_path, reader, b"".join(records(READERS[reader][0], 3)), gz=True))
    assert ".gz:1: cannot read the file further: not gzip data although the name ends in .gz" in message


@pytest.mark.parametrize("reader", GZIP_READERS)
def test_truncated_gz_names_the_first_line_it_lacks(tmp_path, reader):
    """The line is counted from the bytes that decompress, not from gzip's read-ahead (which fails at line 1)."""
    packed = gzip.compress(b"".join(records(READERS[reader][0], 400)))
    cut = packed[: len(packed) * 3 // 5]
    complete = zlib.decompressobj(wbits=31).decompress(cut).count(b"\n")
    assert 1 < complete < 400
    message = refused(reader, write(tmp_path, reader, cut, gz=True))
    assert f".gz:{complete + 1}: cannot read the file further: the gzip data ends early" in message


@pytest.mark.parametrize("reader", GZIP_READERS)
def test_corrupt_gz_is_named(tmp_path, reader):
    packed = bytearray(gzip.compress(b"".join(records(READERS[reader][0], 20))))
    packed[-8:-4] = bytes(b ^ 0xFF for b in packed[-8:-4])  # the CRC-32 of the trailer
    message = refused(reader, write(tmp_path, reader, bytes(packed), gz=True))
    assert ".gz:21: cannot read the file further: the gzip data is corrupted (CRC check failed" in message


# ------------------------------------------------------------------------------ folders, missing files


@pytest.mark.parametrize("reader", [name for name in READERS if not name.startswith("MSMARCO")])
def test_folder_given_as_a_data_file(tmp_path, reader):
    """MSMARCO is left out: a folder in the hub layout is one of its formats."""
    folder = tmp_path / f"train{READERS[reader][1]}"
    folder.mkdir()
    message = refused(reader, folder, FileNotFoundError)
    assert f"{folder} is a folder, not a file" in message and READERS[reader][3] in message


def test_missing_files_are_named_not_sent_to_datasets(tmp_path):
    """Before, a missing SimCSE file went to ``datasets`` (``Unable to find ...``), an MSMARCO file to the hub."""
    for read, name, what in [
        (Wiki1M, "wiki1m.txt", "Wiki1M file (dataset_file_path) not found"),
        (MSMARCO, "msmarco.parquet", "MSMARCO data (dataset_file_path) not found"),
        (lambda path: read_texts(train_files=[str(path)]), "mntp.txt", "train_file not found"),
        (Custom, "custom.jsonl", "dataset_file_path: data file not found"),
        (ReasonAug, "reasonaug.jsonl.gz", "aug_file_path: data file not found"),
    ]:
        with pytest.raises(FileNotFoundError) as caught:
            read(tmp_path / name)
        assert f"{what}: {tmp_path / name}" in str(caught.value)
        assert not type(caught.value).__module__.startswith("datasets")


def test_open_text_is_the_one_text_opener(tmp_path):
    """ReasonAug's benchmark files go through the same reader (``files.open_text``)."""
    packed = tmp_path / "bench.txt.gz"
    packed.write_bytes(gzip.compress(b"first query\r\n\nsecond query\n"))
    with open_text(packed) as lines:
        assert list(lines) == ["first query", "", "second query"]
    good = tmp_path / "good.txt"
    good.write_bytes(b"first query\r\n\nsecond query\n")
    assert load_benchmark_queries(good) == ["first query", "second query"]
    bad = tmp_path / "bench.txt"
    bad.write_bytes(b"first query\nsecond \xe9t\xe9\n")
    with pytest.raises(ValueError, match=r"bench\.txt:2: not valid UTF-8"):
        load_benchmark_queries(bad)


# ---------------------------------------------------------------------------------- hub datasets


HUB_READERS = {
    "read_texts": (
        lambda: read_texts(dataset_name="nobody/not-cached"),
        "dataset_name 'nobody/not-cached'",
        "train_file",
    ),
    "MSMARCO": (lambda: MSMARCO("nobody/not-cached"), "MSMARCO data 'nobody/not-cached'", "dataset_file_path"),
    "Wiki1M": (lambda: Wiki1M(), "Wiki1M file 'hf://datasets/princeton-nlp", "dataset_file_path"),
}


@pytest.mark.parametrize("reader", HUB_READERS)
def test_uncached_hub_dataset_offline_is_refused_in_our_words(monkeypatch, reader, tmp_path):
    import datasets

    (tmp_path / "text").mkdir()  # Wiki1M loads the "text" builder: a folder of that name is not its data
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    read, named, local = HUB_READERS[reader]
    with pytest.raises(DatasetUnavailableError) as caught:
        read()
    message = str(caught.value)
    assert message.startswith(named) and "not in the local datasets cache" in message and "offline mode" in message
    assert f"or pass {local}" in message
    assert caught.value.__cause__ is not None  # the library's own error stays as the cause


@pytest.mark.parametrize("reader", HUB_READERS)
def test_unreachable_hub_is_refused_in_our_words(monkeypatch, reader):
    import datasets

    def no_network(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'nobody/not-cached' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets, "load_dataset", no_network)
    read, named, local = HUB_READERS[reader]
    with pytest.raises(DatasetUnavailableError) as caught:
        read()
    message = str(caught.value)
    assert message.startswith(named) and "the hub cannot be reached (ConnectionError: Couldn't reach" in message
    assert f"or pass {local}" in message


# ------------------------------------------------------------------------------------------ stages


STAGES = {
    "train": ("custom.json", "dataset_file_path", "custom"),
    "simcse": ("simcse.json", "dataset_file_path", "text"),
    "mntp": ("mntp.json", "train_file", "custom"),
}


@pytest.mark.parametrize("stage", STAGES)
def test_stages_refuse_damaged_data_before_the_model_loads(tmp_path, monkeypatch, caplog, stage):
    """The model folder does not exist: the data error shows the data was read first; nothing is written.
    The stage exits with status 2 and the message, no traceback (before, the error escaped ``main``)."""
    monkeypatch.chdir(ROOT)
    config, field, kind = STAGES[stage]
    lines = records(kind, 4)
    lines[1] = b"\xff\xfe" + lines[1]
    suffix = ".txt" if kind == "text" else ".jsonl"
    data = tmp_path / f"data{suffix}"
    data.write_bytes(b"".join(lines))
    value = json.dumps([str(data)]) if field == "train_file" else str(data)
    out = tmp_path / "out"
    argv = [stage, f"train_configs/tiny/{config}", f"--{field}", value, "--output_dir", str(out)]
    argv += ["--model_name_or_path", str(tmp_path / "no-model"), "--report_to", "none"]
    assert cli.main(argv) == 2
    assert f"{data}:2: not valid UTF-8" in caplog.text and "Traceback" not in caplog.text
    assert not out.exists() or not any(out.rglob("*"))


def test_mntp_stage_with_an_uncached_hub_dataset_offline(tmp_path, monkeypatch, caplog):
    import datasets

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    out = tmp_path / "out"
    argv = ["mntp", "train_configs/tiny/mntp.json", "--train_file", "null", "--dataset_name", "nobody/not-cached"]
    argv += ["--output_dir", str(out), "--model_name_or_path", str(tmp_path / "no-model"), "--report_to", "none"]
    assert cli.main(argv) == 2
    assert "dataset_name 'nobody/not-cached' is not in the local datasets" in caplog.text
    assert not out.exists() or not any(out.rglob("*"))


def test_the_exception_chain_walk_ends_on_a_cycle():
    """msmarco took the innermost exception with a walk that looped forever on ``raise e from e``-style cycles."""
    from diffusion_embedder.data.hub import error_chain

    outer, inner = ValueError("outer"), OSError("inner")
    outer.__cause__, inner.__context__ = inner, outer
    assert list(error_chain(outer)) == [outer, inner]
    *_, innermost = error_chain(outer)
    assert innermost is inner
