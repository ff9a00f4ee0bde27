"""``torchrun --nproc_per_node=N experiments/run_mntp.py CONFIG.json [--key value ...]``."""

import sys

from diffusion_embedder.training.stages import STAGES

if __name__ == "__main__":
    sys.exit(STAGES["mntp"].main(sys.argv[1:]))
