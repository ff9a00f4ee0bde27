"""Backbones: Dream and LLaDA reference parity, the bidirectional switch per family and backend, the self-test."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import DREAM_FIXTURE, FAMILIES, LLADA_FIXTURE, default_attention
from numerics import REFERENCE_EPS, assert_close_normwise
from safetensors.torch import load_file
from transformers import AutoConfig

from diffusion_embedder import SUPPORTED_MODEL_TYPES, load_backbone
from diffusion_embedder.backbones import (
    AttentionSelfTestError,
    BackboneConfigError,
    check_attention,
    load_config,
    load_tokenizer,
)

DREAM_CASES = json.loads((DREAM_FIXTURE / "cases.json").read_text())
LLADA_CASES = json.loads((LLADA_FIXTURE / "cases.json").read_text())


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("bidirectional", [True, False])
def test_dream_reproduces_reference(attn, bidirectional):
    model = load_backbone(str(DREAM_FIXTURE), enable_bidirectional=bidirectional, attn_implementation=attn)
    key = "last_hidden_state" if bidirectional else "last_hidden_state_causal"
    for case in DREAM_CASES:
        out = model(input_ids=torch.tensor(case["input_ids"]), use_cache=False).last_hidden_state
        assert_close_normwise(out, torch.tensor(case[key]), eps_multiple=REFERENCE_EPS)


def test_dream_is_qwen2_without_remote_code():
    with pytest.raises(ValueError):
        AutoConfig.from_pretrained(str(DREAM_FIXTURE))  # the folder asks for remote code
    model = load_backbone(str(DREAM_FIXTURE))
    assert type(model).__name__ == "Qwen2Model"
    assert model.config.mask_token_id == 3
    assert model.config.is_causal is False
    tokenizer = load_tokenizer(str(DREAM_FIXTURE))
    assert tokenizer.convert_tokens_to_ids("<|mask|>") == 3
    assert tokenizer.eos_token == tokenizer.pad_token == "<|endoftext|>"
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_backbone(str(DREAM_FIXTURE), trust_remote_code=True)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_dream_padding_does_not_leak(attn):
    """Upstream let pads into Dream's attention; a padded row must equal its unpadded output here."""
    model = load_backbone(str(DREAM_FIXTURE), attn_implementation=attn)
    ids = torch.tensor(DREAM_CASES[1]["input_ids"][0])
    expected = torch.tensor(DREAM_CASES[1]["last_hidden_state"][0])
    padded = torch.cat([torch.zeros(7, dtype=torch.long), ids]).unsqueeze(0)
    mask = torch.cat([torch.zeros(7, dtype=torch.long), torch.ones(len(ids), dtype=torch.long)]).unsqueeze(0)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    out = model(input_ids=padded, attention_mask=mask, position_ids=positions, use_cache=False).last_hidden_state
    assert_close_normwise(out[0, 7:], expected, eps_multiple=REFERENCE_EPS)


def _attn_implementations(family):
    return ["eager"] if default_attention(family) == "eager" else ["eager", "sdpa"]


@pytest.mark.parametrize(
    "family,attn", [(f, a) for f in FAMILIES for a in _attn_implementations(f)]
)
def test_attention_switch_and_self_test(family_checkpoint, family, attn):
    path = str(family_checkpoint(family))
    bi = load_backbone(path, enable_bidirectional=True, attn_implementation=attn)
    causal = load_backbone(path, enable_bidirectional=False, attn_implementation=attn)
    assert bi.config._attn_implementation == attn
    ids = torch.tensor([[5, 9, 17, 33, 65, 129, 257]])
    changed = ids.clone()
    changed[0, -1] = 400
    for model, should_change in ((bi, True), (causal, False)):
        with torch.no_grad():
            a = model(input_ids=ids, use_cache=False).last_hidden_state[0, 0]
            b = model(input_ids=changed, use_cache=False).last_hidden_state[0, 0]
        assert (not torch.equal(a, b)) == should_change
    # The self-test refuses a model whose attention is not what was asked for.
    with pytest.raises(AttentionSelfTestError, match="asked for bidirectional"):
        check_attention(causal, expect_bidirectional=True)
    with pytest.raises(AttentionSelfTestError, match="asked for causal"):
        check_attention(bi, expect_bidirectional=False)


