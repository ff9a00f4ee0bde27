"""``eval``: its options, then load a checkpoint, build the tasks, run mteb per task, keep going past failures.

Results go to mteb's standard path ``OUTPUT_DIR/results/<name>/<revision>/<Task>.json`` when the checkpoint
is evaluated with its own settings, and under ``<revision>/experiments/<ablation>/`` when encoder or
evaluation settings are overridden. Which weights, settings, data and instruction a stored result belongs
to, and when it is scored again, is the ledger of ``results.py``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from diffusion_embedder import clihelp, distributed
from diffusion_embedder.clihelp import UsageError
from diffusion_embedder.evaluation import sharding
from diffusion_embedder.evaluation.options import (
    EXIT_STATUS,
    ModelOptions,
    check_folder,
    check_model_options,
    command_parser,
    encoder_overrides,
    option,
    with_encoder_settings,
)
from diffusion_embedder.evaluation.results import check_identity, record_instruction, rescore_reason
from diffusion_embedder.evaluation.tasks import (
    BENCHMARKS,
    DEFAULT_MAX_LENGTH_CAP,
    DEFAULT_QUERY_TEMPLATE,
    resolve_task_names,
)
from diffusion_embedder.values import AT_LEAST_ONE

logger = logging.getLogger(__name__)

#: For p-MRR tasks "full ranking" keeps every candidate: p-MRR reads the rank of each changed document.
FULL_RANKING = 2**62


@dataclass
class _EvalOptions(ModelOptions):
    """Every ``eval`` option, once: ``build_parser`` makes one flag per field (a list is ``nargs="+"``,
    a bool a switch)."""

    task_name: list[str] = option([], "mteb task name(s); upstream Bright* names accepted")
    benchmark: str | None = option(help="every task of a benchmark (all: the three)", choices=tuple(BENCHMARKS))
    local_task: list[str] = option([], "BEIR-format folder(s) to evaluate")
    task_to_instructions_fp: str | None = option(
        help="JSON task -> query instruction (default: the shipped file)")
    output_dir: str = option("results", "results folder, laid out as mteb's ResultCache reads it")
    max_length_cap: int = option(DEFAULT_MAX_LENGTH_CAP, "upper bound for LongEmbed length splits",
                                 bounds=AT_LEAST_ONE)
    top_k: int | None = option(
        help="documents kept per query; default: full candidate ranking for p-MRR tasks and the top "
             "1000 otherwise (all @k metrics exact); 200 reproduces the paper's truncation", bounds=AT_LEAST_ONE)
    data_dir: str | None = option(help="folder with datasets downloaded beforehand (clones of the hub repos)")
    query_template: str = option(DEFAULT_QUERY_TEMPLATE, "FollowIR query + instruction format")
    embedding_cache_dir: str | None = option(
        help="document embedding cache (default: OUTPUT_DIR/embedding_cache)")
    no_embedding_cache: bool = option(False, "encode every document again instead of reusing cached embeddings")
    overwrite: bool = option(False, "rerun tasks that already have results")
    save_predictions: bool = option(False, "also write each task's ranked documents (RESULTS/predictions)")
    model_name: str | None = option(help="results name (default: diffusion_embedder/<checkpoint folder>)")
    revision: str | None = option(help="results revision (default: hash of weights and settings)")


#: The evaluation options plus every ``EncoderConfig`` setting (None: the checkpoint's own).
EvalArguments = with_encoder_settings(_EvalOptions, "EvalArguments", __name__)


@dataclass
class EvalOutcome:
    """Main score per task that ran, the error per task that failed, and where results were written."""

    scores: dict[str, float] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)
    results_dir: str = ""


def build_parser() -> argparse.ArgumentParser:
    """The ``eval`` command line: one flag per ``_EvalOptions`` field, then one per encoder setting."""
    return command_parser("eval", "Evaluate an encoder on FollowIR, LongEmbed, BRIGHT or local BEIR data (under "
                                  "torchrun: every rank encodes its share, rank 0 scores).", _EvalOptions)


def parse_args(argv: list[str] | None = None) -> EvalArguments:
    """``EvalArguments`` from the command line (``argv``, else ``sys.argv``)."""
    return EvalArguments(**vars(build_parser().parse_args(argv)))


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
    """The checkpoint ``args`` name, with the encoder settings they override, on this rank's device."""
    check_model_options(args, _EvalOptions)
    device, _ = distributed.placement(args.device)
    return sharding.load_checkpoint(args.base_model_name_or_path, args.peft_model_name_or_path, args.torch_dtype,
                                    device, **encoder_overrides(args))


