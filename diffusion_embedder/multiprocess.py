"""One persistent encoding worker per device.

LLM2Vec sent the whole model to a fresh pool task with every batch (its issue #52); here each worker
receives the encoder once at start-up and then only token batches, pulled from a shared queue so
faster devices take more of them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence

import torch
import torch.multiprocessing as mp

from diffusion_embedder.cpu_linear import onednn_linear

logger = logging.getLogger(__name__)


def _worker(encoder, device: str, tasks, results) -> None:
    encoder.to(device).eval()
    while True:
        task = tasks.get()
        if task is None:
            return
        index, features = task
        try:
            with torch.inference_mode(), onednn_linear(encoder.model, torch.device(device)):
                embeddings = encoder({k: v.to(device) for k, v in features.items()}).float().cpu()
            results.put((index, embeddings, None))
        except Exception as error:  # noqa: BLE001 - reported to the parent, which raises it
            results.put((index, None, f"{type(error).__name__}: {error}"))


class DevicePool:
    """Workers (spawned processes) holding a copy of the encoder on each device."""

    def __init__(self, encoder, devices: Sequence[str]):
        self.devices = list(devices)
        context = mp.get_context("spawn")
        self._tasks = context.Queue()
        self._results = context.Queue()
        self._processes = [
            context.Process(target=_worker, args=(encoder, device, self._tasks, self._results), daemon=True)
            for device in self.devices
        ]
        for process in self._processes:
            process.start()
        logger.info("Started %d encoding workers on %s", len(self._processes), ", ".join(self.devices))

    def run(self, batches: Iterable[dict[str, torch.Tensor]]) -> Iterator[tuple[int, torch.Tensor]]:
        """Yield ``(batch index, embeddings)`` as workers finish them; each batch is sent as soon as it is made."""
        sent = 0
        for index, features in enumerate(batches):
            self._tasks.put((index, features))
            sent += 1
        errors = []
        for _ in range(sent):
            index, embeddings, error = self._results.get()
            if error is None:
                yield index, embeddings
            else:
                errors.append(f"batch {index}: {error}")
        if errors:
            raise RuntimeError(f"Encoding workers failed on {len(errors)} batch(es); first: {errors[0]}")

    def close(self) -> None:
        for _ in self._processes:
            self._tasks.put(None)
        for process in self._processes:
            process.join(timeout=30)
            if process.is_alive():
                process.terminate()
