"""The tokenization pipeline against the straightforward algorithm it replaced, kept here as the oracle.

Every text that fits must get the oracle's ids and span, byte for byte, on every fixture tokenizer, with
and without instructions, templates, EOS strings, prepared texts and readout tokens. Cut texts follow the
documented rule (``diffusion_embedder.tokenization``): a plain text keeps the first tokens of its own
tokenization (what the tokenizer's ``truncation=True`` keeps), other texts are cut on the text side.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace

import pytest
from conftest import DREAM_FIXTURE, FIXTURES, LLADA_FIXTURE, LLAMA_FIXTURE, MISTRAL_FIXTURE

from diffusion_embedder.backbones import load_tokenizer
from diffusion_embedder.config import EncoderConfig
from diffusion_embedder.templates import (
    DEFAULT_TEMPLATES,
    SEPARATOR,
    PreparedText,
    TextInput,
    left_padded,
    parse_inputs,
    placeholder_token,
    render,
)
from diffusion_embedder.tokenization import PRECUT_MARGIN, Tokenized, TokenizerCalls, tokenize_items


# ------------------------------------------------------------------------------------------ the oracle
def _reference_ids(tokenizer, texts, special=True, key="input_ids"):
    return tokenizer(texts, add_special_tokens=special, return_offsets_mapping=key == "offset_mapping", verbose=False)[
        key
    ]


def _reference_cut(tokenizer, items, limits):
    offsets_per_text = _reference_ids(tokenizer, [it.text for it in items], special=False, key="offset_mapping")
    out = []
    for item, offsets, limit in zip(items, offsets_per_text, limits, strict=True):
        if len(offsets) > limit:
            item = replace(item, text=item.text[: offsets[limit - 1][1]] if limit > 0 else "")
        out.append(item)
    return out


def reference_tokenize(tokenizer, config, readout, items, doc_max_length=None, max_length=None):
    """The pipeline before issue 19: every text tokenized whole and text-alone; over-long ones cut and
    tokenized again until they fit. Returns the rows and the indices of the texts cut to fit."""
    items = list(items)
    if doc_max_length is not None:
        items = _reference_cut(tokenizer, items, [doc_max_length] * len(items))
    template, eos = config.prompt_template, config.applied_eos_suffix
    max_length = (max_length or config.max_length) - len(readout)
    result = [None] * len(items)
    pending, truncated = list(range(len(items))), set()
    while pending:
        rendered = [render(items[i], template, eos) for i in pending]
        full = _reference_ids(tokenizer, [r[0] for r in rendered])
        spans = _reference_ids(tokenizer, [r[1] for r in rendered], special=False)
        over = []
        for i, ids, span in zip(pending, full, spans, strict=True):
            ids = ids or [placeholder_token(tokenizer)]
            if len(ids) <= max_length:
                result[i] = Tokenized(ids + readout, len(readout) or min(len(span), len(ids)))
            elif not items[i].text:
                raise ValueError("instruction and template alone")
            else:
                over.append((i, len(ids) - max_length))
        if over:
            text_tokens = _reference_ids(tokenizer, [items[i].text for i, _ in over], special=False)
            limits = [max(len(t) - excess, 0) for t, (_, excess) in zip(text_tokens, over, strict=True)]
            cut = _reference_cut(tokenizer, [items[i] for i, _ in over], limits)
            for (i, _), item in zip(over, cut, strict=True):
                items[i] = item if item != items[i] else replace(item, text=item.text[:-1])
                truncated.add(i)
        pending = [i for i, _ in over]
    return result, truncated


# ------------------------------------------------------------------------------------------ the corpus
def corpus_texts() -> list[str]:
    real = [json.loads(line)["text"] for line in (FIXTURES / "beir" / "reasonaug" / "corpus.jsonl").open()]
    odd = [
        "", " ", "   ", "\n", "\n\n\t", "a", " leading space", "trailing space ", "  both  ",
        "Ünïcödé façade – naïve “quotes” …", "日本語のテキストと中文文本混合", "emoji 🙂🚀👩‍👩‍👧 and ZWJ",
        "combining e\u0301 and Hangul \u1100\u1161", "עברית ועربي mixed RTL", "tabs\tand\r\nCRLF\r\n",
        "<s> looks special </s>", "<|im_end|> inside <|endoftext|>", "word " * 300, "x" * 3000,
        "supercalifragilisticexpialidocious " * 40, "1234567890" * 50, "🙂" * 400,
    ]
    return real[::3] + odd


def corpus_items() -> list[TextInput]:
    texts = corpus_texts()
    instructions = ["", "Given a question, retrieve the answer", "  Retrieve  ", "Find: 中文"]
    items = []
    for i, text in enumerate(texts):
        items.append(TextInput("", text))
        items.extend(parse_inputs([[instructions[i % 4], text]]))
        if i % 5 == 0:
            items.append(TextInput("Instruction; ", text, prepared=True))
            items.append(TextInput("", text, prepared=True))
    items.extend(parse_inputs([f"inst {SEPARATOR}sep text", PreparedText(f"ready {SEPARATOR}made")]))
    return items


TOKENIZERS = {"llama": LLAMA_FIXTURE, "mistral": MISTRAL_FIXTURE, "dream": DREAM_FIXTURE, "llada": LLADA_FIXTURE}
FORMATS = {
    "plain": dict(),
    "eos": dict(pooling_mode="eos_token", eos_suffix=" </s>"),
    "im_template": dict(prompt_template=DEFAULT_TEMPLATES["Qwen/Qwen2-7B-Instruct"]),
    "llada_template": dict(prompt_template=DEFAULT_TEMPLATES["GSAI-ML/LLaDA-8B-Instruct"], pooling_mode="eos_token",
                           eos_suffix="<|endoftext|>"),
}  # fmt: skip


@pytest.fixture(scope="module", params=list(TOKENIZERS))
def tokenizer(request):
    return left_padded(load_tokenizer(str(TOKENIZERS[request.param])))


@pytest.mark.parametrize("form", list(FORMATS))
@pytest.mark.parametrize("limits", [(512, None), (128, 64), (48, 1000), (4096, 400)], ids=str)
@pytest.mark.parametrize("readout", [[], [3, 3]], ids=["no-readout", "readout"])
def test_pipeline_equals_the_oracle(tokenizer, form, limits, readout):
    max_length, doc_max_length = limits
    config = EncoderConfig().replace(max_length=max_length, **FORMATS[form])
    items = corpus_items()
    try:
        expected, truncated = reference_tokenize(tokenizer, config, readout, items, doc_max_length)
    except ValueError:  # a template longer than the row (the llada template in another family's vocabulary)
        with pytest.raises(ValueError, match="instruction and template alone"):
            tokenize_items(tokenizer, config, readout, items, doc_max_length, warn=False)
        return
    got = tokenize_items(tokenizer, config, readout, items, doc_max_length, warn=False)
    budget = max_length - len(readout)
    calls = TokenizerCalls(tokenizer)
    head, tail = calls.specials
    plain_cuts = 0
    for i, (item, mine, ref) in enumerate(zip(items, got, expected, strict=True)):
        assert len(mine.input_ids) <= max_length
        full, span = render(item, config.prompt_template, config.applied_eos_suffix)
        own = tokenizer(item.text, add_special_tokens=False)["input_ids"]
        doc_cut = doc_max_length is not None and len(own) > doc_max_length
        if i not in truncated and not doc_cut:
            assert mine == ref, (i, item)  # every text that fits: identical ids and span
        elif full == span == item.text:  # plain: the first tokens of the text's own tokenization
            kept = own[: min(budget - len(head) - len(tail), doc_max_length or len(own))]
            assert mine == Tokenized(head + kept + tail + readout, len(readout) or len(kept)), (i, item)
            plain_cuts += 1
        elif min(len(own), doc_max_length or len(own)) <= budget + PRECUT_MARGIN:
            assert mine == ref, (i, item)  # cut on the text side exactly as the oracle cuts
        else:  # first cut to the budget: the same rule, the cut may move by a BPE boundary
            assert abs(len(mine.input_ids) - len(ref.input_ids)) <= 1 and abs(mine.span - ref.span) <= 1, (i, item)
    if form == "plain" and (doc_max_length == 64 or max_length == 48):
        assert plain_cuts > 10  # the corpus does exercise the cut


def test_general_rows_equal_the_oracle_unless_precut(tokenizer):
    """Cut rows with an instruction: the oracle's ids wherever the text was not first cut to the budget."""
    config = EncoderConfig().replace(max_length=96)
    items = [TextInput("Given a question, retrieve the answer ", t) for t in corpus_texts()]
    got = tokenize_items(tokenizer, config, [], items, warn=False)
    expected, truncated = reference_tokenize(tokenizer, config, [], items)
    assert truncated
    for item, mine, ref in zip(items, got, expected, strict=True):
        own = tokenizer(item.text, add_special_tokens=False)["input_ids"]
        if len(own) <= 96 + PRECUT_MARGIN:
            assert mine == ref
        else:
            assert abs(len(mine.input_ids) - len(ref.input_ids)) <= 1 and len(mine.input_ids) <= 96


