"""The results of several evaluations read into one table: one column per model folder, one row per task.

Reads mteb result folders as ``run.py`` writes them (``.../results/<name>/<revision>[/experiments/<exp>]``):
every folder holding a ``model_meta.json`` is one model column. A score is the task's main score (mean over its
splits, e.g. LongEmbed passkey/needle lengths) x 100, as in the paper; a result missing some of its task's splits
is no score. ``report.py`` renders the table.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from diffusion_embedder.evaluation.results import (
    IDENTITY_FILE,
    INSTRUCTIONS_FILE,
    LEGACY_IDENTITY_FILE,
    recorded_identity,
    stored_instructions,
    stored_main_scores,
)
from diffusion_embedder.evaluation.tasks import BENCHMARKS, benchmark_of
from diffusion_embedder.files import read_json_object

logger = logging.getLogger(__name__)

BENCHMARK_ORDER = ("followir", "longembed", "bright", "local")
SKIP_FILES = {"model_meta.json", LEGACY_IDENTITY_FILE}  # not task results
#: The FollowIR paper's retrieval metric on the original instructions, shown under p-MRR (not averaged).
OG_METRIC = {"News21InstructionRetrieval": "ndcg_at_5"}
OG_DEFAULT = "map_at_1000"
SHORT_LABEL_CHARS = 32


@dataclass
class ResultTable:
    """``scores[model][task]`` (x100), the benchmark of each task, model column labels in order."""

    models: list[str] = field(default_factory=list)
    scores: dict[str, dict[str, float]] = field(default_factory=dict)
    benchmarks: dict[str, str] = field(default_factory=dict)
    #: ``details[model][(task, label)]``: secondary numbers (FollowIR og MAP@1000 / nDCG@5), x100.
    details: dict[str, dict[tuple[str, str], float]] = field(default_factory=dict)
    #: The main score's metric per task (``ndcg_at_10``, ``p-MRR``...).
    metrics: dict[str, str] = field(default_factory=dict)

    def tasks_of(self, benchmark: str) -> list[str]:
        """The benchmark's tasks in its own order (as in the paper's tables); local tasks by name."""
        tasks = [t for t, b in self.benchmarks.items() if b == benchmark]
        order = BENCHMARKS.get(benchmark, ())
        return sorted(tasks, key=lambda t: (order.index(t) if t in order else len(order), t))

    def short_labels(self) -> dict[str, str]:
        """Model column -> a short label for charts and table headers; ``key`` spells out each one."""
        return short_labels(self.models)

    def average(self, model: str, benchmark: str) -> float | None:
        """Mean over the benchmark's tasks (all of ``BENCHMARKS``, not only those in the results: an average over
        the tasks someone happened to score would pass for the benchmark's); None unless the model has every one."""
        tasks = BENCHMARKS.get(benchmark) or self.tasks_of(benchmark)
        values = [self.scores[model].get(t) for t in tasks]
        if not tasks or any(v is None for v in values):
            return None
        return sum(values) / len(values)

    def rows(self, details: bool = True) -> list[tuple[str, str, list[float | None]]]:
        """(benchmark, task or "Average", one value per model) in display order."""
        out = []
        for bench in BENCHMARK_ORDER:
            tasks = self.tasks_of(bench)
            if not tasks:
                continue
            for task in tasks:
                out.append((bench, task, [self.scores[m].get(task) for m in self.models]))
                labels = {lbl for m in self.models for t, lbl in self.details[m] if t == task}
                for label in sorted(labels) if details else []:
                    out.append((bench, f"{task} ({label})", [self.details[m].get((task, label)) for m in self.models]))
            out.append((bench, "Average", [self.average(m, bench) for m in self.models]))
        return out


