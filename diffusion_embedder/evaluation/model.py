"""The mteb 2.x model around an ``Encoder``: instructions on queries only, per-split lengths, cached documents.

The ``ModelMeta`` name/revision come from the checkpoint: the revision is a hash of the weights the
forward pass uses (base with every adapter folded in, pooling head) and of the encoder settings, so a
retrained checkpoint never picks up another's scores, and the same weights loaded as base + adapter
or as an encoder folder get the same revision. Settings overridden for one evaluation (``overrides``:
pooling, attention, lengths) and non-default evaluation settings go to ``experiment_kwargs``, so a
checkpoint evaluated with its own settings sits at mteb's standard path and ablations under
``experiments/``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Iterator
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
#: Where the weights came from, not what they are: never part of the revision.
PROVENANCE_KEYS = ("base_model_name_or_path", "merged_adapters")
TRAIN_CONFIG = "train_config.json"
PAPER = "https://arxiv.org/abs/2505.15045"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def effective_state(module) -> Iterator[tuple[str, Any]]:
    """``(name, tensor)`` of the weights the forward pass uses, in name order, one tensor at a time.

    An unmerged LoRA layer is folded into its base weight exactly as ``merge_and_unload`` does (in
    place, in the base weight's dtype) and named as after merging, so an adapter kept beside its base
    and the same adapter merged give the same tensors. Only one merged weight exists at a time.
    """
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # pragma: no cover - peft is a dependency
        LoraLayer = ()  # noqa: N806
    state = module.state_dict()
    lora = {name: sub for name, sub in module.named_modules()
            if isinstance(sub, LoraLayer) and not getattr(sub, "merged", False)}
    sources: dict[str, str] = {}  # name after merging -> state_dict key
    for key in state:
        owner, sep, _ = key.partition(".lora_")
        if sep and owner in lora:
            continue
        final = key
        for suffix in (".base_layer.weight", ".base_layer.bias"):
            if key.endswith(suffix) and key[: -len(suffix)] in lora:
                final = key[: -len(suffix)] + suffix.replace(".base_layer", "")
        sources[final.replace("base_model.model.", "", 1)] = key
    for final in sorted(sources):
        key = sources[final]
        tensor = state[key]
        owner = key[: -len(".base_layer.weight")] if key.endswith(".base_layer.weight") else None
        if owner in lora:
            tensor = tensor.clone()
            for adapter in lora[owner].active_adapters:
                if adapter in lora[owner].lora_A:
                    tensor += lora[owner].get_delta_weight(adapter).to(tensor.device)
        yield final, tensor


def weights_hash(module) -> str:
    """SHA-256 over every effective tensor (name, dtype, shape, bytes), in name order."""
    import torch

    digest = hashlib.sha256()
    for name, tensor in effective_state(module):
        t = tensor.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{name}|{t.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(t.view(torch.uint8).numpy())
    return digest.hexdigest()


def encoder_settings(encoder) -> dict:
    config = getattr(encoder, "config", None)
    return dict(config.to_dict()) if config is not None and hasattr(config, "to_dict") else {}


def checkpoint_name(path: str) -> str:
    """``diffusion_embedder/<run>-checkpoint-<N>`` for a training checkpoint, else ``diffusion_embedder/<folder>``.

    Readable, and different for two runs' ``checkpoint-10``; the revision tells apart weights that share a name.
    """
    parts = [p for p in os.path.normpath(path).replace("\\", "/").split("/") if p not in ("", ".")]
    tail = parts[-1] if parts else "model"
    if re.fullmatch(r"checkpoint-\d+", tail) and len(parts) > 1:
        tail = f"{parts[-2]}-{tail}"
    return "diffusion_embedder/" + re.sub(r"[^A-Za-z0-9._-]+", "_", tail)


def model_revision(weights: str, settings: dict, overrides: dict | None = None) -> str:
    """Hash of the weights and of the settings the checkpoint brings (overridden ones are experiment kwargs)."""
    skip = {*PROVENANCE_KEYS, *(overrides or {})}
    stable = {k: v for k, v in settings.items() if k not in skip}
    blob = json.dumps({"weights": weights, "settings": stable}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def training_datasets(*folders: str | None) -> set[str] | None:
    """The training set named by the run's ``train_config.json`` (in the checkpoint folder or its run folder)."""
    for folder in folders:
        if not folder:
            continue
        for candidate in (folder, os.path.dirname(os.path.normpath(folder))):
            path = os.path.join(candidate, TRAIN_CONFIG)
            if os.path.isfile(path):
                try:
                    with open(path, encoding="utf-8") as f:
                        config = json.load(f)
                except (OSError, json.JSONDecodeError) as e:
                    logger.warning("%s unreadable (%s): training data left unknown in the model metadata.", path, e)
                    return None
                data = config.get("data", config) if isinstance(config, dict) else {}
                name = data.get("dataset_name") if isinstance(data, dict) else None
                return {name} if isinstance(name, str) else None
    return None


def load_mteb_model(model_name: str, revision: str | None = None, **kwargs: Any) -> MTEBEncoder:
    """``ModelMeta.loader``: rebuild the evaluated model from its metadata (``meta.load_model()``).

    ``kwargs`` are the meta's ``loader_kwargs`` (where the weights are, dtype) and its experiment
    kwargs: encoder settings are applied, evaluation-only ones (``top_k``...) belong to the run.
    """
    from diffusion_embedder import Encoder
    from diffusion_embedder.config import setting_fields

    settings = {f.name for f in setting_fields()}
    overrides = {k: v for k, v in kwargs.items() if k in settings}
    encoder = Encoder.from_pretrained(
        kwargs["base_model_name_or_path"],
        peft_model_name_or_path=kwargs.get("peft_model_name_or_path"),
        merge_peft=kwargs.get("peft_model_name_or_path") is not None,
        torch_dtype=kwargs.get("torch_dtype"),
        device=kwargs.get("device"),
        **overrides,
    )
    model = MTEBEncoder(encoder, name=model_name, overrides=overrides,
                        max_length_cap=kwargs.get("length_cap", 32768),
                        source={k: kwargs.get(k) for k in ("base_model_name_or_path", "peft_model_name_or_path")})
    if revision is not None and model.mteb_model_meta.revision != revision:
        logger.warning("%s: the weights loaded now have revision %s, not the recorded %s.",
                       model_name, model.mteb_model_meta.revision, revision)
    return model


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
        overrides: dict[str, Any] | None = None,
        source: dict[str, str | None] | None = None,
    ):
        """``overrides``: encoder settings set for this evaluation only (not the checkpoint's own);
        ``source``: ``base_model_name_or_path`` / ``peft_model_name_or_path`` the weights were loaded from."""
        if "{query}" not in query_template or "{instruction}" not in query_template:
            raise ValueError(f"query_template must contain {{query}} and {{instruction}}, got {query_template!r}.")
        self.model = encoder
        self.instructions = dict(instructions or {})
        self.query_template = query_template
        self.cache = cache
        self.max_length_cap = max_length_cap
        settings = encoder_settings(encoder)
        overrides = dict(overrides or {})
        self.weights = weights_hash(encoder) if hasattr(encoder, "state_dict") else None
        if revision is None:
            if self.weights is None:
                raise ValueError("An encoder without state_dict() needs an explicit revision.")
            revision = model_revision(self.weights, settings, overrides)
        source = {k: v for k, v in (source or {}).items() if v}
        base = settings.get("base_model_name_or_path")
        if name is None:
            where = source.get("peft_model_name_or_path") or source.get("base_model_name_or_path")
            name = checkpoint_name(where or base or type(encoder).__name__)
        self.identity = {"name": name, "revision": revision, "weights": self.weights, "settings": settings}
        experiment = {**overrides, **(extra_experiment_kwargs or {})}
        experiment = {k: v for k, v in experiment.items() if v is not None}
        self.mteb_model_meta = ModelMeta(**self._meta_fields(encoder, name, revision, settings, source),
                                         experiment_kwargs=experiment or None)

    @staticmethod
    def _meta_fields(encoder, name: str, revision: str, settings: dict, source: dict) -> dict[str, Any]:
        """What we know of the model: sizes from the weights, provenance from the settings and the run folder."""
        base = settings.get("base_model_name_or_path") or None
        loaded_from = source.get("peft_model_name_or_path") or source.get("base_model_name_or_path")
        adapted = bool(settings.get("merged_adapters")) or (loaded_from is not None and loaded_from != base)
        n_parameters = memory = n_embedding = None
        if hasattr(encoder, "state_dict"):
            # LoRA factors are folded into their base weights, so they add nothing
            tensors = [t for k, t in encoder.state_dict().items() if ".lora_" not in k]
            n_parameters = sum(t.numel() for t in tensors)
            memory = round(sum(t.numel() * t.element_size() for t in tensors) / 2**20, 1)
            get_embeddings = getattr(getattr(encoder, "model", None), "get_input_embeddings", None)
            if get_embeddings is not None:
                n_embedding = get_embeddings().weight.numel()
        hub = loaded_from if loaded_from and _HUB_ID.match(loaded_from) and not os.path.exists(loaded_from) else None
        dtype = None
        if hasattr(encoder, "parameters"):
            first = next(iter(encoder.parameters()), None)
            dtype = str(first.dtype).removeprefix("torch.") if first is not None else None
        loader_kwargs = {**source, "torch_dtype": dtype} if source else {}
        return dict(
            loader=load_mteb_model if source.get("base_model_name_or_path") else None,
            loader_kwargs={k: v for k, v in loader_kwargs.items() if v is not None},
            name=name,
            revision=revision,
            release_date=None,
            languages=None,
            n_parameters=n_parameters,
            n_embedding_parameters=n_embedding,
            memory_usage_mb=memory,
            max_tokens=settings.get("max_length"),
            embed_dim=getattr(encoder, "embedding_dim", None),
            license=None,
            open_weights=True,
            public_training_code=None,
            public_training_data=None,
            framework=["PyTorch"],
            reference=f"https://huggingface.co/{hub}" if hub else PAPER,
            similarity_fn_name=ScoringFunction.COSINE,
            use_instructions=True,
            training_datasets=training_datasets(source.get("peft_model_name_or_path"),
                                                source.get("base_model_name_or_path")),
            adapted_from=base if adapted else None,
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
        return [[self.task_instruction(task_metadata), t] for t in texts]

    def task_instruction(self, task_metadata) -> str:
        """The instruction this model gives the task's queries (the results record it: another one scores again)."""
        return query_instruction(task_metadata.name, self.instructions, task_metadata.prompt)

    def _encode_pairs(
        self, pairs: list[list[str]], batch_size: int, show_progress_bar: bool, lengths: dict
    ) -> np.ndarray:
        out = self.model.encode(
            pairs, batch_size=batch_size, show_progress_bar=show_progress_bar, convert_to_numpy=True, **lengths
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
        # LongEmbed length splits: the split's length is this call's max_length and doc_max_length.
        length = split_max_length(hf_split, self.max_length_cap)
        lengths = {} if length is None else {"max_length": length, "doc_max_length": length}
        if prompt_type == PromptType.document and self.cache is not None:
            settings = {**encoder_settings(self.model), **lengths, "role": "document"}
            texts = [text for _, text in pairs]
            return self.cache.get_or_encode(
                texts,
                lambda missing: self._encode_pairs([["", t] for t in missing], batch_size, show, lengths),
                identity=f"{self.identity['name']}@{self.identity['revision']}|{self.weights}",
                settings=settings,
            )
        return self._encode_pairs(pairs, batch_size, show, lengths)
