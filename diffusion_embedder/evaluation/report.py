"""One results table (markdown + CSV) and a bar chart per benchmark, models side by side.

Reads mteb result folders as ``run.py`` writes them (``.../results/<name>/<revision>[/experiments/<exp>]``):
every folder holding a ``model_meta.json`` is one model column. Scores are the task's main score
(mean over splits, e.g. LongEmbed passkey/needle lengths) x 100, as in the paper.
"""

from __future__ import annotations

import csv
import io
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


BENCHMARK_TITLES = {"followir": "FollowIR", "longembed": "LongEmbed", "bright": "BRIGHT", "local": "Local tasks"}


def short_task_name(task: str) -> str:
    """``LEMBNarrativeQARetrieval`` -> ``NarrativeQA``, ``BrightAopsRetrieval`` -> ``Aops``: the chart title
    names the benchmark; the table keeps the full names."""
    for suffix in ("InstructionRetrieval", "Retrieval"):
        if task.endswith(suffix) and task != suffix:
            task = task[: -len(suffix)]
            break
    for prefix in ("LEMB", "Bright"):
        if task.startswith(prefix) and len(task) > len(prefix):
            return task[len(prefix):]
    return task


def metric_name(metric: str) -> str:
    """``ndcg_at_10`` -> ``nDCG@10``, ``map_at_1000`` -> ``MAP@1000``; others as they are."""
    pretty = {"ndcg": "nDCG", "map": "MAP", "mrr": "MRR", "recall": "Recall", "precision": "Precision"}
    head, sep, k = metric.partition("_at_")
    return f"{pretty.get(head, head)}@{k}" if sep else metric


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


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


def to_markdown(table: ResultTable) -> str:
    """The table with short column labels, the metric of each task, and the key to the labels below it."""
    short = table.short_labels()
    lines = ["| benchmark | task | metric | " + " | ".join(short[m] for m in table.models) + " |",
             "|---|---|---|" + "---:|" * len(table.models)]
    for bench, task, values in table.rows():
        name = f"**{task}**" if task == "Average" else task
        metric = metric_name(table.metrics[task]) if task in table.metrics else ""
        lines.append(f"| {bench} | {name} | {metric} | " + " | ".join(_fmt(v) for v in values) + " |")
    lines += ["", "Scores: main score x 100; an empty cell is a missing score. Columns:", ""]
    lines += [f"- **{short[m]}**: `{m}`" for m in table.models]
    return "\n".join(lines) + "\n"


def to_csv(table: ResultTable) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(["benchmark", "task", *table.models])
    for bench, task, values in table.rows():
        writer.writerow([bench, task, *[_fmt(v) for v in values]])
    return buffer.getvalue()


