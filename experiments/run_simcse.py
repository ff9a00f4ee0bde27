"""``torchrun --nproc_per_node=N experiments/run_simcse.py CONFIG.json [--key value ...]``."""

import sys

from diffusion_embedder.training.stages import STAGES

if __name__ == "__main__":
    sys.exit(STAGES["simcse"].main(sys.argv[1:]))
