"""The command-line options of ``eval`` and ``encode``: each defined once, as a dataclass field; flags derived.

``ModelOptions`` are what both commands load and encode with (checkpoint, dtype, device, batch and chunk
sizes); each command adds its own fields, and ``with_encoder_settings`` adds one optional field per
``EncoderConfig`` setting (None: the checkpoint's own), so the setting flags are the encoder's own list.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass, field

from diffusion_embedder import clihelp
from diffusion_embedder.config import SETTING_NAMES, matches_type, setting_fields, value_problem
from diffusion_embedder.config import field_types as encoder_field_types
from diffusion_embedder.dtypes import TORCH_DTYPES
from diffusion_embedder.evaluation.sharding import CHUNK_SIZE
from diffusion_embedder.files import parse_json_object


def option(default=None, help: str | None = None, **cli):
    """A command-line option: its default and help; ``cli`` may add ``choices``, or ``flag`` for a
    ``True`` switch (the ``--flag`` that turns it off)."""
    factory = {"default_factory": default.copy} if isinstance(default, list) else {"default": default}
    return field(**factory, metadata={"help": help, **cli})


@dataclass
class ModelOptions:
    """The checkpoint and how it encodes: shared by ``eval`` and ``encode``."""

    base_model_name_or_path: str | None = option(help="base checkpoint, encoder folder or hub name")
    peft_model_name_or_path: str | None = option(help="LoRA adapter trained on top of the base")
    torch_dtype: str | None = option(help="default: float32", choices=TORCH_DTYPES)
    device: str | None = option(
        help="device to encode on; a comma-separated list (cuda:0,cuda:1) pools them in one process. Under "
             "torchrun each rank uses its own (cuda:LOCAL_RANK) and a list is refused")
    batch_size: int = option(32, "texts per forward pass (the rows of one batch)")
    chunk_size: int = option(
        CHUNK_SIZE, "most texts one Encoder.encode call gets: the unit a torchrun rank takes, stores and "
                    "resumes (fewer for long texts: about 1M characters at most)")
    show_progress_bar: bool = option(True, "hide the progress bar", flag="no_progress_bar")


def _str2bool(value: str) -> bool:
    if value.lower() in ("1", "true", "yes", "y"):
        return True
    if value.lower() in ("0", "false", "no", "n"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {value!r}")


def add_options(parser: argparse.ArgumentParser, options: type) -> None:
    """One flag per field of the ``options`` dataclass (a list is ``nargs="+"``, a bool a switch)."""
    hints = typing.get_type_hints(options)
    for f in dataclasses.fields(options):
        tp = hints[f.name]
        spec = {k: f.metadata[k] for k in ("help", "choices") if k in f.metadata}
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        if tp is bool:
            spec["action"] = "store_false" if default else "store_true"
        elif typing.get_origin(tp) is list:
            spec |= {"nargs": "+", "type": typing.get_args(tp)[0]}
        else:
            spec["type"] = int if int in (tp, *typing.get_args(tp)) else str
        parser.add_argument(f"--{f.metadata.get('flag', f.name)}", dest=f.name, default=default, **spec)


def _setting_type(name: str):
    """argparse type for setting ``name``: its Python type, checked with EncoderConfig's own rules."""
    tp = encoder_field_types()[name]
    base = bool if tp is bool else int if tp is int else dict if typing.get_origin(tp) is dict else str

    def parse(raw: str):
        if base is dict:
            value = parse_json_object(raw, name, argparse.ArgumentTypeError)
            if not matches_type(value, tp):
                raise argparse.ArgumentTypeError(f"{name}: expected a JSON object of strings, got {raw!r}")
            return value
        value = _str2bool(raw) if base is bool else base(raw)
        problem = value_problem(name, value)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return value

    parse.__name__ = base.__name__
    return parse


def add_encoder_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per ``EncoderConfig`` setting; unset flags keep the checkpoint's value."""
    group = parser.add_argument_group("encoder settings (default: the checkpoint's, else the value shown)")
    for f in setting_fields():
        choices = f.metadata.get("choices")
        extra = f"; one of {', '.join(choices)}" if choices else ""
        group.add_argument(
            f"--{f.name}",
            type=_setting_type(f.name),
            default=None,
            metavar=f.name.upper(),
            help=f"{f.metadata['help']} (default: the checkpoint's, else {clihelp.default_text(f)}{extra})",
        )


def command_parser(command: str, description: str, options: type) -> argparse.ArgumentParser:
    """A subcommand's command line: one flag per field of ``options``, then one per encoder setting."""
    parser = argparse.ArgumentParser(prog=clihelp.prog(command), description=description,
                                     formatter_class=clihelp.HelpFormatter)
    add_options(parser, options)
    add_encoder_flags(parser)
    return parser


def with_encoder_settings(options: type, name: str, module: str) -> type:
    """``options`` plus one field per ``EncoderConfig`` setting, None meaning the checkpoint's own."""
    return dataclasses.make_dataclass(
        name,
        [(f.name, encoder_field_types()[f.name] | None, field(default=None)) for f in setting_fields()],
        bases=(options,),
        namespace={"__module__": module},
    )


def encoder_overrides(args) -> dict:
    """Encoder settings given on the command line; unset ones are the checkpoint's own."""
    return {k: getattr(args, k) for k in SETTING_NAMES if getattr(args, k) is not None}
