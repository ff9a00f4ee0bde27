"""Fault injection, ReasonAug: answers stay with their concepts when the concepts file is edited, duplicates,
the released files' upstream ids, the contamination check's and the CLI's bad inputs, an unreachable server and
stages run out of order."""

from __future__ import annotations

import importlib.util
import json
import random
import re
import shutil
from collections import Counter
from pathlib import Path

import pytest
from isolation import reserved_port
from test_reasonaug_stages import STAGES, FakeLLM, parsed_files, raw_answers

from diffusion_embedder.reasonaug import cli, llm
from diffusion_embedder.reasonaug.concepts import concept_key, load_concepts, request_id
from diffusion_embedder.reasonaug.contamination import find_contaminated, load_benchmark_queries
from diffusion_embedder.reasonaug.pipeline import StageConfig, run_stage
from diffusion_embedder.reasonaug.rebuild import load_generation
from diffusion_embedder.reasonaug.triplets import ConceptData, build_triplets

ROOT = Path(__file__).resolve().parents[1] / "ReasonAug"
ROWS = [json.loads(line) for line in (ROOT / "concepts.jsonl").read_text().splitlines()]
#: Three coding and three math concepts, written without ids (content ids) as a user's own file would be.
BASE = [{k: r[k] for k in ("domain", "instance")} for r in ROWS[:3] + ROWS[150:153]]
NEW = {k: ROWS[200][k] for k in ("domain", "instance")}


