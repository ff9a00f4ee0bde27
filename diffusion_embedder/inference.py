"""``Encoder.encode``'s work: inputs and prompts, the tokenization pipeline, batching, devices, the output.

The stages, in order: ``prepare_inputs`` (validate, apply a prompt), ``tokenize_items`` (the tokenization
pipeline: a function of the tokenizer, the settings and the inputs only), ``make_batches`` (length-sorted
or packed), ``run_batches`` (one device, or a pool of persistent workers) and ``finish`` (Matryoshka
truncation, normalization, quantization). Of the encoder's modules only this one plans packed batches and
imports quantization, the device pool (``multiprocess``) and the CPU linear path; ``encoder`` uses
``packing`` only to collate and run packed rows, which training uses too.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from diffusion_embedder import packing as packing_mod
from diffusion_embedder.cpu_linear import onednn_linear
from diffusion_embedder.quantization import check_precision, quantize_embeddings
from diffusion_embedder.templates import TextInput, parse_input, parse_inputs
from diffusion_embedder.tokenization import Tokenized

logger = logging.getLogger(__name__)


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
        return [device]
    devices = list(device)
    if not devices:
        raise ValueError("device=[] names no device: give a device, a list of devices, or None (automatic).")
    return devices


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


def _encode_on_pool(encoder, tokenized, batches, devices, show_progress_bar, collate) -> torch.Tensor:
    if encoder._pool_workers is None or encoder._pool_workers.devices != list(devices):
        encoder.start_pool(devices)
    out = torch.empty((len(tokenized), encoder.embedding_dim), dtype=torch.float32)
    features = [collate([tokenized[i] for i in batch]) for batch in batches]
    for index, embeddings in tqdm(
        encoder._pool_workers.run(features), total=len(batches), desc="Encoding", disable=not show_progress_bar
    ):
        out[batches[index]] = embeddings
    return out


def run_batches(encoder, tokenized, batches, devices: list, show_progress_bar: bool, collate) -> torch.Tensor:
    """(n, d) float32 embeddings on the CPU, in input order: on one device, or shared by a pool of workers."""
    if len(devices) > 1:
        return _encode_on_pool(encoder, tokenized, batches, devices, show_progress_bar, collate)
    return _encode_local(encoder, tokenized, batches, devices[0], show_progress_bar, collate)


# --------------------------------------------------------------------------- the output
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
    normalize_embeddings: bool,
    truncate_dim: int | None,
    precision: str,
    max_tokens_per_batch: int | None,
    max_length: int | None,
    doc_max_length: int | None,
    packing: str | bool,
) -> torch.Tensor | np.ndarray:
    """``Encoder.encode``, whose docstring says what each argument does."""
    check_precision(precision)
    check_batch_size(batch_size)
    items, single = prepare_inputs(sentences, encoder.config.prompts, prompt, prompt_name)
    if not items:
        out = torch.zeros((0, encoder.embedding_dim), dtype=torch.float32)
    else:
        overrides = {"max_length": max_length, "doc_max_length": doc_max_length}
        call = encoder.config.replace(**{k: v for k, v in overrides.items() if v is not None})  # validated
        tokenized = encoder._tokenize_items(items, doc_max_length=call.doc_max_length, max_length=call.max_length)
        lengths = [len(t.input_ids) for t in tokenized]
        devices = _resolve_devices(device, encoder)
        device_type = torch.device(devices[0] or encoder.device).type
        batches, collate = make_batches(encoder, lengths, device_type, batch_size, max_tokens_per_batch, packing)
        out = run_batches(encoder, tokenized, batches, devices, show_progress_bar, collate)
    truncate_dim = truncate_dim if truncate_dim is not None else encoder.truncate_dim
    return finish(out, truncate_dim, normalize_embeddings, precision, single, convert_to_numpy, convert_to_tensor)
