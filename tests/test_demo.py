"""A small run of the demo: the real training (torchrun, 2 CPU processes) and evaluation paths."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from demo import DemoSettings, run_demo
from tiny_runs import HELDOUT_SPLIT, TRAIN_SPLIT, build_heldout_task, learned, read_jsonl_gz


def test_heldout_task_never_shares_a_concept_with_training(tmp_path):
    train_concepts = {r["instance"] for r in read_jsonl_gz(TRAIN_SPLIT)}
    records = read_jsonl_gz(HELDOUT_SPLIT)
    stats = build_heldout_task(records, tmp_path, max_queries=50, seed=0)
    assert stats["queries"] == 50 and stats["documents"] > 100
    assert not train_concepts & {r["instance"] for r in records}
    qrels = (tmp_path / "qrels" / "test.tsv").read_text().splitlines()[1:]
    assert {line.split("\t")[0] for line in qrels} == {f"q{i}" for i in range(50)}
    corpus = {json.loads(line)["_id"] for line in (tmp_path / "corpus.jsonl").open()}
    assert {line.split("\t")[1] for line in qrels} <= corpus


def test_training_raises_ndcg_on_heldout_concepts(tmp_path: Path):
    settings = DemoSettings(tmp_path, max_queries=100, max_steps=60)
    scores = run_demo(settings)
    assert set(scores) == {"bidirectional-untrained", "bidirectional-trained", "causal-untrained", "causal-trained"}
    # Both arms learn their training task (final loss clearly below chance, ln(2 x 32 candidates)) and carry it to
    # unseen concepts: Recall@100 rises by a clear margin, both scored with the same encoder settings (one run of
    # this reduced form measured bidirectional 62.6 -> 84.8 and causal 34.5 -> 56.2, final losses 3.40 and 3.30).
    for arm in ("bidirectional", "causal"):
        before, after = scores[f"{arm}-untrained"], scores[f"{arm}-trained"]
        assert after["chance_loss"] == pytest.approx(math.log(64))
        assert learned(after["final_loss"], after["chance_loss"]), (arm, after)
        assert after["recall_at_100"] >= before["recall_at_100"] + 0.10, (arm, before, after)
    assert "final train loss (chance)" in (tmp_path / "report" / "demo.md").read_text()
    report = tmp_path / "report"
    assert (report / "demo.md").exists() and (report / "demo.csv").exists()
    assert list(report.glob("*.png"))
    for arm in ("bidirectional", "causal"):
        config = json.loads((tmp_path / "checkpoints" / arm / "encoder_config.json").read_text())
        assert config["enable_bidirectional"] == (arm == "bidirectional")
