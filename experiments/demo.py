"""Train and evaluate a bidirectional and a causal encoder on this machine (``make demo``).

    python experiments/demo.py --output_dir runs/demo

The logic lives in ``diffusion_embedder.demo``.
"""

from diffusion_embedder.demo import main

if __name__ == "__main__":
    raise SystemExit(main())
