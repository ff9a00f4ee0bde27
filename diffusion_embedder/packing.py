"""Padding-free batches: texts concatenated into rows, positions restarting at each text, attention kept inside it.

transformers only detects packed sequences (from ``position_ids``) on its causal path; with
``is_causal=False`` packed texts silently attend to each other. So attention is confined here, in the form
each attention implementation wants. ``varlen`` (``diffusion_embedder.varlen``) takes the rows' cumulative
offsets (``cu_seq_lens``, made by ``pack``) and no mask; the others get a block-diagonal mask passed 4D
(transformers then uses it as is): boolean for ``sdpa``, additive float for ``eager`` (it adds the mask to
the scores, so a boolean mask would be wrong there), a ``BlockMask`` for ``flex_attention``. A row holding
one text needs no mask. A dense mask costs rows x width^2, which is why rows are bounded by a pack length.
Packed inference forwards of an ``sdpa`` model run on varlen where its kernel runs (``varlen.dispatched``):
SDPA has no flash kernel for an arbitrary mask, varlen needs none.

Pooling reads each text's own span: the hidden states are gathered back into the left-padded layout
of the padded path, so every pooling mode runs the same code on the same values.

Packed features are a plain dict, so collators (contrastive, pretraining) build them with ``pack``
and the encoder's forward recognises them by their ``unpack_index``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Literal

import torch

from diffusion_embedder import varlen
from diffusion_embedder.values import AT_LEAST_ONE, require

logger = logging.getLogger(__name__)

#: The key that marks a feature dict as packed.
PACKED_KEY = "unpack_index"
#: The cumulative offsets of the sequences in the flattened rows (``varlen``'s ``cu_seq_lens``).
OFFSETS_KEY = "cu_seq_lens"
#: Upper bound on the row width of packed encoding per device type (a dense block mask holds
#: rows x width^2 entries); texts longer than this are encoded in rows of their own, without a mask.
MAX_ROW_LENGTH = {"cpu": 4096, "cuda": 8192}
#: What ``encode(packing=...)`` accepts: on, off, or "auto" (``AUTO_PACKING``).
PACKING_TYPE = bool | Literal["auto"]


def is_packed(features: dict) -> bool:
    return PACKED_KEY in features


def pack_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices grouped into rows of at most ``capacity`` tokens (first-fit decreasing).

    A text longer than ``capacity`` gets a row of its own.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    rows: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(max(capacity - lengths[i], 0))
    return rows


#: Device types whose packed forwards come in a bounded set of shapes, because their attention compiles a
#: kernel per shape (flex_attention; ``torch.compile``): rows as wide as a power of two (at least
#: ``MIN_BOUNDED_WIDTH``), and as many rows as a power of two, empty rows filling the last forward of a step.
#: CPU rows are as wide as the longest text and no wider (nothing compiles per shape there).
BOUNDED_SHAPES = {"cuda": True}
MIN_BOUNDED_WIDTH = 128


def next_power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def row_length(lengths: Sequence[int], device_type: str) -> int:
    """Row width for packed encoding: the longest text, so attention per token costs no more than padded,
    bounded by ``MAX_ROW_LENGTH`` (dense masks cost rows x width^2); longer texts get rows of their own.
    Where ``BOUNDED_SHAPES``, rounded up to a power of two (``MAX_ROW_LENGTH`` values are powers of two)."""
    cap = MAX_ROW_LENGTH.get(device_type, 8192)
    width = max(1, min(max(lengths), cap))
    if BOUNDED_SHAPES.get(device_type, False):
        width = min(max(next_power_of_two(width), MIN_BOUNDED_WIDTH), cap)
    return width


def plan_batches(lengths: Sequence[int], width: int, rows_per_batch: int) -> list[list[int]]:
    """Text indices per forward: rows of at most ``width`` tokens (first-fit decreasing), fullest rows first,
    ``rows_per_batch`` rows per forward; a text longer than ``width`` is a forward of its own (it needs no mask).
    """
    require("rows_per_batch", rows_per_batch, int, bounds=AT_LEAST_ONE)
    rows = pack_rows(lengths, require("pack row length", width, int, bounds=AT_LEAST_ONE))
    rows.sort(key=lambda row: -sum(lengths[i] for i in row))
    batches: list[list[int]] = []
    group: list[list[int]] = []
    for row in rows:
        if sum(lengths[i] for i in row) > width:
            batches.append(row)
            continue
        if len(group) == rows_per_batch:
            batches.append([i for r in group for i in r])
            group = []
        group.append(row)
    if group:
        batches.append([i for r in group for i in r])
    return batches


def pad(sequences: Sequence[tuple[Sequence[int], int]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """The padded layout of ``(input_ids, span)`` pairs (LLM2Vec's, left-padded): ``input_ids``, ``attention_mask``
    and ``embed_mask`` (B, L), the last marking each row's pooled span."""
    width = max(len(ids) for ids, _ in sequences)
    input_ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
    embed_mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, (ids, span) in enumerate(sequences):
        if ids:
            input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, width - len(ids) :] = 1
        if span:
            embed_mask[row, width - span :] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "embed_mask": embed_mask}


