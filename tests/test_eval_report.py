"""Report charts a reader understands at a glance: short labels with a key, the metric on the axis, missing
scores shown as missing, tasks in the benchmark's order, value labels that stay apart."""

from __future__ import annotations

import json
import shutil

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from diffusion_embedder.evaluation import report, result_table, results  # noqa: E402
from diffusion_embedder.evaluation.tasks import BRIGHT, LONGEMBED  # noqa: E402

DREAM = "diffusion_embedder/dream-reasonaug-checkpoint-1000@1a2b3c4d"
DREAM_CAUSAL = DREAM + " (enable_bidirectional=False)"
QWEN = "diffusion_embedder/Qwen2.5-7B-Instruct@9f8e7d6c"


@pytest.fixture
def table() -> result_table.ResultTable:
    """LongEmbed filled in alphabetical order (as files are read), Qwen missing Needle; one of BRIGHT's 12 tasks."""
    t = result_table.ResultTable(models=[DREAM, DREAM_CAUSAL, QWEN])
    for m in t.models:
        t.scores[m], t.details[m] = {}, {}
    for i, task in enumerate(sorted(LONGEMBED)):
        t.benchmarks[task] = "longembed"
        t.metrics[task] = "ndcg_at_1" if task in ("LEMBNeedleRetrieval", "LEMBPasskeyRetrieval") else "ndcg_at_10"
        for j, m in enumerate(t.models):
            if not (m == QWEN and task == "LEMBNeedleRetrieval"):
                t.scores[m][task] = 40.0 + i + j
    t.benchmarks["BrightAopsRetrieval"] = "bright"
    t.metrics["BrightAopsRetrieval"] = "ndcg_at_10"
    for j, m in enumerate(t.models):
        t.scores[m]["BrightAopsRetrieval"] = 10.0 + j
    return t


