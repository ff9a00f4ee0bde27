"""Evaluation driver: load a checkpoint, build the tasks, run mteb per task, keep going past failures.

Results go to mteb's standard path ``OUTPUT_DIR/results/<name>/<revision>/<Task>.json`` when the checkpoint
is evaluated with its own settings, and under ``<revision>/experiments/<ablation>/`` when encoder or
evaluation settings are overridden. The revision is a hash of the loaded weights and settings, and
``identity.jsonl`` beside the results is checked on every run, so scores of another checkpoint are never
reused. A stored result is reused only for the same data (dataset revision; for local tasks a hash of
their files) and the same query instruction (recorded in ``query_instructions.jsonl``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import sys
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from diffusion_embedder import clihelp
from diffusion_embedder.config import field_types as encoder_field_types
from diffusion_embedder.config import matches_type, setting_fields, value_problem
from diffusion_embedder.dtypes import TORCH_DTYPES
from diffusion_embedder.evaluation.tasks import resolve_task_names

logger = logging.getLogger(__name__)

#: Beside the results: the weights and settings they belong to. Not ``*.json``: mteb's ResultCache reads
#: every ``*.json`` next to ``model_meta.json`` as a task result.
IDENTITY_FILE = "identity.jsonl"
#: Beside the results: the query instruction each task was scored with, one JSON line per task.
INSTRUCTIONS_FILE = "query_instructions.jsonl"
#: Encoder settings the command line may override; an override is an ablation (an ``experiments/`` folder).
ENCODER_FLAGS = tuple(f.name for f in setting_fields())
#: For p-MRR tasks "full ranking" keeps every candidate: p-MRR reads the rank of each changed document.
FULL_RANKING = 2**62


@dataclass
class _EvalOptions:
    base_model_name_or_path: str | None = None
    peft_model_name_or_path: str | None = None
    task_name: list[str] = field(default_factory=list)
    benchmark: str | None = None
    local_task: list[str] = field(default_factory=list)
    task_to_instructions_fp: str | None = None
    output_dir: str = "results"
    batch_size: int = 32
    max_length_cap: int = 32768
    top_k: int | None = None
    data_dir: str | None = None
    query_template: str = "{query} {instruction}"
    embedding_cache_dir: str | None = None
    no_embedding_cache: bool = False
    overwrite: bool = False
    save_predictions: bool = False
    show_progress_bar: bool = True
    model_name: str | None = None
    revision: str | None = None
    torch_dtype: str | None = None
    device: str | None = None


#: The evaluation options plus every ``EncoderConfig`` setting (None: the checkpoint's own).
EvalArguments = dataclasses.make_dataclass(
    "EvalArguments",
    [(f.name, encoder_field_types()[f.name] | None, field(default=None)) for f in setting_fields()],
    bases=(_EvalOptions,),
    namespace={"__module__": __name__},
)


@dataclass
class EvalOutcome:
    """Main score per task that ran, the error per task that failed, and where results were written."""

    scores: dict[str, float] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)
    results_dir: str = ""


def _str2bool(value: str) -> bool:
    if value.lower() in ("1", "true", "yes", "y"):
        return True
    if value.lower() in ("0", "false", "no", "n"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {value!r}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=clihelp.prog("eval"),
        description="Evaluate an encoder on FollowIR, LongEmbed, BRIGHT or local BEIR data.",
        formatter_class=clihelp.HelpFormatter,
    )
    p.add_argument("--base_model_name_or_path", help="base checkpoint, encoder folder or hub name")
    p.add_argument("--peft_model_name_or_path", help="LoRA adapter trained on top of the base")
    p.add_argument("--task_name", nargs="+", default=[], help="mteb task name(s); upstream Bright* names accepted")
    p.add_argument("--benchmark", choices=["followir", "longembed", "bright", "all"])
    p.add_argument("--local_task", nargs="+", default=[], help="BEIR-format folder(s) to evaluate")
    p.add_argument("--task_to_instructions_fp", help="JSON task -> query instruction (default: the shipped file)")
    p.add_argument("--output_dir", default="results")
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--max_length_cap", type=int, default=32768, help="upper bound for LongEmbed length splits")
    p.add_argument("--top_k", type=int, default=None,
                   help="documents kept per query; default: full candidate ranking for p-MRR tasks and the top "
                        "1000 otherwise (all @k metrics exact); 200 reproduces the paper's truncation")
    p.add_argument("--data_dir", help="folder with datasets downloaded beforehand (clones of the hub repos)")
    p.add_argument("--query_template", default="{query} {instruction}", help="FollowIR query + instruction format")
    p.add_argument("--embedding_cache_dir", help="document embedding cache (default: OUTPUT_DIR/embedding_cache)")
    p.add_argument("--no_embedding_cache", action="store_true")
    p.add_argument("--overwrite", action="store_true", help="rerun tasks that already have results")
    p.add_argument("--save_predictions", action="store_true")
    p.add_argument("--no_progress_bar", dest="show_progress_bar", action="store_false")
    p.add_argument("--model_name", help="results name (default: diffusion_embedder/<checkpoint folder>)")
    p.add_argument("--revision", help="results revision (default: hash of weights and settings)")
    p.add_argument("--torch_dtype", default=None, choices=TORCH_DTYPES, help="default: float32")
    p.add_argument("--device", default=None)
    add_encoder_flags(p)
    return p


def _setting_type(name: str):
    """argparse type for setting ``name``: its Python type, checked with EncoderConfig's own rules."""
    tp = encoder_field_types()[name]
    base = bool if tp is bool else int if tp is int else dict if typing.get_origin(tp) is dict else str

    def parse(raw: str):
        if base is dict:
            try:
                value = json.loads(raw)
            except json.JSONDecodeError as err:
                raise argparse.ArgumentTypeError(f"{name}: expected a JSON object, got {raw!r}") from err
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
            help=f"{f.metadata['help']} (default: the checkpoint's, else {f.default!r}{extra})",
        )


