"""GradCache: a large contrastive batch trained in chunks with the memory of one chunk.

The embeddings of every column are first computed without a graph, chunk by chunk; the loss and its
gradient with respect to the embeddings are computed once; then each chunk is encoded again with a
graph and back-propagated with its cached embedding gradient.

What makes this exact is that each chunk's second forward reproduces its first bit for bit, so the
cached gradient belongs to the embeddings the loss saw: the RNG states (CPU, and CUDA on every device
the model or the inputs live on) before each chunk's first forward are restored for its second, so
dropout (LoRA's, attention's) draws the same masks. Activation checkpointing keeps this: its
recomputation restores the state it saw at the (replayed) forward. The gradients are then those of
one direct step over the same chunks with the same masks; without dropout they are the direct path's
(tests/test_grad_cache.py, and on CUDA tests/test_gpu.py). A whole-batch direct step with dropout
draws other masks (one draw over the whole batch is not the per-chunk draws), so it is not a reference.

Host synchronisation (``tests/test_grad_cache_syncs.py`` counts them, at most 2 per chunk): a column packed by
chunk at collation (``packed_chunks.pack_chunks``) is cut by shape, without reading the device; another packed column is
read to the host once and its re-packed chunks copied back without waiting; the padded columns' chunk widths are
read once per step, and padded chunks run ``as_rows`` so transformers need not read their padding mask. The
step's other wait is the loss's NaN check.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch
from torch import nn

from diffusion_embedder.packed_chunks import split_packed
from diffusion_embedder.packing import PACKED_KEY, is_packed

Features = dict[str, torch.Tensor]


def cuda_devices(*sources: nn.Module | Features) -> list[int]:
    """The CUDA device indices of the parameters of the modules and of the tensors of the feature dicts."""
    tensors: list[torch.Tensor] = []
    for source in sources:
        tensors.extend(source.parameters() if isinstance(source, nn.Module) else source.values())
    found = {t.device for t in tensors if t.device.type == "cuda"}
    return sorted({torch.cuda.current_device() if d.index is None else d.index for d in found})


class RandState:
    """The CPU RNG state and the CUDA RNG states of ``devices`` at construction; ``with state:`` replays
    them and restores the states of before afterwards."""

    def __init__(self, devices: Iterable[int] = ()):
        self.devices = list(devices)
        self.cpu = torch.get_rng_state()
        self.cuda = [torch.cuda.get_rng_state(d) for d in self.devices]
        self._fork = None

    def __enter__(self):
        self._fork = torch.random.fork_rng(devices=self.devices)
        self._fork.__enter__()
        torch.set_rng_state(self.cpu)
        for device, state in zip(self.devices, self.cuda, strict=True):
            torch.cuda.set_rng_state(state, device)

    def __exit__(self, *exc):
        return self._fork.__exit__(*exc)


def first_columns(columns: list[Features]) -> list[list[int]]:
    """Per padded column, the first used column of each row (its width - 1 for a row with no token, as for a
    chunk with none): read from the device once for all the columns."""
    firsts = []
    for features in columns:
        used = features["attention_mask"] != 0
        firsts.append(torch.where(used.any(dim=1), used.int().argmax(dim=1), used.shape[1] - 1))
    if not firsts:
        return []
    flat = torch.cat(firsts).tolist()  # the one read
    out, start = [], 0
    for first in firsts:
        out.append(flat[start : start + len(first)])
        start += len(first)
    return out


def as_rows(features: Features) -> Features:
    """Padded features as packed ones of one text per row (``packing``): the forward then builds its attention
    mask from segment ids, where transformers would read the padding mask from the device to decide whether it
    needs one. Positions, masks and pooling are the padded path's."""
    mask = features["attention_mask"]
    rows, width = mask.shape
    columns = torch.arange(width, device=mask.device)
    rows_index = torch.arange(rows, device=mask.device)[:, None]
    return {
        "input_ids": features["input_ids"].long(),
        "position_ids": (mask.cumsum(-1) - 1).clamp_min(0),
        "segment_ids": torch.where(mask != 0, rows_index, -1 - columns),
        PACKED_KEY: rows_index * width + columns,
        **{k: v for k, v in features.items() if k not in ("input_ids",)},
    }


def split_features(features: Features, chunk_size: int, firsts: list[int] | None = None) -> list[Features]:
    """Chunks of ``chunk_size`` texts: padded rows cut to their own width (``firsts``: the column's
    ``first_columns``, read here if not given), or packed texts split by ``split_packed``."""
    if is_packed(features):
        return split_packed(features, chunk_size)
    if firsts is None:
        firsts = first_columns([features])[0]
    chunks = []
    for start in range(0, features["attention_mask"].shape[0], chunk_size):
        first = min(firsts[start : start + chunk_size])
        chunks.append({k: v[start : start + chunk_size, first:] for k, v in features.items()})
    return chunks


def split_columns(columns: list[Features], chunk_size: int, rows: bool = False) -> list[list[Features]]:
    """Every column's chunks (``split_features``) with one read from the device for all the padded columns
    (none for columns packed by ``packed_chunks.pack_chunks``); ``rows``: padded chunks ``as_rows``."""
    padded = [c for c in columns if not is_packed(c)]
    firsts = iter(first_columns(padded))
    out = []
    for features in columns:
        chunks = split_features(features, chunk_size, None if is_packed(features) else next(firsts))
        out.append([as_rows(c) if rows and not is_packed(c) else c for c in chunks])
    return out


def grad_cache_step(
    model: nn.Module,
    columns: list[Features],
    chunk_size: int,
    loss_of: Callable[[list[torch.Tensor]], torch.Tensor],
    backward: Callable[[torch.Tensor], None],
    accumulation_steps: int = 1,
    rows: bool = False,
) -> torch.Tensor:
    """Forward and backward of one batch of text ``columns``; returns the (unscaled) loss.

    ``loss_of`` maps the per-column embeddings to the loss (a stage's NaN guard belongs there, so it
    runs before any gradient); ``backward`` is the accelerator's; the loss is divided by
    ``accumulation_steps`` as the Trainer does for gradient accumulation; ``rows``: padded chunks run
    ``as_rows`` (the model must take packed features).
    """
    chunks = split_columns(columns, chunk_size, rows)
    devices = cuda_devices(model, *columns)
    states: list[list[RandState]] = []
    reps: list[torch.Tensor] = []
    with torch.no_grad():
        for column in chunks:
            states.append([])
            parts = []
            for chunk in column:
                states[-1].append(RandState(devices))
                parts.append(model(chunk))
            reps.append(torch.cat(parts).detach().requires_grad_())
    loss = loss_of(reps)
    (loss / accumulation_steps).backward()

    pending = [
        (c, s, g)
        for column, st, r in zip(chunks, states, reps, strict=True)
        for c, s, g in zip(column, st, r.grad.split(chunk_size), strict=True)
    ]
    for index, (chunk, state, grad) in enumerate(pending):
        last = index == len(pending) - 1
        sync = contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()
        with sync:
            with state:
                out = model(chunk)
            backward((out * grad.to(out.dtype)).sum())
    return loss
