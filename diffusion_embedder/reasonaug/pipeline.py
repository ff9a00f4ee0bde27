"""The ReasonAug generation stages: one resumable runner, and one record per stage saying what differs.

Every stage (1) writes its Batch-API request file (deterministic: prompts are seeded per item),
(2) sends the requests not yet answered in the stage's output file, appending answers one by one (or,
without a client, expects the file downloaded from the OpenAI Batch API at the same path), and
(3) parses the answers into a JSONL consumed by the next stage. Malformed answers are counted and
regenerated (``<custom_id>#retry<n>``) up to ``max_regenerations`` times, then dropped. Request ids come
from the request's content (``concepts.request_id``), so answers stay with their concepts whatever the
concepts file's order. A :class:`Stage` holds what differs between stages (its items, the request per
item, the answer check, the record per answer, the files); :func:`run_stage` does the rest.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

from diffusion_embedder.reasonaug.concepts import Concept, request_id
from diffusion_embedder.reasonaug.llm import (
    Completer,
    make_request,
    read_jsonl,
    read_saved_answers,
    run_with_regeneration,
    select_answer,
    write_batch_requests,
    write_jsonl,
)
from diffusion_embedder.reasonaug.parse import (
    is_yes,
    parse_code_verdict,
    parse_definition,
    parse_problem_check,
    parse_problem_solution,
)
from diffusion_embedder.reasonaug.prompts import (
    DEFINITION_MAX_TOKENS,
    DEFINITION_SYSTEM,
    NEGATIVE_SYSTEM,
    PROBLEM_MAX_TOKENS,
    PROBLEM_SYSTEM,
    SOLUTION_CHECK_SYSTEM,
    definition_prompt,
    negative_prompt,
    problem_check_prompt,
    problem_prompt,
    sample_problem_options,
    solution_check_prompt,
)
from diffusion_embedder.reasonaug.triplets import ConceptData, TripletConfig, ring_records

logger = logging.getLogger(__name__)


@dataclass
class StageConfig:
    workdir: Path
    model: str = "gpt-4o-mini"
    rounds: int = 8
    seed: int = 0
    max_regenerations: int = 2
    triplets: TripletConfig | None = None  # the negatives stage's ring draws (None: ``TripletConfig()``)
    allow_missing_definitions: bool = False  # else a concept without a definition stops ``load_concept_data``

    def __post_init__(self):
        self.workdir = Path(self.workdir)

    # upstream layout
    @property
    def definition_input(self) -> Path:
        return self.workdir / "gen_instance_definition" / "instance_definition_input.jsonl"

    @property
    def definition_output(self) -> Path:
        return self.workdir / "gen_instance_definition" / "instance_definition_output.jsonl"

    def problem_input(self, r: int) -> Path:
        return self.workdir / "gen_problem_solution" / "inputs" / f"problem_solution_input_{r}.jsonl"

    def problem_output(self, r: int) -> Path:
        return self.workdir / "gen_problem_solution" / "outputs" / f"problem_solution_output_{r}.jsonl"

    def check(self, name: str, kind: str) -> Path:
        return self.workdir / "gen_problem_solution" / f"{name}_check_{kind}.jsonl"

    def parsed(self, name: str) -> Path:
        return self.workdir / f"{name}.jsonl"


@dataclass
class StageReport:
    """What a stage did; ``failed`` counts requests that got no answer (the next run sends them again) and
    ``last_error`` says why the last of them got none."""

    stage: str
    requests: int = 0
    sent: int = 0
    skipped: int = 0
    failed: int = 0
    kept: int = 0
    malformed: int = 0
    dropped: int = 0
    rewritten: int = 0
    rejected: int = 0
    last_error: str | None = None

    def as_dict(self) -> dict:
        return asdict(self)


class AwaitingBatchOutputs(FileNotFoundError):
    """Batch mode: the request files are written and the answers are not there yet (a normal stop, not a fault)."""

    def __init__(self, missing: list[tuple[Path, Path]]):
        lines = "\n".join(f"  submit {i}\n  save its output as {o}" for i, o in missing)
        super().__init__(
            "no answers yet: run with an endpoint (OPENAI_BASE_URL / OPENAI_API_KEY), or use the OpenAI Batch API:\n"
            + lines
        )
        self.missing = missing


class StageOutputMissing(FileNotFoundError):
    """A stage's input is an earlier stage's parsed output that is not there: that stage has not been run."""


class Ask(NamedTuple):
    """What one item asks: the request id is derived from ``(domain, instance, round, body)``."""

    domain: str
    instance: str
    round: int
    messages: list[dict]


class Answer(NamedTuple):
    """An answer that passed the stage's check, with the request (and the batch round) that produced it."""

    request: dict
    round: int
    text: str