def parse_args(argv: list[str] | None = None) -> EvalArguments:
    return EvalArguments(**vars(build_parser().parse_args(argv)))


def encoder_overrides(args: EvalArguments) -> dict:
    """Encoder settings given on the command line; unset ones are the checkpoint's own."""
    return {k: getattr(args, k) for k in ENCODER_FLAGS if getattr(args, k) is not None}


def experiment_kwargs(args: EvalArguments, instructions: dict[str, str]) -> dict:
    """Non-default evaluation settings that change scores; they name an ``experiments/`` results folder."""
    extra: dict = {} if args.top_k is None else {"top_k": args.top_k}
    if args.task_to_instructions_fp:
        blob = json.dumps(instructions, sort_keys=True).encode()
        extra["instructions"] = hashlib.sha256(blob).hexdigest()[:8]
    if args.query_template != EvalArguments.query_template:
        extra["template"] = hashlib.sha256(args.query_template.encode()).hexdigest()[:8]
    if args.max_length_cap != EvalArguments.max_length_cap:
        extra["length_cap"] = args.max_length_cap
    return extra


def load_encoder(args: EvalArguments):

    from diffusion_embedder import Encoder

    if not args.base_model_name_or_path:
        raise ValueError("--base_model_name_or_path is required.")
    return Encoder.from_pretrained(
        args.base_model_name_or_path,
        peft_model_name_or_path=args.peft_model_name_or_path,
        merge_peft=args.peft_model_name_or_path is not None,
        torch_dtype=args.torch_dtype,
        device=args.device,
        **encoder_overrides(args),
    )


