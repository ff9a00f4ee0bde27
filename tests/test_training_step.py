"""What the training step's throughput relies on, checked on the CPU: the contrastive stages never build an
LM head, the NaN check is one reduction on the rank's device (NCCL takes no CPU tensor), and the GPU mode
of bench/train.py runs (dry run: tiny shape, float32)."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
from conftest import ROOT
from test_training_trainer import make_trainer
from torch import nn

from diffusion_embedder.training import trainer as trainer_module
from diffusion_embedder.training.trainer import RunTrainer


def test_contrastive_stage_builds_no_lm_head(tmp_path):
    encoder = make_trainer(tmp_path).model
    vocab = encoder.model.config.vocab_size
    assert not any("lm_head" in name for name, _ in encoder.named_parameters())
    assert not any(isinstance(m, nn.Linear) and m.out_features == vocab for m in encoder.modules())


def reductions(monkeypatch) -> list[torch.Tensor]:
    """Pretend a process group is up; record what the NaN check reduces."""
    seen: list[torch.Tensor] = []
    monkeypatch.setattr(trainer_module.dist, "is_available", lambda: True)
    monkeypatch.setattr(trainer_module.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(trainer_module.dist, "all_reduce", lambda tensor, op=None: seen.append(tensor.clone()))
    return seen


def check_reduces_on_the_ranks_device(trainer: RunTrainer, monkeypatch) -> None:
    seen = reductions(monkeypatch)
    device = trainer.args.device
    trainer.check_finite(torch.tensor(1.5, device=device))
    trainer.check_trainable_finite()
    assert [(t.device, t.shape, t.item()) for t in seen] == [(device, (1,), 0.0)] * 2


def test_nan_check_is_one_reduction_on_the_ranks_device(tmp_path, monkeypatch):
    check_reduces_on_the_ranks_device(make_trainer(tmp_path), monkeypatch)


def test_bench_train_gpu_mode_dry_run():
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    command = [sys.executable, str(ROOT / "bench" / "train.py"), "--gpu", "--dry-run", "--quick"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    table = [line for line in done.stdout.splitlines() if line.startswith("| ") and "configuration" not in line]
    assert len(table) == 4 and not any("failed" in line for line in table), done.stdout[-3000:]
    assert "peak memory, GradCache 32 vs 8 triples" in done.stdout
