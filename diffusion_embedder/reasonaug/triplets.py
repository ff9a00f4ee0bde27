"""Query / positive / hard-negative triplets for the four ReasonAug task types.

Per concept (following upstream ``gen_hard_negative_llm.py``):

* ``p2i``   problem -> the concept's definition or name (50/50); 2 negatives per problem.
* ``i2ps``  concept name -> one of its solutions (coding) or problem + solution; one per solution.
* ``p2ps`` / ``ps2ps`` (75/25) problem, or problem + solution / problem + name -> another pair of the same
  concept; up to 20 ordered pairs per concept.

Hard negatives are BM25-ranked (bm25s) documents of *other concepts of the same domain*; the two
same-domain concepts that rank highest for a query are skipped entirely (false-negative guard).
Differences from upstream: the skip counts same-domain concepts and removes them for good (upstream
skipped the first ranking positions up to the second other concept of any domain); non-coding i2ps
negatives are the negative problem + solution (upstream repeated the problem twice); the name form of
``p2i`` uses the concept name itself (upstream's parse left it empty for 15 definitions).
"""

from __future__ import annotations

import logging
import random
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import permutations

import bm25s
import numpy as np

from diffusion_embedder.reasonaug.concepts import concept_name
from diffusion_embedder.reasonaug.prompts import TASK_TYPES, task_instruction

logger = logging.getLogger(__name__)

GENERATED = "GENERATED"
RECORD_FIELDS = (
    "id",
    "domain",
    "instance",
    "task_type",
    "task",
    "user_query",
    "positive_document",
    "hard_negative_document",
    "negative_instance",
)


@dataclass(frozen=True)
class ConceptData:
    """Everything the triplet builder needs about one concept."""

    instance: str
    domain: str
    question_type: str
    definition: str
    problems: tuple[str, ...]
    solutions: tuple[str, ...]


@dataclass
class TripletConfig:
    seed: int = 0
    skip: int = 2  # most similar same-domain concepts never used as negatives
    p2i_negatives: int = 2
    max_pairs_per_concept: int = 20
    p2ps_fraction: float = 0.75
    ps2ps_with_solution: float = 0.6
    p2i_definition_fraction: float = 0.5


class _Index:
    """BM25 over a corpus whose documents each belong to a concept; deterministic tie-breaking."""

    def __init__(self, docs: list[str], concepts: list[str]):
        self.docs, self.concepts = docs, concepts
        self.retriever = bm25s.BM25()
        self.retriever.index(bm25s.tokenize(docs, show_progress=False), show_progress=False)

    def rank(self, query: str) -> np.ndarray:
        tokens = bm25s.tokenize([query], return_ids=False, show_progress=False)[0]
        scores = self.retriever.get_scores(tokens) if tokens else np.zeros(len(self.docs))
        return np.lexsort((np.arange(len(self.docs)), -np.asarray(scores)))


def negative_candidates(
    ranking: Iterable[int], doc_concepts: list[str], instance: str, domain_of: dict[str, str], skip: int
) -> list[int]:
    """Ranked doc ids usable as negatives for ``instance``: same domain, other concept, top ``skip`` concepts
    (by their best-ranked document) excluded, though at least one other concept is always kept."""
    domain = domain_of[instance]
    ranking = list(ranking)
    others = {doc_concepts[i] for i in ranking if doc_concepts[i] != instance and domain_of[doc_concepts[i]] == domain}
    skip = min(skip, max(0, len(others) - 1))  # a tiny pool (small held-out split) still yields a negative
    skipped: set[str] = set()
    out = []
    for idx in ranking:
        c = doc_concepts[idx]
        if c == instance or domain_of[c] != domain or c in skipped:
            continue
        if len(skipped) < skip:
            skipped.add(c)
            continue
        out.append(int(idx))
    return out


def _first_distinct(
    candidates: list[int], doc_concepts: list[str], n: int, exclude_docs: set[str], docs: list[str]
) -> list[int]:
    """First ``n`` candidates with pairwise different concepts (and text not in ``exclude_docs``)."""
    chosen, used = [], set()
    for idx in candidates:
        if doc_concepts[idx] in used or docs[idx] in exclude_docs:
            continue
        chosen.append(idx)
        used.add(doc_concepts[idx])
        if len(chosen) == n:
            break
    return chosen


