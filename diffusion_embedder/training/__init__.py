"""Training, every stage (``stages.py``): supervised contrastive (``supervised.py``), SimCSE (``simcse.py``)
and the LM stages MNTP / MDM / CLM (``lm.py``), sharing one config validator (``schema.py``), the argument
groups (``arguments.py``), LoRA (``lora.py``), FSDP2 for the full-weight LM stages (``fsdp.py``), the run
lifecycle (``runner.py``) and the Trainer hooks (``trainer.py``, ``checkpoints.py``, ``grad_cache.py``)."""

from diffusion_embedder.training.arguments import (
    CustomArguments,
    DataArguments,
    LoraArguments,
    ModelArguments,
    RunArguments,
    TrainConfig,
    load_config,
    parse_args,
)
from diffusion_embedder.training.schema import ConfigError

__all__ = [
    "ConfigError",
    "CustomArguments",
    "DataArguments",
    "LoraArguments",
    "ModelArguments",
    "RunArguments",
    "TrainConfig",
    "load_config",
    "parse_args",
]
