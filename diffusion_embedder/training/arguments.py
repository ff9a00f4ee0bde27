"""Training configuration: upstream's JSON field names, validated into dataclasses before any model loads.

A config is one flat JSON object mixing ``ModelArguments``, ``DataArguments``, ``CustomArguments`` and
Hugging Face ``TrainingArguments`` fields (as upstream's ``HfArgumentParser`` reads it). ``--key value``
pairs after the JSON path override it. Every problem is reported at once, each naming the field: an
unknown key (with the closest valid one), a value of the wrong type (with the expected type), a
missing required field, or a value outside its choices.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import json
import logging
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments

from diffusion_embedder.clihelp import default_text
from diffusion_embedder.config import field_types as encoder_field_types
from diffusion_embedder.config import matches_type, setting_fields, value_problem
from diffusion_embedder.data import DATASET_READERS
from diffusion_embedder.data.batching import GROUP_BY
from diffusion_embedder.dtypes import TORCH_DTYPES
from diffusion_embedder.files import read_json_object

logger = logging.getLogger(__name__)

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")
LOSS_CLASSES = ("HardNegativeNLLLoss", "RepllamaLoss")
DATASET_NAMES = tuple(DATASET_READERS)


class ConfigError(ValueError):
    """A training config that cannot run; the message lists every problem found."""


#: LLM2Vec's training names for encoder settings, still accepted (the JSON configs of the paper use them).
MODEL_ALIASES = {"max_seq_length": "max_length", "bidirectional": "enable_bidirectional"}


def _model_arguments() -> type:
    """``ModelArguments``: what to load, plus every ``EncoderConfig`` setting (its name, type, default, choices)."""
    hints = encoder_field_types()
    specs: list[tuple] = [
        ("model_name_or_path", str, field(metadata={"help": "Base checkpoint (hub name or folder)."})),
        (
            "peft_model_name_or_path",
            str | None,
            field(
                default=None,
                metadata={"help": "Earlier adapter: merged (MNTP), or continued if its name contains 'simcse'."},
            ),
        ),
        ("torch_dtype", str | None, field(default=None, metadata={"help": "Weights dtype; null = float32."})),
        ("attn_implementation", str, field(default="sdpa", metadata={"help": "Attention kernel."})),
    ]
    aliases = {canonical: alias for alias, canonical in MODEL_ALIASES.items()}
    for f in setting_fields():
        help_ = f.metadata["help"] + (f" (upstream name: {aliases[f.name]})" if f.name in aliases else "")
        metadata = {**f.metadata, "help": help_}
        default = {"default": f.default} if f.default_factory is dataclasses.MISSING else {
            "default_factory": f.default_factory
        }
        specs.append((f.name, hints[f.name], field(metadata=metadata, **default)))

    def encoder_settings(self) -> dict[str, Any]:
        """The ``EncoderConfig`` settings of this config, as given to ``Encoder.from_pretrained``."""
        return {f.name: getattr(self, f.name) for f in setting_fields()}

    cls = dataclasses.make_dataclass(
        "ModelArguments", specs, namespace={"encoder_settings": encoder_settings, "__module__": __name__}
    )
    cls.__doc__ = "Which backbone, which earlier adapter, and the encoder settings saved with every checkpoint."
    return cls


ModelArguments = _model_arguments()


@dataclass
class DataArguments:
    """Which training set and how it is batched."""

    dataset_name: str = field(metadata={"help": f"One of {DATASET_NAMES}."})
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
        metadata={"help": "'global': one group per optimizer step (LLM2Vec); 'device': per device batch (the fork); "
                         "'none': batches drawn from the whole dataset, every group mixed."},
    )
    skip_bad_lines: bool = field(default=False, metadata={"help": "Count and skip malformed records, not fail."})


@dataclass
class CustomArguments:
    """LoRA, loss and run-control options of the supervised script."""

    lora_r: int = field(default=8, metadata={"help": "LoRA rank."})
    lora_alpha: int | None = field(default=None, metadata={"help": "LoRA alpha; None = 2 * lora_r (upstream)."})
    lora_dropout: float = field(default=0.05, metadata={"help": "LoRA dropout."})
    lora_target_modules: list[str] = field(
        default_factory=lambda: list(LORA_TARGETS), metadata={"help": "Projections that get LoRA."}
    )
    stop_after_n_steps: int | None = field(
        default=10000, metadata={"help": "Stop (and checkpoint) after this many optimizer steps."}
    )
    experiment_id: str | None = field(default=None, metadata={"help": "Run folder name; None = derived id."})
    loss_class: str = field(default="HardNegativeNLLLoss", metadata={"help": f"One of {LOSS_CLASSES}."})
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
    pack_length: int | None = field(
        default=None,
        metadata={"help": "Padding-free training: pack each text column into rows of at most this many tokens."},
    )
    overwrite_output_dir: bool = field(
        default=False, metadata={"help": "Start afresh in a run folder that holds checkpoints (deletes them)."}
    )


ARGUMENT_CLASSES = (ModelArguments, DataArguments, CustomArguments, TrainingArguments)
#: Defaults that differ from TrainingArguments' (our dataset is not a `datasets.Dataset`).
TRAINING_DEFAULTS = {"remove_unused_columns": False}
REQUIRED_TRAINING = ("output_dir",)
CHOICES = {
    "torch_dtype": (None, *TORCH_DTYPES),
    "attn_implementation": ATTN_IMPLEMENTATIONS,
    **{f.name: f.metadata["choices"] for f in setting_fields() if f.metadata.get("choices")},
    "dataset_name": DATASET_NAMES,
    "group_by": GROUP_BY,
    "loss_class": LOSS_CLASSES,
}


#: Numeric ranges checked with the rest of the config, before any model loads: ``(low, high)`` bounds,
#: each ``(value, inclusive)`` or None.
RANGES: dict[str, tuple[tuple[float, bool] | None, tuple[float, bool] | None]] = {
    "per_device_train_batch_size": ((1, True), None),
    "gradient_accumulation_steps": ((1, True), None),
    "lora_r": ((1, True), None),
    "lora_alpha": ((0, False), None),
    "lora_dropout": ((0, True), (1, False)),
    "learning_rate": ((0, False), None),
    "max_seq_length": ((1, True), None),  # the LM stages' block length (supervised: EncoderConfig's max_length)
    "grad_cache_chunk_size": ((1, True), None),
    "pack_length": ((1, True), None),
    "stop_after_n_steps": ((1, True), None),
    "num_negatives": ((0, True), None),
    "max_train_samples": ((1, True), None),
    "loss_scale": ((0, False), None),
    "num_train_epochs": ((0, False), None),
    "warmup_steps": ((0, True), None),
    "warmup_ratio": ((0, True), (1, True)),
    "weight_decay": ((0, True), None),
    "max_grad_norm": ((0, True), None),
    "adam_epsilon": ((0, False), None),
    "adam_beta1": ((0, True), (1, False)),
    "adam_beta2": ((0, True), (1, False)),
    "save_steps": ((0, False), None),
    "logging_steps": ((0, False), None),
    "save_total_limit": ((1, True), None),
    "seed": ((0, True), None),
    "dataloader_num_workers": ((0, True), None),
}
_NO_EVAL = "there is no evaluation during training yet; evaluate checkpoints with `diffusion-embedder eval`"
#: Settings we accept in the config but cannot honour yet: the only value allowed, and why.
UNSUPPORTED = {"eval_strategy": ("no", _NO_EVAL), "do_eval": (False, _NO_EVAL)}


def range_errors(values: dict[str, Any], ranges: dict[str, tuple] = RANGES) -> list[str]:
    """One message per numeric value outside its range, or unsupported setting, naming the field."""
    errors = []
    for name, (low, high) in ranges.items():
        value = values.get(name)
        if not isinstance(value, int | float) or isinstance(value, bool):
            continue
        if low is not None and (value < low[0] or (value == low[0] and not low[1])):
            errors.append(f"{name}: must be {'>=' if low[1] else '>'} {low[0]}, got {value}")
        if high is not None and (value > high[0] or (value == high[0] and not high[1])):
            errors.append(f"{name}: must be {'<=' if high[1] else '<'} {high[0]}, got {value}")
    max_steps = values.get("max_steps")
    if isinstance(max_steps, int) and not isinstance(max_steps, bool) and max_steps != -1 and max_steps < 1:
        errors.append(f"max_steps: must be >= 1 (or -1 to train num_train_epochs), got {max_steps}")
    for name, (allowed, why) in UNSUPPORTED.items():
        if name in values and values[name] != allowed:
            errors.append(f"{name}: {values[name]!r} is not supported ({why}); leave it at {allowed!r}")
    return errors


def _runtime_defaults() -> dict[str, Any]:
    """Under torchrun without CUDA, accelerate only forms the gloo process group with ``use_cpu``."""
    import torch

    if not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return {"use_cpu": True}
    return {}


@dataclass
class TrainConfig:
    """The validated config: one dataclass per argument group, plus the merged raw values."""

    model: ModelArguments
    data: DataArguments
    custom: CustomArguments
    training: TrainingArguments
    values: dict[str, Any]


def _fields(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls) if f.init and not f.name.startswith("_")}


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "null"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return f"one of {[m.value for m in tp]}"
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _describe(tp: Any) -> str:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is typing.Literal:
        return " or ".join(repr(a) for a in typing.get_args(tp))
    return _type_name(tp)


def _enum_choices(tp: Any) -> list[str] | None:
    """Allowed strings of an ``Enum | str`` field (e.g. lr_scheduler_type), so a typo is caught early."""
    for arg in typing.get_args(tp):
        if isinstance(arg, type) and issubclass(arg, enum.Enum):
            return [m.value for m in arg]
    return None


def _field_table(classes: tuple[type, ...] = ARGUMENT_CLASSES) -> dict[str, tuple[type, dataclasses.Field, Any]]:
    table = {}
    for cls in classes:
        hints = _hints(cls)
        for name, f in _fields(cls).items():
            table.setdefault(name, (cls, f, hints[name]))
    return table


def _parse_cli_value(raw: str, tp: Any) -> Any:
    """A ``--key value`` string as the field's type: JSON first (numbers, true/false, null, lists)."""
    lowered = raw.strip().lower()
    if matches_type(True, tp) and lowered in ("true", "yes", "1", "false", "no", "0"):
        return lowered in ("true", "yes", "1")
    if lowered == "null" or (lowered == "none" and not matches_type("none", tp)):
        return None  # "none" stays a string where one is allowed (report_to none)
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        return raw
    if matches_type(value, tp):
        return value
    return raw if matches_type(raw, tp) else value


