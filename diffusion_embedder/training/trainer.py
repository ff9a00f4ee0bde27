"""Trainer hooks: ``RunTrainer`` (checkpoints, resume, NaN stop; any stage) and ``EncoderTrainer``
(contrastive: Encoder forward per text column, contrastive loss, homogeneous order, GradCache).

Design points:

* The data layer already ordered the samples (homogeneous global batches), so the sampler replays
  that order (``HomogeneousSampler``), never a random one.
* Checkpoint files and their completion marker are described in ``checkpoints.py``; GradCache in
  ``grad_cache.py``; building the trainable model in each stage's module (LoRA: ``lora.py``).
* A NaN or inf loss stops the run before the optimizer step. A checkpoint is written only when every
  trainable tensor is finite, and it is called good (its completion marker written, old checkpoints
  rotated out) only once the next step's loss, computed with exactly its weights, is finite too (the
  run's last checkpoint: when training ends). At a too-high learning rate the weights of step N are
  often finite but already ruined; the marker rule keeps such a checkpoint from being named as the
  one to resume from.
* After a resume's batch skip, accelerate's skip wrapper does not forward ``set_epoch`` to the
  sampler: ``RunTrainer`` tells every sampler the epoch itself, so epoch 2 resumes in epoch 2's order.
* A resume with another ``learning_rate`` (the remedy after a NaN stop) continues the restored
  schedule at the new rate; the Trainer would silently keep the checkpoint's.

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
from transformers.trainer_utils import rotate_checkpoints

from diffusion_embedder.data import HomogeneousSampler
from diffusion_embedder.packing import packing_problem
from diffusion_embedder.training.checkpoints import (
    checkpoint_folder,
    find_last_checkpoint,
    load_trainable,
    save_trainable,
    write_complete_marker,
    write_config,
    writing,
)
from diffusion_embedder.training.fsdp import ShardingCheck, checkpoint_layout, enable, local
from diffusion_embedder.training.grad_cache import Features, grad_cache_step

logger = logging.getLogger(__name__)


def data_seed(args) -> int:
    """The seed of the training data's order: ``data_seed`` where set (transformers' meaning), else ``seed``."""
    return args.data_seed if args.data_seed is not None else args.seed


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or inf; training stopped before the optimizer step."""


class StopAfterNStepsCallback(TrainerCallback):
    """Stop after ``n`` optimizer steps, saving a checkpoint there so the run can be resumed."""

    def __init__(self, stop_after_n_steps: int):
        self.stop_after_n_steps = stop_after_n_steps

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.stop_after_n_steps:
            logger.info(
                "Stopping at optimizer step %d: stop_after_n_steps=%d (a checkpoint is saved here; "
                "continue with --resume_from_checkpoint last).",
                state.global_step,
                self.stop_after_n_steps,
            )
            control.should_training_stop = True
            control.should_save = True
        return control