class BatchFiles(NamedTuple):
    """One Batch-API request file and its answers; ``round`` is 0 for a stage with a single pair of files."""

    round: int
    input: Path
    output: Path


@dataclass(frozen=True)
class Stage:
    """One LLM stage. ``to_record`` returns the parsed record, or None for an answer that rejects its item (the
    runner counts ``rejected``); it may count what else it did (``rewritten``) in the report it is given."""

    name: str  # the CLI command and the report's name
    help: str
    kind: str  # the stage part of request ids
    output: str  # the parsed JSONL, ``<workdir>/<output>.jsonl``
    items: Callable[[list[Concept], StageConfig], list]
    ask: Callable[[Any, int, StageConfig], Ask]  # (item, batch round, config)
    to_record: Callable[[Any, Answer, StageReport], dict | None]
    files: Callable[[StageConfig], list[BatchFiles]]
    is_valid: Callable[[str], bool] = lambda text: True  # the answer check: a malformed answer is counted
    regenerate: bool = True  # ... and asked again (``#retry<n>``), up to ``max_regenerations`` times
    max_tokens: int = PROBLEM_MAX_TOKENS


def build_requests(stage: Stage, items: list, round_: int, cfg: StageConfig) -> list[dict]:
    """The stage's Batch-API requests for one batch round; each ``custom_id`` comes from its request's content."""
    requests = []
    for item in items:
        ask = stage.ask(item, round_, cfg)
        request = make_request("", ask.messages, cfg.model, stage.max_tokens)
        cid = request_id(stage.kind, ask.domain, ask.instance, ask.round, request["body"])
        requests.append({**request, "custom_id": cid})
    return requests


def _execute(client: Completer | None, requests: list[dict], files: BatchFiles, is_valid: Callable[[str], bool],
             max_regenerations: int, report: StageReport) -> dict:
    write_batch_requests(files.input, requests)
    report.requests += len(requests)
    if client is not None:
        run = run_with_regeneration(client, requests, files.output, is_valid, max_regenerations)
        report.sent += run.sent
        report.skipped += run.skipped
        report.failed += len(run.failed)
        report.last_error = run.last_error or report.last_error
    outputs = read_saved_answers(files.output)  # batch mode: run_stage made sure it is there if anything is asked
    if client is None:  # a request without an answer in the downloaded file failed, as a live one would
        unanswered = [r["custom_id"] for r in requests if getattr(outputs.get(r["custom_id"]), "content", None) is None]
        if unanswered:
            report.failed += len(unanswered)
            report.last_error = f"{files.output} has no answer for {len(unanswered)} of its {len(requests)} requests"
    for r in requests:
        first = outputs.get(r["custom_id"])
        if first is not None and first.content is not None and not is_valid(first.content):
            report.malformed += 1
    return outputs


def run_stage(stage: Stage | str, concepts: list[Concept], cfg: StageConfig, client: Completer | None) -> StageReport:
    """Run one stage (a :class:`Stage` or its name) and write its parsed JSONL; returns its counts.

    Without a client (batch mode), every request file is written and :class:`AwaitingBatchOutputs` names the
    answer files still missing. Records are item-major, round-minor.
    """
    stage = STAGES[stage] if isinstance(stage, str) else stage
    report = StageReport(stage.name)
    items = stage.items(concepts, cfg)
    regenerations = cfg.max_regenerations if stage.regenerate else 0
    batches = [(files, build_requests(stage, items, files.round, cfg)) for files in stage.files(cfg)]
    missing = [(files.input, files.output) for files, requests in batches if requests and not files.output.exists()]
    if client is None and missing:  # batch mode: write every request file before asking for answers
        for files, requests in batches:
            write_batch_requests(files.input, requests)
        raise AwaitingBatchOutputs(missing)
    outputs = [_execute(client, requests, files, stage.is_valid, regenerations, report) for files, requests in batches]
    records = []
    for pos, item in enumerate(items):
        for (files, requests), answers in zip(batches, outputs, strict=True):
            request = requests[pos]
            text = select_answer(answers, request["custom_id"], stage.is_valid, regenerations)
            if text is None:
                report.dropped += 1
                continue
            record = stage.to_record(item, Answer(request, files.round, text), report)
            if record is None:
                report.rejected += 1
                continue
            records.append(record)
    report.kept = write_jsonl(cfg.parsed(stage.output), records)
    return report


