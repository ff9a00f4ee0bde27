"""mteb 2.x evaluation: the encoder as an mteb model, benchmark tasks, local BEIR data, embedding cache,
results ledger, report.

Submodules import mteb lazily where they can, so ``report`` works without loading torch.
"""