def test_fixed_specials_of_every_fixture_tokenizer(tokenizer):
    """The fast path's assumption (fixed special tokens around any single text) holds for every family."""
    calls = TokenizerCalls(tokenizer)
    assert calls.backend is not None and calls.specials is not None
    head, tail = calls.specials
    for text in corpus_texts()[-22:]:
        assert tokenizer(text)["input_ids"] == head + tokenizer(text, add_special_tokens=False)["input_ids"] + tail


def test_a_tokenizer_with_its_own_call_and_no_fixed_specials_takes_the_general_path(monkeypatch):
    tokenizer = left_padded(load_tokenizer(str(LLAMA_FIXTURE)))
    calls = TokenizerCalls(tokenizer)
    monkeypatch.setattr(TokenizerCalls, "_fixed_specials", lambda self: None)
    monkeypatch.setattr(calls, "backend", None)
    config = EncoderConfig().replace(max_length=40)
    items = corpus_items()[:60]
    got = tokenize_items(tokenizer, config, [], items, 30, warn=False)
    expected, truncated = reference_tokenize(tokenizer, config, [], items, 30)
    kept = [i for i in range(len(items)) if i not in truncated]
    assert [got[i] for i in kept] == [expected[i] for i in kept]


def test_truncation_warning_counts_cut_texts_once(tokenizer, caplog):
    config = EncoderConfig().replace(max_length=32)
    items = parse_inputs(["word " * 100, ["Find it", "word " * 100], "short", ["Find it", "short"]])
    with caplog.at_level(logging.WARNING):
        tokenize_items(tokenizer, config, [], items, 1000)
    messages = [r.getMessage() for r in caplog.records if "truncated" in r.getMessage()]
    assert messages == ["2 of 4 texts were longer than max_length=32 tokens and were truncated on the text side."]


