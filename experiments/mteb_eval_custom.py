"""Evaluate a checkpoint on FollowIR, LongEmbed, BRIGHT (mteb 2.x) or local BEIR folders.

    python experiments/mteb_eval_custom.py --base_model_name_or_path BASE --peft_model_name_or_path ADAPTER \
        --task_name News21InstructionRetrieval --output_dir results --batch_size 128

Logic: diffusion_embedder.evaluation.run (see docs/evaluation.md).
"""

import sys

from diffusion_embedder.evaluation.run import main

if __name__ == "__main__":
    sys.exit(main())
