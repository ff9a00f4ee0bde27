"""Training arguments: the groups every stage shares (backbone, LoRA, run control), the supervised
stage's own (encoder settings, data, loss), and reading a config with ``--key value`` overrides.

A supervised (or SimCSE) config is one flat JSON object mixing ``ModelArguments``, ``DataArguments``,
``CustomArguments`` and Hugging Face ``TrainingArguments`` fields (as upstream's ``HfArgumentParser``
reads it), checked by the one validator (``schema.StageSchema``) before any model loads. The LM
stages' ``LMStageArguments`` (``lm.py``) build on the same shared groups.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from transformers import TrainingArguments

from diffusion_embedder.config import field_types as encoder_field_types
from diffusion_embedder.config import setting_fields
from diffusion_embedder.data import DATASET_READERS
from diffusion_embedder.data.batching import GROUP_BY
from diffusion_embedder.dtypes import TORCH_DTYPES
from diffusion_embedder.files import read_json_object
from diffusion_embedder.losses import LOSSES
from diffusion_embedder.training import liger
from diffusion_embedder.training.fsdp import LORA_STAGE_REFUSAL, lora_stage_rules
from diffusion_embedder.training.rows import row_rules
from diffusion_embedder.training.schema import (
    TRAINING_DEFAULTS,
    ConfigError,
    StageSchema,
    default_of,
    field_aliases,
    field_table,
)
from diffusion_embedder.values import from_text, matches_type

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention", "varlen")
LOSS_CLASSES = tuple(LOSSES)
DATASET_NAMES = tuple(DATASET_READERS)
#: LLM2Vec's training names for encoder settings, still accepted (the JSON configs of the paper use them).
MODEL_ALIASES = {"max_seq_length": "max_length", "bidirectional": "enable_bidirectional"}


@dataclass(kw_only=True)
class BackboneArguments:
    """Which base a stage loads, and how (every stage)."""

    model_name_or_path: str = field(
        metadata={"help": "Base checkpoint (hub name or folder); the LM stages load it with its LM head."}
    )
    torch_dtype: str | None = field(
        default=None, metadata={"help": "Weights dtype; null = float32.", "choices": (None, *TORCH_DTYPES)}
    )
    attn_implementation: str = field(
        default="sdpa", metadata={"help": "Attention kernel.", "choices": ATTN_IMPLEMENTATIONS}
    )
    compile_layers: bool = field(
        default=False, metadata={"help": "torch.compile each decoder layer once (dynamic shapes; compilation.py)."}
    )


@dataclass(kw_only=True)
class LoraArguments:
    """The LoRA a stage trains (every stage), with the defaults of LLM2Vec's supervised and MNTP scripts."""

    lora_r: int = field(default=8, metadata={"help": "LoRA rank."})
    lora_alpha: int | None = field(default=None, metadata={"help": "LoRA alpha; None = 2 * lora_r (upstream)."})
    lora_dropout: float = field(default=0.05, metadata={"help": "LoRA dropout."})
    lora_target_modules: list[str] = field(
        default_factory=lambda: list(LORA_TARGETS), metadata={"help": "Projections that get LoRA."}
    )

    def __post_init__(self):
        if self.lora_alpha is None:
            self.lora_alpha = 2 * self.lora_r


@dataclass(kw_only=True)
class RunArguments:
    """Run control (every stage): the run folder's name and claim, stopping early, starting afresh."""

    stop_after_n_steps: int | None = field(
        default=10000, metadata={"help": "Stop (and checkpoint) after this many optimizer steps; null: never."}
    )
    experiment_id: str | None = field(default=None, metadata={"help": "Run folder name; None = derived id."})
    overwrite_output_dir: bool = field(
        default=False, metadata={"help": "Start afresh in a run folder that holds checkpoints (deletes them)."}
    )
    break_run_claim: bool = field(
        default=False,
        metadata={"help": "Take over a run folder claimed by a run on another host that has ended (run_claim.json)."},
    )


