"""The mteb 2.x model around an ``Encoder``: instructions on queries only, per-split lengths, cached documents.

Its ``ModelMeta`` carries the results identity of ``results.py`` (name and revision from the checkpoint
and its weights) and what else we know of the model (sizes, provenance, training data). Settings
overridden for one evaluation (``overrides``: pooling, attention, lengths) and non-default evaluation
settings go to ``experiment_kwargs``, so a checkpoint evaluated with its own settings sits at mteb's
standard path and ablations under ``experiments/``.
"""

from __future__ import annotations

import logging
import os
import re
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from mteb.models import ModelMeta
from mteb.models.abs_encoder import AbsEncoder
from mteb.models.model_meta import ScoringFunction
from mteb.types import PromptType

from diffusion_embedder.evaluation.cache import EmbeddingCache
from diffusion_embedder.evaluation.results import backbone_hash, checkpoint_name, model_revision, weights_hash
from diffusion_embedder.evaluation.sharding import CHUNK_SIZE, ShardedEncoder, load_checkpoint
from diffusion_embedder.evaluation.tasks import (
    DEFAULT_MAX_LENGTH_CAP,
    DEFAULT_QUERY_TEMPLATE,
    query_instruction,
    split_max_length,
)
from diffusion_embedder.files import read_json_object
from diffusion_embedder.similarity import SIMILARITY_FUNCTIONS, SIMILARITY_PAIRWISE, check_similarity_fn_name

if TYPE_CHECKING:
    from diffusion_embedder.encoder import Encoder

logger = logging.getLogger(__name__)

#: The run's config record, written into every checkpoint and run folder by ``training.checkpoints``.
TRAIN_CONFIG = "train_config.json"
PAPER = "https://arxiv.org/abs/2505.15045"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
#: The similarity functions mteb's ``ModelMeta`` can record and read back; euclidean and manhattan are recorded
#: as None (the model's own). The scores are ``MTEBEncoder.similarity``'s either way.
META_SCORING = {"cosine": ScoringFunction.COSINE, "dot": ScoringFunction.DOT_PRODUCT}


def encoder_settings(encoder) -> dict:
    config = getattr(encoder, "config", None)
    return dict(config.to_dict()) if config is not None and hasattr(config, "to_dict") else {}


def training_datasets(*folders: str | None) -> set[str] | None:
    """The training set named by the run's ``train_config.json`` (in the checkpoint folder or its run folder)."""
    for folder in folders:
        if not folder:
            continue
        for candidate in (folder, os.path.dirname(os.path.normpath(folder))):
            path = os.path.join(candidate, TRAIN_CONFIG)
            if os.path.isfile(path):
                try:
                    config = read_json_object(path)
                except (OSError, ValueError) as e:
                    logger.warning("%s Training data left unknown in the model metadata.", e)
                    return None
                data = config.get("data", config)
                name = data.get("dataset_name") if isinstance(data, dict) else None
                return {name} if isinstance(name, str) else None
    return None


