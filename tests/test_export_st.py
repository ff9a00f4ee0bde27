"""sentence-transformers export: round trips to 1e-5, attention that survives loading, refusals, model cards, CLI."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import DREAM_FIXTURE, FAMILIES, LLAMA_FIXTURE, default_attention
from numerics import HAND_EPS, ORDER_EPS, assert_close_normwise
from peft import LoraConfig, get_peft_model
from safetensors import safe_open
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.modules import Transformer
from transformers import AutoTokenizer

from diffusion_embedder import Encoder
from diffusion_embedder.cli import main as cli_main
from diffusion_embedder.export import (
    ENCODER_MODULE,
    ST_POOLING_MODES,
    ST_TRANSFORMER,
    custom_module_reasons,
    save_sentence_transformers,
    st_prompt,
)
from diffusion_embedder.folders import PEFT_012_LORA_FIELDS, legacy_adapter_config
from diffusion_embedder.pooling import POOLING_MODES
from diffusion_embedder.similarity import SIMILARITY_FUNCTIONS
from diffusion_embedder.templates import parse_input

PROMPTS = {"query": "Given a math problem, retrieve the relevant theorem", "document": "  Represent the proof  "}
TEXTS = [
    "A triangle has sides 3, 4 and 5. Find its area.",
    "short",
    " leading space and a second clause",
    "(parenthesis first) then words",
    "Two pointers sweep the array from both ends, meeting in the middle of it all.",
]
FIXTURES = {"llama": LLAMA_FIXTURE, "Dream": DREAM_FIXTURE}
#: Settings sentence-transformers' Transformer + Pooling compute exactly (the rest need our module).
STOCK = {("mean", False), ("weighted_mean", False), ("bos_token", False), ("bos_token", True), ("last_token", False),
         ("last_token", True)}  # last_token appends nothing (as LLM2Vec), so the stock module is exact
#: Backbones whose tokenizer adds no token around a text (no BOS): an empty text there needs our module.
NO_BOS = {"qwen2", "qwen3", "Dream", "llada"}
EMPTY_TEXTS = ["", "x", " ", "A triangle has sides 3, 4 and 5.", ""]


def load_st(path, **kwargs) -> SentenceTransformer:
    custom = json.loads((path / "modules.json").read_text())[0]["type"] == ENCODER_MODULE
    return SentenceTransformer(str(path), device="cpu", trust_remote_code=custom, **kwargs)


def max_diff(a, b) -> float:
    return (torch.as_tensor(a) - torch.as_tensor(b)).abs().max().item()


#: mask_token pooling needs a mask token: Dream has one, the Llama fixture doesn't.
CASES = [(family, mode) for family in FIXTURES for mode in POOLING_MODES if family == "Dream" or mode != "mask_token"]


@pytest.mark.parametrize("prompts", [PROMPTS, {}], ids=["prompts", "no_prompts"])
@pytest.mark.parametrize("skip_instruction", [False, True], ids=["all_tokens", "skip_instruction"])
@pytest.mark.parametrize(("family", "pooling_mode"), CASES)
def test_round_trip(tmp_path, family, pooling_mode, skip_instruction, prompts):
    """SentenceTransformer(folder) gives Encoder.encode's vectors, plain and with each prompt (query, document).
    With prompts the folder is our module (test_prompted_long_non_ascii_texts_are_cut_as_the_encoder_cuts)."""
    encoder = Encoder.from_pretrained(
        str(FIXTURES[family]),
        pooling_mode=pooling_mode,
        skip_instruction=skip_instruction,
        max_length=128,
        doc_max_length=128,
        prompts=prompts,
        device="cpu",
    )
    encoder.save(str(tmp_path), format="sentence-transformers")
    module = json.loads((tmp_path / "modules.json").read_text())[0]["type"]
    stock = (pooling_mode, skip_instruction) in STOCK and family not in NO_BOS and not prompts
    assert module == (ST_TRANSFORMER if stock else ENCODER_MODULE)
    model = load_st(tmp_path)
    ours = encoder.encode(TEXTS, show_progress_bar=False)
    assert max_diff(model.encode(TEXTS), ours) < 1e-5
    assert max_diff(model.encode(TEXTS, batch_size=2), ours) < 1e-5  # padded batches of other texts
    for name, instruction in prompts.items():
        ours = encoder.encode(TEXTS, prompt_name=name, show_progress_bar=False)
        assert max_diff(ours, encoder.encode([[instruction, t] for t in TEXTS], show_progress_bar=False)) == 0
        assert max_diff(model.encode(TEXTS, prompt_name=name), ours) < 1e-5, name
    assert max_diff(model.encode_query(TEXTS), encoder.encode_query(TEXTS, show_progress_bar=False)) < 1e-5
    assert max_diff(model.encode_document(TEXTS), encoder.encode_document(TEXTS, show_progress_bar=False)) < 1e-5
    assert model.similarity_fn_name == "cosine"
    assert model.get_embedding_dimension() == encoder.get_sentence_embedding_dimension() == 64


def test_bidirectional_attention_survives_sentence_transformers_loading(tmp_path):
    """config.json's is_causal: false is what makes the stock folder bidirectional: forcing it causal changes the
    vectors, and then they equal our causal encoder's (on SDPA and eager attention alike)."""
    encoder = Encoder.from_pretrained(str(LLAMA_FIXTURE), skip_instruction=False, device="cpu")
    encoder.save(str(tmp_path), format="sentence-transformers")
    assert json.loads((tmp_path / "config.json").read_text())["is_causal"] is False
    ours = encoder.encode(TEXTS, show_progress_bar=False)
    causal = Encoder.from_pretrained(str(LLAMA_FIXTURE), skip_instruction=False, enable_bidirectional=False)
    ours_causal = causal.encode(TEXTS, show_progress_bar=False)
    assert max_diff(ours, ours_causal) > 1e-2
    for attn in ("sdpa", "eager"):
        model = load_st(tmp_path, model_kwargs={"attn_implementation": attn})
        assert max_diff(model.encode(TEXTS), ours) < 1e-5, attn
        forced = load_st(tmp_path, model_kwargs={"attn_implementation": attn}, config_kwargs={"is_causal": True})
        assert max_diff(forced.encode(TEXTS), ours) > 1e-2, attn
        assert max_diff(forced.encode(TEXTS), ours_causal) < 1e-5, attn
    causal.save(str(tmp_path / "causal"), format="sentence-transformers")  # the attention ablation exports too
    assert json.loads((tmp_path / "causal" / "config.json").read_text())["is_causal"] is True
    assert max_diff(load_st(tmp_path / "causal").encode(TEXTS), ours_causal) < 1e-5


