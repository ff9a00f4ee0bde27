"""``diffusion-embedder mine``: its command line and exit statuses (the work is ``mine.py``'s).

Every process (each torchrun rank, each job of an array) checks the inputs, loads the model and encodes its share
of both stores; then one (rank 0) searches, filters and writes, once both stores are complete. Bad input stops
the run before the model loads, with exit status 2 and the message alone.
"""

from __future__ import annotations

import argparse

from diffusion_embedder import clihelp, distributed
from diffusion_embedder.evaluation.options import EXIT_STATUS, command_parser
from diffusion_embedder.evaluation.store import OtherEmbeddings
from diffusion_embedder.mining.mine import finish, prepare
from diffusion_embedder.mining.options import MineArguments, MiningError, _MineOptions, check_options

#: ``mine``'s exit statuses (``clihelp.run_command``): 0 done, or this process's share encoded where other shards
#: are still to run; 2 the run could not start, the message alone: a flag (``evaluation/options.py``'s
#: ``EXIT_STATUS``), a rule between flags or a bad input line (``MiningError``, ``DataFormatError``), or an output
#: folder holding another model's, settings' or inputs' embeddings (``OtherEmbeddings``). Anything else is a bug,
#: with its traceback.
MINE_EXIT_STATUS: dict[type[Exception], int] = {**EXIT_STATUS, MiningError: 2, OtherEmbeddings: 2}


def build_parser() -> argparse.ArgumentParser:
    """The ``mine`` command line: one flag per ``_MineOptions`` field, then one per encoder setting."""
    return command_parser(
        "mine", "Mine hard negatives for (query, positive) pairs with the encoder: OUTPUT_DIR/negatives.jsonl in the "
                "custom training format. Documents and queries go through encode's resumable chunk store; "
                "--num_shards/--shard_index and torchrun's ranks share the encoding.", _MineOptions)


def parse_args(argv: list[str] | None = None) -> MineArguments:
    """``MineArguments`` from the command line (``argv``, else ``sys.argv``)."""
    return MineArguments(**vars(build_parser().parse_args(argv)))


def main(argv: list[str] | None = None) -> int:
    """CLI entry: every process encodes its share; rank 0 mines and prints the summary. Exit status:
    ``MINE_EXIT_STATUS``."""
    distributed.configure_logging()
    args = parse_args(argv)
    return clihelp.run_command(lambda: _run(args), MINE_EXIT_STATUS)


def _run(args) -> int:
    check_options(args)  # before any process starts waiting for the others
    distributed.init()
    try:
        prepared = prepare(args)
        distributed.barrier()  # every rank's chunks are written before rank 0 reads them
    finally:
        distributed.shutdown()
    if not distributed.is_main():
        return 0
    summary = finish(prepared)
    if summary.status == "incomplete":
        print(f"Encoded this process's share into {args.output_dir}; other shards still to run (or rerun with "
              "--num_shards 1 to finish), then the negatives are mined.")
        return 0
    print(f"{summary.path}: {summary.records_written} records {summary.status} ({summary.records_dropped} dropped "
          f"with fewer than {args.num_negatives} negatives); candidates dropped: "
          + ", ".join(f"{k} {v}" for k, v in summary.candidates_dropped.items()))
    return 0
