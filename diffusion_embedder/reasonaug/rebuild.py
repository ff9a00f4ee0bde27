"""Offline rebuild of ReasonAug from the real upstream generation files (no network, no LLM).

Upstream's problem-check outputs are missing, so the rebuild uses the generated pairs as they are and
the real solution-check verdicts (``solution_check_output.jsonl``, ``custom_id`` = running pair id,
concept-major, round-minor). The released files keep upstream's ids; each concept's ``custom_id``
(``request-<k>`` in ``ReasonAug/concepts.jsonl``) maps it onto them, whatever its line in the concepts file.
For coding pairs the verifier's rewritten Python code replaces the solution,
as upstream did; because the missing problem check replaced some pairs before verification, a coding
verdict is only used when its code matches *this* pair better than any other round of the same concept
(token overlap >= ``min_overlap``). Other coding pairs are dropped.
"""

from __future__ import annotations

import logging
import re
import statistics
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from diffusion_embedder.reasonaug.concepts import Concept
from diffusion_embedder.reasonaug.llm import BatchResult, read_batch_outputs
from diffusion_embedder.reasonaug.parse import is_yes, parse_code_verdict, parse_definition, parse_problem_solution
from diffusion_embedder.reasonaug.pipeline import StageConfig
from diffusion_embedder.reasonaug.triplets import ConceptData

logger = logging.getLogger(__name__)

_WORD = re.compile(r"[a-z_]{4,}")


def _plain_or_gzipped(path: Path) -> Path:
    """``path``, or its gzipped copy (``.gz``) as shipped in ``ReasonAug/generation``."""
    for candidate in (path, path.with_name(path.name + ".gz")):
        if candidate.exists():
            return candidate
    raise FileNotFoundError(f"{path} (or .gz) not found")


_UPSTREAM_ID = re.compile(r"request-([1-9][0-9]*)")


def upstream_index(concept: Concept) -> int:
    """``k`` of the concept's upstream id ``request-<k>``: its place in upstream's generation order."""
    m = _UPSTREAM_ID.fullmatch(concept.custom_id)
    if m is None:
        raise ValueError(
            f"concept {concept.instance!r} has custom_id {concept.custom_id!r}: the released generation files are "
            "keyed by upstream ids request-<k>, so every concept of a rebuild needs one"
        )
    return int(m.group(1))


def pair_id(concept_index: int, round_: int, rounds: int) -> str:
    """Running pair id used by upstream's solution check: concept-major, round-minor, 1-based."""
    return str((concept_index - 1) * rounds + round_)


def overlap(a: str, b: str) -> float:
    """Share of the smaller word set found in the other (words of 4+ letters, lower-cased)."""
    wa, wb = set(_WORD.findall(a.lower())), set(_WORD.findall(b.lower()))
    return len(wa & wb) / max(1, min(len(wa), len(wb)))


@dataclass
class RebuildReport:
    concepts: int = 0
    definitions: int = 0
    generated_pairs: int = 0
    malformed_pairs: int = 0
    missing_verdicts: int = 0
    rejected: Counter = field(default_factory=Counter)  # verdict "No"/"NO" per question type
    misaligned_code: int = 0
    verified_pairs: int = 0