def load_mteb_model(model_name: str, revision: str | None = None, **kwargs: Any) -> MTEBEncoder:
    """Rebuild an evaluated model from its mteb metadata: ``ModelMeta.loader`` (``meta.load_model()``).

    Args:
        model_name: The name the results are stored under.
        revision: The recorded revision, checked against the weights loaded now.
        **kwargs: The meta's ``loader_kwargs`` (where the weights are, their dtype) and its experiment
            kwargs: encoder settings are applied, evaluation-only ones (``top_k``, ...) belong to the run.

    Returns:
        The ``MTEBEncoder`` over the loaded checkpoint.
    """
    from diffusion_embedder.config import SETTING_NAMES

    overrides = {k: v for k, v in kwargs.items() if k in SETTING_NAMES}
    encoder = load_checkpoint(kwargs["base_model_name_or_path"], kwargs.get("peft_model_name_or_path"),
                              kwargs.get("torch_dtype"), kwargs.get("device"), **overrides)
    model = MTEBEncoder(encoder, name=model_name, overrides=overrides,
                        max_length_cap=kwargs.get("length_cap", DEFAULT_MAX_LENGTH_CAP),
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
    * documents go through ``cache`` when one is given;
    * scores are the encoder's own ``similarity_fn_name`` (mteb's ``AbsEncoder.similarity`` follows the meta,
      which names only cosine and dot);
    * every call is encoded in chunks (``sharding.py``), over the ranks when run under torchrun.
    """

    def __init__(
        self,
        encoder: Encoder,
        instructions: dict[str, str] | None = None,
        query_template: str = DEFAULT_QUERY_TEMPLATE,
        cache: EmbeddingCache | None = None,
        max_length_cap: int = DEFAULT_MAX_LENGTH_CAP,
        name: str | None = None,
        revision: str | None = None,
        extra_experiment_kwargs: dict[str, Any] | None = None,
        overrides: dict[str, Any] | None = None,
        source: dict[str, str | None] | None = None,
        device: str | list[str] | None = None,
        chunk_size: int = CHUNK_SIZE,
    ):
        """Wrap an encoder for mteb's evaluators.

        Args:
            encoder: The ``Encoder``.
            instructions: Task name -> query instruction (None: the task's own query prompt).
            query_template: How FollowIR joins a query and its instruction; holds ``{query}`` and
                ``{instruction}``.
            cache: Where document embeddings are kept between runs, or None.
            max_length_cap: The longest LongEmbed length split applied to ``max_length``.
            name: The name mteb stores the results under (None: derived from the checkpoint).
            revision: The results revision (None: a hash of the weights and settings).
            extra_experiment_kwargs: Evaluation settings that put the results under ``experiments/``.
            overrides: Encoder settings set for this evaluation only.
            source: ``base_model_name_or_path`` and ``peft_model_name_or_path`` the weights came from.
            device: What ``Encoder.encode`` gets as ``device`` (None: its own choice).
            chunk_size: The most texts one ``encode`` call gets (``sharding.py``: the unit a torchrun rank takes).

        Raises:
            ValueError: A ``query_template`` without ``{query}`` and ``{instruction}``.
        """
        if "{query}" not in query_template or "{instruction}" not in query_template:
            raise ValueError(f"query_template must contain {{query}} and {{instruction}}, got {query_template!r}.")
        self.model = encoder
        self.chunks = ShardedEncoder(encoder, device, chunk_size)
        self.instructions = dict(instructions or {})
        self.query_template = query_template
        self.cache = cache
        self.max_length_cap = max_length_cap
        settings = encoder_settings(encoder)
        # an encoder without the setting (a stand-in) scores as an Encoder does by default
        self.similarity_fn_name = check_similarity_fn_name(settings.get("similarity_fn_name", "cosine"))
        overrides = dict(overrides or {})
        self.weights = weights_hash(encoder) if hasattr(encoder, "state_dict") else None
        self.backbone = backbone_hash(encoder) if self.weights is not None else None
        if revision is None:
            if self.weights is None:
                raise ValueError("An encoder without state_dict() needs an explicit revision.")
            revision = model_revision(self.weights, settings, overrides, self.backbone)
        source = {k: v for k, v in (source or {}).items() if v}
        base = settings.get("base_model_name_or_path")
        if name is None:
            where = source.get("peft_model_name_or_path") or source.get("base_model_name_or_path")
            name = checkpoint_name(where or base or type(encoder).__name__)
        self.identity = {"name": name, "revision": revision, "weights": self.weights, "backbone": self.backbone,
                         "settings": settings}
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
            similarity_fn_name=META_SCORING.get(settings.get("similarity_fn_name", "cosine")),
            use_instructions=True,
            training_datasets=training_datasets(source.get("peft_model_name_or_path"),
                                                source.get("base_model_name_or_path")),
            adapted_from=base if adapted else None,
        )

    # ------------------------------------------------------------------ scores
    def similarity(self, embeddings1, embeddings2) -> torch.Tensor:
        """Every query against every document with the encoder's ``similarity_fn_name``: what retrieval ranks by."""
        return SIMILARITY_FUNCTIONS[self.similarity_fn_name](embeddings1, embeddings2)

    def similarity_pairwise(self, embeddings1, embeddings2) -> torch.Tensor:
        """Each vector against its partner with the encoder's ``similarity_fn_name`` (pair and STS tasks)."""
        a, b = (e if torch.is_tensor(e) else torch.as_tensor(np.asarray(e)) for e in (embeddings1, embeddings2))
        return SIMILARITY_PAIRWISE[self.similarity_fn_name](a.float(), b.float())

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
        kwargs = {"batch_size": batch_size, "show_progress_bar": show, **lengths}
        if prompt_type == PromptType.document and self.cache is not None:
            settings = {**encoder_settings(self.model), **lengths, "role": "document"}
            return self.chunks.encode_documents(
                [text for _, text in pairs],
                self.cache,
                identity=f"{self.identity['name']}@{self.identity['revision']}|{self.weights}|{self.backbone}",
                settings=settings,
                **kwargs,
            )
        return self.chunks.encode(pairs, **kwargs)
