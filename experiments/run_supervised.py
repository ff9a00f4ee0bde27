"""Supervised contrastive training: ``torchrun --nproc_per_node=N experiments/run_supervised.py CONFIG.json``."""

import sys

from diffusion_embedder.training.stages import STAGES

if __name__ == "__main__":
    sys.exit(STAGES["supervised"].main(sys.argv[1:]))
