"""Supervised contrastive training: config validation, the Trainer (LoRA, GradCache), the torchrun entry."""

from diffusion_embedder.training.arguments import (
    ConfigError,
    CustomArguments,
    DataArguments,
    ModelArguments,
    TrainConfig,
    load_config,
    parse_args,
)

__all__ = [
    "ConfigError",
    "CustomArguments",
    "DataArguments",
    "ModelArguments",
    "TrainConfig",
    "load_config",
    "parse_args",
]
