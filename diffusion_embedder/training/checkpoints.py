"""Checkpoint files of a run: the exact trainable tensors, the config record, the completion marker.

Every checkpoint is an encoder folder (``Encoder.save``) that ``Encoder.from_pretrained`` loads with
the training-time settings, plus ``trainable.safetensors`` (the exact trainable tensors, for
resuming), ``train_config.json`` (the config it was trained with) and, written last,
``checkpoint_complete.json``: a checkpoint without that marker was interrupted mid-write and is
never resumed from.
"""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

logger = logging.getLogger(__name__)

TRAINABLE_WEIGHTS = "trainable.safetensors"
COMPLETE_MARKER = "checkpoint_complete.json"
TRAIN_CONFIG = "train_config.json"
_CHECKPOINT_RE = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


def checkpoint_folder(output_dir: str | os.PathLike, step: int) -> str:
    return os.path.join(output_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")


def is_complete_checkpoint(path: str | os.PathLike) -> bool:
    return os.path.isfile(os.path.join(path, COMPLETE_MARKER))


def list_checkpoints(output_dir: str | os.PathLike) -> list[str]:
    """Every ``checkpoint-N`` folder in ``output_dir``, newest first (complete or not)."""
    if not os.path.isdir(output_dir):
        return []
    steps = []
    for name in os.listdir(output_dir):
        match = _CHECKPOINT_RE.match(name)
        if match and os.path.isdir(os.path.join(output_dir, name)):
            steps.append(int(match.group(1)))
    return [checkpoint_folder(output_dir, step) for step in sorted(steps, reverse=True)]


def find_last_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The newest ``checkpoint-N`` folder that was completely written, or None."""
    for path in list_checkpoints(output_dir):
        if is_complete_checkpoint(path):
            return path
        logger.warning("Skipping %s: no %s, it was not completely written.", path, COMPLETE_MARKER)
    return None


def save_trainable(model: nn.Module, folder: str | os.PathLike) -> None:
    """The exact trainable tensors, by parameter name."""
    trainable = {n: p.detach().cpu().contiguous() for n, p in model.named_parameters() if p.requires_grad}
    save_file(trainable, os.path.join(folder, TRAINABLE_WEIGHTS))


def load_trainable(model: nn.Module, folder: str | os.PathLike) -> None:
    """Restore the tensors written by ``save_trainable`` (names and shapes must match exactly)."""
    path = os.path.join(folder, TRAINABLE_WEIGHTS)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{folder} has no {TRAINABLE_WEIGHTS}: not a checkpoint of ours.")
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
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
    logger.info("Resumed %d trainable tensors from %s", len(saved), folder)


def write_config(folder: str | os.PathLike, config: dict[str, Any]) -> None:
    with open(os.path.join(folder, TRAIN_CONFIG), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)


def write_complete_marker(folder: str | os.PathLike, global_step: int) -> None:
    """Called once every other file of the checkpoint is on disk (every rank's)."""
    with open(os.path.join(folder, COMPLETE_MARKER), "w", encoding="utf-8") as f:
        json.dump({"global_step": global_step}, f)
