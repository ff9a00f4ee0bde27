"""Each reader on a small file of its real format: counts, instructions, text formats, filters."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest

from diffusion_embedder.data import (
    E5,
    E5_DATASETS,
    MSMARCO,
    Custom,
    DataFormatError,
    ReasonAug,
    load_train_dataset,
)

DATA = Path(__file__).parent / "fixtures" / "data"
E5_DIR = DATA / "e5"
MSMARCO_FILE = DATA / "msmarco" / "train.jsonl"
REASONAUG_FILE = DATA / "reasonaug.jsonl"
CUSTOM_FILE = DATA / "custom.jsonl"


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def joined(pair: tuple[str, str]) -> str:
    """The string LLM2Vec's format builds from a pair (what the Encoder tokenizes)."""
    instruction, text = pair
    return f"{instruction.strip()} {text}" if instruction.strip() else text


# ---------------------------------------------------------------------------------------------- E5
def test_e5_reads_every_dataset_with_upstream_instructions():
    ds = E5(E5_DIR)
    raw = {name: jsonl(E5_DIR / f"{name}.jsonl") for name in E5_DATASETS}
    assert len(ds) == sum(len(v) for v in raw.values()) == 40
    assert ds.group_sizes() == {name: len(v) for name, v in raw.items()}
    by_group: dict[str, list] = {}
    for s in ds:
        by_group.setdefault(s.group, []).append(s)
    fever = by_group["fever"][0]
    assert fever.query == ("Given a claim, retrieve documents that support or refute the claim;",
                           raw["fever"][0]["query"])
    # Upstream training string: f"{instruction}; " + separator + query, separator removed when tokenizing.
    assert joined(fever.query) == ("Given a claim, retrieve documents that support or refute the claim; "
                                   "The Eiffel Tower is located in Berlin.")
    assert fever.positive == ("", raw["fever"][0]["positive"])
    assert fever.negatives == [("", raw["fever"][0]["negative"])]
    assert by_group["msmarco_document"][0].query[0] == (
        "Given a web search query, retrieve relevant documents that answer the query;")
    assert by_group["squad"][0].query[0] == "Retrieve Wikipedia passages that answer the question;"


@pytest.mark.parametrize(
    "name, first, second",
    [
        ("allnli", "Given a premise, retrieve a hypothesis that is entailed by the premise;",
         "Retrieve semantically similar text;"),
        ("quora_duplicates",
         "Given a question, retrieve questions that are semantically equivalent to the given question;",
         "Find questions that have the same meaning as the input question;"),
    ],
)
def test_e5_alternating_instructions_follow_line_parity(name, first, second):
    ds = E5(E5_DIR, datasets=[name])
    raw = jsonl(E5_DIR / f"{name}.jsonl")
    assert [s.query for s in ds] == [((first, second)[i % 2], r["query"]) for i, r in enumerate(raw)]


def test_e5_keeps_first_n_records_per_dataset():
    ds = E5(E5_DIR, max_per_dataset=2)
    assert len(ds) == 2 * len(E5_DATASETS)
    allnli = [s.query[1] for s in ds if s.group == "allnli"]
    assert allnli == [r["query"] for r in jsonl(E5_DIR / "allnli.jsonl")[:2]]
    assert len(E5(E5_DIR, max_per_dataset=None)) == 40


def test_e5_missing_or_unknown_datasets(tmp_path):
    shutil.copytree(E5_DIR, tmp_path / "e5")
    (tmp_path / "e5" / "nq.jsonl").unlink()
    with pytest.raises(FileNotFoundError, match=r"lacks nq\.jsonl"):
        E5(tmp_path / "e5")
    assert len(E5(tmp_path / "e5", datasets=["fever", "squad"])) == 6
    with pytest.raises(ValueError, match="unknown E5 dataset.*dureader"):
        E5(E5_DIR, datasets=["dureader"])


