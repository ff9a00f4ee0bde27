"""``torchrun --nproc_per_node=N experiments/run_supervised.py CONFIG.json [--key value ...]``.

Order matters: the config is validated first (no model is loaded for a bad config), then the run
folder and the checkpoint to resume from (``start_run``), then the data is read (a bad line stops
the run before the model loads), then the encoder is built (``build_trainer``) and trained
(``fit``). Another stage reuses ``open_run`` and ``fit`` with its own ``RunTrainer`` (a model, a
collator and a loss).
"""

from __future__ import annotations

import gc
import logging
import os
import shutil
import sys
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from transformers import TrainingArguments, set_seed

from diffusion_embedder import clihelp
from diffusion_embedder.data import DATASET_READERS, ContrastiveCollator, ContrastiveDataset, load_train_dataset
from diffusion_embedder.losses import loss_from_config
from diffusion_embedder.training.arguments import ARGUMENT_CLASSES, CHOICES, ConfigError, TrainConfig, parse_args
from diffusion_embedder.training.checkpoints import (
    RESUME_MAY_DIFFER,
    TRAIN_CONFIG,
    CheckpointError,
    config_differences,
    find_last_checkpoint,
    is_complete_checkpoint,
    list_checkpoints,
    read_config,
    validate_checkpoint,
)
from diffusion_embedder.training.model import prepare_encoder
from diffusion_embedder.training.trainer import (
    EncoderTrainer,
    NonFiniteLossError,
    RunTrainer,
    StopAfterNStepsCallback,
)

logger = logging.getLogger(__name__)

RESUME_LAST = ("last", "latest", "auto", "true")
USAGE = (
    f"usage: {clihelp.prog('train')} CONFIG.json [--key value ...]\n"
    "   or: torchrun --nproc_per_node=N experiments/run_supervised.py CONFIG.json [--key value ...]\n"
    "CONFIG.json: the fields below and any Hugging Face TrainingArguments field (see train_configs/);\n"
    "--key value pairs override the file. LLM2Vec's names max_seq_length and bidirectional are accepted."
)


def help_text() -> str:
    return USAGE + "\n" + clihelp.fields_help(ARGUMENT_CLASSES[:3], CHOICES)


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def experiment_id(cfg: TrainConfig) -> str:
    """Upstream's run name: dataset, model short name, pooling, global batch, length, bidirectional,
    epochs, seed, warmup, lr and LoRA rank."""
    t = cfg.training
    global_batch = t.per_device_train_batch_size * t.world_size * t.gradient_accumulation_steps
    model = cfg.model.model_name_or_path.rstrip("/").split("/")[-1]
    return (
        f"{cfg.data.dataset_name}_train_m-{model}_p-{cfg.model.pooling_mode}_b-{global_batch}"
        f"_l-{cfg.model.max_length}_bidirectional-{cfg.model.enable_bidirectional}_e-{_number(t.num_train_epochs)}"
        f"_s-{t.seed}_w-{t.warmup_steps}_lr-{t.learning_rate}_lora_r-{cfg.custom.lora_r}"
    )


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
    differences = config_differences(read_config(path), config, classes=classes)
    if differences:
        listed = "; ".join(f"{key}: {old!r} there, {new!r} now" for key, (old, new) in differences.items())
        raise CheckpointError(
            f"{path} was trained with another config ({listed}). Resume with the settings it was trained with "
            f"(these may change on resume: {', '.join(sorted(RESUME_MAY_DIFFER))}), or start the new run under "
            "another output_dir or experiment_id."
        )
    changed = config_differences(read_config(path), config, ignore=(), classes=classes)
    if changed:
        logger.info("Resuming %s with changed settings: %s", path, {k: v[1] for k, v in changed.items()})
    return path


def claim_run_folder(
    output_dir: str, config: dict[str, Any], overwrite: bool, classes: tuple[type, ...] = ARGUMENT_CLASSES
) -> None:
    """A run folder belongs to one run: a fresh start in a folder holding another run's checkpoints (or
    its final record) stops, unless ``overwrite`` (then they are deleted first)."""
    checkpoints = list_checkpoints(output_dir)
    record = os.path.join(output_dir, TRAIN_CONFIG)
    if not checkpoints and not os.path.isfile(record):
        return
    held = f"{len(checkpoints)} checkpoint(s), newest {checkpoints[0]}" if checkpoints else f"a finished run ({record})"
    if not overwrite:
        same = os.path.isfile(record) and not config_differences(read_config(output_dir), config, classes=classes)
        what = "this config" if same else "another config" if os.path.isfile(record) else "a run"
        raise ConfigError(
            f"{output_dir} already holds {held} of {what}. Continue it with --resume_from_checkpoint last, start "
            "this run under another output_dir or experiment_id, or pass --overwrite_output_dir to delete them."
        )
    if int(os.environ.get("RANK", "0")) == 0:  # one process deletes, on a shared file system too
        logger.warning("overwrite_output_dir: deleting %s in %s.", held, output_dir)
        for path in checkpoints:
            shutil.rmtree(path)
        if os.path.isfile(record):
            os.remove(record)