def load_generation(
    root: str | Path, concepts: list[Concept], rounds: int = 8, min_overlap: float = 0.5
) -> tuple[list[ConceptData], RebuildReport]:
    """Parse definitions, pairs and solution-check verdicts from an upstream-layout folder."""
    report = RebuildReport(concepts=len(concepts))
    layout = StageConfig(root)  # the pipeline's file layout is upstream's
    definitions = read_batch_outputs(_plain_or_gzipped(layout.definition_output))
    outputs = [read_batch_outputs(_plain_or_gzipped(layout.problem_output(r))) for r in range(1, rounds + 1)]
    verdicts = read_batch_outputs(_plain_or_gzipped(layout.check("solution", "output")))

    data = []
    for concept in concepts:
        index = upstream_index(concept)
        d = definitions.get(concept.custom_id)
        parsed_def = parse_definition(d.content, concept.instance) if d and d.content else None
        if parsed_def is None:
            logger.warning("%s: no usable definition; concept skipped", concept.instance)
            continue
        report.definitions += 1
        raw: list[str | None] = []
        pairs: dict[int, tuple[str, str]] = {}
        for r in range(1, rounds + 1):
            res: BatchResult | None = outputs[r - 1].get(concept.custom_id)
            raw.append(res.content if res else None)
            parsed = parse_problem_solution(res.content) if res and res.content else None
            if parsed is None:
                report.malformed_pairs += 1
                continue
            report.generated_pairs += 1
            pairs[r] = parsed
        problems, solutions = [], []
        for r, (problem, solution) in pairs.items():
            verdict = verdicts.get(pair_id(index, r, rounds))
            if verdict is None or verdict.content is None:
                report.missing_verdicts += 1
                continue
            if concept.question_type == "coding":
                code = parse_code_verdict(verdict.content)
                if code is None:
                    report.rejected[concept.question_type] += 1
                    continue
                own = overlap(code, raw[r - 1] or "")
                others = [overlap(code, t) for k, t in enumerate(raw, 1) if k != r and t]
                if own < min_overlap or (others and own <= max(others)):
                    report.misaligned_code += 1
                    continue
                solution = code
            elif not is_yes(verdict.content):
                report.rejected[concept.question_type] += 1
                continue
            problems.append(problem)
            solutions.append(solution)
        report.verified_pairs += len(problems)
        data.append(
            ConceptData(
                concept.instance,
                concept.domain,
                concept.question_type,
                parsed_def.definition,
                tuple(problems),
                tuple(solutions),
            )
        )
    return data, report


def _length_stats(values: list[int]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "std": 0.0, "min": 0, "max": 0}
    return {
        "mean": round(statistics.fmean(values), 1),
        "std": round(statistics.pstdev(values), 1),
        "min": min(values),
        "max": max(values),
    }


def dataset_stats(records: list[dict]) -> dict:
    """Counts per domain / task type and whitespace-word length statistics of queries and documents."""
    return {
        "records": len(records),
        "concepts": len({r["instance"] for r in records}),
        "by_domain": dict(sorted(Counter(r["domain"] for r in records).items())),
        "by_task_type": dict(sorted(Counter(r["task_type"] for r in records).items())),
        "by_domain_task": {
            f"{d}/{t}": n for (d, t), n in sorted(Counter((r["domain"], r["task_type"]) for r in records).items())
        },
        "query_words": _length_stats([len(r["user_query"].split()) for r in records]),
        "positive_words": _length_stats([len(r["positive_document"].split()) for r in records]),
        "negative_words": _length_stats(
            [len(r["hard_negative_document"].split()) for r in records if r["hard_negative_document"]]
        ),
    }


def stats_markdown(name: str, stats: dict) -> str:
    """A markdown block for the data card (kept in sync by ``rebuild``)."""
    tasks = list(stats["by_task_type"])
    lines = [
        f"**{name}**: {stats['records']} records, {stats['concepts']} concepts.",
        "",
        "| domain | " + " | ".join(tasks) + " | total |",
        "|---|" + "---:|" * (len(tasks) + 1),
    ]
    for domain, total in stats["by_domain"].items():
        cells = [str(stats["by_domain_task"].get(f"{domain}/{t}", 0)) for t in tasks]
        lines.append(f"| {domain} | " + " | ".join(cells) + f" | {total} |")
    lines.append("| **all** | " + " | ".join(str(stats["by_task_type"][t]) for t in tasks) + f" | {stats['records']} |")
    lines += ["", "| length (whitespace words) | mean | std | min | max |", "|---|---:|---:|---:|---:|"]
    for key in ("query_words", "positive_words", "negative_words"):
        s = stats[key]
        lines.append(f"| {key.replace('_words', '')} | {s['mean']} | {s['std']} | {s['min']} | {s['max']} |")
    return "\n".join(lines)


STATS_BEGIN = "<!-- stats:begin (written by `python -m diffusion_embedder.reasonaug rebuild`) -->"
STATS_END = "<!-- stats:end -->"


def update_card(card: str | Path, markdown: str) -> None:
    """Replace the statistics block of the data card between the stats markers."""
    card = Path(card)
    text = card.read_text(encoding="utf-8")
    if STATS_BEGIN not in text or STATS_END not in text:
        raise ValueError(f"{card}: stats markers {STATS_BEGIN!r} ... {STATS_END!r} not found")
    head, rest = text.split(STATS_BEGIN, 1)
    _, tail = rest.split(STATS_END, 1)
    card.write_text(f"{head}{STATS_BEGIN}\n{markdown}\n{STATS_END}{tail}", encoding="utf-8")
