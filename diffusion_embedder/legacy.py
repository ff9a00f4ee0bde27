"""Saved folders that older releases read too: LLM2Vec 0.2.3 runs on transformers 4.44 and tokenizers 0.19.

transformers 5 writes a few things those releases cannot parse: BPE merges as pairs (tokenizers >= 0.20),
``tokenizer_class: TokenizersBackend``, and RoPE settings only under ``rope_parameters``; peft 0.12 refuses
the keys newer peft adds to ``adapter_config.json``. The rewrite below
is lossless for the current releases, which read the older forms as well.
"""

from __future__ import annotations

import dataclasses
import json
import os

#: tokenizer_config.json keys of transformers 5 that older releases don't know (and would keep as kwargs).
NEW_TOKENIZER_KEYS = ("backend", "is_local", "local_files_only")
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def _load(path: str) -> dict | None:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _dump(path: str, value: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2, ensure_ascii=False)


def legacy_merges(merges: list) -> list[str]:
    """BPE merges as ``"a b"`` strings (the only form tokenizers < 0.20 reads)."""
    out = []
    for merge in merges:
        if isinstance(merge, str):
            out.append(merge)
            continue
        left, right = merge
        if " " in left or " " in right:
            raise ValueError(
                f"The merge {merge!r} holds a space, which tokenizers < 0.20 cannot read; this tokenizer "
                "cannot be saved for older releases."
            )
        out.append(f"{left} {right}")
    return out


def write_legacy_files(folder: str) -> None:
    """Rewrite the tokenizer and config files of a saved folder in the forms transformers 4.4x reads."""
    tokenizer_path = os.path.join(folder, "tokenizer.json")
    tokenizer = _load(tokenizer_path)
    if tokenizer is not None and isinstance(tokenizer.get("model", {}).get("merges"), list):
        tokenizer["model"]["merges"] = legacy_merges(tokenizer["model"]["merges"])
        _dump(tokenizer_path, tokenizer)

    config_path = os.path.join(folder, "tokenizer_config.json")
    tokenizer_config = _load(config_path)
    if tokenizer_config is not None:
        if tokenizer_config.get("tokenizer_class") in (None, "TokenizersBackend") and tokenizer is not None:
            tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
        for key in NEW_TOKENIZER_KEYS:
            tokenizer_config.pop(key, None)
        _dump(config_path, tokenizer_config)
        special_path = os.path.join(folder, "special_tokens_map.json")
        if not os.path.isfile(special_path):
            special = {k: tokenizer_config[k] for k in SPECIAL_TOKENS if tokenizer_config.get(k) is not None}
            _dump(special_path, special)

    model_config_path = os.path.join(folder, "config.json")
    config = _load(model_config_path)
    if config is not None:
        rope = config.get("rope_parameters")
        if isinstance(rope, dict) and "rope_theta" not in config and "rope_theta" in rope:
            config["rope_theta"] = rope["rope_theta"]
            scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
            config["rope_scaling"] = None if scaling.get("rope_type", "default") == "default" else scaling
        if "dtype" in config and "torch_dtype" not in config:
            config["torch_dtype"] = config["dtype"]
        _dump(model_config_path, config)


#: LoraConfig fields peft 0.12 (LLM2Vec 0.2.3's) knows; it refuses any other key in adapter_config.json.
PEFT_012_LORA_FIELDS = frozenset(
    (
        "alpha_pattern auto_mapping base_model_name_or_path bias fan_in_fan_out inference_mode init_lora_weights "
        "layer_replication layers_pattern layers_to_transform loftq_config lora_alpha lora_dropout megatron_config "
        "megatron_core modules_to_save peft_type r rank_pattern revision runtime_config target_modules task_type "
        "use_dora use_rslora"
    ).split()
)


def legacy_adapter_config(adapter: dict) -> dict:
    """Drop the keys newer peft writes at their default values (and ``peft_version``), so peft 0.12 reads the file.

    A newer setting in use (not at its default) stays: peft 0.12 then refuses it by name rather than
    loading another model.
    """
    if adapter.get("peft_type") != "LORA":
        return adapter
    from peft import LoraConfig

    defaults = {}
    for f in dataclasses.fields(LoraConfig):
        if f.default is not dataclasses.MISSING:
            defaults[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            defaults[f.name] = f.default_factory()
    return {
        key: value
        for key, value in adapter.items()
        if key in PEFT_012_LORA_FIELDS or (key != "peft_version" and (key not in defaults or value != defaults[key]))
    }
