"""Write a corpus's embeddings to disk (chunk files with their ids), resumable, sharded over processes.

    python experiments/encode_corpus.py --base_model_name_or_path BASE --peft_model_name_or_path ADAPTER \
        --corpus data/beir_folder/corpus.jsonl --output_dir embeddings/my_corpus --batch_size 64
    torchrun --nproc_per_node 8 experiments/encode_corpus.py ...   # every rank its share

Logic: diffusion_embedder.evaluation.encode_corpus (see docs/evaluation.md).
"""

import sys

from diffusion_embedder.evaluation.encode_corpus import main

if __name__ == "__main__":
    sys.exit(main())
