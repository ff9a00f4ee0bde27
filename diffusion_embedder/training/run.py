"""``torchrun --nproc_per_node=N experiments/run_supervised.py CONFIG.json [--key value ...]``.

Order matters: the config is validated first (no model is loaded for a bad config), then the data is
read (a bad line stops the run before the model loads), then the encoder is built and trained.
"""

from __future__ import annotations

import gc
import logging
import os
import sys

import torch.distributed as dist
from transformers import set_seed

from diffusion_embedder import clihelp
from diffusion_embedder.data import DATASET_READERS, ContrastiveCollator, ContrastiveDataset, load_train_dataset
from diffusion_embedder.losses import loss_from_config
from diffusion_embedder.training.arguments import ARGUMENT_CLASSES, CHOICES, ConfigError, TrainConfig, parse_args
from diffusion_embedder.training.checkpoints import find_last_checkpoint, is_complete_checkpoint
from diffusion_embedder.training.model import prepare_encoder
from diffusion_embedder.training.trainer import EncoderTrainer, NonFiniteLossError, StopAfterNStepsCallback

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


def resolve_resume(value: str | None, output_dir: str) -> str | None:
    """``last`` -> newest complete checkpoint in ``output_dir`` (None: start fresh); a path must be complete."""
    if value is None or value.lower() in ("false", "none", ""):
        return None
    if value.lower() in RESUME_LAST:
        last = find_last_checkpoint(output_dir)
        if last is None:
            logger.info("No complete checkpoint in %s: starting from scratch.", output_dir)
        return last
    if not is_complete_checkpoint(value):
        raise ConfigError(
            f"resume_from_checkpoint={value!r} is not a complete checkpoint (no checkpoint_complete.json); "
            "use 'last' to pick the newest complete one."
        )
    if not os.path.isfile(os.path.join(value, "optimizer.pt")):
        raise ConfigError(
            f"{value} holds no optimizer state (written with save_only_model=true), so the run cannot resume "
            "exactly; set save_only_model to false for resumable runs."
        )
    return value


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


def train(cfg: TrainConfig) -> str:
    """Run one training; returns the run folder (its root holds the final encoder)."""
    t = cfg.training
    set_seed(t.seed)
    run_id = cfg.custom.experiment_id or experiment_id(cfg)
    t.output_dir = os.path.join(t.output_dir, run_id)
    resume = resolve_resume(t.resume_from_checkpoint, t.output_dir)
    logger.info("Run folder %s%s", t.output_dir, f", resuming from {resume}" if resume else "")

    dataset, num_negatives = build_dataset(cfg)
    encoder = prepare_encoder(cfg.model, cfg.custom, t)
    loss_fn = loss_from_config(cfg.custom.loss_class, cfg.custom)
    trainer = EncoderTrainer(
        model=encoder,
        args=t,
        train_dataset=dataset,
        data_collator=ContrastiveCollator(encoder, num_negatives=num_negatives, pack_length=cfg.custom.pack_length),
        loss_fn=loss_fn,
        grad_cache_chunk_size=cfg.custom.grad_cache_chunk_size,
        group_by=cfg.data.group_by,
        run_config=cfg.values,
    )
    if cfg.custom.stop_after_n_steps is not None:
        trainer.add_callback(StopAfterNStepsCallback(cfg.custom.stop_after_n_steps))
    try:
        trainer.train(resume_from_checkpoint=resume)
        trainer.save_model(t.output_dir)
    finally:
        # DDP's reducer must be gone before the process group is destroyed (gloo aborts otherwise).
        del trainer
        gc.collect()
    return t.output_dir


def main(argv: list[str] | None = None) -> int:
    """CLI entry: exit status 0 on success, 2 for a bad config, 1 for a diverged run."""
    logging.basicConfig(
        format="%(asctime)s - %(name)s - %(levelname)s - %(message)s", datefmt="%Y-%m-%d %H:%M:%S", level=logging.INFO
    )
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(help_text() if argv else USAGE)
        return 0 if argv else 2
    try:
        cfg = parse_args(argv)
        train(cfg)
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
