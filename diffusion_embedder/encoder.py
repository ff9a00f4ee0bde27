"""The Encoder: a bidirectional backbone, LLM2Vec's input format and a pooling head, with ``encode()``.

This module is the ``nn.Module`` itself (model, tokenizer, settings, ``tokenize``, collation, ``forward``)
and LLM2Vec's / sentence-transformers' API over it. The work behind that API lives a floor below, each
module given the encoder (or its class) rather than importing it: ``loading`` (``from_pretrained``),
``inference`` (``encode``), ``folders`` (``save``) and ``export`` (``save(format=...)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from torch import nn

from diffusion_embedder import backbones, folders, inference, loading, tokenization
from diffusion_embedder import packing as packing_mod
from diffusion_embedder.compat import EncoderCompat
from diffusion_embedder.config import SETTING_NAMES, EncoderConfig, check_values, resolve_config
from diffusion_embedder.export import export
from diffusion_embedder.pooling import LatentAttentionPooling, pool_features
from diffusion_embedder.similarity import SIMILARITY_FUNCTIONS
from diffusion_embedder.templates import (
    TextInput,
    eos_suffix_for,
    left_padded,
    parse_inputs,
)
from diffusion_embedder.tokenization import Tokenized
from diffusion_embedder.values import checked

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from diffusion_embedder.multiprocess import DevicePool


class Encoder(EncoderCompat, nn.Module):
    """Text encoder over a (bidirectional) decoder LM (= ``LLM2Vec``); public keywords checked (``values.checked``)."""

    @checked(leave=SETTING_NAMES)
    def __init__(
        self,
        model: nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        pooling_mode: str | EncoderConfig | None = None,
        max_length: int | None = None,
        doc_max_length: int | None = None,
        skip_instruction: bool | None = None,
        *,
        config: EncoderConfig | None = None,
        latent: LatentAttentionPooling | None = None,
        **settings: Any,
    ):
        """Wrap a loaded backbone, in LLM2Vec's argument order: ``LLM2Vec(model, tokenizer, "mean", 512, 400, True)``.

        Most code loads with ``from_pretrained`` instead.

        Args:
            model: The backbone (a transformers model whose forward returns ``last_hidden_state``).
            tokenizer: Its tokenizer; a copy padded on the left is used where it pads on the right.
            pooling_mode: How token states become one vector, or an ``EncoderConfig`` holding every setting.
            max_length: Tokens per input, instruction and template included.
            doc_max_length: Tokens of the text itself kept at ``encode`` time.
            skip_instruction: Pool over the text only, not the instruction's tokens.
            config: Every setting at once; the keyword settings replace its values.
            latent: A trained latent-attention head (``latent_attention`` pooling); None builds a fresh one.
            **settings: Other ``EncoderConfig`` settings by name.

        Raises:
            TypeError: An ``EncoderConfig`` given third together with other settings.
            ValueError: A setting outside its rule, or ``mask_token`` pooling on a backbone without a mask token.
        """
        super().__init__()
        if isinstance(pooling_mode, EncoderConfig):
            if config is not None or (max_length, doc_max_length, skip_instruction) != (None, None, None):
                raise TypeError("An EncoderConfig given third holds every setting: pass the others as keywords.")
            config, pooling_mode = pooling_mode, None
        positional = dict(
            pooling_mode=pooling_mode, max_length=max_length, doc_max_length=doc_max_length,
            skip_instruction=skip_instruction,
        )
        settings = {**{k: v for k, v in positional.items() if v is not None}, **settings}
        check_values(settings, "encoder settings")  # each by its own definition, before the model is looked at
        self.model = model
        self.tokenizer = left_padded(tokenizer)  # a copy where the caller's lacks LLM2Vec's padding
        if config is None:
            provenance = {
                "base_model_name_or_path": getattr(model.config, "name_or_path", "") or "",
                "model_type": getattr(model.config, "model_type", "") or "",
            }
            config = resolve_config(explicit={**provenance, **settings})
        elif settings:
            config = config.replace(**settings)
        self.latent = latent
        #: Keep only the first ``truncate_dim`` dimensions of every embedding (Matryoshka-style); None keeps all.
        self.truncate_dim: int | None = None
        self._pool_workers = None
        self._set_config(config)

    def _set_config(self, config: EncoderConfig) -> None:
        """Install ``config`` (immutable): derive the EOS string and build the latent head it needs."""
        if config.pooling_mode == "eos_token" and config.eos_suffix is None:
            spec = backbones.get_spec(config.model_type) if config.model_type else None
            suffix = eos_suffix_for(
                [config.base_model_name_or_path], spec.eos_format if spec else "{eos}", self.tokenizer.eos_token
            )
            config = config.replace(eos_suffix=suffix)
        self._mask_readout_ids(config)  # refuse mask_token pooling on a backbone without a mask token, now
        if config.pooling_mode == "latent_attention" and self.latent is None:
            self.latent = LatentAttentionPooling(
                self.embedding_dim, config.latent_num_latents, config.latent_num_heads
            ).to(self.device)
        self.config = config

    # ------------------------------------------------------------------ loading
    @classmethod
    @checked(leave=SETTING_NAMES)
    def from_pretrained(
        cls,
        base_model_name_or_path: str,
        peft_model_name_or_path: str | None = None,
        merge_peft: bool = False,
        enable_bidirectional: bool | None = None,
        pooling_mode: str | None = None,
        max_length: int | None = None,
        doc_max_length: int | None = None,
        skip_instruction: bool | None = None,
        torch_dtype: torch.dtype | str | None = None,
        attn_implementation: str | None = None,
        device: str | torch.device | None = None,
        prompt_template: str | None = None,
        mask_readout_tokens: int | None = None,
        prompts: dict[str, str] | None = None,
        similarity_fn_name: str | None = None,
        **kwargs: Any,
    ) -> Encoder:
        """Load a plain checkpoint, an LLM2Vec checkpoint or one of our encoder folders, with an adapter on top.

        Each setting is resolved once, from the highest of these that gives it: your arguments, LLM2Vec's
        settings for known checkpoint names (not for our folders, which saved theirs), the checkpoint's
        ``encoder_config.json``, its ``llm2vec_config.json`` (both read from the adapter's folder when one is
        given, as LLM2Vec does), the defaults. The result, ``encoder.config``, is immutable. An adapter stored
        inside the base folder (LLM2Vec's MNTP repos) is merged first. Nothing loads from remote code.

        Args:
            base_model_name_or_path: A hub name or folder: plain weights (safetensors), an LLM2Vec checkpoint
                or an encoder folder written by ``save``.
            peft_model_name_or_path: A LoRA adapter trained over the base, or None.
            merge_peft: Merge that adapter into the weights; False keeps it a trainable ``PeftModel``.
            enable_bidirectional: Remove the causal mask (False: the paper's causal ablation). Default True.
            pooling_mode: How token states become one vector: a key of ``pooling.POOLING_MODES``. Default
                ``"mean"``.
            max_length: Tokens per input, instruction and template included; longer inputs are cut. Default 512.
            doc_max_length: Tokens of the text itself kept at ``encode`` time. Default 400.
            skip_instruction: Pool over the text only, not the instruction's tokens. Default True.
            torch_dtype: The weights' dtype: a ``torch.dtype`` or ``"auto"``, ``"bfloat16"``, ``"float16"``,
                ``"float32"``. None loads float32; use bfloat16 on a GPU.
            attn_implementation: transformers' attention kernel (``"sdpa"``, ``"eager"``, ``"varlen"``, ...).
                None: its default for the model type.
            device: Where the model goes (``"cuda:0"``, ``"cpu"``). None: CUDA if there is a GPU, else the CPU
                (unless ``device_map`` places the model).
            prompt_template: A chat wrapper with one ``{text}`` slot, used at training and evaluation alike.
                None: none, or the known checkpoint's.
            mask_readout_tokens: ``mask_token`` pooling: how many mask tokens are appended and averaged.
                Default 1.
            prompts: Named instructions, e.g. ``{"query": "Given a question, retrieve ..."}``, used by
                ``encode(prompt_name=...)``, ``encode_query`` and ``encode_document``.
            similarity_fn_name: What ``similarity`` computes: ``"cosine"`` (default), ``"dot"``,
                ``"euclidean"`` or ``"manhattan"``.
            **kwargs: Another ``EncoderConfig`` setting by name (``eos_suffix``, ``latent_num_latents``, ...);
                anything else (``device_map``, ``revision``, ``attention_dropout``, ...) goes to the backbone's
                ``from_pretrained``.

        Returns:
            The encoder (an ``nn.Module``), its settings in ``encoder.config``.

        Raises:
            FileNotFoundError: No safetensors weights or adapter at the path, or an adapter path without one.
            TypeError: A keyword that is neither a setting, a loading option nor a field of the model's config.
            ValueError: A setting outside its rule, an unknown ``attn_implementation`` or ``torch_dtype``, or
                ``mask_token`` pooling on a backbone without a mask token.
            backbones.AttentionSelfTestError: The loaded model does not attend as asked (bidirectional or
                causal).
        """
        explicit = dict(
            enable_bidirectional=enable_bidirectional, pooling_mode=pooling_mode, max_length=max_length,
            doc_max_length=doc_max_length, skip_instruction=skip_instruction, prompt_template=prompt_template,
            mask_readout_tokens=mask_readout_tokens, prompts=prompts, similarity_fn_name=similarity_fn_name,
        )
        return loading.from_pretrained(
            cls, base_model_name_or_path, peft_model_name_or_path, merge_peft, explicit, torch_dtype,
            attn_implementation, device, kwargs,
        )

    # ------------------------------------------------------------------ input format
    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def embedding_dim(self) -> int:
        return self.model.config.hidden_size

    def _mask_readout_ids(self, config: EncoderConfig | None = None) -> list[int]:
        """The K mask-token ids appended for ``mask_token`` pooling (DiffRetriever's readout); [] otherwise."""
        config = config or self.config
        if config.pooling_mode != "mask_token":
            return []
        mask_id = getattr(self.model.config, "mask_token_id", None)
        if mask_id is None:
            raise ValueError(
                f"pooling_mode='mask_token' needs a backbone with a mask token (Dream, LLaDA); "
                f"{config.model_type or type(self.model).__name__!r} has no mask_token_id in its config."
            )
        return [int(mask_id)] * config.mask_readout_tokens

    def _tokenize_items(
        self,
        items: list[TextInput],
        doc_max_length: int | None = None,
        warn: bool = True,
        max_length: int | None = None,
        config: EncoderConfig | None = None,
    ) -> list[Tokenized]:
        """``tokenization.tokenize_items`` with this encoder's tokenizer, readout tokens and settings (or ``config``:
        one call's, so that its messages name the lengths in force)."""
        config = config or self.config
        return tokenization.tokenize_items(
            self.tokenizer, config, self._mask_readout_ids(config), items, doc_max_length, warn, max_length
        )

    def _collate(self, batch: Sequence[Tokenized]) -> dict[str, torch.Tensor]:
        """Left-pad (LLM2Vec's layout); ``embed_mask`` marks each row's pooled span."""
        return packing_mod.pad([(t.input_ids, t.span) for t in batch], self.tokenizer.pad_token_id)

    def _collate_packed(self, batch: Sequence[Tokenized], pack_length: int, bounded: bool = False) -> dict:
        """Packed rows of ``pack_length``; ``bounded``: row count padded to a power of two (``packing.pack``)."""
        return packing_mod.pack(
            [(t.input_ids, t.span) for t in batch], pack_length, self.tokenizer.pad_token_id, bounded
        )

    def tokenize(
        self, inputs: Sequence[str | Sequence[str]], *, pack_length: int | None = None
    ) -> dict[str, torch.Tensor]:
        """Tokenize for training (``forward``'s input): texts are cut at ``max_length`` only, as upstream did.

        Args:
            inputs: Strings or ``[instruction, text]`` pairs.
            pack_length: Pack the texts into padding-free rows of at most this many tokens; None: padded rows.
                ``forward`` gives the same embeddings for both.

        Returns:
            ``input_ids``, ``attention_mask`` and ``embed_mask`` (the pooled span) tensors; packed rows add their
            offsets (``diffusion_embedder.packing``).
        """
        tokenized = self._tokenize_items(parse_inputs(inputs), warn=False)
        return self._collate(tokenized) if pack_length is None else self._collate_packed(tokenized, pack_length)

    # ------------------------------------------------------------------ forward
    def forward(self, features: dict[str, torch.Tensor]) -> torch.Tensor:
        """Pooled embeddings, differentiable (the training path).

        Args:
            features: A ``tokenize`` output, padded or packed.

        Returns:
            The (B, d) embeddings.
        """
        return self.get_pooling(features, self._hidden_states(features))

    def _hidden_states(self, features: dict[str, torch.Tensor]) -> torch.Tensor:
        return packing_mod.hidden_states(self.model, features)

    def get_pooling(self, features: dict[str, torch.Tensor], last_hidden_states: torch.Tensor) -> torch.Tensor:
        """LLM2Vec's: pool hidden states over the masks of ``features`` (the text span with ``skip_instruction``).

        Unlike LLM2Vec's, it leaves ``features`` as they were and works with any padding side.

        Args:
            features: A ``tokenize`` output.
            last_hidden_states: The backbone's last hidden states (B, L, d).

        Returns:
            The (B, d) embeddings.
        """
        return pool_features(features, last_hidden_states, self.config, self.latent)

    # ------------------------------------------------------------------ encode
    @checked
    def encode(
        self,
        sentences: str | Sequence[str | Sequence[str]],
        batch_size: int = 32,
        show_progress_bar: bool = True,
        convert_to_numpy: bool = False,
        convert_to_tensor: bool = False,
        device: str | torch.device | Sequence[str] | None = None,
        *,
        prompt: str | None = None,
        prompt_name: str | None = None,
        output_value: str | None = "sentence_embedding",
        normalize_embeddings: bool = False,
        truncate_dim: int | None = None,
        precision: str | None = "float32",
        pool: DevicePool | None = None,
        chunk_size: int | None = None,
        max_tokens_per_batch: int | None = None,
        max_length: int | None = None,
        doc_max_length: int | None = None,
        packing: bool | Literal["auto"] = "auto", compile: bool = False,
    ) -> torch.Tensor | np.ndarray | list:
        """Embed texts, in input order.

        The positional arguments are LLM2Vec's, in its order; newer ones are keyword-only. Texts are batched by
        length, and a text's vector does not depend on the batch it is computed in (the documentation's
        "The encoder in a notebook" page goes through each step).

        Args:
            sentences: Strings, ``[instruction, text]`` pairs (the instruction is attended to and, with
                ``skip_instruction``, left out of pooling) or LLM2Vec's ``[instruction, text, id]`` triples. A
                single string gives a single vector.
            batch_size: Texts per forward pass (with packing: rows per forward).
            show_progress_bar: Show a progress bar over the batches.
            convert_to_numpy: Return a numpy array instead of a tensor.
            convert_to_tensor: Accepted for sentence-transformers' signature; a tensor is the default anyway.
            device: A device, or a list of devices, each then served by a persistent worker (what happens
                when several GPUs are visible). None: the model's device.
            prompt: The instruction of every plain-string input: ``encode(texts, prompt=p)`` equals
                ``encode([[p, t] for t in texts])``.
            prompt_name: A key of ``config.prompts``, whose prompt is used as ``prompt``.
            output_value: What each input gives, with sentence-transformers' meanings:
                ``"sentence_embedding"`` its pooled vector; ``"token_embeddings"`` its last hidden states, one
                ``(n_i, d)`` float32 tensor per input, padding removed; None a dict per input holding both, with
                its ``input_ids`` and ``attention_mask``.
            normalize_embeddings: Scale each vector to unit L2 norm (after ``truncate_dim``).
            truncate_dim: Keep the first dimensions only (Matryoshka-style). None: ``self.truncate_dim``, which
                is None (every dimension) unless set.
            precision: ``"float32"`` (or None), or ``"int8"``, ``"uint8"``, ``"binary"``, ``"ubinary"``,
                quantized as sentence-transformers does, with the buckets taken from this call's embeddings.
            pool: Workers from ``start_multi_process_pool`` that run the batches instead of this process
                (sentence-transformers' ``pool``).
            chunk_size: Accepted for sentence-transformers' signature, where it sets how many texts a pool
                worker gets at once; here workers pull one batch at a time, so it changes nothing.
            max_tokens_per_batch: Cut batches by padded size (rows x longest row) instead of by ``batch_size``,
                so long texts do not exhaust memory and short ones fill it.
            max_length: ``config.max_length`` for this call only.
            doc_max_length: ``config.doc_max_length`` for this call only.
            packing: Pack texts into padding-free rows: True, False, or ``"auto"`` (where it is faster:
                ``packing.AUTO_PACKING``; on CUDA with the varlen kernel, not on the CPU). The vectors are the
                same.
            compile: Compile each decoder layer once, in place (``torch.compile``); later calls reuse them.
                Refused where it cannot pay: on the CPU, and where varlen runs its per-text reference path.

        Returns:
            A float32 CPU tensor ``(N, d)`` (LLM2Vec's default, whatever the model's dtype), ``(d,)`` for a
            single string; a numpy array with ``convert_to_numpy``; int8/uint8 values with those precisions;
            with another ``output_value``, a list of tensors or of dicts.

        Raises:
            TypeError: ``sentences`` of another type, an input that is neither a string nor a pair, or a
                ``pool`` that ``start_multi_process_pool`` did not make.
            ValueError: A pair of the wrong length, text that is not valid Unicode, ``batch_size`` < 1, an
                unknown ``precision`` or ``output_value``, ``prompt`` with ``prompt_name`` or with an input
                that has an instruction, ``pool`` with ``device``, ``compile`` with several devices or where it
                cannot pay.
        """
        return inference.encode(
            self, sentences, batch_size, show_progress_bar, convert_to_numpy, convert_to_tensor, device,
            prompt=prompt, prompt_name=prompt_name, output_value=output_value,
            normalize_embeddings=normalize_embeddings, truncate_dim=truncate_dim, precision=precision, pool=pool,
            chunk_size=chunk_size, max_tokens_per_batch=max_tokens_per_batch, max_length=max_length,
            doc_max_length=doc_max_length, packing=packing, compile=compile,
        )

    def encode_query(self, sentences: str | Sequence[str | Sequence[str]], *args: Any, **kwargs: Any) -> Any:
        """``encode`` for queries: with the encoder's ``query`` prompt, when it has one (sentence-transformers').

        Args:
            sentences: As for ``encode``.
            *args: ``encode``'s other positional arguments.
            **kwargs: ``encode``'s keyword arguments; a ``prompt`` or ``prompt_name`` given here wins.

        Returns:
            What ``encode`` returns.
        """
        return self.encode(sentences, *args, **inference.role_kwargs("query", self.config.prompts, kwargs))

    def encode_document(self, sentences: str | Sequence[str | Sequence[str]], *args: Any, **kwargs: Any) -> Any:
        """``encode`` for documents: with the encoder's ``document`` prompt, when it has one (sentence-transformers').

        Args:
            sentences: As for ``encode``.
            *args: ``encode``'s other positional arguments.
            **kwargs: ``encode``'s keyword arguments; a ``prompt`` or ``prompt_name`` given here wins.

        Returns:
            What ``encode`` returns.
        """
        return self.encode(sentences, *args, **inference.role_kwargs("document", self.config.prompts, kwargs))

    def similarity(self, embeddings1: torch.Tensor | np.ndarray | list, embeddings2: torch.Tensor | np.ndarray | list
                   ) -> torch.Tensor:
        """Score every vector of one set against every vector of another, with ``config.similarity_fn_name``.

        The functions are sentence-transformers': ``cosine``, ``dot``, and the negative ``euclidean`` and
        ``manhattan`` distances (higher is more similar, for all four).

        Args:
            embeddings1: ``(n, d)`` or ``(d,)`` vectors: a tensor, a numpy array or a list of vectors.
            embeddings2: ``(m, d)`` or ``(d,)`` vectors, likewise.

        Returns:
            An ``(n, m)`` float tensor of scores.
        """
        return SIMILARITY_FUNCTIONS[self.config.similarity_fn_name](embeddings1, embeddings2)

    # ------------------------------------------------------------------ saving
    @checked
    def save(
        self, output_path: str, merge_before_save: bool = False, save_config: bool = True, *, format: str = "encoder"
    ) -> None:
        """Write an encoder folder: weights or adapter (safetensors), tokenizer, settings and a model card.

        LLM2Vec's signature. ``Encoder.from_pretrained(output_path)`` gives the same vectors again; a merged
        folder also loads in LLM2Vec 0.2.3 (its tokenizer and config files are written in forms transformers
        4.4x reads).

        Args:
            output_path: The folder to write (created if missing).
            merge_before_save: Merge a LoRA adapter into the saved weights. Unlike LLM2Vec's ``save``, this
                encoder keeps its adapter, so its vectors do not change by saving.
            save_config: Write the settings (``llm2vec_config.json``, ``encoder_config.json``); False leaves
                them out, as LLM2Vec does.
            format: ``"encoder"``, or ``"sentence-transformers"`` to also make the folder a model
                ``SentenceTransformer(output_path)`` loads (always merged; ``diffusion_embedder.export``).

        Raises:
            ValueError: An unknown ``format``; a tokenizer that cannot be written for older releases; with
                ``"sentence-transformers"``, what that format cannot hold.
        """
        if format != "encoder":
            export(self, output_path, format)
        else:
            folders.save(self, output_path, merge_before_save, save_config)


LLM2Vec = Encoder
