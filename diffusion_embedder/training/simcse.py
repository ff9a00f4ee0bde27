"""Unsupervised SimCSE: ``torchrun --nproc_per_node=N experiments/run_simcse.py CONFIG.json [--key value ...]``.

A supervised run whose positive is the query's own text seen through different dropout: each text is
encoded twice (query and positive columns, separate forward passes, so separate dropout masks) and
``HardNegativeNLLLoss`` without hard negatives is the in-batch InfoNCE. ``simcse_dropout`` is the
backbone's attention dropout (upstream's ``simcse_dropout``, 0.3). It usually continues from a merged
MNTP folder (``model_name_or_path: MNTP_OUTPUT``) with a fresh LoRA; name the run folder with
"simcse" so a later supervised run continues its adapter (upstream's rule).
"""

from __future__ import annotations

from diffusion_embedder import clihelp
from diffusion_embedder.training.arguments import SUPERVISED, TrainConfig, read_config_values, validate
from diffusion_embedder.training.runner import run_cli
from diffusion_embedder.training.schema import ConfigError
from diffusion_embedder.training.supervised import train

USAGE = (
    f"{clihelp.config_usage('simcse')}\n"
    "CONFIG.json: the supervised fields plus simcse_dropout (train_configs/simcse/, train_configs/tiny/)."
)
#: What makes a supervised config a SimCSE one, unless the config says otherwise.
SIMCSE_DEFAULTS = {"dataset_name": "Wiki1M", "loss_class": "HardNegativeNLLLoss", "num_negatives": 0}


def check_simcse(cfg: TrainConfig, source: str) -> None:
    """The two views must differ (dropout) and the loss must be the in-batch InfoNCE."""
    problems = []
    if not cfg.custom.simcse_dropout:
        problems.append(
            f"simcse_dropout: must be > 0 (the two views differ only by dropout), got {cfg.custom.simcse_dropout}"
        )
    if cfg.custom.loss_class != "HardNegativeNLLLoss":
        problems.append(f"loss_class: SimCSE uses HardNegativeNLLLoss, got {cfg.custom.loss_class!r}")
    if problems:
        raise ConfigError(f"Invalid SimCSE {source}:\n  - " + "\n  - ".join(problems))


def start(argv: list[str]) -> None:
    values = {**SIMCSE_DEFAULTS, **read_config_values(argv[0], argv[1:])}
    cfg = validate(values, source=f"config {argv[0]}")
    check_simcse(cfg, f"config {argv[0]}")
    train(cfg)


def main(argv: list[str] | None = None) -> int:
    """Unsupervised SimCSE from a JSON config."""
    return run_cli(argv, USAGE, SUPERVISED, start)
