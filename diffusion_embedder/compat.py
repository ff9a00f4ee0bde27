"""The names LLM2Vec and sentence-transformers give an encoder's settings and methods, over ours.

``EncoderCompat`` is a base of ``Encoder``: LLM2Vec's attributes (``pooling_mode``, ``max_length``...) read and set
the encoder's immutable ``config``; sentence-transformers' ``max_seq_length``, ``similarity_fn_name``,
``get_sentence_embedding_dimension`` and its multi-process pool are ``encode``'s own devices and pools. Code written
for either library runs unchanged; nothing here computes an embedding.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from diffusion_embedder import inference
from diffusion_embedder.similarity import check_similarity_fn_name
from diffusion_embedder.templates import SEPARATOR, PreparedText, parse_input, render
from diffusion_embedder.values import checked

if TYPE_CHECKING:
    from diffusion_embedder.multiprocess import DevicePool


def _config_attribute(name: str) -> property:
    """LLM2Vec's attribute ``name``: reads ``config``; setting it installs a validated copy of ``config``."""

    def get(self):
        return getattr(self.config, name)

    def set_(self, value):
        self._set_config(self.config.replace(**{name: value}))

    return property(get, set_, None, f"LLM2Vec's ``{name}``: ``config.{name}``.")


class EncoderCompat:
    """LLM2Vec's and sentence-transformers' names on ``Encoder`` (which provides ``config``, ``_set_config``,
    ``model``, ``embedding_dim``, ``encode`` and ``_pool_workers``)."""

    pooling_mode = _config_attribute("pooling_mode")
    max_length = _config_attribute("max_length")
    doc_max_length = _config_attribute("doc_max_length")
    skip_instruction = _config_attribute("skip_instruction")

    @property
    def similarity_fn_name(self) -> str:
        return self.config.similarity_fn_name

    @similarity_fn_name.setter
    def similarity_fn_name(self, value: str) -> None:
        self._set_config(self.config.replace(similarity_fn_name=check_similarity_fn_name(value)))

    @property
    def max_seq_length(self) -> int:
        """sentence-transformers' name for ``config.max_length`` (tokens per input, instruction included)."""
        return self.config.max_length

    @max_seq_length.setter
    def max_seq_length(self, value: int) -> None:
        self._set_config(self.config.replace(max_length=value))

    def get_sentence_embedding_dimension(self) -> int:
        """Length of the vectors ``encode`` returns (``truncate_dim`` when set)."""
        return min(self.embedding_dim, self.truncate_dim or self.embedding_dim)

    def prepare_for_tokenization(self, text: str) -> str:
        """LLM2Vec's: ``text`` (``instruction !@#$%^&*()text`` or plain) with the chat template and, for
        ``eos_token`` pooling, the EOS string applied; the separator stays where it was. ``tokenize``
        knows the result is prepared and adds neither again."""
        full, span = render(parse_input(text, 0), self.config.prompt_template, self.config.applied_eos_suffix)
        return PreparedText(full[: len(full) - len(span)] + SEPARATOR + span if SEPARATOR in text else full)

    def resize_token_embeddings(self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None):
        """LLM2Vec's: the backbone's ``resize_token_embeddings`` (returns its new input embedding)."""
        return self.model.resize_token_embeddings(new_num_tokens=new_num_tokens, pad_to_multiple_of=pad_to_multiple_of)

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None) -> None:
        """LLM2Vec's: the backbone's checkpointing, by the name its transformers has (5.23: ``activation_...``)."""
        if hasattr(self.model, "activation_checkpointing_enable"):
            self.model.activation_checkpointing_enable(activation_checkpointing_kwargs=gradient_checkpointing_kwargs)
        else:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gradient_checkpointing_kwargs)

    def start_pool(self, devices: Sequence[str]) -> None:
        """Start one persistent worker per device; later ``encode`` calls naming these devices reuse them.

        Args:
            devices: Device names, e.g. ``["cuda:0", "cuda:1"]``.
        """
        self.stop_pool()
        self._pool_workers = inference.start_pool(self, devices)

    def stop_pool(self) -> None:
        if self._pool_workers is not None:
            self._pool_workers.close()
            self._pool_workers = None

    def start_multi_process_pool(self, target_devices: Sequence[str] | None = None) -> DevicePool:
        """sentence-transformers' name: start workers for ``encode(..., pool=pool)``.

        Args:
            target_devices: One worker per device; None: every CUDA device, else 4 CPU workers (as there).

        Returns:
            The pool; stop it with ``stop_multi_process_pool``.
        """
        return inference.start_pool(self, inference.pool_devices(target_devices))

    @staticmethod
    def stop_multi_process_pool(pool: DevicePool) -> None:
        """sentence-transformers' name: stop a pool's workers.

        Args:
            pool: What ``start_multi_process_pool`` returned.
        """
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
        """sentence-transformers' (deprecated there): ``encode(sentences, pool=pool, convert_to_numpy=True)``.

        Args:
            sentences: As for ``encode``.
            pool: What ``start_multi_process_pool`` returned.
            prompt_name: As for ``encode``.
            prompt: As for ``encode``.
            batch_size: As for ``encode``.
            chunk_size: As for ``encode`` (it changes nothing).
            show_progress_bar: As for ``encode``.
            precision: As for ``encode``.
            normalize_embeddings: As for ``encode``.
            truncate_dim: As for ``encode``.

        Returns:
            A numpy array, as there.
        """
        return self.encode(
            sentences, batch_size, bool(show_progress_bar), True, prompt=prompt, prompt_name=prompt_name,
            precision=precision, normalize_embeddings=normalize_embeddings, truncate_dim=truncate_dim, pool=pool,
            chunk_size=chunk_size,
        )

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_pool_workers"] = None
        return state
