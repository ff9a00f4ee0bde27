"""Seed concepts (theorems, algorithms, formulas) that ReasonAug generates problems for, and request ids.

A request's ``custom_id`` is derived from what it asks (stage, domain, concept, round and the request body),
never from a line position: inserting, removing or reordering concepts and rerunning in the same workdir
keeps every saved answer attached to its concept and sends only the requests that are new.
"""

from __future__ import annotations

import hashlib
import json
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path

from diffusion_embedder.data.jsonl import DataFormatError
from diffusion_embedder.reasonaug.llm import read_jsonl
from diffusion_embedder.reasonaug.prompts import DIFFICULTY_REFERENCES, QUESTION_TYPES


def _digest(value: object) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()[:16]


def concept_name(instance: str) -> str:
    """The form in which two concept names are compared: NFKC (a no-break or ideographic space, full-width
    letters or a ligature pasted from a PDF or web page read as the plain character), case-folded, every run of
    whitespace (Unicode's too) one space, none at the ends. Ids keep the name as written (see ``request_id``)."""
    folded = unicodedata.normalize("NFKC", unicodedata.normalize("NFKC", instance).casefold())
    return " ".join(folded.split())


def concept_key(domain: str, instance: str) -> str:
    """The content id of a concept without an explicit ``custom_id`` (of its name as written, as ``request_id``)."""
    return f"concept-{_digest([domain, instance])}"


def request_id(stage: str, domain: str, instance: str, round_: int, body: dict) -> str:
    """``<stage>-r<round>-<digest>``: the digest covers domain, concept, stage, round and the request body, so an
    answer on disk is only reused for exactly the request that produced it (same prompt, seed draw and model).
    The concept enters as written, not as ``concept_name``: the prompt holds it as written anyway, and folding
    it would change the id, and orphan the saved answers, of every concept not already lower-case."""
    return f"{stage}-r{round_}-{_digest([stage, domain, instance, round_, body])}"


@dataclass(frozen=True)
class Concept:
    """One seed concept. ``custom_id`` is the id given in the concepts file (the released file keeps upstream's
    ``request-<k>``, which maps each concept onto the released generation files), else ``concept_key``."""

    custom_id: str
    domain: str
    instance: str
    question_type: str
    references: list[str] = field(default_factory=list, hash=False, compare=False)


def load_concepts(path: str | Path) -> list[Concept]:
    """Read a concepts JSONL (``domain``, ``instance``; optional ``question_type``, ``references``, ``custom_id``).

    ``question_type`` and the difficulty ``references`` default to the upstream tables for the five
    ReasonAug domains; a new domain must give its ``question_type`` (coding, math, physics, finance, ...).
    A concept listed twice (the same ``concept_name``: up to case, Unicode compatibility forms and whitespace) or
    a ``custom_id`` used twice is an error naming both lines; every error is a ``DataFormatError`` naming file and line.
    """
    concepts: list[Concept] = []
    seen_instance: dict[str, int] = {}  # concept_name -> line
    seen_id: dict[str, int] = {}
    for lineno, r in read_jsonl(path):
        where = f"{path}:{lineno}"
        domain, instance = r.get("domain"), r.get("instance")
        if not isinstance(domain, str) or not domain.strip():
            raise DataFormatError(f"{where}: 'domain' must be a non-empty string, got {domain!r}")
        if not isinstance(instance, str) or not concept_name(instance):
            raise DataFormatError(f"{where}: 'instance' must be a non-empty string, got {instance!r}")
        name = concept_name(instance)
        if name in seen_instance:
            raise DataFormatError(f"{where}: duplicate concept {instance!r} (first on line {seen_instance[name]})")
        question_type = r.get("question_type") or QUESTION_TYPES.get(domain)
        if question_type is None:
            raise DataFormatError(
                f"{where}: domain {domain!r} is not one of {sorted(QUESTION_TYPES)}; give a 'question_type'"
            )
        references = r.get("references", DIFFICULTY_REFERENCES.get(domain, []))
        if not isinstance(references, list) or not all(isinstance(x, str) for x in references):
            raise DataFormatError(f"{where}: 'references' must be a list of strings, got {references!r}")
        custom_id = r.get("custom_id", concept_key(domain, instance))
        if not isinstance(custom_id, str) or not custom_id:
            raise DataFormatError(f"{where}: 'custom_id' must be a non-empty string, got {custom_id!r}")
        if custom_id in seen_id:
            raise DataFormatError(f"{where}: duplicate custom_id {custom_id!r} (first on line {seen_id[custom_id]})")
        seen_instance[name], seen_id[custom_id] = lineno, lineno
        concepts.append(Concept(custom_id, domain, instance, question_type, references))
    if not concepts:
        raise DataFormatError(f"{path}: no concepts")
    return concepts
