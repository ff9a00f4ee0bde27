"""``Encoder.encode``'s work: inputs and prompts, batching, devices, the output.

The stages, in order: ``prepare_inputs`` (validate, apply a prompt), ``planned_batches`` (a producer:
``tokenization.tokenize_chunk`` a step of inputs at a time, ``make_batches`` by exact token length,
length-sorted or packed, and collation), then ``_encode_local`` (one device, the producer running ahead in a
thread: ``prefetch``) or ``run_on_pool`` (a pool of persistent workers, the encoder's own or one the caller
started, fed each batch as it is made), and ``finish`` (Matryoshka truncation, normalization, quantization).
Every argument is checked before the first of them. Token states and per-input dicts (sentence-transformers'
``output_value``) are tokenized whole and run on padded batches by ``outputs`` instead (they need every token's
state). Of the encoder's modules only this one plans packed batches and imports quantization and the device
pool (``multiprocess``); ``encoder`` uses ``packing`` only to collate and run packed rows, which training uses too.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from tqdm.auto import tqdm

from diffusion_embedder import compilation, outputs
from diffusion_embedder import packing as packing_mod
from diffusion_embedder.config import EncoderConfig
from diffusion_embedder.cpu_forwards import concurrent_forwards, run_concurrently
from diffusion_embedder.devices import check_device
from diffusion_embedder.prefetch import Prefetcher
from diffusion_embedder.quantization import check_precision, quantize_embeddings
from diffusion_embedder.templates import TextInput, parse_input, parse_inputs
from diffusion_embedder.tokenization import Tokenized, tokenize_chunk, warn_truncated
from diffusion_embedder.values import AT_LEAST_ONE, require

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
#: ``encode``'s numeric options and their ranges; the ``encode`` and ``eval`` commands' flags of the same names
#: are checked against the same (``evaluation/options.py``).
BOUNDS = {"batch_size": AT_LEAST_ONE, "max_tokens_per_batch": AT_LEAST_ONE, "chunk_size": AT_LEAST_ONE}


def check_number(name: str, value, tp=int) -> None:
    """An ``OptionError`` naming ``name`` and ``value`` where it is not of type ``tp`` within ``BOUNDS[name]``."""
    require(name, value, tp, bounds=BOUNDS[name])


def check_batch_size(batch_size) -> None:
    check_number("batch_size", batch_size)


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


@dataclass(frozen=True)
class BatchPlan:
    """How ``encode`` groups texts into forwards: by count or token budget, padded or packed, for a device type."""

    batch_size: int
    max_tokens_per_batch: int | None = None
    packing: bool | Literal["auto"] = "auto"
    device_type: str = "cpu"

    def __post_init__(self):
        check_batch_size(self.batch_size)
        check_number("max_tokens_per_batch", self.max_tokens_per_batch, int | None)
        packing_mod.check_packing(self.packing)


def make_batches(
    encoder, lengths: list[int], plan: BatchPlan
) -> tuple[list[list[int]], Callable[[list[Tokenized]], dict[str, torch.Tensor]]]:
    """The batches (indices) and the collate function: packed rows where ``plan.packing`` asks for them, else padded."""
    if packing_mod.use_packing(plan.packing, encoder.model, plan.device_type, max(lengths)):
        width = packing_mod.row_length(lengths, plan.device_type)
        rows = plan.batch_size if plan.max_tokens_per_batch is None else max(1, plan.max_tokens_per_batch // width)
        bounded = packing_mod.BOUNDED_SHAPES.get(plan.device_type, False)
        if bounded:  # full forwards then have exactly ``rows`` rows, the last of a step a power of two
            rows = packing_mod.next_power_of_two(rows + 1) // 2
        batches = packing_mod.plan_batches(lengths, width, rows)
        return batches, functools.partial(encoder._collate_packed, pack_length=width, bounded=bounded)
    return length_batches(lengths, plan.batch_size, plan.max_tokens_per_batch), encoder._collate


#: The producer tokenizes the inputs in steps: the first of at most ``FIRST_STEP`` texts, so the device
#: starts at once, then ``STEP_BATCHES`` batches' worth (at most ``MAX_STEP`` texts) at a time.
FIRST_STEP, STEP_BATCHES, MAX_STEP = 64, 8, 2048


def _steps(n: int, batch_size: int) -> Iterator[tuple[int, int]]:
    start, stop = 0, min(batch_size, FIRST_STEP)
    while start < n:
        yield start, min(stop, n)
        start, stop = stop, stop + min(STEP_BATCHES * batch_size, MAX_STEP)


def planned_batches(
    encoder, items: list[TextInput], config: EncoderConfig, plan: BatchPlan, pin: bool = False
) -> Iterator[tuple[list[int], dict[str, torch.Tensor]]]:
    """``(input indices, collated features)`` per forward, planned as the inputs are tokenized.

    Token lengths are only known after tokenization, so the inputs are first sorted by a proxy
    (characters, longest first) and tokenized a step at a time; each step's batches are planned by
    exact token length, and the last, shortest batch of a step waits for the next step's texts. With
    ``pin`` the features come in pinned memory, ready for a ``non_blocking`` copy to the GPU.
    """
    order = sorted(range(len(items)), key=lambda i: -(len(items[i].prefix) + len(items[i].text)))
    readout = encoder._mask_readout_ids(config)
    tokenized: dict[int, Tokenized] = {}
    waiting: list[int] = []
    truncated = 0
    for start, stop in _steps(len(order), plan.batch_size):
        step = order[start:stop]
        rows, cut = tokenize_chunk(
            encoder.tokenizer, config, readout, [items[i] for i in step], config.doc_max_length, config.max_length, step
        )
        truncated += cut
        tokenized.update(zip(step, rows, strict=True))
        pending = waiting + step
        batches, collate = make_batches(encoder, [len(tokenized[i].input_ids) for i in pending], plan)
        waiting = [pending[j] for j in batches.pop()] if stop < len(order) and len(batches) > 1 else []
        for batch in batches:
            indices = [pending[j] for j in batch]
            features = collate([tokenized.pop(i) for i in indices])
            yield indices, {k: v.pin_memory() for k, v in features.items()} if pin else features
    warn_truncated(truncated, len(items), config.max_length - len(readout))


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


class _Outputs:
    """Embeddings gathered where the model computed them and brought to the CPU in large pieces.

    Each batch's output stays on the device (no host synchronisation per batch); every ``PIECE_BYTES``
    of them are concatenated and copied to the CPU at once, into their rows of the (n, d) result.
    """

    PIECE_BYTES = 256 * 2**20

    def __init__(self, n: int, dim: int):
        self.out = torch.empty((n, dim), dtype=torch.float32)
        self._indices: list[int] = []
        self._pieces: list[torch.Tensor] = []

    def add(self, indices: list[int], embeddings: torch.Tensor) -> None:
        if embeddings.device.type == "cpu":
            self.out[indices] = embeddings
            return
        self._indices += indices
        self._pieces.append(embeddings)
        if len(self._indices) * self.out.shape[1] * 4 >= self.PIECE_BYTES:
            self.flush()

    def flush(self) -> torch.Tensor:
        if self._pieces:
            self.out[self._indices] = torch.cat(self._pieces).cpu()
            self._indices, self._pieces = [], []
        return self.out


def _encode_local(encoder, items, config, plan, device, show_progress_bar) -> torch.Tensor:
    """(n, d) float32 embeddings on the CPU, in input order, on one device; the batches are made ahead in a thread."""
    gathered = _Outputs(len(items), encoder.embedding_dim)  # made and returned outside inference mode: the caller
    with outputs.inference_on(encoder, device) as target:  # gets ordinary tensors, as before
        batches = planned_batches(encoder, items, config, plan, pin=target.type == "cuda")
        with (
            Prefetcher(batches, depth=4) as ahead,
            tqdm(total=len(items), desc="Encoding", disable=not show_progress_bar) as bar,
        ):
            def forward(batch: tuple[list[int], dict[str, torch.Tensor]]) -> tuple[list[int], torch.Tensor]:
                features = {k: v.to(target, non_blocking=True) for k, v in batch[1].items()}
                return batch[0], encoder(features).float()

            for indices, embeddings in run_concurrently(forward, ahead, concurrent_forwards(encoder.model, target)):
                gathered.add(indices, embeddings)
                bar.update(len(indices))
    return gathered.flush()


def own_pool(encoder, devices: Sequence[str]):
    """The encoder's own workers on ``devices`` (``Encoder.start_pool``), started again if absent or stale."""
    workers = encoder._pool_workers
    if workers is None or workers.closed or workers.devices != list(devices) or workers.stale(encoder):
        encoder.start_pool(devices)
    return encoder._pool_workers


