"""The sentence-transformers-style encode API on Encoder, checked against sentence-transformers' own definitions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import LLAMA_FIXTURE
from numerics import HAND_EPS, ORDER_EPS, assert_close_normwise
from sentence_transformers import SentenceTransformer
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
    assert_close_normwise(SIMILARITY_FUNCTIONS[name](a.numpy(), list(b)), reference, eps_multiple=HAND_EPS, rows=True)
    assert_close_normwise(SIMILARITY_FUNCTIONS[name](a[0], b), reference[:1], eps_multiple=HAND_EPS, rows=True)


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
    assert_close_normwise(cut, torch.nn.functional.normalize(full[:, :16], dim=-1), eps_multiple=HAND_EPS, rows=True)
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
        assert_close_normwise(encode(encoder, long), encode(short, long), eps_multiple=ORDER_EPS, rows=True)
    finally:
        encoder.max_seq_length = 512


def test_return_types_and_keyword_only_arguments(encoder):
    assert isinstance(encode(encoder, TEXTS), torch.Tensor)
    assert isinstance(encode(encoder, TEXTS, convert_to_numpy=True), np.ndarray)
    assert isinstance(encode(encoder, TEXTS, convert_to_numpy=True, convert_to_tensor=True), torch.Tensor)
    with pytest.raises(TypeError):
        encoder.encode(TEXTS, 2, False, False, False, "cpu", "query")


# ---------------------------------------------------------------- sentence-transformers 6.2's other encode options


@pytest.fixture(scope="module")
def stock_pair(tmp_path_factory):
    """An encoder whose export uses sentence-transformers' own modules, and that export loaded there."""
    plain = Encoder.from_pretrained(str(LLAMA_FIXTURE), skip_instruction=False, device="cpu")
    folder = tmp_path_factory.mktemp("st")
    plain.save(str(folder), format="sentence-transformers")
    return plain, SentenceTransformer(str(folder), device="cpu")


def test_output_value_token_embeddings_and_none_match_sentence_transformers(stock_pair):
    """output_value="token_embeddings": each input's token states (padding removed); None: a dict per input; as in
    sentence-transformers 6.2, truncate_dim touches the sentence embedding only and normalization neither."""
    plain, model = stock_pair
    ours = encode(plain, TEXTS, output_value="token_embeddings")
    theirs = model.encode(TEXTS, output_value="token_embeddings")
    assert isinstance(ours, list) and len(ours) == len(TEXTS)
    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == torch.float32 and a.shape == b.shape and torch.allclose(a, b, atol=1e-5)
    rows = encode(plain, TEXTS, output_value=None, truncate_dim=8, normalize_embeddings=True)
    st_rows = model.encode(TEXTS, output_value=None, truncate_dim=8, normalize_embeddings=True)
    full = encode(plain, TEXTS)
    for i, (row, st_row) in enumerate(zip(rows, st_rows, strict=True)):
        assert {"input_ids", "attention_mask", "token_embeddings", "sentence_embedding"} <= set(row) & set(st_row)
        assert row["input_ids"].tolist() == st_row["input_ids"][st_row["attention_mask"].bool()].tolist()
        assert_close_normwise(row["token_embeddings"], ours[i], eps_multiple=ORDER_EPS)
        assert_close_normwise(
            row["sentence_embedding"], st_row["sentence_embedding"],
            eps_multiple=ORDER_EPS, rows=True
        )
        assert_close_normwise(row["sentence_embedding"], full[i, :8], eps_multiple=HAND_EPS, rows=True)
    one = model.encode("one", output_value="token_embeddings")
    assert encode(plain, "one", output_value="token_embeddings").shape == one.shape
    assert set(encode(plain, "one", output_value=None)) >= {"token_embeddings", "sentence_embedding"}
    assert encode(plain, [], output_value="token_embeddings") == []
    with pytest.raises(ValueError, match="Unknown output_value 'tokens'"):
        encode(plain, TEXTS, output_value="tokens")
    with pytest.raises(ValueError, match="precision='int8' quantizes sentence embeddings only"):
        encode(plain, TEXTS, output_value="token_embeddings", precision="int8")


def test_precision_none_is_float32_and_half_models_return_float32(stock_pair):
    """precision=None is sentence-transformers' float32. A bfloat16 encoder returns float32 (LLM2Vec's dtype;
    sentence-transformers returns the model's dtype for tensors and token states)."""
    plain, _ = stock_pair
    assert torch.equal(encode(plain, TEXTS, precision=None), encode(plain, TEXTS))
    half = Encoder.from_pretrained(str(LLAMA_FIXTURE), torch_dtype="bfloat16", device="cpu")
    assert encode(half, TEXTS).dtype == torch.float32
    assert encode(half, TEXTS, output_value="token_embeddings")[0].dtype == torch.float32


def test_multi_process_pool_api(stock_pair):
    """start_multi_process_pool / encode(pool=...) / encode_multi_process / stop_multi_process_pool: the same vectors
    as a local encode; a stopped pool, a pool whose encoder changed settings since, or pool with device is refused."""
    plain, _ = stock_pair
    with pytest.raises(ValueError, match=r"target_devices='nonsense' is not a device name"):
        plain.start_multi_process_pool(["nonsense"])
    pool = plain.start_multi_process_pool(["cpu"])
    try:
        local = encode(plain, TEXTS)
        assert_close_normwise(encode(plain, TEXTS, pool=pool, chunk_size=2), local, eps_multiple=ORDER_EPS, rows=True)
        tokens = encode(plain, TEXTS, pool=pool, output_value="token_embeddings")
        for a, b in zip(tokens, encode(plain, TEXTS, output_value="token_embeddings"), strict=True):
            assert_close_normwise(a, b, eps_multiple=ORDER_EPS)
        numpy_out = plain.encode_multi_process(TEXTS, pool, normalize_embeddings=True)
        assert isinstance(numpy_out, np.ndarray)
        assert_close_normwise(
            numpy_out, encode(plain, TEXTS, normalize_embeddings=True).numpy(),
            eps_multiple=ORDER_EPS, rows=True
        )
        with pytest.raises(ValueError, match="Pass either pool or device"):
            encode(plain, TEXTS, pool=pool, device="cpu")
        with pytest.raises(TypeError, match="pool must be what start_multi_process_pool"):
            encode(plain, TEXTS, pool={"input": None})
        plain.pooling_mode = "weighted_mean"
        try:
            with pytest.raises(ValueError, match="these settings changed since: pooling_mode"):
                encode(plain, TEXTS, pool=pool)
        finally:
            plain.pooling_mode = "mean"
    finally:
        plain.stop_multi_process_pool(pool)
    with pytest.raises(ValueError, match="this pool was stopped"):
        encode(plain, TEXTS, pool=pool)


def test_embeddings_are_ordinary_tensors_the_caller_may_change_in_place(encoder):
    """The forwards run in inference mode; what ``encode`` returns must not be an inference tensor (an in-place
    change of one outside inference mode raises)."""
    embeddings = encoder.encode(["a b c", "d e"] * 10, batch_size=4, convert_to_tensor=True)
    assert not embeddings.is_inference()
    embeddings += 1