def pack(
    sequences: Sequence[tuple[Sequence[int], int]], capacity: int, pad_token_id: int, bounded: bool = False
) -> dict[str, torch.Tensor]:
    """Pack ``(input_ids, span)`` pairs (span: how many trailing tokens are pooled) into rows.

    Returns ``input_ids``, ``position_ids`` and ``segment_ids`` (R, W) for the model (padding after
    the last text of a row gets a segment of its own per token), plus, per text in input order,
    ``unpack_index`` (B, T) into the flattened rows and the padded path's ``attention_mask`` and
    ``embed_mask`` (B, T), left-aligned exactly as ``Encoder.tokenize`` lays them out. Rows are as
    wide as the fullest one; ``bounded`` makes them ``capacity`` wide and their number a power of two
    (empty rows of padding), so forwards come in few shapes (``BOUNDED_SHAPES``). ``cu_seq_lens`` (int32)
    delimits the sequences of the flattened rows for ``varlen``: each text, then its row's padding in pieces
    of at most the longest text's length, so that length (``unpack_index``'s width) bounds every sequence.
    Where every row holds one whole text and no padding, ``segment_ids`` is left out: the forward then needs
    no mask, which it can tell from the keys without reading the device.
    """
    lengths = [len(ids) for ids, _ in sequences]
    rows = pack_rows(lengths, capacity)
    width = max(max(sum(lengths[i] for i in row) for row in rows), 1)
    longest = max(max(lengths), 1)
    n_rows, n_texts = len(rows), len(sequences)
    if bounded:
        width, n_rows = max(width, capacity), next_power_of_two(n_rows)
    input_ids = torch.full((n_rows, width), pad_token_id, dtype=torch.long)
    position_ids = torch.zeros((n_rows, width), dtype=torch.long)
    segment_ids = (-1 - torch.arange(width)).repeat(n_rows, 1)
    unpack_index = torch.zeros((n_texts, longest), dtype=torch.long)
    attention_mask = torch.zeros((n_texts, longest), dtype=torch.long)
    embed_mask = torch.zeros((n_texts, longest), dtype=torch.long)
    ranges = torch.arange(max(longest, width))
    offsets = [0]
    for r in range(n_rows):
        start = 0
        for i in (rows[r] if r < len(rows) else ()):
            ids, span = sequences[i]
            n = lengths[i]
            if not n:
                continue
            input_ids[r, start : start + n] = torch.as_tensor(ids, dtype=torch.long)
            position_ids[r, start : start + n] = ranges[:n]
            segment_ids[r, start : start + n] = i
            unpack_index[i, longest - n :] = r * width + start + ranges[:n]
            attention_mask[i, longest - n :] = 1
            if span:
                embed_mask[i, longest - span :] = 1
            start += n
            offsets.append(r * width + start)
        while offsets[-1] < (r + 1) * width:  # the row's padding
            offsets.append(min(offsets[-1] + longest, (r + 1) * width))
    features = {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "segment_ids": segment_ids,
        PACKED_KEY: unpack_index,
        "attention_mask": attention_mask,
        "embed_mask": embed_mask,
        OFFSETS_KEY: torch.tensor(offsets, dtype=torch.int32),
    }
    if n_rows == len(rows) and all(len(row) == 1 and lengths[row[0]] == width for row in rows):
        del features["segment_ids"]  # one whole text per row: no mask (``packed_hidden``), decided here on the host
    return features