def test_e5_parity_uses_line_position_when_bad_lines_are_skipped(tmp_path, caplog):
    lines = (E5_DIR / "allnli.jsonl").read_text().splitlines()
    lines[1] = '{"query": "broken"'
    (tmp_path / "allnli.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataFormatError, match=r"allnli\.jsonl:2: invalid JSON"):
        E5(tmp_path, datasets=["allnli"])
    ds = E5(tmp_path, datasets=["allnli"], skip_bad_lines=True)
    assert len(ds) == 5 and ds.num_bad_records == 1
    # Line 3 (index 2) keeps the first instruction, as in the untouched file.
    assert ds[1].query[0].startswith("Given a premise")
    assert "skipped 1 malformed record" in caplog.text


# ----------------------------------------------------------------------------------------- MSMARCO
def _passage(p: dict) -> str:
    return f"{p['title']} {p['text']}" if p.get("title") else p["text"]


def test_msmarco_one_positive_and_fifteen_negatives():
    ds = MSMARCO(MSMARCO_FILE, seed=0)
    rows = jsonl(MSMARCO_FILE)
    assert len(ds) == len(rows) == 6
    assert ds.group_sizes() == {"Retrieve text based on user query;": 6}
    for s, row in zip(ds, rows, strict=True):
        assert s.query == ("Retrieve text based on user query;", row["query"])
        assert s.positive == ("", _passage(row["positive_passages"][0]))
        assert len(s.negatives) == 15 and all(inst == "" for inst, _ in s.negatives)
        texts = [t for _, t in s.negatives]
        n_new = min(3, len(row["new_negatives"]))
        assert texts[:n_new] == [_passage(p) for p in row["new_negatives"][:n_new]]
        pool = [_passage(p) for p in row["negative_passages"]]
        assert all(t in pool for t in texts[n_new:])
        if len(pool) >= 15 - n_new:
            assert len(set(texts[n_new:])) == 15 - n_new  # without replacement
    # Title + space + text; an empty title adds nothing (no leading space).
    assert ds[0].positive[1] == "Wikipedia Passage answering 'what is a corporate bond'."
    assert ds[1].positive[1] == "Passage answering 'how long to boil an egg'."
    # One ordinary negative for 12 slots: drawn with replacement.
    assert [t for _, t in ds[3].negatives[3:]] == ["The only ordinary negative passage for this query."] * 12


def test_msmarco_sampling_is_seeded_and_rows_capped():
    a, b, c = (MSMARCO(MSMARCO_FILE, seed=s) for s in (1, 1, 2))
    assert [s.negatives for s in a] == [s.negatives for s in b]
    assert [s.negatives for s in a] != [s.negatives for s in c]
    assert len(MSMARCO(MSMARCO_FILE, max_rows=4)) == 4
    few = MSMARCO(MSMARCO_FILE, num_negatives=4, num_instruction_negatives=1)
    assert all(len(s.negatives) == 4 for s in few)
    assert few[0].negatives[0][1].startswith("Passage about 'what is a corporate bond' that violates")


def test_msmarco_reads_parquet_file_and_hub_layout_folder(tmp_path):
    from datasets import Dataset

    parquet = tmp_path / "file" / "train.parquet"
    parquet.parent.mkdir()
    Dataset.from_list(jsonl(MSMARCO_FILE)).to_parquet(str(parquet))
    folder = tmp_path / "hub_layout" / "data"
    folder.mkdir(parents=True)
    shutil.copy(parquet, folder / "train-00000-of-00001.parquet")
    reference = MSMARCO(MSMARCO_FILE, seed=3)
    for path in (parquet, tmp_path / "hub_layout"):
        ds = MSMARCO(path, seed=3)
        assert [(s.query, s.positive, s.negatives) for s in ds] == [
            (s.query, s.positive, s.negatives) for s in reference
        ]


def test_msmarco_hub_name_goes_to_load_dataset(monkeypatch):
    import datasets

    calls = []
    local = datasets.Dataset.from_list(jsonl(MSMARCO_FILE))

    def fake_load_dataset(path, *args, **kwargs):
        calls.append((path, args, kwargs))
        return local

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    ds = load_train_dataset("MSMARCO")
    assert calls == [("samaya-ai/msmarco-w-instructions", (), {"split": "train"})]
    assert len(ds) == 6


def test_msmarco_bad_rows_name_the_row(tmp_path):
    rows = jsonl(MSMARCO_FILE)
    rows[2]["positive_passages"] = []
    rows[4]["negative_passages"] = []
    rows[4]["new_negatives"] = []
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataFormatError, match=r"train\.jsonl \(train\) row 2: 'positive_passages' is empty"):
        MSMARCO(path)
    ds = MSMARCO(path, skip_bad_lines=True)
    assert len(ds) == 4 and ds.num_bad_records == 2


