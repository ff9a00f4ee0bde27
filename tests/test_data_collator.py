"""ContrastiveCollator: columns, negative layouts, and the upstream training strings through the real Encoder."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import LLAMA_FIXTURE

from diffusion_embedder.data import MSMARCO, ContrastiveCollator, ReasonAug, TrainSample
from diffusion_embedder.templates import SEPARATOR

DATA = Path(__file__).parent / "fixtures" / "data"


class RecordingTokenizer:
    """Stand-in tokenize: remembers each call and encodes texts as their lengths."""

    def __init__(self):
        self.calls: list[list[list[str]]] = []

    def __call__(self, pairs):
        self.calls.append(pairs)
        return {"input_ids": torch.tensor([[len(i), len(t)] for i, t in pairs])}


def samples(k: int) -> list[TrainSample]:
    return [
        TrainSample(
            query=("inst;", f"q{b}"),
            positive=("", f"p{b}"),
            negatives=[("", f"n{b}-{j}") for j in range(k)],
            group="g",
        )
        for b in range(3)
    ]


def test_columns_and_sample_major_negatives():
    tok = RecordingTokenizer()
    batch = ContrastiveCollator(tok, num_negatives=2)(samples(3))
    assert tok.calls == [
        [["inst;", "q0"], ["inst;", "q1"], ["inst;", "q2"]],
        [["", "p0"], ["", "p1"], ["", "p2"]],
        [["", "n0-0"], ["", "n0-1"], ["", "n1-0"], ["", "n1-1"], ["", "n2-0"], ["", "n2-1"]],
    ]
    assert set(batch) == {"query", "positive", "negatives"}
    assert batch["query"]["input_ids"].tolist() == [[5, 2]] * 3
    assert batch["negatives"]["input_ids"].shape == (6, 2)  # B * K rows: one shape for any K


def test_no_negatives_and_too_few():
    batch = ContrastiveCollator(RecordingTokenizer(), num_negatives=0)(samples(1))
    assert set(batch) == {"query", "positive"}
    with pytest.raises(ValueError, match="a sample of group 'g' has 1 negative\\(s\\), the collator needs 2"):
        ContrastiveCollator(RecordingTokenizer(), num_negatives=2)(samples(1))
    with pytest.raises(ValueError, match="empty batch"):
        ContrastiveCollator(RecordingTokenizer())([])
    with pytest.raises(TypeError, match="Encoder or a callable"):
        ContrastiveCollator(42)


@pytest.fixture(scope="module")
def encoder():
    from diffusion_embedder import Encoder

    return Encoder.from_pretrained(str(LLAMA_FIXTURE), torch_dtype=torch.float32, max_length=64)


def test_real_encoder_matches_upstream_training_strings(encoder):
    ds = ReasonAug(DATA / "reasonaug.jsonl", domain="math")
    batch_samples = [ds[i] for i in range(4)]
    batch = ContrastiveCollator(encoder, num_negatives=1)(batch_samples)
    # The fork built "<task>; " + separator + text for queries and separator + text for documents.
    upstream_queries = [f"{s.query[0][:-1]}; {SEPARATOR}{s.query[1]}" for s in batch_samples]
    upstream_negatives = [f"{SEPARATOR}{s.negatives[0][1]}" for s in batch_samples]
    for got, strings in ((batch["query"], upstream_queries), (batch["negatives"], upstream_negatives)):
        want = encoder.tokenize(strings)
        assert set(got) == {"input_ids", "attention_mask", "embed_mask"}
        for key in want:
            assert torch.equal(got[key], want[key]), key
    assert batch["query"]["input_ids"].shape[1] <= 64
    with torch.no_grad():
        emb = encoder(batch["query"])
    assert emb.shape == (4, encoder.embedding_dim) and torch.isfinite(emb).all()


def test_real_encoder_stacked_msmarco_negatives(encoder):
    ds = MSMARCO(DATA / "msmarco" / "train.jsonl", seed=0)
    batch = ContrastiveCollator(encoder, num_negatives=15)([ds[0], ds[1]])
    stacked = batch["negatives"]
    assert stacked["input_ids"].shape[0] == 30
    one = encoder.tokenize([list(n) for n in ds[1].negatives])
    # Row 15 + j is sample 1's j-th negative; compare unpadded token ids (left padding).
    for j in range(15):
        row = stacked["input_ids"][15 + j][stacked["attention_mask"][15 + j].bool()]
        ref = one["input_ids"][j][one["attention_mask"][j].bool()]
        assert torch.equal(row, ref)
