"""Padding-free training: packed columns give the padded path's losses and gradients, direct and GradCache."""

from __future__ import annotations

import pytest
from conftest import randomize_lora_b
from test_training_trainer import PAIRS, assert_same, make_config, make_trainer, step_grads

from diffusion_embedder.data import ContrastiveCollator
from diffusion_embedder.training import supervised
from diffusion_embedder.training.arguments import ConfigError


@pytest.mark.parametrize("negatives", [1, 2])
def test_packed_training_step_equals_padded(tmp_path, negatives):
    trainer = make_trainer(tmp_path, lora_dropout=0.0)
    randomize_lora_b(trainer.model, 0.05)
    samples = [trainer.train_dataset[i] for i in range(6)]
    for sample in samples:
        sample.negatives = (sample.negatives * negatives)[:negatives]
    packed = ContrastiveCollator(trainer.model, num_negatives=negatives, pack_length=64)(samples)
    assert packed["positive"]["input_ids"].shape[0] < len(samples)  # several texts share a row
    padded = ContrastiveCollator(trainer.model, num_negatives=negatives)(samples)
    direct = step_grads(trainer, padded, None)
    assert_same(step_grads(trainer, packed, None), direct)
    assert_same(step_grads(trainer, packed, 4), direct)  # GradCache packs each chunk again


def test_pack_length_setting_reaches_the_collator(tmp_path, monkeypatch):
    class Built(Exception):
        pass

    seen = {}

    def trainer(**kwargs):
        seen.update(kwargs)
        raise Built

    monkeypatch.setattr(supervised, "EncoderTrainer", trainer)
    with pytest.raises(Built):
        supervised.train(make_config(tmp_path, dataset_file_path=str(PAIRS), pack_length=96))
    assert seen["data_collator"].pack_length == 96
    with pytest.raises(ConfigError, match="pack_length: must be >= 1, got 0"):
        make_config(tmp_path, pack_length=0)
    with pytest.raises(ValueError, match="pack_length must be an integer >= 1"):
        ContrastiveCollator(lambda pairs: {}, pack_length=0)


def test_checkpointing_flag_reaches_the_model_on_either_transformers_spelling(tmp_path):
    """5.23 says activation_checkpointing, 5.17 (the GPU machines) gradient_checkpointing: both reach the model."""
    from diffusion_embedder.training.supervised import prepare_encoder

    cfg = make_config(tmp_path, gradient_checkpointing=True)
    encoder = prepare_encoder(cfg.model, cfg.custom, cfg.training)
    assert encoder.model.base_model.model.is_gradient_checkpointing
    assert not cfg.training.gradient_checkpointing  # done on the inner model, not by the Trainer
    plain = make_config(tmp_path)
    plain_encoder = prepare_encoder(plain.model, plain.custom, plain.training)
    assert not plain_encoder.model.base_model.model.is_gradient_checkpointing
