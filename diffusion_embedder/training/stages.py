"""The training stages, one registry: each name maps to the module whose ``main(argv)`` runs it.

LLM2Vec's recipe in order: ``mntp`` (or masked-diffusion / causal-LM adaptation, same entry), then
optionally ``simcse``, then ``supervised`` contrastive training. Adding a stage is one entry here; the
CLI's commands (``diffusion-embedder <command>``) and ``experiments/run_<stage>.py`` read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module


@dataclass(frozen=True)
class Stage:
    module: str
    help: str
    command: str  # its ``diffusion-embedder`` command

    def main(self, argv: list[str] | None = None) -> int:
        return int(import_module(self.module).main(argv) or 0)


STAGES: dict[str, Stage] = {
    "supervised": Stage(
        "diffusion_embedder.training.supervised",
        "contrastive LoRA training from a JSON config (torchrun for >1 GPU)",
        command="train",
    ),
    "mntp": Stage(
        "diffusion_embedder.training.lm", "MNTP, masked-diffusion (mdm) or causal-LM (clm) adaptation", command="mntp"
    ),
    "simcse": Stage(
        "diffusion_embedder.training.simcse",
        "unsupervised SimCSE (two dropout views, in-batch InfoNCE)",
        command="simcse",
    ),
}
