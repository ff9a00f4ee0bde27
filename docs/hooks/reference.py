"""The site's generated reference pages, written from the live objects at build time (never by hand).

``config_reference()``: every field of every training stage (the ``StageSchema`` of each entry of
``training.stages.STAGES``), with its type, default, range or choices, the stages that read it and its other
spellings. ``cli_reference()``: every ``diffusion-embedder`` command (``cli.COMMANDS``) and every flag of its
argparse parser. A field, flag, stage or command added to the code appears here with no other edit;
``tests/test_docs.py`` calls these functions.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import re
import textwrap
import typing
from importlib import import_module
from typing import Any

#: Where the training stages' other spellings come from, for the "also accepted as" column.
ALIAS_NOTE = "upstream (LLM2Vec) name"
RENAME_NOTE = "transformers' other release's spelling"


def _cell(text: Any) -> str:
    """Text safe inside a markdown table cell (pipes escaped, one line)."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _code(value: Any) -> str:
    """A value as JSON in a code span (what a config file holds), e.g. ``null``, ``"mean"``, ``["q_proj"]``."""
    if isinstance(value, enum.Enum):
        value = value.value
    try:
        text = json.dumps(value)
    except TypeError:
        text = repr(value)
    return f"`{_cell(text)}`"


def stage_schemas() -> dict[str, Any]:
    """``stage name -> StageSchema``: the one schema object each stage's module validates its config with."""
    from diffusion_embedder.training.schema import stage_schemas

    return stage_schemas()


def _defining_class(cls: type, name: str) -> type:
    """The most basic class of ``cls``'s MRO that declares field ``name`` (where the field is defined once)."""
    owner = cls
    for base in cls.__mro__[1:]:
        if name in getattr(base, "__dataclass_fields__", {}):
            owner = base
    return owner


def _rule_text(name: str, tp: Any, f: dataclasses.Field, ranges: dict[str, tuple]) -> str:
    """The allowed values of a field: its choices, its numeric range, or the encoder setting's own rule."""
    from diffusion_embedder.config import value_problem
    from diffusion_embedder.values import enum_choices

    choices = f.metadata.get("choices") or enum_choices(tp)
    if choices:
        return "one of " + ", ".join(_code(c) for c in choices)
    parts = []
    if name in ranges:
        low, high = ranges[name]
        if low is not None:
            parts.append(f"{'>=' if low[1] else '>'} {low[0]}")
        if high is not None:
            parts.append(f"{'<=' if high[1] else '<'} {high[0]}")
    if name == "max_steps":
        parts.append(">= 1, or -1 (train num_train_epochs)")
    if f.metadata.get("setting"):  # EncoderConfig's rule, probed with a value it refuses
        probe = {int: 0, str: ""}.get(tp if isinstance(tp, type) else next(iter(typing.get_args(tp)), None))
        problem = value_problem(name, probe) if probe is not None else None
        if problem and "must" in problem:
            rule = problem.split("must", 1)[1].split(", got")[0].split(" (it holds")[0].strip()
            parts.append(rule.removeprefix("be ").strip())
    return _cell(", ".join(parts))


def config_rows() -> dict[type, list[dict[str, str]]]:
    """``defining class -> rows``: one row per config field of any stage, in declaration order."""
    from diffusion_embedder.training.schema import (
        RANGES,
        TRAINING_DEFAULTS,
        argument_fields,
        default_of,
        field_aliases,
        field_table,
    )
    from diffusion_embedder.values import type_text

    rows: dict[type, dict[str, dict[str, Any]]] = {}
    for stage, schema in stage_schemas().items():
        table = field_table(schema.classes)
        others: dict[str, list[str]] = {}
        renamed = {old: new for new, old in _renames()}
        for alias, name in field_aliases(schema.classes).items():
            note = RENAME_NOTE if alias in renamed or name in renamed else ALIAS_NOTE
            others.setdefault(name, []).append(f"`{alias}` ({note})")
        for name, (cls, f, tp) in table.items():
            if name not in argument_fields(cls):
                continue
            owner = _defining_class(cls, name)
            row = rows.setdefault(owner, {}).setdefault(name, {"stages": []})
            row["stages"].append(stage)
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            default = TRAINING_DEFAULTS.get(name, default_of(f))
            row.update(
                type=_cell(type_text(tp)),
                default="required" if required or name == "output_dir" else _code(default),
                allowed=_rule_text(name, tp, f, {**RANGES, **schema.ranges}),
                also=", ".join(others.get(name, [])),
                help=_cell(_first_sentences(f.metadata.get("help") or "")),
            )
    return {
        cls: [{"name": name, **row, "stages": ", ".join(row["stages"])} for name, row in fields.items()]
        for cls, fields in rows.items()
    }


