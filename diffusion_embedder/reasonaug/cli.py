"""``python -m diffusion_embedder.reasonaug <stage>``: one command per pipeline stage."""

from __future__ import annotations

import argparse
import functools
import json
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from diffusion_embedder import clihelp
from diffusion_embedder.clihelp import UsageError
from diffusion_embedder.data.jsonl import DataFormatError, Field
from diffusion_embedder.files import folder_problem
from diffusion_embedder.reasonaug.concepts import load_concepts
from diffusion_embedder.reasonaug.contamination import (
    check_threshold,
    load_benchmark_queries,
    load_bright_queries,
    remove_contaminated,
)
from diffusion_embedder.reasonaug.llm import ChatClient, ClientConfig, read_jsonl, write_jsonl
from diffusion_embedder.reasonaug.pipeline import (
    STAGES,
    AwaitingBatchOutputs,
    Stage,
    StageConfig,
    StageOutputMissing,
    StageReport,
    load_concept_data,
    read_stage_output,
    run_stage,
)
from diffusion_embedder.reasonaug.prompts import render_prompt_card
from diffusion_embedder.reasonaug.rebuild import dataset_stats, load_generation, stats_markdown, update_card
from diffusion_embedder.reasonaug.triplets import TripletConfig, build_split, build_triplets
from diffusion_embedder.values import AT_LEAST_ONE, AT_LEAST_ZERO, Bounds, text_type

#: Exit status of a ``--batch`` stage that wrote its request files and waits for the uploaded batches' outputs.
EXIT_AWAITING_BATCH = 3
#: Exit status of a usage problem found before anything runs (no API key for a live stage, a bad threshold, a stage
#: run before the stage whose output it reads).
EXIT_USAGE = 2
#: Exit status of a stage some of whose requests got no answer (server unreachable, retries exhausted; with
#: ``--batch``, a downloaded file lacking them): the answers received are kept, and a live rerun sends only the rest.
EXIT_REQUESTS_FAILED = 4
TRAIN_FILE = "ReasonAug_train.jsonl.gz"
HELDOUT_FILE = "ReasonAug_heldout.jsonl.gz"


def _number(name: str, tp: type = int, bounds: Bounds | None = None):
    """argparse ``type=`` for a numeric flag: read as a config value would be, checked against ``bounds``."""
    return text_type(name, tp, bounds=bounds)


#: ``--heldout-fraction``: 0 (triplets: no split) up to, not including, 1.
FRACTION: Bounds = ((0, True), (1, False))


def _add_stage_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workdir", type=Path, required=True, help="folder for batch files and parsed JSONL")
    p.add_argument("--concepts", type=Path, default=Path("ReasonAug/concepts.jsonl"), help="the concept list (JSONL)")
    p.add_argument("--model", default=None, help="the LLM asked (default: $REASONAUG_MODEL or gpt-4o-mini)")
    p.add_argument("--rounds", type=_number("rounds", bounds=AT_LEAST_ONE), default=8,
                   help="problem/solution rounds per concept")
    p.add_argument("--seed", type=_number("seed"), default=0,
                   help="seeds each prompt's random choices and the triplets' sampling")
    p.add_argument("--max-regenerations", type=_number("max_regenerations", bounds=AT_LEAST_ZERO), default=2,
                   help="re-asks for a malformed answer")
    p.add_argument("--concurrency", type=_number("concurrency", bounds=AT_LEAST_ONE), default=None,
                   help="requests in flight at once (default: $REASONAUG_CONCURRENCY or 8)")
    p.add_argument(
        "--batch",
        action="store_true",
        help="do not call an endpoint: write the Batch-API input file and parse an output file placed next to it",
    )
    p.add_argument(
        "--allow-missing-definitions", "--allow_missing_definitions", action="store_true",
        help="build from the concepts that have a definition when the 'definitions' stage failed for some (they are "
             "listed and left out); without it such a partial set is refused",
    )


def _add_triplets_args(p: argparse.ArgumentParser) -> None:
    _add_stage_args(p)
    p.add_argument("--out", type=Path, required=True, help="output JSONL (.jsonl or .jsonl.gz)")
    p.add_argument("--heldout-fraction", type=_number("heldout_fraction", float, FRACTION), default=0.0,
                   help="> 0: also write _train/_heldout files")
    p.add_argument("--with-generated", action="store_true", help="append records of the 'negatives' stage")


def _add_rebuild_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--generation", type=Path, default=Path("ReasonAug/generation"),
                   help="folder of the upstream generation files (batch inputs and outputs)")
    p.add_argument("--concepts", type=Path, default=Path("ReasonAug/concepts.jsonl"), help="the concept list (JSONL)")
    p.add_argument("--out-dir", type=Path, default=Path("ReasonAug"),
                   help="where the train and held-out files, split.json and stats.json go")
    p.add_argument("--heldout-fraction", default=0.2, help="share of each domain's concepts held out",
                   type=_number("heldout_fraction", float, ((0, False), (1, False))))
    p.add_argument("--seed", type=_number("seed"), default=0,
                   help="seeds the triplets' sampling and the held-out split")
    p.add_argument("--card", type=Path, default=None, help="data card whose stats block is rewritten")
    p.add_argument("--full", type=Path, default=None, help="also write the all-concept set (one BM25 pool)")


