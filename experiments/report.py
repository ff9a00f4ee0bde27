"""One table (markdown + CSV) and bar charts per benchmark from evaluation results, models side by side.

    python experiments/report.py results_dream results_llm2vec --out_dir report

Logic: diffusion_embedder.evaluation.report.
"""

import sys

from diffusion_embedder.evaluation.report import main

if __name__ == "__main__":
    sys.exit(main())