def wrap_encoder(encoder, args: EvalArguments):
    """The mteb model for ``encoder`` under ``args`` (instructions, template, cache, results identity)."""
    from diffusion_embedder.evaluation.cache import EmbeddingCache
    from diffusion_embedder.evaluation.model import MTEBEncoder
    from diffusion_embedder.evaluation.tasks import load_instructions

    instructions = load_instructions(args.task_to_instructions_fp)
    cache = None
    if not args.no_embedding_cache:
        cache = EmbeddingCache(args.embedding_cache_dir or os.path.join(args.output_dir, "embedding_cache"))
    return MTEBEncoder(
        encoder,
        instructions=instructions,
        query_template=args.query_template,
        cache=cache,
        max_length_cap=args.max_length_cap,
        name=args.model_name,
        revision=args.revision,
        extra_experiment_kwargs=experiment_kwargs(args, instructions),
        overrides=encoder_overrides(args),
        source={"base_model_name_or_path": args.base_model_name_or_path,
                "peft_model_name_or_path": args.peft_model_name_or_path},
    )


def task_factories(args: EvalArguments) -> list[tuple[str, Callable]]:
    """(name, builder) per task; built lazily so one bad task fails alone."""
    from diffusion_embedder.evaluation.local import load_local_task
    from diffusion_embedder.evaluation.tasks import get_mteb_task

    factories: list[tuple[str, Callable]] = []
    if args.task_name or args.benchmark:
        for name in resolve_task_names(args.task_name, args.benchmark):
            factories.append((name, lambda n=name: get_mteb_task(n, args.data_dir)))
    for folder in args.local_task:
        label = os.path.basename(os.path.normpath(folder))
        factories.append((label, lambda f=folder: load_local_task(f)))
    if not factories:
        raise ValueError("Nothing to evaluate: give --task_name, --benchmark or --local_task.")
    return factories


def check_identity(results_dir: Path, identity: dict) -> None:
    """Refuse a results folder written by another checkpoint (same name/revision, different weights)."""
    path = results_dir / IDENTITY_FILE
    legacy = results_dir / "identity.json"
    if legacy.exists() and not path.exists():  # older runs wrote a .json that mteb's ResultCache reads as a result
        legacy.rename(path)
    # where the weights were loaded from is provenance, not identity (a copied checkpoint, or an adapter
    # loaded beside its base instead of merged, is the same one)
    provenance = ("base_model_name_or_path", "merged_adapters")
    settings = {k: v for k, v in identity["settings"].items() if k not in provenance}
    record = {"weights": identity["weights"], "settings": settings}
    if path.exists():
        try:
            stored = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise RuntimeError(f"{path} is not valid JSON ({e.msg}); delete it to re-record this folder.") from None
        if stored != json.loads(json.dumps(record, default=str)):
            raise RuntimeError(
                f"{results_dir} holds results of another checkpoint (weights {str(stored.get('weights'))[:12]}..., "
                f"this one {str(identity['weights'])[:12]}...); choose another --output_dir or --revision."
            )
        return
    results_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, sort_keys=True, default=str) + "\n")


def _stored_instructions(results_dir: Path) -> dict[str, str]:
    """Task -> query instruction its stored result was scored with; unreadable lines count as no record."""
    path = results_dir / INSTRUCTIONS_FILE
    records: dict[str, str] = {}
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            with contextlib.suppress(json.JSONDecodeError, TypeError, KeyError):
                record = json.loads(line)
                records[str(record["task"])] = str(record["query_instruction"])
    return records


def record_instruction(results_dir: Path, task_name: str, instruction: str) -> None:
    """Note the instruction ``task_name`` was just scored with (written after its result, replaced atomically)."""
    records = {**_stored_instructions(results_dir), task_name: instruction}
    path = results_dir / INSTRUCTIONS_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps({"task": k, "query_instruction": v}) + "\n" for k, v in sorted(records.items())),
                   encoding="utf-8")
    os.replace(tmp, path)


