"""The supervised contrastive Trainer: Encoder forward per text column, contrastive loss, LoRA, GradCache.

Design points:

* The data layer already ordered the samples (homogeneous global batches), so the sampler replays
  that order (``HomogeneousSampler``), never a random one.
* Every checkpoint is an encoder folder (``Encoder.save``) that ``Encoder.from_pretrained`` loads
  with the training-time settings, plus ``trainable.safetensors`` (the exact trainable tensors, for
  resuming) and, written last, ``checkpoint_complete.json``: a checkpoint without that marker was
  interrupted mid-write and is never resumed from.
* A NaN or inf loss stops the run before the optimizer step, so no bad weights are ever saved.
* GradCache (``grad_cache_chunk_size``): embeddings of the whole batch are first computed without
  graph in chunks, the loss and its gradient w.r.t. the embeddings are computed once, then each
  chunk is re-encoded with graph and back-propagated with its cached embedding gradient. Memory is
  bounded by one chunk's activations; loss and gradients are those of the direct path. Dropout
  (LoRA's) is replayed exactly: the RNG state before each chunk's first forward is restored for its
  second forward.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import Trainer, TrainerCallback
from transformers.integrations import TensorBoardCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from diffusion_embedder.data import HomogeneousSampler
from diffusion_embedder.encoder import Encoder

logger = logging.getLogger(__name__)

TRAINABLE_WEIGHTS = "trainable.safetensors"
COMPLETE_MARKER = "checkpoint_complete.json"
TRAIN_CONFIG = "train_config.json"
_CHECKPOINT_RE = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")

Features = dict[str, torch.Tensor]


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


def is_complete_checkpoint(path: str | os.PathLike) -> bool:
    return os.path.isfile(os.path.join(path, COMPLETE_MARKER))


def find_last_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The newest ``checkpoint-N`` folder that was completely written, or None."""
    if not os.path.isdir(output_dir):
        return None
    steps = []
    for name in os.listdir(output_dir):
        match = _CHECKPOINT_RE.match(name)
        if match and os.path.isdir(os.path.join(output_dir, name)):
            steps.append(int(match.group(1)))
    for step in sorted(steps, reverse=True):
        path = os.path.join(output_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
        if is_complete_checkpoint(path):
            return path
        logger.warning("Skipping %s: no %s, it was not completely written.", path, COMPLETE_MARKER)
    return None


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
    """Row chunks of a tokenized batch, each cut to its own width (left padding)."""
    chunks = []
    rows = features["input_ids"].shape[0]
    for start in range(0, rows, chunk_size):
        chunk = {k: v[start : start + chunk_size] for k, v in features.items()}
        used = chunk["attention_mask"].any(dim=0).nonzero()
        first = int(used[0]) if len(used) else chunk["attention_mask"].shape[1] - 1
        chunks.append({k: v[:, first:] for k, v in chunk.items()})
    return chunks


def text_columns(inputs: dict[str, Any]) -> tuple[list[Features], int]:
    """The collator's output as a flat list of feature dicts: query, positive, then negatives.

    Returns the columns and K, the number of negatives per query (a stacked negatives dict holds
    B*K rows, sample-major).
    """
    columns = [inputs["query"], inputs["positive"]]
    negatives = inputs.get("negatives")
    if negatives is None:
        return columns, 0
    if isinstance(negatives, dict):
        batch = inputs["query"]["input_ids"].shape[0]
        return [*columns, negatives], negatives["input_ids"].shape[0] // batch
    return [*columns, *negatives], len(negatives)


def assemble(reps: list[torch.Tensor], num_negatives: int) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """(queries, positives, negatives) from per-column embeddings, negatives as (B, K, d) or None."""
    q, p = reps[0], reps[1]
    if num_negatives == 0:
        return q, p, None
    if len(reps) == 3 and reps[2].shape[0] == q.shape[0] * num_negatives:
        return q, p, reps[2].view(q.shape[0], num_negatives, -1)
    return q, p, torch.stack(reps[2:], dim=1)


class EncoderTrainer(Trainer):
    """Hugging Face ``Trainer`` for an ``Encoder`` and a contrastive loss (see the module docstring)."""

    def __init__(
        self,
        *args,
        loss_fn: Callable[..., torch.Tensor],
        grad_cache_chunk_size: int | None = None,
        group_by: str = "global",
        run_config: dict[str, Any] | None = None,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        self.loss_fn = loss_fn
        self.grad_cache_chunk_size = grad_cache_chunk_size
        self.group_by = group_by
        self.run_config = run_config
        self.loss_is_scaled_for_ga = False
        self.current_gradient_accumulation_steps = 1  # set per step by the training loop
        if self.callback_handler.pop_callback(TensorBoardCallback) is not None:
            self.add_callback(EncoderTensorBoardCallback())

    # ------------------------------------------------------------------ data order
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

    # ------------------------------------------------------------------ loss
    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False, **kwargs):
        columns, k = text_columns(inputs)
        reps = [model(features) for features in columns]
        q, p, negatives = assemble(reps, k)
        loss = self.loss_fn(q, p, negatives)
        self._check_finite(loss)
        return (loss, torch.stack([q, p], dim=1)) if return_outputs else loss

    def _check_finite(self, loss: torch.Tensor) -> None:
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

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch=None) -> torch.Tensor:
        if not self.grad_cache_chunk_size:
            return super().training_step(model, inputs, num_items_in_batch)
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.grad_cache_step(model, inputs)
        return loss.detach() / self.current_gradient_accumulation_steps

    def grad_cache_step(self, model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        """Forward and backward of one batch with GradCache; returns the (unscaled) loss."""
        columns, k = text_columns(inputs)
        chunks = [split_features(features, self.grad_cache_chunk_size) for features in columns]
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
        loss = self.loss_fn(*assemble(reps, k))
        self._check_finite(loss)
        (loss / self.current_gradient_accumulation_steps).backward()

        pending = [
            (c, s, g)
            for column, st, r in zip(chunks, states, reps, strict=True)
            for c, s, g in zip(column, st, r.grad.split(self.grad_cache_chunk_size), strict=True)
        ]
        for index, (chunk, state, grad) in enumerate(pending):
            last = index == len(pending) - 1
            sync = contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()
            with sync:
                with state:
                    out = model(chunk)
                self.accelerator.backward((out * grad.to(out.dtype)).sum())
        return loss

    # ------------------------------------------------------------------ saving and resuming
    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """An encoder folder, plus the exact trainable tensors for resuming."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return
        encoder: Encoder = self.accelerator.unwrap_model(self.model)
        encoder.save(output_dir)
        trainable = {n: p.detach().cpu().contiguous() for n, p in encoder.named_parameters() if p.requires_grad}
        save_file(trainable, os.path.join(output_dir, TRAINABLE_WEIGHTS))
        if self.run_config is not None:
            with open(os.path.join(output_dir, TRAIN_CONFIG), "w", encoding="utf-8") as f:
                json.dump(self.run_config, f, indent=2)

    def _save_checkpoint(self, model: nn.Module, trial=None) -> None:
        super()._save_checkpoint(model, trial)
        self.accelerator.wait_for_everyone()  # every rank's files (RNG states) are on disk
        if self.args.should_save:
            folder = os.path.join(self._get_output_dir(trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            with open(os.path.join(folder, COMPLETE_MARKER), "w", encoding="utf-8") as f:
                json.dump({"global_step": self.state.global_step}, f)
        self.accelerator.wait_for_everyone()

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """Restore the trainable tensors written by ``_save`` (names and shapes must match exactly)."""
        path = os.path.join(resume_from_checkpoint, TRAINABLE_WEIGHTS)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{resume_from_checkpoint} has no {TRAINABLE_WEIGHTS}: not a checkpoint of ours.")
        encoder = self.accelerator.unwrap_model(model if model is not None else self.model)
        params = {n: p for n, p in encoder.named_parameters() if p.requires_grad}
        saved = load_file(path)
        if set(saved) != set(params):
            missing, extra = sorted(set(params) - set(saved)), sorted(set(saved) - set(params))
            raise ValueError(
                f"{path} does not match the model being trained: missing {missing[:5]}, unexpected {extra[:5]} "
                "(was it written with other LoRA settings or another base model?)"
            )
        with torch.no_grad():
            for name, tensor in saved.items():
                if params[name].shape != tensor.shape:
                    shapes = f"{tuple(tensor.shape)} vs the model's {tuple(params[name].shape)}"
                    raise ValueError(f"{path}: {name} has shape {shapes}")
                params[name].copy_(tensor)
        logger.info("Resumed %d trainable tensors from %s", len(saved), resume_from_checkpoint)


def prepare_encoder(model_args, custom, training_args) -> Encoder:
    """Load the encoder and make it trainable: a fresh LoRA (after merging an earlier adapter such as
    MNTP), or, when the adapter's name contains "simcse", that adapter continued (upstream's rule).
    """
    from peft import LoraConfig, get_peft_model

    def located(name: str | None) -> str | None:
        """Local folders are recorded absolute, so a checkpoint loads from any working directory."""
        return os.path.abspath(name) if name is not None and os.path.isdir(name) else name

    peft_path = located(model_args.peft_model_name_or_path)
    continue_adapter = peft_path is not None and "simcse" in peft_path.lower()
    encoder = Encoder.from_pretrained(
        located(model_args.model_name_or_path),
        peft_model_name_or_path=peft_path,
        merge_peft=not continue_adapter,
        enable_bidirectional=model_args.bidirectional,
        pooling_mode=model_args.pooling_mode,
        max_length=model_args.max_seq_length,
        doc_max_length=model_args.doc_max_length,
        skip_instruction=model_args.skip_instruction,
        torch_dtype=(
            getattr(torch, model_args.torch_dtype)
            if model_args.torch_dtype not in (None, "auto")
            else model_args.torch_dtype
        ),
        attn_implementation=model_args.attn_implementation,
        prompt_template=model_args.prompt_template,
        device=training_args.device,
    )
    if continue_adapter:
        for name, param in encoder.model.named_parameters():
            param.requires_grad = "lora_" in name
        for config in encoder.model.peft_config.values():
            config.inference_mode = False
        logger.info("Continuing the adapter %s (no new LoRA).", peft_path)
    else:
        lora = LoraConfig(
            r=custom.lora_r,
            lora_alpha=custom.lora_alpha,
            lora_dropout=custom.lora_dropout,
            target_modules=list(custom.lora_target_modules),
            bias="none",
            task_type=None,
        )
        encoder.model = get_peft_model(encoder.model, lora)
    if training_args.activation_checkpointing:
        kwargs = {"use_reentrant": False, **(training_args.activation_checkpointing_kwargs or {})}
        encoder.model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        # The Trainer would call this on the Encoder, which has no such method: it is done here.
        training_args.activation_checkpointing = training_args.gradient_checkpointing = False
    trainable = sum(p.numel() for p in encoder.parameters() if p.requires_grad)
    total = sum(p.numel() for p in encoder.parameters())
    logger.info("Trainable parameters: %d of %d (%.3f%%)", trainable, total, 100 * trainable / max(total, 1))
    return encoder
