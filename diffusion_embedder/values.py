"""Option values: one reading of a value for its field's declared type, whichever form it comes in.

A setting may be given as a JSON value (a config file), as text on a command line (``--key value``,
``--key=value``) or as a Python keyword. The JSON and Python values are taken as they are; the text is read as
the JSON value it spells where the field's declared union allows that value (``from_text``), so ``1`` is the
number 1 wherever a number is allowed and ``true``/``false`` are booleans only where a bool is. One check
(``problem``: the type, then the choices, then the range) then refuses what does not fit, with the same words in
every form, naming the field, the value and what it accepts. The public API's keywords are checked against their
annotations the same way (``checked``), before any work.
"""

from __future__ import annotations

import builtins
import difflib
import enum
import functools
import inspect
import json
import types
import typing
from collections.abc import Callable
from typing import Any

#: A numeric range: ``(low, high)`` bounds, each ``(value, inclusive)`` or None (unbounded).
Bounds = tuple[tuple[float, bool] | None, tuple[float, bool] | None]
AT_LEAST_ONE: Bounds = ((1, True), None)
AT_LEAST_ZERO: Bounds = ((0, True), None)


class OptionError(ValueError):
    """An option value that does not fit its field (wrong type, no choice, out of range); the message names it."""


def matches_type(value: Any, tp: Any) -> bool:
    """Whether a (JSON or Python) value fits a declared type: bool is not an int, an int is a float, a list fits a
    tuple; a type this cannot judge (a library's own object) is left to that library."""
    if tp is Any:
        return True
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(matches_type(value, a) for a in args)
    if origin is typing.Literal:
        return any(value == a and type(value) is type(a) for a in args)
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return isinstance(value, tp) or value in {m.value for m in tp}
    if origin in (tuple, list) or tp in (tuple, list):
        return isinstance(value, list | tuple) and (not args or all(matches_type(v, args[0]) for v in value))
    if origin is dict or tp is dict:
        return isinstance(value, dict) and (
            not args or all(matches_type(k, args[0]) and matches_type(v, args[1]) for k, v in value.items())
        )
    return True


def type_text(tp: Any) -> str:
    """A declared type as messages name it (``int or null``, ``bool or 'auto'``, ``one of [...]``)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(type_text(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is typing.Literal:
        return " or ".join(repr(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return f"one of {[m.value for m in tp]}"
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def enum_choices(tp: Any) -> list[str] | None:
    """The allowed strings of an ``Enum | str`` field (e.g. lr_scheduler_type), so a typo is caught early."""
    for arg in typing.get_args(tp):
        if isinstance(arg, type) and issubclass(arg, enum.Enum):
            return [m.value for m in arg]
    return None


def choice_problem(name: str, value: Any, choices) -> str | None:
    """Why ``value`` is none of ``choices`` (with the closest one); None when it is one."""
    if choices is None or value in choices:
        return None
    close = difflib.get_close_matches(str(value), [str(c) for c in choices if c is not None], n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{name}: {value!r} is not one of {list(choices)}{hint}"


def range_problem(name: str, value: Any, bounds: Bounds | None) -> str | None:
    """Why a number is outside ``bounds``; None when it is inside (or is no number: the type check says so)."""
    if bounds is None or not isinstance(value, int | float) or isinstance(value, bool):
        return None
    if value != value:  # NaN (JSON's NaN, or "nan"): every comparison below would pass it
        return f"{name}: must be a number, got {value}"
    low, high = bounds
    if low is not None and (value < low[0] or (value == low[0] and not low[1])):
        return f"{name}: must be {'>=' if low[1] else '>'} {low[0]}, got {value}"
    if high is not None and (value > high[0] or (value == high[0] and not high[1])):
        return f"{name}: must be {'<=' if high[1] else '<'} {high[0]}, got {value}"
    return None


def problem(name: str, value: Any, tp: Any, choices=None, bounds: Bounds | None = None) -> str | None:
    """Why ``value`` cannot be field ``name`` of type ``tp`` (its ``choices``, its ``bounds``); None when it can.
    A string of an ``Enum | str`` field must be one of the enum's values."""
    if not matches_type(value, tp):
        return f"{name}: {value!r} ({type(value).__name__}) is not of type {type_text(tp)}"
    if choices is None and isinstance(value, str):
        choices = enum_choices(tp)
    return choice_problem(name, value, choices) or range_problem(name, value, bounds)


