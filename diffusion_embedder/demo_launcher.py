"""``diffusion-embedder demo``: says where the demo lives and how to run it.

The demo is an experiment, not library code: it trains with a source checkout's ``experiments/`` scripts on
``train_configs/demo/`` and the shipped ``ReasonAug/`` data, none of which an installed package carries, and the
package never runs ``experiments/`` itself. From a checkout the message names the exact command.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

NOT_A_CHECKOUT = """\
The demo runs from a source checkout, not from the installed package ({package}): it trains with the checkout's
experiments/ scripts on train_configs/demo/ and the shipped ReasonAug/ data. Clone the diffusion_embedder repository
and run, in it:

    make demo        # or: python experiments/demo.py --output_dir runs/demo
"""
IN_A_CHECKOUT = """\
The demo is an experiment of this checkout ({root}), not a library command. Run:

    make demo        # or: python {script} {args}
"""


def source_checkout() -> Path | None:
    """The source checkout this package is imported from, or None for an installed package (read when called)."""
    root = Path(__file__).resolve().parents[1]
    if (root / "experiments" / "demo.py").is_file() and (root / "train_configs" / "demo").is_dir():
        return root
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    root = source_checkout()
    if root is None:
        print(NOT_A_CHECKOUT.format(package=Path(__file__).resolve().parent), file=sys.stderr)
    else:
        args = shlex.join(argv) or "--output_dir runs/demo"
        print(IN_A_CHECKOUT.format(root=root, script=root / "experiments" / "demo.py", args=args), file=sys.stderr)
    return 1
