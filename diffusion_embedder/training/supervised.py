"""The supervised contrastive stage: ``torchrun --nproc_per_node=N experiments/run_supervised.py CONFIG.json
[--key value ...]`` (also ``diffusion-embedder train``).

The config is validated first (no model is loaded for a bad config), then the data is read (a bad line
stops the run before its folder is touched), then the run is opened (``start_run``: run folder claimed,
checkpoint to resume from), then the encoder is built (``build_trainer``) and trained (``fit``).
SimCSE (``simcse.py``) is this stage with its own defaults and checks.
"""

from __future__ import annotations

import logging
import re

from diffusion_embedder import clihelp
from diffusion_embedder.compilation import compile_layers
from diffusion_embedder.data import DATASET_READERS, ContrastiveCollator, ContrastiveDataset, load_train_dataset
from diffusion_embedder.encoder import Encoder
from diffusion_embedder.losses import loss_from_config
from diffusion_embedder.training.arguments import (
    SUPERVISED,
    CustomArguments,
    ModelArguments,
    TrainConfig,
    parse_args,
)
from diffusion_embedder.training.checkpointing import enable_checkpointing
from diffusion_embedder.training.liger import apply_liger
from diffusion_embedder.training.lora import add_lora, continue_adapter, log_trainable
from diffusion_embedder.training.rows import training_rows
from diffusion_embedder.training.runner import (
    OpenRun,
    fit_built,
    global_batch_size,
    located,
    model_short_name,
    open_run,
    run_cli,
)
from diffusion_embedder.training.schema import ConfigError
from diffusion_embedder.training.trainer import EncoderTrainer

logger = logging.getLogger(__name__)

USAGE = (
    f"{clihelp.config_usage('train')}\n"
    "CONFIG.json: the fields below and any Hugging Face TrainingArguments field (train_configs/);\n"
    "--key value pairs override the file. LLM2Vec's max_seq_length and bidirectional are accepted."
)


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def experiment_id(cfg: TrainConfig) -> str:
    """Upstream's run name: dataset, model short name, pooling, global batch, length, bidirectional,
    epochs, seed, warmup, lr and LoRA rank."""
    t = cfg.training
    return (
        f"{cfg.data.dataset_name}_train_m-{model_short_name(cfg.model.model_name_or_path)}_p-{cfg.model.pooling_mode}"
        f"_b-{global_batch_size(t)}_l-{cfg.model.max_length}_bidirectional-{cfg.model.enable_bidirectional}"
        f"_e-{_number(t.num_train_epochs)}_s-{t.seed}_w-{t.warmup_steps}_lr-{t.learning_rate}_lora_r-{cfg.custom.lora_r}"
    )


def build_dataset(cfg: TrainConfig) -> tuple[ContrastiveDataset, int]:
    """The reader named in the config with the options it registered; returns it and the negatives per query."""
    d = cfg.data
    name = d.dataset_name
    spec = DATASET_READERS[name]
    negatives = d.num_negatives if d.num_negatives is not None else spec.negatives
    if spec.fixed_negatives and negatives > spec.negatives:
        raise ConfigError(f"num_negatives={negatives}: {name} has {spec.negatives} hard negative(s) per query.")
    if negatives < spec.min_negatives:
        raise ConfigError(f"num_negatives={negatives}: {name}'s samples always hold {spec.min_negatives} hard "
                          f"negatives (its instruction negatives); use num_negatives >= {spec.min_negatives}.")
    available = {**vars(d), "num_negatives": negatives, "seed": cfg.training.seed}
    options = {key: available[key] for key in spec.options}
    path = getattr(d, spec.path_field) or d.dataset_file_path
    dataset = load_train_dataset(name, path, skip_bad_lines=d.skip_bad_lines, **options)
    if d.max_train_samples is not None and d.max_train_samples < len(dataset):
        dataset = ContrastiveDataset(dataset.samples[: d.max_train_samples], dataset.name, dataset.num_bad_records)
    if dataset.num_bad_records:
        logger.warning("%s: skipped %d malformed record(s).", name, dataset.num_bad_records)
    return dataset, negatives