def rescore_reason(cache, task, meta, instruction: str) -> str | None:
    """Why the stored result of ``task`` must not be reused (its data or query instruction changed), or None.

    mteb reuses a complete result whatever data it was computed on; the result records the dataset
    revision (for a local task, the hash of its files), so we compare it with the task's own. The query
    instruction resolved for the task (from the shipped file, a user file or mteb's prompt, whichever
    applies) is recorded beside the results and compared too, so an upgrade that changes the shipped
    instruction scores again. An unreadable result is an error naming the file, never a silent rerun or a
    crash inside mteb.
    """
    from mteb.results import TaskResult

    path = cache.get_task_result_path(task.metadata.name, meta)
    if not path.is_file():
        return None
    try:
        stored = TaskResult.from_disk(path)
    except Exception as e:  # noqa: BLE001 - truncated JSON, wrong schema: all mean the same to the user
        raise ValueError(
            f"{path}: cannot read this stored result ({type(e).__name__}: {str(e)[:200]}); "
            f"rerun with --overwrite to score {task.metadata.name} again."
        ) from None
    if stored.dataset_revision != task.metadata.revision:
        return (f"its data changed since {path} was written "
                f"(dataset revision {stored.dataset_revision} -> {task.metadata.revision})")
    used = _stored_instructions(path.parent).get(task.metadata.name)
    if used is None:
        return f"{path.parent / INSTRUCTIONS_FILE} does not record the query instruction {path.name} was scored with"
    if used != instruction:
        return f"its query instruction changed since {path} was written ({used!r} -> {instruction!r})"
    return None


def apply_top_k(task, top_k: int | None) -> None:
    """``None``: every candidate for p-MRR tasks, the top max(k_values) otherwise (exact @k metrics)."""
    if top_k is not None:
        task._top_k = top_k
    elif task.metadata.main_score == "p-MRR":
        task._top_k = FULL_RANKING


def evaluate(model, factories: list[tuple[str, Callable]], args: EvalArguments) -> EvalOutcome:
    """Run each task through ``mteb.evaluate``; a failure is logged and recorded, the rest still run."""
    import mteb

    cache = mteb.ResultCache(cache_path=args.output_dir)
    results_dir = cache.get_task_result_path("_", model.mteb_model_meta).parent
    check_identity(results_dir, model.identity)
    outcome = EvalOutcome(results_dir=str(results_dir))
    prediction_folder = results_dir / "predictions" if args.save_predictions else None
    for label, build in factories:
        try:
            task = build()
            label = task.metadata.name
            apply_top_k(task, args.top_k)
            instruction = model.task_instruction(task.metadata)
            reason = None if args.overwrite else rescore_reason(cache, task, model.mteb_model_meta, instruction)
            if reason:
                logger.warning("%s: scoring again: %s.", label, reason)
            result = mteb.evaluate(
                model,
                task,
                cache=cache,
                encode_kwargs={"batch_size": args.batch_size, "show_progress_bar": args.show_progress_bar},
                overwrite_strategy="always" if args.overwrite or reason else "only-missing",
                co2_tracker=False,
                prediction_folder=prediction_folder,
                show_progress_bar=False,
            )
            if result.exceptions:
                raise RuntimeError("; ".join(str(e.exception) for e in result.exceptions))
            record_instruction(results_dir, label, instruction)
            outcome.scores[label] = float(result.task_results[0].get_score())
            logger.info("%s: %s = %.4f", label, task.metadata.main_score, outcome.scores[label])
        except Exception as e:  # noqa: BLE001 - one task's failure must not lose the others
            logger.exception("Task %s failed", label)
            outcome.failures[label] = f"{type(e).__name__}: {e}"
    return outcome


def main(argv: list[str] | None = None) -> int:
    """CLI entry; returns a non-zero exit status when any task failed."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    factories = task_factories(args)  # task-name errors surface before the model is loaded
    model = wrap_encoder(load_encoder(args), args)
    outcome = evaluate(model, factories, args)
    print(f"Results: {outcome.results_dir}")
    for name, score in outcome.scores.items():
        print(f"  {name}: {score:.4f}")
    if outcome.failures:
        print(f"{len(outcome.failures)} task(s) failed:", file=sys.stderr)
        for name, error in outcome.failures.items():
            print(f"  {name}: {error}", file=sys.stderr)
        return 1
    return 0
