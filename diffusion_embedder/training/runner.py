"""The run lifecycle every training stage shares: open the run (seed, the run folder claimed, the
checkpoint to resume from, the folder's ownership), fit, and the command-line entry with its exit status.

Order matters, so that a run that cannot start loses nothing and leaves nothing: a stage validates its
config (no model is loaded for a bad config), reads its data (a bad file stops the run before its folder
is touched), opens the run (``open_run``: still no model), builds its ``RunTrainer`` (a model, a
collator and a loss), and only then, in ``fit``, deletes the old run ``overwrite_output_dir`` replaces
and trains. The stages: ``supervised.py``, ``simcse.py``, ``lm.py``.
"""

from __future__ import annotations

import gc
import logging
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from transformers import TrainingArguments, set_seed

from diffusion_embedder.backbones import BackboneConfigError
from diffusion_embedder.clihelp import exit_status
from diffusion_embedder.data import DataFormatError
from diffusion_embedder.training.arguments import ARGUMENT_CLASSES, RunArguments
from diffusion_embedder.training.checkpoints import (
    RESUME_MAY_DIFFER,
    TRAIN_CONFIG,
    CheckpointError,
    CheckpointWriteError,
    config_differences,
    find_last_checkpoint,
    is_complete_checkpoint,
    list_checkpoints,
    read_config,
    validate_checkpoint,
    writing,
)
from diffusion_embedder.training.claim import FolderClaim, claim_run
from diffusion_embedder.training.schema import ConfigError, StageSchema
from diffusion_embedder.training.trainer import NonFiniteLossError, RunTrainer, StopAfterNStepsCallback

logger = logging.getLogger(__name__)

RESUME_LAST = ("last", "latest", "auto", "true")


def located(name: str | None) -> str | None:
    """A local folder as an absolute path (so a checkpoint records where its base is, from any working
    directory); a hub name as given."""
    return os.path.abspath(name) if name is not None and os.path.isdir(name) else name


def model_short_name(name: str) -> str:
    """The last part of a hub name or folder, as run names use it."""
    return name.rstrip("/").split("/")[-1]


def global_batch_size(args: TrainingArguments) -> int:
    """Texts per optimizer step over every process: per device x processes x accumulation steps."""
    return args.per_device_train_batch_size * args.world_size * args.gradient_accumulation_steps


def resolve_resume(
    value: str | None,
    output_dir: str,
    config: dict[str, Any],
    world_size: int,
    classes: tuple[type, ...] = ARGUMENT_CLASSES,
) -> str | None:
    """The checkpoint to resume from, validated; None to start fresh.

    ``last`` is the newest complete checkpoint in ``output_dir`` (None if there is none). A checkpoint
    missing any file an exact resume needs, or trained with another config (apart from
    ``RESUME_MAY_DIFFER``), stops the run with an error that says what to do.
    """
    if value is None or value.lower() in ("false", "none", ""):
        return None
    if value.lower() in RESUME_LAST:
        path = find_last_checkpoint(output_dir)
        if path is None:
            logger.info("No complete checkpoint in %s: starting from scratch.", output_dir)
            return None
    else:
        path = value
        if not os.path.isdir(path):
            raise ConfigError(f"resume_from_checkpoint={value!r}: no such folder.")
        if not is_complete_checkpoint(path):
            raise ConfigError(
                f"resume_from_checkpoint={value!r} is not a complete checkpoint (no checkpoint_complete.json); "
                "use 'last' to pick the newest complete one."
            )
    validate_checkpoint(path, world_size)
    changed = config_differences(read_config(path), config, ignore=(), classes=classes)
    differences = {key: values for key, values in changed.items() if key not in RESUME_MAY_DIFFER}
    if differences:
        listed = "; ".join(f"{key}: {old!r} there, {new!r} now" for key, (old, new) in differences.items())
        raise CheckpointError(
            f"{path} was trained with another config ({listed}). Resume with the settings it was trained with "
            f"(these may change on resume: {', '.join(sorted(RESUME_MAY_DIFFER))}), or start the new run under "
            "another output_dir or experiment_id."
        )
    if changed:
        logger.info("Resuming %s with changed settings: %s", path, {k: v[1] for k, v in changed.items()})
    return path


def check_run_folder(
    output_dir: str, config: dict[str, Any], overwrite: bool, classes: tuple[type, ...] = ARGUMENT_CLASSES
) -> list[str]:
    """A run folder belongs to one run: a fresh start in a folder holding another run's checkpoints (or
    its final record) stops, unless ``overwrite``. Returns what a fresh start replaces (``OpenRun.replace_old``
    deletes it once the data and the model are ready, so a run that fails before then loses nothing)."""
    checkpoints = list_checkpoints(output_dir)
    record = os.path.join(output_dir, TRAIN_CONFIG)
    if not checkpoints and not os.path.isfile(record):
        return []
    held = f"{len(checkpoints)} checkpoint(s), newest {checkpoints[0]}" if checkpoints else f"a finished run ({record})"
    if not overwrite:
        same = os.path.isfile(record) and not config_differences(read_config(output_dir), config, classes=classes)
        what = "this config" if same else "another config" if os.path.isfile(record) else "a run"
        raise ConfigError(
            f"{output_dir} already holds {held} of {what}. Continue it with --resume_from_checkpoint last, start "
            "this run under another output_dir or experiment_id, or pass --overwrite_output_dir to delete them."
        )
    logger.warning("overwrite_output_dir: %s in %s will be deleted when training starts.", held, output_dir)
    return [*checkpoints, record] if os.path.isfile(record) else checkpoints