def graph_tokens(cfg: TrainConfig, num_negatives: int) -> int:
    """The most tokens whose graph is alive at once in a step: a GradCache chunk's texts, or every text of the
    micro-batch (the columns' graphs wait for the loss), each at ``max_length`` (what ``activation_checkpointing:
    "auto"`` plans for)."""
    texts = cfg.custom.grad_cache_chunk_size or cfg.training.per_device_train_batch_size * (2 + num_negatives)
    return texts * cfg.model.max_length


def adapter_name(path: str) -> str:
    """An adapter's own name, never the folders it sits in: the last part of its folder or hub name, with its run's
    folder in front of a ``checkpoint-N`` (a SimCSE run's checkpoint is continued as the run's adapter)."""
    parts = [p for p in path.replace("\\", "/").rstrip("/").split("/") if p]
    if len(parts) > 1 and re.fullmatch(r"checkpoint-\d+", parts[-1]):
        return f"{parts[-2]}/{parts[-1]}"
    return parts[-1] if parts else path


def prepare_encoder(
    model_args: ModelArguments, custom: CustomArguments, training_args, tokens: int | None = None
) -> Encoder:
    """Load the encoder and make it trainable: a fresh LoRA (after merging an earlier adapter such as
    MNTP), or, when the adapter's name contains "simcse", that adapter continued (upstream's rule); then the
    decoder layers checkpointed that the config asks for (``tokens`` per graph: what "auto" plans for).
    """
    peft_path = located(model_args.peft_model_name_or_path)
    continuing = peft_path is not None and "simcse" in adapter_name(peft_path).lower()
    encoder = Encoder.from_pretrained(
        located(model_args.model_name_or_path),
        peft_model_name_or_path=peft_path,
        merge_peft=not continuing,
        torch_dtype=model_args.torch_dtype,
        attn_implementation=model_args.attn_implementation,
        device=training_args.device,
        **model_args.encoder_settings(),
        **({"attention_dropout": custom.simcse_dropout} if custom.simcse_dropout is not None else {}),
    )
    if continuing:
        continue_adapter(encoder.model)
        logger.info("Continuing the adapter %s (no new LoRA).", peft_path)
    else:
        encoder.model = add_lora(encoder.model, custom)
    enable_checkpointing(encoder.model, training_args, tokens)
    apply_liger(encoder.model, training_args)
    if model_args.compile_layers:
        compile_layers(encoder.model)
    log_trainable(encoder)
    return encoder


def start_run(cfg: TrainConfig) -> OpenRun:
    """``open_run`` for a supervised config."""
    run_id = cfg.custom.experiment_id or experiment_id(cfg)
    return open_run(cfg.training, run_id, cfg.values, cfg.custom)


def build_trainer(cfg: TrainConfig, data: tuple[ContrastiveDataset, int] | None = None) -> EncoderTrainer:
    """The supervised stage: data (``build_dataset``'s, read here if not given), trainable encoder, its rows and
    attention (``rows.training_rows``), loss and collator, each from its config fields."""
    dataset, num_negatives = data or build_dataset(cfg)
    encoder = prepare_encoder(cfg.model, cfg.custom, cfg.training, graph_tokens(cfg, num_negatives))
    pack_length = training_rows(cfg.custom.pack_length, encoder, cfg.custom.simcse_dropout)
    return EncoderTrainer(
        model=encoder,
        args=cfg.training,
        train_dataset=dataset,
        data_collator=ContrastiveCollator(
            encoder,
            num_negatives=num_negatives,
            pack_length=pack_length,
            chunk_size=cfg.custom.grad_cache_chunk_size,
        ),
        loss_fn=loss_from_config(cfg.custom.loss_class, cfg.custom),
        grad_cache_chunk_size=cfg.custom.grad_cache_chunk_size,
        group_by=cfg.data.group_by,
        run_config=cfg.values,
    )


def train(cfg: TrainConfig) -> str:
    """Run one supervised training; returns the run folder (its root holds the final encoder)."""
    data = build_dataset(cfg)  # first: a bad data file stops the run before its folder is touched
    run = start_run(cfg)
    return fit_built(lambda: build_trainer(cfg, data), run, cfg.custom.stop_after_n_steps)


def main(argv: list[str] | None = None) -> int:
    """Supervised contrastive training from a JSON config."""
    return run_cli(argv, USAGE, SUPERVISED, lambda args: train(parse_args(args)))