def unpack_sequences(features: dict[str, torch.Tensor]) -> list[tuple[list[int], int]]:
    """The ``(input_ids, span)`` pairs a packed feature dict was built from, in input order."""
    flat = features["input_ids"].reshape(-1)
    out = []
    for index, mask, span in zip(
        features[PACKED_KEY], features["attention_mask"].bool(), features["embed_mask"].sum(-1), strict=True
    ):
        out.append((flat[index[mask]].tolist(), int(span)))
    return out


# ---------------------------------------------------------------------------------------------- masks
def _allowed(segment_ids: torch.Tensor, causal: bool) -> torch.Tensor:
    """(R, 1, W, W) True where a query may attend to a key: same segment (and not ahead, when causal)."""
    allowed = segment_ids[:, :, None] == segment_ids[:, None, :]
    if causal:
        width = segment_ids.shape[1]
        allowed &= torch.ones(width, width, dtype=torch.bool, device=segment_ids.device).tril()
    return allowed[:, None]


def boolean_mask(segment_ids: torch.Tensor, causal: bool, dtype: torch.dtype):
    return _allowed(segment_ids, causal)


def additive_mask(segment_ids: torch.Tensor, causal: bool, dtype: torch.dtype):
    allowed = _allowed(segment_ids, causal)
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, torch.finfo(dtype).min
    )


def flex_block_mask(segment_ids: torch.Tensor, causal: bool, dtype: torch.dtype):
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(batch, head, q_idx, kv_idx):
        same = segment_ids[batch, q_idx] == segment_ids[batch, kv_idx]
        return same & (q_idx >= kv_idx) if causal else same

    rows, width = segment_ids.shape
    return create_block_mask(mask_mod, rows, None, width, width, device=segment_ids.device)


#: Mask builder per attention implementation; these and ``varlen`` (offsets, no mask) are the ones packed.
MASK_BUILDERS: dict[str, Callable] = {
    "sdpa": boolean_mask,
    "eager": additive_mask,
    "flex_attention": flex_block_mask,
}
PACKED_IMPLEMENTATIONS = (*MASK_BUILDERS, varlen.NAME)


def attention_implementation(model: torch.nn.Module) -> str:
    return getattr(model.config, "_attn_implementation", None) or "eager"


def packing_problem(model: torch.nn.Module, longest: int) -> str | None:
    """Why this model can't run packed batches, or None when it can."""
    impl = attention_implementation(model)
    if impl not in PACKED_IMPLEMENTATIONS:
        return f"attn_implementation={impl!r} has no packed path (supported: {', '.join(PACKED_IMPLEMENTATIONS)})"
    if impl == varlen.NAME and varlen.config_problem(model.config):
        return varlen.config_problem(model.config)
    window = sliding_window(model.config)
    if window is not None and longest > window:
        return f"sliding-window attention (window {window}) with a text of {longest} tokens"
    return None


def sliding_window(config) -> int | None:
    """The window transformers confines some of this model's layers to, or None.

    Gemma2/3 and Qwen2/3 name their windowed layers in ``layer_types`` (Qwen2's ``use_sliding_window`` sets them);
    Mistral's models window every layer whenever ``sliding_window`` is set (MistralConfig's default is 4096).
    """
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return window if "sliding_attention" in layer_types else None
    return None if getattr(config, "use_sliding_window", None) is False else window


