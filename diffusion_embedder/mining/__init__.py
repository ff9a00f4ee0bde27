"""Hard negatives mined with the encoder itself (``diffusion-embedder mine``): see ``mine.py``."""

from diffusion_embedder.mining.mine import MiningSummary, mine_hard_negatives
from diffusion_embedder.mining.options import MiningError

__all__ = ["MiningError", "MiningSummary", "mine_hard_negatives"]