def read_stage_output(cfg: StageConfig, name: str) -> list[dict]:
    """The parsed records of stage ``name``; a missing file says which stage to run first."""
    path = cfg.parsed(STAGES[name].output)
    if not path.exists():
        raise StageOutputMissing(f"{path} not found: run the '{name}' stage first")
    return [r for _, r in read_jsonl(path)]


def load_concept_data(cfg: StageConfig, concepts: list[Concept]) -> list[ConceptData]:
    """Join ``definitions.jsonl`` and ``verified_pairs.jsonl`` per concept (round order)."""
    definitions = {r["instance"]: r["definition"] for r in read_stage_output(cfg, "definitions")}
    pairs: dict[str, list[dict]] = {}
    for p in read_stage_output(cfg, "check-solutions"):
        pairs.setdefault(p["instance"], []).append(p)
    undefined = [repr(c.instance) for c in concepts if c.instance not in definitions]
    partial = len(undefined) < len(concepts)  # none at all: a failed 'definitions' stage, never allowed
    if undefined and not (partial and cfg.allow_missing_definitions):  # a partial set is the user's decision
        allow = "; or pass --allow-missing-definitions to build without them" if partial else ""
        raise StageOutputMissing(
            f"{cfg.parsed('definitions')} has no definition for {len(undefined) if partial else 'any'} of the "
            f"{len(concepts)} concepts ({', '.join(undefined[:5])}{', ...' * (len(undefined) > 5)}): rerun the "
            f"'definitions' stage until it ends without failed requests, then the stages after it{allow}")
    if undefined:
        logger.warning("No definition for %d of the %d concepts, left out (--allow-missing-definitions): %s",
                       len(undefined), len(concepts), ", ".join(undefined))
    data = []
    for c in (c for c in concepts if c.instance in definitions):
        ps = sorted(pairs.get(c.instance, []), key=lambda p: p["round"])
        data.append(ConceptData(c.instance, c.domain, c.question_type, definitions[c.instance],
                                tuple(p["problem"] for p in ps), tuple(p["solution"] for p in ps)))
    return data


# ---------------------------------------------------------------------------------------- the stages


