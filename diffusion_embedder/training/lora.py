"""Making a loaded model trainable, for every stage: LoRA from the shared ``LoraArguments`` (or an
earlier adapter continued) and the trainable-parameter count in the log (checkpointing: ``checkpointing.py``)."""

from __future__ import annotations

import logging

from torch import nn

from diffusion_embedder.training.arguments import LoraArguments
from diffusion_embedder.training.schema import ConfigError

logger = logging.getLogger(__name__)


def check_targets(model: nn.Module, targets: list[str]) -> None:
    """Every ``lora_target_modules`` entry must name a Linear layer of ``model``, matched as peft matches a
    name (the module's full name, or its end after a dot); peft drops an entry that matches nothing as
    long as another entry matches, so a misspelt target would train without its LoRA."""
    linear = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    unmatched = [t for t in targets if not any(name == t or name.endswith(f".{t}") for name in linear)]
    if unmatched:
        leaves = sorted({name.rsplit(".", 1)[-1] for name in linear})
        base = getattr(getattr(model, "config", None), "name_or_path", "") or type(model).__name__
        raise ConfigError(
            f"lora_target_modules: {', '.join(map(repr, unmatched))} match(es) no Linear layer of {base}; "
            f"its Linear layers are named {', '.join(leaves)}. Correct lora_target_modules (given: {targets})."
        )


def add_lora(model: nn.Module, args: LoraArguments) -> nn.Module:
    """``model`` wrapped with a fresh LoRA (upstream's: no bias, no task type, ``lora_alpha`` 2r unless given)."""
    from peft import LoraConfig, get_peft_model

    check_targets(model, list(args.lora_target_modules))
    lora = LoraConfig(
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=list(args.lora_target_modules),
        bias="none",
        task_type=None,
    )
    return get_peft_model(model, lora)


def continue_adapter(model: nn.Module) -> None:
    """Train a loaded peft adapter further (no new LoRA): its LoRA tensors trainable, nothing else."""
    for name, param in model.named_parameters():
        param.requires_grad = "lora_" in name
    for config in model.peft_config.values():
        config.inference_mode = False


def log_trainable(model: nn.Module) -> None:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    logger.info("Trainable parameters: %d of %d (%.3f%%)", trainable, total, 100 * trainable / max(total, 1))