def wrap_encoder(encoder, args: EvalArguments):
    """The mteb model for ``encoder`` under ``args`` (instructions, template, cache, results identity)."""
    from diffusion_embedder.evaluation.cache import EmbeddingCache
    from diffusion_embedder.evaluation.mteb_model import MTEBEncoder
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
        device=distributed.placement(args.device)[1],
        chunk_size=args.chunk_size,
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
        raise UsageError("Nothing to evaluate: give --task_name, --benchmark or --local_task.")
    return factories


def check_arguments(args: EvalArguments) -> list[tuple[str, Callable]]:
    """Every flag, before any model loads or any file is written; returns the task factories (``task_factories``:
    an unknown task or benchmark is refused here, a task's data is read when it runs)."""
    from diffusion_embedder.evaluation.tasks import load_instructions

    check_model_options(args, _EvalOptions)
    check_folder(args.output_dir, "--output_dir")
    check_folder(args.embedding_cache_dir, "--embedding_cache_dir")
    missing = [folder for folder in args.local_task if not os.path.isdir(folder)]
    if missing:
        raise UsageError(f"--local_task: no such folder: {', '.join(missing)} (a BEIR folder: corpus.jsonl, "
                         "queries.jsonl, qrels/).")
    try:
        load_instructions(args.task_to_instructions_fp)
        return task_factories(args)
    except UsageError:
        raise
    except ValueError as e:  # an unknown task or benchmark, an instructions file that is no JSON object of strings
        raise UsageError(str(e)) from None


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
            record_instruction(results_dir, label, instruction, task.metadata.main_score)
            outcome.scores[label] = float(result.task_results[0].get_score())
            logger.info("%s: %s = %.4f", label, task.metadata.main_score, outcome.scores[label])
        except Exception as e:  # noqa: BLE001 - one task's failure must not lose the others
            logger.exception("Task %s failed", label)
            outcome.failures[label] = f"{type(e).__name__}: {e}"
    return outcome


#: ``eval``'s exit statuses (``clihelp.run_command``): 0 every task scored; 1 some task failed (the others still ran,
#: each failure listed); 2 the run could not start, the message alone (``options.EXIT_STATUS``: a flag, a missing
#: folder or file, the checkpoint's files). Anything else is a bug, with its traceback.
EVAL_EXIT_STATUS = EXIT_STATUS


def main(argv: list[str] | None = None) -> int:
    """CLI entry; exit status ``EVAL_EXIT_STATUS``.

    Under torchrun every rank loads the encoder; rank 0 runs mteb and sends the others their chunks of each
    encode call (``sharding.py``), and alone writes results and prints.
    """
    args = parse_args(argv)
    distributed.configure_logging()
    return clihelp.run_command(lambda: _run(args), EVAL_EXIT_STATUS)


def _run(args: EvalArguments) -> int:
    factories = check_arguments(args)  # before the model loads and before any process starts waiting
    distributed.init()
    try:
        if not distributed.is_main():
            sharding.ShardedEncoder(load_encoder(args), distributed.placement(args.device)[1], args.chunk_size).serve()
            distributed.barrier()  # every rank done talking before the group goes: an exit race can abort a rank
            return 0
        try:
            outcome = evaluate(wrap_encoder(load_encoder(args), args), factories, args)
        finally:
            sharding.stop_workers()
            distributed.barrier()  # the workers meet it once they have the stop
    finally:
        distributed.shutdown()
    print(f"Results: {outcome.results_dir}")
    for name, score in outcome.scores.items():
        print(f"  {name}: {score:.4f}")
    if outcome.failures:
        print(f"{len(outcome.failures)} task(s) failed:", file=sys.stderr)
        for name, error in outcome.failures.items():
            print(f"  {name}: {error}", file=sys.stderr)
        return 1
    return 0
