"""End to end: torchrun --nproc_per_node=2 on CPU (gloo) with the tiny config; checkpoints; kill and resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffusion_embedder import Encoder
from diffusion_embedder.training.checkpoints import COMPLETE_MARKER, TRAINABLE_WEIGHTS

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "train_configs" / "tiny" / "custom.json"
RUN_ID = "tiny_custom"


def torchrun(output_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(ROOT / "experiments" / "run_supervised.py"),
        str(TINY),
        "--output_dir",
        str(output_dir),
        *overrides,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("full")
    torchrun(out)
    return out / RUN_ID


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


def test_killed_run_resumes_to_the_same_weights(full_run, tmp_path):
    torchrun(tmp_path, "--stop_after_n_steps", "10")
    run = tmp_path / RUN_ID
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-10"]
    # A kill while checkpoint-15 was being written leaves a folder without the completion marker.
    half = run / "checkpoint-15"
    half.mkdir()
    (half / "adapter_model.safetensors").write_bytes(b"truncated")
    result = torchrun(tmp_path, "--resume_from_checkpoint", "last")
    assert "Skipping" in result.stdout + result.stderr
    resumed = load_file(run / TRAINABLE_WEIGHTS)
    uninterrupted = load_file(full_run / TRAINABLE_WEIGHTS)
    assert resumed.keys() == uninterrupted.keys()
    for name, value in uninterrupted.items():
        torch.testing.assert_close(resumed[name], value, atol=1e-6, rtol=0, msg=name)
