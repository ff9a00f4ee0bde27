"""The training config reference, written from the validator's own definitions at build time (never by hand).

Every field of every training stage (the ``StageSchema`` of each entry of ``training.stages.STAGES``) gets one block
with a stable anchor (``#field-<name>``): its meaning, type, default, allowed values, the stages that take it and its
other spellings. Our own fields come first, then the Hugging Face ``TrainingArguments`` fields we restrict (their
rule is ours: ``schema.RANGES``, ``UNSUPPORTED``, ``TYPE_OVERRIDES``, ``HELP``, ``REQUIREMENTS``, each
stage's ``refused``, ``fsdp.py``'s and ``liger.py``'s tables), then the ones passed through as transformers defines
them. A field added to the code appears here with no other edit; ``tests/test_docs.py`` checks that what a block
says is what the validator does.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: Where the training stages' other spellings come from, for "also accepted as".
ALIAS_NOTE = "upstream (LLM2Vec) name"
RENAME_NOTE = "transformers' other release's spelling"
#: The sections of the page, in order.
OURS, RESTRICTED, PASSED = "ours", "restricted", "passed"
REQUIRED = object()  # the default of a field a config must give


def code(value: Any) -> str:
    """A value as JSON in a code span (what a config file holds), e.g. ``null``, ``"mean"``, ``["q_proj"]``."""
    if isinstance(value, enum.Enum):
        value = value.value
    try:
        text = json.dumps(value)
    except TypeError:
        text = repr(value)
    return f"`{text}`"


@dataclass
class FieldDoc:
    """One block of the page: a config field as the validator sees it."""

    name: str
    owner: type  # the most basic class that declares it
    section: str
    type: str
    default: Any  # the value a run sees when the config leaves it out (REQUIRED: none)
    allowed: str = ""
    choices: tuple | None = None  # the allowed values, where they are a list
    words: tuple = ()  # the words a field also takes beside numbers or booleans (its type's Literal)
    stages: list[str] = field(default_factory=list)
    refused_by: dict[str, str] = field(default_factory=dict)  # stage -> why it refuses the field when set
    also: list[str] = field(default_factory=list)
    help: str = ""
    same_as: str | None = None  # a renamed field's other name: the block points there
    anchor: str = ""


def stage_schemas() -> dict[str, Any]:
    """``stage name -> StageSchema``: the one schema object each stage's module validates its config with."""
    from diffusion_embedder.training.schema import stage_schemas

    return stage_schemas()


def literal_words(tp: Any) -> tuple:
    """The words a type takes beside its other kinds: the strings of its ``Literal`` (``int | Literal["auto"]``)."""
    return tuple(word for arg in typing.get_args(tp) if typing.get_origin(arg) is typing.Literal
                 for word in typing.get_args(arg) if isinstance(word, str))


def _defining_class(cls: type, name: str) -> type:
    """The most basic class of ``cls``'s MRO that declares field ``name`` (where the field is defined once)."""
    owner = cls
    for base in cls.__mro__[1:]:
        if name in getattr(base, "__dataclass_fields__", {}):
            owner = base
    return owner


def _is_transformers(cls: type) -> bool:
    return cls.__module__.startswith("transformers.")


def _range_text(bounds: tuple) -> str:
    low, high = bounds
    parts = []
    if low is not None:
        parts.append(f"{'>=' if low[1] else '>'} {low[0]}")
    if high is not None:
        parts.append(f"{'<=' if high[1] else '<'} {high[0]}")
    return ", ".join(parts)


def _setting_rule(name: str, tp: Any) -> str:
    """An ``EncoderConfig`` setting's rule, read from the message ``config.value_problem`` gives a refused value."""
    from diffusion_embedder.config import value_problem

    probe = {int: 0, str: ""}.get(tp if isinstance(tp, type) else next(iter(typing.get_args(tp)), None))
    problem = value_problem(name, probe) if probe is not None else None
    if not problem or "must" not in problem:
        return ""
    rule = problem.split("must", 1)[1].split(", got")[0].split(" (it holds")[0].strip()
    return rule.removeprefix("be ").strip() if rule.startswith("be ") else f"must {rule}"


# ------------------------------------------------------------------ the rules of single fields, read from their checks
def _fsdp_rule() -> str:
    from diffusion_embedder.training.fsdp import FSDP_WORDS

    return "`true`, or transformers' words, space-separated: " + ", ".join(f"`{w}`" for w in FSDP_WORDS) + (
        " (any other word is refused)")


def _fsdp_config_rule() -> str:
    from diffusion_embedder.training.fsdp import FSDP_CONFIG_KEYS

    keys = []
    for key, allowed in FSDP_CONFIG_KEYS.items():
        if isinstance(allowed, type):
            keys.append(f"`{key}` ({'`true` or `false`' if allowed is bool else allowed.__name__})")
        elif all(isinstance(a, type) for a in allowed):
            keys.append(f"`{key}` (a layer class name or a list)")
        else:
            keys.append(f"`{key}` (one of {', '.join(code(a) for a in allowed)})")
    return "keys " + "; ".join(keys) + "; any other key is refused"