def varlen_offsets(features: dict[str, torch.Tensor]) -> dict:
    """The packing's offsets as transformers' FlashAttention keywords (every sequence is at most as long as
    ``unpack_index`` is wide: a shape, so no host synchronisation)."""
    longest = features[PACKED_KEY].shape[1]
    offsets = features[OFFSETS_KEY]
    return {"cu_seq_lens_q": offsets, "cu_seq_lens_k": offsets, "max_length_q": longest, "max_length_k": longest}


def hidden_states(model: torch.nn.Module, features: dict[str, torch.Tensor]) -> torch.Tensor:
    """The backbone's last hidden states (B, L, d) in the padded layout, for padded or packed rows (``pack``)."""
    if is_packed(features):
        return packed_hidden(model, features)
    attention_mask = features["attention_mask"]
    position_ids = (attention_mask.cumsum(-1) - 1).clamp_min(0)
    return model(
        input_ids=features["input_ids"].long(), attention_mask=padded_mask(model, attention_mask),
        position_ids=position_ids, use_cache=False,
    ).last_hidden_state


def key_padding_mask(attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return attention_mask.bool()[:, None, None, :]


def additive_key_padding_mask(attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    mask = torch.zeros(attention_mask.shape[0], 1, 1, attention_mask.shape[1], dtype=dtype,
                       device=attention_mask.device)
    return mask.masked_fill_(~attention_mask.bool()[:, None, None, :], torch.finfo(dtype).min)


#: Padded bidirectional rows need only their keys masked: one (B, 1, 1, L) mask, which transformers passes as
#: is (4D) and the kernel broadcasts, instead of the (B, 1, L, L) mask transformers builds for every forward
#: (32 rows of 4,096 tokens: 512 MiB). Every real token's output is the same, bit for bit (tests); padded query
#: rows attend to the real keys instead of none, and nothing reads them. On 2 CPU cores SDPA itself ran ~10%
#: faster with it; a whole encode changed within the machine's noise, 0.96-1.05x (bench/results/cpu_forward.md).
KEY_MASK_BUILDERS: dict[str, Callable] = {"sdpa": key_padding_mask, "eager": additive_key_padding_mask}


def padded_mask(model: torch.nn.Module, attention_mask: torch.Tensor) -> torch.Tensor:
    """The mask a padded forward passes: the key-padding mask where it means the same as transformers' own
    (bidirectional attention, no sliding window narrower than the rows, ``KEY_MASK_BUILDERS``), else the 2D mask
    for transformers to expand."""
    builder = KEY_MASK_BUILDERS.get(attention_implementation(model))
    window = sliding_window(model.config)
    if builder is None or getattr(model.config, "is_causal", True) or (
            window is not None and attention_mask.shape[1] > window):
        return attention_mask
    return builder(attention_mask, model.get_input_embeddings().weight.dtype)


def packed_hidden(model: torch.nn.Module, features: dict[str, torch.Tensor]) -> torch.Tensor:
    """Run the backbone on packed rows; return hidden states in the padded layout (B, T, d).

    On ``varlen`` the rows' offsets confine attention; a model loaded with ``sdpa`` runs its packed inference
    forwards there too where the kernel runs (``varlen.dispatch_problem``); the others get their block mask.
    """
    impl = attention_implementation(model)
    inputs = {"input_ids": features["input_ids"], "position_ids": features["position_ids"], "use_cache": False}
    if impl == varlen.NAME or (impl == "sdpa" and varlen.dispatch_problem(model) is None):
        with varlen.dispatched(model):
            hidden = model(**inputs, attention_mask=None, **varlen_offsets(features)).last_hidden_state
        return hidden.reshape(-1, hidden.shape[-1])[features[PACKED_KEY]]
    causal = bool(getattr(model.config, "is_causal", True))
    mask = None  # no segment_ids: one text per row, no padding (``pack``): plain attention, as configured
    if "segment_ids" in features:  # a key, not a value: deciding reads nothing from the device
        dtype = model.get_input_embeddings().weight.dtype
        mask = MASK_BUILDERS[impl](features["segment_ids"], causal, dtype)
    hidden = model(**inputs, attention_mask=mask).last_hidden_state
    return hidden.reshape(-1, hidden.shape[-1])[features[PACKED_KEY]]


#: What ``packing="auto"`` does per (device type, attention implementation): True packs, False pads, and
#: ``VARLEN_KERNEL`` packs where the varlen kernel runs for the model (else pads).
#: CPU: padded. On 2 cores with oneDNN linear layers (bench/results/encode.md), packed rows never paid: 512
#: ReasonAug texts cut at 400 tokens tie (medians 9.5 s padded, 9.65 s packed; padded efficiency already 0.977),
#: and 400 texts up to 2,048 tokens take 22.6 / 21.9 s padded vs 35.1 / 36.0 s packed (efficiency 0.869),
#: because a packed row is as wide as the longest text and the dense block mask makes attention cost row width
#: squared. (``varlen`` on the CPU runs its per-text reference path: padded too, not measured packed.)
#: CUDA (one H200, 7B shape, bf16, main a4bfa6d; ../shared/gpu/2026-11-27.md): packed sdpa rows with a block mask
#: bought nothing (768 texts of 64-512 tokens: 32.4k tokens/s packed, 32.6k padded; cut 512: 36.6k vs 39.7k),
#: because SDPA has no flash kernel for an arbitrary mask; so sdpa packs only where its packed forwards run on
#: the varlen kernel (bf16/fp16, torch >= 2.10), and varlen packs. flex_attention packs: padded it compiles per
#: batch width (12.3k tokens/s padded, 32.3k packed). eager pads (dense mask, no flash kernel either way).
#: The varlen rows are not measured yet (bench/gpu_run.sh measures them beside the plain loop).
VARLEN_KERNEL = "varlen kernel"
AUTO_PACKING: dict[tuple[str, str], bool | str] = {
    ("cpu", "sdpa"): False,
    ("cpu", "eager"): False,
    ("cpu", "flex_attention"): False,
    ("cpu", varlen.NAME): False,
    ("cuda", "sdpa"): VARLEN_KERNEL,
    ("cuda", "eager"): False,
    ("cuda", "flex_attention"): True,
    ("cuda", varlen.NAME): True,
}
#: Padded rows that cost far more than packed ones, and why (said once when a forward runs them).
SLOW_PADDED = {
    ("cuda", "flex_attention"): "padded rows with flex_attention compile a kernel per batch width: 12.3k tokens/s "
    "against 32.3k packed on an H200 (7B shape); pack them (packing=True or 'auto') or use attn_implementation='sdpa'",
}


def check_packing(choice) -> str | bool:
    return require("packing", choice, PACKING_TYPE)


def use_packing(choice: str | bool, model: torch.nn.Module, device_type: str, longest: int) -> bool:
    """Resolve ``encode(packing=...)``: True must be possible (else a clear error), "auto" follows ``AUTO_PACKING``."""
    impl = attention_implementation(model)
    packed = _resolve_packing(check_packing(choice), model, device_type, longest, impl)
    if not packed and (device_type, impl) in SLOW_PADDED:
        varlen.say_once(f"Padded rows: {SLOW_PADDED[device_type, impl]}.")
    return packed


def _resolve_packing(choice: str | bool, model: torch.nn.Module, device_type: str, longest: int, impl: str) -> bool:
    if choice is False:
        return False
    problem = packing_problem(model, longest)
    if choice is True:
        if problem:
            raise ValueError(f"packing=True is not possible: {problem}. Use packing=False or 'auto'.")
        return True
    if problem:
        logger.debug("Not packing: %s.", problem)
        return False
    auto = AUTO_PACKING.get((device_type, impl), False)
    if auto == VARLEN_KERNEL:
        dtype = model.get_input_embeddings().weight.dtype
        slow = varlen.kernel_problem(torch.device(device_type), dtype, varlen.head_dim(model.config)) or (
            varlen.config_problem(model.config))
        if slow:
            varlen.say_once(f"packing='auto' pads {impl} rows on {device_type}: packed rows pay only on the varlen "
                            f"kernel, and {slow}. Fast: {varlen.FAST}.")
        return slow is None
    return bool(auto)
