"""Checkpoint files of a run: the exact trainable tensors, the config record, the completion marker.

Every checkpoint is the stage model's own folder, which ``Encoder.from_pretrained`` loads (an encoder
folder with the training-time settings from the contrastive stages, the LLM2Vec ``-mntp`` layout from
the LM stages), plus ``trainable.safetensors`` (the exact trainable tensors, for
resuming), ``train_config.json`` (the config it was trained with) and, written last,
``checkpoint_complete.json``: a checkpoint without that marker was interrupted mid-write and is
never resumed from. The marker is written only for a checkpoint whose trainable tensors are all
finite (the loss of every step before it was checked), so "complete" also means "good".

Resuming is exact or refused: ``validate_checkpoint`` checks that every file the Trainer needs to
continue exactly (optimizer, scheduler, each rank's RNG state, trainer state, trainable tensors,
config record) is there and readable, and ``config_differences`` that the checkpoint was trained
with the same config, except the keys in ``RESUME_MAY_DIFFER``.

A sharded (FSDP2) run's checkpoint holds the model and optimizer state in accelerate's layout instead of
``trainable.safetensors`` and ``optimizer.pt`` (``SHARDED_LAYOUTS``; the marker names the layout): gathered on
rank 0 (FULL_STATE_DICT) or one ``torch.distributed.checkpoint`` folder each, every rank writing its shard
(SHARDED_STATE_DICT). Its model folder holds the full, gathered weights all the same.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from accelerate.utils.constants import FSDP_MODEL_NAME
from accelerate.utils.constants import OPTIMIZER_NAME as FSDP_OPTIMIZER_NAME
from safetensors.torch import load_file, save_file
from torch import nn
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME
from transformers.trainer_pt_utils import safe_globals
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from diffusion_embedder.files import read_json_object
from diffusion_embedder.training.arguments import ARGUMENT_CLASSES, default_value
from diffusion_embedder.training.schema import ConfigError

logger = logging.getLogger(__name__)

TRAINABLE_WEIGHTS = "trainable.safetensors"
COMPLETE_MARKER = "checkpoint_complete.json"
TRAIN_CONFIG = "train_config.json"
#: Keys that may change when a run resumes: they steer logging, saving, stopping and where files go,
#: not the weights; ``learning_rate`` because lowering it is the remedy after a NaN/inf stop.
RESUME_MAY_DIFFER = frozenset(
    {
        "resume_from_checkpoint",
        "overwrite_output_dir",
        "break_run_claim",
        "output_dir",
        "experiment_id",
        "stop_after_n_steps",
        "learning_rate",
        "save_steps",
        "save_strategy",
        "save_total_limit",
        "logging_steps",
        "logging_strategy",
        "logging_first_step",
        "logging_dir",
        "report_to",
        "run_name",
        "disable_tqdm",
        "dataloader_num_workers",
        "dataloader_persistent_workers",
        "dataloader_prefetch_factor",
    }
)
#: A sharded checkpoint's layout (as the marker names it) -> its model and optimizer state files or folders.
SHARDED_LAYOUTS = {
    "fsdp2/FULL_STATE_DICT": (f"{FSDP_MODEL_NAME}.bin", f"{FSDP_OPTIMIZER_NAME}.bin"),
    "fsdp2/SHARDED_STATE_DICT": (f"{FSDP_MODEL_NAME}_0", f"{FSDP_OPTIMIZER_NAME}_0"),
}
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


def write_complete_marker(
    folder: str | os.PathLike, global_step: int, world_size: int, layout: str | None = None
) -> None:
    """Called once every other file of the checkpoint is on disk (every rank's). Written whole or not at all
    (a temporary file renamed), so a failed write never leaves a marker behind. ``layout``: a sharded run's
    (``SHARDED_LAYOUTS``), None for the others."""
    path = os.path.join(folder, COMPLETE_MARKER)
    record = {"global_step": global_step, "world_size": world_size, **({"layout": layout} if layout else {})}
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


class CheckpointError(ConfigError):
    """A checkpoint that cannot be resumed exactly; the message names the file and what to do."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint or the final model could not be written (disk full, I/O error); the run stopped there."""


#: What torch's and safetensors' writers say when a write fails: they raise RuntimeError / SafetensorError,
#: not OSError, and torch's "basic_ios::clear: iostream error" gives no reason.
_FAILED_WRITE = (
    "iostream error", "file write failed", "PytorchStreamWriter", "inline_container", "Error while serializing"
)
_DISK_FULL = ("No space left on device", "StorageFull")


def write_failure(err: BaseException) -> str | None:
    """Why a write failed, in words, if ``err`` is a failed write (else None: some other error)."""
    text = str(err)
    if (isinstance(err, OSError) and err.errno == errno.ENOSPC) or any(m in text for m in _DISK_FULL):
        return "the disk is full (No space left on device)"
    if isinstance(err, OSError):
        return f"the write failed ({err.strerror or text})"
    if any(m in text for m in _FAILED_WRITE):
        return f"the write failed ({text.strip().splitlines()[-1][:200]}; torch does not say why, often a full disk)"
    return None


def _free_space(folder: str | os.PathLike) -> str:
    path = os.path.abspath(folder)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        return f"{shutil.disk_usage(path).free / 2**20:.0f} MiB"
    except OSError:
        return "unknown space"


@contextmanager
def writing(folder: str | os.PathLike, run_dir: str | os.PathLike) -> Iterator[None]:
    """Turn a failed write into ``folder`` (a checkpoint of ``run_dir``, or the final model there) into a
    ``CheckpointWriteError`` naming the folder, why, and how to resume; other errors pass unchanged."""
    try:
        yield
    except Exception as err:
        why = write_failure(err)
        if why is None:
            raise
        last = find_last_checkpoint(run_dir)
        start = f"the newest complete checkpoint, {last}" if last else "the start (there is no complete checkpoint)"
        unused = (
            f"It has no {COMPLETE_MARKER} (that file is written last), so a resume never uses it; delete it to "
            "free space."
            if os.path.abspath(folder) != os.path.abspath(run_dir)
            else "The run's checkpoints are complete up to the last one written."
        )
        raise CheckpointWriteError(
            f"Writing {folder} failed: {why}; {_free_space(folder)} free on its file system now. {unused} "
            f"Free some space (or move {run_dir} to a disk with room), then resume with "
            f"--resume_from_checkpoint last: it continues from {start}."
        ) from err


def rng_files(world_size: int) -> list[str]:
    """The Trainer's RNG state files: one per rank under torchrun, one file otherwise."""
    return ["rng_state.pth"] if world_size <= 1 else [f"rng_state_{rank}.pth" for rank in range(world_size)]


def required_files(world_size: int, layout: str | None = None) -> list[str]:
    """Every file (or checkpoint folder) an exact resume reads, the completion marker last."""
    model, optimizer = SHARDED_LAYOUTS[layout] if layout else (TRAINABLE_WEIGHTS, OPTIMIZER_NAME)
    return [
        model,
        optimizer,
        SCHEDULER_NAME,
        *rng_files(world_size),
        TRAINER_STATE_NAME,
        TRAIN_CONFIG,
        COMPLETE_MARKER,
    ]


def _read_distributed_checkpoint(path: str) -> None:
    """A ``torch.distributed.checkpoint`` folder: its metadata, and every shard file it names, whole."""
    from torch.distributed.checkpoint import FileSystemReader

    extent: dict[str, int] = {}
    for item in FileSystemReader(path).read_metadata().storage_data.values():
        extent[item.relative_path] = max(extent.get(item.relative_path, 0), item.offset + item.length)
    for name, size in sorted(extent.items()):
        shard = os.path.join(path, name)
        if not os.path.isfile(shard):
            raise FileNotFoundError(f"its shard {name} is missing")
        if os.path.getsize(shard) < size:
            raise ValueError(f"its shard {name} is truncated ({os.path.getsize(shard)} of {size} bytes)")


def _read(path: str) -> None:
    """Raise if the file cannot be read back (missing, truncated, not of its format)."""
    if os.path.isdir(path):
        _read_distributed_checkpoint(path)
    elif path.endswith(".json"):
        with open(path, encoding="utf-8") as f:
            json.load(f)
    elif path.endswith(".safetensors"):
        load_file(path)
    else:
        with safe_globals():
            torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def checkpoint_problem(folder: str | os.PathLike, world_size: int) -> str | None:
    """Why ``folder`` cannot be resumed exactly by ``world_size`` ranks, or None if it can."""
    try:
        with open(os.path.join(folder, COMPLETE_MARKER), encoding="utf-8") as f:
            marker = json.load(f)
        saved_world, layout = marker.get("world_size", world_size), marker.get("layout")
    except (OSError, ValueError, AttributeError):
        saved_world, layout = world_size, None  # reported below as missing or unreadable
    if saved_world != world_size:
        return f"{folder} was written by {saved_world} process(es), this run has {world_size}"
    if layout is not None and layout not in SHARDED_LAYOUTS:
        return f"{folder} holds its state in a layout this version does not know ({layout!r})"
    for name in required_files(world_size, layout):
        path = os.path.join(folder, name)
        if not os.path.exists(path):
            if name == OPTIMIZER_NAME and os.path.isfile(os.path.join(folder, TRAINABLE_WEIGHTS)):
                return f"{path} is missing (a run with save_only_model=true cannot resume exactly)"
            return f"{path} is missing"
        try:
            _read(path)
        except Exception as err:  # any reader error means the same thing: the file is damaged
            return f"{path} is unreadable ({type(err).__name__}: {err})"
    return None


def checkpoint_step(path: str | os.PathLike) -> int | None:
    match = _CHECKPOINT_RE.match(os.path.basename(os.path.normpath(path)))
    return int(match.group(1)) if match else None


def previous_good_checkpoint(folder: str | os.PathLike, world_size: int) -> str | None:
    """The newest checkpoint before ``folder`` (same run folder) that can be resumed exactly."""
    step = checkpoint_step(folder)
    for path in list_checkpoints(os.path.dirname(os.path.abspath(folder))):
        earlier = step is None or checkpoint_step(path) < step
        if earlier and is_complete_checkpoint(path) and checkpoint_problem(path, world_size) is None:
            return path
    return None


def validate_checkpoint(folder: str | os.PathLike, world_size: int) -> None:
    """Refuse a checkpoint that cannot be resumed exactly, naming the file and the previous good one."""
    problem = checkpoint_problem(folder, world_size)
    if problem is None:
        return
    previous = previous_good_checkpoint(folder, world_size)
    hint = (
        f"the previous complete checkpoint is {previous}: resume from it with --resume_from_checkpoint {previous}"
        if previous
        else "there is no earlier complete checkpoint to resume from"
    )
    raise CheckpointError(f"Cannot resume exactly from {folder}: {problem}; {hint}.")


def config_differences(
    saved: dict[str, Any],
    current: dict[str, Any],
    ignore=RESUME_MAY_DIFFER,
    classes: tuple[type, ...] = ARGUMENT_CLASSES,
) -> dict:
    """``key -> (saved, current)`` for every setting that differs (absent keys count as their default
    in the stage's argument ``classes``)."""
    out = {}
    for key in sorted(set(saved) | set(current)):
        if key in ignore:
            continue
        old = saved[key] if key in saved else default_value(key, classes)
        new = current[key] if key in current else default_value(key, classes)
        if old != new:
            out[key] = (old, new)
    return out


def read_config(folder: str | os.PathLike) -> dict[str, Any]:
    return read_json_object(os.path.join(folder, TRAIN_CONFIG), CheckpointError)
