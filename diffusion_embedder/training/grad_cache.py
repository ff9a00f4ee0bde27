"""GradCache: a large contrastive batch trained in chunks with the memory of one chunk.

The embeddings of every column are first computed without a graph, chunk by chunk; the loss and its
gradient with respect to the embeddings are computed once; then each chunk is encoded again with a
graph and back-propagated with its cached embedding gradient. Loss and gradients equal the direct
path's. Dropout (LoRA's) is replayed exactly: the RNG state before each chunk's first forward is
restored for its second forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from diffusion_embedder.packing import is_packed, split_packed

Features = dict[str, torch.Tensor]


class RandState:
    """The CPU and CUDA RNG states at construction; ``with state:`` replays them and restores afterwards."""

    def __init__(self, device: torch.device):
        self.devices = [device] if device.type == "cuda" else []
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


def split_features(features: Features, chunk_size: int) -> list[Features]:
    """Chunks of ``chunk_size`` texts: padded rows cut to their own width, or packed texts packed again."""
    if is_packed(features):
        return split_packed(features, chunk_size)
    chunks = []
    rows = features["input_ids"].shape[0]
    for start in range(0, rows, chunk_size):
        chunk = {k: v[start : start + chunk_size] for k, v in features.items()}
        used = chunk["attention_mask"].any(dim=0).nonzero()
        first = int(used[0]) if len(used) else chunk["attention_mask"].shape[1] - 1
        chunks.append({k: v[:, first:] for k, v in chunk.items()})
    return chunks


def grad_cache_step(
    model: nn.Module,
    columns: list[Features],
    chunk_size: int,
    loss_of: Callable[[list[torch.Tensor]], torch.Tensor],
    backward: Callable[[torch.Tensor], None],
    accumulation_steps: int = 1,
) -> torch.Tensor:
    """Forward and backward of one batch of text ``columns``; returns the (unscaled) loss.

    ``loss_of`` maps the per-column embeddings to the loss (a stage's NaN guard belongs there, so it
    runs before any gradient); ``backward`` is the accelerator's; the loss is divided by
    ``accumulation_steps`` as the Trainer does for gradient accumulation.
    """
    chunks = [split_features(features, chunk_size) for features in columns]
    device = columns[0]["input_ids"].device
    states: list[list[RandState]] = []
    reps: list[torch.Tensor] = []
    with torch.no_grad():
        for column in chunks:
            states.append([])
            parts = []
            for chunk in column:
                states[-1].append(RandState(device))
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