def parse_overrides(argv: list[str], classes: tuple[type, ...] = ARGUMENT_CLASSES) -> dict[str, Any]:
    """``["--lr", "1e-4", "--bf16", "--x=1"]`` -> values typed by the fields they name (unknown keys kept raw)."""
    table = _field_table(classes)
    out: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("--") or len(token) == 2:
            raise ConfigError(f"Expected --key value after the config path, got {token!r}.")
        key, eq, raw = token[2:].partition("=")
        key = key.replace("-", "_")
        if key not in table:
            key = MODEL_ALIASES.get(key, key)
        tp = table[key][2] if key in table else str
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
        out[key] = _parse_cli_value(raw, tp)
        i += 1
    return out


def _value_errors(
    values: dict[str, Any], table: dict[str, tuple], choices: dict[str, tuple], own_classes: tuple[type, ...]
) -> list[str]:
    """Unknown keys (with the closest valid one), wrong types, values outside their choices, missing fields."""
    errors: list[str] = []
    for key, value in values.items():
        if key not in table:
            close = difflib.get_close_matches(key, table, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            errors.append(f"unknown key {key!r}{hint}")
            continue
        _, _, tp = table[key]
        if not matches_type(value, tp):
            errors.append(f"{key}: {value!r} ({type(value).__name__}) is not of type {_describe(tp)}")
            continue
        allowed = choices.get(key) or (_enum_choices(tp) if isinstance(value, str) else None)
        if allowed is not None and value not in allowed:
            close = difflib.get_close_matches(str(value), [str(a) for a in allowed if a is not None], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            errors.append(f"{key}: {value!r} is not one of {[a for a in allowed]}{hint}")
    for cls in own_classes:
        for name, f in _fields(cls).items():
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and name not in values:
                errors.append(f"missing required field {name!r} ({cls.__name__})")
    return errors


SETTING_NAMES = tuple(f.name for f in setting_fields())


def canonical_names(values: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Upstream names (``MODEL_ALIASES``) renamed to ours; giving both names of one setting is an error."""
    values, errors = dict(values), []
    for alias, canonical in MODEL_ALIASES.items():
        if alias in values:
            if canonical in values:
                errors.append(f"{alias} and {canonical} are the same setting; give one")
            values[canonical] = values.pop(alias)
    return values, errors


def validate(values: dict[str, Any], source: str = "config") -> TrainConfig:
    """Check every key, type, choice and required field; build the four argument objects."""
    table = _field_table()
    values, errors = canonical_names(values)
    errors += _value_errors(values, table, CHOICES, ARGUMENT_CLASSES[:3])
    for key, value in values.items():  # EncoderConfig's own checks (prompt_template, lengths...)
        if key in SETTING_NAMES and key not in CHOICES and matches_type(value, table[key][2]):
            errors += [problem for problem in [value_problem(key, value)] if problem]
    for name in REQUIRED_TRAINING:
        if values.get(name) is None:
            errors.append(f"missing required field {name!r} (TrainingArguments)")
    errors.extend(range_errors(values))
    if errors:
        raise ConfigError(f"Invalid training {source}:\n  - " + "\n  - ".join(errors))

    groups: dict[type, dict[str, Any]] = {cls: {} for cls in ARGUMENT_CLASSES}
    for key, value in {**TRAINING_DEFAULTS, **_runtime_defaults(), **values}.items():
        groups[table[key][0]][key] = value
    try:
        built = [cls(**groups[cls]) for cls in ARGUMENT_CLASSES]
    except (ValueError, TypeError) as err:
        raise ConfigError(f"Invalid training {source}: {err}") from err
    model, data, custom, training = built
    if custom.lora_alpha is None:
        custom.lora_alpha = 2 * custom.lora_r
    return TrainConfig(model, data, custom, training, dict(values))


def read_config_values(
    path: str | os.PathLike, overrides: list[str] | None = None, classes: tuple[type, ...] = ARGUMENT_CLASSES
) -> dict[str, Any]:
    """A JSON config's values with ``--key value`` overrides applied (typed by the fields of ``classes``)."""
    values = read_json_object(path, ConfigError)
    overridden = parse_overrides(overrides or [], classes)
    for alias, canonical in MODEL_ALIASES.items():  # an override replaces the setting under either name
        if alias in overridden or canonical in overridden:
            values.pop(alias, None)
            values.pop(canonical, None)
    values.update(overridden)
    return values


def load_config(path: str | os.PathLike, overrides: list[str] | None = None) -> TrainConfig:
    """Read a JSON config, apply ``--key value`` overrides, validate."""
    return validate(read_config_values(path, overrides), source=f"config {path}")


def parse_args(argv: list[str]) -> TrainConfig:
    """``[CONFIG.json, --key, value, ...]`` as given to ``experiments/run_supervised.py``."""
    if not argv or argv[0].startswith("--"):
        raise ConfigError("Usage: run_supervised.py CONFIG.json [--key value ...]")
    return load_config(argv[0], argv[1:])


def default_value(key: str, classes: tuple[type, ...] = ARGUMENT_CLASSES) -> Any:
    """The value a config key takes when the config leaves it out (None for a key ``classes`` do not know)."""
    if key in TRAINING_DEFAULTS:
        return TRAINING_DEFAULTS[key]
    table = _field_table(classes)
    if key not in table:
        return None
    f = table[key][1]
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return None
    return value.value if isinstance(value, enum.Enum) else value


def field_docs() -> list[tuple[str, str, str, str]]:
    """(group, field, type, default and help) rows of our own argument groups, for the README table."""
    rows = []
    for cls in ARGUMENT_CLASSES[:3]:
        hints = _hints(cls)
        for name, f in _fields(cls).items():
            default = default_text(f)
            choices = CHOICES.get(name)
            listed = f" One of {', '.join(str(c) for c in choices)}." if choices else ""
            help_ = f"{default}: {f.metadata.get('help', '')}{listed}"
            rows.append((cls.__name__, name, _describe(hints[name]), help_))
    return rows


@dataclass(frozen=True)
class StageSchema:
    """Another stage's config (MNTP / MDM / CLM): its own argument classes, then ``TrainingArguments``,
    checked by the same rules as supervised training (unknown keys, types, choices, required fields,
    numeric ranges: the shared ``RANGES`` plus the stage's own, given as ``(low, high)`` with
    ``(bound, inclusive)`` or None)."""

    classes: tuple[type, ...]
    choices: dict[str, tuple] = field(default_factory=dict)
    ranges: dict[str, tuple] = field(default_factory=dict)

    def validate(self, values: dict[str, Any], source: str = "config") -> list[Any]:
        """The argument objects, one per class, or a ``ConfigError`` listing every problem."""
        table = _field_table(self.classes)
        errors = _value_errors(values, table, self.choices, self.classes[:-1])
        errors += [f"missing required field {n!r} (TrainingArguments)" for n in REQUIRED_TRAINING if not values.get(n)]
        errors += range_errors(values, {**RANGES, **self.ranges})
        if errors:
            raise ConfigError(f"Invalid {source}:\n  - " + "\n  - ".join(errors))
        groups: dict[type, dict[str, Any]] = {cls: {} for cls in self.classes}
        for key, value in {**TRAINING_DEFAULTS, **_runtime_defaults(), **values}.items():
            groups[table[key][0]][key] = value
        try:
            return [cls(**groups[cls]) for cls in self.classes]
        except (ValueError, TypeError) as err:
            raise ConfigError(f"Invalid {source}: {err}") from err
