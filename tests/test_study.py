"""The study in reduced form: from one random init, a causal LM (clm) and a masked-diffusion LM (mdm), pretrained
by the real LM stage on the same shipped ReasonAug text with the same token budget, both beat their random init
on held-out ReasonAug text (same masks for both models); the study's table names arms near chance."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from study import heldout_lm_loss, plot, study_table
from tiny_runs import HELDOUT_SPLIT, TRAIN_SPLIT, corpus_texts, read_jsonl_gz

from diffusion_embedder.training import lm

ROOT = Path(__file__).resolve().parents[1]
INIT = ROOT / "tests" / "fixtures" / "dream_reference"  # random weights, Dream format, its own BPE


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("study")
    texts = corpus_texts(read_jsonl_gz(TRAIN_SPLIT)[:150])
    with open(out / "text.jsonl", "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    common = [
        "--model_name_or_path", str(INIT), "--train_file", json.dumps([str(out / "text.jsonl")]),
        "--output_dir", str(out), "--max_steps", "40", "--save_steps", "40", "--max_seq_length", "64",
        "--per_device_train_batch_size", "8", "--learning_rate", "0.003", "--warmup_steps", "4",
    ]  # fmt: skip
    folders = {}
    for objective in ("clm", "mdm"):
        args = [str(ROOT / "train_configs" / "study" / "pretrain.json"), *common, "--objective", objective]
        assert lm.main([*args, "--experiment_id", objective]) == 0
        folders[objective] = out / objective
    return folders


@pytest.mark.parametrize("objective", ["clm", "mdm"])
def test_pretrained_arm_beats_its_random_init(pretrained, objective):
    heldout = corpus_texts(read_jsonl_gz(HELDOUT_SPLIT)[:40])
    before = heldout_lm_loss(INIT, objective, heldout, max_seq_length=64, max_blocks=16)
    after = heldout_lm_loss(pretrained[objective], objective, heldout, max_seq_length=64, max_blocks=16)
    assert after < before - 0.5, (objective, before, after)
    config = json.loads((pretrained[objective] / "config.json").read_text())
    assert config["model_type"] == "Dream"  # full weights, in the base's format
    assert (pretrained[objective] / "model.safetensors").is_file()


def test_study_table_and_chart_report_arms_near_chance(tmp_path):
    row = {"lm": "clm", "bidirectional": False, "untrained": {"ndcg_at_10": 0.02, "recall_at_100": 0.3},
           "trained": {"ndcg_at_10": 0.05, "recall_at_100": 0.4}, "chance_loss": 4.159}  # fmt: skip
    table = study_table({"a": {**row, "final_loss": 4.1}, "b": {**row, "final_loss": 1.2}})
    lines = table.splitlines()
    assert "near chance, did not learn" in lines[2] and "near chance" not in lines[3]
    assert lines[3].startswith("| b | clm | causal | 2.00 | 5.00 | 30.00 | 40.00 | 1.200 (4.159) |")
    plot({"a": {**row, "final_loss": 4.1}, "b": {**row, "final_loss": 1.2}}, tmp_path / "study.png")
    assert (tmp_path / "study.png").stat().st_size > 1000