@dataclass
class OpenRun:
    """A run ``open_run`` opened: its folder, the checkpoint it resumes (None: a fresh start), the folder's
    claim (released by ``close``; ``with run:`` closes it) and the old run a fresh start replaces."""

    folder: str
    resume: str | None
    claim: FolderClaim
    replaces: list[str] = field(default_factory=list)

    def replace_old(self) -> None:
        """Delete the old run ``overwrite_output_dir`` replaces (one process; the others wait for it)."""
        if self.replaces and self.claim.held:
            logger.warning("overwrite_output_dir: deleting %s.", ", ".join(self.replaces))
            for path in self.replaces:
                if os.path.isdir(path):
                    shutil.rmtree(path)
                else:
                    os.remove(path)
        self.replaces = []
        if dist.is_available() and dist.is_initialized():
            dist.barrier()

    def close(self) -> None:
        self.claim.release()

    def __enter__(self) -> OpenRun:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def open_run(
    args: TrainingArguments,
    run_id: str,
    config: dict[str, Any],
    run: RunArguments,
    classes: tuple[type, ...] = ARGUMENT_CLASSES,
) -> OpenRun:
    """Any stage: seed, run folder ``args.output_dir/run_id`` claimed for this run (``claim.py``), the
    validated checkpoint to resume from and the folder's ownership, all before any model loads. ``config``
    is the run's config record (compared with a resumed checkpoint's; keys it leaves out count as their
    defaults in the stage's argument ``classes``)."""
    set_seed(args.seed)
    args.output_dir = os.path.join(args.output_dir, run_id)
    if run.overwrite_output_dir and args.resume_from_checkpoint not in (None, "", "false", "none"):
        raise ConfigError(
            f"overwrite_output_dir starts a new run; it cannot be combined with "
            f"resume_from_checkpoint={args.resume_from_checkpoint!r}."
        )
    claim = claim_run(args.output_dir, run.break_run_claim)
    try:
        resume = resolve_resume(args.resume_from_checkpoint, args.output_dir, config, args.world_size, classes)
        replaces = [] if resume else check_run_folder(args.output_dir, config, run.overwrite_output_dir, classes)
    except BaseException:
        claim.release()
        raise
    logger.info("Run folder %s%s", args.output_dir, f", resuming from {resume}" if resume else "")
    return OpenRun(args.output_dir, resume, claim, replaces)


def fit(trainer: RunTrainer, run: OpenRun, stop_after_n_steps: int | None) -> str:
    """Train (resuming from ``run.resume``, after deleting the old run it replaces), save the final model at
    the run folder's root; returns it."""
    if stop_after_n_steps is not None:
        trainer.add_callback(StopAfterNStepsCallback(stop_after_n_steps))
    run.replace_old()
    trainer.train(resume_from_checkpoint=run.resume)
    with writing(trainer.args.output_dir, trainer.args.output_dir):
        trainer.save_model(trainer.args.output_dir)
    return trainer.args.output_dir


def fit_built(build: Callable[[], RunTrainer], run: OpenRun, stop_after_n_steps: int | None) -> str:
    """``fit`` the trainer ``build`` returns, then drop it (DDP's reducer must be gone before the process
    group is destroyed: gloo aborts otherwise) and release the run folder, however the run ended."""
    with run:
        trainer = build()
        try:
            return fit(trainer, run, stop_after_n_steps)
        finally:
            del trainer
            gc.collect()


#: Errors in our own words, each naming what to fix: logged as one message, no traceback. Exit status 2: the
#: run could not start (config, data, model files, a busy run folder); 1: it stopped part-way and can be
#: resumed (a NaN/inf loss, a checkpoint that could not be written). Anything else is a bug: a traceback.
EXIT_STATUS: dict[type[Exception], int] = {
    ConfigError: 2,
    DataFormatError: 2,
    FileNotFoundError: 2,  # our readers' (files.check_file, DatasetUnavailableError): the setting and the path
    BackboneConfigError: 2,
    NonFiniteLossError: 1,
    CheckpointWriteError: 1,
}


def run_cli(argv: list[str] | None, usage: str, schema: StageSchema, start: Callable[[list[str]], object]) -> int:
    """Shared entry of every training stage: exit status 0 on success, else ``EXIT_STATUS``'s.

    ``--help`` prints ``usage`` and the fields of the stage's ``schema``; ``start`` receives
    ``[CONFIG.json, --key value ...]`` and runs the stage.
    """
    logging.basicConfig(
        format="%(asctime)s - %(name)s - %(levelname)s - %(message)s", datefmt="%Y-%m-%d %H:%M:%S", level=logging.INFO
    )
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(f"{usage}\n{schema.fields_help()}" if argv else usage)
        return 0 if argv else 2
    try:
        start(argv)
    except tuple(EXIT_STATUS) as err:
        logger.error("%s", err)
        return exit_status(err, EXIT_STATUS)
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    return 0
