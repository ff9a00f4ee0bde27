"""A small run of the demo: the real training (torchrun, 2 CPU processes) and evaluation paths."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from diffusion_embedder.demo import (
    HELDOUT_SPLIT,
    TRAIN_SPLIT,
    DemoSettings,
    build_heldout_task,
    read_jsonl_gz,
    run_demo,
)


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
    # The arm that should learn (bidirectional) gains a clear margin on unseen concepts, both scored with the same
    # encoder settings (one run measured nDCG@10 29.9 -> 34.7 and Recall@100 62.6 -> 74.8; with lr 1e-9 both stay).
    before, after = scores["bidirectional-untrained"], scores["bidirectional-trained"]
    assert after["ndcg_at_10"] >= before["ndcg_at_10"] + 0.025, (before, after)
    assert after["recall_at_100"] >= before["recall_at_100"] + 0.06, (before, after)
    # The table reports each arm's final training loss next to chance, ln(2 x 32 candidates).
    for arm in ("bidirectional", "causal"):
        assert scores[f"{arm}-trained"]["chance_loss"] == pytest.approx(math.log(64))
        assert 0 < scores[f"{arm}-trained"]["final_loss"] < 20
    assert "final train loss (chance)" in (tmp_path / "report" / "demo.md").read_text()
    report = tmp_path / "report"
    assert (report / "demo.md").exists() and (report / "demo.csv").exists()
    assert list(report.glob("*.png"))
    for arm in ("bidirectional", "causal"):
        config = json.loads((tmp_path / "checkpoints" / arm / "encoder_config.json").read_text())
        assert config["enable_bidirectional"] == (arm == "bidirectional")