def _chat(system: str, user: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def _check_files(name: str) -> Callable[[StageConfig], list[BatchFiles]]:
    return lambda cfg: [BatchFiles(0, cfg.check(name, "input"), cfg.check(name, "output"))]


def _definition_ask(c: Concept, round_: int, cfg: StageConfig) -> Ask:
    prompt = definition_prompt(c.domain, c.instance, c.question_type)
    return Ask(c.domain, c.instance, round_, _chat(DEFINITION_SYSTEM, prompt))


def _definition_record(c: Concept, answer: Answer, report: StageReport) -> dict:
    return {
        "custom_id": c.custom_id,
        "domain": c.domain,
        "question_type": c.question_type,
        "instance": c.instance,
        "definition_response": answer.text,
        "definition": parse_definition(answer.text, c.instance).definition,
    }


def _problem_ask(c: Concept, round_: int, cfg: StageConfig) -> Ask:
    """Options drawn from a per-(seed, round, concept) random stream: an item's prompt never depends on the others."""
    rng = random.Random(f"{cfg.seed}:problem:{round_}:{c.instance}")
    opts = sample_problem_options(c.question_type, c.domain, c.references, rng)
    prompt = problem_prompt(c.question_type, c.domain, c.instance, opts)
    return Ask(c.domain, c.instance, round_, _chat(PROBLEM_SYSTEM, prompt))


def _problem_record(c: Concept, answer: Answer, report: StageReport) -> dict:
    problem, solution = parse_problem_solution(answer.text)
    return {
        "pair_id": answer.request["custom_id"],
        "custom_id": c.custom_id,
        "round": answer.round,
        "domain": c.domain,
        "question_type": c.question_type,
        "instance": c.instance,
        "problem": problem,
        "solution": solution,
        "messages": answer.request["body"]["messages"] + [{"role": "assistant", "content": answer.text}],
    }


def _valid_problem_check(text: str) -> bool:
    confirmed, replacement = parse_problem_check(text)
    return confirmed or replacement is not None


def _problem_check_ask(p: dict, round_: int, cfg: StageConfig) -> Ask:
    """Asked in the generating conversation."""
    question = {"role": "user", "content": problem_check_prompt(p["domain"], p["instance"])}
    return Ask(p["domain"], p["instance"], p["round"], p["messages"] + [question])


def _problem_check_record(p: dict, answer: Answer, report: StageReport) -> dict:
    confirmed, replacement = parse_problem_check(answer.text)
    out = {k: v for k, v in p.items() if k != "messages"}
    if not confirmed:
        out["problem"], out["solution"] = replacement
        report.rewritten += 1
    out["problem_check"] = "confirmed" if confirmed else "rewritten"
    return out


def _solution_check_ask(p: dict, round_: int, cfg: StageConfig) -> Ask:
    prompt = solution_check_prompt(p["question_type"], p["domain"], p["instance"], p["problem"], p["solution"])
    return Ask(p["domain"], p["instance"], p["round"], _chat(SOLUTION_CHECK_SYSTEM, prompt))


def _solution_check_record(p: dict, answer: Answer, report: StageReport) -> dict | None:
    if p["question_type"] == "coding":
        code = parse_code_verdict(answer.text)
        return None if code is None else {**p, "solution": code}
    return p if is_yes(answer.text) else None


def _ring(concepts: list[Concept], cfg: StageConfig) -> list[tuple[int, dict]]:
    """The ring records, each with its place in its own concept's ring (independent of the other concepts)."""
    ring = ring_records(load_concept_data(cfg, concepts), cfg.triplets)
    seen: Counter = Counter()
    items = []
    for r in ring:
        items.append((seen[r["instance"]], r))
        seen[r["instance"]] += 1
    return items


def _negative_files(cfg: StageConfig) -> list[BatchFiles]:
    return [
        BatchFiles(0, cfg.workdir / "gen_hard_negative_input.jsonl", cfg.workdir / "gen_hard_negative_output.jsonl")
    ]


def _negative_ask(item: tuple[int, dict], round_: int, cfg: StageConfig) -> Ask:
    q, r = item
    prompt = negative_prompt(r["task"], r["domain"], r["instance"], r["user_query"], r["positive_document"])
    return Ask(r["domain"], r["instance"], q, _chat(NEGATIVE_SYSTEM, prompt))


STAGES: dict[str, Stage] = {
    s.name: s
    for s in (
        Stage(
            "definitions",
            "1. a 'Concept / Definition' answer per concept -> definitions.jsonl",
            kind="definition",
            output="definitions",
            items=lambda concepts, cfg: concepts,
            ask=_definition_ask,
            to_record=_definition_record,
            files=lambda cfg: [BatchFiles(0, cfg.definition_input, cfg.definition_output)],
            is_valid=lambda text: parse_definition(text, "") is not None,
            max_tokens=DEFINITION_MAX_TOKENS,
        ),
        Stage(
            "problems",
            "2. --rounds problem/solution pairs per concept (seeded prompts) -> pairs.jsonl",
            kind="problem",
            output="pairs",
            items=lambda concepts, cfg: concepts,
            ask=_problem_ask,
            to_record=_problem_record,
            files=lambda cfg: [
                BatchFiles(r, cfg.problem_input(r), cfg.problem_output(r)) for r in range(1, cfg.rounds + 1)
            ],
            is_valid=lambda text: parse_problem_solution(text) is not None,
        ),
        Stage(
            "check-problems",
            "3. does the problem need the concept? keep, take the rewrite, or drop -> checked_pairs.jsonl",
            kind="problem-check",
            output="checked_pairs",
            items=lambda concepts, cfg: read_stage_output(cfg, "problems"),
            ask=_problem_check_ask,
            to_record=_problem_check_record,
            files=_check_files("problem"),
            is_valid=_valid_problem_check,
        ),
        Stage(
            "check-solutions",
            "4. verify each solution (coding: verified code replaces it) -> verified_pairs.jsonl",
            kind="solution-check",
            output="verified_pairs",
            items=lambda concepts, cfg: read_stage_output(cfg, "check-problems"),
            ask=_solution_check_ask,
            to_record=_solution_check_record,
            files=_check_files("solution"),
            regenerate=False,  # a verdict is never re-asked; a "no" rejects the pair
        ),
        Stage(
            "negatives",
            "optional: LLM-written hard negatives for a ring of same-concept pairs -> generated_negatives.jsonl",
            kind="negative",
            output="generated_negatives",
            items=_ring,
            ask=_negative_ask,
            to_record=lambda item, answer, report: {**item[1], "hard_negative_document": answer.text.strip()},
            files=_negative_files,
            is_valid=lambda text: bool(text.strip()),
        ),
    )
}
