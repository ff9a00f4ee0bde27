"""``encode``'s other outputs, sentence-transformers' ``output_value``: each input's token states, or all its outputs.

``"sentence_embedding"`` (the default) is the pooled vector ``encode`` always returned. ``"token_embeddings"`` gives,
per input, the backbone's last hidden states over that input's tokens (instruction, template and special tokens
included, padding removed), a (n_i, d) tensor; ``None`` gives a dict per input holding ``input_ids``,
``attention_mask``, ``embed_mask`` (the pooled span), ``token_embeddings`` and ``sentence_embedding``. As in
sentence-transformers, ``truncate_dim`` applies to the sentence embedding only, and neither normalization nor
quantization applies; unlike there, every tensor is float32 on the CPU, as our sentence embeddings are (LLM2Vec's).

The rows are computed on padded batches (never packed) by ``batch_rows``, in this process or in a pool's workers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from tqdm.auto import tqdm

from diffusion_embedder.cpu_linear import onednn_linear

#: sentence-transformers' ``output_value`` choices.
OUTPUT_VALUES = ("sentence_embedding", "token_embeddings", None)


def check_output_value(output_value, precision: str) -> None:
    if output_value not in OUTPUT_VALUES:
        raise ValueError(
            f"Unknown output_value {output_value!r}; choose 'sentence_embedding', 'token_embeddings' or None "
            "(every output per input), as in sentence-transformers."
        )
    if output_value != "sentence_embedding" and precision != "float32":
        raise ValueError(
            f"precision={precision!r} quantizes sentence embeddings only; output_value={output_value!r} returns "
            "float token states: leave precision at 'float32'."
        )


def batch_rows(encoder, features: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """One padded batch's outputs per row, padding removed, float32 on the CPU (the caller holds inference mode)."""
    hidden = encoder._hidden_states(features)
    embeddings = encoder.get_pooling(features, hidden).float().cpu()
    hidden = hidden.float().cpu()
    features = {k: v.cpu() for k, v in features.items()}
    rows = []
    for i, embedding in enumerate(embeddings):
        real = features["attention_mask"][i].bool()
        row = {key: features[key][i][real] for key in ("input_ids", "attention_mask", "embed_mask")}
        rows.append({**row, "token_embeddings": hidden[i][real], "sentence_embedding": embedding})
    return rows


def run_rows(encoder, tokenized, batches, device, pool, show_progress_bar: bool) -> list[dict[str, torch.Tensor]]:
    """``batch_rows`` of every batch, in input order: on ``pool``'s workers, or here on ``device``."""
    featured = [encoder._collate([tokenized[i] for i in batch]) for batch in batches]
    rows: list = [None] * len(tokenized)
    if pool is not None:
        done = pool.run(featured, per_row=True)
    else:
        done = _run_here(encoder, featured, device)
    for index, batch_out in tqdm(done, total=len(batches), desc="Encoding", disable=not show_progress_bar):
        for position, row in zip(batches[index], batch_out, strict=True):
            rows[position] = row
    return rows


@contextlib.contextmanager
def inference_on(encoder, device) -> Iterator[torch.device]:
    """``encoder`` on ``device`` (moved there if given and elsewhere), in eval and inference mode with oneDNN linear
    layers on CPU; yields the device it runs on, and restores its training mode after (what every encode path does)."""
    if device is not None and torch.device(device) != encoder.device:
        encoder.to(device)
    was_training = encoder.training
    encoder.eval()
    try:
        with torch.inference_mode(), onednn_linear(encoder.model, encoder.device):
            yield encoder.device
    finally:
        encoder.train(was_training)


def _run_here(encoder, featured, device):
    with inference_on(encoder, device) as target:
        for index, features in enumerate(featured):
            yield index, batch_rows(encoder, {k: v.to(target) for k, v in features.items()})


def select(rows: list[dict[str, torch.Tensor]], output_value, truncate_dim: int | None, single: bool):
    """What ``encode`` returns for ``output_value``: token states per input, or the whole dicts."""
    if truncate_dim is not None:
        for row in rows:
            row["sentence_embedding"] = row["sentence_embedding"][:truncate_dim]
    out = [row["token_embeddings"] for row in rows] if output_value == "token_embeddings" else rows
    return out[0] if single else out
