"""Text for the LM stages (local files and the datasets path), blocks, the Wiki1M reader, and the registries."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from diffusion_embedder.data import DATASET_READERS, DataFormatError, Wiki1M, load_text_blocks, read_texts
from diffusion_embedder.data.text import TextBlocks, group_into_blocks
from diffusion_embedder.losses import HardNegativeNLLLoss, RepllamaLoss, loss_from_config
from diffusion_embedder.training.arguments import validate
from diffusion_embedder.training.supervised import build_dataset

FIXTURES = Path(__file__).parent / "fixtures"


def test_local_text_and_jsonl_files_plain_or_gzipped(tmp_path):
    (tmp_path / "a.txt").write_text("first line\n\n  \nsecond line\n")
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.write(json.dumps({"body": "third"}) + "\n\n" + json.dumps({"body": "fourth"}) + "\n")
    texts = read_texts(train_files=[str(tmp_path / "a.txt")])
    assert texts == ["first line", "second line"]
    assert read_texts(train_files=[str(tmp_path / "b.jsonl.gz")], text_column="body") == ["third", "fourth"]


def test_bad_text_files_name_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(DataFormatError, match=r"bad.jsonl:2: not valid JSON"):
        read_texts(train_files=[str(bad)])
    bad.write_text('{"text": "ok"}\n{"body": "x"}\n')
    with pytest.raises(DataFormatError, match=r"bad.jsonl:2: no string field 'text'"):
        read_texts(train_files=[str(bad)])
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        read_texts(train_files=[str(tmp_path / "missing.txt")])
    with pytest.raises(ValueError, match="either dataset_name"):
        read_texts()


def test_hub_path_reads_a_dataset_in_wikitexts_layout(tmp_path):
    """The hub branch is ``datasets.load_dataset``; a local folder of parquet shards is the same format."""
    from datasets import Dataset

    folder = tmp_path / "wikitext"
    folder.mkdir()
    Dataset.from_dict({"text": ["", " = Title = \n", " Some text .\n"]}).to_parquet(folder / "train-00000.parquet")
    assert read_texts(dataset_name=str(folder)) == [" = Title = \n", " Some text .\n"]
    with pytest.raises(DataFormatError, match="no column 'body'"):
        read_texts(dataset_name=str(folder), text_column="body")


def test_blocks_concatenate_texts_and_drop_the_remainder():
    assert group_into_blocks([[1, 2, 3], [4], [5, 6, 7, 8, 9]], 4) == [[1, 2, 3, 4], [5, 6, 7, 8]]
    blocks = TextBlocks([[i, i] for i in range(10)], seed=3)
    assert sorted(blocks.blocks[:, 0].tolist()) == list(range(10)) and blocks.blocks[:, 0].tolist() != list(range(10))
    assert torch.equal(blocks.blocks, TextBlocks([[i, i] for i in range(10)], seed=3).blocks)
    with pytest.raises(DataFormatError, match="no complete block"):
        TextBlocks([])


def test_text_blocks_are_the_tokenizers_stream_with_special_tokens():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(FIXTURES / "llm2vec_parity" / "llama")
    texts = ["The red apple is on the table.", "A second, longer sentence about a green pear and a plum."] * 3
    dataset = load_text_blocks(tokenizer, texts, max_seq_length=8, seed=0)
    stream = [t for text in texts for t in tokenizer(text)["input_ids"]]
    assert stream[0] == tokenizer.bos_token_id  # BOS per text, as run_mntp.py tokenizes
    assert dataset.blocks.shape == (len(stream) // 8, 8)
    expected = sorted(tuple(stream[i : i + 8]) for i in range(0, len(stream) - 7, 8))
    assert sorted(tuple(b) for b in dataset.blocks.tolist()) == expected


def test_wiki1m_is_registered_with_no_hard_negatives(tmp_path):
    path = tmp_path / "wiki1m_for_simcse.txt"
    path.write_text("YMCA in South Australia\n\nThe town lies on the river.\n")
    data = Wiki1M(path)
    assert [(s.query, s.positive, s.negatives) for s in data] == [
        (("", "YMCA in South Australia"),) * 2 + ([],),
        (("", "The town lies on the river."),) * 2 + ([],),
    ]
    cfg = validate(
        {
            "model_name_or_path": "x",
            "dataset_name": "Wiki1M",
            "dataset_file_path": str(path),
            "output_dir": str(tmp_path / "out"),
        }
    )
    dataset, negatives = build_dataset(cfg)
    assert negatives == 0 and len(dataset) == 2
    assert DATASET_READERS["Wiki1M"].negatives == 0


def test_reader_options_reach_the_reader(tmp_path):
    cfg = validate(
        {
            "model_name_or_path": "x",
            "dataset_name": "ReasonAug",
            "domain": "math",
            "aug_file_path": str(FIXTURES / "data" / "reasonaug.jsonl"),
            "output_dir": str(tmp_path),
        }
    )
    dataset, negatives = build_dataset(cfg)
    full, _ = build_dataset(validate({**cfg.values, "domain": "all"}))
    assert negatives == 1 and 0 < len(dataset) < len(full)
    with pytest.raises(ValueError, match="num_negatives=2: ReasonAug has 1"):
        build_dataset(validate({**cfg.values, "num_negatives": 2}))


def test_loss_options_come_from_the_registered_config_fields():
    hard = loss_from_config("HardNegativeNLLLoss", SimpleNamespace(loss_scale=20.0))
    assert isinstance(hard, HardNegativeNLLLoss) and hard.scale == 20.0
    settings = SimpleNamespace(scale_by_dim=False, in_batch_negatives=True, cross_device_negatives=True)
    repllama = loss_from_config("RepllamaLoss", settings)
    assert isinstance(repllama, RepllamaLoss)
    assert (repllama.scale_by_dim, repllama.in_batch_negatives, repllama.cross_device_negatives) == (False, True, True)
