"""Activation checkpointing on only as many decoder layers as memory needs.

``activation_checkpointing`` (``gradient_checkpointing`` on transformers 5.17) takes ``true`` (every decoder
layer, as before), ``false``, a number of layers (the first N are checkpointed), or ``"auto"``: the fewest layers
whose predicted peak fits the device. Checkpointing a layer costs its forward again in the backward; keeping it costs
its saved tensors, so a step that fits without checkpointing every layer should not pay for every layer.

The prediction (``MemoryModel``) adds the weights, the trainable tensors with their gradients and AdamW moments,
the tensors autograd saves per token in each kept layer (``layer_bytes_per_token``: counted from what a Llama-type
layer with peft LoRA saves, checked against ``saved_tensors_hooks`` on CPU and ``max_memory_allocated`` on a GPU,
tests/test_checkpointing.py and tests/test_gpu.py), one hidden state per token for each checkpointed layer, one
layer's working set for the backward, and the LM head's logits where the stage has one. Attention is counted as
the memory-efficient kernels keep it (sdpa, flash, varlen: linear in the tokens); ``eager`` keeps the score matrices,
which the model does not count, so ``"auto"`` refuses it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
from torch import nn

from diffusion_embedder.compilation import decoder_layers
from diffusion_embedder.training.schema import ConfigError

logger = logging.getLogger(__name__)

AUTO = "auto"
#: Share of the device memory the prediction may fill (the caching allocator's fragmentation, kernels' workspaces).
HEADROOM = 0.9
#: Which tensor each LoRA projection reads: projections reading the same one share its saved copy when nothing casts
#: or drops it. The width is the input's: ``hidden``, ``attention`` (heads x head_dim) or ``intermediate``.
LORA_INPUTS = {
    "q_proj": ("attention input", "hidden"),
    "k_proj": ("attention input", "hidden"),
    "v_proj": ("attention input", "hidden"),
    "o_proj": ("attention output", "attention"),
    "gate_proj": ("mlp input", "hidden"),
    "up_proj": ("mlp input", "hidden"),
    "down_proj": ("mlp activation", "intermediate"),
}
#: Inputs some other operation already keeps (o_proj reads the attention output, which attention saves).
KEPT_ANYWAY = {"attention output"}


@dataclass(frozen=True)
class LayerShape:
    """A decoder layer's sizes, from the model config."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    vocab: int

    @classmethod
    def of(cls, config) -> LayerShape:
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(config.hidden_size, config.intermediate_size, heads,
                   getattr(config, "num_key_value_heads", None) or heads, head_dim, config.num_hidden_layers,
                   config.vocab_size)  # fmt: skip

    def width(self, name: str) -> int:
        return {"hidden": self.hidden, "attention": self.heads * self.head_dim, "intermediate": self.intermediate}[name]


@dataclass(frozen=True)
class LoraPlan:
    """What the adapter adds to a layer's saved tensors."""

    targets: tuple[str, ...]
    r: int
    dropout: float
    own_copies: bool  # each projection keeps its own input: dropout, or a cast to the adapter's dtype


def layer_bytes_per_token(shape: LayerShape, act: int, lora: LoraPlan | None, mask: int) -> int:
    """Bytes autograd keeps per token for one decoder layer (frozen base weights, ``act`` bytes per activation,
    ``mask`` bytes per dropout mask element: a bool on CUDA, an activation on CPU)."""
    h, i = shape.hidden, shape.intermediate
    norms = 2 * (4 * h + 4)  # each RMSNorm keeps its float32 input and the reciprocal root
    attention = (2 * shape.heads * shape.head_dim + 2 * shape.kv_heads * shape.head_dim) * act + 4 * shape.heads
    mlp = 3 * i * act  # gate, SiLU(gate), up
    total = norms + attention + mlp
    if lora is None:
        return total
    shared: set[str] = set()
    for target in lora.targets:
        source, width = LORA_INPUTS[target]
        total += lora.r * act  # lora_A's output, for lora_B's gradient
        if lora.own_copies:
            total += shape.width(width) * (act + (mask if lora.dropout > 0 else 0))
        elif source not in KEPT_ANYWAY and source not in shared:
            shared.add(source)
            total += shape.width(width) * act
    return total


@dataclass(frozen=True)
class MemoryModel:
    """The predicted peak of a training step, in bytes, as a function of the layers checkpointed."""

    shape: LayerShape
    tokens: int  # tokens whose graph is alive at once (a GradCache chunk, or the whole micro-batch)
    act: int
    weights: int
    trainable: int  # trainable tensors, their gradients and AdamW's two float32 moments
    per_layer: int  # layer_bytes_per_token
    head_per_token: int = 0  # an LM head's logits and the loss's float32 copies

    def saved(self, checkpointed: int) -> int:
        """What the forward leaves for the backward: kept layers' tensors, checkpointed layers' inputs, the rotary
        cos and sin (shared by the layers), the final norm's."""
        kept = self.shape.layers - checkpointed
        shared = 2 * self.shape.head_dim * self.act + 4 * self.shape.hidden + 4
        per_token = kept * self.per_layer + checkpointed * self.shape.hidden * self.act + shared
        return per_token * self.tokens

    def peak(self, checkpointed: int) -> int:
        working = self.per_layer * self.tokens  # one layer recomputed, or its gradients, during the backward
        return self.weights + self.trainable + self.saved(checkpointed) + working + self.head_per_token * self.tokens

    def fewest_layers(self, budget: int) -> int | None:
        """The fewest layers to checkpoint for the peak to fit ``budget``; None if none fits."""
        return next((k for k in range(self.shape.layers + 1) if self.peak(k) <= budget), None)


