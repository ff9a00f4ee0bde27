"""One meaning for every option value, whichever form it is given in.

A value reaches a setting as a JSON value in a config file, as text after ``--key`` or ``--key=`` on a command line,
or as a Python keyword. Each test here walks every field or keyword there is (so a new one is covered without an
edit), gives it representative values built from its declared type (the values it accepts, and values it must
refuse: a word that is no choice, ``1`` where only a bool fits, a number out of its range), and asserts that every
form resolves each value to the same thing, or refuses it in the same words.

Before, ``--activation_checkpointing 1`` became ``true`` (every layer checkpointed) where ``1`` in the JSON config
checkpointed one layer, and ``"0"``/``"yes"`` turned into booleans for any field that also took a number or a string.
"""

from __future__ import annotations

import builtins
import contextlib
import enum
import inspect
import io
import json
import os
import re
import types
import typing
from pathlib import Path

import pytest
from conftest import LLAMA_FIXTURE

from diffusion_embedder import Encoder, inference, loading
from diffusion_embedder.config import SETTING_NAMES, field_types, setting_fields
from diffusion_embedder.evaluation import encode_corpus
from diffusion_embedder.evaluation import run as eval_run
from diffusion_embedder.training.arguments import read_config_values
from diffusion_embedder.training.schema import RANGES, field_aliases, field_table, stage_schemas

ROOT = Path(__file__).resolve().parents[1]
#: A config each stage accepts, to which one field at a time is added (a new stage needs one here).
BASES = {
    "supervised": {"model_name_or_path": "m", "dataset_name": "Custom", "output_dir": "out", "report_to": "none"},
    "simcse": {"model_name_or_path": "m", "dataset_name": "Custom", "output_dir": "out", "report_to": "none"},
    "mntp": {"model_name_or_path": "m", "train_file": ["t.txt"], "output_dir": "out", "report_to": "none"},
}
WORD = "no-such-word"  # a string that is no choice of any field


# ------------------------------------------------------------------ representative values, from the declared type
def _members(tp) -> tuple:
    return typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)


def _scalars(tp) -> set[type]:
    """The scalar types a declared type admits (a Literal's by its values; an Enum's values are strings)."""
    found: set[type] = set()
    for member in _members(tp):
        if typing.get_origin(member) is typing.Literal:
            found |= {type(a) for a in typing.get_args(member)}
        elif isinstance(member, type) and issubclass(member, enum.Enum):
            found.add(str)
        elif member in (bool, int, float, str, type(None)):
            found.add(member)
    return found


def _in_bounds(value, bounds) -> bool:
    low, high = bounds or (None, None)
    ok_low = low is None or value > low[0] or (value == low[0] and low[1])
    return ok_low and (high is None or value < high[0] or (value == high[0] and high[1]))


def accepted_values(tp, choices=None, bounds=None) -> list:
    """Values of the declared type (its choices for a string, inside its range for a number)."""
    values: list = []
    for member in _members(tp):
        origin, args = typing.get_origin(member), typing.get_args(member)
        if origin is typing.Literal:
            values += list(args)
        elif member is type(None):
            values.append(None)
        elif member is bool:
            values += [True, False]
        elif member is int:
            values += [v for v in (1, 2, 3) if _in_bounds(v, bounds)] or [bounds[0][0] + 1]
        elif member is float:
            values += [v for v in (0.5, 1) if _in_bounds(v, bounds)]  # 1: an int where a float is allowed stays 1
        elif member is str:
            values += [c for c in (choices or [WORD.replace("no-such", "any")]) if isinstance(c, str)][:3]
        elif isinstance(member, type) and issubclass(member, enum.Enum):
            values.append(next(iter(member)).value)
        elif origin in (list, tuple) and args and args[0] is str:
            values.append(["a", "b"])
        elif origin is dict or member is dict:
            values.append({"k": True} if args and args[1] is bool else {"k": "v"})
    unique = []
    for value in values:
        if not any(value == u and type(value) is type(u) for u in unique):
            unique.append(value)
    return unique


