"""One persistent encoding worker per device.

LLM2Vec sent the whole model to a fresh pool task with every batch (its issue #52); here each worker
receives the encoder once at start-up and then only token batches, pulled from a shared queue so
faster devices take more of them. ``Encoder.start_multi_process_pool`` hands one out as sentence-transformers'
pool (its ``encode(..., pool=pool)``); a batch comes back as its embeddings, or with ``per_row`` as each input's
outputs (``outputs.batch_rows``: token states too).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
from collections.abc import Iterable, Iterator, Sequence

import torch
import torch.multiprocessing as mp

from diffusion_embedder.cpu_linear import onednn_linear
from diffusion_embedder.outputs import batch_rows

logger = logging.getLogger(__name__)


def _worker(encoder, device: str, tasks, results) -> None:
    encoder.to(device).eval()
    while True:
        task = tasks.get()
        if task is None:
            return
        index, features, per_row = task
        try:
            with torch.inference_mode(), onednn_linear(encoder.model, torch.device(device)):
                features = {k: v.to(device) for k, v in features.items()}
                out = batch_rows(encoder, features) if per_row else encoder(features).float().cpu()
            results.put((index, out, None))
        except Exception as error:  # noqa: BLE001 - reported to the parent, which raises it
            results.put((index, None, f"{type(error).__name__}: {error}"))


def weights_state(encoder) -> tuple[tuple[int, int], ...]:
    """Each parameter's and buffer's storage and in-place version: it changes when a tensor or the model is
    replaced, or a tensor is edited in place (an optimizer step), which a worker's copy on another device misses.
    An edit through ``tensor.data`` is not counted (it bypasses the version counter): stop the pool after one."""
    return tuple((t.data_ptr(), t._version) for t in itertools.chain(encoder.parameters(), encoder.buffers()))


class DevicePool:
    """Workers (spawned processes) holding a copy of the encoder on each device."""

    def __init__(self, encoder, devices: Sequence[str]):
        self.devices = list(devices)
        #: The settings the workers' copies hold: a pool runs only for an encoder with these (``check_use``).
        self.config = encoder.config
        self.closed = False
        context = mp.get_context("spawn")
        self._tasks = context.Queue()
        self._results = context.Queue()
        self._processes = [
            context.Process(target=_worker, args=(encoder, device, self._tasks, self._results), daemon=True)
            for device in self.devices
        ]
        for process in self._processes:
            process.start()
        #: The weights the workers' copies were made from, taken once they are sent (sending a CPU tensor moves it
        #: to shared memory): a pool runs only for an encoder whose weights are still these (``stale``).
        self.weights = weights_state(encoder)
        logger.info("Started %d encoding workers on %s", len(self._processes), ", ".join(self.devices))

    def stale(self, encoder) -> str | None:
        """Why the workers' copies are not ``encoder`` as it is now (its settings or its weights); None if they are."""
        if self.config != encoder.config:
            changed = sorted(k for k, v in self.config.to_dict().items() if encoder.config.to_dict()[k] != v)
            return f"these settings changed since: {', '.join(changed)}"
        if self.weights != weights_state(encoder):
            return "its weights changed since (a tensor or the model replaced, or edited in place: a training step)"
        return None

    def check_use(self, encoder) -> None:
        """Refuse a stopped pool, or one whose workers hold other settings or weights than ``encoder``'s."""
        if self.closed:
            raise ValueError("pool: this pool was stopped (stop_multi_process_pool); start a new one.")
        stale = self.stale(encoder)
        if stale:
            raise ValueError(f"pool: its workers hold the encoder as it was when the pool started; {stale}. Stop it "
                             f"and start a new one.")

    def run(
        self, batches: Iterable[dict[str, torch.Tensor]], per_row: bool = False
    ) -> Iterator[tuple[int, torch.Tensor | list[dict[str, torch.Tensor]]]]:
        """Yield ``(batch index, embeddings)`` (with ``per_row``: ``(batch index, rows)``) as workers finish them.

        Each batch is sent as soon as ``batches`` makes it. If making one fails, the results of those already
        sent are awaited and dropped before the error is raised, so that none reaches the pool's next call.
        """
        sent = 0
        try:
            for index, features in enumerate(batches):
                self._tasks.put((index, features, per_row))
                sent += 1
        except BaseException:
            with contextlib.suppress(RuntimeError):  # a worker died: the pool is stopped, nothing to drop
                for _ in range(sent):
                    self._next_result()
            raise
        errors = []
        for _ in range(sent):
            index, embeddings, error = self._next_result()
            if error is None:
                yield index, embeddings
            else:
                errors.append(f"batch {index}: {error}")
        if errors:
            raise RuntimeError(f"Encoding workers failed on {len(errors)} batch(es); first: {errors[0]}")

    def _next_result(self) -> tuple:
        """The next worker result; a worker that died (killed, out of memory) is an error, not an endless wait."""
        while True:
            try:
                return self._results.get(timeout=1.0)
            except queue.Empty:
                pairs = zip(self.devices, self._processes, strict=True)
                dead = [(device, process.exitcode) for device, process in pairs if not process.is_alive()]
                if dead:
                    self.closed = True
                    for process in self._processes:
                        process.terminate()
                    raise RuntimeError(
                        f"Encoding worker(s) died: {', '.join(f'{d} (exit code {c})' for d, c in dead)}; the pool "
                        "is stopped, start a new one."
                    ) from None

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for _ in self._processes:
            self._tasks.put(None)
        for process in self._processes:
            process.join(timeout=30)
            if process.is_alive():
                process.terminate()
