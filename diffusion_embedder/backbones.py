"""Backbones: one table of supported model types, one bidirectional switch, one self-test.

Bidirectional attention is transformers' own ``config.is_causal = False`` (transformers >= 5.2), set on
the config object after loading. We never subclass private attention classes, so a transformers release
that renames them can't silently turn an encoder causal again; the load-time self-test catches any
path that still would.

Dream is Qwen2 with bidirectional attention: its ``config.json`` is read as JSON and mapped onto a
``Qwen2Config`` (keeping ``mask_token_id``), so no remote code is ever run. LLaDA (OLMo-style remote
code) is Llama with bidirectional attention: its config is mapped field by field onto a ``LlamaConfig``
and its weights are renamed at load; settings Llama cannot express are refused, never dropped. The
mappings are ``release_configs.py``'s; a config.json whose sizes the weights contradict is refused here.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Tokenizer,
)
from transformers.utils import cached_file

from diffusion_embedder import varlen  # registers attn_implementation="varlen" with transformers
from diffusion_embedder.dtypes import resolve_dtype
from diffusion_embedder.files import find_file, hub_kwargs_of, read_json_object
from diffusion_embedder.release_configs import LLADA_KEY_MAPPING, BackboneConfigError, dream_config, llada_config
from diffusion_embedder.values import checked

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BackboneSpec:
    """What differs between backbones, as data rather than code."""

    model_type: str
    #: How LLM2Vec appends the EOS string for ``eos_token`` pooling; ``{eos}`` is the tokenizer's EOS.
    eos_format: str = "{eos}"
    #: Builds the transformers config from the raw config.json of a remote-code release; None = AutoConfig.
    map_config: Callable[[dict], PretrainedConfig] | None = None
    #: Regex renames of the checkpoint's weight names onto the transformers classes (``key_mapping``).
    key_mapping: dict[str, str] = field(default_factory=dict)
    #: Tokenizer class that reads the release without remote code; None = AutoTokenizer.
    tokenizer_class: type | None = None


BACKBONES: dict[str, BackboneSpec] = {
    spec.model_type: spec
    for spec in (
        BackboneSpec("llama", eos_format=" {eos}"),
        BackboneSpec("mistral", eos_format=" {eos}"),
        BackboneSpec("qwen2"),
        BackboneSpec("qwen3"),
        BackboneSpec("gemma"),
        BackboneSpec("gemma2"),
        # Dream runs on transformers' Qwen2 classes, LLaDA on Llama's (its weights renamed by key_mapping).
        BackboneSpec("Dream", map_config=dream_config, tokenizer_class=Qwen2Tokenizer),
        BackboneSpec(
            "llada",
            map_config=llada_config,
            key_mapping=LLADA_KEY_MAPPING,
            tokenizer_class=PreTrainedTokenizerFast,
        ),
    )
}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(BACKBONES)


#: A tokenizer needs one of these file sets: a fast tokenizer, byte-level BPE (Qwen/Dream), or sentencepiece.
TOKENIZER_FILE_SETS = (("tokenizer.json",), ("vocab.json", "merges.txt"), ("tokenizer.model",))


class AttentionSelfTestError(RuntimeError):
    """The model's attention is not what was asked for (bidirectional vs causal)."""


def read_config_dict(name_or_path: str, **hub_kwargs) -> dict:
    """config.json as plain JSON: safe for remote-code checkpoints (Dream), local folder or hub name."""
    if os.path.isdir(name_or_path):
        path = os.path.join(name_or_path, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"No config.json in {name_or_path!r}: a checkpoint folder needs one.")
    else:  # the hub's own error says why (not found, gated, offline)
        path = cached_file(name_or_path, "config.json", **hub_kwargs)
    return read_json_object(path)


def check_tokenizer_files(name_or_path: str, **hub_kwargs) -> None:
    """Refuse a folder without tokenizer files (some tokenizer classes would load an empty vocabulary silently)."""
    for names in TOKENIZER_FILE_SETS:
        if all(find_file(name_or_path, name, **hub_kwargs) for name in names):
            return
    expected = " or ".join("+".join(names) for names in TOKENIZER_FILE_SETS)
    raise FileNotFoundError(f"No tokenizer files in {name_or_path!r}: expected {expected}.")


