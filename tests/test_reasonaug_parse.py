"""Parsers and prompt templates against the real upstream ReasonAug generation files (shipped gzipped)."""

import gzip
import hashlib
import json
from collections import Counter
from pathlib import Path

import pytest

from diffusion_embedder.reasonaug.concepts import concept_key, load_concepts
from diffusion_embedder.reasonaug.llm import read_batch_outputs, read_jsonl
from diffusion_embedder.reasonaug.parse import (
    is_yes,
    parse_code_verdict,
    parse_definition,
    parse_problem_check,
    parse_problem_solution,
)
from diffusion_embedder.reasonaug.prompts import (
    CODING_CONTEXTS,
    DEFINITION_SYSTEM,
    MATH_CONTEXTS,
    PROBLEM_SYSTEM,
    REAL_WORLD_CONTEXT,
    ProblemOptions,
    definition_prompt,
    problem_prompt,
    render_prompt_card,
    task_instruction,
)

ROOT = Path(__file__).resolve().parents[1] / "ReasonAug"
GEN = ROOT / "generation"


@pytest.fixture(scope="module")
def concepts():
    return load_concepts(ROOT / "concepts.jsonl")


def test_generation_copies_are_byte_identical_to_upstream():
    sums = [line.split("  ") for line in (GEN / "SHA256SUMS").read_text().splitlines()]
    assert len(sums) == 19
    for digest, rel in sums:
        data = gzip.decompress((GEN / (rel + ".gz")).read_bytes())
        assert hashlib.sha256(data).hexdigest() == digest, rel


def test_concept_list(concepts):
    assert len(concepts) == 300
    assert Counter(c.domain for c in concepts) == {
        "algorithm": 60,
        "data structure": 30,
        "math theorem": 100,
        "physics theorem": 80,
        "finance formula": 30,
    }
    assert [c.custom_id for c in concepts] == [f"request-{k}" for k in range(1, 301)]


def test_problem_solution_parser_on_real_outputs():
    counts = Counter()
    for r in range(1, 9):
        outputs = read_batch_outputs(GEN / f"gen_problem_solution/outputs/problem_solution_output_{r}.jsonl.gz")
        assert len(outputs) == 300
        for cid, res in outputs.items():
            parsed = parse_problem_solution(res.content)
            counts[parsed is not None] += 1
            if parsed is None:
                counts[(r, cid)] += 1
            else:
                problem, solution = parsed
                assert problem and solution and "**Solution" not in problem and "**Problem" not in problem
    assert counts[True] == 2398
    assert counts[False] == 2  # the two answers with no Solution tag (upstream regenerated them live)
    assert counts[(2, "request-66")] == 1 and counts[(8, "request-73")] == 1


def test_definition_parser_on_real_outputs(concepts):
    outputs = read_batch_outputs(GEN / "gen_instance_definition/instance_definition_output.jsonl.gz")
    name = {c.custom_id: c.instance for c in concepts}
    parsed = {cid: parse_definition(res.content, name[cid]) for cid, res in outputs.items()}
    assert sum(p is not None for p in parsed.values()) == 300
    # 15 answers start directly with **Definition**: the concept falls back to the requested name
    no_tag = [cid for cid, res in outputs.items() if "**Concept**" not in res.content]
    assert len(no_tag) == 15
    assert all(parsed[cid].concept == name[cid] for cid in no_tag)
    assert parsed["request-1"].concept == "Two Pointers"
    assert parsed["request-1"].definition.startswith("The Two Pointers technique is an algorithmic paradigm")
    coding = {c.custom_id for c in concepts if c.question_type == "coding"}
    assert {cid for cid, p in parsed.items() if "**Implementation Code**" in p.definition} == coding
    assert len(coding) == 90
    assert all("**Definition**" not in p.definition for p in parsed.values())


def test_solution_check_parsers_on_real_outputs():
    outputs = read_batch_outputs(GEN / "gen_problem_solution/solution_check_output.jsonl.gz")
    assert len(outputs) == 2399 and "641" not in outputs
    counts = Counter()
    for cid, res in outputs.items():
        coding = (int(cid) - 1) // 8 < 90  # pair ids are concept-major; concepts 1..90 are coding
        if coding:
            counts["code", parse_code_verdict(res.content) is not None] += 1
        else:
            counts["yes", is_yes(res.content)] += 1
    assert counts == {("code", True): 521, ("code", False): 198, ("yes", True): 1062, ("yes", False): 618}


