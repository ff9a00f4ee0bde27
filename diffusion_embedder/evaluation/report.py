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

from diffusion_embedder.evaluation.tasks import benchmark_of

logger = logging.getLogger(__name__)

BENCHMARK_ORDER = ("followir", "longembed", "bright", "local")
SKIP_FILES = {"model_meta.json", "identity.json"}  # identity.json: written by older versions
#: The FollowIR paper's retrieval metric on the original instructions, shown under p-MRR (not averaged).
OG_METRIC = {"News21InstructionRetrieval": "ndcg_at_5"}
OG_DEFAULT = "map_at_1000"


@dataclass
class ResultTable:
    """``scores[model][task]`` (x100), the benchmark of each task, model column labels in order."""

    models: list[str] = field(default_factory=list)
    scores: dict[str, dict[str, float]] = field(default_factory=dict)
    benchmarks: dict[str, str] = field(default_factory=dict)
    #: ``details[model][(task, label)]``: secondary numbers (FollowIR og MAP@1000 / nDCG@5), x100.
    details: dict[str, dict[tuple[str, str], float]] = field(default_factory=dict)

    def tasks_of(self, benchmark: str) -> list[str]:
        return sorted(t for t, b in self.benchmarks.items() if b == benchmark)

    def average(self, model: str, benchmark: str) -> float | None:
        """Mean over the benchmark's tasks; None unless the model has every one of them."""
        tasks = self.tasks_of(benchmark)
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


def _model_label(folder: Path) -> str:
    meta = json.loads((folder / "model_meta.json").read_text())
    label = f"{meta.get('name')}@{str(meta.get('revision'))[:8]}"
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


def _same_result(a, b) -> bool:
    """The same scores on the same data (a copied folder), whatever the run time."""
    def scores(result) -> str:  # JSON text, so that NaN metrics compare equal
        return json.dumps(result.scores, sort_keys=True, default=str)

    return a.dataset_revision == b.dataset_revision and scores(a) == scores(b)


def load_results(paths: list[str]) -> ResultTable:
    """Collect every model folder under ``paths``; two different results for one column and task are an error."""
    table = ResultTable()
    folders = []
    for path in paths:
        if not os.path.exists(path):
            raise FileNotFoundError(f"Results path {path!r} does not exist.")
        folders.extend(sorted(p.parent for p in Path(path).rglob("model_meta.json")))
    if not folders:
        raise ValueError(f"No results (model_meta.json) found under {paths}.")
    sources: dict[tuple[str, str], tuple[Path, object]] = {}
    for folder in folders:
        label = _model_label(folder)  # the same checkpoint and settings in several folders is one column
        if label not in table.scores:
            table.models.append(label)
            table.scores[label] = {}
            table.details[label] = {}
        for file in sorted(folder.glob("*.json")):
            if file.name in SKIP_FILES:
                continue
            result = _read_result(file)
            seen = sources.get((label, result.task_name))
            if seen is not None:
                if _same_result(seen[1], result):
                    continue
                raise ValueError(
                    f"Two different results for {label} on {result.task_name}: {seen[0]} "
                    f"(score {seen[1].get_score():.6g}, data {seen[1].dataset_revision}) and {file} "
                    f"(score {result.get_score():.6g}, data {result.dataset_revision}); report one of them."
                )
            sources[(label, result.task_name)] = (file, result)
            table.scores[label][result.task_name] = 100 * float(result.get_score())
            metric = OG_METRIC.get(result.task_name, OG_DEFAULT)
            og = [s["og"][metric] for split in result.scores.values() for s in split if "og" in s]
            if og:
                table.details[label][(result.task_name, f"og {metric}")] = 100 * sum(og) / len(og)
            table.benchmarks[result.task_name] = benchmark_of(result.task_name)
    return table


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


def to_markdown(table: ResultTable) -> str:
    lines = ["| benchmark | task | " + " | ".join(table.models) + " |", "|---|---|" + "---:|" * len(table.models)]
    for bench, task, values in table.rows():
        name = f"**{task}**" if task == "Average" else task
        lines.append(f"| {bench} | {name} | " + " | ".join(_fmt(v) for v in values) + " |")
    return "\n".join(lines) + "\n"


def to_csv(table: ResultTable) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(["benchmark", "task", *table.models])
    for bench, task, values in table.rows():
        writer.writerow([bench, task, *[_fmt(v) for v in values]])
    return buffer.getvalue()


def plot(table: ResultTable, out_dir: str) -> list[str]:
    """One grouped bar chart per benchmark (tasks + average), and ``overview.png`` of the averages (Figure 1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    written = []
    groups: dict[str, list[tuple[str, list[float | None]]]] = {}
    for bench, task, values in table.rows(details=False):
        groups.setdefault(bench, []).append((task, values))
    groups["overview"] = [
        (bench, [table.average(m, bench) for m in table.models]) for bench in BENCHMARK_ORDER if table.tasks_of(bench)
    ]
    width = 0.8 / max(len(table.models), 1)
    for name, items in groups.items():
        fig, ax = plt.subplots(figsize=(max(4.0, 1.1 * len(items) + 2), 3.6))
        for j, model in enumerate(table.models):
            xs = [i + (j - (len(table.models) - 1) / 2) * width for i in range(len(items))]
            ys = [values[j] or 0.0 for _, values in items]
            bars = ax.bar(xs, ys, width, label=model)
            ax.bar_label(bars, labels=[_fmt(values[j]) for _, values in items], fontsize=7)
        ax.set_xticks(range(len(items)))
        ax.set_xticklabels([label for label, _ in items], rotation=25, ha="right", fontsize=8)
        ax.set_ylabel("main score x 100")
        ax.set_title("Benchmark averages" if name == "overview" else name)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        path = os.path.join(out_dir, f"{name}.png")
        fig.savefig(path, dpi=120, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    return written


def write_report(paths: list[str], out_dir: str | None = None) -> tuple[str, ResultTable]:
    """Markdown table (returned), plus ``report.md``, ``report.csv`` and the PNGs in ``out_dir``."""
    table = load_results(paths)
    markdown = to_markdown(table)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        Path(out_dir, "report.md").write_text(markdown, encoding="utf-8")
        Path(out_dir, "report.csv").write_text(to_csv(table), encoding="utf-8")
        plot(table, out_dir)
    return markdown, table


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Table and bar charts of evaluation results, models side by side.")
    parser.add_argument("results_dirs", nargs="+", help="output_dir(s) of mteb_eval_custom.py, or results folders")
    parser.add_argument("--out_dir", default="report", help="where report.md, report.csv and the PNGs go")
    args = parser.parse_args(argv)
    markdown, _ = write_report(args.results_dirs, args.out_dir)
    print(markdown)
    print(f"Wrote {args.out_dir}/report.md, report.csv and bar charts.")
    return 0
