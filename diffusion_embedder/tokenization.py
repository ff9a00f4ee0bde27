"""The tokenization pipeline: inputs in LLM2Vec's format to token ids and pooled spans, at the tokenizer's speed.

A row is ``tokenize(render(prefix, text))`` with the tokenizer's special tokens; its pooled span is the
last n tokens, n = ``len(tokenize(span))`` without special tokens, where span is the text plus any
template suffix and EOS string (``templates.render``; LLM2Vec's format). Two paths give exactly that:

- **Plain items** (no instruction, no template, no EOS string: documents, as a rule). The row is the
  text's tokens between the fixed special tokens the post-processor adds to a single sequence (found
  once per call by probing, and used only where the probes agree), so ONE batch call gives both the
  row and the span (n = the text's token count). An over-long text keeps its first k tokens, k as
  many as fit with ``doc_max_length`` and ``max_length``: what the tokenizer's own ``truncation=True``
  keeps, and what LLM2Vec keeps for a text without instruction.
- **Other items** cost a text-alone call, which gives every cut point and the span where the span is
  the text, or the text followed by a suffix that a special token splits off (a chat template's end),
  and the full call; a span call only for the rest. Over-long texts are cut on the text side at a token
  boundary of the text-alone call (the instruction and the template suffix stay whole) and only the cut,
  short rows are tokenized again, until they fit (a cut can move a BPE boundary by a token). Texts
  longer than the whole row budget are first cut to ``budget + PRECUT_MARGIN`` tokens, so no whole
  over-long text is tokenized more than once.

Every text that fits gets the ids and span of the straightforward algorithm (``tests/test_tokenization.py``
keeps it as the oracle). Where a plain over-long text is cut, the kept tokens are the first k tokens of
the text's own tokenization; the old rule tokenized the cut string again. The two agree wherever the cut
string's tokens are the first tokens of the whole string: on ReasonAug texts cut at 400 and 512 tokens
(two realistic tokenizers, ``bench/tokenize_speed.py``) not one row differed; in the test corpus one
did, 400 emoji cut where a byte-level token ends inside a character (the old rule's cut string then
keeps the whole character, so it tokenized to different last tokens).

The batch calls go to the fast tokenizer's Rust backend directly (no ``BatchEncoding``; offsets are
converted only where a cut reads them), which releases the GIL (checked: a Python thread runs on
during ``encode_batch``), so ``inference`` tokenizes the next
batches in a thread while the device runs. Other tokenizers get their own ``__call__``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

from diffusion_embedder.config import EncoderConfig
from diffusion_embedder.templates import TextInput, placeholder_token, render

logger = logging.getLogger(__name__)

try:
    from transformers.tokenization_utils_tokenizers import TokenizersBackend
except ImportError:  # a transformers without the Rust-backed base class: every tokenizer takes its own call
    TokenizersBackend = None

#: A text longer than the row budget by more than this many tokens cannot fit whatever its instruction
#: merges with, so it is cut to ``budget + PRECUT_MARGIN`` tokens before the full and span calls.
PRECUT_MARGIN = 16
#: Probe strings whose ids with and without special tokens reveal the post-processor's fixed tokens.
_PROBES = ("a", "a b c", "")


@dataclass
class Tokenized:
    """One input after tokenization, unpadded: its ids and how many trailing tokens are the pooled span."""

    input_ids: list[int]
    span: int


class _Encoded(NamedTuple):
    ids: list[int]
    offsets: list[tuple[int, int]]


#: Held while a backend's state is set and used: truncation, padding and special-token splitting are state of the
#: Rust tokenizer, shared by every thread that tokenizes with it (two ``encode`` calls in two threads on one
#: encoder). Without it one call's truncation cut the other's texts.
_BACKEND_STATE = threading.RLock()


class TokenizerCalls:
    """Batch calls of one tokenizer: its Rust backend where the Hugging Face call adds nothing to it, else that call.

    The backend's truncation and padding are per-call state that the Hugging Face call sets every time;
    they are cleared here the same way, so the backend tokenizes whole texts.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.backend = None
        overridden = TokenizersBackend is None or type(tokenizer)._encode_plus is not TokenizersBackend._encode_plus
        if not overridden and isinstance(tokenizer, TokenizersBackend):
            self.backend = tokenizer.backend_tokenizer
        self.specials = self._fixed_specials()
        self._tails: dict[str, int | None] = {}

    def _whole_texts(self) -> None:
        """The backend set to tokenize whole texts as the tokenizer would (under ``_BACKEND_STATE``)."""
        backend = self.backend
        if backend.truncation is not None:
            backend.no_truncation()
        if backend.padding is not None:
            backend.no_padding()
        if backend.encode_special_tokens != self.tokenizer.split_special_tokens:
            backend.encode_special_tokens = self.tokenizer.split_special_tokens

    def encode(self, texts: Sequence[str], special: bool) -> list:
        """Objects with ``.ids`` and ``.offsets`` (offsets of the text's own characters), one per text."""
        if not texts:
            return []
        if self.backend is not None:
            with _BACKEND_STATE:
                self._whole_texts()
                return self.backend.encode_batch(list(texts), add_special_tokens=special)
        out = self.tokenizer(list(texts), add_special_tokens=special, return_offsets_mapping=True, verbose=False)
        return [_Encoded(ids, offsets) for ids, offsets in zip(out["input_ids"], out["offset_mapping"], strict=True)]

    def first_ids(self, texts: Sequence[str], keep: int) -> list[tuple[list[int], bool]]:
        """The first ``keep`` token ids of each text (no special tokens), and whether the text had more.

        The backend truncates in Rust, as the tokenizer's own ``truncation=True`` does, so a long text's
        ids are never converted to a Python list whole.
        """
        if self.backend is None or not texts:
            return [(ids[:keep], len(ids) > keep) for ids in self.ids(texts, False)]
        with _BACKEND_STATE:
            self._whole_texts()
            self.backend.enable_truncation(keep)
            try:
                encoded = self.backend.encode_batch(list(texts), add_special_tokens=False)
                return [(e.ids, bool(e.overflowing)) for e in encoded]
            finally:
                self.backend.no_truncation()

    def ids(self, texts: Sequence[str], special: bool) -> list[list[int]]:
        if self.backend is not None:
            return [e.ids for e in self.encode(texts, special)]
        return self.tokenizer(list(texts), add_special_tokens=special, verbose=False)["input_ids"] if texts else []

    def tail_length(self, span: str, text: str) -> int | None:
        """``len(tokenize(span)) - len(tokenize(text))`` where it follows from the text's own tokens, else None.

        True where the span is the text itself, or the text followed by a suffix (template end, EOS string)
        that starts with a special token matched on the raw string: the backend splits there first and
        tokenizes the pieces apart, so the span's tokens are the text's and then the suffix's.
        """
        if span == text:
            return 0
        if self.backend is None or not span.startswith(text):
            return None
        suffix = span[len(text) :]
        if suffix not in self._tails:
            splits = not self.tokenizer.split_special_tokens and any(
                suffix.startswith(token.content) and token.special and not token.normalized and not token.lstrip
                for token in self.backend.get_added_tokens_decoder().values()
            )
            self._tails[suffix] = len(self.ids([suffix], False)[0]) if splits else None
        return self._tails[suffix]

    def _fixed_specials(self) -> tuple[list[int], list[int]] | None:
        """(prefix, suffix) ids the post-processor adds around any single text, or None where the probes disagree."""
        (with_special,), (without,) = self.ids([_PROBES[0]], True), self.ids([_PROBES[0]], False)
        head = next((k for k in range(len(with_special)) if with_special[k : k + len(without)] == without), None)
        if not without or head is None:
            return None
        pair = with_special[:head], with_special[head + len(without) :]
        for probe in _PROBES[1:]:
            (with_special,), (without,) = self.ids([probe], True), self.ids([probe], False)
            if with_special != pair[0] + without + pair[1]:
                return None
        return pair


