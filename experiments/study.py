"""``python experiments/study.py --output_dir runs/study``: diffusion vs autoregressive pretraining, as embedders."""

from diffusion_embedder.study import main

if __name__ == "__main__":
    raise SystemExit(main())
