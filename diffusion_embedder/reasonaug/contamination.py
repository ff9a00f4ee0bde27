"""Contamination check: drop generated queries that nearly duplicate benchmark queries.

Same decision as upstream ``bright_verify.py``: a query is contaminated when
``difflib.SequenceMatcher(None, query.lower(), benchmark.lower()).ratio() >= threshold`` (0.7) for any
benchmark query. ``real_quick_ratio`` and ``quick_ratio`` are upper bounds of ``ratio``, so using them as
filters first changes no decision, only the run time.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from difflib import SequenceMatcher
from pathlib import Path

from tqdm import tqdm

from diffusion_embedder.data.jsonl import Field
from diffusion_embedder.files import open_text
from diffusion_embedder.reasonaug.llm import read_jsonl

logger = logging.getLogger(__name__)

BRIGHT_REASONING_SUBSETS = ("leetcode", "aops", "theoremqa_theorems", "theoremqa_questions")


@dataclass
class Match:
    query: str
    benchmark_query: str
    similarity: float


@dataclass
class ContaminationReport:
    threshold: float
    checked: int = 0
    matches: list[Match] = field(default_factory=list)
    max_similarity: float = 0.0  # over flagged queries only (ratios below the threshold are never computed)

    def as_dict(self) -> dict:
        return {
            "threshold": self.threshold,
            "checked_queries": self.checked,
            "contaminated_queries": len(self.matches),
            "max_similarity": round(self.max_similarity, 4),
            "matches": [m.__dict__ for m in self.matches],
        }


def check_threshold(threshold: float) -> float:
    """A similarity threshold must be in (0, 1]: 0 or less flags everything, above 1 flags nothing."""
    if not 0 < threshold <= 1:  # also refuses NaN
        raise ValueError(f"contamination threshold must be in (0, 1], got {threshold}")
    return threshold


def find_contaminated(
    queries: list[str], benchmark: list[str], threshold: float = 0.7
) -> tuple[set[str], ContaminationReport]:
    """Return the distinct queries whose best ratio against ``benchmark`` reaches ``threshold``."""
    check_threshold(threshold)
    if not benchmark:
        raise ValueError("no benchmark queries: an empty benchmark would pass every query as clean")
    report = ContaminationReport(threshold)
    distinct = sorted(set(queries))
    lowered = [q.lower() for q in distinct]
    best = [0.0] * len(distinct)
    best_ref = [""] * len(distinct)
    matcher = SequenceMatcher(None)
    for ref in tqdm(sorted(set(benchmark)), desc="contamination", disable=len(benchmark) < 50):
        matcher.set_seq2(ref.lower())  # caches the benchmark side; seq1 varies
        for i, q in enumerate(lowered):
            matcher.set_seq1(q)
            floor = max(threshold, best[i])
            if matcher.real_quick_ratio() < floor or matcher.quick_ratio() < floor:
                continue
            ratio = matcher.ratio()
            if ratio >= floor and ratio > best[i]:
                best[i], best_ref[i] = ratio, ref
    report.checked = len(distinct)
    flagged = set()
    for q, score, ref in zip(distinct, best, best_ref, strict=True):
        if score >= threshold:
            flagged.add(q)
            report.matches.append(Match(q, ref, score))
    report.max_similarity = max(best, default=0.0)
    return flagged, report


def remove_contaminated(
    records: list[dict], benchmark: list[str], threshold: float = 0.7
) -> tuple[list[dict], ContaminationReport]:
    """Drop every record whose ``user_query`` is contaminated."""
    for i, r in enumerate(records):
        if not isinstance(r.get("user_query"), str):
            raise ValueError(f"record {i}: missing string field 'user_query'")
    flagged, report = find_contaminated([r["user_query"] for r in records], benchmark, threshold)
    kept = [r for r in records if r["user_query"] not in flagged]
    logger.info("contamination: %d of %d records removed", len(records) - len(kept), len(records))
    return kept, report


def load_benchmark_queries(source: str | Path, field_name: str = "query") -> list[str]:
    """Benchmark queries from a ``.jsonl`` (``field_name``), ``.json`` list, or ``.txt`` (one per line) file.

    A file with no query is an error: checking against nothing would call every query clean.
    """
    path = Path(source)
    if path.suffix in (".jsonl", ".gz"):
        out = [r[field_name] for _, r in read_jsonl(path, [Field(field_name)])]
    elif path.suffix == ".json":
        out = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(out, list) or not all(isinstance(x, str) for x in out):
            raise ValueError(f"{path}: expected a JSON list of strings")
    else:
        with open_text(path) as f:
            out = [line for line in f if line.strip()]
    if not any(q.strip() for q in out):
        raise ValueError(f"{path}: no benchmark queries; an empty benchmark would pass every query as clean")
    return out


def load_bright_queries(path: str = "xlangai/BRIGHT", subsets: tuple[str, ...] = BRIGHT_REASONING_SUBSETS) -> list[str]:
    """Queries of the BRIGHT ``examples`` config (the upstream check); ``path`` may be a local copy."""
    from datasets import load_dataset

    out: list[str] = []
    for subset in subsets:
        out.extend(load_dataset(path, "examples", split=subset)["query"])
    return out
