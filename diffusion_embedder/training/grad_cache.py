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

Host synchronisation: splitting reads each column's shape from the device once (padded: one read of
the row offsets; packed: one copy to the host and back), before any forward; nothing else here waits
for the device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch
from torch import nn

from diffusion_embedder.packing import is_packed, split_packed

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


def split_features(features: Features, chunk_size: int) -> list[Features]:
    """Chunks of ``chunk_size`` texts: padded rows cut to their own width, or packed texts packed again."""
    if is_packed(features):
        device = features["input_ids"].device
        chunks = split_packed({k: v.cpu() for k, v in features.items()}, chunk_size)  # one copy, not one per text
        return [{k: v.to(device) for k, v in chunk.items()} for chunk in chunks]
    mask = features["attention_mask"]
    rows, width = mask.shape
    used = mask != 0
    # first used column of each row (width - 1 for a row with no token, as for a chunk with none)
    firsts = torch.where(used.any(dim=1), used.int().argmax(dim=1), width - 1).tolist()
    chunks = []
    for start in range(0, rows, chunk_size):
        first = min(firsts[start : start + chunk_size])
        chunks.append({k: v[start : start + chunk_size, first:] for k, v in features.items()})
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
