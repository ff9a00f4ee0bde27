"""The mteb 2.x model around an ``Encoder``: instructions on queries only, per-split lengths, cached documents.

The ``ModelMeta`` name/revision come from the checkpoint: the revision is a hash of the weights
actually loaded (base, merged and unmerged adapters, pooling head) and of the encoder settings, so a
retrained checkpoint never picks up another's cached scores. Attention and pooling go to
``experiment_kwargs`` so ablations of one checkpoint sit side by side under one revision.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from typing import Any

import numpy as np
from mteb.models import ModelMeta
from mteb.models.abs_encoder import AbsEncoder
from mteb.models.model_meta import ScoringFunction
from mteb.types import PromptType

from diffusion_embedder.evaluation.cache import EmbeddingCache
from diffusion_embedder.evaluation.tasks import query_instruction, split_max_length

logger = logging.getLogger(__name__)

#: How FollowIR's per-query instruction joins the query (upstream and mteb: query first).
DEFAULT_QUERY_TEMPLATE = "{query} {instruction}"
ABLATION_KEYS = ("enable_bidirectional", "pooling_mode")


def weights_hash(module) -> str:
    """SHA-256 over every tensor of ``module.state_dict()`` (name, dtype, shape, bytes), in name order."""
    import torch

    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        t = tensor.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{name}|{t.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(t.view(torch.uint8).numpy())
    return digest.hexdigest()


def encoder_settings(encoder) -> dict:
    config = getattr(encoder, "config", None)
    return dict(config.to_dict()) if config is not None and hasattr(config, "to_dict") else {}


def checkpoint_name(path: str) -> str:
    """``diffusion_embedder/<last path part>``: readable; uniqueness comes from the revision."""
    tail = os.path.basename(os.path.normpath(path)) or "model"
    return f"diffusion_embedder/{tail}"


def model_revision(weights: str, settings: dict) -> str:
    stable = {k: v for k, v in settings.items() if k not in ABLATION_KEYS and k != "base_model_name_or_path"}
    blob = json.dumps({"weights": weights, "settings": stable}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


class MTEBEncoder(AbsEncoder):
    """An ``Encoder`` as an mteb ``AbsEncoder``.

    * queries: ``[task instruction, text]`` with the instruction from ``instructions`` (the shipped
      ``task_to_instructions.json`` or the user's file), else the task's own query prompt;
      FollowIR's per-query instruction is joined to the query by ``query_template``;
    * documents: ``["", title + " " + text]``, never an instruction;
    * LongEmbed length splits (``test_4096``...) set ``max_length`` and ``doc_max_length`` to the
      split's length (at most ``max_length_cap``) for that split;
    * documents go through ``cache`` when one is given.
    """

    def __init__(
        self,
        encoder,
        instructions: dict[str, str] | None = None,
        query_template: str = DEFAULT_QUERY_TEMPLATE,
        cache: EmbeddingCache | None = None,
        max_length_cap: int = 32768,
        name: str | None = None,
        revision: str | None = None,
        extra_experiment_kwargs: dict[str, Any] | None = None,
    ):
        if "{query}" not in query_template or "{instruction}" not in query_template:
            raise ValueError(f"query_template must contain {{query}} and {{instruction}}, got {query_template!r}.")
        self.model = encoder
        self.instructions = dict(instructions or {})
        self.query_template = query_template
        self.cache = cache
        self.max_length_cap = max_length_cap
        settings = encoder_settings(encoder)
        self.weights = weights_hash(encoder) if hasattr(encoder, "state_dict") else None
        if revision is None:
            if self.weights is None:
                raise ValueError("An encoder without state_dict() needs an explicit revision.")
            revision = model_revision(self.weights, settings)
        if name is None:
            source = settings.get("base_model_name_or_path") or type(encoder).__name__
            name = checkpoint_name(source)
        self.identity = {"name": name, "revision": revision, "weights": self.weights, "settings": settings}
        experiment = {
            "bidirectional": settings.get("enable_bidirectional"),
            "pooling": settings.get("pooling_mode"),
            **(extra_experiment_kwargs or {}),
        }
        experiment = {k: v for k, v in experiment.items() if v is not None}
        self.mteb_model_meta = ModelMeta(
            loader=None,
            name=name,
            revision=revision,
            release_date=None,
            languages=None,
            n_parameters=sum(p.numel() for p in encoder.parameters()) if hasattr(encoder, "parameters") else None,
            memory_usage_mb=None,
            max_tokens=settings.get("max_length"),
            embed_dim=getattr(encoder, "embedding_dim", None),
            license=None,
            open_weights=None,
            public_training_code=None,
            public_training_data=None,
            framework=["PyTorch"],
            similarity_fn_name=ScoringFunction.COSINE,
            use_instructions=True,
            training_datasets=None,
            experiment_kwargs=experiment or None,
        )

    # ------------------------------------------------------------------ inputs
    def _query_texts(self, batch: dict) -> list[str]:
        instructions = batch.get("instruction")
        if not instructions or "query" not in batch:
            return list(batch["text"])
        return [
            self.query_template.format(query=q, instruction=i).strip() if i else q
            for q, i in zip(batch["query"], instructions, strict=True)
        ]

    def inputs_for(self, inputs, task_metadata, prompt_type: PromptType | None) -> list[list[str]]:
        """The ``[instruction, text]`` pairs the encoder receives for one mteb ``encode`` call."""
        is_document = prompt_type == PromptType.document
        texts: list[str] = []
        for batch in inputs:
            texts.extend(batch["text"] if is_document else self._query_texts(batch))
        if is_document:
            return [["", t] for t in texts]
        instruction = query_instruction(task_metadata.name, self.instructions, task_metadata.prompt)
        return [[instruction, t] for t in texts]

    @contextlib.contextmanager
    def _split_lengths(self, hf_split: str):
        """LongEmbed: the split's length becomes max_length and doc_max_length while it is encoded."""
        length = split_max_length(hf_split, self.max_length_cap)
        config = getattr(self.model, "config", None)
        if length is None or config is None:
            yield
            return
        saved = (config.max_length, config.doc_max_length)
        config.max_length = config.doc_max_length = length
        try:
            yield
        finally:
            config.max_length, config.doc_max_length = saved

    def _encode_pairs(self, pairs: list[list[str]], batch_size: int, show_progress_bar: bool) -> np.ndarray:
        out = self.model.encode(
            pairs, batch_size=batch_size, show_progress_bar=show_progress_bar, convert_to_numpy=True
        )
        return np.asarray(out, dtype=np.float32)

    def encode(
        self,
        inputs,
        *,
        task_metadata,
        hf_split: str,
        hf_subset: str,
        prompt_type: PromptType | None = None,
        **kwargs: Any,
    ) -> np.ndarray:
        pairs = self.inputs_for(inputs, task_metadata, prompt_type)
        batch_size = int(kwargs.get("batch_size") or 32)
        show = bool(kwargs.get("show_progress_bar", False))
        with self._split_lengths(hf_split):
            if prompt_type == PromptType.document and self.cache is not None:
                settings = {**encoder_settings(self.model), "role": "document"}
                texts = [text for _, text in pairs]
                return self.cache.get_or_encode(
                    texts,
                    lambda missing: self._encode_pairs([["", t] for t in missing], batch_size, show),
                    identity=f"{self.identity['name']}@{self.identity['revision']}|{self.weights}",
                    settings=settings,
                )
            return self._encode_pairs(pairs, batch_size, show)