def check_safetensors(name_or_path: str, **hub_kwargs) -> None:
    """Open every weights file's header: a truncated or corrupted file is an OSError naming it."""
    index = find_file(name_or_path, "model.safetensors.index.json", **hub_kwargs)
    names = ["model.safetensors"]
    if index is not None:
        names = sorted(set(read_json_object(index).get("weight_map", {}).values()))
    for name in names:
        path = find_file(name_or_path, name, **hub_kwargs)
        if path is None:
            raise FileNotFoundError(f"Weights file {name} is missing from {name_or_path!r}.")
        try:
            with safe_open(path, framework="pt"):
                pass
        except SafetensorError as e:
            raise OSError(f"{path} is truncated or corrupted ({e}); re-download or re-save it.") from None


def get_spec(model_type: str) -> BackboneSpec:
    try:
        return BACKBONES[model_type]
    except KeyError:
        raise ValueError(
            f"Unsupported model type {model_type!r}. Supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}."
        ) from None


def load_config(name_or_path: str, **hub_kwargs) -> tuple[PretrainedConfig, BackboneSpec]:
    """The transformers config for a checkpoint and its table entry; Dream and LLaDA are mapped from JSON."""
    raw = read_config_dict(name_or_path, **hub_kwargs)
    spec = get_spec(raw.get("model_type", "<missing model_type>"))
    if spec.map_config is not None:
        config = spec.map_config(raw)
        config.name_or_path = name_or_path
    else:
        config = AutoConfig.from_pretrained(name_or_path, **hub_kwargs)
    return config, spec


def load_tokenizer(name_or_path: str, spec: BackboneSpec | None = None, **hub_kwargs):
    """The checkpoint's tokenizer, read by a built-in class for remote-code releases (Dream: Qwen2's; LLaDA:
    ``PreTrainedTokenizerFast``). LLaDA's tokenizer names no mask token: it is set from config.json's id.
    """
    raw = None
    if spec is None:
        raw = read_config_dict(name_or_path, **hub_kwargs)
        spec = get_spec(raw.get("model_type", "<missing>"))
    check_tokenizer_files(name_or_path, **hub_kwargs)
    if spec.tokenizer_class is None:
        return AutoTokenizer.from_pretrained(name_or_path, **hub_kwargs)
    tokenizer = spec.tokenizer_class.from_pretrained(name_or_path, **hub_kwargs)
    if tokenizer.mask_token is None:
        try:
            raw = raw or read_config_dict(name_or_path, **hub_kwargs)
        except OSError:  # an adapter folder: no config.json, and its saved tokenizer already names the mask
            raw = {}
        if raw.get("mask_token_id") is not None:
            tokenizer.mask_token = tokenizer.convert_ids_to_tokens(raw["mask_token_id"])
    return tokenizer


def set_bidirectional(model: PreTrainedModel, enable: bool) -> None:
    """Flip transformers' own causal switch on the config and, belt and braces, on each attention module."""
    model.config.is_causal = not enable
    model.config.use_cache = False
    for module in model.modules():
        if hasattr(module, "is_causal") and isinstance(module.is_causal, bool) and module is not model:
            module.is_causal = not enable