def _liger_config_rule() -> str:
    from diffusion_embedder.training.liger import KERNELS, NOT_WIRED

    wired = ", ".join(f"`{k}` (default {code(v)})" for k, v in KERNELS.items() if k not in NOT_WIRED)
    return f"keys {wired}; " + ", ".join(f"`{k}`" for k in NOT_WIRED) + " must stay `false` (not wired to our losses)"


def _liger_rule() -> str:
    from diffusion_embedder.training.liger import LIGER_FAMILIES

    return "`true` on the families " + ", ".join(f"`{f}`" for f in LIGER_FAMILIES)


#: Fields whose allowed values a table of their own module defines (a registry: one function per field).
FIELD_RULES: dict[str, Callable[[], str]] = {
    "fsdp": _fsdp_rule,
    "fsdp_config": _fsdp_config_rule,
    "liger_kernel_config": _liger_config_rule,
    "use_liger_kernel": _liger_rule,
}


def _allowed(name: str, tp: Any, f: dataclasses.Field, ranges: dict[str, tuple]) -> tuple[str, tuple | None]:
    """The allowed values of a field as text, and as a list where they are one."""
    from diffusion_embedder.training.schema import REQUIREMENTS, UNSUPPORTED
    from diffusion_embedder.values import enum_choices

    if name in UNSUPPORTED:
        allowed, _ = UNSUPPORTED[name]
        return f"only {code(allowed)}", (allowed,)
    choices = f.metadata.get("choices") or enum_choices(tp)
    words = literal_words(tp)
    parts = []
    if choices:
        parts.append("one of " + ", ".join(code(c) for c in choices))
    if words:
        args = typing.get_args(tp)
        kinds = (["`true`", "`false`"] if bool in args else []) + ([f"a number {_range_text(ranges[name])}"]
                                                                  if int in args and name in ranges else [])
        parts.append(", ".join(kinds) + " or " + " or ".join(code(w) for w in words))
    elif name in ranges:
        parts.append(_range_text(ranges[name]))
    if name == "max_steps":  # range_errors' own rule: -1 means "train num_train_epochs"
        parts.append(">= 1, or -1 (train num_train_epochs)")
    if name in FIELD_RULES:
        parts.append(FIELD_RULES[name]())
    if f.metadata.get("setting"):
        parts.append(_setting_rule(name, tp))
    for (field_name, value), (_, needs, _) in REQUIREMENTS.items():
        if field_name == name:
            parts.append(f"{code(value)} needs {needs}")
    return "; ".join(p for p in parts if p), tuple(choices) if choices else None


def _first_sentences(text: str, limit: int = 300) -> str:
    """transformers' help runs to paragraphs: its first sentences, up to ``limit`` characters."""
    text = " ".join(text.split()).replace("%%", "%")  # argparse's escape, in transformers' help
    if len(text) <= limit:
        return text
    cut = text[:limit].rsplit(". ", 1)[0]
    return cut + ("." if not cut.endswith(".") else "") + " ..."


def _restricted_names(schemas: dict[str, Any]) -> set[str]:
    """The Hugging Face fields with a rule of ours (a range, a refusal, our meaning or our default)."""
    from diffusion_embedder.training import schema as s

    names = set(s.RANGES) | set(s.UNSUPPORTED) | set(s.TYPE_OVERRIDES) | set(s.HELP)
    names |= set(s.TRAINING_DEFAULTS) | set(s.REQUIRED_TRAINING) | {n for n, _ in s.REQUIREMENTS} | set(FIELD_RULES)
    names |= {n for pair in s.TRANSFORMERS_RENAMES for n in pair} | {"max_steps"}
    for stage in schemas.values():
        names |= set(stage.ranges) | set(stage.refused)
    return names


def _resolved_defaults(cls: type) -> Any:
    """``TrainingArguments`` as built from no config (what a run sees: transformers turns some None defaults into a
    value, e.g. ``activation_checkpointing`` into false)."""
    return cls(output_dir="unused")  # only read; nothing is written


