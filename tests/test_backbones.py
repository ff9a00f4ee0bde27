"""Backbones: Dream reference parity, the bidirectional switch per family and backend, the self-test."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import DREAM_FIXTURE, FAMILIES, default_attention
from transformers import AutoConfig

from diffusion_embedder import SUPPORTED_MODEL_TYPES, load_backbone
from diffusion_embedder.backbones import AttentionSelfTestError, check_attention, load_tokenizer

DREAM_CASES = json.loads((DREAM_FIXTURE / "cases.json").read_text())


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("bidirectional", [True, False])
def test_dream_reproduces_reference(attn, bidirectional):
    model = load_backbone(str(DREAM_FIXTURE), enable_bidirectional=bidirectional, attn_implementation=attn)
    key = "last_hidden_state" if bidirectional else "last_hidden_state_causal"
    for case in DREAM_CASES:
        out = model(input_ids=torch.tensor(case["input_ids"]), use_cache=False).last_hidden_state
        assert torch.allclose(out, torch.tensor(case[key]), atol=1e-4, rtol=0)


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
    assert torch.allclose(out[0, 7:], expected, atol=1e-4, rtol=0)


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