def test_parsers_never_crash_on_malformed_input():
    for text in ["", "**Solution**", "**Problem** x **Solution** a **Solution** b", "no tags at all", "**Problem**"]:
        assert parse_problem_solution(text) is None
    assert parse_problem_solution("**Problem:**\n. Find x.\n**solution:** x = 2") == ("Find x.", "x = 2")
    assert parse_definition("just text", "X") is None
    assert parse_definition("**Concept**\nX\n**Definition**\n   ", "X") is None
    assert parse_problem_check("YES") == (True, None)
    assert parse_problem_check("No. **Problem** P2 **Solution** S2") == (False, ("P2", "S2"))
    assert parse_problem_check("No, it does not.") == (False, None)
    assert parse_code_verdict("NO") is None
    assert parse_code_verdict("Yes\n```java\nclass A {}\n```") is None
    assert parse_code_verdict("Yes\n```python\nx = 1\n```") == "x = 1\n"
    assert is_yes("  Yes, correct") and is_yes("The answer is **YES**.") and not is_yes("No.")


def test_definition_prompts_reproduce_real_requests(concepts):
    requests = [r for _, r in read_jsonl(GEN / "gen_instance_definition/instance_definition_input.jsonl.gz")]
    assert len(requests) == 300
    for c, req in zip(concepts, requests, strict=True):
        assert req["custom_id"] == c.custom_id
        system, user = req["body"]["messages"]
        assert system == {"role": "system", "content": DEFINITION_SYSTEM}
        assert user["content"] == definition_prompt(c.domain, c.instance, c.question_type)
        assert req["body"]["max_tokens"] == 1000


def _infer_options(prompt: str, c) -> ProblemOptions:
    lines = prompt.split("\n")
    pool = (
        CODING_CONTEXTS
        if c.question_type == "coding"
        else MATH_CONTEXTS
        if c.question_type == "math"
        else [REAL_WORLD_CONTEXT]
    )
    context = next((x for x in pool if x and x in lines), "")
    prefix = "The problem should be as difficult as "
    difficulty = next((x[len(prefix) : -1] for x in lines if x.startswith(prefix)), None)
    prefix = "The problem should be solved "
    solved = next((x[len(prefix) : -1] for x in lines if x.startswith(prefix)), None)
    return ProblemOptions(
        context=context,
        difficulty=difficulty,
        solved=solved,
        solution_no_mention=f"The solution should not explicitly mention {c.instance}." in lines,
        four_sentences="The problem should be around four sentences long." in lines,
    )


def test_problem_prompts_reproduce_all_2400_real_requests(concepts):
    seen_refs = Counter()
    for r in range(1, 9):
        requests = [r for _, r in read_jsonl(GEN / f"gen_problem_solution/inputs/problem_solution_input_{r}.jsonl.gz")]
        for c, req in zip(concepts, requests, strict=True):
            system, user = req["body"]["messages"]
            assert system["content"] == PROBLEM_SYSTEM
            opts = _infer_options(user["content"], c)
            assert problem_prompt(c.question_type, c.domain, c.instance, opts) == user["content"], (r, c.instance)
            if opts.difficulty:
                assert opts.difficulty in c.references
                seen_refs[c.domain, opts.difficulty] += 1
    assert len(seen_refs) == 7 + 7 + 6 + 6 + 4  # every difficulty reference of every domain occurs


def test_task_instructions_fix_the_typo():
    assert task_instruction("p2i", "math theorem", "math") == (
        "Given a math problem, retrieve the relevant math theorem that help solve the given problem."
    )
    with pytest.raises(ValueError, match="unknown task_type"):
        task_instruction("x2y", "a", "b")


def test_shipped_prompt_card_is_current():
    assert (ROOT / "prompts.md").read_text(encoding="utf-8") == render_prompt_card()


def test_concepts_file_errors_name_line(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text(json.dumps({"domain": "algorithm", "instance": "A"}) + "\n" + json.dumps({"domain": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"c.jsonl:2: 'instance'"):
        load_concepts(p)
    p.write_text(json.dumps({"domain": "chemistry law", "instance": "Le Chatelier"}) + "\n")
    with pytest.raises(ValueError, match=r"c.jsonl:1: domain 'chemistry law'.*question_type"):
        load_concepts(p)
    p.write_text(json.dumps({"domain": "chemistry law", "instance": "Le Chatelier", "question_type": "chemistry"}))
    (c,) = load_concepts(p)
    assert c.question_type == "chemistry" and c.references == [] and c.custom_id == concept_key(c.domain, c.instance)
