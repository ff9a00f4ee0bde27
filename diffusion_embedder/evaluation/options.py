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

from diffusion_embedder import clihelp, distributed
from diffusion_embedder.clihelp import UsageError
from diffusion_embedder.config import SETTING_NAMES, check_values, setting_fields, value_problem
from diffusion_embedder.config import field_types as encoder_field_types
from diffusion_embedder.data.jsonl import DataFormatError
from diffusion_embedder.devices import check_device
from diffusion_embedder.dtypes import TORCH_DTYPES
from diffusion_embedder.evaluation.sharding import CHUNK_SIZE
from diffusion_embedder.files import folder_problem
from diffusion_embedder.inference import BOUNDS
from diffusion_embedder.release_configs import BackboneConfigError
from diffusion_embedder.values import AT_LEAST_ONE, AT_LEAST_ZERO, OptionError, require, text_type

#: ``eval``'s and ``encode``'s errors in our words, reported as the message alone (no traceback) with this exit
#: status: 2, the command could not start (a flag, the corpus or a data file, the checkpoint's files, an output
#: folder); argparse's own refusals exit 2 too. Anything else is a bug, with its traceback.
EXIT_STATUS: dict[type[Exception], int] = {
    UsageError: 2,
    OptionError: 2,
    DataFormatError: 2,
    FileNotFoundError: 2,  # a corpus, a checkpoint or a file a flag names
    BackboneConfigError: 2,
}


def option(default=None, help: str | None = None, **cli):
    """A command-line option: its default and help; ``cli`` may add ``choices``, ``bounds`` (a numeric range,
    ``values.Bounds``), or ``flag`` for a ``True`` switch (the ``--flag`` that turns it off)."""
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
    batch_size: int = option(32, "texts per forward pass (the rows of one batch)", bounds=BOUNDS["batch_size"])
    chunk_size: int = option(
        CHUNK_SIZE, "most texts one Encoder.encode call gets: the unit a torchrun rank takes, stores and "
                    "resumes (fewer for long texts: about 1M characters at most)", bounds=AT_LEAST_ONE)
    show_progress_bar: bool = option(True, "hide the progress bar", flag="no_progress_bar")


@dataclass
class CorpusFieldOptions:
    """The fields of a JSONL corpus: ``encode``'s and ``mine``'s."""

    id_field: str = option("_id", "the JSONL field holding each document's id")
    text_field: str = option("text", "the JSONL field holding each document's text")
    title_field: str = option("title", "joined before the text where present (as mteb does); '' for none")


@dataclass
class ShardOptions:
    """How the chunk store's work is shared out and batched: ``encode``'s and ``mine``'s."""

    num_shards: int = option(1, "processes the corpus is shared out to (a job array's size); under torchrun "
                                "each one's ranks share its part", bounds=AT_LEAST_ONE)
    shard_index: int = option(0, "this process's share, 0 .. num_shards - 1 (a job array's index)",
                              bounds=AT_LEAST_ZERO)
    max_tokens_per_batch: int | None = option(help="cut batches by padded tokens (rows x longest) instead",
                                              bounds=BOUNDS["max_tokens_per_batch"])


def check_shares(args) -> None:
    """``ShardOptions`` together: this process's share is one of the shares (each value alone is checked by its
    bounds)."""
    if not 0 <= args.shard_index < args.num_shards:
        raise UsageError(f"--shard_index {args.shard_index} is not in 0 .. --num_shards - 1 = {args.num_shards - 1}.")


def process_share(args) -> tuple[int, int]:
    """``(index, count)`` of this process's share of the chunks: the job array's shard, split again over torchrun's
    ranks."""
    world = distributed.world_size()
    return args.shard_index * world + distributed.rank(), args.num_shards * world


def add_options(parser: argparse.ArgumentParser, options: type) -> None:
    """One flag per field of the ``options`` dataclass (a list is ``nargs="+"``, a bool a switch); every value is
    read and checked by ``text_type`` from the field's type, choices and bounds."""
    hints = typing.get_type_hints(options)
    for f in dataclasses.fields(options):
        tp = hints[f.name]
        spec = {k: f.metadata[k] for k in ("help", "choices") if k in f.metadata}
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        choices, bounds = f.metadata.get("choices"), f.metadata.get("bounds")
        if tp is bool:
            spec["action"] = "store_false" if default else "store_true"
        elif typing.get_origin(tp) is list:
            spec |= {"nargs": "+", "type": text_type(f.name, typing.get_args(tp)[0], choices, bounds)}
        else:
            spec["type"] = text_type(f.name, tp, choices, bounds)
        parser.add_argument(f"--{f.metadata.get('flag', f.name)}", dest=f.name, default=default, **spec)


def add_encoder_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per ``EncoderConfig`` setting; unset flags keep the checkpoint's value."""
    group = parser.add_argument_group("encoder settings (default: the checkpoint's, else the value shown)")
    for f in setting_fields():
        choices = f.metadata.get("choices")
        extra = f"; one of {', '.join(choices)}" if choices else ""
        group.add_argument(
            f"--{f.name}",
            type=text_type(f.name, encoder_field_types()[f.name], rule=value_problem),
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


def check_model_options(args, options: type) -> None:
    """Before anything loads: every field of ``options`` (a value given in Python, not parsed by ``add_options``, is
    checked as its flag would be; None is "not given"), every encoder setting, a checkpoint, device names this
    machine has (and a placement torchrun allows)."""
    hints = typing.get_type_hints(options)
    for f in dataclasses.fields(options):
        value = getattr(args, f.name)
        if value is not None:
            choices = None if isinstance(value, list) else f.metadata.get("choices")
            require(f.name, value, hints[f.name], choices, f.metadata.get("bounds"))
    check_values(encoder_overrides(args), "encoder settings")
    if not args.base_model_name_or_path:
        raise UsageError("--base_model_name_or_path is required.")
    try:
        distributed.placement(args.device)  # a device pool under torchrun is refused before any process waits
        for device in distributed.parse_devices(args.device):
            check_device(device, "--device")
    except ValueError as e:
        raise UsageError(str(e)) from None


def check_folder(path: str | None, flag: str) -> None:
    """A folder a flag names that this command will write into: refused if it (or a folder above it) is a file."""
    problem = folder_problem(path, flag) if path else None
    if problem:
        raise UsageError(problem)
