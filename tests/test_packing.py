"""Padding-free (packed) batches: same embeddings as the padded path, no attention across texts, bounded rows."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import FAMILIES, LLAMA_FIXTURE, MIXED_TEXTS, default_attention
from numerics import HAND_EPS, ORDER_EPS, assert_close_normwise

from diffusion_embedder import Encoder, packed_chunks
from diffusion_embedder import packing as packing_mod
from diffusion_embedder.pooling import POOLING_MODES

TEXTS = MIXED_TEXTS
#: Small enough that rows hold several texts and the longest text gets a row of its own.
PACK_LENGTH = 48


def load(path, **kwargs) -> Encoder:
    return Encoder.from_pretrained(str(path), torch_dtype=torch.float32, **kwargs)


def with_pooling(encoder: Encoder, mode: str) -> Encoder:
    """The same backbone under another pooling mode (no reload)."""
    return Encoder(encoder.model, encoder.tokenizer, replace(encoder.config, pooling_mode=mode, eos_suffix=None))


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_equals_padded_for_every_pooling_mode(family_checkpoint, family):
    base = load(family_checkpoint(family), attn_implementation=default_attention(family))
    has_mask_token = getattr(base.model.config, "mask_token_id", None) is not None
    for mode in POOLING_MODES:
        if mode == "mask_token" and not has_mask_token:
            continue  # refused at construction for backbones without a mask token (tested in test_encoder)
        encoder = with_pooling(base, mode)
        padded = encoder.encode(TEXTS, batch_size=len(TEXTS), packing=False, show_progress_bar=False)
        packed = encoder.encode(TEXTS, max_tokens_per_batch=PACK_LENGTH, packing=True, show_progress_bar=False)
        assert_close_normwise(packed, padded, eps_multiple=ORDER_EPS, rows=True, msg=(family, mode))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("bidirectional", [True, False], ids=["bidirectional", "causal"])
def test_packed_equals_padded_per_attention_and_direction(attn, bidirectional):
    """Each implementation gets its own mask form (eager adds it to the scores); causal rows stay causal per text."""
    encoder = load(LLAMA_FIXTURE, attn_implementation=attn, enable_bidirectional=bidirectional)
    padded = encoder.encode(TEXTS, batch_size=2, packing=False, show_progress_bar=False)
    packed = encoder.encode(TEXTS, max_tokens_per_batch=PACK_LENGTH, packing=True, show_progress_bar=False)
    assert_close_normwise(packed, padded, eps_multiple=ORDER_EPS, rows=True, msg=(packed - padded).abs().max())
    one_row = encoder.encode(TEXTS, max_tokens_per_batch=10_000, packing=True, show_progress_bar=False)
    assert_close_normwise(one_row, padded, eps_multiple=ORDER_EPS, rows=True)


def test_no_attention_across_packed_texts():
    """A text's packed embedding equals the model run on that text alone, whatever shares its row."""
    encoder = load(LLAMA_FIXTURE, attn_implementation="sdpa")
    features = encoder.tokenize(TEXTS, pack_length=10_000)
    assert features["input_ids"].shape[0] == 1  # all texts in one row
    with torch.no_grad():
        packed = encoder(features)
        for i, text in enumerate(TEXTS):
            ids = encoder.tokenize([text])["input_ids"]
            hidden = encoder.model(input_ids=ids, use_cache=False).last_hidden_state[0]
            span = int(encoder.tokenize([text])["embed_mask"].sum())
            assert_close_normwise(packed[i], hidden[-span:].mean(0), eps_multiple=HAND_EPS, msg=i)


def test_pack_rows_and_features_layout():
    lengths = [5, 100, 7, 60, 3, 100, 20, 0]
    rows = packing_mod.pack_rows(lengths, 120)
    assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in r) <= 120 for r in rows)
    assert len(rows) == 3  # 100+20, 100+7+5+3(+0), 60
    assert packing_mod.pack_rows([500, 10], 64) == [[0], [1]]  # too long: a row of its own
    batches = packing_mod.plan_batches(lengths, 60, rows_per_batch=2)
    # rows of <= 60 tokens, fullest first, two per forward; each 100-token text is a forward of its own
    assert [sorted(lengths[i] for i in b) for b in batches] == [[0, 100], [100], [3, 5, 7, 20, 60]]
    one_row_each = packing_mod.plan_batches(lengths, 60, 1)
    assert [sorted(lengths[i] for i in b) for b in one_row_each][2:] == [[60], [3, 5, 7, 20]]
    for width, rows_per_batch, message in ((0, 1, "pack row length: must be >= 1, got 0"),
                                           (60, 0, "rows_per_batch: must be >= 1, got 0")):
        with pytest.raises(ValueError, match=message):
            packing_mod.plan_batches(lengths, width, rows_per_batch)

    features = packing_mod.pack([([11, 12, 13], 2), ([21], 1), ([31, 32], 0)], capacity=4, pad_token_id=0)
    assert features["input_ids"].tolist() == [[11, 12, 13, 21], [31, 32, 0, 0]]
    assert features["position_ids"].tolist() == [[0, 1, 2, 0], [0, 1, 0, 0]]
    assert features["segment_ids"].tolist() == [[0, 0, 0, 1], [2, 2, -3, -4]]
    assert features["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1], [0, 1, 1]]
    assert features["embed_mask"].tolist() == [[0, 1, 1], [0, 0, 1], [0, 0, 0]]
    flat = features["input_ids"].reshape(-1)
    assert flat[features["unpack_index"][0]].tolist() == [11, 12, 13]
    assert packing_mod.unpack_sequences(features) == [([11, 12, 13], 2), ([21], 1), ([31, 32], 0)]
    chunks = packed_chunks.split_packed(features, 2)
    assert [packing_mod.unpack_sequences(c) for c in chunks] == [[([11, 12, 13], 2), ([21], 1)], [([31, 32], 0)]]


def test_masks_per_attention_implementation():
    segments = torch.tensor([[0, 0, 1, -4]])
    boolean = packing_mod.MASK_BUILDERS["sdpa"](segments, False, torch.float32)
    assert boolean.dtype == torch.bool and boolean.shape == (1, 1, 4, 4)
    assert boolean[0, 0].int().tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]
    causal = packing_mod.MASK_BUILDERS["sdpa"](segments, True, torch.float32)
    assert causal[0, 0].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]
    additive = packing_mod.MASK_BUILDERS["eager"](segments, False, torch.bfloat16)
    assert additive.dtype == torch.bfloat16
    assert torch.equal(additive == 0, boolean)
    assert (additive[~boolean] == torch.finfo(torch.bfloat16).min).all()