def _renames() -> tuple[tuple[str, str], ...]:
    from diffusion_embedder.training.schema import TRANSFORMERS_RENAMES

    return TRANSFORMERS_RENAMES


def _first_sentences(text: str, limit: int = 300) -> str:
    """transformers' help runs to paragraphs: its first sentences, up to ``limit`` characters."""
    text = " ".join(text.split()).replace("%%", "%")  # argparse's escape, in transformers' help
    if len(text) <= limit:
        return text
    cut = text[:limit].rsplit(". ", 1)[0]
    return cut + ("." if not cut.endswith(".") else "") + " ..."


def config_reference() -> str:
    """The markdown of the config reference page."""
    from diffusion_embedder.training.stages import STAGES

    lines = [
        "# Training config reference",
        "",
        "Generated at build time from the argument dataclasses every stage validates its config with "
        "(`training/schema.py`, `training/arguments.py`, `config.py`'s `EncoderConfig`): a field added there "
        "appears here. A config is one flat JSON object; any field is also a `--field value` override after the "
        "config path (see [Training](../training.md)).",
        "",
        "Stages (the `stages` column): "
        + "; ".join(f"`{name}` (`diffusion-embedder {s.command}`: {s.help})" for name, s in STAGES.items())
        + ".",
        "",
    ]
    for cls, rows in config_rows().items():
        doc = " ".join((cls.__doc__ or "").split()) if cls.__module__ != "transformers.training_args" else (
            "Hugging Face's own training arguments, as the installed transformers defines them; "
            "the ranges are ours, checked before any model loads."
        )
        lines += [f"## {cls.__name__}", "", doc, "",
                  "| field | type | default | allowed | stages | also accepted as | meaning |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| `{r['name']}` | {r['type']} | {r['default']} | {r['allowed']} | {r['stages']} | {r['also']} "
                  f"| {r['help']} |" for r in rows]
        lines.append("")
    return "\n".join(lines)


