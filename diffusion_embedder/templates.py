"""Input formatting: instructions, chat templates and the pooled span, byte-compatible with LLM2Vec.

A pair ``[instruction, text]`` becomes ``instruction.strip() + " " + text`` (just ``text`` without an
instruction), optionally wrapped in a chat template and followed by an EOS string for ``eos_token``
pooling. The pooled span is everything after the instruction: the text plus any template suffix.
That is exactly what LLM2Vec's ``!@#$%^&*()`` separator marks, so its published checkpoints give the
same vectors here.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

SEPARATOR = "!@#$%^&*()"

_IM_TEMPLATE = "<|im_start|>user\n{text}<|im_end|>"
#: LLaDA's chat format; its tokenizer adds no BOS, so the template carries it (as LLaDA's chat template does).
_LLADA_TEMPLATE = "<|startoftext|><|start_header_id|>user<|end_header_id|>\n\n{text}<|eot_id|>"

#: Chat wrappers LLM2Vec hard-coded by hub name (kept for compatibility), plus Dream's and LLaDA's.
#: Unlike upstream, the template is an encoder setting saved with the checkpoint, so training and
#: evaluation see the same format.
DEFAULT_TEMPLATES: dict[str, str] = {
    "meta-llama/Meta-Llama-3-8B-Instruct": "<|start_header_id|>user<|end_header_id|>\n\n{text}<|eot_id|>",
    "mistralai/Mistral-7B-Instruct-v0.2": "[INST] {text} [/INST]",
    "meta-llama/Llama-2-7b-chat-hf": "[INST] {text} [/INST]",
    "google/gemma-2-9b-it": "<bos><start_of_turn>user\n{text}<end_of_turn>",
    "Qwen/Qwen2-1.5B-Instruct": _IM_TEMPLATE,
    "Qwen/Qwen2-7B-Instruct": _IM_TEMPLATE,
    "Dream-org/Dream-v0-Instruct-7B": _IM_TEMPLATE,
    "siyue/Dream_emb": _IM_TEMPLATE,
    "GSAI-ML/LLaDA-8B-Instruct": _LLADA_TEMPLATE,
    "GSAI-ML/LLaDA-1.5": _LLADA_TEMPLATE,
}

#: EOS strings LLM2Vec used for ``eos_token`` pooling where they differ from the backbone default.
#: Llama-3-Instruct's template already ends the turn, so LLM2Vec appended nothing.
EOS_SUFFIX_OVERRIDES: dict[str, str] = {
    "meta-llama/Meta-Llama-3-8B": "<|end_of_text|>",
    "meta-llama/Meta-Llama-3-8B-Instruct": "",
}

#: Encoder settings LLM2Vec forced for known checkpoints.
KNOWN_SETTINGS: dict[str, dict] = {
    "intfloat/e5-mistral-7b-instruct": {
        "pooling_mode": "eos_token",
        "max_length": 4096,
        "doc_max_length": 4096,
        "skip_instruction": False,
    },
}


class PreparedText(str):
    """A string ``Encoder.prepare_for_tokenization`` returned: template and EOS string already applied, so
    ``tokenize`` takes it as it is (LLM2Vec's two steps, ``tokenize([prepare_for_tokenization(t)])``)."""


@dataclass(frozen=True)
class TextInput:
    """One input: the literal text before the pooled span, and the user's text."""

    prefix: str
    text: str
    #: Template and EOS string already applied (a ``PreparedText``): ``render`` adds neither.
    prepared: bool = False


def _check_unicode(value: str, index: int, name: str) -> str:
    """Refuse lone surrogates (e.g. from a bad decode): a tokenizer can't encode them and fails far from the input."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"Input {index}: the {name} is not valid Unicode: lone surrogate {value[e.start]!r} at character {e.start}."
        ) from None
    return value


def parse_input(item: object, index: int) -> TextInput:
    """Validate one ``encode`` input: a string (optionally with the separator) or an ``[instruction, text]`` pair."""
    if isinstance(item, str):
        _check_unicode(item, index, "text")
        prepared = isinstance(item, PreparedText)
        if SEPARATOR in item:
            prefix, _, text = item.partition(SEPARATOR)
            return TextInput(prefix, text.replace(SEPARATOR, ""), prepared)
        return TextInput("", str(item), prepared)
    if isinstance(item, list | tuple):
        if len(item) == 3 and isinstance(item[2], int) and not isinstance(item[2], bool):
            item = item[:2]  # LLM2Vec's [instruction, text, id] triples (MEDI): it reads the first two
        if len(item) != 2:
            raise ValueError(
                f"Input {index} is a sequence of length {len(item)}; expected a string, an [instruction, text] "
                "pair or an [instruction, text, int] triple."
            )
        instruction, text = item
        for part, name in ((instruction, "instruction"), (text, "text")):
            if not isinstance(part, str):
                raise TypeError(f"Input {index}: the {name} must be a string, got {type(part).__name__}.")
            _check_unicode(part, index, name)
        instruction = instruction.strip()
        return TextInput(f"{instruction} " if instruction else "", text)
    raise TypeError(f"Input {index} must be a string or an [instruction, text] pair, got {type(item).__name__}.")


def parse_inputs(items: Iterable[object]) -> list[TextInput]:
    """Validate a collection of inputs; anything else (None, a number, bytes) is a TypeError naming its type."""
    if isinstance(items, str):
        raise TypeError("Expected a list of inputs, got a single string; wrap it in a list.")
    if isinstance(items, bytes | bytearray) or not isinstance(items, Iterable):
        raise TypeError(
            "Expected a string or a list of strings / [instruction, text] pairs, got "
            f"{type(items).__name__}{' (decode bytes to str first)' if isinstance(items, bytes | bytearray) else ''}."
        )
    return [parse_input(item, i) for i, item in enumerate(items)]


def placeholder_token(tokenizer) -> int:
    """The one token of a row that would otherwise have none (an empty text, no template, no BOS: Dream).

    BOS where the tokenizer has one (what the other rows start with), else EOS, else the pad token:
    a defined input, so the embedding is finite and independent of the batch.
    """
    for token_id in (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id):
        if token_id is not None:
            return token_id
    raise ValueError("The tokenizer has no BOS, EOS or pad token to stand for an empty text.")


def left_padded(tokenizer, owned: bool = False):
    """``tokenizer`` with a pad token (its EOS when it has none) and left padding, LLM2Vec's layout.

    One that lacks them is copied first unless ``owned`` (loaded by us, seen by no caller): the
    caller's tokenizer is never changed.
    """
    if tokenizer.pad_token_id is not None and tokenizer.padding_side == "left":
        return tokenizer
    if not owned:
        tokenizer = copy.deepcopy(tokenizer)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def render(item: TextInput, template: str | None, eos_suffix: str) -> tuple[str, str]:
    """The full string to tokenize and the part of it that is pooled (LLM2Vec's text after the separator)."""
    marked = f"{item.prefix}{SEPARATOR}{item.text}"
    if item.prepared:
        template, eos_suffix = None, ""
    if template:
        marked = template.replace("{text}", marked.strip())
    if eos_suffix:
        marked = marked.strip() + eos_suffix
    prefix, _, span = marked.partition(SEPARATOR)
    return prefix + span, span


def known_settings(names: Sequence[str | None]) -> dict:
    """Settings LLM2Vec hard-coded for published checkpoints with one of ``names`` (templates included)."""
    known: dict = {}
    for name in reversed(list(names)):
        known.update(KNOWN_SETTINGS.get(name, {}))
    template = default_template(names)
    if template is not None:
        known["prompt_template"] = template
    return known


def default_template(names: Sequence[str | None]) -> str | None:
    """The chat template LLM2Vec applied for the first known name, if any."""
    return next((DEFAULT_TEMPLATES[n] for n in names if n in DEFAULT_TEMPLATES), None)


def eos_suffix_for(names: Sequence[str | None], eos_format: str, eos_token: str | None) -> str:
    """The string appended for ``eos_token`` pooling."""
    for name in names:
        if name in EOS_SUFFIX_OVERRIDES:
            return EOS_SUFFIX_OVERRIDES[name]
    if not eos_token:
        raise ValueError("eos_token pooling needs a tokenizer with an EOS token.")
    return eos_format.format(eos=eos_token)