def run_on_pool(pool, encoder, items: list[TextInput], config: EncoderConfig, plan: BatchPlan,
                show_progress_bar: bool) -> torch.Tensor:
    """(n, d) float32 embeddings on the CPU, in input order, computed by ``pool``'s workers (the encoder's own or a
    caller's, one device or several); each batch is sent as soon as it is planned."""
    out = torch.empty((len(items), encoder.embedding_dim), dtype=torch.float32)
    sent: list[list[int]] = []

    def features():  # tokenized here while the workers run the batches already sent
        for indices, batch in planned_batches(encoder, items, config, plan):
            sent.append(indices)
            yield batch

    with tqdm(total=len(items), desc="Encoding", disable=not show_progress_bar) as bar:
        for index, embeddings in pool.run(features()):
            out[sent[index]] = embeddings
            bar.update(len(sent[index]))
    return out


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
    packing: bool | Literal["auto"],
    compile: bool = False,
) -> torch.Tensor | np.ndarray | list:
    """``Encoder.encode``, whose docstring says what each argument does."""
    precision = check_precision("float32" if precision is None else precision)  # None: sentence-transformers' float32
    outputs.check_output_value(output_value, precision)
    check_batch_size(batch_size)
    for name, value in (("max_tokens_per_batch", max_tokens_per_batch), ("chunk_size", chunk_size)):
        check_number(name, value, int | None)
    truncate_dim = check_truncate_dim(
        truncate_dim if truncate_dim is not None else encoder.truncate_dim, encoder.embedding_dim
    )
    if pool is not None:
        _check_pool(pool, device, encoder)
        devices = list(pool.devices)
    else:
        devices = _resolve_devices(device, encoder)
    plan = BatchPlan(batch_size, max_tokens_per_batch, packing, torch.device(devices[0] or encoder.device).type)
    items, single = prepare_inputs(sentences, encoder.config.prompts, prompt, prompt_name)
    overrides = {"max_length": max_length, "doc_max_length": doc_max_length}
    call = encoder.config.replace(**{k: v for k, v in overrides.items() if v is not None})  # validated
    _check_call(call, encoder._mask_readout_ids())
    if not items:
        if output_value != "sentence_embedding":
            return []
        out = torch.zeros((0, encoder.embedding_dim), dtype=torch.float32)
        return finish(out, truncate_dim, normalize_embeddings, precision, single, convert_to_numpy, convert_to_tensor)
    if compile:  # the layers stay compiled: a later call reuses them
        if pool is not None or len(devices) > 1:
            raise ValueError("compile=True runs on one device: a device pool's workers hold their own copies")
        problem = compilation.encode_problem(encoder.model, torch.device(devices[0] or encoder.device))
        if problem:
            raise ValueError(f"compile=True is refused: {problem}.")
        compilation.compile_layers(encoder.model)
    if pool is None and len(devices) > 1:
        pool = own_pool(encoder, devices)
    if output_value != "sentence_embedding":  # per-token states: padded batches of inputs tokenized at once
        tokenized = encoder._tokenize_items(
            items, doc_max_length=call.doc_max_length, max_length=call.max_length, config=call
        )
        batches = length_batches([len(t.input_ids) for t in tokenized], batch_size, max_tokens_per_batch)
        rows = outputs.run_rows(encoder, tokenized, batches, devices[0], pool, show_progress_bar)
        return outputs.select(rows, output_value, truncate_dim, single)
    if pool is not None:
        out = run_on_pool(pool, encoder, items, call, plan, show_progress_bar)
    else:
        out = _encode_local(encoder, items, call, plan, devices[0], show_progress_bar)
    return finish(out, truncate_dim, normalize_embeddings, precision, single, convert_to_numpy, convert_to_tensor)