def check_attention(model: PreTrainedModel, expect_bidirectional: bool) -> None:
    """Prove the attention is what was asked for, on the attention implementation in use.

    Changing the last token must change the first position's output when attention is bidirectional
    and must leave it untouched when causal. Silent causality was LLM2Vec's worst failure mode.
    """
    vocab = model.config.vocab_size
    ids = torch.tensor([[(7 * i + 11) % vocab for i in range(6)]], device=model.device)
    changed = ids.clone()
    changed[0, -1] = (int(ids[0, -1]) + 1) % vocab
    was_training = model.training
    model.eval()
    with torch.no_grad():
        first = model(input_ids=ids, use_cache=False).last_hidden_state[0, 0].float()
        second = model(input_ids=changed, use_cache=False).last_hidden_state[0, 0].float()
    model.train(was_training)
    delta = ((first - second).abs().max() / first.abs().max().clamp_min(1e-12)).item()
    tolerance = 1e-5 if first.dtype == torch.float32 and model.dtype == torch.float32 else 1e-3
    is_bidirectional = delta > tolerance
    if is_bidirectional != expect_bidirectional:
        impl = model.config._attn_implementation
        raise AttentionSelfTestError(
            f"Attention self-test failed for {type(model).__name__} with attn_implementation={impl!r}: "
            f"asked for {'bidirectional' if expect_bidirectional else 'causal'} attention but the first "
            f"position {'ignores' if expect_bidirectional else 'sees'} the last token (relative change {delta:.2e}). "
            "This transformers version or attention implementation does not honour config.is_causal; "
            "try attn_implementation='sdpa' or 'eager', or transformers >= 5.2."
        )
    logger.debug("Attention self-test passed (%s, relative change %.2e)", model.config._attn_implementation, delta)


#: The config sizes that give a weight its shape (transformers' names), by a part of the weight's name.
_SHAPE_FIELDS = (
    (r"embed_tokens|lm_head", ("vocab_size", "hidden_size")),
    (r"[kv]_proj", ("num_key_value_heads", "num_attention_heads", "hidden_size")),
    (r"[qo]_proj", ("num_attention_heads", "hidden_size")),
    (r"gate_proj|up_proj|down_proj", ("intermediate_size", "hidden_size")),
)
#: Their names in LLaDA's config.json.
_LLADA_FIELDS = {
    "vocab_size": "embedding_size",
    "hidden_size": "d_model",
    "num_attention_heads": "n_heads",
    "num_key_value_heads": "n_kv_heads",
    "intermediate_size": "mlp_hidden_size",
}


def _mismatch_message(name_or_path: str, spec: BackboneSpec, config: PretrainedConfig, mismatched) -> str:
    """A weight whose shape config.json's sizes contradict, named with both shapes and the fields that set it."""
    rows = sorted((key, tuple(saved), tuple(built)) for key, saved, built in mismatched)
    key, saved, built = rows[0]
    fields = next((f for pattern, f in _SHAPE_FIELDS if re.search(pattern, key)), ("hidden_size",))
    names = _LLADA_FIELDS if spec.model_type == "llada" else {}
    sizes = ", ".join(f"{names.get(f, f)} = {getattr(config, f, None)}" for f in fields)
    more = f" ({len(rows) - 1} more weight(s) differ too)" if len(rows) > 1 else ""
    defaults = ", LLaDA's defaults for keys it leaves out" if names else ""
    return (
        f"config.json of {name_or_path!r} does not match its weights: {key} has shape {list(saved)} in the "
        f"weights, but config.json's sizes ({sizes}{defaults}) give it {list(built)}{more}. Correct config.json, "
        "or load the weights it was written for."
    )


#: Weights of a causal-LM checkpoint that the encoder trunk leaves out (the LM head), by name.
LM_HEAD_KEY = re.compile(r"(^|\.)lm_head\.")