@pytest.fixture
def figures(table, tmp_path, monkeypatch):
    """Every figure ``plot`` saves, by file name, kept open for inspection."""
    saved: dict[str, Figure] = {}
    real = Figure.savefig

    def keep(self, path, *args, **kwargs):
        saved[str(path).rsplit("/", 1)[-1]] = self
        return real(self, path, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    written = report.plot(table, str(tmp_path))
    assert sorted(p.rsplit("/", 1)[-1] for p in written) == ["bright.png", "longembed.png", "overview.png"]
    return saved


def test_short_labels_with_a_key_in_legend_and_table(table, figures):
    short = table.short_labels()
    assert short == {DREAM: "dream-reasonaug-checkpoint-1000",
                     DREAM_CAUSAL: "dream-reasonaug-checkpoint-1000 (bidir=False)",
                     QWEN: "Qwen2.5-7B-Instruct"}
    for fig in figures.values():
        ax, key_ax = fig.axes
        assert [t.get_text() for t in ax.get_legend().get_texts()] == list(short.values())
        key = key_ax.texts[0].get_text()
        assert all(f"{short[m]} = {m}" in key for m in table.models)
    markdown = report.to_markdown(table)
    assert markdown.splitlines()[0] == "| benchmark | task | metric | " + " | ".join(short.values()) + " |"
    assert f"- **Qwen2.5-7B-Instruct**: `{QWEN}`" in markdown
    # two columns that would read the same get their revision back
    same = result_table.short_labels(["a/run@11111111", "b/run@22222222"])
    assert same == {"a/run@11111111": "run@111111", "b/run@22222222": "run@222222"}


def test_metric_on_each_axis_and_tasks_in_the_benchmark_order(figures):
    longembed = figures["longembed.png"].axes[0]
    ticks = [t.get_text() for t in longembed.get_xticklabels()]
    assert ticks == ["NarrativeQA\n(nDCG@10)", "QMSum\n(nDCG@10)", "WikimQA\n(nDCG@10)", "SummScreenFD\n(nDCG@10)",
                     "Needle\n(nDCG@1)", "Passkey\n(nDCG@1)", "Average"]  # LongEmbed's order, not alphabetical
    assert "main score x 100" in longembed.get_ylabel()
    assert figures["bright.png"].axes[0].get_ylabel() == "nDCG@10 x 100"
    overview = figures["overview.png"].axes[0]
    assert [t.get_text() for t in overview.get_xticklabels()] == ["LongEmbed\n(nDCG@10 / nDCG@1)", "BRIGHT\n(nDCG@10)"]


def test_a_missing_score_is_marked_not_drawn_as_zero(table, figures):
    ax = figures["longembed.png"].axes[0]
    qwen_bars = ax.containers[2]
    assert len(qwen_bars) == 5  # 7 groups; Needle and the (incomplete) average are missing
    assert all(bar.get_height() > 0 for container in ax.containers for bar in container)
    marks = sorted((round(t.get_position()[0]), t.get_text()) for t in ax.texts
                   if t.get_text() in ("missing", "incomplete"))
    assert marks == [(4, "missing"), (6, "incomplete")]
    assert "| longembed | LEMBNeedleRetrieval | nDCG@1 | 41.00 | 42.00 |  |" in report.to_markdown(table)


def test_a_benchmark_average_needs_every_task_of_the_benchmark(table, figures):
    """The average is the mean over the benchmark's own tasks, not over the tasks someone was scored on: one BRIGHT
    domain of 12 gives no BRIGHT average (table, chart, overview), a model lacking Needle no LongEmbed average."""
    assert [table.average(m, "longembed") for m in table.models] == [42.5, 43.5, None]  # (40+...+45)/6, (41+...+46)/6
    bright = {task: values for bench, task, values in table.rows() if bench == "bright"}
    assert bright == {"BrightAopsRetrieval": [10.0, 11.0, 12.0], "Average": [None, None, None]}
    assert "| bright | **Average** |  |  |  |  |" in report.to_markdown(table)
    overview = figures["overview.png"].axes[0]
    assert [bar.get_height() for container in overview.containers for bar in container] == [42.5, 43.5]
    marks = sorted((round(t.get_position()[0]), t.get_text()) for t in overview.texts if t.get_text() == "incomplete")
    assert marks == [(0, "incomplete"), (1, "incomplete"), (1, "incomplete"), (1, "incomplete")]
    for i, task in enumerate(BRIGHT):  # every domain: the average is back, the mean of the 12
        table.benchmarks[task], table.metrics[task] = "bright", "ndcg_at_10"
        table.scores[DREAM][task] = 10.0 + i
    assert table.average(DREAM, "bright") == 15.5  # (10 + 21) / 2
    assert table.average(DREAM_CAUSAL, "bright") is None


def test_value_labels_stand_upright_above_their_own_bars(figures):
    for fig in figures.values():
        ax = fig.axes[0]
        labels = [t for t in ax.texts if t.get_text() not in ("missing", "incomplete")]
        assert labels and all(t.get_rotation() == 90 for t in labels)
        bars = [bar for container in ax.containers for bar in container]
        assert len(labels) == len(bars)
        assert ax.get_ylim()[1] >= 1.2 * max(bar.get_height() for bar in bars) - 1e-9  # room for the labels


def test_a_label_carries_its_settings_only_where_names_clash():
    """Runs told apart by name (the demo's four arms) get no settings string squeezing the chart; the key has it."""
    runs = ["demo/bidir-untrained@940caecf (doc_max_length=128,enable_bidirectional=True,max_length=128)",
            "demo/bidir-trained@eb723e58 (enable_bidirectional=True)"]
    assert result_table.short_labels(runs) == {runs[0]: "bidir-untrained", runs[1]: "bidir-trained"}


# ------------------------------------------------------------------ FollowIR: mean over the task's splits
#: Per task, per split: (p-MRR, the original-instruction metric): different on each split, so a report that
#: reads one split only, or weights them otherwise, shows other numbers.
FOLLOWIR_SPLITS = {
    "Core17InstructionRetrieval": {"test": (0.0625, 0.25), "dev": (-0.125, 0.5)},
    "Robust04InstructionRetrieval": {"test": (0.03125, 0.125), "dev": (0.09375, 0.375)},
    "News21InstructionRetrieval": {"test": (-0.0625, 0.75), "dev": (0.1875, 0.25)},
}


def write_followir_results(folder) -> None:
    """A model folder as ``run.py`` leaves it, with FollowIR results on two splits (mteb's result format)."""
    import mteb

    folder.mkdir(parents=True)
    (folder / "model_meta.json").write_text(json.dumps({"name": "diffusion_embedder/m", "revision": "0123456789"}))
    for task, splits in FOLLOWIR_SPLITS.items():
        og_metric = result_table.OG_METRIC.get(task, result_table.OG_DEFAULT)
        scores = {split: [{"hf_subset": "default", "languages": ["eng-Latn"], "main_score": p_mrr, "p-MRR": p_mrr,
                           "og": {og_metric: og, "ndcg_at_10": 0.0}, "changed": {og_metric: 0.0}}]
                  for split, (p_mrr, og) in splits.items()}
        (folder / f"{task}.json").write_text(json.dumps({
            "dataset_revision": "r", "task_name": task, "mteb_version": mteb.__version__, "scores": scores,
            "evaluation_time": 1.0, "kg_co2_emissions": None}))


def test_followir_columns_are_the_mean_over_the_task_s_splits(tmp_path):
    write_followir_results(tmp_path / "results" / "m" / "0123456789")
    markdown, table = report.write_report([str(tmp_path / "results")])
    (model,) = table.models
    rows = {task: values[0] for _, task, values in table.rows()}
    hand_average = 0.0
    for task, splits in FOLLOWIR_SPLITS.items():
        (p_test, og_test), (p_dev, og_dev) = splits["test"], splits["dev"]
        hand_main, hand_og = 100 * (p_test + p_dev) / 2, 100 * (og_test + og_dev) / 2  # exact in binary
        og_label = f"og {result_table.OG_METRIC.get(task, result_table.OG_DEFAULT)}"
        assert table.scores[model][task] == hand_main and rows[task] == hand_main, task
        assert table.details[model][(task, og_label)] == hand_og and rows[f"{task} ({og_label})"] == hand_og, task
        assert f"| followir | {task} | p-MRR | {hand_main:.2f} |" in markdown
        assert f"| followir | {task} ({og_label}) |  | {hand_og:.2f} |" in markdown
        hand_average += hand_main / len(FOLLOWIR_SPLITS)
    assert rows["Average"] == pytest.approx(hand_average, rel=1e-15)  # the p-MRR columns only, not og
    assert f"| followir | **Average** |  | {hand_average:.2f} |" in markdown


# ------------------------------------------------------------------ a result missing some of its task's splits
#: LEMBPasskeyRetrieval's main score per length split (all of mteb's eval_splits for it), exact in binary.
PASSKEY_SPLITS = dict(zip([f"test_{n}" for n in (256, 512, 1024, 2048, 4096, 8192, 16384, 32768)],
                          (1.0, 1.0, 0.75, 0.5, 0.5, 0.25, 0.0, 0.0), strict=True))


def write_passkey_result(folder, name: str, splits: dict[str, float]):
    """A model folder with a LEMBPasskeyRetrieval result holding ``splits`` (mteb's format); returns the file."""
    import mteb

    folder.mkdir(parents=True)
    (folder / "model_meta.json").write_text(json.dumps({"name": name, "revision": "r"}))
    scores = {split: [{"hf_subset": "default", "languages": ["eng-Latn"], "main_score": v, "ndcg_at_1": v}]
              for split, v in splits.items()}
    file = folder / "LEMBPasskeyRetrieval.json"
    file.write_text(json.dumps({"dataset_revision": "r", "task_name": "LEMBPasskeyRetrieval",
                                "mteb_version": mteb.__version__, "scores": scores, "evaluation_time": 1.0,
                                "kg_co2_emissions": None}))
    return file


def test_a_result_missing_some_of_the_task_s_splits_is_missing_not_averaged(tmp_path, capsys, caplog):
    """mteb saves a result after each split: a passkey run that ran out of memory at 8192 tokens leaves the five
    shorter splits. Their mean (75.00) is no passkey score: the cell is empty, as a missing score's, and the log
    and ``--check`` name the file and the splits it lacks. All eight splits give their mean."""
    write_passkey_result(tmp_path / "full" / "results" / "full" / "r", "diffusion_embedder/full", PASSKEY_SPLITS)
    short = dict(list(PASSKEY_SPLITS.items())[:5])
    partial = write_passkey_result(tmp_path / "partial" / "results" / "p" / "r", "diffusion_embedder/partial", short)
    with caplog.at_level("WARNING", logger=report.logger.name):
        markdown, table = report.write_report([str(tmp_path / "full"), str(tmp_path / "partial")])
    assert table.scores == {"diffusion_embedder/full@r": {"LEMBPasskeyRetrieval": 50.0},  # 100 * 4.0 / 8
                            "diffusion_embedder/partial@r": {}}
    assert "| longembed | LEMBPasskeyRetrieval | nDCG@1 | 50.00 |  |" in markdown
    lacking = "test_8192, test_16384, test_32768"
    assert str(partial) in caplog.text and lacking in caplog.text
    assert report.main([str(tmp_path / "full"), "--check"]) == 0
    assert "Every result file reads" in capsys.readouterr().out
    assert report.main([str(tmp_path / "partial"), "--check"]) == 1
    printed = capsys.readouterr().out
    assert str(partial) in printed and lacking in printed and "1 unreadable or incomplete" in printed


# ------------------------------------------------------------------ what makes two result files one column and row
RUN = "diffusion_embedder/run-checkpoint-1000"
HAND_TASK = "HandRetrieval"


def write_result(folder, *, revision: str = "checkpoint-1000", data: str = "data-1", score: float = 0.375,
                 experiment: dict | None = None, weights: str | None = "w1", instruction: str | None = "Find it:",
                 metric: str | None = "ndcg_at_10"):
    """One model folder as ``run.py`` leaves it, written by hand: ``model_meta.json``, one task result (mteb's
    format), and the ledger beside it (``identity.jsonl``; ``query_instructions.jsonl``, with the main score's
    metric) where given."""
    import mteb

    folder.mkdir(parents=True)
    meta = {"name": RUN, "revision": revision, **({"experiment_kwargs": experiment} if experiment else {})}
    (folder / "model_meta.json").write_text(json.dumps(meta))
    scores = {"test": [{"hf_subset": "default", "languages": ["eng-Latn"], "main_score": score, "ndcg_at_10": score}]}
    (folder / f"{HAND_TASK}.json").write_text(json.dumps({
        "dataset_revision": data, "task_name": HAND_TASK, "mteb_version": mteb.__version__, "scores": scores,
        "evaluation_time": 1.0, "kg_co2_emissions": None}))
    if weights is not None:
        (folder / results.IDENTITY_FILE).write_text(json.dumps({"weights": weights, "settings": {"pooling": "mean"}}))
    if instruction is not None:
        record = {"task": HAND_TASK, "query_instruction": instruction, **({"main_score": metric} if metric else {})}
        (folder / results.INSTRUCTIONS_FILE).write_text(json.dumps(record) + "\n")
    return folder


def report_of(tmp_path, capsys, *folders) -> tuple[int, str, str]:
    """``report`` on the folders: its exit status, what it printed, and what it wrote to stderr."""
    code = report.main([*map(str, folders), "--out_dir", str(tmp_path / "report")])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_copied_result_is_one_column_and_row(tmp_path, capsys):
    write_result(tmp_path / "a" / "results" / "run" / "checkpoint-1000")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    code, out, _ = report_of(tmp_path, capsys, tmp_path / "a", tmp_path / "b")
    assert code == 0
    assert f"| local | {HAND_TASK} | nDCG@10 | 37.50 |\n" in out  # one column: one value in the row
    assert out.count(f"`{RUN}@") == 1


@pytest.mark.parametrize("other, named", [
    ({"data": "data-2"}, "data revision"),
    ({"weights": "w2"}, "weights and settings (identity.jsonl)"),
    ({"weights": None}, "weights and settings (identity.jsonl)"),
    ({"instruction": "Find the other:"}, "query instruction (query_instructions.jsonl)"),
    ({"instruction": None}, "query instruction (query_instructions.jsonl)"),
], ids=["data revision", "weights", "weights not recorded", "instruction", "instruction not recorded"])  # fmt: skip
def test_equal_scores_from_different_data_or_weights_or_instructions_are_not_merged(tmp_path, capsys, other, named):
    """Two results for one checkpoint, experiment and task with equal scores are still two results when their data
    revision, the weights recorded beside them or the query instruction they were scored with differ (or are
    recorded beside one only): the report stops (exit 2, no traceback) naming both files and what differs, and
    writes nothing."""
    first = write_result(tmp_path / "a" / "results" / "run" / "checkpoint-1000")
    second = write_result(tmp_path / "b" / "results" / "run" / "checkpoint-1000", **other)
    code, out, err = report_of(tmp_path, capsys, tmp_path / "a", tmp_path / "b")
    assert code == 2 and "Traceback" not in err and out == ""
    assert "Two different results" in err and f"differ in their {named};" in err, err
    for folder in (first, second):
        assert str(folder / f"{HAND_TASK}.json") in err
    assert not (tmp_path / "report").exists()


@pytest.mark.parametrize("second, headers", [
    ({"revision": "checkpoint-2000"}, "run-checkpoint-1000@checkpoint-1000 | run-checkpoint-1000@checkpoint-2000"),
    ({"experiment": {"top_k": 200}}, "run-checkpoint-1000 | run-checkpoint-1000 (top_k=200)"),
], ids=["revision", "experiment"])  # fmt: skip
def test_other_revisions_or_experiments_with_equal_scores_are_two_columns(tmp_path, capsys, second, headers):
    """Another revision (even one sharing its first characters) or another experiment is another column, each with
    its own score, however equal, and a header of its own."""
    write_result(tmp_path / "a" / "results" / "run" / "checkpoint-1000")
    write_result(tmp_path / "b" / "results" / "run" / "other", **second)
    code, out, _ = report_of(tmp_path, capsys, tmp_path / "a", tmp_path / "b")
    assert code == 0
    assert f"| local | {HAND_TASK} | nDCG@10 | 37.50 | 37.50 |\n" in out
    assert out.count(f"`{RUN}@") == 2
    assert out.startswith(f"| benchmark | task | metric | {headers} |\n")


def test_a_local_result_whose_metric_is_not_recorded_is_labelled_main_score(tmp_path, capsys):
    """An older version recorded no metric beside a local task's result: its main score equals its nDCG@10 here,
    yet the label says only "main score", never a metric guessed from equal values."""
    write_result(tmp_path / "a" / "results" / "run" / "checkpoint-1000", metric=None)
    code, out, _ = report_of(tmp_path, capsys, tmp_path / "a")
    assert code == 0 and f"| local | {HAND_TASK} | main score | 37.50 |\n" in out
