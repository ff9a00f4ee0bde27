"""FSDP2 for the full-weight LM stages (``full_training: true``): which sharding a config may ask for, turning it
on where the Trainer leaves it off (CPU), and checking, once the Trainer has wrapped the model, that it is sharded.

The fields are the Trainer's own: ``fsdp`` (``true``, or transformers' words ``full_shard`` / ``shard_grad_op`` /
``auto_wrap``) and ``fsdp_config`` (``version: 2``, ``reshard_after_forward``, ``activation_checkpointing``,
``state_dict_type``, ``auto_wrap_policy``, ``transformer_layer_cls_to_wrap``, ``min_num_params``). accelerate's
FSDP2 plugin does the work: ``fully_shard`` on each decoder layer and on the root, DTensor parameters, the
optimizer built over the shards, checkpoints through ``torch.distributed.checkpoint`` or gathered on rank 0.

Why CPU needs a step of ours: accelerate (1.15, ``AcceleratorState``) turns the Trainer's FSDP plugin into
``DistributedType.FSDP`` only for GPU-like devices; under ``MULTI_CPU`` (gloo) it drops the plugin without a word
and the Trainer wraps the model in DDP. ``enable`` sets the state the GPU path sets, so the same accelerate code
shards under gloo (that is how the CPU tests exercise it).

Whatever cannot be honoured stops the run naming the field and the value: ``config_problems`` with the rest of the
config, ``check_sharded`` right after the Trainer wrapped the model. Nothing falls back to DDP.
"""

from __future__ import annotations

import difflib
import logging
import os
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback

from diffusion_embedder.files import read_json_object
from diffusion_embedder.training.schema import ConfigError, is_set

logger = logging.getLogger(__name__)

#: ``fsdp`` words (transformers' legacy spelling) that FSDP2 honours; the others are FSDP1's or offload.
FSDP_WORDS = ("full_shard", "shard_grad_op", "auto_wrap")
#: ``fsdp_config`` keys we honour (transformers strips a leading ``fsdp_``): the allowed values, the type, or the
#: types (a tuple of types).
FSDP_CONFIG_KEYS: dict[str, tuple | type] = {
    "version": (2,),
    "reshard_after_forward": bool,
    "activation_checkpointing": bool,
    "state_dict_type": ("FULL_STATE_DICT", "SHARDED_STATE_DICT"),
    "auto_wrap_policy": ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"),
    "transformer_layer_cls_to_wrap": (str, list),
    "min_num_params": int,
}
_FSDP1 = "an FSDP1 setting (we run FSDP2 only, fsdp_config.version 2)"
_OFFLOAD = (
    "CPU offload is not supported: it is untested here (no GPU in the test suite), and the sharded parameters "
    "and optimizer state already divide the memory by the number of ranks"
)
#: ``fsdp_config`` keys (and ``fsdp`` words) refused when set: why.
REFUSED = {
    "cpu_offload": _OFFLOAD,
    "offload": _OFFLOAD,
    "cpu_ram_efficient_loading": "the stage loads the weights on every rank before sharding; rank-0-only loading "
    "is not supported",
    "xla": "XLA (TPU) FSDP is not supported",
    "xla_fsdp_v2": "XLA (TPU) FSDP is not supported",
    "xla_fsdp_settings": "XLA (TPU) FSDP is not supported",
    "xla_fsdp_grad_ckpt": "XLA (TPU) FSDP is not supported",
    "forward_prefetch": _FSDP1,
    "backward_prefetch": _FSDP1,
    "use_orig_params": _FSDP1,
    "sync_module_states": _FSDP1,
    "limit_all_gathers": _FSDP1,
    "hybrid_shard": _FSDP1,
    "hybrid_shard_zero2": _FSDP1,
    "no_shard": _FSDP1 + "; without sharding, drop fsdp: torchrun alone trains with DDP",
}
GRAD_CACHE_RULE = (
    "GradCache under FSDP is refused: GradCache runs two forward passes per chunk and reduces the gradients once "
    "per step, which sharded training does not reproduce exactly (peer tools compute or reduce gradients twice: "
    "sentence-transformers #3173, Tevatron #206); with DDP it is proven exact"
)


class ShardingError(ConfigError):
    """A sharding the config asked for that this run cannot honour; the message names the field and the value."""


def requested(values: dict[str, Any]) -> bool:
    """Whether a config asks for FSDP (``fsdp`` true or a non-empty word list)."""
    return is_set(values.get("fsdp"))