def _dedup(problems: tuple[str, ...], solutions: tuple[str, ...]) -> tuple[list[str], list[str]]:
    seen, ps, ss = set(), [], []
    for p, s in zip(problems, solutions, strict=True):
        if p not in seen:
            seen.add(p)
            ps.append(p)
            ss.append(s)
    return ps, ss


def _record(c: ConceptData, task: str, query: str, pos: str, neg: str | None, neg_instance: str) -> dict:
    """A record of ``c`` in ``RECORD_FIELDS`` order, less the ``id``."""
    return {
        "domain": c.domain,
        "instance": c.instance,
        "task_type": task,
        "task": task_instruction(task, c.domain, c.question_type),
        "user_query": query,
        "positive_document": pos,
        "hard_negative_document": neg,
        "negative_instance": neg_instance,
    }


def _pair_document(problem: str, solution: str, coding: bool) -> str:
    """A pair as a document: the solution alone for coding (as upstream), else problem, newline, solution."""
    return solution if coding else problem + "\n" + solution


def _pair_query(
    rng: random.Random, config: TripletConfig, problem: str, solution: str, instance: str
) -> tuple[str, str]:
    """``(task, query)`` of a pair-to-pair record: the problem (p2ps), or the problem with its solution or the
    concept name (ps2ps). Always draws twice from ``rng``, so later draws do not depend on the task."""
    task = "p2ps" if rng.random() < config.p2ps_fraction else "ps2ps"
    with_solution = rng.random() < config.ps2ps_with_solution
    if task == "p2ps":
        return task, problem
    return task, problem + "\n" + (solution if with_solution else instance)


def build_triplets(concepts: list[ConceptData], config: TripletConfig | None = None) -> list[dict]:
    """Build ReasonAug records (schema ``RECORD_FIELDS``) for all concepts, ordered by task then concept."""
    config = config or TripletConfig()
    seen: dict[str, str] = {}
    for c in concepts:  # two spellings of one concept would be each other's hard negatives
        name = concept_name(c.instance)
        if name in seen:
            raise ValueError(f"concept {c.instance!r} is listed twice (also as {seen[name]!r})")
        seen[name] = c.instance
    domain_of = {c.instance: c.domain for c in concepts}
    deduped = {c.instance: _dedup(c.problems, c.solutions) for c in concepts}

    prob_docs, sol_docs, owners = [], [], []
    for c in concepts:
        ps, ss = deduped[c.instance]
        prob_docs += ps
        sol_docs += ss
        owners += [c.instance] * len(ps)
    if not prob_docs:
        raise ValueError("no problem/solution pairs to build triplets from")
    def_index = _Index([c.definition for c in concepts], [c.instance for c in concepts])
    prob_index = _Index(prob_docs, owners)
    sol_index = _Index(sol_docs, owners)

    by_task: dict[str, list[dict]] = defaultdict(list)
    for c in concepts:
        problems, solutions = deduped[c.instance]
        if not problems:
            continue
        coding = c.question_type == "coding"

        def record(task: str, query: str, pos: str, neg: str, neg_instance: str, c: ConceptData = c):
            if neg != pos:  # identical text in two concepts: not a usable negative
                by_task[task].append(_record(c, task, query, pos, neg, neg_instance))

        # p2i
        rng = random.Random(f"{config.seed}:p2i:{c.instance}")
        for problem in problems:
            cands = negative_candidates(def_index.rank(problem), def_index.concepts, c.instance, domain_of, config.skip)
            for idx in cands[: config.p2i_negatives]:
                neg_c = concepts[idx]
                if rng.random() < config.p2i_definition_fraction:
                    record("p2i", problem, c.definition, neg_c.definition, neg_c.instance)
                else:
                    record("p2i", problem, c.instance, neg_c.instance, neg_c.instance)

        # i2ps: the concept's definition retrieves other concepts' solutions
        rng = random.Random(f"{config.seed}:i2ps:{c.instance}")
        cands = negative_candidates(
            sol_index.rank(c.definition), sol_index.concepts, c.instance, domain_of, config.skip
        )
        negs = _first_distinct(cands, sol_index.concepts, len(solutions), set(), sol_index.docs)
        order = list(range(len(solutions)))
        rng.shuffle(order)
        for k, idx in zip(order, negs, strict=False):
            neg = _pair_document(prob_docs[idx], sol_docs[idx], coding)
            record("i2ps", c.instance, _pair_document(problems[k], solutions[k], coding), neg, owners[idx])

        # p2ps / ps2ps
        rng = random.Random(f"{config.seed}:p2ps:{c.instance}")
        negs_by_problem = {}
        for problem in problems:
            cands = negative_candidates(
                prob_index.rank(problem), prob_index.concepts, c.instance, domain_of, config.skip
            )
            negs_by_problem[problem] = _first_distinct(
                cands, prob_index.concepts, len(problems) - 1, {problem}, prob_index.docs
            )
        pairs = list(permutations(range(len(problems)), 2))
        for q, p in rng.sample(pairs, min(len(pairs), config.max_pairs_per_concept)):
            task, query = _pair_query(rng, config, problems[q], solutions[q], c.instance)
            pool = negs_by_problem[problems[q]]
            if not pool:
                logger.debug("%s: no negative left for a p2ps query", c.instance)
                continue
            idx = pool.pop(0)
            neg = _pair_document(prob_docs[idx], sol_docs[idx], coding)
            record(task, query, _pair_document(problems[p], solutions[p], coding), neg, owners[idx])

    records = [r for task in TASK_TYPES for r in by_task[task]]
    for i, r in enumerate(records, 1):
        r["id"] = str(i)
    return [{k: r[k] for k in RECORD_FIELDS} for r in records]