class _DropLoadReport(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in str(record.msg)


@contextlib.contextmanager
def _own_load_report():
    """Silence transformers' load table (it lists the LM head we drop on purpose); ``load_backbone`` reports
    what matters from the loading info itself: missing tensors refuse the load, other unused ones warn."""
    target = logging.getLogger("transformers.modeling_utils")
    report_filter = _DropLoadReport()
    target.addFilter(report_filter)
    try:
        yield
    finally:
        target.removeFilter(report_filter)


@checked
def load_backbone(
    name_or_path: str,
    enable_bidirectional: bool = True,
    torch_dtype: torch.dtype | str | None = None,
    attn_implementation: str | None = None,
    device_map: str | dict | None = None,
    lm_head: bool = False,
    **kwargs: Any,
) -> PreTrainedModel:
    """Load a supported decoder as an encoder trunk whose forward returns ``last_hidden_state``
    (with ``lm_head``: the ``*ForCausalLM`` model, whose forward returns logits; the LM stages).

    ``torch_dtype=None`` loads float32 (predictable on CPU); pass ``torch.bfloat16`` or ``"auto"`` on GPU.

    Args:
        name_or_path: A hub name or folder of a supported model type.
        enable_bidirectional: Set ``config.is_causal = False`` (checked by the attention self-test).
        torch_dtype: As for ``Encoder.from_pretrained``.
        attn_implementation: transformers' attention kernel; None: its default for the model type.
        device_map: accelerate's device map, passed to ``from_pretrained``.
        lm_head: Load the ``*ForCausalLM`` model (the LM stages).
        **kwargs: Passed to ``from_pretrained`` (``revision``, ``token``, ``attention_dropout``, ...).

    Returns:
        The transformers model itself.

    Raises:
        FileNotFoundError: A folder without ``config.json`` or a weights file its index names.
        ValueError: A model type outside the supported table (the error lists those it holds).
        AttentionSelfTestError: The loaded model does not attend as asked.
    """
    if kwargs.get("trust_remote_code"):
        raise ValueError("trust_remote_code is never used: every supported backbone runs on transformers' own code.")
    dtype = resolve_dtype(torch_dtype)
    hub_kwargs = hub_kwargs_of(kwargs)
    config, spec = load_config(name_or_path, **hub_kwargs)
    check_safetensors(name_or_path, **hub_kwargs)
    config_overrides = {k: kwargs.pop(k) for k in list(kwargs) if hasattr(config, k) and k not in hub_kwargs}
    for key, value in config_overrides.items():
        setattr(config, key, value)
    if attn_implementation == varlen.NAME and varlen.config_problem(config):
        raise ValueError(f"attn_implementation='varlen' cannot load {name_or_path!r}: {varlen.config_problem(config)}.")
    config.is_causal = not enable_bidirectional
    config.use_cache = False
    load_kwargs = dict(kwargs, config=config, dtype=dtype)
    if attn_implementation is not None:
        load_kwargs["attn_implementation"] = attn_implementation
    if device_map is not None:
        load_kwargs["device_map"] = device_map
    if spec.key_mapping:  # renames the LM head too (LLaDA's transformer.ff_out -> lm_head)
        load_kwargs["key_mapping"] = spec.key_mapping
    load_kwargs["ignore_mismatched_sizes"] = True  # reported below in our words, then refused
    auto = AutoModelForCausalLM if lm_head else AutoModel
    with _own_load_report():
        model, info = auto.from_pretrained(name_or_path, use_safetensors=True, output_loading_info=True, **load_kwargs)
    if info["mismatched_keys"]:
        raise BackboneConfigError(_mismatch_message(name_or_path, spec, config, info["mismatched_keys"]))
    unexpected = sorted(k for k in info["unexpected_keys"] if lm_head or not LM_HEAD_KEY.search(k))
    if unexpected:  # the LM head of a *ForCausalLM checkpoint is expected to stay behind: not reported
        logger.warning("%s: %d tensor(s) not used by the model: %s", name_or_path, len(unexpected), unexpected[:5])
    if info["missing_keys"]:  # transformers would fill them with random values: a silently different encoder
        missing = sorted(info["missing_keys"])
        raise OSError(
            f"The weights in {name_or_path!r} lack {len(missing)} tensor(s) the {spec.model_type} model needs "
            f"({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}): the safetensors file is incomplete "
            "or from another architecture; re-download or re-save it."
        )
    if getattr(config, "mask_token_id", None) is not None:
        model.config.mask_token_id = config.mask_token_id
    set_bidirectional(model, enable_bidirectional)
    check_attention(model.base_model if lm_head else model, expect_bidirectional=enable_bidirectional)
    logger.info(
        "Loaded %s (%s, %s attention, %s)",
        name_or_path,
        spec.model_type,
        "bidirectional" if enable_bidirectional else "causal",
        model.config._attn_implementation,
    )
    return model
