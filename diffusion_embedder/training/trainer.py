"""Trainer hooks: ``RunTrainer`` (checkpoints, resume, NaN stop; any stage) and ``EncoderTrainer``
(contrastive: Encoder forward per text column, contrastive loss, homogeneous order, GradCache).

Design points:

* The data layer already ordered the samples (homogeneous global batches), so the sampler replays
  that order (``HomogeneousSampler``), never a random one.
* Checkpoint files and their completion marker are described in ``checkpoints.py``; GradCache in
  ``grad_cache.py``; building the trainable model in ``model.py``.
* A NaN or inf loss stops the run before the optimizer step, so no bad weights are ever saved.

A pretraining stage reuses ``RunTrainer`` by supplying a model (with ``save(folder)`` or
``save_pretrained(folder)``), a collator and a ``compute_loss``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import Trainer, TrainerCallback
from transformers.integrations import TensorBoardCallback

from diffusion_embedder.data import HomogeneousSampler
from diffusion_embedder.training.checkpoints import (
    checkpoint_folder,
    find_last_checkpoint,
    load_trainable,
    save_trainable,
    write_complete_marker,
    write_config,
)
from diffusion_embedder.training.grad_cache import Features, grad_cache_step

logger = logging.getLogger(__name__)


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or inf; training stopped before the optimizer step."""


class StopAfterNStepsCallback(TrainerCallback):
    """Stop after ``n`` optimizer steps, saving a checkpoint there so the run can be resumed."""

    def __init__(self, stop_after_n_steps: int):
        self.stop_after_n_steps = stop_after_n_steps

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.stop_after_n_steps:
            control.should_training_stop = True
            control.should_save = True
        return control


class EncoderTensorBoardCallback(TensorBoardCallback):
    """TensorBoard logging that records the encoder's settings (``EncoderConfig`` is not a HF config)."""

    def on_train_begin(self, args, state, control, **kwargs):
        model = kwargs.pop("model", None)
        super().on_train_begin(args, state, control, **kwargs)
        if self.tb_writer is not None and model is not None and hasattr(model, "config"):
            self.tb_writer.add_text("encoder_config", json.dumps(model.config.to_dict(), indent=2))


class RunTrainer(Trainer):
    """Hugging Face ``Trainer`` with our checkpoint files, exact resume and the NaN/inf stop."""

    def __init__(self, *args, run_config: dict[str, Any] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.run_config = run_config
        if self.callback_handler.pop_callback(TensorBoardCallback) is not None:
            self.add_callback(EncoderTensorBoardCallback())

    def check_finite(self, loss: torch.Tensor) -> None:
        """Stop every rank together on a non-finite loss, naming the checkpoint to resume from."""
        bad = (~torch.isfinite(loss.detach())).float().reshape(1)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        if bad.item() == 0:
            return
        last = find_last_checkpoint(self.args.output_dir)
        keep = f"the last good checkpoint is {last}" if last else "no checkpoint had been written yet"
        raise NonFiniteLossError(
            f"Loss is {loss.item()} at optimizer step {self.state.global_step + 1}; training stopped before "
            f"updating the weights, {keep}. Lower the learning rate (learning_rate={self.args.learning_rate}) "
            "or check the data, then resume with --resume_from_checkpoint last."
        )

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """The model's own folder, plus the exact trainable tensors and the config record."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return
        model = self.accelerator.unwrap_model(self.model)
        if hasattr(model, "save"):
            model.save(output_dir)
        else:
            model.save_pretrained(output_dir)
        save_trainable(model, output_dir)
        if self.run_config is not None:
            write_config(output_dir, self.run_config)

    def _save_checkpoint(self, model: nn.Module, trial=None) -> None:
        super()._save_checkpoint(model, trial)
        self.accelerator.wait_for_everyone()  # every rank's files (RNG states) are on disk
        if self.args.should_save:
            write_complete_marker(
                checkpoint_folder(self._get_output_dir(trial), self.state.global_step), self.state.global_step
            )
        self.accelerator.wait_for_everyone()

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        target = model if model is not None else self.model
        load_trainable(self.accelerator.unwrap_model(target), resume_from_checkpoint)


def text_columns(inputs: dict[str, Any]) -> tuple[list[Features], int]:
    """The collator's output as a flat list of feature dicts: query, positive, then the negatives.

    Returns the columns and K, the number of negatives per query (the negatives dict holds B*K rows,
    sample-major).
    """
    columns = [inputs["query"], inputs["positive"]]
    negatives = inputs.get("negatives")
    if negatives is None:
        return columns, 0
    # attention_mask has one row per text, padded or packed
    return [*columns, negatives], negatives["attention_mask"].shape[0] // inputs["query"]["attention_mask"].shape[0]


def assemble(reps: list[torch.Tensor], num_negatives: int) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """(queries, positives, negatives) from per-column embeddings, negatives as (B, K, d) or None."""
    q, p = reps[0], reps[1]
    return q, p, reps[2].view(q.shape[0], num_negatives, -1) if num_negatives else None


class EncoderTrainer(RunTrainer):
    """Contrastive training of an ``Encoder`` (see the module docstring)."""

    def __init__(
        self,
        *args,
        loss_fn: Callable[..., torch.Tensor],
        grad_cache_chunk_size: int | None = None,
        group_by: str = "global",
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        self.loss_fn = loss_fn
        self.grad_cache_chunk_size = grad_cache_chunk_size
        self.group_by = group_by
        self.loss_is_scaled_for_ga = False
        self.current_gradient_accumulation_steps = 1  # set per step by the training loop

    def _get_train_sampler(self, train_dataset=None) -> torch.utils.data.Sampler | None:
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        if not hasattr(dataset, "groups"):
            return torch.utils.data.SequentialSampler(dataset)
        return HomogeneousSampler(
            dataset.groups,
            self.args.per_device_train_batch_size,
            world_size=self.args.world_size,
            gradient_accumulation_steps=self.args.gradient_accumulation_steps,
            group_by=self.group_by,
            seed=self.args.seed,
        )

    def contrastive_loss(self, reps: list[torch.Tensor], num_negatives: int) -> torch.Tensor:
        loss = self.loss_fn(*assemble(reps, num_negatives))
        self.check_finite(loss)
        return loss

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False, **kwargs):
        columns, k = text_columns(inputs)
        reps = [model(features) for features in columns]
        loss = self.contrastive_loss(reps, k)
        return (loss, torch.stack(reps[:2], dim=1)) if return_outputs else loss

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch=None) -> torch.Tensor:
        if not self.grad_cache_chunk_size:
            return super().training_step(model, inputs, num_items_in_batch)
        model.train()
        inputs = self._prepare_inputs(inputs)
        columns, k = text_columns(inputs)
        with self.compute_loss_context_manager():
            loss = grad_cache_step(
                model,
                columns,
                self.grad_cache_chunk_size,
                lambda reps: self.contrastive_loss(reps, k),
                self.accelerator.backward,
                self.current_gradient_accumulation_steps,
            )
        return loss.detach() / self.current_gradient_accumulation_steps
