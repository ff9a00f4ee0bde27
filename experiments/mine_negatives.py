"""Mine hard negatives for (query, positive) pairs with the encoder itself, into the custom training format.

    python experiments/mine_negatives.py --base_model_name_or_path BASE --pairs pairs.jsonl \
        --corpus corpus.jsonl --output_dir mined --num_negatives 3
    torchrun --nproc_per_node 8 experiments/mine_negatives.py ...   # every rank encodes its share

Logic: diffusion_embedder.mining (see docs/mining.md).
"""

import sys

from diffusion_embedder.mining.cli import main

if __name__ == "__main__":
    sys.exit(main())
