"""Users' own training data: JSONL of ``query``, ``positive``, ``negatives`` (list) and optional ``instruction``.

The instruction applies to the query only, in the training format ``"<instruction>; <query>"`` (a
``;`` is added unless the instruction already ends with ``;`` or ``:``). Samples are grouped by
instruction, so each optimizer step sees one task, as with the paper's datasets.
"""

from __future__ import annotations

import logging
import os

from .jsonl import Field, read_jsonl
from .sample import ContrastiveDataset, TrainSample

logger = logging.getLogger(__name__)

_FIELDS = (
    Field("query"),
    Field("positive"),
    Field("negatives", kind="list[str]"),
    Field("instruction", required=False),
)


def custom_instruction(instruction: str | None) -> str:
    inst = (instruction or "").strip()
    if not inst or inst.endswith((";", ":")):
        return inst
    return f"{inst};"


class Custom(ContrastiveDataset):
    """A JSONL of ``{"query", "positive", "negatives": [...], "instruction"?}`` records.

    ``num_negatives``: keep the first N negatives of each record and drop (with a count in the log)
    records that have fewer, so batches have a fixed shape; ``None`` keeps every record's full list.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        num_negatives: int | None = 1,
        skip_bad_lines: bool = False,
    ):
        if num_negatives is not None and num_negatives < 0:
            raise ValueError(f"num_negatives must be >= 0 or None, got {num_negatives}")
        too_few = 0

        def convert(record: dict, index: int) -> TrainSample | None:
            nonlocal too_few
            negatives = record["negatives"]
            if num_negatives is not None:
                if len(negatives) < num_negatives:
                    too_few += 1
                    return None
                negatives = negatives[:num_negatives]
            instruction = custom_instruction(record.get("instruction"))
            return TrainSample(
                query=(instruction, record["query"]),
                positive=("", record["positive"]),
                negatives=[("", n) for n in negatives],
                group=instruction,
            )

        what = "dataset_file_path: data file"
        samples, bad = read_jsonl(path, _FIELDS, convert, skip_bad_lines=skip_bad_lines, what=what)
        if too_few:
            logger.warning("%s: dropped %d record(s) with fewer than %d negatives", path, too_few, num_negatives)
        super().__init__(samples, name=f"Custom({os.fspath(path)})", num_bad_records=bad)