def refused_values(tp, bounds=None) -> list:
    """Values the declared type refuses: a word that is no choice, ``1`` where a bool fits and a number does not,
    a fraction where only whole numbers fit, ``true`` where only numbers fit, a number outside its range."""
    kinds = _scalars(tp)
    values: list = [WORD]
    if bool in kinds and not kinds & {int, float}:
        values.append(1)
    if int in kinds and float not in kinds:
        values.append(0.5)
    if kinds & {int, float} and bool not in kinds:
        values.append(True)
    low, high = bounds or (None, None)
    if low is not None:
        values.append(low[0] - 1 if low[1] else low[0])
    if high is not None:
        values.append(high[0] + 1 if high[1] else high[0])
    return values


def as_text(value) -> str:
    """How a user writes ``value`` after ``--key``: a string as it is, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value)


def writable_as_text(value, tp) -> bool:
    """A number or bool where the type admits a string but not that value's type reads as that string on a command
    line (``--experiment_id 7`` is the name "7"): such a value has no text form of its own."""
    kinds = _scalars(tp)
    return isinstance(value, str | list | dict) or value is None or type(value) in kinds or str not in kinds


def problem_line(name: str, message: str) -> str:
    """The line of ``message`` that names ``name`` (``name: ...``, not ``--name: ...``)."""
    found = re.search(rf"(?<![\w-]){re.escape(name)}: .*", message)
    return found.group(0) if found else message


@pytest.fixture
def environment_kept():
    """TrainingArguments may set environment variables for some values: every test here leaves none behind."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


# ------------------------------------------------------------------ every field of every stage's schema
def _stage_fields() -> list[tuple[str, str]]:
    """``(stage, field)`` for every field of every stage; a field two stages define alike (same type, choices and
    range: the same reading) is walked once, in the first stage that has it."""
    seen, out = set(), []
    for stage, schema in stage_schemas().items():
        ranges = {**RANGES, **schema.ranges}
        for name, (_, f, tp) in field_table(schema.classes).items():
            key = (name, repr(tp), repr(f.metadata.get("choices")), repr(ranges.get(name)))
            if key not in seen:
                seen.add(key)
                out.append((stage, name))
    return out


def _resolved(schema, values: dict, name: str) -> tuple:
    """What a config resolves ``name`` to: the run's record (saved as train_config.json) and the argument object's
    attribute; or the refusal, by type and text (any error: a library's too)."""
    try:
        record, arguments = schema.resolve(values)
    except Exception as error:  # noqa: BLE001 - compared across forms, whatever it is
        return ("refused", type(error).__name__, str(error))
    name = field_aliases(schema.classes).get(name, name)  # the other transformers release's spelling: read as ours
    owner = field_table(schema.classes)[name][0]
    attribute = getattr(arguments[schema.classes.index(owner)], name)
    return ("accepted", repr(record[name]), type(record[name]).__name__, repr(attribute))


def test_every_field_of_every_stage_means_one_thing_in_every_form(tmp_path, environment_kept):
    schemas = stage_schemas()
    walked, accepted, differ, changed = 0, 0, [], []
    files: dict[str, Path] = {}
    for stage, name in _stage_fields():
        schema, base = schemas[stage], BASES[stage]
        ranges = {**RANGES, **schema.ranges}
        _, f, tp = field_table(schema.classes)[name]
        if stage not in files:
            files[stage] = tmp_path / f"{stage}.json"
            files[stage].write_text(json.dumps(base))
        without = {k: v for k, v in base.items() if k != name}
        base_file = tmp_path / f"{stage}-{name}-base.json"
        base_file.write_text(json.dumps(without))
        choices = f.metadata.get("choices")
        for value in accepted_values(tp, choices, ranges.get(name)) + refused_values(tp, ranges.get(name)):
            config = tmp_path / "config.json"
            config.write_text(json.dumps({**without, name: value}))
            forms = {"json": _resolved(schema, read_config_values(config, [], schema.classes), name)}
            if writable_as_text(value, tp):
                for form, argv in (("--key value", [f"--{name}", as_text(value)]),
                                   ("--key=value", [f"--{name}={as_text(value)}"])):
                    forms[form] = _resolved(schema, read_config_values(base_file, argv, schema.classes), name)
            walked += 1
            if len(set(forms.values())) > 1:
                differ.append((stage, name, value, forms))
            if forms["json"][0] == "accepted":
                accepted += 1
                if forms["json"][1:3] != (repr(value), type(value).__name__):  # the record holds the value as given
                    changed.append((stage, name, value, forms["json"]))
    assert not differ, "\n".join(f"{s}.{n} = {v!r}: {forms}" for s, n, v, forms in differ[:10])
    assert not changed, changed[:10]
    assert walked > 600 and accepted > 300, (walked, accepted)  # the walk reached the fields (measured 747 / 407)