def plot(table: ResultTable, out_dir: str) -> list[str]:
    """One grouped bar chart per benchmark (tasks in its order + average), and ``overview.png`` of the averages
    (the paper's Figure 1). Short model labels in the legend, the full identities in a key under the chart,
    the metric on the axis (under each task when they differ), a missing score marked "missing", never a 0 bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    short = table.short_labels()
    written = []
    groups: dict[str, list[tuple[str, list[float | None]]]] = {}
    metrics: dict[str, list[str]] = {}
    for bench, task, values in table.rows(details=False):
        groups.setdefault(bench, []).append((task, values))
        metrics.setdefault(bench, []).append(metric_name(table.metrics[task]) if task in table.metrics else "")
    benches = [b for b in BENCHMARK_ORDER if table.tasks_of(b)]
    groups["overview"] = [(bench, [table.average(m, bench) for m in table.models]) for bench in benches]
    metrics["overview"] = [" / ".join(dict.fromkeys(metric_name(table.metrics[t]) for t in table.tasks_of(b)))
                           for b in benches]
    n = max(len(table.models), 1)
    width = 0.8 / n
    key = "\n".join(f"{short[m]} = {m}" for m in table.models)
    for name, items in groups.items():
        task_metrics = [m for m, (label, _) in zip(metrics[name], items, strict=True) if label != "Average"]
        one_metric = len(set(task_metrics)) == 1 and name != "overview"
        fig, (ax, key_ax) = plt.subplots(
            2, 1, figsize=(max(9.0, len(items) * (0.32 * n + 0.5) + 3.0), 4.6 + 0.16 * n),
            height_ratios=[4.0, 0.35 + 0.16 * n], layout="constrained",
        )
        present = [v for _, values in items for v in values if v is not None]
        top, bottom = max([0.0, *present]), min([0.0, *present])
        span = (top - bottom) or 1.0
        for j, model in enumerate(table.models):
            xs = [i + (j - (n - 1) / 2) * width for i in range(len(items))]
            shown = [(x, values[j]) for x, (_, values) in zip(xs, items, strict=True) if values[j] is not None]
            bars = ax.bar([x for x, _ in shown], [v for _, v in shown], width, label=short[model])
            ax.bar_label(bars, labels=[_fmt(v) for _, v in shown], fontsize=7, rotation=90, padding=2)
            for x, (label, values) in zip(xs, items, strict=True):
                if values[j] is None:  # an average over an incomplete benchmark is missing too
                    word = "incomplete" if label == "Average" or name == "overview" else "missing"
                    ax.text(x, 0.02 * span, word, rotation=90, ha="center", va="bottom", fontsize=7,
                            color="0.45", style="italic")
        ax.axhline(0, color="0.3", linewidth=0.8)
        ax.set_ylim(bottom - (0.22 * span if bottom < 0 else 0), top + 0.22 * span)
        ax.set_xticks(range(len(items)))
        labels = [BENCHMARK_TITLES.get(label, label) if name == "overview" else
                  label if name == "local" else short_task_name(label) for label, _ in items]
        if one_metric:
            ticks = labels
            ylabel = f"{task_metrics[0]} x 100"
        else:
            ticks = [f"{label}\n({m})" if m else label for label, m in zip(labels, metrics[name], strict=True)]
            ylabel = "average main score x 100" if name == "overview" else "main score x 100 (metric under each task)"
        ax.set_xticklabels(ticks, rotation=30 if len(items) > 3 else 0, ha="right" if len(items) > 3 else "center",
                           fontsize=8)
        ax.set_ylabel(ylabel)
        title = "Benchmark averages (mean of the tasks' main scores)" if name == "overview" else (
            f"{BENCHMARK_TITLES.get(name, name)}: main score per task")
        ax.set_title(title)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="model", title_fontsize=7)
        key_ax.axis("off")
        key_ax.text(0.0, 1.0, "Key:\n" + key, fontsize=7, va="top", ha="left", family="monospace",
                    transform=key_ax.transAxes)
        path = os.path.join(out_dir, f"{name}.png")
        fig.savefig(path, dpi=120, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    return written


def write_report(paths: list[str], out_dir: str | None = None) -> tuple[str, ResultTable]:
    """One results table of several evaluations, models side by side, and its bar charts.

    Args:
        paths: Evaluation output folders (``diffusion-embedder eval --output_dir``) or results folders.
        out_dir: Where ``report.md``, ``report.csv`` and the PNGs go; None writes nothing.

    Returns:
        The markdown table, and the table itself.

    Raises:
        FileNotFoundError: A path that does not exist.
        ValueError: A result file mteb cannot read, named with its path.
    """
    table = load_results(paths)
    markdown = to_markdown(table)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        Path(out_dir, "report.md").write_text(markdown, encoding="utf-8")
        Path(out_dir, "report.csv").write_text(to_csv(table), encoding="utf-8")
        plot(table, out_dir)
    return markdown, table


def build_parser():
    """The ``report`` command line."""
    import argparse

    from diffusion_embedder import clihelp

    parser = argparse.ArgumentParser(
        prog=clihelp.prog("report"),
        description="Table and bar charts of evaluation results, models side by side.",
        formatter_class=clihelp.HelpFormatter,
    )
    parser.add_argument("results_dirs", nargs="+", help="output_dir(s) of diffusion-embedder eval, or results folders")
    parser.add_argument("--out_dir", default="report", help="where report.md, report.csv and the PNGs go")
    parser.add_argument(
        "--check", action="store_true",
        help="only name every result file mteb's ResultCache could not read, or that lacks some of its task's "
             "splits (exit 1 if any); write nothing",
    )
    return parser


#: ``report``'s exit statuses (``clihelp.run_command``): 0 done (with ``--check``: every result file reads and is
#: complete); 1 with ``--check``, some result file is unreadable or incomplete (each named); 2 nothing could be
#: reported, the message alone: a results folder that is missing or holds nothing readable, two results that cannot
#: be merged, an ``--out_dir`` that is a file. Anything else is a bug, with its traceback.
EXIT_STATUS: dict[type[Exception], int] = {ValueError: 2, FileNotFoundError: 2}  # our readers' errors


def main(argv: list[str] | None = None) -> int:
    """CLI entry; exit status ``EXIT_STATUS``."""
    from diffusion_embedder import clihelp

    args = build_parser().parse_args(argv)
    return clihelp.run_command(lambda: _run(args), EXIT_STATUS)


def _run(args) -> int:
    from diffusion_embedder.clihelp import UsageError
    from diffusion_embedder.files import folder_problem

    if args.check:
        problems = check_results(args.results_dirs)
        for problem in problems:
            print(problem)
        print(f"{len(problems)} unreadable or incomplete file(s)." if problems else
              "Every result file reads and holds all of its task's splits.")
        return 1 if problems else 0
    problem = folder_problem(args.out_dir, "--out_dir")
    if problem:  # before any result is read
        raise UsageError(problem)
    markdown, _ = write_report(args.results_dirs, args.out_dir)
    print(markdown)
    print(f"Wrote {args.out_dir}/report.md, report.csv and bar charts.")
    return 0
