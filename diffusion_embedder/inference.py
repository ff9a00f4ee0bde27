"""``Encoder.encode``'s work: inputs and prompts, the tokenization pipeline, batching, devices, the output.

The stages, in order: ``prepare_inputs`` (validate, apply a prompt), ``tokenize_items`` (the tokenization
pipeline: a function of the tokenizer, the settings and the inputs only), ``make_batches`` (length-sorted
or packed), ``run_batches`` (one device, or a pool of persistent workers; ``run_on_pool`` for a pool the caller
started) and ``finish`` (Matryoshka truncation, normalization, quantization). Every argument is checked before the
first of them. Token states and per-input dicts (sentence-transformers' ``output_value``) take ``outputs`` in
place of the last two. Of the encoder's modules only this one plans packed batches and imports quantization and
the device pool (``multiprocess``); ``encoder`` uses ``packing`` only to collate and run packed rows, which
training uses too.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
from tqdm.auto import tqdm

from diffusion_embedder import outputs
from diffusion_embedder import packing as packing_mod
from diffusion_embedder.config import EncoderConfig
from diffusion_embedder.cpu_linear import onednn_linear
from diffusion_embedder.devices import check_device
from diffusion_embedder.quantization import check_precision, quantize_embeddings
from diffusion_embedder.templates import TextInput, parse_input, parse_inputs, placeholder_token, render

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- tokenization pipeline
@dataclass
class Tokenized:
    """One input after tokenization, unpadded: its ids and how many trailing tokens are the pooled span."""

    input_ids: list[int]
    span: int


def _token_ids(tokenizer, texts: list[str], special: bool = True, key: str = "input_ids") -> list[list]:
    """Untruncated tokenization; lengths are checked by the caller, so the tokenizer's warning is noise."""
    return tokenizer(texts, add_special_tokens=special, return_offsets_mapping=key == "offset_mapping", verbose=False)[
        key
    ]


