"""Random-weight models in real backbones' shapes: speed and memory checks without a download (bench/, GPU tests)."""

from __future__ import annotations

from pathlib import Path

import torch

#: Real backbones' shapes with random weights, for speed and memory checks (bench/, tests/test_gpu.py):
#: Qwen2.5-7B (Dream-7B) and LLaDA-8B (run as a Llama-shaped model).
SHAPES_7B: dict[str, tuple[str, dict[str, int]]] = {
    "qwen2.5-7b": ("qwen2", dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                 num_attention_heads=28, num_key_value_heads=4, vocab_size=152064)),
    "llada-8b": ("llama", dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                               num_attention_heads=32, num_key_value_heads=32, vocab_size=126464)),
}  # fmt: skip
#: A tiny model of the same family, for the GPU scripts' CPU dry runs.
TINY_SHAPE: tuple[str, dict[str, int]] = ("qwen2", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=1024))


def random_encoder(
    model_type: str,
    dims: dict[str, int],
    tokenizer_folder: str | Path,
    *,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    attn: str = "sdpa",
    max_length: int = 32768,
    **settings,
):
    """A bidirectional ``Encoder`` with random weights (seed 0) of the given shape, made on ``device``.

    The attention self-test runs first, so a benchmark never measures a model that is still causal.
    """
    from transformers import AutoConfig, AutoModel

    from diffusion_embedder.backbones import check_attention, load_tokenizer, set_bidirectional
    from diffusion_embedder.encoder import Encoder

    config = AutoConfig.for_model(model_type, **dims, max_position_embeddings=32768)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModel.from_config(config, dtype=dtype, attn_implementation=attn)
    set_bidirectional(model, True)
    check_attention(model, expect_bidirectional=True)
    return Encoder(model.eval(), load_tokenizer(str(tokenizer_folder)), model_type=model_type,
                   max_length=max_length, doc_max_length=max_length, **settings)  # fmt: skip
