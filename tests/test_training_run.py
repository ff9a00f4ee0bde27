"""End to end: torchrun --nproc_per_node=2 on CPU (gloo) with the tiny config; checkpoints (kill and resume:
test_faults_training.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffusion_embedder import Encoder
from diffusion_embedder.training.checkpoints import COMPLETE_MARKER, TRAINABLE_WEIGHTS


@pytest.fixture(scope="module")
def full_run(tiny_full_run) -> Path:
    return tiny_full_run


def test_two_process_run_trains_and_checkpoints(full_run):
    assert sorted(p.name for p in full_run.glob("checkpoint-*")) == ["checkpoint-10", "checkpoint-20"]
    state = json.loads((full_run / "checkpoint-20" / "trainer_state.json").read_text())
    losses = [entry["loss"] for entry in state["log_history"] if "loss" in entry]
    assert len(losses) == 10
    assert sum(losses[-3:]) / 3 < 0.5 * sum(losses[:3]) / 3, losses
    assert all("learning_rate" in e for e in state["log_history"] if "loss" in e)
    # global batch = 4 per device x 2 ranks: 96 samples -> 12 steps per epoch
    assert state["log_history"][0]["epoch"] == pytest.approx(2 / 12)
    for step in (10, 20):
        assert (full_run / f"checkpoint-{step}" / COMPLETE_MARKER).is_file()


def test_checkpoint_reloads_with_training_settings_and_encodes(full_run):
    checkpoint = full_run / "checkpoint-20"
    encoder = Encoder.from_pretrained(str(checkpoint), device="cpu")
    assert (encoder.config.max_length, encoder.config.pooling_mode) == (64, "mean")
    assert encoder.config.enable_bidirectional and encoder.config.skip_instruction is False
    trained = load_file(checkpoint / TRAINABLE_WEIGHTS)
    loaded = dict(encoder.named_parameters())
    assert trained and all(torch.equal(loaded[name].detach(), value) for name, value in trained.items())
    texts = [["Retrieve the sentence that answers the riddle;", "I am red and I am an apple."], "The red apple."]
    vectors = encoder.encode(texts, show_progress_bar=False)
    assert vectors.shape == (2, 64) and torch.isfinite(vectors).all()
    final = Encoder.from_pretrained(str(full_run), device="cpu").encode(texts, show_progress_bar=False)
    torch.testing.assert_close(vectors, final)  # the run folder holds the last step's encoder


def test_tensorboard_logs_loss_and_learning_rate(full_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events_dir,) = {p.parent for p in (full_run / "runs").rglob("events.out.tfevents.*")}
    events = EventAccumulator(str(events_dir))
    events.Reload()
    assert {"train/loss", "train/learning_rate"} <= set(events.Tags()["scalars"])
    assert len(events.Scalars("train/loss")) == 10
