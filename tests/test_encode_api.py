"""The sentence-transformers-style encode API on Encoder, checked against sentence-transformers' own definitions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import LLAMA_FIXTURE
from sentence_transformers.util import SimilarityFunction
from sentence_transformers.util.quantization import quantize_embeddings as st_quantize

from diffusion_embedder import Encoder
from diffusion_embedder.quantization import PRECISIONS, quantize_embeddings
from diffusion_embedder.similarity import SIMILARITY_FUNCTIONS

PROMPTS = {"query": "Given a math problem, retrieve the relevant theorem", "document": "Represent the proof"}
TEXTS = ["A triangle has sides 3, 4 and 5.", "short", "Two pointers sweep the array.", "x", "(a) b c"]


@pytest.fixture(scope="module")
def encoder():
    return Encoder.from_pretrained(str(LLAMA_FIXTURE), prompts=PROMPTS, device="cpu")


def encode(encoder, texts, **kwargs):
    return encoder.encode(texts, show_progress_bar=False, **kwargs)


def test_prompts_are_instructions(encoder):
    pairs = encode(encoder, [[PROMPTS["query"], t] for t in TEXTS])
    assert torch.equal(encode(encoder, TEXTS, prompt_name="query"), pairs)
    assert torch.equal(encode(encoder, TEXTS, prompt=PROMPTS["query"]), pairs)
    assert torch.equal(encoder.encode_query(TEXTS, show_progress_bar=False), pairs)
    documents = encode(encoder, [[PROMPTS["document"], t] for t in TEXTS])
    assert torch.equal(encoder.encode_document(TEXTS, show_progress_bar=False), documents)
    assert not torch.allclose(pairs, encode(encoder, TEXTS), atol=1e-3)
    assert torch.equal(encoder.encode_query(TEXTS, prompt="", show_progress_bar=False), encode(encoder, TEXTS))
    with pytest.raises(ValueError, match="Unknown prompt_name 'passage'"):
        encode(encoder, TEXTS, prompt_name="passage")
    with pytest.raises(ValueError, match="either prompt or prompt_name"):
        encode(encoder, TEXTS, prompt="a", prompt_name="query")
    with pytest.raises(ValueError, match="Input 1 already carries an instruction"):
        encode(encoder, ["a", ["inst", "b"]], prompt_name="query")


def test_without_prompts_encode_query_is_encode():
    plain = Encoder.from_pretrained(str(LLAMA_FIXTURE), device="cpu")
    assert torch.equal(plain.encode_query(TEXTS, show_progress_bar=False), encode(plain, TEXTS))
    assert torch.equal(plain.encode_document(TEXTS, show_progress_bar=False), encode(plain, TEXTS))


def test_prompts_and_similarity_are_saved_settings(encoder, tmp_path):
    encoder.similarity_fn_name = "dot"
    try:
        encoder.save(str(tmp_path))
    finally:
        encoder.similarity_fn_name = "cosine"
    reloaded = Encoder.from_pretrained(str(tmp_path), device="cpu")
    assert reloaded.config.prompts == PROMPTS and reloaded.similarity_fn_name == "dot"
    assert torch.allclose(encode(reloaded, TEXTS, prompt_name="query"), encode(encoder, TEXTS, prompt_name="query"))
    with pytest.raises(ValueError, match="Unknown similarity_fn_name 'cos'"):
        encoder.similarity_fn_name = "cos"


@pytest.mark.parametrize("name", list(SIMILARITY_FUNCTIONS))
def test_similarity_matches_sentence_transformers(encoder, name):
    a, b = encode(encoder, TEXTS[:3]), encode(encoder, TEXTS)
    encoder.similarity_fn_name = name
    try:
        ours = encoder.similarity(a, b)
    finally:
        encoder.similarity_fn_name = "cosine"
    reference = SimilarityFunction.to_similarity_fn(name)(a, b)
    assert ours.shape == (3, len(TEXTS)) and torch.allclose(ours, reference, atol=1e-5)
    assert torch.allclose(SIMILARITY_FUNCTIONS[name](a.numpy(), list(b)), reference, atol=1e-5)
    assert torch.allclose(SIMILARITY_FUNCTIONS[name](a[0], b), reference[:1], atol=1e-5)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_precision_matches_sentence_transformers(encoder, precision):
    floats = encode(encoder, TEXTS, normalize_embeddings=True).numpy()
    reference = st_quantize(floats, precision=precision)
    got = encode(encoder, TEXTS, normalize_embeddings=True, precision=precision)
    assert got.dtype == torch.from_numpy(reference).dtype and np.array_equal(got.numpy(), reference)
    as_numpy = encode(encoder, TEXTS, normalize_embeddings=True, precision=precision, convert_to_numpy=True)
    assert isinstance(as_numpy, np.ndarray) and np.array_equal(as_numpy, reference)
    rng = np.random.default_rng(0)
    data, calibration = rng.normal(size=(7, 16)), rng.normal(size=(50, 16))
    ranges = np.vstack((calibration.min(0), calibration.max(0)))
    assert np.array_equal(quantize_embeddings(data, precision), st_quantize(data, precision))
    assert np.array_equal(quantize_embeddings(data, precision, ranges), st_quantize(data, precision, ranges=ranges))


def test_precision_errors(encoder):
    with pytest.raises(ValueError, match="Unknown precision 'int4'"):
        encode(encoder, TEXTS, precision="int4")
    with pytest.raises(ValueError, match="single embedding"):
        encode(encoder, ["one"], precision="int8")


def test_truncate_dim_then_normalize(encoder):
    full = encode(encoder, TEXTS)
    cut = encode(encoder, TEXTS, truncate_dim=16, normalize_embeddings=True)
    assert torch.allclose(cut, torch.nn.functional.normalize(full[:, :16], dim=-1), atol=1e-6)
    assert encoder.get_sentence_embedding_dimension() == 64
    encoder.truncate_dim = 8
    try:
        assert encode(encoder, TEXTS).shape == (len(TEXTS), 8)
        assert encode(encoder, "one").shape == (8,)
        assert encoder.get_sentence_embedding_dimension() == 8
        assert encode(encoder, TEXTS, truncate_dim=32).shape == (len(TEXTS), 32)
    finally:
        encoder.truncate_dim = None


def test_max_seq_length_is_max_length(encoder):
    assert encoder.max_seq_length == encoder.config.max_length == 512
    long = ["word " * 40]
    short = Encoder.from_pretrained(str(LLAMA_FIXTURE), max_length=12, device="cpu")
    encoder.max_seq_length = 12
    try:
        assert encoder.config.max_length == 12
        assert torch.allclose(encode(encoder, long), encode(short, long), atol=1e-6)
    finally:
        encoder.max_seq_length = 512


def test_return_types_and_keyword_only_arguments(encoder):
    assert isinstance(encode(encoder, TEXTS), torch.Tensor)
    assert isinstance(encode(encoder, TEXTS, convert_to_numpy=True), np.ndarray)
    assert isinstance(encode(encoder, TEXTS, convert_to_numpy=True, convert_to_tensor=True), torch.Tensor)
    with pytest.raises(TypeError):
        encoder.encode(TEXTS, 2, False, False, False, "cpu", "query")
