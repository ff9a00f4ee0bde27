"""The one validator of every training stage's config (supervised, SimCSE, MNTP / MDM / CLM).

A stage's config is one flat JSON object: the fields of the stage's argument dataclasses, then
Hugging Face ``TrainingArguments``. ``StageSchema`` checks it before any model loads and reports
every problem at once, each naming the field: an unknown key (with the closest valid one), a value
of the wrong type (with the expected type), a value outside its choices, a missing required field,
a number outside its range. What it checks is read from the fields themselves: their types, their
defaults (no default: required), ``metadata["choices"]``, ``metadata["alias"]`` (an upstream name
also accepted) and ``metadata["setting"]`` (an ``EncoderConfig`` setting, checked by its rules).
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import os
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import import_module
from typing import Any, Literal

from diffusion_embedder.clihelp import fields_help
from diffusion_embedder.config import value_problem
from diffusion_embedder.files import folder_problem
from diffusion_embedder.training.stages import STAGES
from diffusion_embedder.values import problem, range_problem


class ConfigError(ValueError):
    """A training config that cannot run; the message lists every problem found."""


#: TrainingArguments fields transformers renamed, ``(new, old)``: 5.23 ``activation_*`` (keeping ``gradient_*`` as a
#: deprecated alias that the new field overrides), 5.17 on the GPU machines ``gradient_*`` only. A config may use
#: either spelling; it is read under the newest one the installed release has, so the two never both reach it.
TRANSFORMERS_RENAMES = (("activation_checkpointing", "gradient_checkpointing"),
                        ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs"))
#: Defaults that differ from TrainingArguments' (our datasets are not `datasets.Dataset`s).
TRAINING_DEFAULTS = {"remove_unused_columns": False}
#: TrainingArguments fields a stage cannot run without: missing when absent or null.
REQUIRED_TRAINING = ("output_dir",)
#: Numeric ranges checked with the rest of the config, before any model loads: ``(low, high)`` bounds,
#: each ``(value, inclusive)`` or None. A stage adds its own (``StageSchema.ranges``).
RANGES: dict[str, tuple[tuple[float, bool] | None, tuple[float, bool] | None]] = {
    "per_device_train_batch_size": ((1, True), None),
    "gradient_accumulation_steps": ((1, True), None),
    "lora_r": ((1, True), None),
    "lora_alpha": ((0, False), None),
    "lora_dropout": ((0, True), (1, False)),
    "learning_rate": ((0, False), None),
    "grad_cache_chunk_size": ((1, True), None),
    "simcse_dropout": ((0, True), (1, False)),  # the backbone's attention dropout probability
    "pack_length": ((1, True), None),
    "stop_after_n_steps": ((1, True), None),
    "activation_checkpointing": ((0, True), None),  # a number of decoder layers
    "gradient_checkpointing": ((0, True), None),
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
UNSUPPORTED = {
    "eval_strategy": ("no", _NO_EVAL),
    "do_eval": (False, _NO_EVAL),
    "label_smoothing_factor": (0.0, "transformers smooths its own cross-entropy; our losses are computed by us and "
                                    "never read it"),
    "neftune_noise_alpha": (None, "NEFTune's noise is hooked into a generative model's input embeddings, not into "
                                  "our encoder's"),
}

#: Values that need what a machine may lack: ``(field, value) -> (transformers.utils check, what it needs, the fix)``.
#: Such a value stops the run here, with the config; it never falls back to another kernel.
REQUIREMENTS = {
    ("attn_implementation", "flash_attention_2"): (
        "is_flash_attn_2_available",
        "the flash-attn package and a CUDA GPU",
        "pip install flash-attn --no-build-isolation",
    ),
    ("attn_implementation", "flash_attention_3"): (
        "is_flash_attn_3_available",
        "FlashAttention 3 (flash_attn_interface) and a CUDA GPU",
        "pip install flash-attn --no-build-isolation",
    ),
    ("use_liger_kernel", True): (
        "is_liger_kernel_available",
        "the liger-kernel package (Triton kernels: a CUDA GPU)",
        "pip install 'diffusion-embedder[liger]'",
    ),
}
#: What to set instead of a value ``REQUIREMENTS`` cannot honour.
INSTEAD = {"attn_implementation": ('"sdpa"', "sdpa"), "use_liger_kernel": ("false", "false")}

#: Fields whose accepted values are wider than their annotation: transformers documents ``fsdp: true`` but
#: annotates ``fsdp`` as a string.
#: ``activation_checkpointing`` (``gradient_checkpointing`` on 5.17) also takes a number of layers or "auto"
#: (``checkpointing.py``).
CHECKPOINTING_TYPE = bool | int | Literal["auto"] | None
TYPE_OVERRIDES: dict[str, Any] = {"fsdp": bool | str | None, "activation_checkpointing": CHECKPOINTING_TYPE,
                                  "gradient_checkpointing": CHECKPOINTING_TYPE}
#: What Hugging Face fields mean here where that differs from transformers' own help (the config reference shows
#: this instead; the values allowed come from the checks themselves: ``RANGES``, ``TYPE_OVERRIDES``, ``fsdp.py``,
#: ``liger.py``).
HELP = {
    "activation_checkpointing": "Recompute the activations of decoder layers in the backward instead of keeping them: "
    "true every layer, false none, a number N the first N layers, \"auto\" the fewest layers whose predicted peak "
    "memory fits the device (its choice logged; not with eager attention). Under fsdp, set "
    "fsdp_config.activation_checkpointing instead.",
    "fsdp": "Shard a full-weight LM-stage run (full_training: true) with FSDP2 over torchrun's processes (2 or more): "
    "true, or transformers' words.",
    "fsdp_config": "FSDP2's settings, read only with fsdp: a JSON object or the path of a JSON file (a leading fsdp_ "
    "of a key is dropped).",
    "use_liger_kernel": "Liger Kernel's Triton kernels (RMSNorm, rotary embeddings, SwiGLU) on the backbone, applied "
    "by us (liger.py) to the families it is wired for; needs the liger extra, so a CUDA machine.",
    "liger_kernel_config": "Which of Liger's kernels to apply (a JSON object of booleans), over our defaults.",
    "remove_unused_columns": "Our datasets are not datasets.Dataset objects: nothing to remove.",
}

#: A config key's owner: (argument class, dataclass field, resolved type).
FieldEntry = tuple[type, dataclasses.Field, Any]


def range_errors(values: dict[str, Any], ranges: dict[str, tuple] = RANGES) -> list[str]:
    """One message per numeric value outside its range, or unsupported setting, naming the field."""
    errors = [found for name, bounds in ranges.items() for found in [range_problem(name, values.get(name), bounds)]
              if found]
    max_steps = values.get("max_steps")
    if isinstance(max_steps, int) and not isinstance(max_steps, bool) and max_steps != -1 and max_steps < 1:
        errors.append(f"max_steps: must be >= 1 (or -1 to train num_train_epochs), got {max_steps}")
    for name, (allowed, why) in UNSUPPORTED.items():
        if name in values and values[name] != allowed:
            errors.append(f"{name}: {values[name]!r} is not supported ({why}); leave it at {allowed!r}")
    return errors


def requirement_errors(values: dict[str, Any]) -> list[str]:
    """One message per value this machine cannot honour (``REQUIREMENTS``), naming the field and the fix."""
    import transformers.utils

    errors = []
    for (name, value), (check, needs, install) in REQUIREMENTS.items():
        if values.get(name) == value and not getattr(transformers.utils, check)():
            errors.append(
                f"{name}: {value!r} needs {needs}, which this machine lacks (no other kernel is used instead). "
                f'Set "{name}": {INSTEAD[name][0]} in the config or pass --{name} {INSTEAD[name][1]}; or install '
                f"what it needs ({install})"
            )
    return errors


def _runtime_defaults() -> dict[str, Any]:
    """Under torchrun without CUDA, accelerate only forms the gloo process group with ``use_cpu``."""
    import torch

    if not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return {"use_cpu": True}
    return {}


def argument_fields(cls: type) -> dict[str, dataclasses.Field]:
    """The fields a config may set (TrainingArguments' private and non-init fields are not)."""
    return {f.name: f for f in dataclasses.fields(cls) if f.init and not f.name.startswith("_")}


def field_table(classes: tuple[type, ...]) -> dict[str, FieldEntry]:
    """Every config key of ``classes``; a key two classes share belongs to the first."""
    return dict(_field_table(tuple(classes)))


@functools.cache
def _field_table(classes: tuple[type, ...]) -> dict[str, FieldEntry]:
    """``field_table``, read once per set of classes (resolving TrainingArguments' type hints takes milliseconds,
    and a config is checked against them several times)."""
    table: dict[str, FieldEntry] = {}
    for cls in classes:
        hints = typing.get_type_hints(cls)
        for name, f in argument_fields(cls).items():
            table.setdefault(name, (cls, f, TYPE_OVERRIDES.get(name, hints[name])))
    return table


def field_aliases(classes: tuple[type, ...]) -> dict[str, str]:
    """``alias -> field``: the upstream names the fields of ``classes`` also accept, and the other transformers
    release's spelling of a renamed TrainingArguments field (so a config and a ``--key value`` override may use
    either, whichever release is installed)."""
    table = field_table(classes)
    aliases = {f.metadata["alias"]: name for name, (_, f, _) in table.items() if f.metadata.get("alias")}
    renames = {}
    for new, old in TRANSFORMERS_RENAMES:
        if new in table:
            renames[old] = new
        elif old in table:
            renames[new] = old
    return {**aliases, **renames}


def default_of(f: dataclasses.Field) -> Any:
    """A field's default (an enum as its value), or None for a required field."""
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return None
    return value.value if isinstance(value, enum.Enum) else value


def _value_errors(values: dict[str, Any], table: dict[str, FieldEntry], schema: StageSchema) -> list[str]:
    """Unknown keys (with the closest valid one), wrong types, values outside their choices, and the
    ``EncoderConfig`` rules of a setting without choices."""
    errors: list[str] = []
    for key, value in values.items():
        if key not in table:
            errors.append(unknown_key(key, table, schema))
            continue
        _, f, tp = table[key]
        found = problem(key, value, tp, f.metadata.get("choices"))
        if found is None and f.metadata.get("setting"):
            found = value_problem(key, value)
        if found:
            errors.append(found)
    return errors


def is_set(value: Any) -> bool:
    """Whether a config asks for a setting: true, a non-zero number, a non-blank string, a non-empty collection."""
    return bool(value.strip()) if isinstance(value, str) else bool(value)


def unknown_key(key: str, table: dict[str, FieldEntry], schema: StageSchema) -> str:
    """A key ``schema``'s stage does not have: the stages that do (``stages.py``), else the closest key it has."""
    schemas = stage_schemas()
    elsewhere = [name for name, other in schemas.items() if key in field_table(other.classes)]
    if elsewhere:
        here = [name for name, other in schemas.items() if other is schema] or ["this"]
        listed = " and ".join(f"{name} (diffusion-embedder {STAGES[name].command})" for name in elsewhere)
        return (f"unknown key {key!r}: a field of the {listed} stage{'s' * (len(elsewhere) > 1)} only, not of the "
                f"{' or '.join(here)} stage")
    close = difflib.get_close_matches(key, table, n=1, cutoff=0.6)
    return f"unknown key {key!r}" + (f"; did you mean {close[0]!r}?" if close else "")


def stage_schemas() -> dict[str, StageSchema]:
    """``stage name -> StageSchema``: the one schema object each stage's module (``stages.py``) validates with."""
    schemas = {}
    for name, stage in STAGES.items():
        found = {id(v): v for v in vars(import_module(stage.module)).values() if isinstance(v, StageSchema)}
        if len(found) != 1:
            raise RuntimeError(f"stage {name!r}: expected one StageSchema in {stage.module}, found {len(found)}")
        schemas[name] = next(iter(found.values()))
    return schemas


@dataclass(frozen=True)
class StageSchema:
    """A stage's config: its argument ``classes`` (``TrainingArguments`` last), its own numeric ``ranges`` (added
    to ``RANGES``), the fields it ``refused`` when set (``field -> why``; the config reference leaves this stage out
    of theirs) and its ``rules`` across fields (each returns one message per problem, naming the field)."""

    classes: tuple[type, ...]
    ranges: dict[str, tuple] = field(default_factory=dict)
    rules: tuple[Callable[[dict[str, Any]], list[str]], ...] = ()
    refused: dict[str, str] = field(default_factory=dict)

    def fields_help(self) -> str:
        """``--help``: one line per field of the stage's own classes (type, default, choices, help)."""
        return fields_help(self.classes[:-1])

    def canonical(self, values: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
        """Upstream names (``metadata["alias"]``) renamed to ours, and a TrainingArguments field renamed between
        transformers releases to the installed spelling; giving both names of one setting is an error."""
        values, errors = dict(values), []
        for alias, name in field_aliases(self.classes).items():
            if alias in values:
                if name in values:
                    errors.append(f"{alias} and {name} are the same setting; give one")
                values[name] = values.pop(alias)
        return values, errors

    def as_given(self, given: dict[str, Any], problems: list[str]) -> list[str]:
        """``problems`` (each starting with the canonical field's name) naming each field as ``given`` spells it."""
        spelled = {name: alias for alias, name in field_aliases(self.classes).items() if alias in given}
        out = []
        for message in problems:
            name = message.split(":", 1)[0]
            out.append(spelled[name] + message[len(name):] if name in spelled else message)
        return out

    def problems(self, values: dict[str, Any]) -> list[str]:
        """Every problem of canonical ``values``, each naming its field."""
        table = field_table(self.classes)
        errors = _value_errors(values, table, self)
        for cls in self.classes[:-1]:
            for name, f in argument_fields(cls).items():
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and name not in values:
                    errors.append(f"missing required field {name!r} ({cls.__name__})")
        for name in REQUIRED_TRAINING:
            if values.get(name) is None:
                errors.append(f"missing required field {name!r} (TrainingArguments)")
        errors += [f"{name}: {values[name]!r} is not supported by this stage ({why})"
                   for name, why in self.refused.items() if is_set(values.get(name))]
        if isinstance(values.get("output_dir"), str):  # a file there would stop the run as it claims the folder
            errors += [found for found in [folder_problem(values["output_dir"], "output_dir")] if found]
        errors += [problem for rule in self.rules for problem in rule(values)]
        return errors + range_errors(values, {**RANGES, **self.ranges}) + requirement_errors(values)

    def validate(self, values: dict[str, Any], source: str = "config") -> list[Any]:
        """The argument objects, one per class, or a ``ConfigError`` listing every problem."""
        return self.resolve(values, source)[1]

    def resolve(self, values: dict[str, Any], source: str = "config") -> tuple[dict[str, Any], list[Any]]:
        """``validate``, also returning the values under their canonical names (the run's config record)."""
        given = values
        values, errors = self.canonical(values)
        errors += self.as_given(given, self.problems(values))
        if errors:
            raise ConfigError(f"Invalid training {source}:\n  - " + "\n  - ".join(errors))
        table = field_table(self.classes)
        groups: dict[type, dict[str, Any]] = {cls: {} for cls in self.classes}
        for key, value in {**TRAINING_DEFAULTS, **_runtime_defaults(), **values}.items():
            groups[table[key][0]][key] = value
        try:
            return values, [cls(**groups[cls]) for cls in self.classes]
        except (ValueError, TypeError) as err:
            raise ConfigError(f"Invalid training {source}: {err}") from err
