"""``diffusion-embedder <command> ...``: one entry point over the package's drivers."""

from __future__ import annotations

import sys
from importlib import import_module

from diffusion_embedder import __version__, clihelp
from diffusion_embedder.training.stages import STAGES

#: ``command -> (module with main(argv), help)``: the training stages from their registry, then the rest.
COMMANDS = {stage.command: (stage.module, stage.help) for stage in STAGES.values()} | {
    "eval": ("diffusion_embedder.evaluation.run", "evaluate on FollowIR, LongEmbed, BRIGHT or local BEIR folders"),
    "encode": ("diffusion_embedder.evaluation.encode_corpus", "a corpus's embeddings to disk: sharded, resumable"),
    "mine": ("diffusion_embedder.mining.cli", "hard negatives for (query, positive) pairs, mined with the encoder"),
    "report": ("diffusion_embedder.evaluation.report", "one results table (markdown, CSV) and bar charts"),
    "reasonaug": ("diffusion_embedder.reasonaug.cli", "build ReasonAug with an LLM, stage by stage, resumable"),
    "demo": ("diffusion_embedder.demo_launcher", "says how to run the demo (bidirectional vs causal) from a checkout"),
    "export": ("diffusion_embedder.export_cli", "write an encoder as a folder sentence-transformers (or we) load"),
}


def usage() -> str:
    lines = [f"usage: {clihelp.PROG} <command> [args...] | --version", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] == "--version":
        print(f"{clihelp.PROG} {__version__}")
        return 0
    if argv[0] not in COMMANDS:
        print(f"unknown command {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = import_module(COMMANDS[argv[0]][0])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
