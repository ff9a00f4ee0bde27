"""Encoder: LLM2Vec parity, batch invariance, save/load, adapters, templates and bad input."""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil

import numpy as np
import pytest
import torch
from conftest import (
    DREAM_FIXTURE,
    FAMILIES,
    LLAMA_FIXTURE,
    MISTRAL_FIXTURE,
    MIXED_TEXTS,
    REFERENCE_FAMILIES,
    default_attention,
    randomize_lora_b,
)
from numerics import HAND_EPS, MERGE_EPS, ORDER_EPS, REFERENCE_EPS, assert_close_normwise
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file

from diffusion_embedder import Encoder, LLM2Vec
from diffusion_embedder.backbones import load_tokenizer
from diffusion_embedder.inference import length_batches
from diffusion_embedder.pooling import POOLING_MODES, pool
from diffusion_embedder.templates import SEPARATOR, parse_input, render

TEXTS = MIXED_TEXTS[:5]


def encoder_for(path, **kwargs) -> Encoder:
    kwargs.setdefault("torch_dtype", torch.float32)
    return Encoder.from_pretrained(str(path), **kwargs)


def parity_cases(fixture):
    cases = json.loads((fixture / "cases.json").read_text())
    return [
        pytest.param(fixture, case, id=f"{fixture.name}-{i}-{case['pooling_mode']}") for i, case in enumerate(cases)
    ]


@pytest.mark.parametrize(("fixture", "case"), parity_cases(LLAMA_FIXTURE) + parity_cases(MISTRAL_FIXTURE))
def test_llm2vec_parity_at_any_batch_size(fixture, case):
    """Every case LLM2Vec 0.2.3 produced (all pooling modes, causal, triples, strings, truncation)."""
    settings = {k: case[k] for k in ("enable_bidirectional", "doc_max_length") if k in case}
    encoder = encoder_for(
        fixture,
        pooling_mode=case["pooling_mode"],
        skip_instruction=case["skip_instruction"],
        max_length=case["max_length"],
        **settings,
    )
    expected = torch.tensor(case["embeddings"])
    for batch_size in (1, 3, 10):
        got = encoder.encode(case["inputs"], batch_size=batch_size, show_progress_bar=False)
        assert got.dtype == torch.float32
        assert_close_normwise(got, expected, eps_multiple=REFERENCE_EPS, rows=True, msg=(batch_size))


def test_llm2vec_text_format():
    """The string LLM2Vec tokenizes and the span it pools, for pairs, separator strings and EOS pooling."""
    pair = parse_input(["  Retrieve passages  ", "the text"], 0)
    assert render(pair, None, "") == ("Retrieve passages the text", "the text")
    assert render(parse_input(["", "the text"], 0), None, "") == ("the text", "the text")
    assert render(parse_input(f"inst; {SEPARATOR}doc", 0), None, "") == ("inst; doc", "doc")
    assert render(pair, None, " </s>") == ("Retrieve passages the text </s>", "the text </s>")
    wrapped = render(pair, "<|im_start|>user\n{text}<|im_end|>", "")
    assert wrapped == ("<|im_start|>user\nRetrieve passages the text<|im_end|>", "the text<|im_end|>")


@pytest.mark.parametrize(
    "family,pooling_mode",
    [(f, m) for f in FAMILIES for m in POOLING_MODES if m != "mask_token" or f in REFERENCE_FAMILIES],
)
def test_batch_invariance(family_checkpoint, family, pooling_mode):
    """A text encoded alone and inside a padded batch gives the same vector, for every mode and backbone."""
    encoder = encoder_for(
        family_checkpoint(family), pooling_mode=pooling_mode, attn_implementation=default_attention(family)
    )
    batched = encoder.encode(TEXTS, batch_size=len(TEXTS), show_progress_bar=False)
    for i, text in enumerate(TEXTS):
        alone = encoder.encode([text], show_progress_bar=False)[0]
        assert_close_normwise(alone, batched[i], eps_multiple=ORDER_EPS, msg=(family, pooling_mode, i))