# --------------------------------------------------------------------------------------- ReasonAug
def test_reasonaug_drops_records_without_hard_negative_and_groups_by_task():
    raw = jsonl(REASONAUG_FILE)
    with_negative = [r for r in raw if r["hard_negative_document"]]
    assert len(with_negative) < len(raw)
    ds = ReasonAug(REASONAUG_FILE)
    assert len(ds) == len(with_negative) == 36
    assert ds.group_sizes() == {f"{t};": n for t, n in Counter(r["task"] for r in with_negative).items()}
    for s, r in zip(ds, with_negative, strict=True):
        assert s.query == (r["task"] + ";", r["user_query"])
        assert s.group == s.query[0]
        assert s.positive == ("", r["positive_document"])
        assert s.negatives == [("", r["hard_negative_document"])]
    p2i = next(s for s in ds if s.query[0].startswith("Gievn"))  # upstream typo kept verbatim
    assert joined(p2i.query).startswith(
        "Gievn a coding problem, retrieve the relevant algorithm that help solve the given problem.; ")


@pytest.mark.parametrize(
    "domain, task, domains, tasks",
    [
        ("coding", "all", {"algorithm", "data structure"}, None),
        ("leetcode", "all", {"algorithm", "data structure"}, None),
        ("aops", "all", {"math theorem"}, None),
        ("theoremqa", "all", {"math theorem", "physics theorem", "finance formula"}, None),
        (["physics", "finance"], "all", {"physics theorem", "finance formula"}, None),
        ("all", "p2i", None, {"p2i"}),
        ("all", ["p2ps", "ps2ps"], None, {"p2ps", "ps2ps"}),
        ("math", "i2ps", {"math theorem"}, {"i2ps"}),
    ],
)
def test_reasonaug_filters(domain, task, domains, tasks):
    raw = [r for r in jsonl(REASONAUG_FILE) if r["hard_negative_document"]]
    expected = [
        r["user_query"]
        for r in raw
        if (domains is None or r["domain"] in domains) and (tasks is None or r["task_type"] in tasks)
    ]
    ds = ReasonAug(REASONAUG_FILE, domain=domain, task=task)
    assert [s.query[1] for s in ds] == expected and expected


def test_reasonaug_filter_errors(tmp_path):
    with pytest.raises(ValueError, match="domain='biology' is not valid"):
        ReasonAug(REASONAUG_FILE, domain="biology")
    with pytest.raises(ValueError, match="task='q2d' is not valid"):
        ReasonAug(REASONAUG_FILE, task="q2d")
    math_only = tmp_path / "math.jsonl"
    math_only.write_text("".join(json.dumps(r) + "\n" for r in jsonl(REASONAUG_FILE) if r["domain"] == "math theorem"))
    with pytest.raises(ValueError, match="no usable record for domain='coding'.*math theorem/p2i: 2"):
        ReasonAug(math_only, domain="coding")