def test_packing_choice_is_validated_and_auto_follows_the_table():
    encoder = load(LLAMA_FIXTURE, attn_implementation="sdpa")
    with pytest.raises(ValueError, match=r"packing: 'yes' \(str\) is not of type bool or 'auto'"):
        encoder.encode(TEXTS, packing="yes", show_progress_bar=False)
    with pytest.raises(ValueError, match="max_tokens_per_batch: must be >= 1, got 0"):
        encoder.encode(TEXTS, packing=True, max_tokens_per_batch=0, show_progress_bar=False)
    model = encoder.model
    assert packing_mod.use_packing("auto", model, "cpu", 10) is packing_mod.AUTO_PACKING[("cpu", "sdpa")]
    model.config._attn_implementation = "flash_attention_2"
    try:
        assert packing_mod.use_packing("auto", model, "cpu", 10) is False
        with pytest.raises(ValueError, match="flash_attention_2.*no packed path"):
            packing_mod.use_packing(True, model, "cpu", 10)
    finally:
        model.config._attn_implementation = "sdpa"


def test_auto_packing_reaches_encode(monkeypatch):
    """``packing`` decides which collation encode uses (packed features carry an unpack index)."""
    encoder = load(LLAMA_FIXTURE, attn_implementation="sdpa")
    seen = []
    forward = Encoder.forward

    def spy(self, features):
        seen.append(packing_mod.is_packed(features))
        return forward(self, features)

    monkeypatch.setattr(Encoder, "forward", spy)
    monkeypatch.setitem(packing_mod.AUTO_PACKING, ("cpu", "sdpa"), True)
    encoder.encode(TEXTS, show_progress_bar=False)
    monkeypatch.setitem(packing_mod.AUTO_PACKING, ("cpu", "sdpa"), False)
    encoder.encode(TEXTS, show_progress_bar=False)
    encoder.encode(TEXTS, packing=True, show_progress_bar=False)
    encoder.encode(TEXTS, packing=False, show_progress_bar=False)
    assert seen == [True, False, True, False]


def corpus(count: int) -> list[str]:
    import json

    from conftest import FIXTURES

    lines = (FIXTURES / "beir" / "reasonaug" / "corpus.jsonl").read_text().splitlines()
    return [json.loads(line)["text"][: 40 + 37 * i % 700] for i, line in enumerate(lines[:count])]


def planned_shapes(encoder: Encoder, texts: list[str], plan) -> tuple[set, torch.Tensor]:
    """Run ``plan``'s batches (planned for any device type) on the CPU: their shapes and the embeddings."""
    from diffusion_embedder import inference

    items, _ = inference.prepare_inputs(texts, {}, None, None)
    out = torch.empty((len(texts), encoder.embedding_dim))
    shapes = set()
    with torch.inference_mode():
        for indices, features in inference.planned_batches(encoder, items, encoder.config, plan):
            shapes.add(tuple(features["input_ids"].shape))
            out[indices] = encoder(features)
    return shapes, out


@pytest.mark.parametrize("family", FAMILIES)
def test_bounded_cuda_shapes_equal_padded_on_cpu(family_checkpoint, family):
    """CUDA's packed forwards (power-of-two widths and row counts, so flex_attention compiles few kernels)
    give the padded path's vectors; run here on the CPU, planned as for CUDA."""
    from diffusion_embedder.inference import BatchPlan

    encoder = load(family_checkpoint(family), attn_implementation=default_attention(family)).eval()
    texts = corpus(24)
    padded = encoder.encode(texts, batch_size=5, packing=False, show_progress_bar=False)
    for plan in (BatchPlan(3, None, True, "cuda"), BatchPlan(4, 600, True, "cuda")):
        shapes, packed = planned_shapes(encoder, texts, plan)
        assert_close_normwise(packed, padded, eps_multiple=ORDER_EPS, rows=True, msg=(family, plan))
        assert all(rows & (rows - 1) == 0 and width & (width - 1) == 0 for rows, width in shapes), shapes


def test_bounded_shapes_are_few_where_cpu_rows_vary():
    from diffusion_embedder.inference import BatchPlan

    encoder = load(LLAMA_FIXTURE, attn_implementation="sdpa").eval()
    texts = corpus(100)
    bounded, _ = planned_shapes(encoder, texts, BatchPlan(4, None, True, "cuda"))
    exact, _ = planned_shapes(encoder, texts, BatchPlan(4, None, True, "cpu"))
    assert {w for _, w in bounded} <= {128, 256, 512} and {r for r, _ in bounded} <= {1, 2, 4}
    assert len(bounded) <= 9 < len(exact), (bounded, exact)