def _cut_texts(tokenizer, items: list[TextInput], limits: list[int]) -> list[TextInput]:
    """Cut each text to at most ``limits[i]`` tokens at a token boundary, keeping its instruction."""
    offsets_per_text = _token_ids(tokenizer, [it.text for it in items], special=False, key="offset_mapping")
    out = []
    for item, offsets, limit in zip(items, offsets_per_text, limits, strict=True):
        if len(offsets) > limit:
            item = replace(item, text=item.text[: offsets[limit - 1][1]] if limit > 0 else "")
        out.append(item)
    return out


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
    Each text is tokenized once whole (the exact LLM2Vec sequence); only texts past ``max_length``
    (default ``config.max_length``) are cut and tokenized again, until they fit (a cut can move a
    BPE boundary by a token). ``doc_max_length`` first cuts every text to that many tokens.
    """
    if doc_max_length is not None:
        items = _cut_texts(tokenizer, items, [doc_max_length] * len(items))
    template, eos = config.prompt_template, config.applied_eos_suffix
    max_length = (max_length or config.max_length) - len(readout)  # the appended mask tokens always fit
    result: list[Tokenized] = [None] * len(items)  # type: ignore[list-item]
    pending, truncated = list(range(len(items))), set()
    while pending:
        rendered = [render(items[i], template, eos) for i in pending]
        full = _token_ids(tokenizer, [r[0] for r in rendered])
        spans = _token_ids(tokenizer, [r[1] for r in rendered], special=False)
        over = []
        for i, ids, span in zip(pending, full, spans, strict=True):
            ids = ids or [placeholder_token(tokenizer)]  # no tokens at all: documented stand-in
            if len(ids) <= max_length:
                result[i] = Tokenized(ids + readout, len(readout) or min(len(span), len(ids)))
            elif not items[i].text:
                raise ValueError(
                    f"Input {i}: the instruction and template alone take {len(ids) + len(readout)} tokens, "
                    f"more than max_length={config.max_length}; shorten the instruction or raise max_length."
                )
            else:
                over.append((i, len(ids) - max_length))
        if over:
            text_tokens = _token_ids(tokenizer, [items[i].text for i, _ in over], special=False)
            limits = [max(len(t) - excess, 0) for t, (_, excess) in zip(text_tokens, over, strict=True)]
            cut = _cut_texts(tokenizer, [items[i] for i, _ in over], limits)
            for (i, _), item in zip(over, cut, strict=True):
                items[i] = item if item != items[i] else replace(item, text=item.text[:-1])
                truncated.add(i)
        pending = [i for i, _ in over]
    if truncated:
        logger.log(
            logging.WARNING if warn else logging.DEBUG,
            "%d of %d texts were longer than max_length=%d tokens and were truncated on the text side.",
            len(truncated),
            len(items),
            max_length,
        )
    return result


# --------------------------------------------------------------------------- inputs and prompts
def _is_single_triple(sentences) -> bool:
    return (
        isinstance(sentences, list | tuple)
        and len(sentences) == 3
        and isinstance(sentences[0], str)
        and isinstance(sentences[1], str)
        and isinstance(sentences[2], int)
    )


def _resolve_prompt(prompts: dict[str, str], prompt: str | None, prompt_name: str | None) -> str | None:
    if prompt is not None and prompt_name is not None:
        raise ValueError("Pass either prompt or prompt_name, not both.")
    if prompt_name is None:
        return prompt
    if prompt_name not in prompts:
        raise ValueError(
            f"Unknown prompt_name {prompt_name!r}; this encoder's prompts are {sorted(prompts)} "
            "(set them with Encoder.from_pretrained(..., prompts={...}))."
        )
    return prompts[prompt_name]


def _with_prompt(item: TextInput, prompt: str, index: int) -> TextInput:
    if item.prefix:
        raise ValueError(f"Input {index} already carries an instruction; a prompt applies to plain-string inputs only.")
    return parse_input([prompt, item.text], index)


def prepare_inputs(
    sentences, prompts: dict[str, str], prompt: str | None, prompt_name: str | None
) -> tuple[list[TextInput], bool]:
    """The validated inputs with the prompt (or ``prompts[prompt_name]``) applied, and whether one string was given."""
    single = isinstance(sentences, str)
    if _is_single_triple(sentences):
        sentences = [sentences]  # as LLM2Vec: one [instruction, text, id] input
    items = parse_inputs([sentences] if single else sentences)
    prompt = _resolve_prompt(prompts, prompt, prompt_name)
    if prompt is not None:
        items = [_with_prompt(item, prompt, i) for i, item in enumerate(items)]
    return items, single


def role_kwargs(role: str, prompts: dict[str, str], kwargs: dict) -> dict:
    """``encode_query`` / ``encode_document``: the role's prompt, when the encoder has one and no other is given."""
    if kwargs.get("prompt") is None and kwargs.get("prompt_name") is None and role in prompts:
        kwargs = {**kwargs, "prompt_name": role}
    return kwargs


# --------------------------------------------------------------------------- batching and devices
def check_batch_size(batch_size) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}.")


