"""A sentence-transformers input module that runs a whole Encoder, for settings its own modules can't express.

``modules.json`` names it as ``diffusion_embedder.st_modules.EncoderModule``; sentence-transformers imports it
by that name when ``diffusion_embedder`` is installed. It tokenizes exactly as ``Encoder.encode`` does
(instructions, chat template, EOS suffix, truncation) and pools with the encoder's own pooling. A
sentence-transformers prompt is taken literally as the text before the pooled span, as sentence-transformers
defines prompts; exported prompts are written as ``instruction.strip() + " "``, LLM2Vec's join.
"""

from __future__ import annotations

from typing import Any

import torch
from sentence_transformers.base.modules.input_module import InputModule

from diffusion_embedder.cpu_linear import onednn_linear
from diffusion_embedder.encoder import Encoder
from diffusion_embedder.templates import TextInput, parse_input


class EncoderModule(InputModule):
    """Tokenization, bidirectional backbone and pooling of a diffusion_embedder ``Encoder`` folder."""

    save_in_root = True

    def __init__(self, encoder: Encoder):
        super().__init__()
        self.encoder = encoder

    @property
    def tokenizer(self):
        return self.encoder.tokenizer

    @property
    def max_seq_length(self) -> int:
        return self.encoder.config.max_length

    @max_seq_length.setter
    def max_seq_length(self, value: int) -> None:
        self.encoder.max_seq_length = value

    def get_embedding_dimension(self) -> int:
        return self.encoder.embedding_dim

    def preprocess(self, inputs, prompt: str | None = None, **kwargs) -> dict[str, Any]:
        items = []
        for index, item in enumerate(inputs):
            if not isinstance(item, str):
                raise TypeError(f"Input {index}: EncoderModule takes text strings, got {type(item).__name__}.")
            items.append(TextInput(prompt, item) if prompt else parse_input(item, index))
        tokenized = self.encoder._tokenize_items(items, doc_max_length=self.encoder.config.doc_max_length)
        return self.encoder._collate(tokenized)

    def forward(self, features: dict[str, torch.Tensor], **kwargs) -> dict[str, torch.Tensor]:
        """``sentence_embedding`` (``Encoder.encode``'s maths), and ``token_embeddings`` with the per-token
        features laid out as sentence-transformers expects (padding on the right, where it trims it)."""
        if torch.is_grad_enabled():  # training: the plain path (oneDNN's linear op has no gradient)
            features["sentence_embedding"] = self.encoder(features).float()
            return features
        with onednn_linear(self.encoder.model, self.encoder.device):
            hidden = self.encoder._hidden_states(features)
            features["sentence_embedding"] = self.encoder.get_pooling(features, hidden).float()
        return _right_padded({**features, "token_embeddings": hidden.float()})

    def save(self, output_path: str, *args, **kwargs) -> None:
        self.encoder.save(output_path, merge_before_save=True)

    @classmethod
    def load(
        cls,
        model_name_or_path: str,
        subfolder: str = "",
        token: bool | str | None = None,
        cache_folder: str | None = None,
        revision: str | None = None,
        local_files_only: bool = False,
        model_kwargs: dict[str, Any] | None = None,
        **kwargs,
    ) -> EncoderModule:
        path = cls.load_dir_path(
            model_name_or_path,
            subfolder=subfolder,
            token=token,
            cache_folder=cache_folder,
            revision=revision,
            local_files_only=local_files_only,
        )
        model_kwargs = dict(model_kwargs or {})
        dtype = model_kwargs.pop("torch_dtype", model_kwargs.pop("dtype", None))
        attn = model_kwargs.pop("attn_implementation", None)
        return cls(Encoder.from_pretrained(path, torch_dtype=dtype, attn_implementation=attn, device="cpu"))


def _right_padded(features: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every per-token feature of a left-padded batch moved to the left of its row, padding after it."""
    mask = features["attention_mask"]
    width = mask.shape[1]
    pads = width - mask.sum(-1, keepdim=True)
    index = (torch.arange(width, device=mask.device) + pads) % width  # (B, L): row i rolled left by its padding
    out = dict(features)
    for key in ("input_ids", "attention_mask", "embed_mask", "token_embeddings"):
        value = features[key]
        out[key] = value.gather(1, index.view(*index.shape, *[1] * (value.dim() - 2)).expand_as(value))
    return out
