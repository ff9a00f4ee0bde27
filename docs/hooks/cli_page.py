"""The command-line reference, written from the argparse parsers at build time (never by hand).

Every ``diffusion-embedder`` command (``cli.COMMANDS``) with its usage as the installed command shows it, and every
flag of its parser: what it takes, its default and choices, and its help. A flag or command added to the code
appears here with no other edit; ``tests/test_docs.py`` checks it, and that no flag lacks help.
"""

from __future__ import annotations

import argparse
import enum
import json
import textwrap
from importlib import import_module
from pathlib import PurePath
from typing import Any

#: Wider usage lines are wrapped (the page's code blocks hold about 100 characters at 1400 pixels, without scrolling).
USAGE_WIDTH = 96


def cell(text: Any) -> str:
    """Text safe inside a markdown table cell (pipes escaped, one line)."""
    return " ".join(str(text).split()).replace("|", "\\|")


def value_text(value: Any) -> str:
    """A default as the command line takes it, in a code span: a path as a path, a list as its items."""
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, PurePath):
        return f"`{value}`"
    if isinstance(value, list | tuple):
        return " ".join(value_text(v) for v in value) or "none"
    if isinstance(value, bool) or value is None:
        return f"`{json.dumps(value)}`"
    return f"`{value}`"


def kind_text(action: argparse.Action) -> str:
    """What a flag takes: a switch, or its value's type (argparse reads a flag without a type as a string)."""
    if action.nargs == 0:
        return "switch"
    kind = {"Path": "path"}.get(getattr(action.type, "__name__", ""), getattr(action.type, "__name__", "str"))
    return kind + (" ..." if action.nargs in ("+", "*", argparse.REMAINDER) else "")


def flag_rows(parser: argparse.ArgumentParser) -> list[str]:
    """One table row per flag or positional argument: its names and kind, then its help, default and choices."""
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
            continue
        names = ", ".join(f"`{o}`" for o in action.option_strings) or f"`{action.dest}`"
        facts = [cell(action.help or "").rstrip(".") + "." if action.help else ""]
        if action.choices:
            facts.append("One of " + ", ".join(value_text(c) for c in action.choices) + ".")
        if action.required or not action.option_strings:
            facts.append("Required.")
        elif action.nargs != 0 and action.default not in (None, argparse.SUPPRESS) and "default:" not in (
                action.help or ""):
            facts.append(f"Default {value_text(action.default)}.")
        rows.append(f"| {names} <br>{kind_text(action)} | {' '.join(f for f in facts if f)} |")
    return rows


def wrap_usage(text: str) -> str:
    """Usage lines wrapped at ``USAGE_WIDTH``, continuations indented."""
    return "\n".join(textwrap.fill(ln, USAGE_WIDTH, subsequent_indent="    ") if len(ln) > USAGE_WIDTH else ln
                     for ln in text.splitlines())


def parser_markdown(parser: argparse.ArgumentParser, level: int = 3) -> list[str]:
    """One parser: its usage, description and a table of every flag; subcommands follow, one heading each."""
    formatter = parser.formatter_class(prog=parser.prog, width=USAGE_WIDTH)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    lines = ["```", formatter.format_help().strip(), "```", ""]
    if parser.description:
        lines += [cell(parser.description), ""]
    rows = flag_rows(parser)
    if rows:
        lines += ["| flag | meaning |", "|---|---|", *rows, ""]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                lines += [f"{'#' * level} `{sub.prog}`", "", cell(helps.get(name) or ""), ""]
                lines += parser_markdown(sub, level + 1)
    return lines


def cli_reference() -> str:
    """The markdown of the CLI reference page: every command of ``diffusion-embedder`` and every flag."""
    from diffusion_embedder.cli import COMMANDS, usage
    from diffusion_embedder.training.stages import STAGES

    stage_of = {s.command: name for name, s in STAGES.items()}
    lines = [
        "# Command-line reference",
        "",
        "Generated when the site is built, from the parsers (`diffusion_embedder/cli.py`'s `COMMANDS` and each "
        "command's `build_parser()`): a flag added there appears here. Each command is also the module's "
        "`main(argv)` (`python -m diffusion_embedder.cli COMMAND ...`). Under torchrun, run the installed command "
        "with `torchrun --nproc_per_node=N --no-python diffusion-embedder COMMAND ...`.",
        "",
        "```",
        usage(),
        "```",
        "",
    ]
    for command, (module_name, help_) in COMMANDS.items():
        module = import_module(module_name)
        lines += [f"## `diffusion-embedder {command}`", "", cell(help_)[:1].upper() + cell(help_)[1:] + ".", ""]
        if hasattr(module, "build_parser"):
            lines += parser_markdown(module.build_parser())
        elif command in stage_of:
            lines += ["```", wrap_usage(module.USAGE), "```", "",
                      f"Every field of the [`{stage_of[command]}` stage's config](config.md) is also a "
                      "`--field value` override (`--flag` alone means true, `null` means None, lists as JSON).", ""]
        else:
            lines += [cell((module.__doc__ or "").strip()), ""]
    return "\n".join(lines)
