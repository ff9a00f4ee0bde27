"""Padding-free training: packed columns give the padded path's losses and gradients, direct and GradCache."""

from __future__ import annotations

import pytest
import torch
from conftest import randomize_lora_b
from numerics import ORDER_EPS, assert_close_normwise
from test_training_trainer import PAIRS, assert_same, make_config, make_trainer, step_grads

from diffusion_embedder import packed_chunks
from diffusion_embedder.data import ContrastiveCollator, TrainSample
from diffusion_embedder.training import supervised
from diffusion_embedder.training.arguments import ConfigError
from diffusion_embedder.training.grad_cache import split_features
from diffusion_embedder.training.trainer import text_columns


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
    with pytest.raises(ValueError, match="pack_length: must be >= 1, got 0"):
        ContrastiveCollator(lambda pairs: {}, pack_length=0)
    for bad, message in (({"pack_length": True}, r"pack_length: True \(bool\) is not of type"),
                         ({"chunk_size": 0}, "chunk_size: must be >= 1, got 0"),
                         ({"num_negatives": -1}, "num_negatives: must be >= 0, got -1")):
        with pytest.raises(ValueError, match=message):
            ContrastiveCollator(lambda pairs: {}, **bad)


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


#: Texts whose chunks of two, packed in rows of ``UNEVEN_PACK`` tokens, differ in shape: chunk 0 is the widest (a
#: text longer than a row gets a row of its own), chunk 1 spans two rows narrower than chunk 0's, chunk 2 shares one
#: row (the column's other rows are padding), and with 5 samples the last chunk holds one text (an empty slot).
UNEVEN_TEXTS = [
    "A long passage that gets a row of its own because it is longer than a packed row, " * 2,
    "Hi.",
    "Twelve-ish tokens of text here, ok",
    "Another text of a similar size, ok",
    "x",
    "a middle one",
    "The one text of the last chunk, of a few tokens",
]
UNEVEN_PACK = 20


def uneven_samples(rows: int) -> list[TrainSample]:
    """Queries, positives and negatives drawn from ``UNEVEN_TEXTS`` at different strides, so every column mixes
    long and short texts in different chunk layouts."""
    text = lambda i: UNEVEN_TEXTS[i % len(UNEVEN_TEXTS)]  # noqa: E731
    return [TrainSample(query=("Retrieve the passage;", text(i)), positive=("", text(i + 2)),
                        negatives=[("", text(3 * i + 1))]) for i in range(rows)]  # fmt: skip


@pytest.mark.parametrize("attn", ["sdpa", "varlen"])
def test_packed_grad_cache_chunks_of_different_widths_train_as_padded(tmp_path, attn):
    """A column packed chunk by chunk at collation, with chunks that span several rows and are narrower than the
    widest (each chunk's own rows must be re-laid into the column's wider rows), trains as the padded batch: each
    chunk's embeddings are the padded ones of its texts, and the GradCache step's loss and gradients are the
    direct padded step's. ``varlen`` reads each chunk's own offsets, ``sdpa`` its segment ids."""
    trainer = make_trainer(tmp_path, lora_dropout=0.0, attn_implementation=attn)
    randomize_lora_b(trainer.model, 0.05)
    samples = uneven_samples(5)
    chunked = ContrastiveCollator(trainer.model, num_negatives=1, pack_length=UNEVEN_PACK, chunk_size=2)(samples)
    padded = ContrastiveCollator(trainer.model, num_negatives=1)(samples)
    query_chunks = [trainer.model.tokenize([list(s.query) for s in samples[i : i + 2]], pack_length=UNEVEN_PACK)
                    for i in range(0, 5, 2)]  # fmt: skip
    shapes = [tuple(c["input_ids"].shape) for c in query_chunks]  # (rows, width) of each chunk packed alone
    widest = max(w for _, w in shapes)
    assert any(r > 1 and w < widest for r, w in shapes), shapes  # the case under test: re-laid rows
    assert chunked["query"]["input_ids"].shape[1] == widest
    columns, padded_columns = text_columns(chunked)[0], text_columns(padded)[0]
    trainer.model.eval()
    with torch.no_grad():
        for name, column, reference in zip(("query", "positive", "negatives"), columns, padded_columns, strict=True):
            chunks = split_features(column, 2)
            assert packed_chunks.CHUNKS_KEY in chunks[0]  # cut by shape, not packed again
            embedded = torch.cat([trainer.model(c) for c in chunks])
            assert_close_normwise(embedded, trainer.model(reference), eps_multiple=ORDER_EPS, rows=True, msg=name)
    trainer.model.train()
    assert_same(step_grads(trainer, chunked, 2), step_grads(trainer, padded, None))