def _flag_rows(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
            continue
        names = ", ".join(f"`{o}`" for o in action.option_strings) or f"`{action.dest}` (positional)"
        if action.nargs == 0:  # a switch: off until given
            value, default = "switch", "off"
        else:
            kind = getattr(action.type, "__name__", None) or action.metavar or "value"
            value = f"`{_cell(kind)}`" + (" ..." if action.nargs in ("+", "*", argparse.REMAINDER) else "")
            default = "" if action.default in (None, argparse.SUPPRESS) or not action.option_strings else _code(
                action.default)
        choices = ", ".join(_code(c) for c in action.choices) if action.choices else ""
        rows.append(f"| {names} | {value} | {default} | {choices} | {_cell(action.help or '')} |")
    return rows


def parser_markdown(parser: argparse.ArgumentParser, level: int = 3) -> list[str]:
    """One parser: its usage, description and a table of every flag; subcommands follow, one heading each."""
    lines = ["```", parser.format_usage().strip(), "```", ""]
    if parser.description:
        lines += [_cell(parser.description), ""]
    rows = _flag_rows(parser)
    if rows:
        lines += ["| flag | value | default | choices | meaning |", "|---|---|---|---|---|", *rows, ""]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                lines += [f"{'#' * level} `{sub.prog}`", "", _cell(helps.get(name) or ""), ""]
                lines += parser_markdown(sub, level + 1)
    return lines


def cli_reference() -> str:
    """The markdown of the CLI reference page: every command of ``diffusion-embedder`` and every flag."""
    from diffusion_embedder.cli import COMMANDS, usage
    from diffusion_embedder.training.stages import STAGES

    stage_of = {s.command: name for name, s in STAGES.items()}
    scripts = {"eval": "experiments/mteb_eval_custom.py", "encode": "experiments/encode_corpus.py",
               "report": "experiments/report.py"}
    lines = [
        "# Command-line reference",
        "",
        "Generated at build time from the argparse parsers (`diffusion_embedder/cli.py`'s `COMMANDS` and each "
        "command's `build_parser()`): a flag added there appears here.",
        "",
        "```",
        usage(),
        "```",
        "",
    ]
    for command, (module_name, help_) in COMMANDS.items():
        module = import_module(module_name)
        lines += [f"## `diffusion-embedder {command}`", "", _cell(help_) + ".", ""]
        if command in scripts:
            lines += [f"The same command line as `python {scripts[command]}`.", ""]
        if hasattr(module, "build_parser"):
            lines += parser_markdown(module.build_parser())
        elif command in stage_of:
            usage_text = "\n".join(textwrap.fill(ln, 110, subsequent_indent="    ") for ln in module.USAGE.splitlines())
            lines += ["```", usage_text, "```", "",
                      f"Every field of the [`{stage_of[command]}` stage's config](config.md) is also a "
                      "`--field value` override (`--flag` alone means true, `null` means None, lists as JSON).", ""]
        else:
            lines += [_cell((module.__doc__ or "").strip()), ""]
    return "\n".join(lines)


def api_identifiers(markdown: str) -> list[tuple[str, list[str] | None]]:
    """The objects a page documents with mkdocstrings (``::: dotted.path`` lines), each with the members its
    options list (``members: [a, b]``), or None for mkdocstrings' default (every public member)."""
    found: list[tuple[str, list[str] | None]] = []
    for line in markdown.splitlines():
        if line.startswith("::: "):
            found.append((line.split()[1], None))
        elif found and line.strip().startswith("members:"):
            listed = line.split(":", 1)[1].strip().strip("[]")
            found[-1] = (found[-1][0], [m.strip() for m in listed.split(",") if m.strip()])
    return found


def _public_callables(obj: Any) -> list[tuple[str, Any]]:
    """What mkdocstrings renders of ``obj``: itself if a function; a class's own public methods (and its
    constructor); a module's public functions and classes defined in it (each with their methods)."""
    import inspect

    if inspect.isroutine(obj):
        return [(obj.__qualname__, obj)]
    if inspect.isclass(obj):
        out = [(f"{obj.__qualname__}.__init__", obj.__init__)] if "__init__" in vars(obj) else []
        for name, member in vars(obj).items():
            member = member.__func__ if isinstance(member, classmethod | staticmethod) else member
            if not name.startswith("_") and inspect.isfunction(member):
                out.append((f"{obj.__qualname__}.{name}", member))
        return out
    out = []
    for name, member in vars(obj).items():
        if name.startswith("_") or getattr(member, "__module__", None) != obj.__name__:
            continue
        if inspect.isfunction(member) or inspect.isclass(member):
            out += _public_callables(member)
    return out


def undocumented_parameters(identifier: str, members: list[str] | None = None) -> list[str]:
    """``qualname: parameter`` for every parameter of a documented callable that its docstring never names (in a
    code span, as ``name`` or ``f(name, ...)``, or as ``:param name:``); a class's constructor may be documented in
    the class docstring."""
    import inspect

    module_name, _, attr = identifier.rpartition(".")
    try:
        obj = import_module(identifier)
    except ImportError:
        obj = getattr(import_module(module_name), attr)
    if not callable(obj) and not inspect.ismodule(obj):
        return []  # a registry or constant: nothing to call
    missing = []
    for qualname, fn in _public_callables(obj):
        if members is not None and qualname.rsplit(".", 1)[-1] not in (*members, "__init__"):
            continue
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            continue
        doc = inspect.getdoc(fn) or ""
        if qualname.endswith(".__init__"):
            owner = getattr(import_module(fn.__module__), qualname.split(".")[0], None)
            doc += "\n" + (inspect.getdoc(owner) or "")
        for name, p in params.items():
            if name in ("self", "cls") or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            if not re.search(rf"`[^`]*\b{re.escape(name)}\b[^`]*`|:param {re.escape(name)}:", doc):
                missing.append(f"{fn.__module__}.{qualname}: {name}")
    return missing


#: Where a page asks for the index of measured results (``results_index``), replaced at build time.
RESULTS_MARKER = "<!-- generated: results index -->"


def results_index(folder: Any, link_prefix: str = "results/") -> str:
    """A table of the measured results in ``folder`` (``bench/results/*.md``): each file's title, the setting it
    was measured in (its first ``Command (...)``, else its first sentence with a date) and every date it names."""
    from pathlib import Path

    lines = ["| results | measured on | dates |", "|---|---|---|"]
    for path in sorted(Path(folder).glob("*.md")):
        text = path.read_text(encoding="utf-8")
        title = next((ln[2:].strip() for ln in text.splitlines() if ln.startswith("# ")), path.stem)
        body = [ln for ln in text.splitlines() if not ln.startswith("#")]
        flat = " ".join(" ".join(body).replace("**", "").split())
        command = re.search(r"Command \(([^)]*)\)", flat)
        if command:
            where = command.group(1)
        else:
            dated = re.search(r"[^.]*\b20\d\d-\d\d-\d\d\b[^.]*\.", flat)
            where = dated.group(0).strip() if dated else ""
        dates = ", ".join(sorted(set(re.findall(r"\b20\d\d-\d\d-\d\d\b", text))))
        lines.append(f"| [{_cell(title)}]({link_prefix}{path.name}) | {_cell(where)} | {dates} |")
    return "\n".join(lines)
