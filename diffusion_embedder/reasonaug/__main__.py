import sys

from diffusion_embedder.reasonaug.cli import main

sys.exit(main())