def test_pooling_is_padding_side_agnostic():
    torch.manual_seed(0)
    hidden = torch.randn(1, 5, 8)
    mask = torch.tensor([[1, 1, 1, 1, 1]])
    span = torch.tensor([[0, 0, 1, 1, 1]])
    pad = torch.randn(1, 3, 8)
    for mode in ("mean", "weighted_mean", "eos_token", "bos_token", "mask_token"):
        plain = pool(hidden, mask, span, mode)
        left = pool(torch.cat([pad, hidden], 1), torch.cat([torch.zeros(1, 3, dtype=torch.long), mask], 1),
                    torch.cat([torch.zeros(1, 3, dtype=torch.long), span], 1), mode)
        right = pool(torch.cat([hidden, pad], 1), torch.cat([mask, torch.zeros(1, 3, dtype=torch.long)], 1),
                     torch.cat([span, torch.zeros(1, 3, dtype=torch.long)], 1), mode)
        assert torch.allclose(plain, left, atol=1e-6) and torch.allclose(plain, right, atol=1e-6), mode
    # weighted_mean by hand: weights 1, 2, 3 over the span
    expected = (hidden[0, 2] * 1 + hidden[0, 3] * 2 + hidden[0, 4] * 3) / 6
    assert_close_normwise(pool(hidden, mask, span, "weighted_mean")[0], expected, eps_multiple=HAND_EPS)


def test_skip_instruction_excludes_instruction_tokens():
    encoder = encoder_for(LLAMA_FIXTURE, skip_instruction=True)
    features = encoder.tokenize([["Given a question, retrieve the answer", "hello world"]])
    n_text = len(encoder.tokenizer("hello world", add_special_tokens=False)["input_ids"])
    assert int(features["embed_mask"].sum()) == n_text
    assert features["embed_mask"][0, -n_text:].all()
    with torch.no_grad():
        hidden = encoder.model(input_ids=features["input_ids"], use_cache=False).last_hidden_state
        got = encoder(features)
    assert_close_normwise(got[0], hidden[0, -n_text:].mean(0), eps_multiple=HAND_EPS)


def test_save_and_reload_gives_identical_embeddings(tmp_path):
    encoder = encoder_for(LLAMA_FIXTURE, pooling_mode="weighted_mean", max_length=128, doc_max_length=64,
                          skip_instruction=False, prompt_template="[INST] {text} [/INST]")
    before = encoder.encode(TEXTS, show_progress_bar=False)
    encoder.save(str(tmp_path / "enc"))
    saved = json.loads((tmp_path / "enc" / "llm2vec_config.json").read_text())
    assert saved == {"pooling_mode": "weighted_mean", "max_length": 128, "doc_max_length": 64,
                     "skip_instruction": False}
    assert (tmp_path / "enc" / "model.safetensors").exists()
    reloaded = Encoder.from_pretrained(str(tmp_path / "enc"))
    assert reloaded.config.to_dict() == encoder.config.to_dict()
    assert torch.equal(reloaded.encode(TEXTS, show_progress_bar=False), before)


def _with_random_lora(encoder: Encoder, seed: int = 0) -> Encoder:
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0)
    encoder.model = get_peft_model(encoder.model, config)
    torch.manual_seed(seed)
    randomize_lora_b(encoder.model, 0.5)
    return encoder