def _model_arguments() -> type:
    """``ModelArguments``: the backbone, an earlier adapter, and every ``EncoderConfig`` setting (its name,
    type, default, choices and help; ``metadata["setting"]`` marks it)."""
    hints = encoder_field_types()
    specs: list[tuple] = [
        (
            "peft_model_name_or_path",
            str | None,
            field(
                default=None,
                metadata={"help": "Earlier adapter: merged (MNTP), or continued if its name (its folder, or its run's "
                                  "for a checkpoint-N) contains 'simcse'."},
            ),
        ),
    ]
    aliases = {canonical: alias for alias, canonical in MODEL_ALIASES.items()}
    for f in setting_fields():
        metadata = dict(f.metadata)
        if f.name in aliases:
            metadata.update(help=f"{f.metadata['help']} (upstream name: {aliases[f.name]})", alias=aliases[f.name])
        default = {"default": f.default} if f.default_factory is dataclasses.MISSING else {
            "default_factory": f.default_factory
        }
        specs.append((f.name, hints[f.name], field(metadata=metadata, **default)))

    def encoder_settings(self) -> dict[str, Any]:
        """The ``EncoderConfig`` settings of this config, as given to ``Encoder.from_pretrained``."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.metadata.get("setting")}

    cls = dataclasses.make_dataclass(
        "ModelArguments",
        specs,
        bases=(BackboneArguments,),
        namespace={"encoder_settings": encoder_settings, "__module__": __name__},
    )
    cls.__doc__ = "Which backbone, which earlier adapter, and the encoder settings saved with every checkpoint."
    return cls


ModelArguments = _model_arguments()


@dataclass
class DataArguments:
    """Which training set and how it is batched."""

    dataset_name: str = field(metadata={"help": "Training set (its reader).", "choices": DATASET_NAMES})
    dataset_file_path: str | None = field(
        default=None, metadata={"help": "E5 folder, MSMARCO hub name or file, Custom JSONL (reader default if None)."}
    )
    aug_file_path: str | None = field(default=None, metadata={"help": "ReasonAug JSONL (for ReasonAug / E5Mix)."})
    domain: str = field(default="all", metadata={"help": "ReasonAug domain filter."})
    task: str = field(default="all", metadata={"help": "ReasonAug task-type filter."})
    num_negatives: int | None = field(
        default=None, metadata={"help": "Hard negatives per query (None: the reader's: E5/ReasonAug 1, MSMARCO 15)."}
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep the first N samples read."})
    group_by: str = field(
        default="global",
        metadata={
            "help": "'global': one group per optimizer step (LLM2Vec); 'device': per device batch (the fork); "
            "'none': batches drawn from the whole dataset, every group mixed.",
            "choices": GROUP_BY,
        },
    )
    skip_bad_lines: bool = field(default=False, metadata={"help": "Count and skip malformed records, not fail."})


@dataclass
class CustomArguments(RunArguments, LoraArguments):
    """The supervised script's custom options: LoRA and run control (shared), loss, GradCache, packing."""

    loss_class: str = field(
        default="HardNegativeNLLLoss", metadata={"help": "Contrastive loss (losses.LOSSES).", "choices": LOSS_CLASSES}
    )
    loss_scale: float = field(default=50.0, metadata={"help": "HardNegativeNLLLoss cosine scale (1/temperature)."})
    scale_by_dim: bool = field(default=False, metadata={"help": "RepllamaLoss: embeddings times 1/sqrt(d)."})
    in_batch_negatives: bool = field(default=False, metadata={"help": "RepllamaLoss: other passages as negatives."})
    cross_device_negatives: bool = field(default=False, metadata={"help": "RepllamaLoss: gather them from all ranks."})
    grad_cache_chunk_size: int | None = field(
        default=None, metadata={"help": "GradCache: texts per forward chunk (memory bounded by the chunk)."}
    )
    simcse_dropout: float | None = field(
        default=None, metadata={"help": "Backbone attention dropout (SimCSE's two views; upstream 0.3)."}
    )
    pack_length: int | Literal["auto"] | None = field(
        default="auto",
        metadata={
            "help": "Padding-free training: pack each text column into rows of at most this many tokens (on CUDA "
            "on the varlen kernel); 'auto': rows of 8192 on CUDA where the varlen kernel runs, else padded; "
            "null: padded."
        },
    )


