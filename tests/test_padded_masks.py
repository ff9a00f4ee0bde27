"""Padded bidirectional forwards pass one key-padding mask (B, 1, 1, L) instead of the (B, 1, L, L) mask
transformers builds: every real token's hidden state is the same under both, for every family and each attention
implementation that takes it. Where transformers confines attention to a sliding window narrower than the rows,
the 2D mask goes to transformers, and packing (whose block mask has no window) is refused."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import FAMILIES, MISTRAL_FIXTURE, MIXED_TEXTS
from transformers import Gemma2Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from diffusion_embedder import Encoder
from diffusion_embedder import packing as packing_mod

#: Every family with each implementation that takes a key-padding mask (Gemma2's soft-capping has no SDPA path).
CASES = [(family, attn) for family in FAMILIES for attn in ("sdpa", "eager") if (family, attn) != ("gemma2", "sdpa")]


def transformers_hidden(model, features):
    mask = features["attention_mask"]
    return model(input_ids=features["input_ids"].long(), attention_mask=mask,
                 position_ids=(mask.cumsum(-1) - 1).clamp_min(0), use_cache=False).last_hidden_state


@pytest.mark.parametrize(("family", "attn"), CASES)
def test_key_padding_mask_gives_transformers_hidden_states(family_checkpoint, family, attn):
    encoder = Encoder.from_pretrained(str(family_checkpoint(family)), torch_dtype=torch.float32,
                                      attn_implementation=attn)
    features = encoder.tokenize(MIXED_TEXTS)
    mask = features["attention_mask"]
    assert not mask.bool().all(), "the texts must pad"
    passed = packing_mod.padded_mask(encoder.model, mask)
    assert passed.shape == (len(MIXED_TEXTS), 1, 1, mask.shape[1])
    with torch.no_grad():
        ours = packing_mod.hidden_states(encoder.model, features)
        theirs = transformers_hidden(encoder.model, features)
    real = mask.bool()
    assert torch.equal(ours[real], theirs[real]), (ours[real] - theirs[real]).abs().max()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_causal_models_keep_the_2d_mask(family_checkpoint, attn):
    encoder = Encoder.from_pretrained(str(family_checkpoint("llama")), torch_dtype=torch.float32,
                                      attn_implementation=attn, enable_bidirectional=False)
    features = encoder.tokenize(MIXED_TEXTS)
    assert packing_mod.padded_mask(encoder.model, features["attention_mask"]) is features["attention_mask"]
    with torch.no_grad():
        ours = packing_mod.hidden_states(encoder.model, features)
        theirs = transformers_hidden(encoder.model, features)
    real = features["attention_mask"].bool()
    assert torch.equal(ours[real], theirs[real])


def test_sliding_window_of_each_family():
    assert packing_mod.sliding_window(MistralConfig()) == 4096  # Mistral windows whenever the window is set
    assert packing_mod.sliding_window(MistralConfig(sliding_window=None)) is None
    assert packing_mod.sliding_window(Gemma2Config(sliding_window=512)) == 512  # every other layer
    assert packing_mod.sliding_window(LlamaConfig()) is None
    assert packing_mod.sliding_window(Qwen2Config(sliding_window=64)) is None  # use_sliding_window is off
    windowed = Qwen2Config(use_sliding_window=True, sliding_window=64, max_window_layers=1, num_hidden_layers=2)
    assert packing_mod.sliding_window(windowed) == 64
    assert packing_mod.sliding_window(Qwen3Config(use_sliding_window=True, sliding_window=64, max_window_layers=2,
                                                  num_hidden_layers=2)) is None  # no layer past max_window_layers


def test_mistral_window_narrower_than_the_rows(tmp_path):
    """A window of 8 tokens over texts of up to 50: transformers' windowed mask for the padded rows (the key mask
    would drop the window), and packing refused (its block mask would too)."""
    for name in ("windowed", "unwindowed"):
        shutil.copytree(MISTRAL_FIXTURE, tmp_path / name)
    for name, window in (("windowed", 8), ("unwindowed", None)):
        config = json.loads((tmp_path / name / "config.json").read_text())
        (tmp_path / name / "config.json").write_text(json.dumps(config | {"sliding_window": window}))
    windowed = Encoder.from_pretrained(str(tmp_path / "windowed"), torch_dtype=torch.float32)
    features = windowed.tokenize(MIXED_TEXTS)
    assert features["attention_mask"].shape[1] > 8
    assert packing_mod.padded_mask(windowed.model, features["attention_mask"]) is features["attention_mask"]
    with pytest.raises(ValueError, match=r"sliding-window attention \(window 8\)"):
        windowed.encode(MIXED_TEXTS, packing=True, show_progress_bar=False)
    unwindowed = Encoder.from_pretrained(str(tmp_path / "unwindowed"), torch_dtype=torch.float32)
    with torch.no_grad():
        ours = packing_mod.hidden_states(windowed.model, features)
        theirs = transformers_hidden(windowed.model, features)
        open_ = packing_mod.hidden_states(unwindowed.model, features)
    real = features["attention_mask"].bool()
    assert torch.equal(ours[real], theirs[real])
    assert (ours[real] - open_[real]).abs().max() > 1e-2  # the window changes the result: the check above can fail