def test_lora_adapter_round_trip_merged_and_unmerged(tmp_path):
    base = encoder_for(LLAMA_FIXTURE).encode(TEXTS, show_progress_bar=False)
    encoder = _with_random_lora(encoder_for(LLAMA_FIXTURE))
    with_lora = encoder.encode(TEXTS, show_progress_bar=False)
    assert not torch.allclose(with_lora, base, atol=1e-3)

    encoder.save(str(tmp_path / "adapter"))
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()
    assert not (tmp_path / "adapter" / "model.safetensors").exists()
    unmerged = Encoder.from_pretrained(str(tmp_path / "adapter"))
    assert hasattr(unmerged.model, "peft_config")
    assert_close_normwise(unmerged.encode(TEXTS, show_progress_bar=False), with_lora, eps_multiple=MERGE_EPS, rows=True)

    merged = Encoder.from_pretrained(str(tmp_path / "adapter"), merge_peft=True)
    assert not hasattr(merged.model, "peft_config")
    assert_close_normwise(merged.encode(TEXTS, show_progress_bar=False), with_lora, eps_multiple=MERGE_EPS, rows=True)

    # LLM2Vec's way: base + peft_model_name_or_path, merged or not.
    for merge in (True, False):
        llm2vec_style = Encoder.from_pretrained(
            str(LLAMA_FIXTURE), peft_model_name_or_path=str(tmp_path / "adapter"), merge_peft=merge
        )
        assert_close_normwise(
            llm2vec_style.encode(TEXTS, show_progress_bar=False), with_lora,
            eps_multiple=MERGE_EPS, rows=True
        )

    encoder.save(str(tmp_path / "merged"), merge_before_save=True)
    assert (tmp_path / "merged" / "model.safetensors").exists()
    fully = Encoder.from_pretrained(str(tmp_path / "merged"))
    assert_close_normwise(fully.encode(TEXTS, show_progress_bar=False), with_lora, eps_multiple=MERGE_EPS, rows=True)


def test_saving_merged_leaves_the_encoders_model_as_it_was(tmp_path):
    """save(merge_before_save=True) and the sentence-transformers export write merged weights, the ones peft's
    in-place merge gives, and the encoder keeps its adapter, its weights and its vectors."""
    encoder = _with_random_lora(encoder_for(LLAMA_FIXTURE))
    model = encoder.model
    state = {k: v.clone() for k, v in model.state_dict().items()}
    before = encoder.encode(TEXTS, show_progress_bar=False)
    expected = copy.deepcopy(model).merge_and_unload().state_dict()  # what save did to the encoder's own model
    encoder.save(str(tmp_path / "merged"), merge_before_save=True)
    encoder.save(str(tmp_path / "st"), format="sentence-transformers")
    assert encoder.model is model and hasattr(model, "peft_config")
    after = model.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[k], state[k]) for k in state)
    assert torch.equal(encoder.encode(TEXTS, show_progress_bar=False), before)
    for folder in ("merged", "st"):
        saved = load_file(str(tmp_path / folder / "model.safetensors"))
        assert saved.keys() == expected.keys()
        assert all(torch.equal(saved[k], expected[k]) for k in saved), folder


def test_the_callers_tokenizer_is_left_as_it_was(tmp_path):
    """The encoder pads on the left with EOS as the pad token (LLM2Vec's layout) on a copy, never on the caller's
    tokenizer; it encodes and saves exactly as the tokenizer from_pretrained prepares for itself."""
    loaded = encoder_for(LLAMA_FIXTURE)
    tokenizer = load_tokenizer(str(LLAMA_FIXTURE))
    assert (tokenizer.padding_side, tokenizer.pad_token) == ("right", None)
    encoder = Encoder(loaded.model, tokenizer, loaded.config)
    assert (tokenizer.padding_side, tokenizer.pad_token) == ("right", None)
    assert encoder.tokenizer is not tokenizer
    assert (encoder.tokenizer.padding_side, encoder.tokenizer.pad_token) == ("left", "</s>")
    assert torch.equal(encoder.encode(TEXTS, show_progress_bar=False), loaded.encode(TEXTS, show_progress_bar=False))
    encoder.save(str(tmp_path / "given"))
    loaded.save(str(tmp_path / "loaded"))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / "given" / name).read_bytes() == (tmp_path / "loaded" / name).read_bytes(), name
    assert Encoder(loaded.model, encoder.tokenizer).tokenizer is encoder.tokenizer  # already left-padded: shared