def require(name: str, value: Any, tp: Any, choices=None, bounds: Bounds | None = None) -> Any:
    """``value``, or ``OptionError`` with ``problem``'s message where it cannot be field ``name``."""
    found = problem(name, value, tp, choices, bounds)
    if found:
        raise OptionError(found)
    return value


def from_text(raw: str, tp: Any) -> Any:
    """The value a command-line text spells for a field of type ``tp``: the JSON value it is (a number, a list, an
    object; ``true``/``false`` where a bool is allowed, ``null``/``None`` where None is) when the type allows that
    value, else the text itself when the type allows a string; otherwise the JSON value, which ``problem`` then
    refuses in the same words as the same value in a config file. A quoted text (``'"true"'``) is a string."""
    text = raw.strip()
    if text in ("true", "false", "True", "False") and matches_type(True, tp):
        return text.lower() == "true"
    if text in ("null", "None") and matches_type(None, tp):
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return raw
    if isinstance(value, str) or matches_type(value, tp):
        return value
    return raw if matches_type(raw, tp) else value


def parse_text(name: str, raw: str, tp: Any, choices=None, bounds: Bounds | None = None) -> Any:
    """``from_text``, checked by ``problem``: the value, or ``OptionError`` naming the field and the value."""
    return require(name, from_text(raw, tp), tp, choices, bounds)


def text_type(name: str, tp: Any, choices=None, bounds: Bounds | None = None,
              rule: Callable[[str, Any], str | None] | None = None) -> Callable[[str], Any]:
    """An argparse ``type=`` for a flag: its text read and checked as ``parse_text`` does, then by ``rule`` (a
    setting's own, e.g. ``config.value_problem``; not for None); argparse reports the message (exit status 2, no
    traceback)."""
    import argparse

    def parse(raw: str) -> Any:
        try:
            value = parse_text(name, raw, tp, choices, bounds)
        except OptionError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        found = rule(name, value) if rule is not None and value is not None else None
        if found:
            raise argparse.ArgumentTypeError(found)
        return value

    parse.__name__ = type_text(tp)
    return parse


class _Names(dict):
    """The names an annotation may use: the function's module's and the builtins; a name imported for type checking
    only reads as Any (such an object is left to the function)."""

    def __missing__(self, key: str) -> Any:
        return Any


def _annotations(func: Callable) -> dict[str, Any]:
    """A function's parameter types, resolved by ``typing.get_type_hints``."""
    return typing.get_type_hints(func, localns=_Names({**vars(builtins), **func.__globals__}))


def keyword_problems(hints: dict[str, Any], arguments: dict[str, Any]) -> list[str]:
    """One message per argument that does not fit its annotation in ``hints`` (``problem``), naming it."""
    return [p for name, value in arguments.items() if name in hints
            for p in [problem(name, value, hints[name])] if p]


def checked(func: Callable | None = None, *, leave: typing.Iterable[str] = ()) -> Callable:
    """A public function or method whose arguments are checked against its annotations before it runs: a value of
    another type (``compile="false"`` for a bool) is an ``OptionError`` naming the keyword, not a truthy value.
    ``leave`` names arguments checked where they are read, by their own definition (``EncoderConfig``'s settings,
    whose None means "not given"): ``@checked(leave=SETTING_NAMES)``."""
    if func is None:
        return functools.partial(checked, leave=leave)
    signature = inspect.signature(func)
    left = {n for n, p in signature.parameters.items() if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)} | set(leave)
    hints: dict[str, Any] = {}

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        if not hints:  # resolved at the first call, when every module the annotations name is loaded
            hints.update({k: v for k, v in _annotations(func).items() if k not in left and k != "return"})
        arguments = signature.bind_partial(*args, **kwargs).arguments
        problems = keyword_problems(hints, arguments)
        if problems:
            raise OptionError(f"{func.__qualname__}: " + "; ".join(problems))
        return func(*args, **kwargs)

    return wrapper
