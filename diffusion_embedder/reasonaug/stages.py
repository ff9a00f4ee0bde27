"""The ReasonAug generation stages; each one is resumable and keeps upstream's Batch-API file layout.

Every stage (1) writes its Batch-API request file (deterministic: prompts are seeded per item),
(2) sends the requests not yet answered in the stage's output file, appending answers one by one (or,
without a client, expects the file downloaded from the OpenAI Batch API at the same path), and
(3) parses the answers into a JSONL consumed by the next stage. Malformed answers are counted and
regenerated (``<custom_id>#retry<n>``) up to ``max_regenerations`` times, then dropped. Request ids come
from the request's content (``concepts.request_id``), so answers stay with their concepts whatever the
concepts file's order.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from diffusion_embedder.reasonaug.concepts import Concept, request_id
from diffusion_embedder.reasonaug.llm import (
    Completer,
    make_request,
    read_batch_outputs,
    read_jsonl,
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


def _request(
    stage: str, domain: str, instance: str, round_: int, messages: list[dict], cfg: StageConfig, max_tokens: int
) -> dict:
    """A Batch-API request whose ``custom_id`` is derived from its content (``concepts.request_id``)."""
    request = make_request("", messages, cfg.model, max_tokens)
    return {**request, "custom_id": request_id(stage, domain, instance, round_, request["body"])}


def _execute(
    client: Completer | None,
    requests: list[dict],
    input_path: Path,
    output_path: Path,
    is_valid: Callable[[str], bool],
    max_regenerations: int,
    report: StageReport,
) -> dict:
    write_batch_requests(input_path, requests)
    report.requests += len(requests)
    if client is not None:
        run = run_with_regeneration(client, requests, output_path, is_valid, max_regenerations)
        report.sent += run.sent
        report.skipped += run.skipped
        report.failed += len(run.failed)
    elif not output_path.exists():
        raise AwaitingBatchOutputs([(input_path, output_path)])
    outputs = read_batch_outputs(output_path)
    for r in requests:
        first = outputs.get(r["custom_id"])
        if first is not None and first.content is not None and not is_valid(first.content):
            report.malformed += 1
    return outputs


def _message(role: str, content: str) -> dict:
    return {"role": role, "content": content}


def run_definitions(concepts: list[Concept], cfg: StageConfig, client: Completer | None) -> StageReport:
    """One "Concept / Definition" request per concept -> ``definitions.jsonl``."""
    report = StageReport("definitions")
    requests = [
        _request(
            "definition",
            c.domain,
            c.instance,
            0,
            [
                _message("system", DEFINITION_SYSTEM),
                _message("user", definition_prompt(c.domain, c.instance, c.question_type)),
            ],
            cfg,
            DEFINITION_MAX_TOKENS,
        )
        for c in concepts
    ]

    def valid(text: str) -> bool:
        return parse_definition(text, "") is not None

    outputs = _execute(
        client, requests, cfg.definition_input, cfg.definition_output, valid, cfg.max_regenerations, report
    )
    records = []
    for c, req in zip(concepts, requests, strict=True):
        text = select_answer(outputs, req["custom_id"], valid, cfg.max_regenerations)
        if text is None:
            report.dropped += 1
            continue
        parsed = parse_definition(text, c.instance)
        records.append(
            {
                "custom_id": c.custom_id,
                "domain": c.domain,
                "question_type": c.question_type,
                "instance": c.instance,
                "definition_response": text,
                "definition": parsed.definition,
            }
        )
    report.kept = write_jsonl(cfg.parsed("definitions"), records)
    return report


def problem_requests(concepts: list[Concept], round_: int, cfg: StageConfig) -> list[dict]:
    """Round ``round_`` of problem prompts; options drawn from a per-(seed, round, concept) random stream."""
    requests = []
    for c in concepts:
        rng = random.Random(f"{cfg.seed}:problem:{round_}:{c.instance}")
        opts = sample_problem_options(c.question_type, c.domain, c.references, rng)
        messages = [
            _message("system", PROBLEM_SYSTEM),
            _message("user", problem_prompt(c.question_type, c.domain, c.instance, opts)),
        ]
        requests.append(_request("problem", c.domain, c.instance, round_, messages, cfg, PROBLEM_MAX_TOKENS))
    return requests


def _valid_pair(text: str) -> bool:
    return parse_problem_solution(text) is not None


def run_problems(concepts: list[Concept], cfg: StageConfig, client: Completer | None) -> StageReport:
    """``rounds`` independent problem/solution requests per concept -> ``pairs.jsonl``."""
    report = StageReport("problems")
    rounds = range(1, cfg.rounds + 1)
    missing = [(cfg.problem_input(r), cfg.problem_output(r)) for r in rounds if not cfg.problem_output(r).exists()]
    if client is None and missing:  # batch mode: write every round's request file before asking for answers
        for r in rounds:
            write_batch_requests(cfg.problem_input(r), problem_requests(concepts, r, cfg))
        raise AwaitingBatchOutputs(missing)
    per_round = []
    for r in rounds:
        requests = problem_requests(concepts, r, cfg)
        outputs = _execute(
            client, requests, cfg.problem_input(r), cfg.problem_output(r), _valid_pair, cfg.max_regenerations, report
        )
        per_round.append((requests, outputs))
    records = []
    for pos, c in enumerate(concepts):
        for r, (requests, outputs) in enumerate(per_round, 1):
            request = requests[pos]
            text = select_answer(outputs, request["custom_id"], _valid_pair, cfg.max_regenerations)
            if text is None:
                report.dropped += 1
                continue
            problem, solution = parse_problem_solution(text)
            messages = request["body"]["messages"] + [_message("assistant", text)]
            records.append(
                {
                    "pair_id": request["custom_id"],
                    "custom_id": c.custom_id,
                    "round": r,
                    "domain": c.domain,
                    "question_type": c.question_type,
                    "instance": c.instance,
                    "problem": problem,
                    "solution": solution,
                    "messages": messages,
                }
            )
    report.kept = write_jsonl(cfg.parsed("pairs"), records)
    return report


def _read_parsed(path: Path, stage: str) -> list[dict]:
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: run the '{stage}' stage first")
    return [r for _, r in read_jsonl(path)]


def _valid_problem_check(text: str) -> bool:
    confirmed, replacement = parse_problem_check(text)
    return confirmed or replacement is not None


def run_check_problems(cfg: StageConfig, client: Completer | None) -> StageReport:
    """Ask, in the generating conversation, whether the problem needs the concept; take a rewrite if not."""
    report = StageReport("check-problems")
    pairs = _read_parsed(cfg.parsed("pairs"), "problems")
    requests = [
        _request(
            "problem-check",
            p["domain"],
            p["instance"],
            p["round"],
            p["messages"] + [_message("user", problem_check_prompt(p["domain"], p["instance"]))],
            cfg,
            PROBLEM_MAX_TOKENS,
        )
        for p in pairs
    ]
    outputs = _execute(
        client,
        requests,
        cfg.check("problem", "input"),
        cfg.check("problem", "output"),
        _valid_problem_check,
        cfg.max_regenerations,
        report,
    )
    records = []
    for p, request in zip(pairs, requests, strict=True):
        text = select_answer(outputs, request["custom_id"], _valid_problem_check, cfg.max_regenerations)
        if text is None:
            report.dropped += 1
            continue
        confirmed, replacement = parse_problem_check(text)
        out = {k: v for k, v in p.items() if k != "messages"}
        if not confirmed:
            out["problem"], out["solution"] = replacement
            report.rewritten += 1
        out["problem_check"] = "confirmed" if confirmed else "rewritten"
        records.append(out)
    report.kept = write_jsonl(cfg.parsed("checked_pairs"), records)
    return report


def run_check_solutions(cfg: StageConfig, client: Completer | None) -> StageReport:
    """Verify each pair; coding answers carry the rewritten solution. Rejected pairs are dropped."""
    report = StageReport("check-solutions")
    pairs = _read_parsed(cfg.parsed("checked_pairs"), "check-problems")
    requests = [
        _request(
            "solution-check",
            p["domain"],
            p["instance"],
            p["round"],
            [
                _message("system", SOLUTION_CHECK_SYSTEM),
                _message(
                    "user",
                    solution_check_prompt(p["question_type"], p["domain"], p["instance"], p["problem"], p["solution"]),
                ),
            ],
            cfg,
            PROBLEM_MAX_TOKENS,
        )
        for p in pairs
    ]
    outputs = _execute(
        client,
        requests,
        cfg.check("solution", "input"),
        cfg.check("solution", "output"),
        lambda text: True,
        0,
        report,
    )
    records = []
    for p, request in zip(pairs, requests, strict=True):
        result = outputs.get(request["custom_id"])
        if result is None or result.content is None:
            report.dropped += 1
            continue
        if p["question_type"] == "coding":
            code = parse_code_verdict(result.content)
            if code is None:
                report.rejected += 1
                continue
            p = {**p, "solution": code}
        elif not is_yes(result.content):
            report.rejected += 1
            continue
        records.append(p)
    report.kept = write_jsonl(cfg.parsed("verified_pairs"), records)
    return report


def load_concept_data(cfg: StageConfig, concepts: list[Concept]) -> list[ConceptData]:
    """Join ``definitions.jsonl`` and ``verified_pairs.jsonl`` per concept (round order)."""
    definitions = {r["instance"]: r["definition"] for r in _read_parsed(cfg.parsed("definitions"), "definitions")}
    pairs: dict[str, list[dict]] = {}
    for p in _read_parsed(cfg.parsed("verified_pairs"), "check-solutions"):
        pairs.setdefault(p["instance"], []).append(p)
    data = []
    for c in concepts:
        if c.instance not in definitions:
            logger.warning("%s: no definition; concept skipped", c.instance)
            continue
        ps = sorted(pairs.get(c.instance, []), key=lambda p: p["round"])
        data.append(
            ConceptData(
                c.instance,
                c.domain,
                c.question_type,
                definitions[c.instance],
                tuple(p["problem"] for p in ps),
                tuple(p["solution"] for p in ps),
            )
        )
    return data


def run_generated_negatives(
    data: list[ConceptData], cfg: StageConfig, client: Completer | None, triplet_config: TripletConfig | None = None
) -> StageReport:
    """Optional: upstream's ring of consecutive same-concept pairs whose hard negative an LLM writes."""
    report = StageReport("negatives")
    ring = ring_records(data, triplet_config)
    seen: Counter = Counter()
    within = []  # each record's place in its own concept's ring, independent of the other concepts
    for r in ring:
        within.append(seen[r["instance"]])
        seen[r["instance"]] += 1
    requests = [
        _request(
            "negative",
            r["domain"],
            r["instance"],
            q,
            [
                _message("system", NEGATIVE_SYSTEM),
                _message(
                    "user",
                    negative_prompt(r["task"], r["domain"], r["instance"], r["user_query"], r["positive_document"]),
                ),
            ],
            cfg,
            PROBLEM_MAX_TOKENS,
        )
        for q, r in zip(within, ring, strict=True)
    ]

    def valid(text: str) -> bool:
        return bool(text.strip())

    outputs = _execute(
        client,
        requests,
        cfg.workdir / "gen_hard_negative_input.jsonl",
        cfg.workdir / "gen_hard_negative_output.jsonl",
        valid,
        cfg.max_regenerations,
        report,
    )
    records = []
    for r, request in zip(ring, requests, strict=True):
        text = select_answer(outputs, request["custom_id"], valid, cfg.max_regenerations)
        if text is None:
            report.dropped += 1
            continue
        records.append({**r, "hard_negative_document": text.strip()})
    report.kept = write_jsonl(cfg.parsed("generated_negatives"), records)
    return report
