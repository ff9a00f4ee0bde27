"""Seed concepts (theorems, algorithms, formulas) that ReasonAug generates problems for."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from diffusion_embedder.reasonaug.llm import read_jsonl
from diffusion_embedder.reasonaug.prompts import DIFFICULTY_REFERENCES, QUESTION_TYPES


@dataclass(frozen=True)
class Concept:
    """One seed concept. ``custom_id`` (``request-<k>``) keys its requests in every batch file."""

    custom_id: str
    domain: str
    instance: str
    question_type: str
    references: list[str] = field(default_factory=list, hash=False, compare=False)

    @property
    def index(self) -> int:
        return int(self.custom_id.rsplit("-", 1)[-1])


def load_concepts(path: str | Path) -> list[Concept]:
    """Read a concepts JSONL (``domain``, ``instance``; optional ``question_type``, ``references``).

    ``question_type`` and the difficulty ``references`` default to the upstream tables for the five
    ReasonAug domains; a new domain must give its ``question_type`` (coding, math, physics, finance, ...).
    """
    concepts: list[Concept] = []
    seen: set[str] = set()
    for lineno, r in read_jsonl(path):
        where = f"{path}:{lineno}"
        domain, instance = r.get("domain"), r.get("instance")
        if not isinstance(domain, str) or not domain.strip():
            raise ValueError(f"{where}: 'domain' must be a non-empty string, got {domain!r}")
        if not isinstance(instance, str) or not instance.strip():
            raise ValueError(f"{where}: 'instance' must be a non-empty string, got {instance!r}")
        if instance in seen:
            raise ValueError(f"{where}: duplicate instance {instance!r}")
        question_type = r.get("question_type") or QUESTION_TYPES.get(domain)
        if question_type is None:
            raise ValueError(
                f"{where}: domain {domain!r} is not one of {sorted(QUESTION_TYPES)}; give a 'question_type'"
            )
        references = r.get("references", DIFFICULTY_REFERENCES.get(domain, []))
        if not isinstance(references, list) or not all(isinstance(x, str) for x in references):
            raise ValueError(f"{where}: 'references' must be a list of strings, got {references!r}")
        custom_id = r.get("custom_id") or f"request-{len(concepts) + 1}"
        seen.add(instance)
        concepts.append(Concept(custom_id, domain, instance, question_type, references))
    if not concepts:
        raise ValueError(f"{path}: no concepts")
    return concepts