ARGUMENT_CLASSES = (ModelArguments, DataArguments, CustomArguments, TrainingArguments)
SUPERVISED = StageSchema(ARGUMENT_CLASSES, rules=(lora_stage_rules, row_rules, liger.config_problems),
                         refused={"fsdp": LORA_STAGE_REFUSAL, "fsdp_config": LORA_STAGE_REFUSAL})


@dataclass
class TrainConfig:
    """The validated config: one dataclass per argument group, plus the merged raw values."""

    model: ModelArguments
    data: DataArguments
    custom: CustomArguments
    training: TrainingArguments
    values: dict[str, Any]


def parse_overrides(argv: list[str], classes: tuple[type, ...] = ARGUMENT_CLASSES) -> dict[str, Any]:
    """``["--lr", "1e-4", "--bf16", "--x=1"]`` -> values typed by the fields they name (``values.from_text``: the
    value the same text means in the JSON config; unknown keys kept raw), under the names given (an upstream or
    other-release spelling is renamed with the config's, so errors name it as given). A bare ``--flag`` is true."""
    table, aliases = field_table(classes), field_aliases(classes)
    out: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("--") or len(token) == 2:
            raise ConfigError(f"Expected --key value after the config path, got {token!r}.")
        key, eq, raw = token[2:].partition("=")
        key = key.replace("-", "_")
        field_name = aliases.get(key, key)
        tp = table[field_name][2] if field_name in table else str
        if not eq:
            has_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
            if not has_value:
                if not matches_type(True, tp):
                    raise ConfigError(f"--{key} needs a value.")
                out[key] = True
                i += 1
                continue
            raw = argv[i + 1]
            i += 1
        out[key] = from_text(raw, tp)
        i += 1
    return out


def read_config_values(
    path: str | os.PathLike, overrides: list[str] | None = None, classes: tuple[type, ...] = ARGUMENT_CLASSES
) -> dict[str, Any]:
    """A JSON config's values with ``--key value`` overrides applied (typed by the fields of ``classes``)."""
    values = read_json_object(path, ConfigError)
    overridden = parse_overrides(overrides or [], classes)
    for alias, canonical in field_aliases(classes).items():  # an override replaces the setting under either name
        if canonical in overridden or alias in overridden:
            values.pop(alias, None)
            values.pop(canonical, None)
    values.update(overridden)
    return values


def default_value(key: str, classes: tuple[type, ...] = ARGUMENT_CLASSES) -> Any:
    """The value a config key takes when the config leaves it out (None for a key ``classes`` do not know)."""
    if key in TRAINING_DEFAULTS:
        return TRAINING_DEFAULTS[key]
    table = field_table(classes)
    return default_of(table[key][1]) if key in table else None


def validate(values: dict[str, Any], source: str = "config") -> TrainConfig:
    """Check every key, type, choice and required field; build the four argument objects."""
    values, (model, data, custom, training) = SUPERVISED.resolve(values, source)
    return TrainConfig(model, data, custom, training, values)


def load_config(path: str | os.PathLike, overrides: list[str] | None = None) -> TrainConfig:
    """Read a JSON config, apply ``--key value`` overrides, validate."""
    return validate(read_config_values(path, overrides), source=f"config {path}")


def parse_args(argv: list[str]) -> TrainConfig:
    """``[CONFIG.json, --key, value, ...]`` as given to ``experiments/run_supervised.py``."""
    if not argv or argv[0].startswith("--"):
        raise ConfigError("Usage: run_supervised.py CONFIG.json [--key value ...]")
    return load_config(argv[0], argv[1:])