def length_batches(lengths: Sequence[int], batch_size: int, max_tokens_per_batch: int | None = None) -> list[list[int]]:
    """Indices grouped into batches, longest first.

    By count, or, with ``max_tokens_per_batch``, by padded size (rows x longest row): long documents
    don't exhaust memory and short ones fill it. A single text longer than the budget gets its own batch.
    """
    check_batch_size(batch_size)
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = lengths[current[0]] if current else lengths[i]
        full = len(current) >= batch_size if max_tokens_per_batch is None else (
            (len(current) + 1) * longest > max_tokens_per_batch
        )
        if current and full:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def make_batches(
    encoder, lengths: list[int], device_type: str, batch_size: int, max_tokens_per_batch: int | None, packing
) -> tuple[list[list[int]], Callable[[list[Tokenized]], dict[str, torch.Tensor]]]:
    """The batches (indices) and the collate function: packed rows where ``packing`` asks for them, else padded."""
    if packing_mod.use_packing(packing, encoder.model, device_type, max(lengths)):
        width = packing_mod.row_length(lengths, device_type)
        rows = batch_size
        if max_tokens_per_batch is not None:
            rows = max(1, packing_mod.check_positive("max_tokens_per_batch", max_tokens_per_batch) // width)
        return packing_mod.plan_batches(lengths, width, rows), functools.partial(
            encoder._collate_packed, pack_length=width
        )
    return length_batches(lengths, batch_size, max_tokens_per_batch), encoder._collate


def _resolve_devices(device, encoder) -> list:
    if device is None:
        on_gpu = encoder.device.type == "cuda" and not hasattr(encoder.model, "hf_device_map")
        if on_gpu and torch.cuda.device_count() > 1:
            return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
        return [None]
    if isinstance(device, str | torch.device):
        check_device(device)
        return [device]
    devices = list(device)
    if not devices:
        raise ValueError("device=[] names no device: give a device, a list of devices, or None (automatic).")
    for one in devices:
        check_device(one)
    return devices


def pool_devices(target_devices: Sequence[str] | None) -> list[str]:
    """sentence-transformers' pool devices: the ones given (checked), else every CUDA device, else 4 CPU workers."""
    if target_devices is None:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return [f"cuda:{i}" for i in range(count)] if count else ["cpu"] * 4
    devices = [target_devices] if isinstance(target_devices, str) else list(target_devices)
    if not devices:
        raise ValueError("target_devices=[] names no device: give devices, or None (every GPU, else 4 CPU workers).")
    for one in devices:
        check_device(one, "target_devices")
    return [str(one) for one in devices]


def start_pool(encoder, devices: Sequence[str]):
    """One persistent worker per device, each holding a copy of ``encoder``."""
    from diffusion_embedder.multiprocess import DevicePool

    return DevicePool(encoder, list(devices))


def _encode_local(encoder, tokenized, batches, device, show_progress_bar, collate) -> torch.Tensor:
    if device is not None and torch.device(device) != encoder.device:
        encoder.to(device)
    out = torch.empty((len(tokenized), encoder.embedding_dim), dtype=torch.float32)
    was_training = encoder.training
    encoder.eval()
    with torch.inference_mode(), onednn_linear(encoder.model, encoder.device):
        for batch in tqdm(batches, desc="Encoding", disable=not show_progress_bar):
            features = collate([tokenized[i] for i in batch])
            features = {k: v.to(encoder.device) for k, v in features.items()}
            out[batch] = encoder(features).float().cpu()
    encoder.train(was_training)
    return out


def own_pool(encoder, devices: Sequence[str]):
    """The encoder's own workers on ``devices`` (``Encoder.start_pool``), started again if absent or stale."""
    workers = encoder._pool_workers
    if workers is None or workers.closed or workers.devices != list(devices) or workers.config != encoder.config:
        encoder.start_pool(devices)
    return encoder._pool_workers


def _encode_on_pool(encoder, tokenized, batches, devices, show_progress_bar, collate) -> torch.Tensor:
    return run_on_pool(own_pool(encoder, devices), encoder, tokenized, batches, show_progress_bar, collate)


def run_on_pool(pool, encoder, tokenized, batches, show_progress_bar: bool, collate) -> torch.Tensor:
    """(n, d) float32 embeddings on the CPU, in input order, computed by ``pool``'s workers."""
    out = torch.empty((len(tokenized), encoder.embedding_dim), dtype=torch.float32)
    features = [collate([tokenized[i] for i in batch]) for batch in batches]
    done = pool.run(features)
    for index, embeddings in tqdm(done, total=len(batches), desc="Encoding", disable=not show_progress_bar):
        out[batches[index]] = embeddings
    return out


def run_batches(encoder, tokenized, batches, devices: list, show_progress_bar: bool, collate) -> torch.Tensor:
    """(n, d) float32 embeddings on the CPU, in input order: on one device, or shared by a pool of workers."""
    if len(devices) > 1:
        return _encode_on_pool(encoder, tokenized, batches, devices, show_progress_bar, collate)
    return _encode_local(encoder, tokenized, batches, devices[0], show_progress_bar, collate)


# --------------------------------------------------------------------------- the output
def check_truncate_dim(truncate_dim, embedding_dim: int) -> int | None:
    """None keeps every dimension; else an integer in 1..``embedding_dim`` (sentence-transformers would return
    empty vectors for 0 and every dimension for more: refused here rather than silently different)."""
    if truncate_dim is None:
        return None
    if isinstance(truncate_dim, bool) or not isinstance(truncate_dim, int) or not 1 <= truncate_dim <= embedding_dim:
        raise ValueError(
            f"truncate_dim must be an integer from 1 to the embedding dimension {embedding_dim} "
            f"(or None: all of them), got {truncate_dim!r}."
        )
    return truncate_dim


def finish(
    out: torch.Tensor,
    truncate_dim: int | None,
    normalize_embeddings: bool,
    precision: str,
    single: bool,
    convert_to_numpy: bool,
    convert_to_tensor: bool,
) -> torch.Tensor | np.ndarray:
    """sentence-transformers' post-processing: keep ``truncate_dim`` dimensions, L2-normalize, quantize."""
    if truncate_dim is not None:
        out = out[:, :truncate_dim]
    if normalize_embeddings:
        out = torch.nn.functional.normalize(out, dim=-1)
    if precision != "float32" and len(out):
        out = torch.from_numpy(quantize_embeddings(out.numpy(), precision))
    if single:
        out = out[0]
    if convert_to_numpy and not convert_to_tensor:
        return out.numpy()
    return out


def _check_call(call: EncoderConfig, readout: list[int]) -> None:
    """Lengths this call cannot run with, named as given (the call's ``max_length``, not the encoder's)."""
    if call.max_length <= len(readout):
        raise ValueError(
            f"max_length={call.max_length} leaves no token for the text: mask_token pooling appends "
            f"{len(readout)} mask token(s) (mask_readout_tokens={call.mask_readout_tokens}); give max_length > "
            f"{len(readout)}."
        )


def _check_pool(pool, device, encoder) -> None:
    from diffusion_embedder.multiprocess import DevicePool

    if not isinstance(pool, DevicePool):
        raise TypeError(f"pool must be what start_multi_process_pool() returned, got {type(pool).__name__}.")
    if device is not None:
        raise ValueError(f"Pass either pool or device, not both: the pool's devices are {pool.devices}.")
    pool.check_use(encoder)


def encode(
    encoder,
    sentences,
    batch_size: int,
    show_progress_bar: bool,
    convert_to_numpy: bool,
    convert_to_tensor: bool,
    device,
    *,
    prompt: str | None,
    prompt_name: str | None,
    output_value: str | None,
    normalize_embeddings: bool,
    truncate_dim: int | None,
    precision: str | None,
    pool,
    chunk_size: int | None,
    max_tokens_per_batch: int | None,
    max_length: int | None,
    doc_max_length: int | None,
    packing: str | bool,
) -> torch.Tensor | np.ndarray | list:
    """``Encoder.encode``, whose docstring says what each argument does."""
    precision = check_precision("float32" if precision is None else precision)  # None: sentence-transformers' float32
    outputs.check_output_value(output_value, precision)
    check_batch_size(batch_size)
    for name, value in (("max_tokens_per_batch", max_tokens_per_batch), ("chunk_size", chunk_size)):
        if value is not None:
            packing_mod.check_positive(name, value)
    truncate_dim = check_truncate_dim(
        truncate_dim if truncate_dim is not None else encoder.truncate_dim, encoder.embedding_dim
    )
    if pool is not None:
        _check_pool(pool, device, encoder)
        devices = list(pool.devices)
    else:
        devices = _resolve_devices(device, encoder)
    items, single = prepare_inputs(sentences, encoder.config.prompts, prompt, prompt_name)
    overrides = {"max_length": max_length, "doc_max_length": doc_max_length}
    call = encoder.config.replace(**{k: v for k, v in overrides.items() if v is not None})  # validated
    _check_call(call, encoder._mask_readout_ids())
    if not items:
        if output_value != "sentence_embedding":
            return []
        out = torch.zeros((0, encoder.embedding_dim), dtype=torch.float32)
        return finish(out, truncate_dim, normalize_embeddings, precision, single, convert_to_numpy, convert_to_tensor)
    tokenized = encoder._tokenize_items(
        items, doc_max_length=call.doc_max_length, max_length=call.max_length, config=call
    )
    lengths = [len(t.input_ids) for t in tokenized]
    device_type = torch.device(devices[0] or encoder.device).type
    if output_value != "sentence_embedding":
        batches = length_batches(lengths, batch_size, max_tokens_per_batch)
        if pool is None and len(devices) > 1:
            pool = own_pool(encoder, devices)
        rows = outputs.run_rows(encoder, tokenized, batches, devices[0], pool, show_progress_bar)
        return outputs.select(rows, output_value, truncate_dim, single)
    batches, collate = make_batches(encoder, lengths, device_type, batch_size, max_tokens_per_batch, packing)
    if pool is not None:
        out = run_on_pool(pool, encoder, tokenized, batches, show_progress_bar, collate)
    else:
        out = run_batches(encoder, tokenized, batches, devices, show_progress_bar, collate)
    return finish(out, truncate_dim, normalize_embeddings, precision, single, convert_to_numpy, convert_to_tensor)
