"""The remote-code releases on transformers' own classes: Dream's config.json as a ``Qwen2Config``, LLaDA's
(OLMo-style) as a ``LlamaConfig`` read as LLaDA's own code reads it, and LLaDA's weight names as Llama's.
``backbones.py`` names these in its table; no remote code is ever run. A config.json that cannot be run as
written is a ``BackboneConfigError`` naming the field and its value, never a different model.
"""

from __future__ import annotations

import json

from transformers import LlamaConfig, PretrainedConfig, Qwen2Config


class BackboneConfigError(ValueError):
    """A config.json that transformers' classes cannot run as written, or that does not match its weights;
    the message names the field, its value and, for a size, the weight and both shapes."""


#: Config keys of Dream's config.json that Qwen2Config must not see.
_DREAM_DROP_KEYS = ("architectures", "auto_map", "model_type", "use_mrope", "transformers_version", "torch_dtype")


def dream_config(raw: dict) -> PretrainedConfig:
    fields = {k: v for k, v in raw.items() if k not in _DREAM_DROP_KEYS}
    mask_token_id = fields.pop("mask_token_id", None)
    fields.setdefault("tie_word_embeddings", False)
    config = Qwen2Config(**fields)
    config.mask_token_id = mask_token_id
    return config


#: LLaDA/OLMo settings that Llama's code does not implement: the only value it can run, and the value
#: LLaDA's code uses when config.json leaves the key out (``configuration_llada.ModelConfig``'s default;
#: ``rope_scaling`` and ``clip_qkv`` are OLMo keys LLaDA's code never reads, null meaning none).
_LLADA_FIXED: dict[str, tuple[object, object]] = {
    "block_type": ("llama", "sequential"),
    "activation_type": ("silu", "swiglu"),
    "layer_norm_type": ("rms", "default"),
    "layer_norm_with_affine": (True, True),
    "bias_for_layer_norm": (False, None),
    "attention_layer_norm": (False, False),
    "input_emb_norm": (False, False),
    "include_qkv_bias": (False, False),
    "alibi": (False, False),
    "rope": (True, False),
    "scale_logits": (False, False),
    "residual_dropout": (0.0, 0.1),
    "embedding_dropout": (0.0, 0.1),
    "rope_scaling": (None, None),
    "clip_qkv": (None, None),
}
#: Flags LLaDA's code only tests for truth (``if config.rope:``), so an explicit null there means false.
_LLADA_TRUTH_TESTED = (
    "layer_norm_with_affine", "attention_layer_norm", "input_emb_norm", "alibi", "rope", "scale_logits"
)


def _llada_reading(raw: dict, key: str) -> tuple[object, str]:
    """The value LLaDA's own code acts on for ``key``, and how config.json gave it (for the message).

    A missing key takes LLaDA's default. A null reaches LLaDA's code as None: a truth test reads it as
    false, ``bias_for_layer_norm`` falls back to ``include_bias``, and elsewhere LLaDA's code cannot build
    a model with it (an unknown block, norm or activation type, ``nn.Dropout(None)``, ``include_bias | None``).
    """
    if key in raw:
        value, given = raw[key], json.dumps(raw[key])
    else:
        value = _LLADA_FIXED[key][1]
        given = f"missing, so LLaDA's default {json.dumps(value)}"
    if value is not None:
        return value, given
    if key in _LLADA_TRUTH_TESTED:
        return False, f"{given}, which LLaDA's code reads as false"
    if key == "bias_for_layer_norm":
        include_bias = bool(raw.get("include_bias"))
        return include_bias, f"{given}, so include_bias: {json.dumps(include_bias)}"
    return None, f"{given}, which LLaDA's own code cannot build a model with"


#: LLaDA's defaults (``configuration_llada.ModelConfig``) for the sizes and numbers mapped onto Llama: a key
#: config.json leaves out takes these, as in LLaDA's own code. Null means "derive it" for the keys in
#: ``_LLADA_DERIVED``; for the others LLaDA's code cannot build a model with it.
_LLADA_DEFAULTS: dict[str, object] = {
    "d_model": 768,
    "n_heads": 12,
    "n_kv_heads": None,
    "multi_query_attention": None,
    "n_layers": 12,
    "mlp_ratio": 4,
    "mlp_hidden_size": None,
    "max_sequence_length": 1024,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "vocab_size": 50257,
    "embedding_size": 50304,
    "weight_tying": True,
    "include_bias": False,
    "attention_dropout": 0.1,
}
_LLADA_DERIVED = ("n_kv_heads", "multi_query_attention", "mlp_hidden_size", "embedding_size")


