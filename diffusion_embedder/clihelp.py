"""Help output shared by the ``diffusion-embedder`` subcommands: their names in usage lines, every default shown."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
import typing
from collections.abc import Callable, Mapping

PROG = "diffusion-embedder"


class UsageError(ValueError):
    """A command line that cannot run as given (a missing or conflicting flag, a value out of range, a folder that is
    a file, a device this machine lacks), found before any model loads or any file is written."""


def prog(command: str) -> str:
    """The usage-line name of a subcommand, e.g. ``diffusion-embedder eval``."""
    return f"{PROG} {command}"


def config_usage(command: str) -> str:
    """A training command's usage: one process, or torchrun's processes each running the installed command."""
    args = "CONFIG.json [--key value ...]"
    return f"usage: {prog(command)} {args}\n   or: torchrun --nproc_per_node=N --no-python {prog(command)} {args}"


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every option's help ends with its default (and its choices, when they are not in the metavar)."""

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and action.option_strings and action.default is not argparse.SUPPRESS:
            action = copy.copy(action)
            action.help = "(default: %(default)s)"  # argparse prints nothing for an option without help
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        help_ = (action.help or "").strip()
        if action.choices and action.metavar is not None and "one of" not in help_:
            help_ += f" (one of {', '.join(map(str, action.choices))})"
        if "%(default)" not in help_ and "default:" not in help_ and action.default is not argparse.SUPPRESS:
            if action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
                help_ += " (default: %(default)s)"
        return help_


def default_text(f: dataclasses.Field) -> str:
    """A field's default as help shows it: its repr, or "required"."""
    if f.default is not dataclasses.MISSING:
        return repr(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return repr(f.default_factory())
    return "required"


def fields_help(classes: typing.Iterable[type]) -> str:
    """One line per dataclass field: ``--name TYPE (default: ...; one of ...) help``."""
    lines = []
    for cls in classes:
        lines.append(f"\n{cls.__name__}:")
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = default_text(f)
            allowed = f.metadata.get("choices")
            listed = f"; one of {', '.join(map(str, allowed))}" if allowed else ""
            type_name = str(hints[f.name]).replace("typing.", "").replace("<class '", "").replace("'>", "")
            lines.append(f"  --{f.name} {type_name} (default: {default}{listed})  {f.metadata.get('help', '')}")
    return "\n".join(lines)


def exit_status(error: BaseException, statuses: Mapping[type[BaseException], int]) -> int | None:
    """The exit status of an error in our words: that of the first kind in ``statuses`` it is one of. The commands
    report such an error as its message alone; None means a bug, which keeps its traceback."""
    return next((status for kind, status in statuses.items() if isinstance(error, kind)), None)


def run_command(run: Callable[[], int], statuses: Mapping[type[BaseException], int]) -> int:
    """A command's exit status: ``run()``'s, or for an error in our words (a kind in ``statuses``) its status, the
    message alone printed as ``error: ...`` on stderr. Anything else is a bug and keeps its traceback."""
    try:
        return run()
    except tuple(statuses) as error:
        print(f"error: {error}", file=sys.stderr)
        return exit_status(error, statuses)
