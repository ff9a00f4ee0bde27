"""The Encoder: a bidirectional backbone, LLM2Vec's input format and a pooling head, with ``encode()``.

This module is the ``nn.Module`` itself (model, tokenizer, settings, ``tokenize``, collation, ``forward``)
and LLM2Vec's / sentence-transformers' API over it. The work behind that API lives a floor below, each
module given the encoder (or its class) rather than importing it: ``loading`` (``from_pretrained``),
``inference`` (``encode``), ``folders`` (``save``) and ``export`` (``save(format=...)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch
from torch import nn

from diffusion_embedder import backbones, folders, inference, loading, tokenization
from diffusion_embedder import packing as packing_mod
from diffusion_embedder.config import SETTING_NAMES, EncoderConfig, check_values, resolve_config
from diffusion_embedder.export import export
from diffusion_embedder.pooling import LatentAttentionPooling, pool
from diffusion_embedder.similarity import SIMILARITY_FUNCTIONS, check_similarity_fn_name
from diffusion_embedder.templates import (
    SEPARATOR,
    PreparedText,
    TextInput,
    eos_suffix_for,
    left_padded,
    parse_input,
    parse_inputs,
    render,
)
from diffusion_embedder.tokenization import Tokenized
from diffusion_embedder.values import checked

if TYPE_CHECKING:
    from diffusion_embedder.multiprocess import DevicePool


def _config_attribute(name: str) -> tuple:
    """LLM2Vec's attribute ``name``: reads ``config``; setting it installs a validated copy of ``config``."""

    def get(self):
        return getattr(self.config, name)

    def set_(self, value):
        self._set_config(self.config.replace(**{name: value}))

    return get, set_, None, f"LLM2Vec's ``{name}``: ``config.{name}``."