def build_dataset(cfg: TrainConfig) -> tuple[ContrastiveDataset, int]:
    """The reader named in the config with the options it registered; returns it and the negatives per query."""
    d = cfg.data
    name = d.dataset_name
    spec = DATASET_READERS[name]
    negatives = d.num_negatives if d.num_negatives is not None else spec.negatives
    if spec.fixed_negatives and negatives > spec.negatives:
        raise ConfigError(f"num_negatives={negatives}: {name} has {spec.negatives} hard negative(s) per query.")
    available = {**vars(d), "num_negatives": negatives, "seed": cfg.training.seed}
    options = {key: available[key] for key in spec.options}
    path = getattr(d, spec.path_field) or d.dataset_file_path
    dataset = load_train_dataset(name, path, skip_bad_lines=d.skip_bad_lines, **options)
    if d.max_train_samples is not None and d.max_train_samples < len(dataset):
        dataset = ContrastiveDataset(dataset.samples[: d.max_train_samples], dataset.name, dataset.num_bad_records)
    if dataset.num_bad_records:
        logger.warning("%s: skipped %d malformed record(s).", name, dataset.num_bad_records)
    return dataset, negatives


def open_run(
    args: TrainingArguments,
    run_id: str,
    config: dict[str, Any],
    overwrite: bool,
    classes: tuple[type, ...] = ARGUMENT_CLASSES,
) -> str | None:
    """Any stage: seed, run folder ``args.output_dir/run_id``, the validated checkpoint to resume from
    (None: a fresh run) and the folder's ownership, all before any model loads. ``config`` is the
    run's config record (compared with a resumed checkpoint's; keys it leaves out count as their
    defaults in the stage's argument ``classes``)."""
    set_seed(args.seed)
    args.output_dir = os.path.join(args.output_dir, run_id)
    if overwrite and args.resume_from_checkpoint not in (None, "", "false", "none"):
        raise ConfigError(
            f"overwrite_output_dir starts a new run; it cannot be combined with "
            f"resume_from_checkpoint={args.resume_from_checkpoint!r}."
        )
    resume = resolve_resume(args.resume_from_checkpoint, args.output_dir, config, args.world_size, classes)
    if resume is None:
        claim_run_folder(args.output_dir, config, overwrite, classes)
    logger.info("Run folder %s%s", args.output_dir, f", resuming from {resume}" if resume else "")
    return resume


def start_run(cfg: TrainConfig) -> str | None:
    """``open_run`` for a supervised config."""
    run_id = cfg.custom.experiment_id or experiment_id(cfg)
    return open_run(cfg.training, run_id, cfg.values, cfg.custom.overwrite_output_dir)


def build_trainer(cfg: TrainConfig) -> EncoderTrainer:
    """The supervised stage: data, trainable encoder, loss and collator, each from its config fields."""
    dataset, num_negatives = build_dataset(cfg)
    encoder = prepare_encoder(cfg.model, cfg.custom, cfg.training)
    return EncoderTrainer(
        model=encoder,
        args=cfg.training,
        train_dataset=dataset,
        data_collator=ContrastiveCollator(encoder, num_negatives=num_negatives, pack_length=cfg.custom.pack_length),
        loss_fn=loss_from_config(cfg.custom.loss_class, cfg.custom),
        grad_cache_chunk_size=cfg.custom.grad_cache_chunk_size,
        group_by=cfg.data.group_by,
        run_config=cfg.values,
    )


def fit(trainer: RunTrainer, resume: str | None, stop_after_n_steps: int | None) -> str:
    """Train (resuming from ``resume``), save the final model at the run folder's root; returns it."""
    if stop_after_n_steps is not None:
        trainer.add_callback(StopAfterNStepsCallback(stop_after_n_steps))
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(trainer.args.output_dir)
    return trainer.args.output_dir


def train(cfg: TrainConfig) -> str:
    """Run one supervised training; returns the run folder (its root holds the final encoder)."""
    resume = start_run(cfg)
    trainer = build_trainer(cfg)
    try:
        return fit(trainer, resume, cfg.custom.stop_after_n_steps)
    finally:
        # DDP's reducer must be gone before the process group is destroyed (gloo aborts otherwise).
        del trainer
        gc.collect()


def run_cli(
    argv: list[str] | None, usage: str, help_text: Callable[[], str], start: Callable[[list[str]], object]
) -> int:
    """Shared entry of every training stage: exit status 0 on success, 2 for a bad config, 1 for a diverged run.

    ``start`` receives ``[CONFIG.json, --key value ...]`` and runs the stage.
    """
    logging.basicConfig(
        format="%(asctime)s - %(name)s - %(levelname)s - %(message)s", datefmt="%Y-%m-%d %H:%M:%S", level=logging.INFO
    )
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(help_text() if argv else usage)
        return 0 if argv else 2
    try:
        start(argv)
    except ConfigError as err:
        logger.error("%s", err)
        return 2
    except NonFiniteLossError as err:
        logger.error("%s", err)
        return 1
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Supervised contrastive training from a JSON config."""
    return run_cli(argv, USAGE, help_text, lambda args: train(parse_args(args)))