def fsdp_config_of(values: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``fsdp_config`` as a dict with transformers' key spelling (no ``fsdp_`` prefix); a path is read."""
    raw = values.get("fsdp_config")
    if raw is None:
        return {}, []
    if isinstance(raw, str):
        try:
            raw = read_json_object(raw, ConfigError)
        except ConfigError as err:
            return {}, [f"fsdp_config: {err}"]
    if not isinstance(raw, dict):
        return {}, []  # its type is reported with the other fields
    return {(k[5:] if k.startswith("fsdp_") else k): v for k, v in raw.items()}, []


def _value_problem(key: str, value: Any) -> str | None:
    allowed = FSDP_CONFIG_KEYS[key]
    if key == "version" and value != 2:
        return f"fsdp_config.version: {value!r} is not supported; FSDP2 (version 2) is the one we run"
    if isinstance(allowed, type):
        ok = isinstance(value, allowed) and (allowed is bool or not isinstance(value, bool))
        return None if ok else f"fsdp_config.{key}: {value!r} is not of type {allowed.__name__}"
    if all(isinstance(a, type) for a in allowed):
        return None if isinstance(value, allowed) else f"fsdp_config.{key}: {value!r} is a layer class name or a list"
    return None if value in allowed else f"fsdp_config.{key}: {value!r} is not one of {list(allowed)}"


def config_problems(values: dict[str, Any]) -> list[str]:
    """What of ``fsdp`` / ``fsdp_config`` cannot be honoured by any stage, each naming the field and the value."""
    config, errors = fsdp_config_of(values)
    if not requested(values):
        if config:
            errors.append(
                "fsdp_config is given but fsdp is not set, so nothing would be sharded: add \"fsdp\": true "
                "(or remove fsdp_config)"
            )
        return errors
    fsdp = values["fsdp"]
    words = fsdp.split() if isinstance(fsdp, str) else []
    for word in words:
        if word in REFUSED:
            errors.append(f"fsdp: {word!r} is not supported ({REFUSED[word]})")
        elif word not in FSDP_WORDS:
            errors.append(f"fsdp: {word!r} is not one of true, {', '.join(FSDP_WORDS)}")
    for key, value in config.items():
        if key in REFUSED:
            if value not in (False, None):
                errors.append(f"fsdp_config.{key}: {value!r} is not supported ({REFUSED[key]})")
        elif key not in FSDP_CONFIG_KEYS:
            close = difflib.get_close_matches(key, [*FSDP_CONFIG_KEYS, *REFUSED], n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            errors.append(f"fsdp_config: unknown key {key!r}{hint} (transformers would ignore it)")
        else:
            errors += [p for p in [_value_problem(key, value)] if p]
    return errors


def lm_stage_rules(values: dict[str, Any]) -> list[str]:
    """The LM stages shard only the full-weight run (a LoRA over a frozen base fits one GPU per process: DDP), and
    only over several processes."""
    errors = config_problems(values)
    if not requested(values):
        return errors
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        errors.append(
            f"fsdp: {values['fsdp']!r} shards over torchrun's processes, and this is one process: launch with "
            "torchrun --nproc_per_node N (N >= 2, or several nodes), or drop fsdp"
        )
    if not values.get("full_training"):
        errors.append(
            f"fsdp: {values['fsdp']!r} needs full_training: true (the LM stage shards only a full-weight run; "
            "its LoRA fits one GPU per process and trains with DDP: drop fsdp)"
        )
    for name in ("activation_checkpointing", "gradient_checkpointing"):
        if values.get(name):
            errors.append(
                f"{name}: under fsdp, set fsdp_config.activation_checkpointing: true instead (FSDP's own, per "
                "decoder layer; the training argument's adds an all-gather to every backward)"
            )
    return errors


#: Why the supervised and SimCSE stages refuse ``fsdp`` and ``fsdp_config`` (their ``StageSchema.refused``): a LoRA
#: over a frozen base fits one GPU per process (7B in bf16 is about 15 GiB) and trains with DDP.
LORA_STAGE_REFUSAL = (
    "it trains a LoRA over a frozen base, which fits one GPU per process: torchrun alone trains it with DDP; FSDP is "
    "for the LM stages with full_training: true"
)


def lora_stage_rules(values: dict[str, Any]) -> list[str]:
    """The supervised and SimCSE stages refuse ``fsdp`` and ``fsdp_config`` (their ``refused``); GradCache under FSDP
    is named too, as it is refused for its own reason."""
    if requested(values) and values.get("grad_cache_chunk_size"):
        return [f"grad_cache_chunk_size with fsdp: {GRAD_CACHE_RULE}"]
    return []


# ---------------------------------------------------------------------------------------------- at run time
def enable(trainer: Any) -> None:
    """After the Trainer built its ``Accelerator``: make the FSDP2 plugin the one in force, or stop.

    On CPU accelerate has dropped the plugin (module docstring): the state the GPU path sets is set here.
    """
    plugin_args = trainer.args.fsdp_plugin_args
    if not plugin_args:
        return
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = trainer.accelerator.state
    if getattr(state, "fsdp_plugin", None) is None:
        if state.distributed_type != DistributedType.MULTI_CPU:
            raise ShardingError(
                f"fsdp: {trainer.args.fsdp!r} was asked for, but accelerate set up {state.distributed_type.value} "
                "without FSDP; this launch cannot shard (launch with torchrun, one process per GPU)"
            )
        plugin = FullyShardedDataParallelPlugin(**plugin_args)
        if state.mixed_precision != "no":
            plugin.set_mixed_precision(state.mixed_precision)
        state.fsdp_plugin = plugin
        state.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        trainer.is_fsdp_enabled = True
    if not trainer.accelerator.is_fsdp2:
        raise ShardingError(f"fsdp_config.version: FSDP{state.fsdp_plugin.fsdp_version} is in force; FSDP2 is required")


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded (DTensor) parameter or state; a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def check_sharded(model: nn.Module, optimizer: torch.optim.Optimizer | None, plugin: Any, world_size: int) -> str:
    """Raise ``ShardingError`` unless ``model`` is what the config asked for: every parameter a DTensor sharded
    over all ``world_size`` ranks, the optimizer built over those shards, each decoder layer its own unit (the
    transformer-based wrap), and the layers checkpointed if ``activation_checkpointing`` asked. Returns a summary."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Shard

    params = dict(model.named_parameters())
    plain = [n for n, p in params.items() if not isinstance(p, DTensor)]
    if plain:
        raise ShardingError(
            f"fsdp: asked for, but after the Trainer wrapped the model ({type(model).__name__}) {len(plain)} of "
            f"{len(params)} parameters are not sharded ({', '.join(plain[:3])}); nothing was trained"
        )
    spread = [n for n, p in params.items() if p.device_mesh.size() != world_size or not all(
        isinstance(placement, Shard) for placement in p.placements)]
    if spread:
        raise ShardingError(f"fsdp: {', '.join(spread[:3])} are not sharded over all {world_size} ranks")
    trained = {id(p) for p in params.values() if p.requires_grad}
    if optimizer is not None and {id(p) for g in optimizer.param_groups for p in g["params"]} != trained:
        raise ShardingError("fsdp: the optimizer does not hold the sharded parameters; nothing would be trained")
    units = sum(isinstance(m, FSDPModule) for m in model.modules())
    policy = str(getattr(plugin, "auto_wrap_policy", ""))
    if "transformer_auto_wrap_policy" in policy and units < 2:
        raise ShardingError(
            "fsdp_config.auto_wrap_policy: TRANSFORMER_BASED_WRAP wrapped no decoder layer of the model; name its "
            "layer class in fsdp_config.transformer_layer_cls_to_wrap"
        )
    checkpointed = sum(isinstance(m, CheckpointWrapper) for m in model.modules())
    if getattr(plugin, "activation_checkpointing", False) and not checkpointed:
        raise ShardingError(
            "fsdp_config.activation_checkpointing: true, but no layer was wrapped for checkpointing (name the "
            "decoder layer class in fsdp_config.transformer_layer_cls_to_wrap)"
        )
    dropout = any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules())
    if checkpointed and (dropout or getattr(getattr(model, "config", None), "attention_dropout", 0)):
        raise ShardingError(
            "fsdp_config.activation_checkpointing: accelerate's FSDP2 checkpointing does not replay the random "
            "state, so dropout would differ between a layer's forward and its recompute; set the model's dropout "
            "to 0 or drop activation_checkpointing"
        )
    held = sum(local(p).numel() for p in params.values())
    total = sum(p.numel() for p in params.values())
    return (
        f"FSDP2: {len(params)} parameters sharded over {world_size} ranks in {units} units "
        f"({checkpointed} checkpointed layers); this rank holds {held} of {total} elements"
    )


class ShardingCheck(TrainerCallback):
    """``check_sharded`` at the start of training: after the Trainer wrapped the model, before any step."""

    def __init__(self, trainer: Any):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        plugin = getattr(self.trainer.accelerator.state, "fsdp_plugin", None)
        wrapped = self.trainer.model_wrapped  # the model itself under FSDP2; a DDP wrapper says so by its name
        logger.info("%s", check_sharded(wrapped, optimizer, plugin, args.world_size))


def checkpoint_layout(trainer: Any) -> str | None:
    """How a checkpoint holds the model and optimizer state (``checkpoints.SHARDED_LAYOUTS``); None: unsharded."""
    if not getattr(trainer, "is_fsdp_enabled", False):
        return None
    kind = trainer.accelerator.state.fsdp_plugin.state_dict_type
    return f"fsdp2/{getattr(kind, 'name', kind)}"
