"""The whole generation pipeline against a fake LLM: resumability, regeneration, batch mode, triplets."""

import asyncio
import hashlib
import json
import re
from collections import Counter
from pathlib import Path

import pytest

from diffusion_embedder.reasonaug import cli, pipeline
from diffusion_embedder.reasonaug.concepts import load_concepts
from diffusion_embedder.reasonaug.llm import LLMError, read_batch_outputs, read_jsonl
from diffusion_embedder.reasonaug.pipeline import StageConfig, build_requests, load_concept_data, run_stage
from diffusion_embedder.reasonaug.prompts import TASK_TYPES
from diffusion_embedder.reasonaug.triplets import RECORD_FIELDS, build_triplets

ROOT = Path(__file__).resolve().parents[1] / "ReasonAug"


def _h(text: str) -> int:
    return int(hashlib.sha1(text.encode()).hexdigest(), 16)


def words(name: str, k: int) -> str:
    """Concept-specific vocabulary, so BM25 has something to rank on."""
    stem = re.sub(r"\W", "", name).lower()
    return " ".join(f"{stem}{i}" for i in range(k))


def fake_answer(body: dict) -> str:
    """Deterministic stand-in for GPT-4o-mini; some answers are malformed or negative on purpose."""
    prompt = body["messages"][-1]["content"]
    seed = body.get("seed", 0)
    m = re.search(r"definition for the (.+?): (.+?)(?: with the implementation code\.|\. Write the equation)", prompt)
    if m:
        name = m.group(2)
        return f"**Concept**\n{name}\n**Definition**\n{name} means {words(name, 6)}."
    m = re.search(r"require or test about the (.+?): (.+?)\.\n", prompt)
    if m:
        name, tag = m.group(2), _h(prompt) % 1000
        if _h(prompt) % 5 == 0 and seed == 0:
            return f"**Problem**\nA task about {name} without any solution tag."
        return f"**Problem**\nTask {tag}: {words(name, 4)} story {tag}.\n**Solution**\nUse {words(name, 3)} step {tag}."
    m = re.search(r"Is this problem testing or requiring (.+?)\? If yes", prompt)
    if m:
        h = _h(json.dumps(body["messages"]))
        if h % 7 == 0:
            return f"No. **Problem** Rewritten task {h % 10007}. **Solution** Rewritten answer {h % 10007}."
        return "No, sorry." if h % 11 == 0 and seed == 0 else "YES"
    m = re.search(r"using the (.+?)\? (If yes, response with the the updated Python|Response \"YES\")", prompt)
    if m:
        bad = _h(prompt) % 6 == 0
        if m.group(2).startswith("If yes"):
            return "NO" if bad else f"Yes.\n```python\ndef solve():\n    '''verified {_h(prompt) % 10**9}'''\n```"
        return "No." if bad else "YES"
    if "hard negative document" in prompt:
        return f"A different-concept document {_h(prompt) % 1000}."
    raise AssertionError(f"unexpected prompt: {prompt[:200]}")


class Killed(Exception):
    """Stands for the process being killed mid-stage."""


class FakeLLM:
    def __init__(self, fail_after: int | None = None):
        self.bodies: list[str] = []
        self.fail_after = fail_after

    async def complete(self, body):
        await asyncio.sleep(0)
        if self.fail_after is not None and len(self.bodies) >= self.fail_after:
            raise Killed("killed")
        self.bodies.append(json.dumps(body, sort_keys=True))
        return {"id": "x", "choices": [{"message": {"content": fake_answer(body)}, "finish_reason": "stop"}]}


@pytest.fixture(scope="module")
def concepts(tmp_path_factory):
    rows = [json.loads(line) for line in (ROOT / "concepts.jsonl").read_text().splitlines()]
    picked = [r for r in rows if r["domain"] == "algorithm"][:6] + [r for r in rows if r["domain"] == "math theorem"][
        :6
    ]
    path = tmp_path_factory.mktemp("concepts") / "concepts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in picked))
    return load_concepts(path)


STAGES = ("definitions", "problems", "check-problems", "check-solutions", "negatives")


def problem_requests(concepts, round_, cfg):
    return build_requests(pipeline.STAGES["problems"], concepts, round_, cfg)


def run_pipeline(concepts, workdir, fail_after=None):
    cfg = StageConfig(workdir, model="fake", rounds=3, seed=1, max_regenerations=2)
    clients, reports = [], {}
    for name in STAGES:
        while True:
            clients.append(FakeLLM(fail_after))
            try:
                reports[name] = run_stage(name, concepts, cfg, clients[-1])
                break
            except Killed:
                continue
    return cfg, [b for c in clients for b in c.bodies], reports