def ring_records(concepts: list[ConceptData], config: TripletConfig | None = None) -> list[dict]:
    """Upstream's extra ring: pair i -> pair i+1 of each concept, hard negative to be written by an LLM.

    ``hard_negative_document`` is None and ``negative_instance`` is ``GENERATED`` until the
    ``negatives`` stage fills the document in.
    """
    config = config or TripletConfig()
    out = []
    for c in concepts:
        problems, solutions = _dedup(c.problems, c.solutions)
        if len(problems) < 2:
            continue
        rng = random.Random(f"{config.seed}:ring:{c.instance}")
        for q in range(len(problems)):
            p = (q + 1) % len(problems)
            task, query = _pair_query(rng, config, problems[q], solutions[q], c.instance)
            pos = _pair_document(problems[p], solutions[p], c.question_type == "coding")
            out.append({"id": f"ring-{c.instance}-{q}", **_record(c, task, query, pos, None, GENERATED)})
    return out


def split_concepts(
    concepts: list[ConceptData], heldout_fraction: float = 0.2, seed: int = 0
) -> tuple[list[ConceptData], list[ConceptData]]:
    """Hold out ``round(fraction * n)`` concepts per domain (at least one where a domain has two or more)."""
    if not 0 < heldout_fraction < 1:
        raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    by_domain: dict[str, list[ConceptData]] = defaultdict(list)
    for c in concepts:
        by_domain[c.domain].append(c)
    heldout: set[str] = set()
    for domain, members in sorted(by_domain.items()):
        names = sorted(m.instance for m in members)
        random.Random(f"{seed}:split:{domain}").shuffle(names)
        n = round(heldout_fraction * len(names))
        n = max(n, 1) if len(names) >= 2 else 0
        heldout.update(names[:n])
    return [c for c in concepts if c.instance not in heldout], [c for c in concepts if c.instance in heldout]


def build_split(
    concepts: list[ConceptData], config: TripletConfig | None = None, heldout_fraction: float = 0.2
) -> tuple[list[dict], list[dict], list[str], list[str]]:
    """Split concepts, then build each side on its own: no concept appears on both sides, neither as the
    query's concept nor as a hard negative. Returns train and held-out records and concept names."""
    config = config or TripletConfig()
    usable = [c for c in concepts if c.problems]
    train, heldout = split_concepts(usable, heldout_fraction, config.seed)
    return (
        build_triplets(train, config),
        build_triplets(heldout, config),
        [c.instance for c in train],
        [c.instance for c in heldout],
    )