@pytest.mark.parametrize("argv", [["--activation_checkpointing", "1"], ["--activation_checkpointing=1"],
                                  ["--gradient_checkpointing", "1"]])
def test_one_checkpointed_layer_is_one_layer_on_the_command_line_too(argv, tmp_path, environment_kept):
    """The case that was read as ``true``: one layer, an int, in the run's record and in the training arguments."""
    from diffusion_embedder.training.arguments import SUPERVISED

    config = tmp_path / "c.json"
    config.write_text(json.dumps(BASES["supervised"]))
    record, arguments = SUPERVISED.resolve(read_config_values(config, argv))
    name = "activation_checkpointing" if "activation_checkpointing" in record else "gradient_checkpointing"
    assert record[name] == 1 and type(record[name]) is int
    assert getattr(arguments[-1], name) == 1 and type(getattr(arguments[-1], name)) is int
    config.write_text(json.dumps({**BASES["supervised"], "activation_checkpointing": 1}))
    assert SUPERVISED.resolve(read_config_values(config))[0] == record


# ------------------------------------------------------------------ encoder settings, encode's and load's keywords
def _cli_outcome(parse, argv: list[str], name: str, check=None) -> tuple:
    """A command line's value for ``name`` (argparse, then the command's own check), or its refusal's line."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = parse(argv)
        if check is not None:
            check(args)
    except SystemExit:
        return ("refused", problem_line(name, err.getvalue().strip().splitlines()[-1]))
    except ValueError as error:
        return ("refused", problem_line(name, str(error)))
    return ("accepted", repr(getattr(args, name)), type(getattr(args, name)).__name__)


def _cli_forms(parse, name: str, value, tp, base: list[str], check=None) -> dict:
    if not writable_as_text(value, tp):
        return {}
    return {f"{parse.__module__} --key value": _cli_outcome(parse, [*base, f"--{name}", as_text(value)], name, check),
            f"{parse.__module__} --key=value": _cli_outcome(parse, [*base, f"--{name}={as_text(value)}"], name, check)}


class _Resolved(Exception):
    """Raised by the spy once ``from_pretrained`` has resolved its settings: nothing is loaded."""


def _from_pretrained_outcome(monkeypatch, name: str, value) -> tuple:
    """``Encoder.from_pretrained(LLAMA_FIXTURE, name=value)``: the setting it resolved (read from the config it built,
    before any weight loads), the keyword as it reached the loader, or the refusal's line."""
    seen: dict = {}
    real_load, real_resolve = loading.from_pretrained, loading.resolve_config

    def load(*args, **kwargs):
        seen["arguments"] = inspect.signature(real_load).bind(*args, **kwargs).arguments
        return real_load(*args, **kwargs)

    def resolve(*args, **kwargs):
        seen["config"] = real_resolve(*args, **kwargs)
        raise _Resolved

    monkeypatch.setattr(loading, "from_pretrained", load)
    monkeypatch.setattr(loading, "resolve_config", resolve)
    try:
        Encoder.from_pretrained(str(LLAMA_FIXTURE), **{name: value})
    except _Resolved:
        given = getattr(seen["config"], name) if name in SETTING_NAMES else seen["arguments"][name]
        return ("accepted", repr(given), type(given).__name__)
    except (ValueError, TypeError, OSError) as error:  # ours (OptionError, a missing adapter) and Python's
        return ("refused", problem_line(name, str(error)))
    finally:
        monkeypatch.undo()
    raise AssertionError(f"from_pretrained({name}={value!r}) neither resolved nor refused")


@pytest.fixture(scope="module")
def tiny_encoder():
    return Encoder.from_pretrained(str(LLAMA_FIXTURE), device="cpu")