@pytest.mark.parametrize("asked", [True, False])
def test_load_fails_when_the_switch_is_not_honoured(family_checkpoint, monkeypatch, asked):
    """A backbone that ignores the switch must fail at load, not embed with the wrong attention silently."""
    import diffusion_embedder.backbones as backbones

    original = backbones.set_bidirectional
    monkeypatch.setattr(backbones, "set_bidirectional", lambda model, enable: original(model, not enable))
    with pytest.raises(AttentionSelfTestError, match="Attention self-test failed"):
        load_backbone(str(family_checkpoint("qwen2")), enable_bidirectional=asked)


def test_unsupported_model_type_lists_supported(tmp_path):
    shutil.copytree(DREAM_FIXTURE, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["model_type"] = "gpt2"
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="Unsupported model type 'gpt2'") as error:
        load_backbone(str(tmp_path / "m"))
    for name in SUPPORTED_MODEL_TYPES:
        assert name in str(error.value)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_llada_reproduces_reference(attn):
    """Hidden states after ln_f and logits of LLaDA's own code, on transformers' Llama without remote code."""
    model = load_backbone(str(LLADA_FIXTURE), attn_implementation=attn)
    lm = load_backbone(str(LLADA_FIXTURE), attn_implementation=attn, lm_head=True)  # the LM stages' model
    assert type(lm).__name__ == "LlamaForCausalLM"
    for case in LLADA_CASES:
        ids = torch.tensor(case["input_ids"])
        with torch.no_grad():
            hidden = model(input_ids=ids, use_cache=False).last_hidden_state
            logits = lm(input_ids=ids, use_cache=False).logits
        assert_close_normwise(hidden, torch.tensor(case["last_hidden_state"]), eps_multiple=REFERENCE_EPS)
        assert_close_normwise(logits, torch.tensor(case["logits"]), eps_multiple=REFERENCE_EPS)