def cut_text(item: TextInput, encoded, limit: int) -> TextInput:
    """``item`` with its text cut after its first ``limit`` tokens (``encoded``: the text's own tokenization)."""
    return replace(item, text=item.text[: encoded.offsets[limit - 1][1]] if limit > 0 else "")


def tokenize_chunk(
    tokenizer,
    config: EncoderConfig,
    readout: list[int],
    items: Sequence[TextInput],
    doc_max_length: int | None = None,
    max_length: int | None = None,
    indices: Sequence[int] | None = None,
) -> tuple[list[Tokenized], int]:
    """``tokenize_items``' work without the warning: the rows, and how many texts were cut to fit ``max_length``.

    ``indices`` are the inputs' positions in the caller's list, for error messages (default 0, 1, ...).
    """
    calls = TokenizerCalls(tokenizer)
    template, eos = config.prompt_template, config.applied_eos_suffix
    budget = (max_length or config.max_length) - len(readout)  # the appended mask tokens always fit
    indices = list(range(len(items))) if indices is None else list(indices)
    fast = calls.specials is not None and budget > sum(map(len, calls.specials))
    plain, other = [], []
    for k, item in enumerate(items):
        full, span = render(item, template, eos)
        (plain if fast and full == span == item.text else other).append(k)
    result: list[Tokenized] = [None] * len(items)  # type: ignore[list-item]
    rows, cut_plain = _plain_rows(calls, [items[k] for k in plain], budget, doc_max_length, readout, tokenizer)
    for k, row in zip(plain, rows, strict=True):
        result[k] = row
    rows, cut_other = _general_rows(
        calls, [items[k] for k in other], [indices[k] for k in other], template, eos, budget, doc_max_length,
        readout, tokenizer, max_length or config.max_length,
    )
    for k, row in zip(other, rows, strict=True):
        result[k] = row
    return result, cut_plain + cut_other


