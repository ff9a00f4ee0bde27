"""Pooling of last hidden states into one vector per text.

Every mode indexes the masks instead of assuming where padding sits, so the result is the same with
left padding, right padding or none: an embedding never depends on the batch it was computed in.
"""

from __future__ import annotations

import torch
from torch import nn

POOLING_MODES = ("mean", "weighted_mean", "eos_token", "last_token", "bos_token", "latent_attention", "mask_token")


def check_pooling_mode(mode: str) -> str:
    if mode not in POOLING_MODES:
        raise ValueError(f"Unknown pooling_mode {mode!r}; choose one of {', '.join(POOLING_MODES)}.")
    return mode


def masked_mean(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    weights = mask.to(hidden.dtype).unsqueeze(-1)
    return (hidden * weights).sum(1) / weights.sum(1).clamp_min(1e-9)


def weighted_mean(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """SGPT position weights 1..L over the masked tokens, in order, normalised (LLM2Vec's weighted_mean)."""
    weights = (mask.cumsum(-1) * mask).to(hidden.dtype)
    weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-9)
    return (hidden * weights.unsqueeze(-1)).sum(1)


def last_token(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    last = (positions * attention_mask).argmax(-1)
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]


def last_tokens_mask(attention_mask: torch.Tensor, k: int) -> torch.Tensor:
    """The last ``k`` real tokens of each row, wherever the padding sits."""
    from_end = attention_mask.flip(-1).cumsum(-1).flip(-1)
    return (attention_mask.bool() & (from_end <= k)).to(attention_mask.dtype)


def first_token(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    first = attention_mask.int().argmax(-1)
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), first]


class LatentAttentionPooling(nn.Module):
    """NV-Embed's latent attention: token states attend to a trainable latent array, then an MLP, then a masked mean.

    Residual connections make it start close to plain mean pooling, so it can be trained from a
    pretrained backbone without a cold start.

    Args:
        hidden_size: The backbone's hidden size.
        num_latents: Rows of the latent array.
        num_heads: Attention heads (must divide ``hidden_size``).
    """

    def __init__(self, hidden_size: int, num_latents: int = 512, num_heads: int = 8):
        super().__init__()
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size {hidden_size} is not divisible by latent_attention heads {num_heads}.")
        self.num_latents = num_latents
        self.num_heads = num_heads
        self.latents = nn.Parameter(torch.randn(num_latents, hidden_size) * hidden_size**-0.5)
        self.cross_attention = nn.MultiheadAttention(hidden_size, num_heads, batch_first=True)
        self.mlp = nn.Sequential(
            nn.Linear(hidden_size, 4 * hidden_size), nn.GELU(), nn.Linear(4 * hidden_size, hidden_size)
        )

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Pool token states.

        Args:
            hidden: Token states (B, L, d).
            mask: (B, L), 1 at the positions that count.

        Returns:
            The (B, d) pooled vectors.
        """
        latents = self.latents.to(hidden.dtype).unsqueeze(0).expand(hidden.shape[0], -1, -1)
        attended, _ = self.cross_attention(hidden, latents, latents, need_weights=False)
        states = hidden + attended
        states = states + self.mlp(states)
        return masked_mean(states, mask)


def pool_features(features: dict[str, torch.Tensor], hidden: torch.Tensor, config, latent=None) -> torch.Tensor:
    """Pool ``hidden`` (B, L, d) over a ``tokenize`` output's masks as ``config`` (an ``EncoderConfig``) says: the
    text span with ``skip_instruction``; an empty text, which has no span of its own, over all its tokens."""
    attention_mask = features["attention_mask"]
    pool_mask = attention_mask
    if config.skip_instruction and "embed_mask" in features:
        embed_mask = features["embed_mask"]
        has_span = embed_mask.sum(-1, keepdim=True) > 0
        pool_mask = torch.where(has_span, embed_mask, attention_mask)
    if latent is not None:
        hidden = hidden.to(next(latent.parameters()).dtype)
    return pool(hidden, attention_mask, pool_mask, config.pooling_mode, latent, config.mask_readout_tokens)


def pool(
    hidden: torch.Tensor,
    attention_mask: torch.Tensor,
    pool_mask: torch.Tensor,
    mode: str,
    latent: LatentAttentionPooling | None = None,
    readout_tokens: int = 1,
) -> torch.Tensor:
    """Pool ``hidden`` (B, L, d). ``pool_mask`` marks the tokens that count (the text span, or all tokens).

    ``mask_token`` averages the last ``readout_tokens`` positions: the mask tokens appended after the text.

    Args:
        hidden: The backbone's last hidden states (B, L, d).
        attention_mask: (B, L), 1 for tokens, 0 for pads.
        pool_mask: (B, L), the tokens that count.
        mode: One of ``POOLING_MODES``.
        latent: The latent-attention head (``latent_attention`` only).
        readout_tokens: How many appended mask tokens ``mask_token`` averages.

    Returns:
        The (B, d) pooled vectors.
    """
    check_pooling_mode(mode)
    if mode == "mask_token":
        return masked_mean(hidden, last_tokens_mask(attention_mask, readout_tokens))
    if mode == "mean":
        return masked_mean(hidden, pool_mask)
    if mode == "weighted_mean":
        return weighted_mean(hidden, pool_mask)
    if mode in ("eos_token", "last_token"):
        return last_token(hidden, attention_mask)
    if mode == "bos_token":
        return first_token(hidden, attention_mask)
    if latent is None:
        raise ValueError("latent_attention pooling needs its LatentAttentionPooling module.")
    return latent(hidden, pool_mask)
