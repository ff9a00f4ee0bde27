"""``diffusion-embedder demo``: runs the demo of the source checkout this package is imported from, or says where the
demo lives.

The demo is an experiment, not library code: it trains with the checkout's ``experiments/`` scripts on
``train_configs/demo/`` and the shipped ``ReasonAug/`` data, none of which an installed package carries.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

NOT_A_CHECKOUT = """\
diffusion-embedder demo runs from a source checkout: it trains with the checkout's experiments/ scripts on
train_configs/demo/ and the shipped ReasonAug/ data, which an installed package does not carry (this one is
{package}). Clone the diffusion_embedder repository and run, in it:

    make demo        # or: python experiments/demo.py --output_dir runs/demo
"""


def source_checkout() -> Path | None:
    """The source checkout this package is imported from, or None for an installed package."""
    root = Path(__file__).resolve().parents[1]
    if (root / "experiments" / "demo.py").is_file() and (root / "train_configs" / "demo").is_dir():
        return root
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    root = source_checkout()
    if root is None:
        print(NOT_A_CHECKOUT.format(package=Path(__file__).resolve().parent), file=sys.stderr)
        return 1
    # The checkout goes first on the child's path, so the demo runs this very copy of the package (found here perhaps
    # through the working directory, as ``python -m`` finds it); the child's output is copied to sys.stdout, so it
    # shows wherever the caller's output goes (a notebook, a captured test).
    path = [str(root), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path), PYTHONUNBUFFERED="1")
    command = [sys.executable, str(root / "experiments" / "demo.py"), *argv]
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env) as child:
        for line in child.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
    return child.returncode