class RankStreams(TrainerCallback):
    """Each process draws its own random numbers (masks, diffusion times, dropout). transformers seeds every process
    with ``seed``, so rank r drew exactly what rank 0 drew, on other data. Rank 0 keeps ``seed``'s stream (a
    one-process run is unchanged); a resumed run then restores each rank's saved state, as before."""

    def on_train_begin(self, args, state, control, **kwargs):
        if args.process_index:
            torch.manual_seed(args.seed + args.process_index)


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
        self.resumed_from: str | None = None
        self._pending: tuple[str, int] | None = None  # saved, not yet called good
        if self.callback_handler.pop_callback(TensorBoardCallback) is not None:
            self.add_callback(EncoderTensorBoardCallback())
        self.add_callback(RankStreams())
        if self.args.fsdp_plugin_args:  # asked for: checked once the model is wrapped, whatever wrapped it
            self.add_callback(ShardingCheck(self))

    def create_accelerator_and_postprocess(self) -> None:
        """The Trainer's, then FSDP2 in force as the config asked, on CPU too (``fsdp.enable``)."""
        super().create_accelerator_and_postprocess()
        enable(self)

    # ------------------------------------------------------------------ NaN/inf stop
    def _any_rank(self, flag: torch.Tensor) -> bool:
        """Whether ``flag`` (a 0-d tensor) is set on any rank: the check's one host synchronisation. The
        reduction runs on this rank's device (NCCL reduces CUDA tensors only)."""
        value = flag.detach().to(self.args.device, torch.float32).reshape(1)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def _remedy(self) -> str:
        """Where to resume from after a NaN/inf stop, and with which learning rate."""
        last = find_last_checkpoint(self.args.output_dir) or self.resumed_from
        lower = f"{self.args.learning_rate / 10:g}"
        if last is None:
            return (
                f"No finite checkpoint was written; restart with a lower learning rate (now "
                f"{self.args.learning_rate:g}, e.g. --learning_rate {lower}) or check the data."
            )
        return (
            f"The last finite checkpoint is {last}; resume from it with a lower learning rate (now "
            f"{self.args.learning_rate:g}): --resume_from_checkpoint {last} --learning_rate {lower}, or check the data."
        )

    def check_finite(self, loss: torch.Tensor) -> None:
        """Stop every rank together on a non-finite loss, before any gradient reaches the weights."""
        if not self._any_rank(~torch.isfinite(loss.detach()).all()):
            self._confirm_pending_checkpoint()
            return
        raise NonFiniteLossError(
            f"Loss is {loss.detach().float().mean().item()} at optimizer step {self.state.global_step + 1}; "
            f"training stopped before updating the weights. {self._remedy()}"
        )

    def check_trainable_finite(self) -> None:
        """Stop every rank together if a trainable tensor holds NaN/inf (no checkpoint is written then)."""
        model = self.accelerator.unwrap_model(self.model)
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        flags = [torch.isfinite(local(p)).all().to(self.args.device) for _, p in trainable]
        finite = torch.stack(flags) if flags else torch.ones(0, dtype=torch.bool, device=self.args.device)
        if not self._any_rank(~finite.all()):
            return
        bad = [n for (n, _), ok in zip(trainable, finite.tolist(), strict=True) if not ok]
        raise NonFiniteLossError(
            f"Trainable tensors are not finite after optimizer step {self.state.global_step} "
            f"({', '.join(bad[:3]) or 'on another rank'}); no checkpoint was written for this step. {self._remedy()}"
        )

    # ------------------------------------------------------------------ exact resume
    def _run_epoch(self, *args, **kwargs):
        set_sampler_epoch(kwargs["train_dataloader"], kwargs["epoch"])
        return super()._run_epoch(*args, **kwargs)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """The Trainer restores the checkpoint's learning rate; a changed ``learning_rate`` rescales it."""
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None or self.optimizer is None:
            return
        groups = self.optimizer.param_groups
        old = groups[0].get("initial_lr")
        new = self.args.learning_rate
        if not old or old == new:
            return
        ratio = new / old
        scheduler = getattr(self.lr_scheduler, "scheduler", self.lr_scheduler)
        for group in groups:
            group["initial_lr"] *= ratio
            group["lr"] *= ratio
        if hasattr(scheduler, "base_lrs"):
            scheduler.base_lrs = [lr * ratio for lr in scheduler.base_lrs]
            scheduler._last_lr = [group["lr"] for group in groups]
        logger.warning(
            "learning_rate is %g, the checkpoint was trained with %g: the schedule continues at the new rate.", new, old
        )

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Under FSDP every rank gathers its shards and rank 0 writes the full weights, whatever the checkpoints'
        ``state_dict_type`` (the Trainer writes no model folder under SHARDED_STATE_DICT)."""
        if not self.is_fsdp_enabled:
            return super().save_model(output_dir, _internal_call)
        state_dict = self.accelerator.get_state_dict(self.model)
        self._save(output_dir if output_dir is not None else self.args.output_dir, state_dict=state_dict)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """The model's own folder, plus the exact trainable tensors and the config record; under FSDP the folder
        from the gathered ``state_dict`` (the shards resume from accelerate's files, ``checkpoints.py``)."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return
        model = self.accelerator.unwrap_model(self.model)
        if self.is_fsdp_enabled:
            model.save(output_dir, state_dict=state_dict)
        else:
            (model.save if hasattr(model, "save") else model.save_pretrained)(output_dir)
            save_trainable(model, output_dir)
        if self.run_config is not None:
            write_config(output_dir, self.run_config)

    def train(self, *args, **kwargs):
        result = super().train(*args, **kwargs)
        self._confirm_pending_checkpoint()
        return result

    def _save_checkpoint(self, model: nn.Module, trial=None) -> None:
        """Only finite weights are saved; the marker waits for the next finite loss (module docstring)."""
        self.check_trainable_finite()
        limit, self.args.save_total_limit = self.args.save_total_limit, None  # rotated once called good
        run_dir = self._get_output_dir(trial)
        try:
            with writing(checkpoint_folder(run_dir, self.state.global_step), run_dir):
                super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
        self.accelerator.wait_for_everyone()  # every rank's files (RNG states) are on disk
        self._pending = (run_dir, self.state.global_step)

    def _confirm_pending_checkpoint(self) -> None:
        """Write the completion marker of the checkpoint waiting for it, last, then rotate old ones out."""
        if self._pending is None:
            return
        run_dir, step = self._pending
        self._pending = None
        if self.args.should_save:
            folder = checkpoint_folder(run_dir, step)
            with writing(folder, run_dir):
                write_complete_marker(folder, step, self.args.world_size, checkpoint_layout(self))
            rotate_checkpoints(run_dir, save_total_limit=self.args.save_total_limit)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        target = model if model is not None else self.model
        if self.is_fsdp_enabled:  # the shards, from accelerate's files
            super()._load_from_checkpoint(resume_from_checkpoint, target)
        else:
            load_trainable(self.accelerator.unwrap_model(target), resume_from_checkpoint)
        self.resumed_from = resume_from_checkpoint


def set_sampler_epoch(loader: Any, epoch: int) -> None:
    """Call ``set_epoch`` on every sampler under a (wrapped) dataloader."""
    seen: set[int] = set()
    stack = [loader]
    while stack:
        obj = stack.pop()
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        if obj is not loader and isinstance(obj, torch.utils.data.Sampler) and hasattr(obj, "set_epoch"):
            obj.set_epoch(epoch)
        stack.extend(getattr(obj, name, None) for name in ("batch_sampler", "sampler", "base_dataloader"))


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
            seed=data_seed(self.args),
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
        backbone = self.accelerator.unwrap_model(model).model
        widest = max(c["attention_mask"].shape[1] for c in columns)
        with self.compute_loss_context_manager():
            loss = grad_cache_step(
                model,
                columns,
                self.grad_cache_chunk_size,
                lambda reps: self.contrastive_loss(reps, k),
                self.accelerator.backward,
                self.current_gradient_accumulation_steps,
                rows=packing_problem(backbone, widest) is None,
            )
        return loss.detach() / self.current_gradient_accumulation_steps