def short_labels(models: list[str]) -> dict[str, str]:
    """The run's own name (``diffusion_embedder/`` and the revision dropped; its middle cut beyond
    ``SHORT_LABEL_CHARS``); its experiment, then its revision's start, then its whole revision, come back only
    where two columns would read the same (the key spells out every label in full)."""

    def shorten(label: str, detail: int) -> str:
        name, _, rest = label.partition("@")
        revision, _, experiment = rest.partition(" ")
        short = name.rsplit("/", 1)[-1]
        if len(short) > SHORT_LABEL_CHARS:  # cut the middle: the run's start and its checkpoint number stay
            half = (SHORT_LABEL_CHARS - 1) // 2
            short = short[:half] + "…" + short[-half:]
        if detail >= 2:
            short += f"@{revision[:6] if detail == 2 else revision}"
        if detail >= 1 and experiment:
            short += " " + experiment.replace("enable_bidirectional", "bidir").replace("pooling_mode", "pool")
        return short

    out = {m: shorten(m, 0) for m in models}
    for detail in (1, 2, 3):
        clashes = {v for v in out.values() if list(out.values()).count(v) > 1}
        out = {m: shorten(m, detail) if v in clashes else v for m, v in out.items()}
    clashes = {v for v in out.values() if list(out.values()).count(v) > 1}
    return {m: f"{v} #{i + 1}" if v in clashes else v for i, (m, v) in enumerate(out.items())}


def _main_metric(stored: StoredResult) -> str:
    """The metric a result's main score is, as its task declares it: recorded beside the result (a local task's
    task.json), else mteb's task metadata. Never read off the scores: metrics often tie (nDCG@1 and Precision@1)."""
    import mteb

    if stored.main_score is not None:
        return stored.main_score
    try:
        return mteb.get_task(stored.result.task_name).metadata.main_score
    except KeyError:  # a local task scored by a version that did not record its metric
        return "main score"


def _model_label(folder: Path) -> str:
    meta = read_json_object(folder / "model_meta.json")
    label = f"{meta.get('name')}@{meta.get('revision')}"  # the whole revision: two may share a prefix
    if meta.get("experiment_kwargs"):
        exp = ",".join(f"{k}={v}" for k, v in sorted(meta["experiment_kwargs"].items()))
        label += f" ({exp})"
    return label


def _read_result(file: Path):
    from mteb.results import TaskResult

    try:
        return TaskResult.from_disk(file)
    except Exception as e:  # noqa: BLE001 - truncated JSON, wrong schema: the file is what the user must fix
        raise ValueError(
            f"{file}: cannot read this result ({type(e).__name__}: {str(e)[:200]}); rerun its evaluation "
            "with --overwrite, or remove the file."
        ) from None


def model_folders(path: str) -> list[Path]:
    """Every model folder (one holding ``model_meta.json``) under ``path``."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"Results path {path!r} does not exist.")
    return sorted(p.parent for p in Path(path).rglob("model_meta.json"))


def result_files(folder: Path) -> list[Path]:
    """The task result files of one model folder: what mteb's ``ResultCache`` reads there."""
    return [file for file in sorted(folder.glob("*.json")) if file.name not in SKIP_FILES]


def incomplete(file: Path, result) -> str | None:
    """What a result lacks of its task's evaluation splits (mteb's task metadata), naming the file; None if whole.

    mteb saves a result after each split, so a run that failed at a long one (out of memory at LongEmbed's 8192
    tokens) leaves the shorter ones, whose mean is no score of the task. A local task has one split: its result
    is whole once written.
    """
    import mteb

    try:
        task = mteb.get_task(result.task_name)
    except KeyError:  # not an mteb task: a local one
        return None
    missing = result.get_missing_evaluations(task)
    if not missing:
        return None
    return (f"{file}: incomplete, {result.task_name} has no score for split(s) {', '.join(missing)} (its evaluation "
            "stopped before them); rerun its evaluation to score them.")