def config_fields() -> list[FieldDoc]:
    """Every config field of any stage, ours first (by class, in declaration order), then Hugging Face's."""
    from diffusion_embedder.training.schema import (
        HELP,
        RANGES,
        REQUIRED_TRAINING,
        TRAINING_DEFAULTS,
        UNSUPPORTED,
        argument_fields,
        default_of,
        field_aliases,
        field_table,
    )
    from diffusion_embedder.values import type_text

    schemas = stage_schemas()
    restricted = _restricted_names(schemas)
    renames = {n for pair in _renames() for n in pair}
    docs: dict[tuple[type, str], FieldDoc] = {}
    resolved: dict[type, Any] = {}
    for stage, schema in schemas.items():
        table = field_table(schema.classes)
        aliases = field_aliases(schema.classes)
        for name, (cls, f, tp) in table.items():
            if name not in argument_fields(cls):
                continue
            owner = _defining_class(cls, name)
            doc = docs.get((owner, name))
            if doc is None:
                hf = _is_transformers(owner)
                section = (RESTRICTED if name in restricted else PASSED) if hf else OURS
                default = default_of(f)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    default = REQUIRED
                if section == RESTRICTED:
                    built = resolved.setdefault(owner, _resolved_defaults(owner))
                    value = getattr(built, name)
                    default = value.value if isinstance(value, enum.Enum) else value
                default = REQUIRED if name in REQUIRED_TRAINING else TRAINING_DEFAULTS.get(name, default)
                allowed, choices = _allowed(name, tp, f, {**RANGES, **schema.ranges})
                help_ = HELP.get(name) or f.metadata.get("help") or ""
                if name in UNSUPPORTED:
                    help_ = f"Only {code(UNSUPPORTED[name][0])}: {UNSUPPORTED[name][1]}."
                shown = type(UNSUPPORTED[name][0]) if name in UNSUPPORTED else tp  # the one value's type
                doc = docs[(owner, name)] = FieldDoc(
                    name, owner, section, type_text(shown), default, allowed, choices,
                    words=literal_words(tp),
                    help=_first_sentences(help_) if hf and name not in HELP else " ".join(help_.split()),
                )
                if name in aliases and aliases[name] in table:
                    doc.same_as = aliases[name]  # both spellings are fields of this transformers: one setting
            if name in schema.refused:
                doc.refused_by[stage] = schema.refused[name]
            else:
                doc.stages.append(stage)
            for alias, canonical in aliases.items():
                note = f"`{alias}` ({RENAME_NOTE if alias in renames else ALIAS_NOTE})"
                if canonical == name and note not in doc.also:
                    doc.also.append(note)
    ordered = sorted(docs.values(), key=lambda d: [OURS, RESTRICTED, PASSED].index(d.section))
    seen: dict[str, int] = {}
    for doc in ordered:  # a name two classes define (dataset_name) gets the later block's stages in its anchor
        seen[doc.name] = seen.get(doc.name, 0) + 1
        doc.anchor = f"field-{doc.name}" if seen[doc.name] == 1 else f"field-{doc.name}-{'-'.join(doc.stages)}"
    return ordered


def _renames() -> tuple[tuple[str, str], ...]:
    from diffusion_embedder.training.schema import TRANSFORMERS_RENAMES

    return TRANSFORMERS_RENAMES


def field_block(doc: FieldDoc, all_stages: list[str]) -> list[str]:
    """One field: a heading with its anchor, its meaning, then one line per fact."""
    lines = [f"### `{doc.name}` {{ #{doc.anchor} }}", ""]
    if doc.same_as:
        return lines + [f"The same setting as [`{doc.same_as}`](#field-{doc.same_as}) ({RENAME_NOTE}); a config "
                        "gives one of the two.", ""]
    if doc.help:
        lines += [doc.help, ""]
    facts = [f"**Type**: {doc.type}",
             f"**Default**: {'required' if doc.default is REQUIRED else code(doc.default)}"]
    if doc.allowed:
        facts.append(f"**Allowed**: {doc.allowed}")
    if doc.stages != all_stages or doc.section != PASSED:
        facts.append(f"**Stages**: {', '.join(doc.stages) or 'none'}")
    for why in dict.fromkeys(doc.refused_by.values()):
        facts.append(f"**Refused by** {', '.join(s for s, w in doc.refused_by.items() if w == why)}: {why}")
    if doc.also:
        facts.append(f"**Also accepted as**: {', '.join(doc.also)}")
    return lines + [f"- {fact}" for fact in facts] + [""]


def config_reference() -> str:
    """The markdown of the config reference page."""
    from diffusion_embedder.training.stages import STAGES

    all_stages = list(STAGES)
    lines = [
        "# Training config reference",
        "",
        "Generated when the site is built, from the definitions the config validator checks with "
        "(`training/schema.py`, `training/arguments.py`, `training/lm.py`, `config.py`'s `EncoderConfig`): a field "
        "added there appears here. A config is one flat JSON object; any field is also a `--field value` override "
        "after the config path (see [Training](../training.md)). Every value below is checked before any model "
        "loads, and a config breaking a rule stops with the field named.",
        "",
        "| stage | command | what it trains |",
        "|---|---|---|",
        *[f"| `{name}` | `diffusion-embedder {s.command}` | {s.help} |" for name, s in STAGES.items()],
        "",
    ]
    fields = config_fields()
    owner = None
    for doc in fields:
        if doc.section == OURS and doc.owner is not owner:
            owner = doc.owner
            lines += [f"## {owner.__name__}", "", " ".join((owner.__doc__ or "").split()), ""]
        elif doc.section != OURS and owner != doc.section:
            owner = doc.section
            lines += {
                RESTRICTED: ["## Hugging Face fields with our rules", "",
                             "Fields of transformers' `TrainingArguments` that we check, restrict or read our own way: "
                             "the rule shown is ours.", ""],
                PASSED: ["## Hugging Face fields passed through", "",
                         "The other fields of `TrainingArguments`, as the installed transformers defines them; every "
                         "stage reads them.", ""],
            }[doc.section]
        lines += field_block(doc, all_stages)
    return "\n".join(lines)