def device_budget(device: torch.device) -> tuple[int, str]:
    """``HEADROOM`` of the device's memory, and how it was read (for the log)."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        where = f"{torch.cuda.get_device_name(device)} ({device})"
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        where = f"{device.type} RAM"
    return int(total * HEADROOM), f"{HEADROOM:.0%} of {total / 2**30:.1f} GiB on {where}"


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def memory_model(model: nn.Module, tokens: int, act: int, head_per_token: int = 0) -> MemoryModel:
    """The prediction for ``model`` (its LoRA read from its peft config, if any) at ``tokens`` per graph."""
    config = getattr(model, "config", None)
    shape = LayerShape.of(config)
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    device = params[0].device
    lora = None
    for cfg in (getattr(model, "peft_config", None) or {}).values():
        targets = tuple(t for t in LORA_INPUTS if t in set(cfg.target_modules or ()))
        adapter_dtype = next((p.dtype for n, p in model.named_parameters() if "lora_" in n), None)
        casts = adapter_dtype is not None and adapter_dtype.itemsize != act
        lora = LoraPlan(targets, cfg.r, cfg.lora_dropout, own_copies=cfg.lora_dropout > 0 or casts)
    mask = 1 if device.type == "cuda" else act
    state = _bytes(trainable) * 2 + 8 * sum(p.numel() for p in trainable)  # the tensors, their gradients, AdamW's
    return MemoryModel(shape, tokens, act, _bytes(params), state, layer_bytes_per_token(shape, act, lora, mask),
                       head_per_token)  # fmt: skip


def checkpoint_first(model: nn.Module, count: int, kwargs: dict) -> int:
    """Checkpoint the first ``count`` decoder layers (the model's own checkpointing, then the rest turned off);
    returns how many are checkpointed."""
    if count == 0:
        return 0
    kwargs = {"use_reentrant": False, **kwargs}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    layers = decoder_layers(model)
    for index, layer in enumerate(layers):
        layer.gradient_checkpointing = index < count
    return sum(layer.gradient_checkpointing for layer in layers)


def activation_bytes(training_args, model: nn.Module) -> int:
    """Bytes per activation: 2 under bf16/fp16 (autocast or half weights), else 4."""
    half = training_args.bf16 or training_args.fp16
    return 2 if half or next(model.parameters()).dtype in (torch.bfloat16, torch.float16) else 4


def setting(training_args) -> tuple[str, bool | int | str, dict]:
    """The field as installed (``activation_checkpointing`` on 5.2x, ``gradient_checkpointing`` on 5.17), its
    value and the checkpoint function's keyword arguments."""
    new = hasattr(training_args, "activation_checkpointing")
    name = "activation_checkpointing" if new else "gradient_checkpointing"
    user = (getattr(training_args, "activation_checkpointing_kwargs", None)
            or getattr(training_args, "gradient_checkpointing_kwargs", None) or {})  # fmt: skip
    return name, getattr(training_args, name), dict(user)


def layers_to_checkpoint(
    name: str, value: bool | int | str, model: nn.Module, training_args, tokens: int | None, head_per_token: int = 0
) -> int:
    """How many decoder layers ``value`` asks for on ``model``; ``"auto"`` asks the memory model (its choice
    logged). A count beyond the model's layers, or no count that fits, stops the run naming the field."""
    layers = len(decoder_layers(model))
    if value is True or value is False:
        return layers if value else 0
    if isinstance(value, int):
        if value > layers:
            raise ConfigError(f"{name}: {value} layers asked, but the model has {layers} decoder layers")
        return value
    attention = getattr(model.config, "_attn_implementation", None)
    if attention == "eager":
        raise ConfigError(f"{name}: 'auto' counts attention as the memory-efficient kernels keep it; with "
                          "attn_implementation 'eager' give a number of layers (or true)")  # fmt: skip
    if tokens is None:
        raise ConfigError(f"{name}: 'auto' needs the tokens per step, which this stage does not give")
    predicted = memory_model(model, tokens, activation_bytes(training_args, model), head_per_token)
    budget, where = device_budget(next(model.parameters()).device)
    count = predicted.fewest_layers(budget)
    if count is None:
        raise ConfigError(
            f"{name}: 'auto': even with all {layers} decoder layers checkpointed the step's predicted peak, "
            f"{predicted.peak(layers) / 2**30:.1f} GiB for {tokens} tokens, exceeds the device budget ({where}). "
            "Lower per_device_train_batch_size or the lengths, or set grad_cache_chunk_size"
        )
    logger.info("%s 'auto': checkpointing %d of %d decoder layers; predicted peak %.2f GiB for %d tokens "
                "(%.2f GiB with none, %.2f GiB with all); device budget %.2f GiB (%s).", name, count, layers,
                predicted.peak(count) / 2**30, tokens, predicted.peak(0) / 2**30, predicted.peak(layers) / 2**30,
                budget / 2**30, where)  # fmt: skip
    return count


def enable_checkpointing(model: nn.Module, training_args, tokens: int | None = None, head_per_token: int = 0) -> int:
    """Checkpoint the decoder layers the setting asks for on ``model`` (the backbone, or the LM), then clear the
    flag (the Trainer would call it on the outer model, which may have no such method). Returns the count."""
    name, value, kwargs = setting(training_args)
    count = layers_to_checkpoint(name, value, model, training_args, tokens, head_per_token)
    checked = checkpoint_first(model, count, kwargs)
    training_args.gradient_checkpointing = False
    if hasattr(training_args, "activation_checkpointing"):
        training_args.activation_checkpointing = False
    return checked