def parsed_files(workdir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(workdir.glob("*.jsonl")) if "gen_hard_negative" not in p.name}


def raw_answers(workdir: Path) -> dict[str, dict]:
    return {
        str(p.relative_to(workdir)): {k: v.content for k, v in read_batch_outputs(p).items()}
        for p in sorted(workdir.rglob("*output*.jsonl"))
    }


@pytest.fixture(scope="module")
def uninterrupted(concepts, tmp_path_factory):
    return run_pipeline(concepts, tmp_path_factory.mktemp("a"))


def test_interrupted_reruns_equal_uninterrupted_run(concepts, uninterrupted, tmp_path):
    cfg_a, bodies_a, _ = uninterrupted
    cfg_b, bodies_b, _ = run_pipeline(concepts, tmp_path / "b", fail_after=7)
    assert parsed_files(cfg_a.workdir) == parsed_files(cfg_b.workdir)
    assert raw_answers(cfg_a.workdir) == raw_answers(cfg_b.workdir)
    assert Counter(bodies_b) == Counter(bodies_a)  # nothing sent twice, nothing missing
    assert max(Counter(bodies_b).values()) == 1
    # a third run finds everything done and sends nothing
    _, bodies_c, reports = run_pipeline(concepts, cfg_b.workdir)
    assert bodies_c == [] and all(r.sent == 0 for r in reports.values())


def test_stage_reports_count_malformed_regenerated_and_dropped(uninterrupted, concepts):
    cfg, _, reports = uninterrupted
    assert reports["definitions"].kept == 12 and reports["definitions"].malformed == 0
    problems = reports["problems"]
    assert problems.requests == 36 and problems.malformed > 0 and problems.dropped == 0  # all regenerated
    outputs = {}
    for r in range(1, 4):
        outputs.update({f"{r}:{k}": v for k, v in read_batch_outputs(cfg.problem_output(r)).items()})
    assert sum("#retry1" in k for k in outputs) == problems.malformed
    pc = reports["check-problems"]
    assert pc.kept + pc.dropped == problems.kept and pc.rewritten > 0
    sc = reports["check-solutions"]
    assert sc.kept + sc.rejected + sc.dropped == pc.kept and sc.rejected > 0
    verified = [r for _, r in read_jsonl(cfg.parsed("verified_pairs"))]
    assert len(verified) == sc.kept
    coding = [p for p in verified if p["question_type"] == "coding"]
    assert coding and all(p["solution"].startswith("def solve():") for p in coding)
    rewritten = [p for p in verified if p["problem_check"] == "rewritten"]
    assert rewritten and all(p["problem"].startswith("Rewritten task ") for p in rewritten)


def test_problem_prompts_are_seeded_per_item(concepts, tmp_path):
    a = StageConfig(tmp_path / "a", rounds=2, seed=3)
    r1 = problem_requests(concepts, 1, a)
    assert problem_requests(concepts, 1, a) == r1
    assert problem_requests(concepts[3:], 1, a) == r1[3:]  # an item's prompt does not depend on the others
    assert problem_requests(concepts, 2, a) != r1
    assert problem_requests(concepts, 1, StageConfig(tmp_path, rounds=2, seed=4)) != r1


def test_batch_mode_parses_a_downloaded_output_file(concepts, uninterrupted, tmp_path):
    cfg_a, _, _ = uninterrupted
    cfg = StageConfig(tmp_path / "batch", model="fake", rounds=3, seed=1)
    with pytest.raises(FileNotFoundError, match="Batch API") as e:
        run_stage("definitions", concepts, cfg, None)
    assert f"save its output as {cfg.definition_output}" in str(e.value)
    with pytest.raises(FileNotFoundError, match="problem_solution_output_3.jsonl"):
        run_stage("problems", concepts, cfg, None)
    assert [cfg.problem_input(r).exists() for r in (1, 2, 3)] == [True] * 3
    assert cfg.definition_input.exists()
    assert cfg.definition_input.read_bytes() == cfg_a.definition_input.read_bytes()
    cfg.definition_output.write_bytes(cfg_a.definition_output.read_bytes())
    report = run_stage("definitions", concepts, cfg, None)
    assert report.sent == 0 and report.kept == 12
    assert cfg.parsed("definitions").read_bytes() == cfg_a.parsed("definitions").read_bytes()