def _add_contamination_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", type=Path, required=True, help="triplets JSONL to check")
    p.add_argument("--output", type=Path, required=True, help="the triplets kept (JSONL)")
    p.add_argument("--report", type=Path, required=True, help="JSON report of the queries removed")
    p.add_argument("--benchmark", type=Path, default=None, help=".jsonl ('query' field), .json list or .txt")
    p.add_argument("--bright", default=None, help="BRIGHT dataset name or local path, e.g. xlangai/BRIGHT")
    p.add_argument("--threshold", type=float, default=0.7,  # "nan" too: check_threshold refuses it by name
                   help="difflib similarity ratio at or above which a query counts as a duplicate")


def _add_prompts_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path("ReasonAug/prompts.md"), help="the card to write (markdown)")


def _client(args: argparse.Namespace) -> ChatClient | None:
    if args.batch:
        return None
    config = ClientConfig.from_env(model=args.model, concurrency=args.concurrency)
    if not config.api_key:
        raise UsageError(
            "no API key configured: set OPENAI_API_KEY (any value for a local endpoint that ignores it, "
            "with OPENAI_BASE_URL), or pass --batch to write Batch-API request files instead"
        )
    return ChatClient(config)


def _folder(path: Path | None, flag: str) -> None:
    """A folder the command writes into: refused, before anything is sent or written, if it (or one above) is a file."""
    problem = folder_problem(path, flag) if path is not None else None
    if problem:
        raise UsageError(problem)


def _output_file(path: Path | None, flag: str) -> None:
    """A file the command writes: refused if it is a folder or its folder cannot be made."""
    if path is not None and path.is_dir():
        raise UsageError(f"{flag} {path} is a folder, not a file; name a file.")
    _folder(None if path is None else path.parent, f"the folder of {flag}")


def _stage_config(args: argparse.Namespace) -> StageConfig:
    _folder(args.workdir, "--workdir")
    model = args.model or ClientConfig.from_env().model
    triplets = TripletConfig(seed=args.seed)
    return StageConfig(args.workdir, model, args.rounds, args.seed, args.max_regenerations, triplets,
                       args.allow_missing_definitions)


def _suffixed(path: Path, suffix: str) -> Path:
    name = path.name
    stem = name[: -len(".jsonl.gz")] if name.endswith(".jsonl.gz") else name.rsplit(".", 1)[0]
    ext = name[len(stem) :]
    return path.with_name(f"{stem}_{suffix}{ext}")


def _numbered(records: list[dict]) -> list[dict]:
    return [{**r, "id": str(i)} for i, r in enumerate(records, 1)]


def _failed_requests_message(report: StageReport, workdir: Path, batch: bool) -> str:
    rerun = "run it without --batch" if batch else "rerun the same command"
    return (
        f"{report.failed} request(s) of the '{report.stage}' stage got no answer; last error: {report.last_error}\n"
        f"the answers received so far are kept in {workdir}; {rerun} to send only the requests still unanswered"
    )


def _llm_stage(stage: Stage, args: argparse.Namespace) -> int:
    cfg, client = _stage_config(args), _client(args)
    report = run_stage(stage, load_concepts(args.concepts), cfg, client)
    print(json.dumps(report.as_dict(), indent=2))
    if report.failed:  # later stages need these answers: stop a script here, not on a missing file further on
        print(f"error: {_failed_requests_message(report, cfg.workdir, args.batch)}", file=sys.stderr)
        return EXIT_REQUESTS_FAILED
    return 0


def _triplets(args: argparse.Namespace) -> int:
    _output_file(args.out, "--out")
    cfg = _stage_config(args)
    concepts = load_concepts(args.concepts)
    data = load_concept_data(cfg, concepts)
    generated = []
    if args.with_generated:
        generated = read_stage_output(cfg, "negatives")
    records = _numbered(build_triplets(data, cfg.triplets) + generated)
    print(f"{write_jsonl(args.out, records)} records -> {args.out}")
    defined = {c.instance for c in data}
    missing = [c.instance for c in concepts if c.instance not in defined]
    if missing:  # the user allowed it (--allow-missing-definitions): the output says which concepts it lacks
        print(f"left out, no definition (--allow-missing-definitions): {', '.join(missing)}")
    if args.heldout_fraction > 0:
        train, heldout, _, held_names = build_split(data, cfg.triplets, args.heldout_fraction)
        held = set(held_names)
        train += [r for r in generated if r["instance"] not in held]
        heldout += [r for r in generated if r["instance"] in held]
        write_jsonl(_suffixed(args.out, "train"), _numbered(train))
        write_jsonl(_suffixed(args.out, "heldout"), _numbered(heldout))
        print(f"split: {len(train)} train / {len(heldout)} held-out records ({len(held_names)} held-out concepts)")
    return 0