def test_reasonaug_bad_records(tmp_path):
    raw = jsonl(REASONAUG_FILE)[:6]
    raw[1]["domain"] = "biology"
    raw[3]["hard_negative_document"] = 7
    path = tmp_path / "ra.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in raw))
    with pytest.raises(DataFormatError, match=r"ra\.jsonl:2: unknown domain 'biology'"):
        ReasonAug(path)
    ds = ReasonAug(path, skip_bad_lines=True)
    assert len(ds) == 4 and ds.num_bad_records == 2
    raw[1]["domain"] = "algorithm"
    path.write_text("".join(json.dumps(r) + "\n" for r in raw))
    with pytest.raises(DataFormatError, match=r"ra\.jsonl:4: field 'hard_negative_document' must be str, got int"):
        ReasonAug(path)


# ------------------------------------------------------------------------------------------ Custom
def test_custom_instructions_groups_and_negatives():
    ds = Custom(CUSTOM_FILE)
    raw = jsonl(CUSTOM_FILE)
    kept = [r for r in raw if r["negatives"]]
    assert len(ds) == len(kept) == 6
    assert [s.query[1] for s in ds] == [r["query"] for r in kept]
    assert ds[0].query[0] == "Given a programming question, retrieve a helpful answer;"
    assert ds[3].query == ("", "Paris") and ds[4].query == ("", "Mount Fuji")  # absent / null instruction
    assert ds[5].query[0] == "Retrieve a passage that answers the question:"  # ends with ':' -> kept as is
    assert ds.group_sizes() == {
        "Given a programming question, retrieve a helpful answer;": 3,
        "": 2,
        "Retrieve a passage that answers the question:": 1,
    }
    assert all(len(s.negatives) == 1 for s in ds)
    assert ds[0].negatives == [("", "Use sorted(xs) to get the items in ascending order.")]
    assert ds[0].positive == ("", raw[0]["positive"])


def test_custom_num_negatives():
    two = Custom(CUSTOM_FILE, num_negatives=2)
    assert [s.query[1] for s in two] == [
        "How do I reverse a list in Python?",
        "Which metal is liquid at room temperature?",
    ]
    every = Custom(CUSTOM_FILE, num_negatives=None)
    assert [len(s.negatives) for s in every] == [2, 1, 1, 1, 1, 0, 2]
    assert all(s.negatives == [] for s in Custom(CUSTOM_FILE, num_negatives=0))


def test_load_train_dataset_names():
    assert len(load_train_dataset("E5", E5_DIR, max_per_dataset=1)) == 12
    assert len(load_train_dataset("E5Mix", REASONAUG_FILE, domain="math")) == 8
    assert len(load_train_dataset("Custom", CUSTOM_FILE)) == 6
    with pytest.raises(ValueError, match="did you mean 'ReasonAug'"):
        load_train_dataset("Reasonaug", REASONAUG_FILE)
    with pytest.raises(ValueError, match="needs a data file path"):
        load_train_dataset("Custom")



def test_reasonaug_reads_the_shipped_file():
    """The repository's ReasonAug release (gzipped JSONL) through the default path, checked against its stats."""
    release = Path(__file__).parent.parent / "ReasonAug"
    stats = json.loads((release / "stats.json").read_text())["train"]
    ds = load_train_dataset("ReasonAug", release / "ReasonAug_train.jsonl.gz")
    assert len(ds) == stats["records"]  # the release has a hard negative on every record
    assert all(s.group == s.query[0] and s.group.endswith(".;") for s in ds)
    coding = ReasonAug(release / "ReasonAug_train.jsonl.gz", domain="coding")
    assert len(coding) == stats["by_domain"]["algorithm"] + stats["by_domain"]["data structure"]
    math_p2i = ReasonAug(release / "ReasonAug_train.jsonl.gz", domain="math", task="p2i")
    assert len(math_p2i) == stats["by_domain_task"]["math theorem/p2i"]
