"""Diffusion backbones as encoders: LLaDA end to end (LoRA, save/load) and mask-token readout pooling."""

from __future__ import annotations

import json

import torch
from conftest import LLADA_FIXTURE
from peft import LoraConfig, get_peft_model

from diffusion_embedder import Encoder
from diffusion_embedder.training.arguments import LORA_TARGETS

TEXTS = [
    ["Given a math problem, retrieve the theorem", "A triangle has sides 3, 4 and 5. Find its area."],
    "Two pointers sweep the array from both ends.",
    ["Retrieve text based on user query", "What is the capital of France?"],
]


def test_llada_lora_save_and_reload_records_the_base(tmp_path):
    encoder = Encoder.from_pretrained(str(LLADA_FIXTURE), torch_dtype=torch.float32, device="cpu")
    base = encoder.encode(TEXTS, show_progress_bar=False)
    encoder.model = get_peft_model(encoder.model, LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS))
    wrapped = {n.rsplit(".", 1)[0] for n, _ in encoder.model.named_parameters() if "lora_B" in n}
    assert len(wrapped) == 2 * 7  # the default targets name every mapped projection of both blocks
    torch.manual_seed(0)
    for name, param in encoder.model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.5)
    expected = encoder.encode(TEXTS, show_progress_bar=False)
    assert not torch.allclose(expected, base, atol=1e-3)

    encoder.save(str(tmp_path / "adapter"))
    saved = json.loads((tmp_path / "adapter" / "encoder_config.json").read_text())
    assert saved["model_type"] == "llada" and saved["base_model_name_or_path"] == str(LLADA_FIXTURE)
    adapter = Encoder.from_pretrained(str(tmp_path / "adapter"), device="cpu")
    assert torch.allclose(adapter.encode(TEXTS, show_progress_bar=False), expected, atol=1e-5)

    encoder.save(str(tmp_path / "merged"), merge_before_save=True)
    merged = Encoder.from_pretrained(str(tmp_path / "merged"), device="cpu")
    assert merged.config.model_type == "llada" and merged.model.config.mask_token_id == 956
    assert merged.tokenizer.mask_token_id == 956
    assert torch.allclose(merged.encode(TEXTS, show_progress_bar=False), expected, atol=1e-5)
