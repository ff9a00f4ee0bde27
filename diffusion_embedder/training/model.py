"""The trainable encoder: the backbone loaded with the training-time settings, LoRA on top."""

from __future__ import annotations

import logging
import os

import torch

from diffusion_embedder.encoder import Encoder

logger = logging.getLogger(__name__)


def prepare_encoder(model_args, custom, training_args) -> Encoder:
    """Load the encoder and make it trainable: a fresh LoRA (after merging an earlier adapter such as
    MNTP), or, when the adapter's name contains "simcse", that adapter continued (upstream's rule).
    """
    from peft import LoraConfig, get_peft_model

    def located(name: str | None) -> str | None:
        """Local folders are recorded absolute, so a checkpoint loads from any working directory."""
        return os.path.abspath(name) if name is not None and os.path.isdir(name) else name

    peft_path = located(model_args.peft_model_name_or_path)
    continue_adapter = peft_path is not None and "simcse" in peft_path.lower()
    encoder = Encoder.from_pretrained(
        located(model_args.model_name_or_path),
        peft_model_name_or_path=peft_path,
        merge_peft=not continue_adapter,
        torch_dtype=model_args.torch_dtype,
        attn_implementation=model_args.attn_implementation,
        device=training_args.device,
        **model_args.encoder_settings(),
        **({"attention_dropout": custom.simcse_dropout} if custom.simcse_dropout is not None else {}),
    )
    if continue_adapter:
        for name, param in encoder.model.named_parameters():
            param.requires_grad = "lora_" in name
        for config in encoder.model.peft_config.values():
            config.inference_mode = False
        logger.info("Continuing the adapter %s (no new LoRA).", peft_path)
    else:
        lora = LoraConfig(
            r=custom.lora_r,
            lora_alpha=custom.lora_alpha,
            lora_dropout=custom.lora_dropout,
            target_modules=list(custom.lora_target_modules),
            bias="none",
            task_type=None,
        )
        encoder.model = get_peft_model(encoder.model, lora)
    # The Trainer would call this on the Encoder, which has no such method: it is done here.
    enable_checkpointing(encoder.model, training_args)
    trainable = sum(p.numel() for p in encoder.parameters() if p.requires_grad)
    total = sum(p.numel() for p in encoder.parameters())
    logger.info("Trainable parameters: %d of %d (%.3f%%)", trainable, total, 100 * trainable / max(total, 1))
    return encoder


def enable_checkpointing(model: torch.nn.Module, training_args) -> None:
    """Turn on activation checkpointing on ``model`` if the arguments ask for it, then clear the flag.

    transformers 5.23 names it ``activation_checkpointing``; 5.17 (on the GPU machines) only knows
    ``gradient_checkpointing``: both spellings are read, and the model's own method is used.
    """
    enabled = getattr(training_args, "activation_checkpointing", None) or training_args.gradient_checkpointing
    if not enabled:
        return
    user = (getattr(training_args, "activation_checkpointing_kwargs", None)
            or getattr(training_args, "gradient_checkpointing_kwargs", None) or {})
    kwargs = {"use_reentrant": False, **user}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    training_args.gradient_checkpointing = False
    if hasattr(training_args, "activation_checkpointing"):
        training_args.activation_checkpointing = False