def write_concepts(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_all(rows: list[dict], workdir: Path) -> list[str]:
    """Every stage once, with a fresh fake client per stage; returns the request bodies sent."""
    concepts = load_concepts(write_concepts(workdir.parent / f"{workdir.name}.jsonl", rows))
    cfg = StageConfig(workdir, model="fake", rounds=2, seed=1, max_regenerations=2)
    sent = []
    for name in STAGES:
        client = FakeLLM()
        run_stage(name, concepts, cfg, client)
        sent += client.bodies
    return sent


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """The base concepts run to the end once; each edit test starts from a copy of this workdir."""
    workdir = tmp_path_factory.mktemp("base") / "work"
    return workdir, run_all(BASE, workdir)


EDITS = {
    "insert": BASE[:2] + [NEW] + BASE[2:],
    "remove": BASE[:2] + BASE[3:],
    "reorder": BASE[::-1],
    "insert, remove and reorder": [BASE[4], NEW, BASE[0], BASE[5], BASE[1], BASE[3]],
}


@pytest.mark.parametrize("edit", EDITS)
def test_editing_the_concepts_file_keeps_answers_with_their_concepts(first_run, tmp_path, edit):
    """Rerunning an edited concepts file in the used workdir gives exactly what a fresh run gives, sending
    only the requests the first run did not send."""
    base_dir, base_sent = first_run
    reused = tmp_path / "reused"
    shutil.copytree(base_dir, reused)
    rerun_sent = run_all(EDITS[edit], reused)
    fresh_sent = run_all(EDITS[edit], tmp_path / "fresh")
    assert parsed_files(reused) == parsed_files(tmp_path / "fresh")
    assert Counter(rerun_sent) == Counter(fresh_sent) - Counter(base_sent)
    if NEW not in EDITS[edit]:
        assert rerun_sent == []
    else:
        assert rerun_sent and all(NEW["instance"] in body for body in rerun_sent)
    # every answer the first run saved is still in the reused workdir, under the same id
    before, after = raw_answers(base_dir), raw_answers(reused)
    for name, answers in before.items():
        assert answers.items() <= after[name].items()


def test_duplicate_concepts_and_ids_name_both_lines(tmp_path):
    path = tmp_path / "c.jsonl"
    variant = {"domain": BASE[1]["domain"], "instance": "  N-QUEENS problem "}
    write_concepts(path, [BASE[0], BASE[1], BASE[2], variant])
    with pytest.raises(ValueError, match=r"c.jsonl:4: duplicate concept '  N-QUEENS problem ' \(first on line 2\)"):
        load_concepts(path)
    rows = [{**BASE[0], "custom_id": "request-7"}, BASE[1], {**BASE[2], "custom_id": "request-7"}]
    write_concepts(path, rows)
    with pytest.raises(ValueError, match=r"c.jsonl:3: duplicate custom_id 'request-7' \(first on line 1\)"):
        load_concepts(path)
    write_concepts(path, [BASE[0], {**BASE[1], "custom_id": ""}])
    with pytest.raises(ValueError, match=r"c.jsonl:2: 'custom_id' must be a non-empty string"):
        load_concepts(path)


SPELLINGS = [
    "binary  search",  # two spaces inside
    "\tBINARY SEARCH\n",  # tab, newline
    "Binary\u00a0Search",  # no-break space
    "binary\u3000\u2003search ",  # ideographic and em spaces
    "\uff22inary \uff33earch",  # full-width letters
]


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_a_concept_spelt_with_other_case_or_whitespace_is_a_duplicate(tmp_path, spelling):
    """Same name up to case, every run of (Unicode) whitespace and NFKC compatibility forms: one concept."""
    path = tmp_path / "c.jsonl"
    binary = {"domain": "algorithm", "instance": "Binary Search"}
    write_concepts(path, [BASE[0], binary, BASE[1], {"domain": "algorithm", "instance": spelling}])
    with pytest.raises(
        ValueError, match=rf"c.jsonl:4: duplicate concept {re.escape(repr(spelling))} \(first on line 2\)"
    ):
        load_concepts(path)
    names = [ConceptData(name, "algorithm", "coding", "d", ("p",), ("s",)) for name in ("Binary Search", spelling)]
    with pytest.raises(ValueError, match="listed twice"):  # one concept would be its own hard negative
        build_triplets(names)


def test_ids_keep_the_concept_name_as_written(tmp_path):
    """Duplicates are found on the normalised name; ids (pinned from before) are not, so saved answers stay theirs."""
    path = write_concepts(tmp_path / "c.jsonl", [{"domain": "algorithm", "instance": "Binary Search"}])
    assert load_concepts(path)[0].custom_id == concept_key("algorithm", "Binary Search") == "concept-d43b6e93dad973d7"
    assert request_id("definition", "algorithm", "Binary Search", 0, {"model": "m"}) == "definition-r0-6599a9cc2787a17c"


def test_rebuild_maps_concepts_to_upstream_ids_whatever_their_order(tmp_path):
    """The released generation files keep upstream ids; the concepts file's ``custom_id`` maps onto them."""
    picked = ROWS[85:95]  # coding and math concepts around the boundary
    shuffled = picked[:]
    random.Random(0).shuffle(shuffled)
    in_order, _ = load_generation(ROOT / "generation", load_concepts(write_concepts(tmp_path / "a.jsonl", picked)))
    reordered, _ = load_generation(ROOT / "generation", load_concepts(write_concepts(tmp_path / "b.jsonl", shuffled)))
    assert {c.instance: c for c in in_order} == {c.instance: c for c in reordered}
    full, _ = load_generation(ROOT / "generation", load_concepts(ROOT / "concepts.jsonl"))
    by_name = {c.instance: c for c in full}
    assert all(by_name[c.instance] == c for c in reordered)
    write_concepts(tmp_path / "c.jsonl", [{k: r[k] for k in ("domain", "instance")} for r in picked])
    with pytest.raises(ValueError, match=r"has custom_id 'concept-[0-9a-f]+'.*keyed by upstream ids request-<k>"):
        load_generation(ROOT / "generation", load_concepts(tmp_path / "c.jsonl"))


# ---------------------------------------------------------------- contamination check


@pytest.mark.parametrize("name,content", [("q.jsonl", ""), ("q.txt", "\n  \n"), ("q.json", "[]"), ("q.jsonl", "\n")])
def test_empty_benchmark_file_is_refused(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ValueError, match=rf"{name}: no benchmark queries"):
        load_benchmark_queries(path)
    with pytest.raises(ValueError, match="no benchmark queries"):
        find_contaminated(["a query"], [])


@pytest.mark.parametrize("threshold", [0, -0.5, 1.01, float("nan")])
def test_threshold_outside_zero_one_is_refused(tmp_path, threshold, capsys):
    with pytest.raises(ValueError, match=r"threshold must be in \(0, 1\]"):
        find_contaminated(["a query"], ["a query"], threshold)
    (tmp_path / "in.jsonl").write_text(json.dumps({"user_query": "q"}) + "\n")
    (tmp_path / "bench.txt").write_text("q\n")
    args = ["contamination", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl")]
    args += ["--report", str(tmp_path / "r.json"), "--benchmark", str(tmp_path / "bench.txt")]
    assert cli.main([*args, "--threshold", str(threshold)]) == cli.EXIT_USAGE
    assert "--threshold: contamination threshold must be in (0, 1]" in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()
    assert cli.main([*args, "--threshold", "1"]) == 0  # the bound itself is allowed: exact duplicates only
    assert not (tmp_path / "out.jsonl").read_text()


def test_records_without_user_query_name_file_and_line(tmp_path, capsys):
    rows = [{"user_query": "fine"}, {"user_query": "also fine"}, {"query": "wrong field"}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "bench.txt").write_text("something\n")
    args = ["contamination", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl")]
    args += ["--report", str(tmp_path / "r.json"), "--benchmark", str(tmp_path / "bench.txt")]
    assert cli.main(args) == cli.EXIT_USAGE  # the message alone, as for a bad concepts file
    err = capsys.readouterr().err
    assert re.fullmatch(r"error: \S*in.jsonl:3: missing field 'user_query'.*\n", err) and "Traceback" not in err
    assert not (tmp_path / "out.jsonl").exists()


# ---------------------------------------------------------------- batch mode and API keys


def test_batch_mode_waiting_for_uploads_is_a_normal_stop(tmp_path, capsys):
    concepts = write_concepts(tmp_path / "c.jsonl", BASE)
    for stage in ("definitions", "problems"):
        args = [stage, "--workdir", str(tmp_path / "w"), "--concepts", str(concepts), "--rounds", "2", "--batch"]
        assert cli.main(args) == cli.EXIT_AWAITING_BATCH
        err = capsys.readouterr().err
        assert "Traceback" not in err and "save its output as" in err and "rerun the same command" in err
    cfg = StageConfig(tmp_path / "w", rounds=2)
    assert cfg.definition_input.exists() and cfg.problem_input(1).exists() and cfg.problem_input(2).exists()


def test_live_stage_without_api_key_stops_before_sending(tmp_path, monkeypatch, capsys):
    posted = []

    async def post(self, url, headers, body):
        posted.append(headers)
        return 200, {}, {"id": "x", "choices": [{"message": {"content": "**Concept**\nX\n**Definition**\nd"}}]}

    monkeypatch.setattr(llm.UrllibTransport, "post", post)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    concepts = write_concepts(tmp_path / "c.jsonl", BASE[:2])
    args = ["definitions", "--workdir", str(tmp_path / "w"), "--concepts", str(concepts)]
    assert cli.main(args) == cli.EXIT_USAGE
    assert "no API key configured: set OPENAI_API_KEY" in capsys.readouterr().err
    assert posted == [] and not (tmp_path / "w").exists()
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    assert cli.main(args) == 0
    assert len(posted) == 2 and all(h["Authorization"] == "Bearer sk-test" for h in posted)


# ---------------------------------------------------------------- server down, stages out of order


@pytest.fixture
def server_down(monkeypatch):
    """OPENAI_BASE_URL pointing at a localhost port held closed for the test (no other program can open a server
    there meanwhile); retries without waiting."""
    with reserved_port() as port:
        url = f"http://127.0.0.1:{port}/v1"
        monkeypatch.setenv("OPENAI_BASE_URL", url)
        monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
        monkeypatch.setenv("no_proxy", "127.0.0.1")
        monkeypatch.setattr(llm.ChatClient, "backoff", lambda self, attempt, headers=None: 0.0)
        yield url


def load_builder():
    spec = importlib.util.spec_from_file_location("build_reasonaug", ROOT.parent / "experiments" / "build_reasonaug.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_server_down_stops_the_stage_and_the_builder_with_exit_status_4(tmp_path, server_down, monkeypatch, capsys):
    concepts = write_concepts(tmp_path / "c.jsonl", BASE[:2])
    workdir = tmp_path / "w"
    args = ["definitions", "--workdir", str(workdir), "--concepts", str(concepts)]
    assert cli.main(args) == cli.EXIT_REQUESTS_FAILED == 4
    err = capsys.readouterr().err
    assert "error: 2 request(s) of the 'definitions' stage got no answer" in err
    assert f"to reach {server_down}/chat/completions: " in err and "Connection refused" in err
    assert "are kept in" in err and "rerun the same command to send only the requests still unanswered" in err
    # the builder stops at the first stage with that stage's message and status, before any later stage runs
    with pytest.raises(SystemExit) as stop:
        load_builder().main(["--concepts", str(concepts), "--workdir", str(workdir), "--rounds", "1"])
    assert stop.value.code == cli.EXIT_REQUESTS_FAILED
    err = capsys.readouterr().err
    assert "2 request(s) of the 'definitions' stage got no answer" in err and "Traceback" not in err
    assert not (workdir / "gen_problem_solution").exists()
    # switching to --batch with that (empty) answer file: the same stop, not every concept silently dropped
    assert cli.main([*args, "--batch"]) == cli.EXIT_REQUESTS_FAILED
    err = capsys.readouterr().err
    assert "instance_definition_output.jsonl has no answer for 2 of its 2 requests" in err
    assert "run it without --batch to send only the requests still unanswered" in err
    # the server is back: the rerun sends the two failed requests and succeeds
    fake = FakeLLM()
    monkeypatch.setattr(cli, "_client", lambda args: fake)
    assert cli.main(args) == 0 and len(fake.bodies) == 2


def test_a_stage_run_before_the_stage_it_reads_says_which_to_run_first(first_run, tmp_path, capsys):
    concepts = write_concepts(tmp_path / "c.jsonl", BASE)
    common = ["--workdir", str(tmp_path / "empty"), "--concepts", str(concepts), "--batch"]
    for stage, first in [
        ("check-problems", "problems"),
        ("check-solutions", "check-problems"),
        ("negatives", "definitions"),
    ]:
        assert cli.main([stage, *common]) == cli.EXIT_USAGE
        err = capsys.readouterr().err
        assert f"not found: run the '{first}' stage first" in err and "Traceback" not in err
    workdir = tmp_path / "w"
    shutil.copytree(first_run[0], workdir)
    (workdir / "generated_negatives.jsonl").unlink()
    common = ["--workdir", str(workdir), "--concepts", str(concepts), "--rounds", "2", "--seed", "1", "--batch"]
    assert cli.main(["triplets", *common, "--out", str(tmp_path / "t.jsonl"), "--with-generated"]) == cli.EXIT_USAGE
    assert "generated_negatives.jsonl not found: run the 'negatives' stage first" in capsys.readouterr().err


def test_a_live_stage_with_nothing_to_ask_reads_no_missing_answer_file(tmp_path):
    """Every pair failed or was dropped upstream: the check stage asks nothing and finds no answer file."""
    cfg = StageConfig(tmp_path, model="fake", rounds=1)
    cfg.parsed("pairs").write_text("")
    client = FakeLLM()
    report = run_stage("check-problems", load_concepts(write_concepts(tmp_path / "c.jsonl", BASE)), cfg, client)
    assert (report.requests, report.failed, report.kept, client.bodies) == (0, 0, 0, [])
    assert cfg.parsed("checked_pairs").read_text() == ""


def test_builder_without_a_split_checks_only_the_files_triplets_wrote(first_run, tmp_path, monkeypatch):
    """``--heldout-fraction 0`` writes no _train/_heldout files: the contamination step must not look for them."""
    workdir = tmp_path / "w"
    shutil.copytree(first_run[0], workdir)
    concepts = write_concepts(tmp_path / "c.jsonl", BASE)
    monkeypatch.setenv("REASONAUG_MODEL", "fake")  # the model of the saved answers
    (tmp_path / "bench.txt").write_text("a benchmark query\n")
    args = ["--concepts", str(concepts), "--workdir", str(workdir), "--rounds", "2", "--seed", "1", "--batch"]
    load_builder().main([*args, "--heldout-fraction", "0", "--benchmark", str(tmp_path / "bench.txt")])
    assert (workdir / "ReasonAug.clean.jsonl").exists() and not list(workdir.glob("ReasonAug_*"))


def test_triplets_after_a_failed_definitions_stage_names_the_missing_definitions(tmp_path, server_down, monkeypatch,
                                                                                   capsys):
    """Before, the later stages ran on nothing and triplets died with a traceback blaming missing pairs."""
    concepts = write_concepts(tmp_path / "c.jsonl", BASE[:2])
    common = ["--workdir", str(tmp_path / "w"), "--concepts", str(concepts), "--rounds", "1"]
    assert cli.main(["definitions", *common]) == cli.EXIT_REQUESTS_FAILED
    monkeypatch.setattr(cli, "_client", lambda args: FakeLLM())  # a script that goes on regardless
    for stage in ("problems", "check-problems", "check-solutions"):
        assert cli.main([stage, *common]) == 0
    capsys.readouterr()
    assert cli.main(["triplets", *common, "--out", str(tmp_path / "t.jsonl")]) == cli.EXIT_USAGE == 2
    err = capsys.readouterr().err
    names = ", ".join(repr(r["instance"]) for r in BASE[:2])
    assert err == (f"error: {tmp_path / 'w' / 'definitions.jsonl'} has no definition for any of the 2 concepts "
                   f"({names}): rerun the 'definitions' stage until it ends without failed requests, then the stages "
                   "after it\n")
    assert not (tmp_path / "t.jsonl").exists()


BAD_CONCEPTS = {
    "duplicate concept": (lambda: BASE[:2] + [BASE[0]], r"c.jsonl:3: duplicate concept .* \(first on line 1\)"),
    "bad line": (lambda: None, r"c.jsonl:2: "),
    "unknown domain": (lambda: [BASE[0], {"domain": "astrology", "instance": "x"}],
                       r"c.jsonl:2: domain 'astrology' is not one of .*give a 'question_type'"),
    "empty file": (lambda: [], r"c.jsonl"),
}


@pytest.mark.parametrize("command", ["definitions", "triplets"])
@pytest.mark.parametrize("case", BAD_CONCEPTS)
def test_bad_concepts_files_exit_2_with_the_message_alone(tmp_path, capsys, case, command):
    """As the training commands: exit status 2 and one line naming file and line, no traceback (before: a
    ValueError's traceback)."""
    rows, message = BAD_CONCEPTS[case]
    path = tmp_path / "c.jsonl"
    if rows() is None:
        path.write_text(json.dumps(BASE[0]) + "\n{not json\n")
    else:
        write_concepts(path, rows())
    extra = ["--out", str(tmp_path / "t.jsonl")] if command == "triplets" else []
    assert cli.main([command, "--workdir", str(tmp_path / "w"), "--concepts", str(path), "--batch", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert re.search(message, err), err


def test_a_partial_set_of_definitions_is_refused_unless_the_user_allows_it(first_run, tmp_path, capsys, caplog):
    """Before, triplets after a 'definitions' run that failed for 1 of 6 concepts exited 0 and left that concept out
    with a warning only. Now it stops (status 2, naming the concept and the flag), as the negatives stage does, until
    the user passes --allow-missing-definitions; then the set is built without it and the output says so."""
    workdir = tmp_path / "w"
    shutil.copytree(first_run[0], workdir)
    definitions = workdir / "definitions.jsonl"
    rows = definitions.read_text().splitlines()
    dropped = json.loads(rows[2])["instance"]
    definitions.write_text("".join(row + "\n" for row in rows if json.loads(row)["instance"] != dropped))
    concepts = write_concepts(tmp_path / "c.jsonl", BASE)
    common = ["--workdir", str(workdir), "--concepts", str(concepts), "--rounds", "2", "--seed", "1", "--batch"]
    out = tmp_path / "t.jsonl"
    refusal = (f"error: {definitions} has no definition for 1 of the 6 concepts ({dropped!r}): rerun the 'definitions' "
               "stage until it ends without failed requests, then the stages after it; or pass "
               "--allow-missing-definitions to build without them\n")
    for command in (["triplets", *common, "--out", str(out)], ["negatives", *common]):
        assert cli.main(command) == 2
        assert capsys.readouterr().err == refusal
    assert not out.exists()
    assert cli.main(["triplets", *common, "--out", str(out), "--allow_missing_definitions"]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    kept = {r["instance"] for r in records}
    assert kept == {r["instance"] for r in BASE} - {dropped}
    assert not any(dropped in (r["user_query"], r["positive_document"], r["hard_negative_document"]) for r in records)
    assert f"left out, no definition (--allow-missing-definitions): {dropped}" in capsys.readouterr().out
    assert f"No definition for 1 of the 6 concepts, left out (--allow-missing-definitions): {dropped!r}" in caplog.text


@pytest.mark.parametrize(("command", "flags", "message"), [
    ("problems", ["--rounds", "-2"], "rounds: must be >= 1, got -2"),
    ("problems", ["--rounds", "0"], "rounds: must be >= 1, got 0"),
    ("definitions", ["--max-regenerations", "-1"], "max_regenerations: must be >= 0, got -1"),
    ("definitions", ["--concurrency", "0"], "concurrency: must be >= 1, got 0"),
    ("definitions", ["--seed", "1.5"], "seed: 1.5 (float) is not of type int"),
    ("triplets", ["--out", "t.jsonl", "--heldout-fraction", "1"], "heldout_fraction: must be < 1, got 1"),
    ("rebuild", ["--heldout-fraction", "0"], "heldout_fraction: must be > 0, got 0"),
])
def test_numeric_flags_out_of_range_are_refused_before_anything_runs(command, flags, message, tmp_path, capsys,
                                                                      monkeypatch):
    """Before, ``problems --rounds -2`` ran and did nothing; ``rebuild --heldout-fraction 0`` ended in a traceback."""
    monkeypatch.chdir(tmp_path)
    argv = [command, *flags] + (["--workdir", "w", "--batch"] if command != "rebuild" else [])
    with pytest.raises(SystemExit) as stop:
        cli.main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flags[-2]}: {message}" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("argv", "message"), [
    (["definitions", "--workdir", "{file}", "--batch"], "--workdir {file} is a file, not a folder"),
    (["problems", "--workdir", "{file}/w", "--batch"], "--workdir {file}/w lies under {file}, which is a file"),
    (["triplets", "--workdir", "w", "--out", "{folder}"], "--out {folder} is a folder, not a file"),
    (["triplets", "--workdir", "w", "--out", "{file}/t.jsonl"], "the folder of --out {file} is a file"),
    (["contamination", "--input", "i.jsonl", "--output", "{file}/o.jsonl", "--report", "r.json", "--benchmark",
      "b.txt"], "the folder of --output {file} is a file"),
    (["prompts", "--out", "{folder}"], "--out {folder} is a folder, not a file"),
    (["rebuild", "--out-dir", "{file}"], "--out-dir {file} is a file, not a folder"),
])
def test_a_folder_that_is_a_file_is_refused_in_our_words_before_anything_is_written(argv, message, tmp_path, capsys,
                                                                                     monkeypatch):
    """Before, ``definitions --workdir <a file>`` ended in a NotADirectoryError traceback."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a_file").write_text("not a folder")
    (tmp_path / "a_folder").mkdir()
    names = {"file": str(tmp_path / "a_file"), "folder": str(tmp_path / "a_folder")}
    assert cli.main([arg.format(**names) for arg in argv]) == cli.EXIT_USAGE == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message.format(**names)}") and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "a_folder"]
    assert (tmp_path / "a_file").read_text() == "not a folder" and not any((tmp_path / "a_folder").iterdir())