def test_pipeline_triplets_and_generated_negatives(uninterrupted, concepts):
    cfg, _, reports = uninterrupted
    data = load_concept_data(cfg, concepts)
    records = build_triplets(data)
    assert {r["task_type"] for r in records} == set(TASK_TYPES)
    domain = {c.instance: c.domain for c in concepts}
    for r in records:
        assert tuple(r) == RECORD_FIELDS
        assert r["negative_instance"] != r["instance"] and domain[r["negative_instance"]] == r["domain"]
        assert r["hard_negative_document"] != r["positive_document"]
    generated = [r for _, r in read_jsonl(cfg.parsed("generated_negatives"))]
    assert len(generated) == reports["negatives"].kept > 0
    assert all(r["negative_instance"] == "GENERATED" and r["hard_negative_document"] for r in generated)


def test_cli_triplets_with_split(uninterrupted, concepts, tmp_path, capsys):
    cfg, _, _ = uninterrupted
    concepts_file = tmp_path / "c.jsonl"
    concepts_file.write_text(
        "".join(
            json.dumps({"domain": c.domain, "instance": c.instance, "custom_id": c.custom_id}) + "\n" for c in concepts
        )
    )
    out = tmp_path / "ra.jsonl"
    args = ["triplets", "--workdir", str(cfg.workdir), "--concepts", str(concepts_file), "--out", str(out)]
    assert cli.main(args + ["--heldout-fraction", "0.34", "--with-generated", "--batch"]) == 0
    records = [r for _, r in read_jsonl(out)]
    assert [r["id"] for r in records] == [str(i) for i in range(1, len(records) + 1)]
    assert any(r["negative_instance"] == "GENERATED" for r in records)
    train = {r["instance"] for _, r in read_jsonl(tmp_path / "ra_train.jsonl")}
    held = {r["instance"] for _, r in read_jsonl(tmp_path / "ra_heldout.jsonl")}
    assert train and held and not train & held
    for side in ("train", "heldout"):
        rows = [r for _, r in read_jsonl(tmp_path / f"ra_{side}.jsonl")]
        assert [r["id"] for r in rows] == [str(i) for i in range(1, len(rows) + 1)]
        assert any(r["negative_instance"] == "GENERATED" for r in rows)


def test_cli_llm_stage_uses_the_client_and_batch_mode(uninterrupted, concepts, tmp_path, monkeypatch, capsys):
    cfg_a, _, _ = uninterrupted
    concepts_file = tmp_path / "c.jsonl"
    concepts_file.write_text(
        "".join(
            json.dumps({"domain": c.domain, "instance": c.instance, "custom_id": c.custom_id}) + "\n" for c in concepts
        )
    )
    fake = FakeLLM()
    monkeypatch.setattr(cli, "_client", lambda args: None if args.batch else fake)
    base = ["--concepts", str(concepts_file), "--model", "fake", "--rounds", "3", "--seed", "1"]
    assert cli.main(["definitions", "--workdir", str(tmp_path / "live"), *base]) == 0
    assert len(fake.bodies) == 12
    assert json.loads(capsys.readouterr().out)["kept"] == 12
    assert (tmp_path / "live" / "definitions.jsonl").read_bytes() == cfg_a.parsed("definitions").read_bytes()
    assert cli.main(["definitions", "--workdir", str(tmp_path / "batch"), "--batch", *base]) == cli.EXIT_AWAITING_BATCH
    assert "Batch API" in capsys.readouterr().err


def defined_concept(body) -> str:
    return re.search(r"definition for the .+?: (.+?)(?: with the implementation code\.|\. Write)", body).group(1)


class FailingLLM(FakeLLM):
    """Answers every definition request except those for the named concepts (a non-retryable HTTP error)."""

    def __init__(self, failing: set[str]):
        super().__init__()
        self.failing = failing

    async def complete(self, body):
        if defined_concept(body["messages"][-1]["content"]) in self.failing:
            raise LLMError("HTTP 400", 400)
        return await super().complete(body)


def test_failed_requests_are_counted_dropped_and_sent_again(concepts, tmp_path):
    """A request that fails for good is counted in ``failed``, its item dropped; the next run sends only it."""
    cfg = StageConfig(tmp_path, model="fake", rounds=1, seed=1)
    failing = {concepts[2].instance, concepts[7].instance}
    report = run_stage("definitions", concepts, cfg, FailingLLM(failing))
    assert (report.requests, report.sent, report.failed, report.dropped, report.kept) == (12, 10, 2, 2, 10)
    ids = [r["custom_id"] for _, r in read_jsonl(cfg.definition_input)]
    assert len(set(ids)) == len(ids) == 12  # the Batch API refuses a file with a repeated custom_id
    again = FakeLLM()
    report = run_stage("definitions", concepts, cfg, again)
    assert (report.sent, report.skipped, report.failed, report.kept) == (2, 10, 0, 12)
    assert {defined_concept(json.loads(body)["messages"][-1]["content"]) for body in again.bodies} == failing