def test_dream_is_written_as_qwen2_without_remote_code_files(tmp_path):
    """Config, tokenizer and weights load with transformers' own classes; the folder names our module (Dream has no
    BOS, so an empty text needs it), which sentence-transformers imports with trust_remote_code=True."""
    encoder = Encoder.from_pretrained(str(DREAM_FIXTURE), skip_instruction=False, device="cpu")
    encoder.save(str(tmp_path), format="sentence-transformers")
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["model_type"], config["architectures"], config["is_causal"]) == ("qwen2", ["Qwen2Model"], False)
    assert "auto_map" not in config and "auto_map" not in json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert not list(tmp_path.glob("*.py"))
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))  # no trust_remote_code
    assert tokenizer("a b")["input_ids"] == encoder.tokenizer("a b")["input_ids"]
    assert json.loads((tmp_path / "modules.json").read_text())[0]["type"] == ENCODER_MODULE
    model = SentenceTransformer(str(tmp_path), device="cpu", trust_remote_code=True)
    assert max_diff(model.encode(TEXTS), encoder.encode(TEXTS, show_progress_bar=False)) < 1e-5


def close(a, b) -> bool:
    """Equal to 1e-6, absolute or relative (Gemma's scaled states reach tens)."""
    return torch.allclose(torch.as_tensor(a), torch.as_tensor(b), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_backbone_gives_an_empty_text_the_encoders_vector_or_names_our_module(tmp_path, family_checkpoint,
                                                                                  family):
    """Every pooling mode sentence-transformers' Pooling covers, both skip_instruction values: `""` alone and inside a
    batch gets Encoder.encode's vector. Where the tokenizer adds no BOS the stock Transformer would give it no token
    (a crash alone, another vector in a batch), so the export names our module and says why."""
    base = Encoder.from_pretrained(
        str(family_checkpoint(family)), attn_implementation=default_attention(family), device="cpu"
    )
    assert (not base.tokenizer("")["input_ids"]) == (family in NO_BOS)
    load_kwargs = {"model_kwargs": {"attn_implementation": default_attention(family)}}
    for mode in ST_POOLING_MODES:
        for skip_instruction in (False, True):
            config = replace(base.config, pooling_mode=mode, skip_instruction=skip_instruction, eos_suffix=None)
            encoder = Encoder(base.model, base.tokenizer, config=config)
            reasons = custom_module_reasons(encoder)
            assert any("an empty text has no tokens" in r for r in reasons) == (family in NO_BOS), (mode, reasons)
            folder = tmp_path / f"{mode}-{skip_instruction}"
            encoder.save(str(folder), format="sentence-transformers")
            module = json.loads((folder / "modules.json").read_text())[0]["type"]
            assert module == (ENCODER_MODULE if reasons else ST_TRANSFORMER)
            model = load_st(folder, **load_kwargs)
            where = (family, mode, skip_instruction, module)
            assert close(model.encode(EMPTY_TEXTS), encoder.encode(EMPTY_TEXTS, show_progress_bar=False)), where
            assert close(model.encode([""]), encoder.encode([""], show_progress_bar=False)), where


def test_stock_folders_load_without_the_flag_ours_say_why_they_need_it(tmp_path, caplog):
    """sentence-transformers 6.2 imports a module class from outside its package only with trust_remote_code=True:
    a stock folder loads without it; one naming our module says why it needs it and shows the flag (card, log)."""
    stock = Encoder.from_pretrained(str(LLAMA_FIXTURE), skip_instruction=False, device="cpu")
    stock.save(str(tmp_path / "stock"), format="sentence-transformers")
    model = SentenceTransformer(str(tmp_path / "stock"), device="cpu")  # no flag
    assert max_diff(model.encode(TEXTS), stock.encode(TEXTS, show_progress_bar=False)) < 1e-5
    card = (tmp_path / "stock" / "README.md").read_text()
    assert "trust_remote_code=True" not in card and "no `trust_remote_code`" in card

    ours = Encoder.from_pretrained(str(LLAMA_FIXTURE), device="cpu")  # skip_instruction with mean pooling
    folder = tmp_path / "ours"
    with caplog.at_level(logging.WARNING, logger="diffusion_embedder.export"):
        ours.save(str(folder), format="sentence-transformers")
    logged = caplog.text
    assert "skip_instruction=True with mean pooling" in logged
    assert f"SentenceTransformer({str(folder)!r}, trust_remote_code=True)" in logged
    card = (folder / "README.md").read_text()
    assert f'SentenceTransformer("{folder}", trust_remote_code=True)' in card
    assert "- skip_instruction=True with mean pooling" in card and "#3801" in card
    with pytest.raises(ValueError, match="diffusion_embedder.st_modules.EncoderModule"):
        SentenceTransformer(str(folder), device="cpu")
    model = SentenceTransformer(str(folder), device="cpu", trust_remote_code=True)
    assert max_diff(model.encode(TEXTS), ours.encode(TEXTS, show_progress_bar=False)) < 1e-5
    tokens = ours.encode(TEXTS, output_value="token_embeddings", show_progress_bar=False)
    for a, b in zip(model.encode(TEXTS, output_value="token_embeddings"), tokens, strict=True):
        assert a.shape == b.shape and max_diff(a, b) < 1e-6  # our module's token states, in its layout
    with pytest.raises(ValueError, match=r"trust_remote_code=True\)"):
        save_sentence_transformers(ours, str(tmp_path / "refused"), stock_only=True)


@pytest.mark.parametrize("family", FIXTURES)
def test_prompt_exclusion_of_sentence_transformers_is_not_our_pooled_span(tmp_path, family):
    """Why skip_instruction keeps our module: Pooling(include_prompt=False) drops as many tokens as the prompt has
    alone, whose trailing space is a token of its own; in the row the space joins the text's first word, so token by
    token the excluded part ends one past the instruction (it drops the text's first token)."""
    encoder = Encoder.from_pretrained(str(FIXTURES[family]), skip_instruction=False, device="cpu")
    encoder.save(str(tmp_path), format="sentence-transformers")
    transformer = Transformer(str(tmp_path))
    prompt = st_prompt(PROMPTS["query"])
    prompt_length = transformer._get_prompt_length(prompt)  # what Pooling(include_prompt=False) excludes
    for text in ("x", "A triangle has sides 3, 4 and 5.", "(parenthesis first) then words"):
        [row] = encoder._tokenize_items([parse_input([PROMPTS["query"], text], 0)])
        assert row.input_ids == transformer.preprocess([prompt + text])["input_ids"][0].tolist()  # the same row
        assert prompt_length == len(row.input_ids) - row.span + 1, text  # one token of the text dropped


def test_long_texts_with_prompts_are_cut_as_the_encoder_cuts_them(tmp_path):
    """doc_max_length < max_length with prompts: the encoder keeps the instruction and cuts the text, so the export
    uses our module (stock truncation would cut prompt and text together); plain texts fit max_seq_length."""
    long = ["What is the capital of France? It is a city on the Seine " * 5, "word " * 40]
    settings = dict(skip_instruction=False, max_length=64, doc_max_length=16, device="cpu")
    for prompts, module in (({}, ST_TRANSFORMER), (PROMPTS, ENCODER_MODULE)):
        encoder = Encoder.from_pretrained(str(LLAMA_FIXTURE), prompts=prompts, **settings)
        folder = tmp_path / module
        encoder.save(str(folder), format="sentence-transformers")
        assert json.loads((folder / "modules.json").read_text())[0]["type"] == module
        model = load_st(folder)
        assert max_diff(model.encode(long), encoder.encode(long, show_progress_bar=False)) < 1e-5
        if prompts:
            ours = encoder.encode(long, prompt_name="query", show_progress_bar=False)
            assert max_diff(model.encode(long, prompt_name="query"), ours) < 1e-5
        else:
            assert model.max_seq_length == 17  # 16 text tokens + BOS


def test_prompted_long_non_ascii_texts_are_cut_as_the_encoder_cuts(tmp_path):
    """The encoder cuts a long prompted text at a character of the text; sentence-transformers' stock Transformer
    cuts the row at a token, and a character spread over byte-fallback tokens left the rows a token apart (0.18 on
    this text with the stock module). With prompts the folder is our module, and the vectors agree."""
    encoder = Encoder.from_pretrained(str(LLAMA_FIXTURE), device="cpu", skip_instruction=False, max_length=32,
                                      doc_max_length=32, prompts={"query": "Represent the proof"})
    encoder.save(str(tmp_path), format="sentence-transformers")
    assert json.loads((tmp_path / "modules.json").read_text())[0]["type"] == ENCODER_MODULE
    text = ["Ünïcødé ταξίδι 旅行 🚀🚀 " * 15]
    ours = encoder.encode(text, prompt_name="query", show_progress_bar=False)
    assert max_diff(load_st(tmp_path).encode(text, prompt_name="query"), ours) < 1e-5


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        (dict(pooling_mode="latent_attention", skip_instruction=False), "pooling_mode='latent_attention'"),
        (dict(skip_instruction=False, prompt_template="<|user|>{text}<|end|>"), "prompt_template"),
        (dict(pooling_mode="eos_token", skip_instruction=False), "eos_suffix=' </s>'"),
        (dict(pooling_mode="mean", skip_instruction=True), "skip_instruction=True"),
        (dict(skip_instruction=False, prompts=PROMPTS), "doc_max_length=400 < max_length=512"),
        (dict(skip_instruction=False, prompts=PROMPTS, doc_max_length=512), "prompts: the encoder cuts a long"),
    ],
    ids=["latent", "template", "eos_suffix", "skip_instruction", "prompt_truncation", "prompt_cut"],
)
def test_stock_only_refuses_what_sentence_transformers_modules_cannot_express(tmp_path, settings, named):
    encoder = Encoder.from_pretrained(str(LLAMA_FIXTURE), device="cpu", **settings)
    with pytest.raises(ValueError, match="its own modules only") as error:
        save_sentence_transformers(encoder, str(tmp_path / "out"), stock_only=True)
    assert named in str(error.value)
    assert not (tmp_path / "out").exists()