class Encoder(nn.Module):
    """Text encoder over a (bidirectional) decoder LM. ``LLM2Vec`` is the same class. Its public methods' keywords
    are checked against their annotations before any work (``values.checked``)."""

    @checked(leave=SETTING_NAMES)
    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        pooling_mode: str | EncoderConfig | None = None,
        max_length: int | None = None,
        doc_max_length: int | None = None,
        skip_instruction: bool | None = None,
        *,
        config: EncoderConfig | None = None,
        latent: LatentAttentionPooling | None = None,
        **settings,
    ):
        """LLM2Vec's order, ``LLM2Vec(model, tokenizer, "mean", 512, 400, True)``: the backbone ``model``, its
        ``tokenizer``, ``pooling_mode``, ``max_length``, ``doc_max_length``, ``skip_instruction``. ``config`` (an
        ``EncoderConfig``, also accepted third and alone) holds every setting, which keyword settings replace;
        ``latent`` is a trained latent-attention head (built fresh when None)."""
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

    pooling_mode = property(*_config_attribute("pooling_mode"))
    max_length = property(*_config_attribute("max_length"))
    doc_max_length = property(*_config_attribute("doc_max_length"))
    skip_instruction = property(*_config_attribute("skip_instruction"))

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
        **kwargs,
    ) -> Encoder:
        """Load a plain checkpoint, an LLM2Vec checkpoint or an encoder folder (``base_model_name_or_path``), with an
        adapter on top (``peft_model_name_or_path``; ``merge_peft`` merges it, else it stays a ``PeftModel``).

        ``enable_bidirectional``, ``pooling_mode``, ``max_length``, ``doc_max_length``, ``skip_instruction``,
        ``prompt_template``, ``mask_readout_tokens``, ``prompts``, ``similarity_fn_name``: the ``EncoderConfig``
        settings of those names (None: not given). ``torch_dtype`` (a dtype or ``auto``, ``bfloat16``, ``float16``,
        ``float32``; None: float32), ``attn_implementation`` and ``device`` say how the backbone loads.
        Settings are resolved once by ``config.resolve_config``, in increasing priority: the defaults,
        the checkpoint's ``llm2vec_config.json`` and ``encoder_config.json`` (read from the PEFT folder
        when one is given, as LLM2Vec does), LLM2Vec's settings for known checkpoint names (not for
        our encoder folders, which saved them), then the explicit arguments; the result is immutable.
        An adapter stored inside the base folder (LLM2Vec's MNTP repos) is merged first. ``kwargs`` naming
        another setting set it; others (``device_map``, ``revision``...) go to the backbone's ``from_pretrained``.
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

    def prepare_for_tokenization(self, text: str) -> str:
        """LLM2Vec's: ``text`` (``instruction !@#$%^&*()text`` or plain) with the chat template and, for
        ``eos_token`` pooling, the EOS string applied; the separator stays where it was. ``tokenize``
        knows the result is prepared and adds neither again."""
        full, span = render(parse_input(text, 0), self.config.prompt_template, self.config.applied_eos_suffix)
        return PreparedText(full[: len(full) - len(span)] + SEPARATOR + span if SEPARATOR in text else full)

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
        width = max(len(t.input_ids) for t in batch)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        embed_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, tok in enumerate(batch):
            n = len(tok.input_ids)
            if n:
                input_ids[row, width - n :] = torch.tensor(tok.input_ids, dtype=torch.long)
                attention_mask[row, width - n :] = 1
            if tok.span:
                embed_mask[row, width - tok.span :] = 1
        return {"input_ids": input_ids, "attention_mask": attention_mask, "embed_mask": embed_mask}

    def _collate_packed(self, batch: Sequence[Tokenized], pack_length: int, bounded: bool = False) -> dict:
        """Packed rows of ``pack_length``; ``bounded``: row count padded to a power of two (``packing.pack``)."""
        return packing_mod.pack(
            [(t.input_ids, t.span) for t in batch], pack_length, self.tokenizer.pad_token_id, bounded
        )

    def tokenize(self, inputs: Sequence[str | Sequence[str]], *, pack_length: int | None = None) -> dict:
        """``inputs`` (strings or ``[instruction, text]`` pairs) to padded ``input_ids``, ``attention_mask``,
        ``embed_mask``.

        This is the training path: texts are cut only at ``max_length`` (as upstream training did, and
        logged at debug level rather than once per batch); ``encode`` also applies ``doc_max_length``.
        With ``pack_length`` the texts are packed into rows of at most that many tokens instead
        (``diffusion_embedder.packing``); ``forward`` gives the same embeddings for both.
        """
        tokenized = self._tokenize_items(parse_inputs(inputs), warn=False)
        return self._collate(tokenized) if pack_length is None else self._collate_packed(tokenized, pack_length)

    # ------------------------------------------------------------------ forward
    def forward(self, features: dict[str, torch.Tensor]) -> torch.Tensor:
        """Pooled embeddings (B, d) for ``features``, a ``tokenize`` output, padded or packed; differentiable."""
        return self.get_pooling(features, self._hidden_states(features))

    def _hidden_states(self, features: dict[str, torch.Tensor]) -> torch.Tensor:
        """The backbone's last hidden states (B, L, d) in the padded layout (packed rows are gathered back)."""
        if packing_mod.is_packed(features):
            return packing_mod.packed_hidden(self.model, features)
        attention_mask = features["attention_mask"]
        position_ids = (attention_mask.cumsum(-1) - 1).clamp_min(0)
        return self.model(input_ids=features["input_ids"].long(), attention_mask=attention_mask,
                          position_ids=position_ids, use_cache=False).last_hidden_state

    def get_pooling(self, features: dict[str, torch.Tensor], last_hidden_states: torch.Tensor) -> torch.Tensor:
        """LLM2Vec's: pool ``last_hidden_states`` (B, L, d) over ``features``' masks (the text span with
        ``skip_instruction``). Unlike LLM2Vec's it leaves ``features`` as they were (LLM2Vec overwrote the
        attention mask with the embed mask) and works with any padding side."""
        attention_mask = features["attention_mask"]
        pool_mask = attention_mask
        if self.config.skip_instruction and "embed_mask" in features:
            embed_mask = features["embed_mask"]
            # An empty text has no span of its own: it falls back to all its tokens (documented).
            has_span = embed_mask.sum(-1, keepdim=True) > 0
            pool_mask = torch.where(has_span, embed_mask, attention_mask)
        hidden = last_hidden_states
        if self.latent is not None:
            hidden = hidden.to(next(self.latent.parameters()).dtype)
        return pool(
            hidden, attention_mask, pool_mask, self.config.pooling_mode, self.latent, self.config.mask_readout_tokens
        )

    def resize_token_embeddings(self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None):
        """LLM2Vec's: the backbone's ``resize_token_embeddings`` (returns its new input embedding)."""
        return self.model.resize_token_embeddings(new_num_tokens=new_num_tokens, pad_to_multiple_of=pad_to_multiple_of)

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None) -> None:
        """LLM2Vec's: the backbone's checkpointing, by the name its transformers has (5.23: ``activation_...``)."""
        if hasattr(self.model, "activation_checkpointing_enable"):
            self.model.activation_checkpointing_enable(activation_checkpointing_kwargs=gradient_checkpointing_kwargs)
        else:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gradient_checkpointing_kwargs)

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
        """Embed ``sentences`` (strings or ``[instruction, text]`` pairs), in input order (``show_progress_bar``;
        ``convert_to_tensor`` is accepted for sentence-transformers' signature: a tensor is the default).

        Returns a float32 CPU ``torch.Tensor`` (LLM2Vec's default and dtype, whatever the model's dtype; a
        numpy array with ``convert_to_numpy``); a single string gives a 1-D vector. ``prompt`` (or
        ``prompt_name``, a key of ``config.prompts``) is the instruction of every plain-string input:
        ``encode(texts, prompt=p)`` equals ``encode([[p, t] for t in texts])``. Then, as in
        sentence-transformers: the first ``truncate_dim`` dimensions are kept (default ``self.truncate_dim``),
        vectors are L2-normalized with ``normalize_embeddings``, and ``precision`` (int8, uint8, binary,
        ubinary; None is float32) quantizes them with buckets from this call's embeddings.
        ``output_value="token_embeddings"`` (default ``sentence_embedding``) returns each input's token states
        instead (a list of (n_i, d) float32 tensors, padding removed), ``None`` a dict per input with every output
        (``diffusion_embedder.outputs``). The positional arguments are LLM2Vec's, in its order; newer ones are
        keyword-only. ``max_length`` / ``doc_max_length`` override the encoder's for this call only.
        Batches are length-sorted; with ``max_tokens_per_batch`` they are cut by padded token count
        (rows x longest row) instead of by number of texts. With ``packing`` (True, or "auto" where
        the benchmark showed it faster) texts are instead packed without padding into rows as wide
        as the longest text of each tokenization step (at most ``packing.MAX_ROW_LENGTH``), ``batch_size``
        rows per forward (or as many as fit ``max_tokens_per_batch``); on CUDA widths and row counts are
        rounded to powers of two (``packing.BOUNDED_SHAPES``) so compiled attention sees few shapes. The
        embeddings are the same. ``compile=True`` compiles each decoder layer once, in place (``compilation.py``).
        ``device`` may be a list of devices: one persistent worker per device then shares the batches
        (done automatically when several GPUs are visible); ``pool`` (from ``start_multi_process_pool``)
        runs them on that pool's workers instead. ``chunk_size`` is accepted for sentence-transformers'
        signature: workers here pull one batch at a time, so it changes nothing.
        """
        return inference.encode(
            self, sentences, batch_size, show_progress_bar, convert_to_numpy, convert_to_tensor, device,
            prompt=prompt, prompt_name=prompt_name, output_value=output_value,
            normalize_embeddings=normalize_embeddings, truncate_dim=truncate_dim, precision=precision, pool=pool,
            chunk_size=chunk_size, max_tokens_per_batch=max_tokens_per_batch, max_length=max_length,
            doc_max_length=doc_max_length, packing=packing, compile=compile,
        )

    def encode_query(self, sentences, *args, **kwargs) -> torch.Tensor | np.ndarray:
        """``encode(sentences, ...)`` with the ``query`` prompt (when the encoder has one and no other is given)."""
        return self.encode(sentences, *args, **inference.role_kwargs("query", self.config.prompts, kwargs))

    def encode_document(self, sentences, *args, **kwargs) -> torch.Tensor | np.ndarray:
        """``encode(sentences, ...)`` with the ``document`` prompt (when the encoder has one and no other is given)."""
        return self.encode(sentences, *args, **inference.role_kwargs("document", self.config.prompts, kwargs))

    def similarity(self, embeddings1, embeddings2) -> torch.Tensor:
        """(n x m) scores of ``embeddings1`` (n, d) against ``embeddings2`` (m, d): ``config.similarity_fn_name``."""
        return SIMILARITY_FUNCTIONS[self.config.similarity_fn_name](embeddings1, embeddings2)

    @property
    def similarity_fn_name(self) -> str:
        return self.config.similarity_fn_name

    @similarity_fn_name.setter
    def similarity_fn_name(self, value: str) -> None:
        self._set_config(self.config.replace(similarity_fn_name=check_similarity_fn_name(value)))

    def get_sentence_embedding_dimension(self) -> int:
        """Length of the vectors ``encode`` returns (``truncate_dim`` when set)."""
        return min(self.embedding_dim, self.truncate_dim or self.embedding_dim)

    @property
    def max_seq_length(self) -> int:
        """sentence-transformers' name for ``config.max_length`` (tokens per input, instruction included)."""
        return self.config.max_length

    @max_seq_length.setter
    def max_seq_length(self, value: int) -> None:
        self._set_config(self.config.replace(max_length=value))

    def start_pool(self, devices: Sequence[str]) -> None:
        """Start one persistent worker per device of ``devices``; later ``encode`` calls with them reuse them."""
        self.stop_pool()
        self._pool_workers = inference.start_pool(self, devices)

    def stop_pool(self) -> None:
        if self._pool_workers is not None:
            self._pool_workers.close()
            self._pool_workers = None

    def start_multi_process_pool(self, target_devices: Sequence[str] | None = None) -> DevicePool:
        """sentence-transformers' name: workers for ``encode(..., pool=pool)``, one per ``target_devices`` (default:
        every CUDA device, else 4 CPU workers, as there). Stop it with ``stop_multi_process_pool``."""
        return inference.start_pool(self, inference.pool_devices(target_devices))

    @staticmethod
    def stop_multi_process_pool(pool: DevicePool) -> None:
        """sentence-transformers' name: stop the workers of ``pool``, from ``start_multi_process_pool``."""
        pool.close()

    @checked
    def encode_multi_process(
        self,
        sentences: Sequence[str | Sequence[str]],
        pool: DevicePool,
        prompt_name: str | None = None,
        prompt: str | None = None,
        batch_size: int = 32,
        chunk_size: int | None = None,
        show_progress_bar: bool | None = None,
        precision: str | None = "float32",
        normalize_embeddings: bool = False,
        truncate_dim: int | None = None,
    ) -> np.ndarray:
        """sentence-transformers' (deprecated there) ``encode(sentences, pool=pool, convert_to_numpy=True)``, in its
        argument order (``sentences``, ``pool``, ``prompt_name``, ``prompt``, ``batch_size``, ``chunk_size``,
        ``show_progress_bar``, ``precision``, ``normalize_embeddings``, ``truncate_dim``); a numpy array, as there."""
        return self.encode(
            sentences, batch_size, bool(show_progress_bar), True, prompt=prompt, prompt_name=prompt_name,
            precision=precision, normalize_embeddings=normalize_embeddings, truncate_dim=truncate_dim, pool=pool,
            chunk_size=chunk_size,
        )

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_pool_workers"] = None
        return state

    # ------------------------------------------------------------------ saving
    @checked
    def save(
        self, output_path: str, merge_before_save: bool = False, save_config: bool = True, *, format: str = "encoder"
    ) -> None:
        """Write an encoder folder at ``output_path``: weights or adapter (safetensors), tokenizer, configs, model card.

        LLM2Vec's signature. With ``merge_before_save`` a LoRA adapter is merged into the saved weights
        (LLM2Vec's ``save`` also swaps its model for the merged one; this encoder keeps its adapter, so its
        vectors don't change by saving); such a folder also loads in LLM2Vec 0.2.3 (the
        tokenizer and config files are written in forms transformers 4.4x reads). ``save_config=False``
        leaves out ``llm2vec_config.json`` and ``encoder_config.json`` (the settings), as LLM2Vec does.
        ``format="sentence-transformers"`` also makes the folder a sentence-transformers model (merged;
        see ``diffusion_embedder.export``).
        """
        if format != "encoder":
            export(self, output_path, format)
        else:
            folders.save(self, output_path, merge_before_save, save_config)


LLM2Vec = Encoder