def test_adapter_inside_base_folder_is_merged_first(tmp_path):
    """LLM2Vec's published layout: base + MNTP adapter in one folder, then a supervised adapter on top."""
    mntp = _with_random_lora(encoder_for(LLAMA_FIXTURE), seed=1)
    mntp.model.save_pretrained(str(tmp_path / "mntp"))  # adapter only, naming its base
    shutil.copy(LLAMA_FIXTURE / "config.json", tmp_path / "mntp" / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(LLAMA_FIXTURE / name, tmp_path / "mntp" / name)
    expected_mntp = mntp.encode(TEXTS, show_progress_bar=False)

    loaded = Encoder.from_pretrained(str(tmp_path / "mntp"), torch_dtype=torch.float32)
    assert not hasattr(loaded.model, "peft_config")  # merged, as LLM2Vec does
    assert loaded.config.merged_adapters == (str(tmp_path / "mntp"),)
    assert_close_normwise(
        loaded.encode(TEXTS, show_progress_bar=False), expected_mntp,
        eps_multiple=MERGE_EPS, rows=True
    )

    supervised = _with_random_lora(loaded, seed=2)
    expected = supervised.encode(TEXTS, show_progress_bar=False)
    supervised.save(str(tmp_path / "supervised"))
    again = Encoder.from_pretrained(str(tmp_path / "mntp"), peft_model_name_or_path=str(tmp_path / "supervised"))
    assert_close_normwise(again.encode(TEXTS, show_progress_bar=False), expected, eps_multiple=MERGE_EPS, rows=True)
    # the MNTP folder spelled otherwise (relative, through a link) is the adapter already merged: not merged twice
    (tmp_path / "link").symlink_to(tmp_path)
    for spelling in (os.path.relpath(tmp_path / "mntp"), str(tmp_path / "link" / "mntp")):
        other = Encoder.from_pretrained(spelling, peft_model_name_or_path=str(tmp_path / "supervised"))
        assert other.config.merged_adapters == (str(tmp_path / "mntp"),), spelling
        assert_close_normwise(other.encode(TEXTS, show_progress_bar=False), expected, eps_multiple=MERGE_EPS,
                              rows=True, msg=spelling)
    # The checkpoint alone restores base + MNTP merge + its adapter.
    alone = Encoder.from_pretrained(str(tmp_path / "supervised"))
    assert_close_normwise(alone.encode(TEXTS, show_progress_bar=False), expected, eps_multiple=MERGE_EPS, rows=True)


def test_llm2vec_config_is_read_and_explicit_arguments_win(tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(LLAMA_FIXTURE, folder)
    (folder / "llm2vec_config.json").write_text(json.dumps(
        {"pooling_mode": "eos_token", "max_length": 64, "doc_max_length": 32, "skip_instruction": False}))
    encoder = Encoder.from_pretrained(str(folder))
    assert (encoder.config.pooling_mode, encoder.config.max_length, encoder.config.doc_max_length) == (
        "eos_token", 64, 32)
    assert encoder.config.skip_instruction is False
    assert encoder.config.eos_suffix == " </s>"
    explicit = Encoder.from_pretrained(str(folder), pooling_mode="mean", max_length=128)
    assert (explicit.config.pooling_mode, explicit.config.max_length, explicit.config.doc_max_length) == (
        "mean", 128, 32)


def test_llm2vec_alias_and_argument_names():
    case = json.loads((LLAMA_FIXTURE / "cases.json").read_text())[0]
    model = LLM2Vec.from_pretrained(
        base_model_name_or_path=str(LLAMA_FIXTURE),
        peft_model_name_or_path=None,
        merge_peft=True,
        enable_bidirectional=True,
        pooling_mode=case["pooling_mode"],
        max_length=case["max_length"],
        skip_instruction=case["skip_instruction"],
        torch_dtype=torch.float32,
        device_map=None,
    )
    assert LLM2Vec is Encoder
    out = model.encode(case["inputs"], batch_size=8, show_progress_bar=False, convert_to_numpy=True)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32
    assert_close_normwise(out, np.array(case["embeddings"]), eps_multiple=REFERENCE_EPS, rows=True)
    # LLM2Vec's constructor: LLM2Vec(model, tokenizer, pooling_mode=..., max_length=...)
    wrapped = LLM2Vec(model.model, model.tokenizer, pooling_mode="mean", max_length=256, skip_instruction=True)
    assert_close_normwise(
        wrapped.encode(case["inputs"], show_progress_bar=False).numpy(), out,
        eps_multiple=ORDER_EPS, rows=True
    )


def test_llm2vec_positional_constructor_reproduces_the_parity_fixture():
    """LLM2Vec 0.2.3's positional order, LLM2Vec(model, tokenizer, pooling_mode, max_length, doc_max_length,
    skip_instruction), gives LLM2Vec's own vectors for every bidirectional parity case; an EncoderConfig is still
    taken third (told apart by type) or as config=."""
    base = encoder_for(LLAMA_FIXTURE)
    for case in json.loads((LLAMA_FIXTURE / "cases.json").read_text()):
        if not case.get("enable_bidirectional", True):
            continue
        mode, length, skip = case["pooling_mode"], case["max_length"], case["skip_instruction"]
        wrapped = LLM2Vec(base.model, base.tokenizer, mode, length, case.get("doc_max_length", 400), skip)
        assert (wrapped.pooling_mode, wrapped.max_length, wrapped.skip_instruction) == (mode, length, skip)
        got = wrapped.encode(case["inputs"], batch_size=4, show_progress_bar=False)
        assert_close_normwise(got, torch.tensor(case["embeddings"]), eps_multiple=REFERENCE_EPS, rows=True, msg=case)
    short = LLM2Vec(base.model, base.tokenizer, "weighted_mean", 128, 64, False)
    assert (short.config.max_length, short.config.doc_max_length, short.config.skip_instruction) == (128, 64, False)
    assert Encoder(base.model, base.tokenizer, short.config).config == short.config
    assert Encoder(base.model, base.tokenizer, config=short.config, max_length=32).config.max_length == 32
    with pytest.raises(TypeError, match="An EncoderConfig given third holds every setting"):
        Encoder(base.model, base.tokenizer, short.config, 256)


def test_get_pooling_is_forwards_pooling_and_leaves_the_features():
    """LLM2Vec's get_pooling(features, last_hidden_states): forward is the backbone then this; unlike LLM2Vec's it
    does not overwrite features["attention_mask"] with the embed mask."""
    encoder = encoder_for(LLAMA_FIXTURE)
    for mode in ("mean", "weighted_mean", "last_token", "bos_token"):
        encoder.pooling_mode = mode
        features = encoder.tokenize(TEXTS)
        before = {k: v.clone() for k, v in features.items()}
        with torch.no_grad():
            mask = features["attention_mask"]
            positions = (mask.cumsum(-1) - 1).clamp_min(0)
            hidden = encoder.model(input_ids=features["input_ids"], attention_mask=mask, position_ids=positions)
            hidden = hidden.last_hidden_state
            pooled = encoder.get_pooling(features, hidden)
            assert_close_normwise(pooled, encoder(features), eps_multiple=ORDER_EPS, rows=True, msg=mode)
        assert all(torch.equal(features[k], before[k]) for k in before), mode
        assert_close_normwise(
            pooled, encoder.encode(TEXTS, show_progress_bar=False),
            eps_multiple=ORDER_EPS, rows=True, msg=mode
        )


def test_resize_token_embeddings_and_gradient_checkpointing_reach_the_backbone():
    """LLM2Vec passes both to its model; so does the encoder (with a LoRA adapter too)."""
    encoder = encoder_for(LLAMA_FIXTURE)
    embedding = encoder.resize_token_embeddings(1030, pad_to_multiple_of=8)
    assert embedding.weight.shape[0] == 1032 == encoder.model.get_input_embeddings().weight.shape[0]

    def checkpointing() -> bool:  # transformers 5.23's name, else the older one
        if hasattr(type(encoder.model), "is_activation_checkpointing"):
            return encoder.model.is_activation_checkpointing
        return encoder.model.is_gradient_checkpointing

    assert not checkpointing()
    encoder.gradient_checkpointing_enable({"use_reentrant": False})
    assert checkpointing()
    encoder.model = get_peft_model(encoder.model, LoraConfig(r=4, target_modules=["q_proj"]))
    assert encoder.resize_token_embeddings(1040).weight.shape[0] == 1040


def test_causal_encoder_differs_and_round_trips(tmp_path):
    bi = encoder_for(DREAM_FIXTURE)
    causal = encoder_for(DREAM_FIXTURE, enable_bidirectional=False)
    assert not torch.allclose(bi.encode(TEXTS, show_progress_bar=False),
                              causal.encode(TEXTS, show_progress_bar=False), atol=1e-3)
    causal.save(str(tmp_path / "causal"))
    again = Encoder.from_pretrained(str(tmp_path / "causal"))
    assert again.config.enable_bidirectional is False and again.model.config.is_causal is True
    assert torch.equal(again.encode(TEXTS, show_progress_bar=False), causal.encode(TEXTS, show_progress_bar=False))


def test_dream_template_is_a_saved_setting(tmp_path):
    encoder = encoder_for(DREAM_FIXTURE, prompt_template="<|im_start|>user\n{text}<|im_end|>")
    ids = encoder.tokenize([["Find", "abc"]])["input_ids"][0].tolist()
    assert ids[0] == encoder.tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids[-1] == encoder.tokenizer.convert_tokens_to_ids("<|im_end|>")
    encoder.save(str(tmp_path / "dream"))
    reloaded = Encoder.from_pretrained(str(tmp_path / "dream"))
    assert reloaded.config.prompt_template == "<|im_start|>user\n{text}<|im_end|>"
    assert reloaded.tokenize([["Find", "abc"]])["input_ids"][0].tolist() == ids


def test_default_template_follows_llm2vec_names(tmp_path):
    folder = tmp_path / "dream"
    shutil.copytree(DREAM_FIXTURE, folder)
    config = json.loads((folder / "config.json").read_text())
    config["_name_or_path"] = "siyue/Dream_emb"
    (folder / "config.json").write_text(json.dumps(config))
    assert encoder_for(folder).config.prompt_template == "<|im_start|>user\n{text}<|im_end|>"
    assert encoder_for(DREAM_FIXTURE).config.prompt_template is None


def test_latent_attention_trains_saves_and_reloads(tmp_path):
    encoder = encoder_for(LLAMA_FIXTURE, pooling_mode="latent_attention")
    assert encoder.latent is not None and encoder.latent.latents.requires_grad
    features = encoder.tokenize(TEXTS)
    encoder(features).sum().backward()
    assert encoder.latent.latents.grad is not None
    before = encoder.encode(TEXTS, show_progress_bar=False)
    encoder.save(str(tmp_path / "latent"))
    assert (tmp_path / "latent" / "pooling.safetensors").exists()
    reloaded = Encoder.from_pretrained(str(tmp_path / "latent"))
    assert torch.equal(reloaded.encode(TEXTS, show_progress_bar=False), before)


def test_bad_inputs():
    encoder = encoder_for(LLAMA_FIXTURE)
    empty = encoder.encode([], show_progress_bar=False)
    assert empty.shape == (0, encoder.embedding_dim)
    assert encoder.encode([], convert_to_numpy=True, show_progress_bar=False).shape == (0, 64)
    with pytest.raises(TypeError, match="Input 2"):
        encoder.encode(["a", "b", None], show_progress_bar=False)
    with pytest.raises(ValueError, match="Input 1"):
        encoder.encode(["a", ["only one"]], show_progress_bar=False)
    with pytest.raises(TypeError, match="Input 0: the text"):
        encoder.encode([["instruction", None]], show_progress_bar=False)
    with pytest.raises(TypeError, match="single string"):
        encoder.tokenize("not a list")


def test_empty_and_whitespace_texts_have_a_defined_embedding():
    """An empty text pools over its remaining tokens (BOS, instruction): finite and batch-independent."""
    encoder = encoder_for(LLAMA_FIXTURE, skip_instruction=True)
    inputs = ["", "   ", ["Retrieve a document", ""], ["Retrieve a document", "text"]]
    out = encoder.encode(inputs, show_progress_bar=False)
    assert torch.isfinite(out).all()
    features = encoder.tokenize([["Retrieve a document", ""]])
    with torch.no_grad():
        hidden = encoder.model(input_ids=features["input_ids"], use_cache=False).last_hidden_state
    assert_close_normwise(out[2], hidden[0].mean(0), eps_multiple=HAND_EPS)
    for i, item in enumerate(inputs):
        assert_close_normwise(encoder.encode([item], show_progress_bar=False)[0], out[i], eps_multiple=ORDER_EPS)


def test_long_text_is_truncated_on_the_text_side_with_one_warning(caplog):
    encoder = encoder_for(LLAMA_FIXTURE, max_length=32, doc_max_length=1000)
    instruction = "Given a question, retrieve the answer"
    long_text = "the quick brown fox jumps over the lazy dog " * 40
    with caplog.at_level(logging.WARNING, logger="diffusion_embedder.encoder"):
        out = encoder.encode([[instruction, long_text], [instruction, long_text], "short"], show_progress_bar=False)
    warnings = [r for r in caplog.records if "truncated" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].getMessage().startswith("2 of 3 texts")
    features = encoder.tokenize([[instruction, long_text]])
    ids = features["input_ids"][0].tolist()
    assert len(ids) == 32
    prefix = encoder.tokenizer(instruction)["input_ids"]
    assert ids[: len(prefix)] == prefix  # the instruction is kept whole
    decoded = encoder.tokenizer.decode(ids[len(prefix):])
    assert long_text.startswith(decoded.strip()[:30])
    assert torch.allclose(out[0], out[1])
    with pytest.raises(ValueError, match="instruction and template alone"):
        encoder.tokenize([["word " * 100, ""]])


def test_doc_max_length_cuts_texts_in_encode_only():
    encoder = encoder_for(LLAMA_FIXTURE, max_length=512, doc_max_length=8)
    text = "one two three four five six seven eight nine ten eleven twelve"
    tokens = encoder.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    cut = text[: tokens["offset_mapping"][7][1]]
    assert_close_normwise(
        encoder.encode([text], show_progress_bar=False), encoder.encode([cut], show_progress_bar=False),
        eps_multiple=ORDER_EPS, rows=True
    )
    assert int(encoder.tokenize([text])["attention_mask"].sum()) == len(tokens["input_ids"]) + 1


def test_token_budget_batching():
    lengths = [5, 100, 7, 60, 3, 100, 20]
    batches = length_batches(lengths, batch_size=32, max_tokens_per_batch=200)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for batch in batches:
        assert len(batch) * max(lengths[i] for i in batch) <= 200 or len(batch) == 1
    assert [lengths[b[0]] for b in batches] == sorted((lengths[b[0]] for b in batches), reverse=True)
    assert length_batches(lengths, batch_size=3) == [[1, 5, 3], [6, 2, 0], [4]]
    assert length_batches([500], batch_size=4, max_tokens_per_batch=10) == [[0]]


def test_encode_options():
    encoder = encoder_for(LLAMA_FIXTURE)
    plain = encoder.encode(TEXTS, batch_size=2, show_progress_bar=False)
    budget = encoder.encode(TEXTS, max_tokens_per_batch=64, show_progress_bar=False)
    assert_close_normwise(plain, budget, eps_multiple=ORDER_EPS, rows=True)
    normed = encoder.encode(TEXTS, normalize_embeddings=True, convert_to_tensor=True, show_progress_bar=False)
    assert_close_normwise(normed.norm(dim=-1), torch.ones(len(TEXTS)), eps_multiple=HAND_EPS)
    assert_close_normwise(normed, torch.nn.functional.normalize(plain, dim=-1), eps_multiple=HAND_EPS, rows=True)
    single = encoder.encode("Short.", show_progress_bar=False)
    assert single.shape == (64,) and torch.allclose(single, plain[2], atol=1e-5)


def test_persistent_worker_pool_matches_single_process():
    encoder = encoder_for(LLAMA_FIXTURE)
    expected = encoder.encode(TEXTS, batch_size=2, show_progress_bar=False)
    encoder.start_pool(["cpu", "cpu"])
    try:
        first = encoder.encode(TEXTS, batch_size=2, device=["cpu", "cpu"], show_progress_bar=False)
        pool_obj = encoder._pool_workers
        second = encoder.encode(TEXTS[::-1], batch_size=1, device=["cpu", "cpu"], show_progress_bar=False)
        assert encoder._pool_workers is pool_obj  # workers persist across calls
    finally:
        encoder.stop_pool()
    assert_close_normwise(first, expected, eps_multiple=ORDER_EPS, rows=True)
    assert_close_normwise(second, expected.flip(0), eps_multiple=ORDER_EPS, rows=True)


def test_a_pool_never_encodes_with_weights_the_encoder_no_longer_has():
    """The workers hold the encoder as it was when they started. Replaced weights (a tensor, or the whole model)
    or weights edited in place (an optimizer step, which a copy on another device misses) restart the encoder's own
    pool, and make a pool given as ``pool=`` refuse; before, the old vectors came back with no error."""
    encoder = encoder_for(LLAMA_FIXTURE)
    other = encoder_for(LLAMA_FIXTURE)
    with torch.no_grad():
        for p in other.model.parameters():
            p.mul_(1.5)
    edits = {
        "a replaced tensor": lambda: setattr(encoder.model.norm.weight, "data", encoder.model.norm.weight.data * 2),
        "an in-place edit": lambda: torch.no_grad()(encoder.model.norm.weight.mul_)(0.5),  # as optimizers edit
        "another model": lambda: setattr(encoder, "model", other.model),
    }
    try:
        for name, edit in edits.items():
            encoder.encode(TEXTS, batch_size=2, device=["cpu", "cpu"], show_progress_bar=False)
            workers = encoder._pool_workers
            encoder.encode(TEXTS, batch_size=2, device=["cpu", "cpu"], show_progress_bar=False)
            assert encoder._pool_workers is workers, name  # unchanged weights: the same workers
            edit()
            pooled = encoder.encode(TEXTS, batch_size=2, device=["cpu", "cpu"], show_progress_bar=False)
            assert encoder._pool_workers is not workers, name
            local = encoder.encode(TEXTS, batch_size=2, show_progress_bar=False)
            assert_close_normwise(pooled, local, eps_multiple=ORDER_EPS, rows=True, msg=name)
        pool = encoder.start_multi_process_pool(["cpu"])
        try:
            with torch.no_grad():
                encoder.model.norm.weight.mul_(2)
            with pytest.raises(ValueError, match="pool: .* its weights changed since"):
                encoder.encode(TEXTS, pool=pool, show_progress_bar=False)
        finally:
            encoder.stop_multi_process_pool(pool)
    finally:
        encoder.stop_pool()


def test_merged_adapters_recorded_twice_under_two_spellings_merge_once_in_their_order(tmp_path):
    from diffusion_embedder.loading import _plan_load

    (tmp_path / "A").mkdir()
    (tmp_path / "B").mkdir()
    (tmp_path / "A_link").symlink_to(tmp_path / "A")
    saved = {"merged_adapters": [str(tmp_path / "A"), str(tmp_path / "B"), str(tmp_path / "A_link")]}
    plan = _plan_load(str(LLAMA_FIXTURE), saved, keep_own_adapter=False, hub_kwargs={})
    assert plan.merges == (str(tmp_path / "A"), str(tmp_path / "B"))
