"""One results table (markdown + CSV) and a bar chart per benchmark, models side by side: the ``report`` command.

``result_table.py`` reads the mteb result folders into the table; this module renders it.
"""

from __future__ import annotations

import csv
import io
import logging
import os
from pathlib import Path

from diffusion_embedder.evaluation.result_table import BENCHMARK_ORDER, ResultTable, check_results, load_results

logger = logging.getLogger(__name__)

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