def test_custom_module_folder_never_loads_silently_as_a_plain_model(tmp_path):
    encoder = Encoder.from_pretrained(str(LLAMA_FIXTURE), device="cpu")  # skip_instruction: our module
    encoder.save(str(tmp_path), format="sentence-transformers")
    with pytest.raises(ValueError, match="diffusion_embedder.st_modules.EncoderModule"):
        SentenceTransformer(str(tmp_path), device="cpu")
    with pytest.raises(ValueError, match="Unknown export format 'onnx'"):
        encoder.save(str(tmp_path / "x"), format="onnx")


def test_custom_module_takes_model_kwargs_and_saves_again(tmp_path):
    """sentence-transformers' model_kwargs (dtype, attention) reach our module, and its own save() round-trips."""
    encoder = Encoder.from_pretrained(str(DREAM_FIXTURE), pooling_mode="mask_token", device="cpu")
    encoder.save(str(tmp_path / "a"), format="sentence-transformers")
    half = load_st(tmp_path / "a", model_kwargs={"torch_dtype": torch.bfloat16, "attn_implementation": "eager"})
    assert half[0].encoder.model.dtype == torch.bfloat16
    assert half[0].encoder.model.config._attn_implementation == "eager"
    model = load_st(tmp_path / "a")
    model.save(str(tmp_path / "b"))
    again = load_st(tmp_path / "b")
    assert max_diff(again.encode(TEXTS), encoder.encode(TEXTS, show_progress_bar=False)) < 1e-5
    again.max_seq_length = 8  # sentence-transformers' setter reaches the encoder's max_length
    short = Encoder.from_pretrained(str(DREAM_FIXTURE), pooling_mode="mask_token", max_length=8, device="cpu")
    assert max_diff(again.encode(TEXTS), short.encode(TEXTS, show_progress_bar=False)) < 1e-5