def llada_by_hand(ids: torch.Tensor, causal: bool) -> torch.Tensor:
    """LLaDA's llama block written out from its config and raw weight names (no transformers code)."""
    raw = json.loads((LLADA_FIXTURE / "config.json").read_text())
    w = {k.removeprefix("model.transformer."): v for k, v in load_file(LLADA_FIXTURE / "model.safetensors").items()}
    heads, eps = raw["n_heads"], raw["rms_norm_eps"]
    dim = raw["d_model"] // heads

    def norm(x, gain):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gain

    inv_freq = 1.0 / raw["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = torch.arange(ids.shape[1], dtype=torch.float32)[:, None] * inv_freq[None]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()

    def rope(x):  # rotate-half (NeoX) form
        half = torch.cat([-x[..., dim // 2 :], x[..., : dim // 2]], -1)
        return x * cos + half * sin

    x = w["wte.weight"][ids]
    for i in range(raw["n_layers"]):
        b = {k.removeprefix(f"blocks.{i}."): v for k, v in w.items() if k.startswith(f"blocks.{i}.")}
        h = norm(x, b["attn_norm.weight"])
        q, k, v = (
            (h @ b[f"{n}.weight"].T).view(*ids.shape, heads, dim).transpose(1, 2)
            for n in ("q_proj", "k_proj", "v_proj")
        )
        att = torch.nn.functional.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=causal)
        x = x + att.transpose(1, 2).reshape(*ids.shape, -1) @ b["attn_out.weight"].T
        h = norm(x, b["ff_norm.weight"])
        gated = torch.nn.functional.silu(h @ b["ff_proj.weight"].T) * (h @ b["up_proj.weight"].T)
        x = x + gated @ b["ff_out.weight"].T
    return norm(x, w["ln_f.weight"])


def test_llada_causal_matches_a_hand_written_forward():
    """No causal reference ships with the fixture: a hand-written forward, itself checked against the
    bidirectional reference, is the reference for the causal ablation."""
    causal = load_backbone(str(LLADA_FIXTURE), enable_bidirectional=False)
    for case in LLADA_CASES:
        ids = torch.tensor(case["input_ids"])
        assert_close_normwise(
            llada_by_hand(ids, causal=False), torch.tensor(case["last_hidden_state"]),
            eps_multiple=REFERENCE_EPS
        )
        with torch.no_grad():
            out = causal(input_ids=ids, use_cache=False).last_hidden_state
        assert_close_normwise(out, llada_by_hand(ids, causal=True), eps_multiple=REFERENCE_EPS)


def test_llada_is_llama_without_remote_code(tmp_path):
    with pytest.raises(ValueError):
        AutoConfig.from_pretrained(str(LLADA_FIXTURE))  # the folder asks for remote code
    model = load_backbone(str(LLADA_FIXTURE))
    assert type(model).__name__ == "LlamaModel" and model.config.is_causal is False
    assert model.config.mask_token_id == 956
    tokenizer = load_tokenizer(str(LLADA_FIXTURE))
    assert (tokenizer.mask_token, tokenizer.mask_token_id) == ("<|mdm_mask|>", 956)
    assert tokenizer.eos_token == tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer("a b")["input_ids"][0] != tokenizer.bos_token_id  # LLaDA adds no BOS by itself
    # A setting Llama's code cannot run is refused by name, not dropped.
    raw = json.loads((LLADA_FIXTURE / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "alibi": True}))
    with pytest.raises(ValueError, match="'alibi': True"):
        load_config(str(tmp_path))


#: LLaDA config edits refused, each as LLaDA's own code reads it (configuration_llada/modeling_llada):
#: a missing key takes LLaDA's default, a null reaches its code as None.
LLADA_REFUSED = {
    "rope null": ({"rope": None}, "'rope' is null, which LLaDA's code reads as false"),  # no rotary embeddings
    "rope missing": ({"rope": "<drop>"}, "'rope' is missing, so LLaDA's default false"),
    "block_type null": ({"block_type": None}, "'block_type' is null, which LLaDA's own code cannot build"),
    "block_type missing": ({"block_type": "<drop>"}, "'block_type' is missing, so LLaDA's default \"sequential\""),
    "norm affine null": ({"layer_norm_with_affine": None}, "'layer_norm_with_affine' is null, which LLaDA's code"),
    "qkv bias null": ({"include_qkv_bias": None}, "'include_qkv_bias' is null, which LLaDA's own code cannot"),
    "dropout missing": ({"residual_dropout": "<drop>"}, "'residual_dropout' is missing, so LLaDA's default 0.1"),
    "norm bias inherited": ({"bias_for_layer_norm": None, "include_bias": True}, "so include_bias: true"),
}
#: Edits that mean what Llama runs: OLMo's "none" keys, flags LLaDA only tests for truth, an inherited bias.
LLADA_EQUIVALENT = [
    {"rope_scaling": None, "clip_qkv": None},
    {"alibi": None, "scale_logits": None, "attention_layer_norm": None, "input_emb_norm": None},
    {"bias_for_layer_norm": None},
    {"alibi": "<drop>", "bias_for_layer_norm": "<drop>", "input_emb_norm": "<drop>"},
]


def llada_folder(tmp_path, edits: dict):
    raw = json.loads((LLADA_FIXTURE / "config.json").read_text())
    raw.update({k: v for k, v in edits.items() if v != "<drop>"})
    for key in [k for k, v in edits.items() if v == "<drop>"]:
        del raw[key]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return str(tmp_path)


@pytest.mark.parametrize("case", LLADA_REFUSED)
def test_llada_settings_are_read_as_llada_reads_null_and_missing_keys(tmp_path, case):
    """Before, a null skipped the check: ``"rope": null`` loaded with rotary embeddings LLaDA would not apply."""
    edits, why = LLADA_REFUSED[case]
    with pytest.raises(ValueError, match="Llama does not implement") as caught:
        load_config(llada_folder(tmp_path, edits))
    assert why in str(caught.value)


@pytest.mark.parametrize("edits", LLADA_EQUIVALENT)
def test_llada_nulls_that_mean_the_same_model_load_the_same_config(tmp_path, edits):
    reference, _ = load_config(str(LLADA_FIXTURE))
    config, _ = load_config(llada_folder(tmp_path, edits))
    assert config.to_dict() | {"_name_or_path": ""} == reference.to_dict() | {"_name_or_path": ""}


@pytest.mark.parametrize(("key", "default"), [("rope_theta", 10000.0), ("rms_norm_eps", 1e-5)])
def test_llada_missing_rope_theta_or_norm_eps_take_llada_defaults(tmp_path, key, default):
    """Before, a bare KeyError; LLaDA's own code (``configuration_llada.ModelConfig``) has defaults for both."""
    config, _ = load_config(llada_folder(tmp_path, {key: "<drop>"}))
    assert (config.rms_norm_eps if key == "rms_norm_eps" else config.rope_parameters["rope_theta"]) == default


#: Sizes that do not match the fixture's weights: (edit, the weight and its shape there, the fields, the shape built).
LLADA_WRONG_SIZES = {
    "d_model missing": (
        {"d_model": "<drop>"},
        "embed_tokens.weight has shape [1024, 64] in the weights",
        "(embedding_size = 1024, d_model = 768, LLaDA's defaults for keys it leaves out) give it [1024, 768]",
    ),
    "mlp_hidden_size": (
        {"mlp_hidden_size": 256},
        "layers.0.mlp.down_proj.weight has shape [64, 192] in the weights",
        "(mlp_hidden_size = 256, d_model = 64, LLaDA's defaults for keys it leaves out) give it [64, 256]",
    ),
    "n_heads": (
        {"n_heads": 8},
        "layers.0.self_attn.k_proj.weight has shape [64, 64] in the weights",
        "(n_kv_heads = 4, n_heads = 8, d_model = 64, LLaDA's defaults for keys it leaves out) give it [32, 64]",
    ),
}


@pytest.mark.parametrize("case", LLADA_WRONG_SIZES)
def test_llada_sizes_that_do_not_match_the_weights_name_field_weight_and_shapes(tmp_path, case):
    """Before, a missing d_model was a bare KeyError and a wrong size transformers' ignore_mismatched_sizes error."""
    edits, weight, sizes = LLADA_WRONG_SIZES[case]
    folder = tmp_path / "llada"
    shutil.copytree(LLADA_FIXTURE, folder)
    with pytest.raises(BackboneConfigError) as caught:
        load_backbone(llada_folder(folder, edits))
    message = str(caught.value)
    assert f"config.json of '{folder}' does not match its weights: {weight}" in message and sizes in message


def test_llada_null_size_is_named(tmp_path):
    with pytest.raises(BackboneConfigError, match="'d_model' is null, which LLaDA's own code cannot build a model"):
        load_config(llada_folder(tmp_path, {"d_model": None}))


#: Every LLaDA config.json field that changes the computation, its LlamaConfig field (the fixtures README's map),
#: as an edit of the fixture's config.json and the value Llama must then carry. Each edit differs from the
#: fixture's value and from LLaDA's default, so a field dropped, or read as its default, shows.
LLADA_MAPPED = {
    "d_model": ({"d_model": 96}, "hidden_size", 96),
    "n_heads": ({"n_heads": 8, "n_kv_heads": 8}, "num_attention_heads", 8),
    "n_kv_heads": ({"n_kv_heads": 2}, "num_key_value_heads", 2),
    "multi_query_attention, n_kv_heads absent": (
        {"multi_query_attention": True, "n_kv_heads": "<drop>"}, "num_key_value_heads", 1),
    "multi_query_attention, n_kv_heads null": ({"multi_query_attention": True, "n_kv_heads": None},
                                               "num_key_value_heads", 1),
    "multi_query_attention false, n_kv_heads absent": (
        {"multi_query_attention": False, "n_kv_heads": "<drop>"}, "num_key_value_heads", 4),
    "n_kv_heads absent": ({"n_kv_heads": "<drop>", "multi_query_attention": "<drop>"}, "num_key_value_heads", 4),
    "multi_query_attention agreeing with n_kv_heads": ({"multi_query_attention": True, "n_kv_heads": 1},
                                                       "num_key_value_heads", 1),
    "n_layers": ({"n_layers": 3}, "num_hidden_layers", 3),
    "mlp_hidden_size": ({"mlp_hidden_size": 160}, "intermediate_size", 160),
    "mlp_ratio (mlp_hidden_size null)": ({"mlp_hidden_size": None, "mlp_ratio": 5}, "intermediate_size", 320),
    "max_sequence_length": ({"max_sequence_length": 2048}, "max_position_embeddings", 2048),
    "rope_theta": ({"rope_theta": 250000.0}, "rope_theta", 250000.0),
    "rms_norm_eps": ({"rms_norm_eps": 1e-6}, "rms_norm_eps", 1e-6),
    "embedding_size": ({"embedding_size": 1152}, "vocab_size", 1152),
    "vocab_size (embedding_size null)": ({"embedding_size": None, "vocab_size": 1000}, "vocab_size", 1000),
    "weight_tying": ({"weight_tying": True}, "tie_word_embeddings", True),
    "include_bias (attention)": ({"include_bias": True}, "attention_bias", True),
    "include_bias (mlp)": ({"include_bias": True}, "mlp_bias", True),
    "attention_dropout": ({"attention_dropout": 0.25}, "attention_dropout", 0.25),
    "mask_token_id": ({"mask_token_id": 957}, "mask_token_id", 957),
    "eos_token_id": ({"eos_token_id": 942}, "eos_token_id", 942),
    "pad_token_id": ({"pad_token_id": 943}, "pad_token_id", 943),
}

#: Cases whose derived value is the fixture's own (4 key/value heads = n_heads), so only the mapping is checked.
LLADA_DERIVED_AS_THE_FIXTURE = ("multi_query_attention false, n_kv_heads absent", "n_kv_heads absent")


def mapped_value(config, field: str):
    return config.rope_parameters["rope_theta"] if field == "rope_theta" else getattr(config, field)


@pytest.mark.parametrize("case", LLADA_MAPPED)
def test_every_llada_field_that_changes_the_computation_reaches_its_llama_field(tmp_path, case):
    edits, field, expected = LLADA_MAPPED[case]
    reference, _ = load_config(str(LLADA_FIXTURE))
    config, _ = load_config(llada_folder(tmp_path, edits))
    assert mapped_value(config, field) == expected
    if case not in LLADA_DERIVED_AS_THE_FIXTURE:  # the edit moves this field off the fixture's value
        assert mapped_value(reference, field) != expected
    assert (config.hidden_act, config.rope_parameters["rope_type"], type(config).__name__) == (
        "silu", "default", "LlamaConfig")  # LLaDA's fixed settings (swiglu, no rope scaling)


def test_llada_multi_query_attention_builds_one_key_value_head(tmp_path):
    """The model built from ``multi_query_attention: true`` (no ``n_kv_heads``) has one key/value head: k and v
    project to one head's width, and every query head attends to that one head."""
    from transformers import LlamaModel

    config, _ = load_config(llada_folder(tmp_path, {"multi_query_attention": True, "n_kv_heads": "<drop>"}))
    attention = LlamaModel(config).layers[0].self_attn
    head_dim = config.hidden_size // config.num_attention_heads
    assert attention.k_proj.weight.shape == attention.v_proj.weight.shape == (head_dim, config.hidden_size)
    assert attention.num_key_value_groups == config.num_attention_heads


@pytest.mark.parametrize(("edits", "implied"), [({"multi_query_attention": True, "n_kv_heads": 4}, 1),
                                                ({"multi_query_attention": False, "n_kv_heads": 2}, 4)])
def test_llada_n_kv_heads_disagreeing_with_multi_query_attention_is_refused(tmp_path, edits, implied):
    """LLaDA's own code refuses both set differently; before, n_kv_heads silently won."""
    with pytest.raises(BackboneConfigError, match=rf"'n_kv_heads' is {edits['n_kv_heads']} but "
                                                  rf"'multi_query_attention' is .*means {implied} key/value heads"):
        load_config(llada_folder(tmp_path, edits))


@pytest.mark.parametrize("side", ["left", "right"])
def test_llada_padding_does_not_leak(side):
    """Upstream LLaDA ignores attention_mask; here each padded row equals its unpadded reference."""
    model = load_backbone(str(LLADA_FIXTURE))
    rows = [(torch.tensor(c["input_ids"][0]), torch.tensor(c["last_hidden_state"][0])) for c in LLADA_CASES]
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), 941)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (ids, _) in enumerate(rows):
        where = slice(width - len(ids), width) if side == "left" else slice(0, len(ids))
        input_ids[i, where], mask[i, where] = ids, 1
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=False)
    for i, (_, expected) in enumerate(rows):
        got = out.last_hidden_state[i][mask[i].bool()]
        assert_close_normwise(got, expected, eps_multiple=REFERENCE_EPS, msg=(side, i))