def _plain_rows(calls, items, budget, doc_max_length, readout, tokenizer) -> tuple[list[Tokenized], int]:
    """Rows of plain items from one text-alone call: fixed specials around the first tokens that fit."""
    head, tail = calls.specials or ([], [])
    room = budget - len(head) - len(tail)
    keep = room if doc_max_length is None else min(room, doc_max_length)
    rows, truncated = [], 0
    for ids, longer in calls.first_ids([it.text for it in items], keep):
        if longer and (doc_max_length is None or doc_max_length > room):  # a doc_max_length cut is documented
            truncated += 1
        row = head + ids + tail or [placeholder_token(tokenizer)]  # no tokens at all: documented stand-in
        rows.append(Tokenized(row + readout, len(readout) or min(len(ids), len(row))))
    return rows, truncated


def _general_rows(
    calls, items, indices, template, eos, budget, doc_max_length, readout, tokenizer, max_length
) -> tuple[list[Tokenized], int]:
    """Rows of items with an instruction, a template or an EOS string: full and span calls, cuts on the text side.

    ``own[k]`` is always the tokenization of item k's current text: the span where the span is the text,
    and the cut points. A cut text is tokenized again at once (one call for all cut rows, which are short).
    """
    items = list(items)
    own = dict(enumerate(calls.encode([it.text for it in items], special=False)))
    truncated, cut = set(), []
    for k, encoded in own.items():
        n = len(encoded.ids) if doc_max_length is None else min(len(encoded.ids), doc_max_length)
        if n > budget + PRECUT_MARGIN:  # cannot fit: cut before the full and span calls
            n = budget + PRECUT_MARGIN
            truncated.add(k)
        if n < len(encoded.ids):
            items[k] = cut_text(items[k], encoded, n)
            cut.append(k)
    own.update(zip(cut, calls.encode([items[k].text for k in cut], special=False), strict=True))
    result: list[Tokenized] = [None] * len(items)  # type: ignore[list-item]
    pending = list(range(len(items)))
    while pending:
        rendered = [render(items[k], template, eos) for k in pending]
        full = calls.ids([r[0] for r in rendered], special=True)
        tails = [calls.tail_length(r[1], items[k].text) for k, r in zip(pending, rendered, strict=True)]
        fresh = iter(calls.ids([r[1] for r, tail in zip(rendered, tails, strict=True) if tail is None], special=False))
        over = []
        for k, ids, tail in zip(pending, full, tails, strict=True):
            span = len(next(fresh)) if tail is None else len(own[k].ids) + tail
            ids = ids or [placeholder_token(tokenizer)]  # no tokens at all: documented stand-in
            if len(ids) <= budget:
                result[k] = Tokenized(ids + readout, len(readout) or min(span, len(ids)))
            elif not items[k].text:
                raise ValueError(
                    f"Input {indices[k]}: the instruction and template alone take {len(ids) + len(readout)} tokens, "
                    f"more than max_length={max_length}; shorten the instruction or raise max_length."
                )
            else:
                over.append((k, len(ids) - budget))
        for k, excess in over:
            shorter = cut_text(items[k], own[k], max(len(own[k].ids) - excess, 0))
            items[k] = shorter if shorter != items[k] else replace(shorter, text=shorter.text[:-1])
            truncated.add(k)
        pending = [k for k, _ in over]
        own.update(zip(pending, calls.encode([items[k].text for k in pending], special=False), strict=True))
    return result, len(truncated)


def tokenize_items(
    tokenizer,
    config: EncoderConfig,
    readout: list[int],
    items: list[TextInput],
    doc_max_length: int | None = None,
    warn: bool = True,
    max_length: int | None = None,
) -> list[Tokenized]:
    """Tokenize as LLM2Vec does; over-long texts are cut on the text side so the instruction survives.

    ``readout`` is the token ids appended after every text (``mask_token`` pooling; [] otherwise).
    ``doc_max_length`` first keeps at most that many tokens of every text; ``max_length`` (default
    ``config.max_length``) bounds the whole row. The module docstring says how each is cut.
    """
    rows, truncated = tokenize_chunk(tokenizer, config, readout, items, doc_max_length, max_length)
    warn_truncated(truncated, len(items), (max_length or config.max_length) - len(readout), warn)
    return rows


def warn_truncated(truncated: int, total: int, budget: int, warn: bool = True) -> None:
    """One log line per call (a warning for ``encode``, debug for training batches) for the texts cut to fit."""
    if truncated:
        logger.log(
            logging.WARNING if warn else logging.DEBUG,
            "%d of %d texts were longer than max_length=%d tokens and were truncated on the text side.",
            truncated,
            total,
            budget,
        )