def test_legacy_adapter_config_drops_only_defaults():
    """Newer peft's keys at their defaults go (peft 0.12 would refuse them); one in use stays, to fail by name."""
    written = {"peft_type": "LORA", "r": 4, "peft_version": "0.21", "alora_invocation_tokens": None,
               "use_qalora": True, "lora_dropout": 0.0}
    assert legacy_adapter_config(written) == {"peft_type": "LORA", "r": 4, "use_qalora": True, "lora_dropout": 0.0}


@pytest.mark.parametrize("family", FIXTURES)
def test_adapter_folder_card_and_config(tmp_path, family):
    """An adapter folder names its base as loaded, is a FEATURE_EXTRACTION adapter, carries our model card (not
    peft's template) whose peft recipe runs and gives the encoder's token states, reloads to the same vectors,
    and exports merged to sentence-transformers."""
    encoder = Encoder.from_pretrained(str(FIXTURES[family]), device="cpu")
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    encoder.model = get_peft_model(encoder.model, lora)
    before = encoder.encode(TEXTS, show_progress_bar=False)
    folder = tmp_path / "adapter"
    encoder.save(str(folder))
    adapter = json.loads((folder / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(FIXTURES[family])
    assert adapter["task_type"] == "FEATURE_EXTRACTION"
    assert set(adapter) <= PEFT_012_LORA_FIELDS  # peft 0.12 (LLM2Vec 0.2.3) reads it: bench/compat_llm2vec.sh
    card = (folder / "README.md").read_text()
    assert "Model Card for Model ID" not in card
    for loader in ("Encoder.from_pretrained", "SentenceTransformer", "PeftModel"):
        assert loader in card, loader
    if family == "llama":
        assert f'LLM2Vec.from_pretrained("{FIXTURES[family]}", peft_model_name_or_path="{folder}")' in card
    else:  # llm2vec's Qwen2 model (what Dream runs on) stays causal: the card says so instead of a wrong recipe
        assert "would not reproduce this encoder" in card and "Qwen2 model stays causal" in card
    recipe = {}
    exec(re.search(r"## peft\n\n```python\n(.*?)```", card, re.S).group(1), recipe)  # the card's peft recipe
    ids = torch.tensor([[5, 9, 12, 40, 7, 3]])
    with torch.no_grad():
        expected = encoder.model(input_ids=ids).last_hidden_state
        assert max_diff(recipe["model"](input_ids=ids).last_hidden_state, expected) < 1e-5
    reloaded = Encoder.from_pretrained(str(folder), device="cpu")
    assert max_diff(reloaded.encode(TEXTS, show_progress_bar=False), before) < 1e-5

    encoder.save(str(tmp_path / "st"), format="sentence-transformers")
    assert not (tmp_path / "st" / "adapter_config.json").exists()
    assert max_diff(load_st(tmp_path / "st").encode(TEXTS), before) < 1e-5
    card = (tmp_path / "st" / "README.md").read_text()
    assert "trust_remote_code=True" in card and "library_name: sentence-transformers" in card


def test_cli_export(tmp_path, capsys):
    """diffusion-embedder export CHECKPOINT OUT: format, dtype and stock_only reach the export."""
    source = tmp_path / "encoder"
    Encoder.from_pretrained(str(LLAMA_FIXTURE), skip_instruction=False, device="cpu").save(str(source))
    assert "Encoder.from_pretrained" in (source / "README.md").read_text()
    out = tmp_path / "st"
    assert cli_main(["export", str(source), str(out), "--format", "sentence-transformers"]) == 0
    encoder = Encoder.from_pretrained(str(source), device="cpu")
    assert max_diff(load_st(out).encode(TEXTS), encoder.encode(TEXTS, show_progress_bar=False)) < 1e-5

    assert cli_main(["export", str(source), str(tmp_path / "bf16"), "--torch_dtype", "bfloat16"]) == 0
    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), "pt") as f:
        assert f.get_tensor(next(iter(f.keys()))).dtype == torch.bfloat16

    latent = tmp_path / "latent"
    Encoder.from_pretrained(str(LLAMA_FIXTURE), pooling_mode="latent_attention", device="cpu").save(str(latent))
    assert cli_main(["export", str(latent), str(tmp_path / "refused"), "--stock_only"]) == 2
    assert "pooling_mode='latent_attention'" in capsys.readouterr().err
    assert not (tmp_path / "refused").exists()


