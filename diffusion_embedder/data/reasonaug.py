"""ReasonAug triplets (the fork's ``E5Mix`` loader): query, positive and one hard negative per record.

Record schema: ``id, domain, instance, task_type, task, user_query, positive_document,
hard_negative_document, negative_instance``. ``task`` is the retrieval instruction (it encodes the
task type and the domain) and is the homogeneous-batch group, as upstream. Records whose hard
negative is null or empty are dropped.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Sequence

from .jsonl import Field, RecordError, read_jsonl
from .sample import ContrastiveDataset, TrainSample, train_instruction

logger = logging.getLogger(__name__)

#: Record ``domain`` -> question type (the unit the ``domain`` filter selects).
DOMAIN_TO_TYPE: dict[str, str] = {
    "algorithm": "coding",
    "data structure": "coding",
    "math theorem": "math",
    "physics theorem": "physics",
    "finance formula": "finance",
}

#: ``domain`` filter values: question types, plus the fork's names for the BRIGHT-matched subsets.
DOMAIN_FILTERS: dict[str, tuple[str, ...]] = {
    "all": ("coding", "math", "physics", "finance"),
    "coding": ("coding",),
    "math": ("math",),
    "physics": ("physics",),
    "finance": ("finance",),
    "leetcode": ("coding",),
    "aops": ("math",),
    "theoremqa": ("math", "physics", "finance"),
}

TASK_TYPES: tuple[str, ...] = ("p2i", "i2ps", "p2ps", "ps2ps")

_FIELDS = (
    Field("id", kind="int|str", required=False),
    Field("domain"),
    Field("instance", required=False),
    Field("task_type"),
    Field("task"),
    Field("user_query"),
    Field("positive_document"),
    Field("hard_negative_document", nullable=True),
    Field("negative_instance", required=False),
)


def _as_list(value: str | Sequence[str], name: str, choices: Sequence[str]) -> list[str]:
    values = [value] if isinstance(value, str) else list(value)
    unknown = [v for v in values if v not in choices]
    if not values or unknown:
        raise ValueError(f"{name}={value!r} is not valid; choose from {', '.join(choices)} (or a list of them)")
    return values


class ReasonAug(ContrastiveDataset):
    """Reasoning-intensive training data, filtered by ``domain`` and ``task`` (task type).

    ``domain``: ``all``, ``coding``, ``math``, ``physics``, ``finance``, or the fork's ``leetcode``
    (coding), ``aops`` (math), ``theoremqa`` (math + physics + finance); a list selects several.
    ``task``: ``all`` or task types among ``p2i``, ``i2ps``, ``p2ps``, ``ps2ps``.
    """

    def __init__(
        self,
        path: str | os.PathLike = "ReasonAug/ReasonAug_train.jsonl.gz",
        *,
        domain: str | Sequence[str] = "all",
        task: str | Sequence[str] = "all",
        skip_bad_lines: bool = False,
    ):
        types = {t for d in _as_list(domain, "domain", tuple(DOMAIN_FILTERS)) for t in DOMAIN_FILTERS[d]}
        tasks = _as_list(task, "task", ("all", *TASK_TYPES))
        task_set = None if "all" in tasks else set(tasks)
        seen: Counter = Counter()
        no_negative = 0

        def convert(record: dict, index: int) -> TrainSample | None:
            nonlocal no_negative
            if record["domain"] not in DOMAIN_TO_TYPE:
                raise RecordError(
                    f"unknown domain {record['domain']!r}; expected one of {', '.join(DOMAIN_TO_TYPE)}"
                )
            seen[(record["domain"], record["task_type"])] += 1
            if DOMAIN_TO_TYPE[record["domain"]] not in types:
                return None
            if task_set is not None and record["task_type"] not in task_set:
                return None
            if not record["hard_negative_document"]:
                no_negative += 1
                return None
            instruction = train_instruction(record["task"])
            return TrainSample(
                query=(instruction, record["user_query"]),
                positive=("", record["positive_document"]),
                negatives=[("", record["hard_negative_document"])],
                group=instruction,
            )

        what = "aug_file_path: data file"
        samples, bad = read_jsonl(path, _FIELDS, convert, skip_bad_lines=skip_bad_lines, what=what)
        if no_negative:
            logger.info("ReasonAug: dropped %d record(s) without a hard negative", no_negative)
        if not samples:
            present = ", ".join(f"{d}/{t}: {n}" for (d, t), n in sorted(seen.items())) or "none"
            raise ValueError(
                f"ReasonAug {path}: no usable record for domain={domain!r}, task={task!r} "
                f"({no_negative} dropped without a hard negative; records by domain/task_type: {present})"
            )
        super().__init__(samples, name="ReasonAug", num_bad_records=bad)
