"""``Encoder.from_pretrained``'s work: where the weights, adapters and tokenizer are, which settings apply, loading.

The encoder class is passed in (``cls``), so this module never imports ``encoder``. The load plan is made
from a checkpoint's small files only, so settings and the tokenizer are checked before any weight is read.
"""

from __future__ import annotations

import difflib
import inspect
import os
from dataclasses import dataclass

import torch
from safetensors.torch import load_file
from torch import nn

from diffusion_embedder import backbones
from diffusion_embedder.config import (
    ENCODER_CONFIG,
    LLM2VEC_CONFIG,
    LLM2VEC_KEYS,
    POOLING_WEIGHTS,
    SETTING_NAMES,
    check_values,
    read_settings,
    resolve_config,
)
from diffusion_embedder.devices import check_device
from diffusion_embedder.dtypes import resolve_dtype
from diffusion_embedder.files import HUB_KWARGS, find_file, hub_kwargs_of, read_optional_json_object
from diffusion_embedder.pooling import LatentAttentionPooling
from diffusion_embedder.templates import eos_suffix_for, known_settings, left_padded

#: Keywords transformers 5's ``PreTrainedModel.from_pretrained`` reads from ``**kwargs`` (its named parameters
#: are read from its signature); with config fields and ``load_backbone``'s own, all a backbone keyword may be.
TRANSFORMERS_LOAD_KWARGS = frozenset(
    {
        "state_dict", "proxies", "output_loading_info", "dtype", "torch_dtype", "device_map", "max_memory",
        "offload_folder", "offload_buffers", "quantization_config", "subfolder", "variant", "adapter_kwargs",
        "adapter_name", "generation_config", "gguf_file", "distributed_config", "device_mesh", "tp_plan", "tp_size",
        "trust_remote_code", "allow_all_kernels", "use_kernels", "kernel_config", "low_cpu_mem_usage",
        "experts_implementation",
    }
)


@dataclass(frozen=True)
class _LoadPlan:
    """What to load for a checkpoint name, read from its small files only (no weights)."""

    weights_from: str
    tokenizer_from: str
    #: Names that select LLM2Vec's known settings (the name given, the config's ``_name_or_path``, the base).
    names: list[str | None]
    base_model_name_or_path: str
    model_type: str
    merges: tuple[str, ...]
    own_adapter: str | None