def check_results(paths: list[str]) -> list[str]:
    """One line per file under ``paths`` that mteb's ``ResultCache`` could not read (truncated, not a result) or
    that lacks some of its task's splits (``incomplete``), naming it and the fix; empty when every file is fine."""
    problems = []
    for path in paths:
        for folder in model_folders(path):
            try:
                _model_label(folder)
            except ValueError as e:
                problems.append(str(e))
            for file in result_files(folder):
                try:
                    problem = incomplete(file, _read_result(file))
                except ValueError as e:
                    problem = str(e)
                if problem:
                    problems.append(problem)
    return problems


@dataclass(frozen=True)
class StoredResult:
    """A task result with what identifies it beyond its column: its file, the weights and settings and the query
    instruction recorded beside it, and its main score's metric recorded there (None where not recorded)."""

    file: Path
    result: object
    identity: dict | None
    instruction: str | None
    main_score: str | None

    @classmethod
    def read(cls, folder: Path, file: Path) -> StoredResult:
        result = _read_result(file)
        task = result.task_name
        return cls(file, result, recorded_identity(folder), stored_instructions(folder).get(task),
                   stored_main_scores(folder).get(task))

    def differences(self, other: StoredResult) -> list[str]:
        """What tells two results for one column and task apart; none: the same result (a copied folder), whatever
        the run time. A record kept beside one only (an older version's folder) tells them apart too."""
        def scores(stored) -> str:  # JSON text, so that NaN metrics compare equal
            return json.dumps(stored.result.scores, sort_keys=True, default=str)

        pairs = {
            "data revision": (self.result.dataset_revision, other.result.dataset_revision),
            "scores": (scores(self), scores(other)),
            f"weights and settings ({IDENTITY_FILE})": (self.identity, other.identity),
            f"query instruction ({INSTRUCTIONS_FILE})": (self.instruction, other.instruction),
        }
        return [what for what, (mine, theirs) in pairs.items() if mine != theirs]


def load_results(paths: list[str]) -> ResultTable:
    """Collect every model folder under ``paths``; two different results for one column and task are an error."""
    table = ResultTable()
    folders = []
    for path in paths:
        found = model_folders(path)
        if not found:  # a mistyped or unfinished path would otherwise vanish from the table without a word
            raise ValueError(
                f"{path}: holds no evaluation results (no model_meta.json below it); check the path, or run its "
                "evaluation first."
            )
        folders.extend(found)
    sources: dict[tuple[str, str], StoredResult] = {}
    for folder in folders:
        label = _model_label(folder)  # the same checkpoint and settings in several folders is one column
        if label not in table.scores:
            table.models.append(label)
            table.scores[label] = {}
            table.details[label] = {}
        for file in result_files(folder):
            stored = StoredResult.read(folder, file)
            result = stored.result
            seen = sources.get((label, result.task_name))
            if seen is not None:
                differences = seen.differences(stored)
                if not differences:
                    continue
                raise ValueError(
                    f"Two different results for {label} on {result.task_name}: {seen.file} "
                    f"(score {seen.result.get_score():.6g}, data {seen.result.dataset_revision}) and {file} "
                    f"(score {result.get_score():.6g}, data {result.dataset_revision}) differ in their "
                    f"{', '.join(differences)}; report one of them."
                )
            sources[(label, result.task_name)] = stored
            table.benchmarks[result.task_name] = benchmark_of(result.task_name)
            table.metrics.setdefault(result.task_name, _main_metric(stored))
            problem = incomplete(file, result)
            if problem:  # its cell stays empty, as a missing score's: the mean of some splits is no task score
                logger.warning("%s: %s", label, problem)
                continue
            table.scores[label][result.task_name] = 100 * float(result.get_score())
            metric = OG_METRIC.get(result.task_name, OG_DEFAULT)
            og = [s["og"][metric] for split in result.scores.values() for s in split if "og" in s]
            if og:
                table.details[label][(result.task_name, f"og {metric}")] = 100 * sum(og) / len(og)
    return table
