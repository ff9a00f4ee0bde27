"""A tiny Dream-format checkpoint built from scratch: the demo's starting point, made without any download.

The tokenizer is a byte-level BPE trained on the shipped ReasonAug text; the model is a random
Qwen2-shaped network saved in Dream's released layout (``model_type: "Dream"``), so it goes through
exactly the loading path a real Dream checkpoint takes. Its attention is decided at load time
(``enable_bidirectional``), so one folder gives both arms of the comparison from the same weights.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>")


@dataclass(frozen=True)
class TinyModelConfig:
    vocab_size: int = 4096
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 2048
    seed: int = 0


def train_tokenizer(texts: Iterable[str], folder: Path, vocab_size: int) -> None:
    """Byte-level BPE in Dream/Qwen2's file layout (vocab.json + merges.txt), special tokens first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.model.save(str(folder))
    added = {
        str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                 "special": True}
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    tokenizer_config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|endoftext|>",
        "mask_token": "<|mask|>",
        "model_max_length": 2048,
        "pad_token": "<|endoftext|>",
        "tokenizer_class": "Qwen2Tokenizer",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    special_map = {"additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "eos_token": "<|endoftext|>",
                   "mask_token": "<|mask|>", "pad_token": "<|endoftext|>"}
    (folder / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2))


def make_tiny_dream(folder: str | Path, texts: Iterable[str], config: TinyModelConfig = TinyModelConfig()) -> Path:
    """Write a random tiny Dream-format checkpoint (tokenizer trained on ``texts``) to ``folder``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    train_tokenizer(texts, folder, config.vocab_size)
    qwen = Qwen2Config(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(config.seed)
    Qwen2ForCausalLM(qwen).save_pretrained(folder, safe_serialization=True)
    dream = {
        "architectures": ["DreamModel"],
        "model_type": "Dream",
        "hidden_act": "silu",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "rms_norm_eps": qwen.rms_norm_eps,
        "rope_theta": 1000000.0,
        "attention_dropout": 0.0,
        "initializer_range": qwen.initializer_range,
        "tie_word_embeddings": False,
        "use_cache": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "eos_token_id": 0,
        "pad_token_id": 0,
        "mask_token_id": SPECIAL_TOKENS.index("<|mask|>"),
        "torch_dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(dream, indent=2))
    for stale in ("generation_config.json",):
        (folder / stale).unlink(missing_ok=True)
    logger.info("Wrote a tiny Dream-format checkpoint to %s", folder)
    return folder