def from_pretrained(
    cls: type[nn.Module],
    base_model_name_or_path: str,
    peft_model_name_or_path: str | None,
    merge_peft: bool,
    explicit: dict,
    torch_dtype: torch.dtype | str | None,
    attn_implementation: str | None,
    device: str | torch.device | None,
    kwargs: dict,
) -> nn.Module:
    """An instance of ``cls`` (the Encoder) for a checkpoint; see ``Encoder.from_pretrained`` for the layers.

    ``explicit`` holds the setting arguments (None: not given); ``kwargs`` naming another setting join them,
    the rest go to the backbone's ``from_pretrained``.
    """
    kwargs = dict(kwargs)
    hub_kwargs = hub_kwargs_of(kwargs)
    explicit = {**explicit, **{name: kwargs.pop(name) for name in SETTING_NAMES if name in kwargs}}
    check_values({k: v for k, v in explicit.items() if v is not None}, "encoder settings")  # before any file is read
    resolve_dtype(torch_dtype)
    check_attn_implementation(attn_implementation)
    if device is not None:
        check_device(device)
    if peft_model_name_or_path is not None:
        _check_adapter(peft_model_name_or_path, hub_kwargs)
    settings_dir = peft_model_name_or_path or base_model_name_or_path
    saved = read_settings(find_file(settings_dir, ENCODER_CONFIG, **hub_kwargs))
    llm2vec = read_settings(find_file(settings_dir, LLM2VEC_CONFIG, **hub_kwargs), LLM2VEC_KEYS)
    keep_own_adapter = peft_model_name_or_path is None and not merge_peft
    plan = _plan_load(base_model_name_or_path, saved, keep_own_adapter, hub_kwargs)
    _check_backbone_kwargs(cls, plan, kwargs, hub_kwargs)
    # An encoder folder already holds the settings known for its checkpoint, resolved when it was made.
    config = resolve_config(llm2vec, saved, {} if saved else known_settings(plan.names), explicit)
    merged = list(plan.merges)
    if peft_model_name_or_path is not None and merge_peft:
        merged.append(peft_model_name_or_path)
    config = config.replace(
        base_model_name_or_path=plan.base_model_name_or_path, model_type=plan.model_type, merged_adapters=merged
    )

    backbone_kwargs = dict(
        kwargs,
        enable_bidirectional=config.enable_bidirectional,
        torch_dtype=torch_dtype,
        attn_implementation=attn_implementation,
    )
    spec = backbones.get_spec(config.model_type)
    tokenizer = backbones.load_tokenizer(plan.tokenizer_from, spec, **hub_kwargs)  # a missing one fails first
    model = _load_model(plan, backbone_kwargs)

    if peft_model_name_or_path is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, peft_model_name_or_path, **hub_kwargs)
        if merge_peft:
            model = model.merge_and_unload()

    if config.eos_suffix is None and config.pooling_mode == "eos_token":
        config = config.replace(eos_suffix=eos_suffix_for(plan.names, spec.eos_format, tokenizer.eos_token))

    latent = None
    latent_path = find_file(settings_dir, POOLING_WEIGHTS, **hub_kwargs)
    if config.pooling_mode == "latent_attention" and latent_path is not None:
        latent = LatentAttentionPooling(model.config.hidden_size, config.latent_num_latents, config.latent_num_heads)
        latent.load_state_dict(load_file(latent_path))

    encoder = cls(model, left_padded(tokenizer, owned=True), config=config, latent=latent)
    if "device_map" not in kwargs:
        encoder.to(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return encoder


def check_attn_implementation(value) -> None:
    """Refuse an attention implementation transformers does not know, listing those it does, before any load."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if value is None:
        return
    valid = ["eager", *ALL_ATTENTION_FUNCTIONS.valid_keys()]
    if isinstance(value, str) and (value.removeprefix("paged|") in valid or "/" in value):  # "/": a hub kernel
        return
    close = difflib.get_close_matches(str(value), valid, n=1)
    raise ValueError(
        f"Unknown attn_implementation {value!r}; choose one of {', '.join(valid)}, or a hub kernel 'org/repo'"
        + (f" (did you mean {close[0]!r}?)" if close else "")
        + "."
    )


def _check_adapter(path: str, hub_kwargs: dict) -> None:
    if find_file(path, "adapter_config.json", **hub_kwargs) is None:
        where = (
            "that folder has no adapter_config.json"
            if os.path.isdir(path)
            else "no such folder, and no reachable hub repo of that name holds an adapter_config.json"
        )
        raise FileNotFoundError(f"peft_model_name_or_path={path!r} is not a PEFT adapter: {where}.")


def _check_backbone_kwargs(cls: type[nn.Module], plan: _LoadPlan, kwargs: dict, hub_kwargs: dict) -> None:
    """Refuse a keyword that is no encoder setting, transformers loading option or backbone config field, before
    the weights load (transformers would fail late, naming its model class's ``__init__``)."""
    if not kwargs:
        return
    from transformers import PreTrainedModel

    config, _ = backbones.load_config(plan.weights_from, **hub_kwargs)
    known = (
        set(inspect.signature(PreTrainedModel.from_pretrained).parameters)
        | set(inspect.signature(backbones.load_backbone).parameters)
        | TRANSFORMERS_LOAD_KWARGS
        | set(HUB_KWARGS)
    )
    for name, value in kwargs.items():
        if name in known or hasattr(config, name):
            continue
        choices = sorted(known | set(SETTING_NAMES) | set(inspect.signature(cls.from_pretrained).parameters))
        close = difflib.get_close_matches(name, choices + sorted(config.to_dict()), n=1)
        raise TypeError(
            f"from_pretrained() got an unknown keyword argument {name}={value!r}: not an encoder setting, not an "
            f"option of transformers' from_pretrained, not a field of the {plan.model_type} config"
            + (f"; did you mean {close[0]!r}?" if close else ".")
        )


def _place(name: str) -> str:
    """Where an adapter is, however its name is spelled: a local folder's real path (relative, through a link), or
    the hub name as given. An adapter recorded as merged is never merged again under another spelling."""
    return os.path.realpath(name) if os.path.isdir(name) else name


def _plan_load(base: str, saved: dict, keep_own_adapter: bool, hub_kwargs: dict) -> _LoadPlan:
    """Where the weights, adapters and tokenizer of ``base`` are.

    ``base`` may be a plain checkpoint, an LLM2Vec folder whose adapter sits beside a config naming its
    base (merged, as LLM2Vec does), or one of our encoder folders holding only an adapter (its base
    and earlier merges are recorded in ``saved``; the adapter stays a trainable PEFT model when
    ``keep_own_adapter``). Nothing heavy is read, so settings and the tokenizer are checked before the weights.
    """
    has_weights = any(find_file(base, f, **hub_kwargs) for f in ("model.safetensors", "model.safetensors.index.json"))
    own_adapter = read_optional_json_object(find_file(base, "adapter_config.json", **hub_kwargs))
    is_encoder_folder = bool(saved)
    if has_weights:
        weights_from = base
    elif own_adapter:
        weights_from = saved.get("base_model_name_or_path") or own_adapter["base_model_name_or_path"]
    else:
        raise FileNotFoundError(
            f"No model found at {base!r}: expected model.safetensors (or its index) or a PEFT adapter "
            "(adapter_config.json), in a local folder or a reachable hub repo. Only safetensors weights are loaded."
        )
    names = [base, weights_from]
    if find_file(base, "config.json", **hub_kwargs):
        names.insert(1, backbones.read_config_dict(base, **hub_kwargs).get("_name_or_path"))
    # an encoder folder keeps its original base as provenance
    provenance = saved.get("base_model_name_or_path") if is_encoder_folder else None
    model_type = saved.get("model_type") or backbones.get_spec(
        backbones.read_config_dict(weights_from, **hub_kwargs).get("model_type", "<missing>")
    ).model_type
    merges: list[str] = []
    for merged in saved.get("merged_adapters", []):  # in merge order, each adapter once however it is spelled
        if _place(merged) not in {_place(m) for m in merges}:
            merges.append(merged)
    keep_own = bool(own_adapter) and is_encoder_folder and keep_own_adapter
    if own_adapter and not keep_own and _place(base) not in {_place(m) for m in merges}:
        merges.append(base)
    return _LoadPlan(
        weights_from=weights_from,
        tokenizer_from=base if find_file(base, "tokenizer_config.json", **hub_kwargs) else weights_from,
        names=names,
        base_model_name_or_path=provenance or weights_from,
        model_type=model_type,
        merges=tuple(merges),
        own_adapter=base if keep_own else None,
    )


def _load_model(plan: _LoadPlan, backbone_kwargs: dict) -> nn.Module:
    """Load the base weights and merge the adapters that belong under them, in order."""
    hub_kwargs = hub_kwargs_of(backbone_kwargs)
    model = backbones.load_backbone(plan.weights_from, **backbone_kwargs)
    if plan.merges or plan.own_adapter:
        from peft import PeftModel

        for adapter in plan.merges:
            model = PeftModel.from_pretrained(model, adapter, **hub_kwargs).merge_and_unload()
        if plan.own_adapter:
            model = PeftModel.from_pretrained(model, plan.own_adapter, **hub_kwargs)
    return model