def _rebuild(args: argparse.Namespace) -> int:
    _folder(args.out_dir, "--out-dir")
    _output_file(args.full, "--full")
    concepts = load_concepts(args.concepts)
    data, report = load_generation(args.generation, concepts)
    tconfig = TripletConfig(seed=args.seed)
    train, heldout, train_names, held_names = build_split(data, tconfig, args.heldout_fraction)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl(args.out_dir / TRAIN_FILE, train)
    write_jsonl(args.out_dir / HELDOUT_FILE, heldout)
    split = {
        "seed": args.seed,
        "heldout_fraction": args.heldout_fraction,
        "train": train_names,
        "heldout": held_names,
    }
    (args.out_dir / "split.json").write_text(json.dumps(split, indent=1, ensure_ascii=False) + "\n")
    stats = {
        "generation": {**report.__dict__, "rejected": dict(sorted(report.rejected.items()))},
        "train": dataset_stats(train),
        "heldout": dataset_stats(heldout),
    }
    (args.out_dir / "stats.json").write_text(json.dumps(stats, indent=1) + "\n")
    if args.card is not None:
        md = stats_markdown("train", stats["train"]) + "\n\n" + stats_markdown("held-out", stats["heldout"])
        update_card(args.card, md)
    if args.full is not None:
        write_jsonl(args.full, build_triplets([c for c in data if c.problems], tconfig))
    print(json.dumps({"train": len(train), "heldout": len(heldout), **stats["generation"]}, indent=1))
    return 0


def _contamination(args: argparse.Namespace) -> int:
    if (args.benchmark is None) == (args.bright is None):
        raise UsageError("give exactly one of --benchmark FILE or --bright NAME_OR_PATH")
    try:
        check_threshold(args.threshold)
    except ValueError as e:
        raise UsageError(f"--threshold: {e}") from None
    _output_file(args.output, "--output")
    _output_file(args.report, "--report")
    records = [r for _, r in read_jsonl(args.input, [Field("user_query")])]
    benchmark = load_benchmark_queries(args.benchmark) if args.benchmark else load_bright_queries(args.bright)
    kept, report = remove_contaminated(records, benchmark, args.threshold)
    write_jsonl(args.output, kept)
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(json.dumps(report.as_dict(), indent=1, ensure_ascii=False) + "\n")
    print(f"{len(records) - len(kept)} of {len(records)} records removed; report -> {args.report}")
    return 0


def _prompts(args: argparse.Namespace) -> int:
    _output_file(args.out, "--out")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render_prompt_card(), encoding="utf-8")
    print(f"prompt templates -> {args.out}")
    return 0


#: Errors in our own words, reported as their message alone (no traceback) with this exit status, as the training
#: commands' ``EXIT_STATUS``: a bad concepts or records file (file and line), a missing file, a stage run too early.
EXIT_STATUS: dict[type[Exception], int] = {
    UsageError: EXIT_USAGE,
    StageOutputMissing: EXIT_USAGE,
    DataFormatError: EXIT_USAGE,
    FileNotFoundError: EXIT_USAGE,
}


@dataclass(frozen=True)
class Command:
    help: str
    add_args: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]  # the exit status


#: Every subcommand, in ``--help`` order: the LLM stages from the pipeline's table, then the offline steps.
COMMANDS: dict[str, Command] = {
    **{
        name: Command(stage.help, _add_stage_args, functools.partial(_llm_stage, stage))
        for name, stage in STAGES.items()
    },
    "triplets": Command(
        "5. BM25 hard-negative triplets (and optional concept split) from a workdir", _add_triplets_args, _triplets
    ),
    "rebuild": Command("offline rebuild from the real upstream generation files", _add_rebuild_args, _rebuild),
    "contamination": Command(
        "remove queries that nearly duplicate benchmark queries", _add_contamination_args, _contamination
    ),
    "prompts": Command("write the prompt-template card", _add_prompts_args, _prompts),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=clihelp.prog("reasonaug"), description=__doc__, formatter_class=clihelp.HelpFormatter
    )
    sub = parser.add_subparsers(
        dest="command",
        required=True,
        parser_class=functools.partial(argparse.ArgumentParser, formatter_class=clihelp.HelpFormatter),
    )
    for name, command in COMMANDS.items():
        command.add_args(sub.add_parser(name, help=command.help))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("bm25s").setLevel(logging.WARNING)
    try:
        return COMMANDS[args.command].run(args)
    except AwaitingBatchOutputs as e:  # a normal stop, not an error
        print(f"{e}\nrerun the same command once the outputs are in place.", file=sys.stderr)
        return EXIT_AWAITING_BATCH
    except tuple(EXIT_STATUS) as e:
        print(f"error: {e}", file=sys.stderr)
        return clihelp.exit_status(e, EXIT_STATUS)
