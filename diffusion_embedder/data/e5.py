"""Public E5 ("echo-data"): ``<dir>/<name>.jsonl`` with ``query``, ``positive``, ``negative``.

Instructions are the E5-mistral ones LLM2Vec and the paper's fork use, on queries only (the fork's
document-side instruction code never fires). ``allnli`` and ``quora_duplicates`` alternate two
instructions by line parity (line 1 gets the first). The fork keeps the first 8,000 records of each
file; each file is one homogeneous-batch group.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

from .jsonl import Field, read_jsonl
from .sample import ContrastiveDataset, TrainSample, train_instruction

logger = logging.getLogger(__name__)

#: Per-dataset query instructions (the fork drops the Chinese dureader and t2ranking).
E5_INSTRUCTIONS: dict[str, str | tuple[str, str]] = {
    "allnli": (
        "Given a premise, retrieve a hypothesis that is entailed by the premise",
        "Retrieve semantically similar text",
    ),
    "eli5_question_answer": "Provided a user question, retrieve the highest voted answers on Reddit ELI5 forum",
    "fever": "Given a claim, retrieve documents that support or refute the claim",
    "hotpot_qa": "Given a multi-hop question, retrieve documents that can help answer the question",
    "miracl": "Given a question, retrieve Wikipedia passages that answer the question",
    "mrtydi": "Given a question, retrieve Wikipedia passages that answer the question",
    "msmarco_passage": "Given a web search query, retrieve relevant passages that answer the query",
    "msmarco_document": "Given a web search query, retrieve relevant documents that answer the query",
    "nq": "Given a question, retrieve Wikipedia passages that answer the question",
    "quora_duplicates": (
        "Given a question, retrieve questions that are semantically equivalent to the given question",
        "Find questions that have the same meaning as the input question",
    ),
    "squad": "Retrieve Wikipedia passages that answer the question",
    "trivia_qa": "Retrieve Wikipedia passages that answer the question",
}

E5_DATASETS: tuple[str, ...] = tuple(E5_INSTRUCTIONS)

_FIELDS = (Field("query"), Field("positive"), Field("negative"))


def e5_instruction(dataset: str, index: int) -> str:
    """The instruction of the record on 0-based line ``index`` of ``<dataset>.jsonl``."""
    inst = E5_INSTRUCTIONS[dataset]
    return inst if isinstance(inst, str) else inst[index % 2]


class E5(ContrastiveDataset):
    """Public E5 training data: one hard negative per query, grouped by source dataset.

    ``max_per_dataset`` keeps the first N records of each file (the fork's 8,000; None keeps all).
    """

    def __init__(
        self,
        dataset_dir: str | os.PathLike = "cache/echo-data",
        *,
        datasets: Sequence[str] | None = None,
        max_per_dataset: int | None = 8000,
        skip_bad_lines: bool = False,
    ):
        names = list(E5_DATASETS if datasets is None else datasets)
        unknown = [n for n in names if n not in E5_INSTRUCTIONS]
        if unknown:
            raise ValueError(f"unknown E5 dataset(s) {unknown}; known: {', '.join(E5_DATASETS)}")
        if not os.path.isdir(dataset_dir):
            what = "is a file" if os.path.exists(dataset_dir) else "not found"
            raise FileNotFoundError(
                f"E5 data folder (dataset_file_path) {os.fspath(dataset_dir)}: {what}; name the folder that "
                "holds <name>.jsonl per dataset (echo-data)"
            )
        missing = [n for n in names if not os.path.isfile(os.path.join(dataset_dir, f"{n}.jsonl"))]
        if missing:
            raise FileNotFoundError(
                f"E5 data folder {dataset_dir} lacks {', '.join(f'{n}.jsonl' for n in missing)} "
                f"(pass datasets=[...] to train on a subset)"
            )
        if max_per_dataset is not None and max_per_dataset < 1:
            raise ValueError(f"max_per_dataset must be >= 1 or None, got {max_per_dataset}")

        samples: list[TrainSample] = []
        bad_total = 0
        for name in names:
            def convert(record: dict, index: int, name: str = name) -> TrainSample:
                return TrainSample(
                    query=(train_instruction(e5_instruction(name, index)), record["query"]),
                    positive=("", record["positive"]),
                    negatives=[("", record["negative"])],
                    group=name,
                )

            read, bad = read_jsonl(
                os.path.join(dataset_dir, f"{name}.jsonl"),
                _FIELDS,
                convert,
                skip_bad_lines=skip_bad_lines,
                limit=max_per_dataset,
            )
            logger.info("E5 %s: %d records", name, len(read))
            samples.extend(read)
            bad_total += bad
        super().__init__(samples, name="E5", num_bad_records=bad_total)
