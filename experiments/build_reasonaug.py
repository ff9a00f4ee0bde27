"""Build a ReasonAug-style set end to end: every stage in order, each resumable (rerun after a crash).

    # offline: rebuild the shipped split from the real upstream generation files
    python experiments/build_reasonaug.py --rebuild

    # new set with an OpenAI-compatible endpoint (OPENAI_BASE_URL, OPENAI_API_KEY, REASONAUG_MODEL)
    python experiments/build_reasonaug.py --concepts my_concepts.jsonl --workdir runs/ra --rounds 8 \
        --heldout-fraction 0.2 --benchmark bench_queries.jsonl

The logic lives in ``diffusion_embedder.reasonaug`` (``python -m diffusion_embedder.reasonaug --help``). The
first step that does not finish stops the build with that step's own message and exit status (3: waiting for
Batch-API outputs; 4: requests that got no answer, e.g. the server is unreachable; rerun the same command).
"""

import argparse
from pathlib import Path

from diffusion_embedder.reasonaug.cli import FRACTION
from diffusion_embedder.reasonaug.cli import main as reasonaug
from diffusion_embedder.reasonaug.pipeline import STAGES
from diffusion_embedder.values import AT_LEAST_ONE, text_type


def _run(argv: list[str]) -> None:
    """One step; a step that did not finish has printed why, and the later steps need its output."""
    status = reasonaug(argv)
    if status:
        raise SystemExit(status)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rebuild", action="store_true", help="offline rebuild of ReasonAug/ (no LLM)")
    p.add_argument("--concepts", default="ReasonAug/concepts.jsonl")
    p.add_argument("--workdir", type=Path, default=Path("runs/reasonaug"))
    p.add_argument("--rounds", type=text_type("rounds", int, bounds=AT_LEAST_ONE), default=8)
    p.add_argument("--seed", type=text_type("seed", int), default=0)
    p.add_argument("--heldout-fraction", type=text_type("heldout_fraction", float, bounds=FRACTION), default=0.2)
    p.add_argument("--generated-negatives", action="store_true", help="also run the LLM-written negatives stage")
    p.add_argument("--benchmark", default=None, help="benchmark queries for the contamination check")
    p.add_argument("--batch", action="store_true", help="Batch-API mode: write inputs, parse downloaded outputs")
    p.add_argument("--allow-missing-definitions", action="store_true",
                   help="build without the concepts the 'definitions' stage found no definition for (listed)")
    args = p.parse_args(argv)

    if args.rebuild:
        raise SystemExit(reasonaug(["rebuild", "--card", "ReasonAug/README.md"]))

    common = ["--workdir", str(args.workdir), "--concepts", args.concepts, "--rounds", str(args.rounds)]
    common += ["--seed", str(args.seed)] + (["--batch"] if args.batch else [])
    common += ["--allow-missing-definitions"] if args.allow_missing_definitions else []
    for stage in STAGES:
        if stage == "negatives" and not args.generated_negatives:
            continue
        _run([stage, *common])
    out = args.workdir / "ReasonAug.jsonl"
    extra = ["--with-generated"] if args.generated_negatives else []
    _run(["triplets", *common, "--out", str(out), "--heldout-fraction", str(args.heldout_fraction), *extra])
    if args.benchmark:
        split = ["ReasonAug_train", "ReasonAug_heldout"] if args.heldout_fraction > 0 else []
        for name in ["ReasonAug", *split]:  # the files ``triplets`` wrote
            src = args.workdir / f"{name}.jsonl"
            _run(
                [
                    "contamination",
                    "--input",
                    str(src),
                    "--output",
                    str(args.workdir / f"{name}.clean.jsonl"),
                    "--report",
                    str(args.workdir / f"{name}.contamination.json"),
                    "--benchmark",
                    args.benchmark,
                ]
            )


if __name__ == "__main__":
    main()
