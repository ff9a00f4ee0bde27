"""Parsers for the LLM answers. A malformed answer yields None (the caller counts, regenerates or drops it)."""

from __future__ import annotations

import re
from dataclasses import dataclass

_SOLUTION_TAG = re.compile(r"\*\*\s*solution\s*:?\s*\*\*", re.IGNORECASE)
_PROBLEM_TAG = re.compile(r"\*\*\s*problem\s*:?\s*\*\*", re.IGNORECASE)
_DEFINITION_TAG = "**Definition**"
_CONCEPT_TAG = "**Concept**"
_CODE_BLOCK = re.compile(r"```(python|java|cpp)?\n(.*?)```", re.DOTALL)
_LEADING_NO = re.compile(r"^\s*no\b[.:!,]?\s*", re.IGNORECASE)


def parse_problem_solution(text: str) -> tuple[str, str] | None:
    """Split a "**Problem** ... **Solution** ..." answer.

    Exactly one Solution tag is required (upstream's ``str.split`` unpacking failed otherwise); the text
    after a Problem tag (if any) is the problem. A stray leading "." is stripped as upstream did.
    """
    parts = _SOLUTION_TAG.split(text)
    if len(parts) != 2:
        return None
    head, solution = parts
    problem_parts = _PROBLEM_TAG.split(head, maxsplit=1)
    problem = problem_parts[-1].strip()
    if problem.startswith("."):
        problem = problem[1:].strip()
    solution = solution.strip()
    if not problem or not solution:
        return None
    return problem, solution


@dataclass(frozen=True)
class Definition:
    concept: str  # the name the model wrote, or the requested name when it skipped the Concept tag
    definition: str  # everything after the Definition tag (may include "**Implementation Code**")


def parse_definition(text: str, instance: str) -> Definition | None:
    """Split a "**Concept** ... **Definition** ..." answer.

    Some answers start directly with the Definition tag (the prompt ended with "**Concept**\\nX"); the
    requested ``instance`` is then the concept name, instead of upstream's empty string.
    """
    if _DEFINITION_TAG not in text:
        return None
    head, definition = text.split(_DEFINITION_TAG, 1)
    concept = head.replace(_CONCEPT_TAG, "").strip() or instance
    definition = definition.strip()
    if not definition:
        return None
    return Definition(concept, definition)


def is_yes(text: str) -> bool:
    """Upstream's verdict rule for math/physics/finance checks: starts with "yes", or contains "**yes**"."""
    t = text.strip().lower()
    return t.startswith("yes") or "**yes**" in t


def parse_problem_check(text: str) -> tuple[bool, tuple[str, str] | None]:
    """Return ``(confirmed, replacement)``: YES keeps the pair, otherwise a new pair may be proposed."""
    if text.strip().lower().startswith("yes"):
        return True, None
    return False, parse_problem_solution(_LEADING_NO.sub("", text, count=1))


def parse_code_verdict(text: str) -> str | None:
    """Coding solution check: the first fenced block, if it is Python, is the verified solution."""
    match = _CODE_BLOCK.search(text)
    if match is None or match.group(1) != "python":
        return None
    return match.group(2)