def test_export_to_a_file_says_so_in_our_words(tmp_path, capsys):
    """Before, a raw FileExistsError (or NotADirectoryError) from os.makedirs, after loading the checkpoint."""
    from diffusion_embedder.export import FORMATS, export

    taken = tmp_path / "taken.txt"
    taken.write_text("not a folder")
    for out, where in ((taken, "is a file"), (taken / "sub", f"lies under {taken}, which is a file")):
        assert cli_main(["export", str(LLAMA_FIXTURE), str(out)]) == 2
        assert capsys.readouterr().err == f"error: OUTPUT {out} {where}, not a folder; choose another path, or " \
                                          "move the file away.\n"
    encoder = Encoder.from_pretrained(str(LLAMA_FIXTURE), device="cpu")
    for format in FORMATS:  # the API too, every format: the same message, the file untouched
        with pytest.raises(ValueError, match=f"^Output folder {taken} is a file, not a folder"):
            export(encoder, str(taken), format)
    with pytest.raises(ValueError, match=f"lies under {taken}, which is a file"):
        encoder.save(str(taken / "sub"))
    assert taken.read_text() == "not a folder"


def hand_similarity(name: str, a, b) -> np.ndarray:
    """sentence-transformers' definitions, pair by pair in float64: cosine, dot, negative L2 and L1 distances."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    pair = {"cosine": lambda x, y: x @ y / np.sqrt((x @ x) * (y @ y)), "dot": lambda x, y: x @ y,
            "euclidean": lambda x, y: -np.sqrt(((x - y) ** 2).sum()), "manhattan": lambda x, y: -np.abs(x - y).sum()}
    return np.array([[pair[name](x, y) for y in b] for x in a])


#: A folder of sentence-transformers' own modules, and one naming our EncoderModule (skip_instruction).
MODULE_SETTINGS = {
    ST_TRANSFORMER: {"skip_instruction": False, "max_length": 128, "doc_max_length": 128, "prompts": {}},
    ENCODER_MODULE: {"skip_instruction": True, "prompts": PROMPTS},
}


@pytest.mark.parametrize("module", list(MODULE_SETTINGS), ids=["stock", "EncoderModule"])
@pytest.mark.parametrize("name", list(SIMILARITY_FUNCTIONS))
def test_the_exported_folder_scores_with_the_encoders_similarity_function(tmp_path, name, module):
    """The folder names the encoder's similarity function, and sentence-transformers, loading it, scores queries
    against documents with it: the values computed by hand in float64 from its vectors, and our
    ``Encoder.similarity`` on ours."""
    encoder = Encoder.from_pretrained(str(LLAMA_FIXTURE), similarity_fn_name=name, device="cpu",
                                      **MODULE_SETTINGS[module])  # fmt: skip
    encoder.save(str(tmp_path), format="sentence-transformers")
    assert json.loads((tmp_path / "modules.json").read_text())[0]["type"] == module
    assert json.loads((tmp_path / "config_sentence_transformers.json").read_text())["similarity_fn_name"] == name
    model = load_st(tmp_path)
    assert model.similarity_fn_name == name
    queries, documents = model.encode_query(TEXTS[:2]), model.encode_document(TEXTS)
    scores = model.similarity(queries, documents)
    assert_close_normwise(scores, hand_similarity(name, queries, documents), eps_multiple=HAND_EPS, rows=True)
    ours = encoder.similarity(encoder.encode_query(TEXTS[:2], show_progress_bar=False),
                              encoder.encode_document(TEXTS, show_progress_bar=False))  # fmt: skip
    assert_close_normwise(scores, ours, eps_multiple=ORDER_EPS, rows=True)
