"""``diffusion-embedder mine`` as a command: bad input is refused with exit status 2, the message alone (flag, file,
line and value named), before the model loads and before any file is written; every flag reaches the code it
controls; a rerun reuses negatives made with the same model, settings and inputs, mines again when a mining option
or a positive changed, and refuses stores made by another model, setting, corpus or queries."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import LLAMA_FIXTURE, ROOT

from diffusion_embedder.evaluation import encode_corpus
from diffusion_embedder.evaluation.store import OtherEmbeddings
from diffusion_embedder.mining import cli as mine_cli
from diffusion_embedder.mining import mine as mine_mod
from diffusion_embedder.mining import mine_hard_negatives

BEIR = ROOT / "tests" / "fixtures" / "beir" / "reasonaug"


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def small_inputs(folder: Path) -> tuple[Path, Path]:
    """A 30-document corpus and 8 pairs (queries: the first words of their positive)."""
    docs = [json.loads(line) for line in (BEIR / "corpus.jsonl").read_text().splitlines()][:30]
    pairs = [{"query": " ".join(d["text"].split()[:10]), "positive": d["text"], "instruction": "Find the problem"}
             for d in docs[:8]]
    return write_jsonl(folder / "corpus.jsonl", docs), write_jsonl(folder / "pairs.jsonl", pairs)


def argv(pairs: Path, corpus: Path | None, out: Path, *extra: str) -> list[str]:
    return ["--base_model_name_or_path", str(LLAMA_FIXTURE), "--pairs", str(pairs), "--output_dir", str(out),
            "--no_progress_bar", "--chunk_size", "16", *(["--corpus", str(corpus)] if corpus else []), *extra]


def no_load(*args, **kwargs):
    raise AssertionError("the model was loaded before the input was checked")


@pytest.fixture
def no_model(monkeypatch):
    """The model must not load: bad input is refused before."""
    monkeypatch.setattr(mine_mod, "load_checkpoint", no_load)


BAD = {
    "an empty corpus": ({"corpus": []}, [], r"corpus\.jsonl: no records \(the file is empty\)"),
    "a pair without a positive": ({"pairs": [{"query": "q", "positive": "p"}, {"query": "q2"}]}, [],
                                  r"pairs\.jsonl:2: missing field 'positive'"),
    "an empty positive": ({"pairs": [{"query": "q", "positive": "p"}, {"query": "q", "positive": " "}]}, [],
                          r"pairs\.jsonl:2: field 'positive' is empty"),
    "a query field missing": ({}, ["--query_field", "question"], r"pairs\.jsonl:1: missing field 'question'"),
    "an instruction not a string": ({"pairs": [{"query": "q", "positive": "p", "instruction": 3}]}, [],
                                    r"pairs\.jsonl:1: field 'instruction' must be str, got int"),
    "a line that is not JSON": ({"pairs": [{"query": "q", "positive": "p"}, "{oops"]}, [],
                                r"pairs\.jsonl:2: invalid JSON"),
    "a positive id the corpus lacks": ({"pairs": [{"query": "q", "positive": "p", "pid": "c1r2"},
                                                  {"query": "q", "positive": "p", "pid": "nope"}]},
                                       ["--positive_id_field", "pid"],
                                       r"pairs\.jsonl:2: field 'pid': 'nope' is not an id of --corpus"),
    "num_negatives above the window": ({}, ["--num_negatives", "9", "--range_min", "2", "--range_max", "10"],
                                       r"--num_negatives 9 is more than the window holds: --range_max 10 - "
                                       r"--range_min 2 = 8"),
    "range_min not below range_max": ({}, ["--range_min", "5", "--range_max", "5"],
                                      "--range_min 5 must be below --range_max 5"),
    "min_score above max_score": ({}, ["--max_score", "0.2", "--min_score", "0.5"],
                                  r"--min_score 0\.5 is above --max_score 0\.2"),
    "a shard outside the shares": ({}, ["--num_shards", "2", "--shard_index", "2"],
                                   r"--shard_index 2 is not in 0 \.\. --num_shards - 1 = 1"),
    "a missing corpus file": ({"corpus": None}, ["--corpus", "missing.jsonl"], "--corpus not found: missing.jsonl"),
    "a missing pairs file": ({"pairs": None}, ["--pairs", "missing.jsonl"], "--pairs not found: missing.jsonl"),
    "an output folder that is a file": ({}, ["--output_dir", "a_file"], "a_file"),
    "positive ids without a corpus": ({"corpus": None}, ["--positive_id_field", "pid"],
                                      "--positive_id_field names the positive's --corpus id: give --corpus too"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_refused_with_status_2_naming_field_and_line_before_the_model_loads(
        case, tmp_path, monkeypatch, capsys, no_model):
    monkeypatch.chdir(tmp_path)
    contents, extra, message = BAD[case]
    corpus, pairs = small_inputs(tmp_path)
    if contents.get("corpus") is not None:
        write_jsonl(corpus, contents["corpus"])
    if contents.get("pairs") is not None:
        write_jsonl(pairs, contents["pairs"])
    (tmp_path / "a_file").write_text("not a folder")
    args = argv(pairs, None if "corpus" in contents and contents["corpus"] is None else corpus, tmp_path / "out")
    status = mine_cli.main([*args, *extra])
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err
    assert err.startswith("error: ") and __import__("re").search(message, err), err
    assert not (tmp_path / "out").exists()  # nothing written


#: Values their flag's type, choices or range refuse, as every command's flags are read (``values``): argparse's
#: error, exit status 2, the flag and the value named.
BAD_VALUES = [
    ("--relative_margin", "lots", "relative_margin: 'lots' (str) is not of type float or null"),
    ("--relative_margin", "1.5", "relative_margin: must be < 1, got 1.5"),
    ("--relative_margin", "nan", "relative_margin: 'nan' (str) is not of type float or null"),
    ("--absolute_margin", "-0.1", "absolute_margin: must be >= 0, got -0.1"),
    ("--max_score", "NaN", "max_score: must be a number, got nan"),
    ("--num_negatives", "0", "num_negatives: must be >= 1, got 0"),
    ("--num_negatives", "2.5", "num_negatives: 2.5 (float) is not of type int"),
    ("--query_block_size", "0", "query_block_size: must be >= 1, got 0"),
    ("--sampling", "best", "sampling: 'best' is not one of ['top', 'random']"),
]


@pytest.mark.parametrize(("flag", "value", "message"), BAD_VALUES)
def test_a_bad_value_of_a_typed_flag_is_an_argparse_error(flag, value, message, tmp_path, capsys, no_model):
    corpus, pairs = small_inputs(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        mine_cli.main([*argv(pairs, corpus, tmp_path / "out"), flag, value])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"argument {flag}" in err and message in err, err
    assert not (tmp_path / "out").exists()


def test_null_turns_a_filter_off_as_in_a_json_config(tmp_path):
    corpus, pairs = small_inputs(tmp_path)
    for text in ("null", "None"):
        args = mine_cli.parse_args([*argv(pairs, corpus, tmp_path / "out"), "--relative_margin", text])
        assert args.relative_margin is None
    assert mine_cli.parse_args(argv(pairs, corpus, tmp_path / "out")).relative_margin == 0.05


def test_the_python_api_refuses_what_the_flag_refuses_in_the_same_words(tmp_path, no_model):
    from diffusion_embedder.values import OptionError

    corpus, pairs = small_inputs(tmp_path)
    common = {"base_model_name_or_path": str(LLAMA_FIXTURE), "show_progress_bar": False}
    for name, value, message in (("relative_margin", 1.5, "relative_margin: must be < 1, got 1.5"),
                                 ("num_negatives", True, "num_negatives: True (bool) is not of type int"),
                                 ("sampling", "best", "sampling: 'best' is not one of ['top', 'random']")):
        with pytest.raises(OptionError, match=__import__("re").escape(message)):
            mine_hard_negatives(str(pairs), str(tmp_path / "out"), str(corpus), **common, **{name: value})
    assert not (tmp_path / "out").exists()


def test_faiss_asked_for_where_it_is_not_installed_is_refused(tmp_path, monkeypatch, capsys, no_model):
    import builtins

    real_import = builtins.__import__

    def without_faiss(name, *args, **kwargs):
        if name == "faiss":
            raise ImportError("No module named 'faiss'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_faiss)
    corpus, pairs = small_inputs(tmp_path)
    assert mine_cli.main([*argv(pairs, corpus, tmp_path / "out"), "--search", "faiss"]) == 2
    assert "--search faiss needs FAISS: pip install 'diffusion_embedder[faiss]'" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------- every flag's glue

class Spies:
    """What the code each flag controls received (the real functions still run)."""

    def __init__(self, monkeypatch):
        self.calls: dict[str, list] = {}
        for module, name in ((mine_mod, "load_checkpoint"), (mine_mod, "encode_chunks"), (mine_mod, "search"),
                             (mine_mod, "select"), (encode_corpus, "encode_chunk"), (mine_mod, "read_inputs")):
            self._wrap(monkeypatch, module, name)

    def _wrap(self, monkeypatch, module, name):
        real = getattr(module, name)

        def spy(*args, **kwargs):
            self.calls.setdefault(name, []).append((args, kwargs))
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)


def test_every_flag_reaches_the_code_it_controls(tmp_path, monkeypatch, capsys):
    from test_docs_examples import lora_adapter

    adapter = lora_adapter(LLAMA_FIXTURE, tmp_path / "adapter")
    docs = [json.loads(line) for line in (BEIR / "corpus.jsonl").read_text().splitlines()][:30]
    corpus = write_jsonl(tmp_path / "corpus.jsonl", [{"doc": d["_id"], "body": d["text"], "head": "Problem"}
                                                     for d in docs])
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"question": " ".join(d["text"].split()[:10]), "pid": d["_id"],
                                                    "answer": "Problem " + d["text"], "task": "Find it"}
                                                   for d in docs[:8]])
    fields = ["--id_field", "doc", "--text_field", "body", "--title_field", "head", "--query_field", "question",
              "--positive_field", "answer", "--instruction_field", "task", "--positive_id_field", "pid"]
    # 1: the model, the encoding and the shares (job 1 of 2 encodes the odd chunks and mines nothing)
    spies = Spies(monkeypatch)
    out = tmp_path / "out"
    first = ["--peft_model_name_or_path", adapter, "--torch_dtype", "bfloat16", "--device", "cpu", "--batch_size",
             "5", "--max_tokens_per_batch", "300", "--num_shards", "2", "--shard_index", "1", "--pooling_mode",
             "weighted_mean"]
    assert mine_cli.main([*argv(pairs, corpus, out, *fields, *first), "--chunk_size", "4"]) == 0
    assert "other shards still to run" in capsys.readouterr().out
    (base, peft, dtype, device), overrides = spies.calls["load_checkpoint"][0]
    assert (base, peft, dtype, device, overrides) == (str(LLAMA_FIXTURE), adapter, "bfloat16", "cpu",
                                                      {"pooling_mode": "weighted_mean"})
    for (_, _, _, manifest, shard, shards, dev, batch, tokens, bar), _ in spies.calls["encode_chunks"]:
        assert (shard, shards, dev, batch, tokens, bar) == (1, 2, None, 5, 300, False)  # None: where it loaded
        assert manifest["chunks"]["chunk_size"] == 4 and manifest["torch_dtype"] == "bfloat16"
        assert manifest["model"]["peft_model_name_or_path"] == adapter
        assert manifest["settings"]["pooling_mode"] == "weighted_mean"
    assert {kw["batch_size"] for _, kw in spies.calls["encode_chunk"]} == {5}
    assert sorted(p.name for p in (out / "documents").glob("chunk-*.json"))[0] == "chunk-000001.json"
    documents = json.loads((out / "documents" / "manifest.json").read_text())
    assert documents["corpus"]["num_rows"] == 30 + 0  # the positives ("Problem " + text) are the corpus's documents
    # 2: the search, the filters, the output (every option not its default)
    spies = Spies(monkeypatch)
    second = ["--num_negatives", "2", "--range_min", "1", "--range_max", "6", "--relative_margin", "null",
              "--absolute_margin", "0.001", "--max_score", "0.99", "--min_score", "0.01", "--sampling", "random",
              "--seed", "5", "--keep_fewer", "--output_scores", "--search", "faiss", "--faiss_index", "Flat",
              "--query_block_size", "3", "--document_block_size", "7"]
    pytest.importorskip("faiss")
    assert mine_cli.main([*argv(pairs, corpus, tmp_path / "out2", *fields, *second)]) == 0
    (queries, documents_, k, similarity), kw = spies.calls["search"][0]
    groups = kw.pop("groups")  # one per document, 30 distinct texts
    assert k == 6 + 1 and kw == {"method": "faiss", "query_block": 3, "document_block": 7, "device": "cpu",
                                 "faiss_index": "Flat"} and list(groups) == list(range(30))
    options = spies.calls["select"][0][0][-1]
    assert (options.num_negatives, options.range_min, options.range_max, options.relative_margin,
            options.absolute_margin, options.max_score, options.min_score, options.sampling, options.seed) == (
        2, 1, 6, None, 0.001, 0.99, 0.01, "random", 5)
    records = [json.loads(line) for line in (tmp_path / "out2" / "negatives.jsonl").read_text().splitlines()]
    assert len(records) == 8 and {"positive_score", "negative_scores", "negative_ranks"} <= records[0].keys()
    assert records[0]["query"] == " ".join(docs[0]["text"].split()[:10]) and records[0]["instruction"] == "Find it"
    assert records[0]["positive"] == "Problem " + docs[0]["text"]
    assert all(docs[i]["_id"] not in r["negative_ids"] for i, r in enumerate(records))  # by id: the doc field
    read = spies.calls["read_inputs"][0][0][0]
    assert (read.id_field, read.text_field, read.title_field, read.positive_id_field) == ("doc", "body", "head", "pid")
    # every mining flag is in one of the two runs (a new flag must be added here)
    given = {a for a in [*fields, *first, *second, *argv(pairs, corpus, out)] if a.startswith("--")}
    flags = {a.option_strings[-1] for a in mine_cli.build_parser()._actions if a.option_strings}
    from diffusion_embedder.config import SETTING_NAMES

    settings = {f"--{name}" for name in SETTING_NAMES} - {"--pooling_mode"}  # encode's flags, tested with encode
    assert flags - settings - {"--help"} == given


# ------------------------------------------------------------------------------------------------ reruns


@pytest.fixture(scope="module")
def mined(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("mined")
    corpus, pairs = small_inputs(folder)
    mine_hard_negatives(str(pairs), str(folder / "out"), str(corpus), base_model_name_or_path=str(LLAMA_FIXTURE),
                        chunk_size=16, relative_margin=None, range_max=8)
    return folder


def rerun(folder: Path, **options):
    return mine_hard_negatives(str(folder / "pairs.jsonl"), str(folder / "out"), str(folder / "corpus.jsonl"),
                               **({"base_model_name_or_path": str(LLAMA_FIXTURE), "chunk_size": 16,
                                   "relative_margin": None, "range_max": 8} | options))


def test_a_rerun_with_the_same_inputs_reuses_and_a_changed_option_or_positive_mines_again(mined, tmp_path,
                                                                                          monkeypatch):
    shutil.copytree(mined, tmp_path / "run")
    run = tmp_path / "run"
    before = (run / "out" / "negatives.jsonl").read_bytes()
    stamp = os.stat(run / "out" / "negatives.jsonl").st_mtime_ns
    encoded = []
    real = encode_corpus.encode_chunk
    monkeypatch.setattr(encode_corpus, "encode_chunk", lambda *a, **k: encoded.append(len(a[1])) or real(*a, **k))
    assert rerun(run).status == "reused" and not encoded
    assert os.stat(run / "out" / "negatives.jsonl").st_mtime_ns == stamp
    # a mining option changed: mined again from the stored embeddings, as a fresh run gives it
    for n, options in enumerate(({"num_negatives": 2}, {"sampling": "random"}, {"relative_margin": 0.05},
                                 {"output_scores": True})):
        summary = rerun(run, **options)
        assert summary.status == "mined" and not encoded, options  # from the stores: nothing encoded again
        fresh = tmp_path / f"fresh{n}"
        shutil.copytree(mined, fresh)
        shutil.rmtree(fresh / "out")
        rerun(fresh, **options)
        assert (run / "out" / "negatives.jsonl").read_bytes() == (fresh / "out" / "negatives.jsonl").read_bytes()
        assert (run / "out" / "negatives.jsonl").read_bytes() != before
        encoded.clear()
    # a positive changed (another corpus document: the stores are the same): mined again, the new positive excluded
    pairs = [json.loads(line) for line in (run / "pairs.jsonl").read_text().splitlines()]
    docs = [json.loads(line) for line in (run / "corpus.jsonl").read_text().splitlines()]
    top = json.loads((run / "out" / "negatives.jsonl").read_text().splitlines()[0])["negative_ids"][0]
    pairs[0]["positive"] = next(d["text"] for d in docs if d["_id"] == top)
    write_jsonl(run / "pairs.jsonl", pairs)
    assert rerun(run).status == "mined"
    assert top not in json.loads((run / "out" / "negatives.jsonl").read_text().splitlines()[0])["negative_ids"]
    # the negatives edited by hand: never taken for the manifest's
    path = run / "out" / "negatives.jsonl"
    path.write_text(path.read_text().replace("a", "b", 1))
    assert rerun(run).status == "mined"
    # negatives mined under older rules (a manifest without the rules' number, as they were written): mined again
    assert rerun(run).status == "reused"
    monkeypatch.setattr(mine_mod.output, "RULES", mine_mod.output.RULES + 1)
    assert rerun(run).status == "mined" and not encoded


def test_stores_of_another_model_setting_corpus_or_queries_are_refused(mined, tmp_path, family_checkpoint,
                                                                       monkeypatch):
    """Another model or setting is refused once the model loads; another corpus, queries or instruction before
    (they are known without the model), as ``encode`` refuses them."""
    real = mine_mod.load_checkpoint
    cases = {
        "model.weights_sha256": {"base_model_name_or_path": str(family_checkpoint("llama"))},
        "encoder setting pooling_mode": {"pooling_mode": "weighted_mean"},
        "corpus.fingerprint": "corpus",
        "queries": "queries",
        "instruction": "instruction",
    }
    for expected, change in cases.items():
        run = tmp_path / expected.replace(" ", "_")
        shutil.copytree(mined, run)
        before = {p: p.read_bytes() for p in (run / "out").rglob("*") if p.is_file()}
        options = change if isinstance(change, dict) else {}
        monkeypatch.setattr(mine_mod, "load_checkpoint", real if options else no_load)
        if change == "corpus":
            docs = [json.loads(line) for line in (run / "corpus.jsonl").read_text().splitlines()]
            docs[-1]["text"] += " changed"
            write_jsonl(run / "corpus.jsonl", docs)
        elif change in ("queries", "instruction"):
            pairs = [json.loads(line) for line in (run / "pairs.jsonl").read_text().splitlines()]
            pairs[0][{"queries": "query", "instruction": "instruction"}[change]] += " changed"
            write_jsonl(run / "pairs.jsonl", pairs)
            expected = "queries holds.*corpus.fingerprint"  # the queries' store, for its "corpus" (the queries)
        other = "holds the embeddings of another model, settings or corpus"
        refusal = expected if "holds" in expected else f"{other}.*{expected}"
        with pytest.raises(OtherEmbeddings, match=refusal):
            rerun(run, **options)
        assert before == {p: p.read_bytes() for p in (run / "out").rglob("*") if p.is_file()}  # nothing written


def test_the_mining_page_s_options_table_gives_the_code_s_defaults():
    """docs/mining.md's table names each flag with its default: the flags exist and the defaults are the parser's
    (``off`` for a filter or budget that is None, ``on``/``off`` for a switch)."""
    import re

    defaults = vars(mine_cli.build_parser().parse_args([]))
    rows = re.findall(r"^\| ((?:`--\w+`(?:, )?)+) \| ([^|]+) \|", (ROOT / "docs" / "mining.md").read_text(), re.M)
    assert len(rows) >= 15
    for flags, written in rows:
        names = re.findall(r"`--(\w+)`", flags)
        for name, text in zip(names, written.split(", "), strict=True):
            value = defaults[name]
            expected = "off" if value is None or value is False else str(value)
            expected = f"`{expected}`" if isinstance(value, str) else expected
            assert text.strip() == expected, name