def _encode_outcome(encoder, monkeypatch, name: str, value) -> tuple:
    """``encoder.encode([], name=value)`` (every keyword is checked before the inputs are looked at): the keyword as
    it reached encode's work (``inference.encode``), or the refusal's line."""
    seen: dict = {}
    real = inference.encode

    def spy(*args, **kwargs):
        seen.update(inspect.signature(real).bind(*args, **kwargs).arguments)
        return real(*args, **kwargs)

    monkeypatch.setattr(inference, "encode", spy)
    try:
        encoder.encode([], **{name: value})
    except (ValueError, TypeError) as error:
        return ("refused", problem_line(name, str(error)))
    finally:
        monkeypatch.undo()
    return ("accepted", repr(seen[name]), type(seen[name]).__name__)


def _check_encode_cli(args) -> None:
    encode_corpus.check_arguments(args)


def test_every_encoder_setting_means_one_thing_in_config_keyword_and_flags(tmp_path, monkeypatch, environment_kept):
    """Each ``EncoderConfig`` setting as a training config field (JSON, ``--key value``, ``--key=value``), a
    ``from_pretrained`` keyword and an ``eval`` / ``encode`` flag: one resolved value, or one refusal."""
    from diffusion_embedder.training.arguments import SUPERVISED

    base_file = tmp_path / "base.json"
    base_file.write_text(json.dumps(BASES["supervised"]))
    differ, walked = [], 0
    for f in setting_fields():
        tp = field_types()[f.name]
        for value in accepted_values(tp, f.metadata.get("choices")) + refused_values(tp):
            config = tmp_path / "c.json"
            config.write_text(json.dumps({**BASES["supervised"], f.name: value}))
            training = _resolved(SUPERVISED, read_config_values(config), f.name)
            forms = {"training config": ("accepted", *training[1:3]) if training[0] == "accepted" else
                     ("refused", problem_line(f.name, training[2]))}
            if value is not None:  # None is "not given" to from_pretrained and on the eval/encode command lines
                forms["from_pretrained"] = _from_pretrained_outcome(monkeypatch, f.name, value)
                forms |= _cli_forms(eval_run.parse_args, f.name, value, tp, [])
                forms |= _cli_forms(encode_corpus.parse_args, f.name, value, tp, [])
            walked += 1
            if len(set(forms.values())) > 1:
                differ.append((f.name, value, forms))
    assert not differ, "\n".join(f"{n} = {v!r}: {forms}" for n, v, forms in differ[:10])
    assert walked > 50, walked


#: Names an entry point shares with another that mean something else there (so they are not compared across them):
#: the command lines' ``device`` is a comma-separated list and their ``chunk_size`` the corpus chunk a process takes;
#: ``from_pretrained`` also takes a hub kernel as ``attn_implementation``, which training cannot run; paths and names
#: are checked where they are read. Each is still walked in its own forms.
NOT_SHARED = {"device", "chunk_size", "attn_implementation", "base_model_name_or_path", "peft_model_name_or_path"}


def _keywords(function) -> dict[str, typing.Any]:
    """A public function's options and their declared types: every keyword with a default (the required ones are
    the data: texts, a checkpoint), but the settings (the test above) and a type that names no JSON value."""
    hints = typing.get_type_hints(function, {**vars(inspect.getmodule(function)), "DevicePool": object})
    return {name: hints[name] for name, p in inspect.signature(function).parameters.items()
            if name in hints and p.default is not p.empty and name not in SETTING_NAMES
            and accepted_values(hints[name])}


def _cli_options(options: type) -> set[str]:
    """The flags of a command that take a value (a bool field is a switch: ``--no_progress_bar``)."""
    return {name for name, tp in typing.get_type_hints(options).items() if tp is not bool}