def test_a_cut_to_doc_max_length_that_fills_the_row_is_not_a_truncation_warning(tokenizer, caplog):
    """doc_max_length equal to the room max_length leaves beside the special tokens is the documented document cut;
    only a row that max_length itself cuts is warned about."""
    config = EncoderConfig().replace(max_length=32)
    room = 32 - (len(tokenizer("a")["input_ids"]) - len(tokenizer("a", add_special_tokens=False)["input_ids"]))
    items = parse_inputs(["word " * 100])
    for doc_max_length, warned in ((room, False), (room + 1, True)):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            rows = tokenize_items(tokenizer, config, [], items, doc_max_length)
        assert len(rows[0].input_ids) == 32
        assert any("were truncated" in r.getMessage() for r in caplog.records) is warned, doc_max_length


def test_instruction_alone_too_long_names_the_input(tokenizer):
    config = EncoderConfig().replace(max_length=16)
    items = parse_inputs(["fine", ["word " * 50, ""]])
    with pytest.raises(ValueError, match="Input 1: the instruction and template alone take"):
        tokenize_items(tokenizer, config, [], items)


def test_the_tokenizer_state_the_hugging_face_call_sets_is_cleared():
    tokenizer = left_padded(load_tokenizer(str(LLAMA_FIXTURE)))
    tokenizer(["a b c d e f g h"], truncation=True, max_length=3, padding="max_length")
    config = EncoderConfig().replace(max_length=64)
    rows = tokenize_items(tokenizer, config, [], parse_inputs(["a b c d e f g h"]))
    assert rows[0].input_ids == tokenizer("a b c d e f g h")["input_ids"]


def test_two_threads_tokenizing_with_one_tokenizer_get_their_own_ids():
    """The Rust backend's truncation is state shared by every thread: one thread cutting plain texts at
    doc_max_length while another tokenizes whole instructed texts cut the other's rows (two ``encode`` calls on one
    encoder, as a threaded server makes them). Each thread's rows equal those of a run alone."""
    import threading

    from diffusion_embedder.templates import parse_inputs
    from diffusion_embedder.tokenization import tokenize_chunk

    tokenizer = load_tokenizer(str(LLAMA_FIXTURE))
    config = EncoderConfig(max_length=64, doc_max_length=64)
    plain = parse_inputs(["alpha beta gamma delta " * 40 + str(i) for i in range(64)])
    instructed = parse_inputs([["Represent the passage", f"word{i} " * (5 + i % 30)] for i in range(64)])
    alone = tokenize_chunk(tokenizer, config, [], instructed)[0]
    wrong: list[int] = []

    def cut_plain():
        for _ in range(60):
            tokenize_chunk(tokenizer, config, [], plain)

    def whole_instructed():
        for _ in range(60):
            rows = tokenize_chunk(tokenizer, config, [], instructed)[0]
            wrong.append(sum(r != s for r, s in zip(rows, alone, strict=True)))

    threads = [threading.Thread(target=cut_plain), threading.Thread(target=whole_instructed)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(wrong) == 60 and not any(wrong), f"{sum(map(bool, wrong))} of 60 rounds had rows cut"