def _llada_number(raw: dict, key: str) -> object:
    """config.json's ``key`` as LLaDA's code reads it: missing means LLaDA's default; null is refused unless
    LLaDA derives the value from others (``_LLADA_DERIVED``)."""
    value = raw.get(key, _LLADA_DEFAULTS[key])
    if value is None and key not in _LLADA_DERIVED:
        raise BackboneConfigError(
            f"LLaDA config.json: {key!r} is null, which LLaDA's own code cannot build a model with; give its "
            f"value (LLaDA's default when the key is left out: {json.dumps(_LLADA_DEFAULTS[key])})."
        )
    return value


def _llada_kv_heads(n_kv_heads: object, multi_query_attention: object, n_heads: object) -> object:
    """Key/value heads as LLaDA's ``effective_n_kv_heads`` derives them: ``n_kv_heads`` when given; else one
    under ``multi_query_attention: true``, ``n_heads`` otherwise. Both given and disagreeing is refused, as there."""
    if n_kv_heads is None:
        return 1 if multi_query_attention is True else n_heads
    if multi_query_attention is None:
        return n_kv_heads
    implied = 1 if multi_query_attention else n_heads
    if n_kv_heads != implied:
        raise BackboneConfigError(
            f"LLaDA config.json: 'n_kv_heads' is {json.dumps(n_kv_heads)} but 'multi_query_attention' is "
            f"{json.dumps(multi_query_attention)}, which means {implied} key/value heads; LLaDA's own code refuses "
            "the two set differently. Leave one of them out (or null)."
        )
    return implied


def llada_config(raw: dict) -> PretrainedConfig:
    """LLaDA's OLMo-style config.json as a ``LlamaConfig`` (the field map in docs/models.md), ``mask_token_id`` kept.

    A fixed setting is checked as LLaDA's own code reads it (``_llada_reading``), so ``"rope": null`` (no
    rotary embeddings there) is refused rather than loaded with them.
    """
    readings = {key: _llada_reading(raw, key) for key in _LLADA_FIXED}
    supported = {key: needed for key, (needed, _) in _LLADA_FIXED.items()}
    unsupported = {k: raw.get(k, "<missing>") for k, (value, _) in readings.items() if value != supported[k]}
    if unsupported:
        why = "; ".join(f"{k!r} is {readings[k][1]} (Llama runs only {json.dumps(supported[k])})" for k in unsupported)
        raise BackboneConfigError(
            f"LLaDA config.json has settings transformers' Llama does not implement: {unsupported} ({why}) "
            f"(supported: {supported}); refusing rather than loading a different model."
        )
    value = {key: _llada_number(raw, key) for key in _LLADA_DEFAULTS}
    d_model, n_heads = value["d_model"], value["n_heads"]
    n_kv_heads = _llada_kv_heads(value["n_kv_heads"], value["multi_query_attention"], n_heads)
    embedding_size = value["embedding_size"]
    config = LlamaConfig(
        vocab_size=embedding_size if embedding_size is not None else value["vocab_size"],
        hidden_size=d_model,
        intermediate_size=value["mlp_hidden_size"] or value["mlp_ratio"] * d_model,
        num_hidden_layers=value["n_layers"],
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads,
        max_position_embeddings=value["max_sequence_length"],
        rms_norm_eps=value["rms_norm_eps"],
        rope_theta=value["rope_theta"],
        tie_word_embeddings=value["weight_tying"],
        hidden_act="silu",
        attention_bias=bool(value["include_bias"]),
        mlp_bias=bool(value["include_bias"]),
        attention_dropout=value["attention_dropout"],
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=raw.get("eos_token_id"),
        pad_token_id=raw.get("pad_token_id"),
    )
    config.mask_token_id = raw.get("mask_token_id")
    return config


_BLOCK = r"model\.transformer\.blocks\.(\d+)\."
#: LLaDA-8B weight names -> LlamaForCausalLM's (LlamaModel drops the ``model.`` prefix itself).
LLADA_KEY_MAPPING = {
    r"model\.transformer\.wte\.": "model.embed_tokens.",
    _BLOCK + r"q_proj\.": r"model.layers.\1.self_attn.q_proj.",
    _BLOCK + r"k_proj\.": r"model.layers.\1.self_attn.k_proj.",
    _BLOCK + r"v_proj\.": r"model.layers.\1.self_attn.v_proj.",
    _BLOCK + r"attn_out\.": r"model.layers.\1.self_attn.o_proj.",
    _BLOCK + r"ff_proj\.": r"model.layers.\1.mlp.gate_proj.",
    _BLOCK + r"up_proj\.": r"model.layers.\1.mlp.up_proj.",
    _BLOCK + r"ff_out\.": r"model.layers.\1.mlp.down_proj.",
    _BLOCK + r"attn_norm\.": r"model.layers.\1.input_layernorm.",
    _BLOCK + r"ff_norm\.": r"model.layers.\1.post_attention_layernorm.",
    r"model\.transformer\.ln_f\.": "model.norm.",
    r"model\.transformer\.ff_out\.": "lm_head.",
}