def test_every_encode_and_load_keyword_means_one_thing_wherever_it_is_given(tiny_encoder, monkeypatch, tmp_path):
    """Each keyword of ``Encoder.encode`` and ``Encoder.from_pretrained`` (the settings have the test above), with
    the ``encode`` / ``eval`` flags of the same name and meaning: one resolved value, or one refusal."""
    encode_cli, eval_cli = _cli_options(encode_corpus._EncodeOptions), _cli_options(eval_run._EvalOptions)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"_id": "1", "text": "a"}) + "\n")
    encode_base = ["--base_model_name_or_path", "m", "--corpus", str(corpus), "--output_dir", str(tmp_path / "o")]
    entry_points = {"encode": _keywords(Encoder.encode), "from_pretrained": _keywords(Encoder.from_pretrained)}
    assert {"compile", "packing", "batch_size", "max_tokens_per_batch", "merge_peft", "torch_dtype"} <= {
        n for keywords in entry_points.values() for n in keywords}
    differ, walked = [], 0
    for entry, keywords in entry_points.items():
        for name, tp in keywords.items():
            for value in accepted_values(tp) + refused_values(tp, inference.BOUNDS.get(name)):
                if entry == "encode":
                    forms = {"encode": _encode_outcome(tiny_encoder, monkeypatch, name, value)}
                else:
                    forms = {"from_pretrained": _from_pretrained_outcome(monkeypatch, name, value)}
                if name not in NOT_SHARED and value is not None:  # None: not given, on a command line
                    if name in encode_cli:
                        forms |= _cli_forms(encode_corpus.parse_args, name, value, tp, encode_base, _check_encode_cli)
                    if name in eval_cli:
                        forms |= _cli_forms(eval_run.parse_args, name, value, tp, [])
                walked += 1
                if len(set(forms.values())) > 1:
                    differ.append((entry, name, value, forms))
                kinds = _scalars(tp)
                foreign = str not in kinds if isinstance(value, str) else type(value) not in kinds
                if foreign and forms[entry][0] == "accepted":  # a value of another type: never taken as truthy
                    differ.append((entry, name, value, forms))
    assert not differ, "\n".join(f"{e}({n}={v!r}): {forms}" for e, n, v, forms in differ[:10])
    assert walked > 60, walked


# ------------------------------------------------------------------ every boolean keyword of the public API
def _documented_callables() -> list[tuple[str, typing.Any, typing.Any]]:
    """``(name, callable, module)`` for what the API pages document (``::: dotted.path`` lines): functions, and each
    class's constructor and public methods."""
    from importlib import import_module

    found = []
    for page in sorted((ROOT / "docs").rglob("*.md")):
        for line in page.read_text(encoding="utf-8").splitlines():
            if not line.startswith("::: "):
                continue
            module_name, _, attr = line.split()[1].rpartition(".")
            obj = getattr(import_module(module_name), attr)
            if inspect.isfunction(obj):
                found.append((obj.__qualname__, obj, obj))
            elif inspect.isclass(obj):
                for name, member in vars(obj).items():
                    if name == "__init__" or (not name.startswith("_") and callable(getattr(obj, name, None))):
                        bound = member if inspect.isfunction(member) else getattr(obj, name)
                        found.append((f"{obj.__qualname__}.{name}", bound, inspect.unwrap(getattr(obj, name))))
    return found


class _TypeCheckingNames(dict):
    """A module's names; a name imported for type checking only (``DevicePool``, a tokenizer class) reads as object."""

    def __missing__(self, key: str) -> type:
        return object


def test_every_boolean_keyword_of_the_public_api_refuses_a_non_boolean():
    """Before, ``encode(texts, compile="false")`` compiled every layer (a non-empty string is truthy) while
    ``packing="true"`` was refused. Every documented function's and method's keywords that take a bool, walked from
    their signatures: ``"false"`` and ``1`` are refused naming the keyword, before any work."""
    walked = []
    for qualname, function, target in _documented_callables():
        if not inspect.isroutine(target):
            continue
        hints = typing.get_type_hints(target, localns=_TypeCheckingNames({**vars(builtins),
                                                                          **vars(inspect.getmodule(target))}))
        parameters = inspect.signature(function).parameters
        required = [p for p in parameters.values() if p.default is p.empty
                    and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        for name, p in parameters.items():
            if name not in hints or bool not in _scalars(hints[name]) or p.kind is p.VAR_KEYWORD:
                continue
            for value in ("false", 1):  # the others: of their type where it is a string (a checkpoint), else None
                others = ["unused" if hints.get(q.name) is str else None for q in required if q.name != name]
                with pytest.raises(ValueError, match=re.escape(f"{name}: {value!r} ({type(value).__name__}) is not of "
                                                               "type bool")):
                    function(*others, **{name: value})
            walked.append(f"{qualname}({name})")
    expected = {"Encoder.encode(compile)", "Encoder.encode(normalize_embeddings)", "Encoder.save(merge_before_save)",
                "Encoder.from_pretrained(merge_peft)", "load_backbone(lm_head)", "RepllamaLoss.__init__(scale_by_dim)"}
    assert expected <= set(walked), sorted(walked)
