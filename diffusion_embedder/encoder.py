"""The Encoder: a bidirectional backbone, LLM2Vec's input format and a pooling head, with ``encode()``.

An encoder folder holds the weights (or a LoRA adapter over a recorded base), the tokenizer,
``llm2vec_config.json`` (LLM2Vec's four keys, so LLM2Vec reads our checkpoints) and
``encoder_config.json`` (every setting), so ``Encoder.from_pretrained(folder)`` gives back the same vectors.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm.auto import tqdm

from diffusion_embedder import backbones
from diffusion_embedder import packing as packing_mod
from diffusion_embedder.config import (
    ENCODER_CONFIG,
    LLM2VEC_CONFIG,
    LLM2VEC_KEYS,
    EncoderConfig,
    read_settings,
    resolve_config,
    setting_fields,
)
from diffusion_embedder.cpu_linear import onednn_linear
from diffusion_embedder.files import find_file, hub_kwargs_of, read_optional_json_object, write_json
from diffusion_embedder.pooling import LatentAttentionPooling, pool
from diffusion_embedder.quantization import check_precision, quantize_embeddings
from diffusion_embedder.similarity import SIMILARITY_FUNCTIONS, check_similarity_fn_name
from diffusion_embedder.templates import (
    SEPARATOR,
    PreparedText,
    TextInput,
    eos_suffix_for,
    known_settings,
    parse_input,
    parse_inputs,
    placeholder_token,
    render,
)

logger = logging.getLogger(__name__)

POOLING_WEIGHTS = "pooling.safetensors"
SETTING_NAMES = tuple(f.name for f in setting_fields())


def _config_attribute(name: str) -> tuple:
    """LLM2Vec's attribute ``name``: reads ``config``; setting it installs a validated copy of ``config``."""

    def get(self):
        return getattr(self.config, name)

    def set_(self, value):
        self._set_config(self.config.replace(**{name: value}))

    return get, set_, None, f"LLM2Vec's ``{name}``: ``config.{name}``."


@dataclass
class _Tokenized:
    """One input after tokenization, unpadded: its ids and how many trailing tokens are the pooled span."""

    input_ids: list[int]
    span: int


class Encoder(nn.Module):
    """Text encoder over a (bidirectional) decoder LM. ``LLM2Vec`` is the same class."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        config: EncoderConfig | None = None,
        latent: LatentAttentionPooling | None = None,
        **settings,
    ):
        super().__init__()
        self.model = model
        self.tokenizer = tokenizer
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        tokenizer.padding_side = "left"
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
        """Load a plain checkpoint, an LLM2Vec checkpoint or an encoder folder.

        Settings are resolved once by ``config.resolve_config``, in increasing priority: the defaults,
        the checkpoint's ``llm2vec_config.json`` and ``encoder_config.json`` (read from the PEFT folder
        when one is given, as LLM2Vec does), LLM2Vec's settings for known checkpoint names (not for
        our encoder folders, which saved them), then the explicit arguments; the result is immutable.
        An adapter stored inside the base folder (LLM2Vec's MNTP repos) is
        merged first. ``kwargs`` naming another ``EncoderConfig`` setting set it; other ``kwargs``
        (``device_map``, ``revision``, ``attention_dropout``...) go to the backbone's ``from_pretrained``.
        """
        hub_kwargs = hub_kwargs_of(kwargs)
        settings_dir = peft_model_name_or_path or base_model_name_or_path
        saved = read_settings(find_file(settings_dir, ENCODER_CONFIG, **hub_kwargs))
        llm2vec = read_settings(find_file(settings_dir, LLM2VEC_CONFIG, **hub_kwargs), LLM2VEC_KEYS)
        keep_own_adapter = peft_model_name_or_path is None and not merge_peft
        plan = _plan_load(base_model_name_or_path, saved, keep_own_adapter, hub_kwargs)
        explicit = {
            "enable_bidirectional": enable_bidirectional,
            "pooling_mode": pooling_mode,
            "max_length": max_length,
            "doc_max_length": doc_max_length,
            "skip_instruction": skip_instruction,
            "prompt_template": prompt_template,
            "mask_readout_tokens": mask_readout_tokens,
            "prompts": prompts,
            "similarity_fn_name": similarity_fn_name,
            **{name: kwargs.pop(name) for name in SETTING_NAMES if name in kwargs},
        }
        # An encoder folder already holds the settings known for its checkpoint, resolved when it was made.
        config = resolve_config(llm2vec, saved, {} if saved else known_settings(plan.names), explicit)
        merged = list(plan.merges)
        if peft_model_name_or_path is not None and merge_peft:
            merged.append(peft_model_name_or_path)
        config = config.replace(
            base_model_name_or_path=plan.base_model_name_or_path, model_type=plan.model_type, merged_adapters=merged
        )

        backbone_kwargs = dict(
            kwargs,
            enable_bidirectional=config.enable_bidirectional,
            torch_dtype=torch_dtype,
            attn_implementation=attn_implementation,
        )
        spec = backbones.get_spec(config.model_type)
        tokenizer = backbones.load_tokenizer(plan.tokenizer_from, spec, **hub_kwargs)  # a missing one fails first
        model = _load_model(plan, backbone_kwargs)

        if peft_model_name_or_path is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, peft_model_name_or_path, **hub_kwargs)
            if merge_peft:
                model = model.merge_and_unload()

        if config.eos_suffix is None and config.pooling_mode == "eos_token":
            config = config.replace(eos_suffix=eos_suffix_for(plan.names, spec.eos_format, tokenizer.eos_token))

        latent = None
        latent_path = find_file(settings_dir, POOLING_WEIGHTS, **hub_kwargs)
        if config.pooling_mode == "latent_attention" and latent_path is not None:
            hidden_size = model.config.hidden_size
            latent = LatentAttentionPooling(hidden_size, config.latent_num_latents, config.latent_num_heads)
            latent.load_state_dict(load_file(latent_path))

        encoder = cls(model, tokenizer, config, latent=latent)
        if "device_map" not in kwargs:
            encoder.to(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        return encoder

    # ------------------------------------------------------------------ tokenization
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

    def _eos_suffix(self) -> str:
        """LLM2Vec appends an EOS string for ``eos_token`` pooling only (``last_token`` pools the text's own end)."""
        return (self.config.eos_suffix or "") if self.config.pooling_mode == "eos_token" else ""

    def prepare_for_tokenization(self, text: str) -> str:
        """LLM2Vec's: ``text`` (``instruction !@#$%^&*()text`` or plain) with the chat template and, for
        ``eos_token`` pooling, the EOS string applied; the separator stays where it was. ``tokenize``
        knows the result is prepared and adds neither again."""
        full, span = render(parse_input(text, 0), self.config.prompt_template, self._eos_suffix())
        return PreparedText(full[: len(full) - len(span)] + SEPARATOR + span if SEPARATOR in text else full)

    def _token_ids(self, texts: list[str], special: bool = True, key: str = "input_ids") -> list[list]:
        """Untruncated tokenization; lengths are checked by the caller, so the tokenizer's warning is noise."""
        return self.tokenizer(
            texts, add_special_tokens=special, return_offsets_mapping=key == "offset_mapping", verbose=False
        )[key]

    def _cut_texts(self, items: list[TextInput], limits: list[int]) -> list[TextInput]:
        """Cut each text to at most ``limits[i]`` tokens at a token boundary, keeping its instruction."""
        offsets_per_text = self._token_ids([it.text for it in items], special=False, key="offset_mapping")
        out = []
        for item, offsets, limit in zip(items, offsets_per_text, limits, strict=True):
            if len(offsets) > limit:
                item = replace(item, text=item.text[: offsets[limit - 1][1]] if limit > 0 else "")
            out.append(item)
        return out

    def _tokenize_items(
        self,
        items: list[TextInput],
        doc_max_length: int | None = None,
        warn: bool = True,
        max_length: int | None = None,
    ) -> list[_Tokenized]:
        """Tokenize as LLM2Vec does; over-long texts are cut on the text side so the instruction survives.

        Each text is tokenized once whole (the exact LLM2Vec sequence); only texts past ``max_length``
        are cut and tokenized again, until they fit (a cut can move a BPE boundary by a token).
        """
        if doc_max_length is not None:
            items = self._cut_texts(items, [doc_max_length] * len(items))
        template, eos, readout = self.config.prompt_template, self._eos_suffix(), self._mask_readout_ids()
        max_length = (max_length or self.config.max_length) - len(readout)  # the appended mask tokens always fit
        result: list[_Tokenized] = [None] * len(items)  # type: ignore[list-item]
        pending, truncated = list(range(len(items))), set()
        while pending:
            rendered = [render(items[i], template, eos) for i in pending]
            full = self._token_ids([r[0] for r in rendered])
            spans = self._token_ids([r[1] for r in rendered], special=False)
            over = []
            for i, ids, span in zip(pending, full, spans, strict=True):
                ids = ids or [placeholder_token(self.tokenizer)]  # no tokens at all: documented stand-in
                if len(ids) <= max_length:
                    result[i] = _Tokenized(ids + readout, len(readout) or min(len(span), len(ids)))
                elif not items[i].text:
                    raise ValueError(
                        f"Input {i}: the instruction and template alone take {len(ids) + len(readout)} tokens, "
                        f"more than max_length={self.config.max_length}; shorten the instruction or raise max_length."
                    )
                else:
                    over.append((i, len(ids) - max_length))
            if over:
                text_tokens = self._token_ids([items[i].text for i, _ in over], special=False)
                limits = [max(len(t) - excess, 0) for t, (_, excess) in zip(text_tokens, over, strict=True)]
                cut = self._cut_texts([items[i] for i, _ in over], limits)
                for (i, _), item in zip(over, cut, strict=True):
                    items[i] = item if item != items[i] else replace(item, text=item.text[:-1])
                    truncated.add(i)
            pending = [i for i, _ in over]
        if truncated:
            logger.log(
                logging.WARNING if warn else logging.DEBUG,
                "%d of %d texts were longer than max_length=%d tokens and were truncated on the text side.",
                len(truncated),
                len(items),
                max_length,
            )
        return result

    def _collate(self, batch: Sequence[_Tokenized]) -> dict[str, torch.Tensor]:
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

    def _collate_packed(self, batch: Sequence[_Tokenized], pack_length: int) -> dict[str, torch.Tensor]:
        return packing_mod.pack([(t.input_ids, t.span) for t in batch], pack_length, self.tokenizer.pad_token_id)

    def tokenize(
        self, inputs: Sequence[str | Sequence[str]], *, pack_length: int | None = None
    ) -> dict[str, torch.Tensor]:
        """Strings or ``[instruction, text]`` pairs to padded ``input_ids``, ``attention_mask`` and ``embed_mask``.

        This is the training path: texts are cut only at ``max_length`` (as upstream training did, and
        logged at debug level rather than once per batch); ``encode`` also applies ``doc_max_length``.
        With ``pack_length`` the texts are packed into rows of at most that many tokens instead
        (``diffusion_embedder.packing``); ``forward`` gives the same embeddings for both.
        """
        tokenized = self._tokenize_items(parse_inputs(inputs), warn=False)
        return self._collate(tokenized) if pack_length is None else self._collate_packed(tokenized, pack_length)

    # ------------------------------------------------------------------ forward
    def forward(self, features: dict[str, torch.Tensor]) -> torch.Tensor:
        """Pooled embeddings (B, d) for a ``tokenize`` output, padded or packed; differentiable."""
        attention_mask = features["attention_mask"]
        if packing_mod.is_packed(features):
            hidden = packing_mod.packed_hidden(self.model, features)
        else:
            position_ids = (attention_mask.cumsum(-1) - 1).clamp_min(0)
            hidden = self.model(
                input_ids=features["input_ids"].long(),
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=False,
            ).last_hidden_state
        pool_mask = attention_mask
        if self.config.skip_instruction and "embed_mask" in features:
            embed_mask = features["embed_mask"]
            # An empty text has no span of its own: it falls back to all its tokens (documented).
            has_span = embed_mask.sum(-1, keepdim=True) > 0
            pool_mask = torch.where(has_span, embed_mask, attention_mask)
        if self.latent is not None:
            hidden = hidden.to(next(self.latent.parameters()).dtype)
        return pool(
            hidden, attention_mask, pool_mask, self.config.pooling_mode, self.latent, self.config.mask_readout_tokens
        )

    # ------------------------------------------------------------------ encode
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
        normalize_embeddings: bool = False,
        truncate_dim: int | None = None,
        precision: str = "float32",
        max_tokens_per_batch: int | None = None,
        max_length: int | None = None,
        doc_max_length: int | None = None,
        packing: str | bool = "auto",
    ) -> torch.Tensor | np.ndarray:
        """Embed strings or ``[instruction, text]`` pairs, in input order.

        Returns a float32 ``torch.Tensor`` (LLM2Vec's default; a numpy array with ``convert_to_numpy``);
        a single string gives a 1-D vector. ``prompt`` (or ``prompt_name``, a key of ``config.prompts``)
        is the instruction of every plain-string input: ``encode(texts, prompt=p)`` equals
        ``encode([[p, t] for t in texts])``. Then, as in sentence-transformers: the first ``truncate_dim``
        dimensions are kept (default ``self.truncate_dim``), vectors are L2-normalized with
        ``normalize_embeddings``, and ``precision`` (int8, uint8, binary, ubinary) quantizes them with
        buckets from this call's embeddings.

        The positional arguments are LLM2Vec's, in its order; newer ones are keyword-only.
        ``max_length`` / ``doc_max_length`` override the encoder's for this call only.

        Batches are length-sorted; with ``max_tokens_per_batch`` they are cut by padded token count
        (rows x longest row) instead of by number of texts. With ``packing`` (True, or "auto" where
        the benchmark showed it faster) texts are instead packed without padding into rows as wide
        as the longest text (at most ``packing.MAX_ROW_LENGTH``), ``batch_size`` rows per forward
        (or as many as fit ``max_tokens_per_batch``); the embeddings are the same.
        ``device`` may be a list of devices: one persistent worker per device then shares the batches
        (done automatically when several GPUs are visible).
        """
        check_precision(precision)
        check_batch_size(batch_size)
        single = isinstance(sentences, str)
        if _is_single_triple(sentences):
            sentences = [sentences]  # as LLM2Vec: one [instruction, text, id] input
        items = parse_inputs([sentences] if single else sentences)
        prompt = self._resolve_prompt(prompt, prompt_name)
        if prompt is not None:
            items = [self._with_prompt(item, prompt, i) for i, item in enumerate(items)]
        if not items:
            out = torch.zeros((0, self.embedding_dim), dtype=torch.float32)
        else:
            overrides = {"max_length": max_length, "doc_max_length": doc_max_length}
            call = self.config.replace(**{k: v for k, v in overrides.items() if v is not None})  # validated
            tokenized = self._tokenize_items(items, doc_max_length=call.doc_max_length, max_length=call.max_length)
            lengths = [len(t.input_ids) for t in tokenized]
            devices = _resolve_devices(device, self)
            device_type = torch.device(devices[0] or self.device).type
            collate = self._collate
            if packing_mod.use_packing(packing, self.model, device_type, max(lengths)):
                width = packing_mod.row_length(lengths, device_type)
                rows = batch_size
                if max_tokens_per_batch is not None:
                    rows = max(1, packing_mod.check_positive("max_tokens_per_batch", max_tokens_per_batch) // width)
                batches = packing_mod.plan_batches(lengths, width, rows)
                collate = functools.partial(self._collate_packed, pack_length=width)
            else:
                batches = length_batches(lengths, batch_size, max_tokens_per_batch)
            if len(devices) > 1:
                out = self._encode_on_pool(tokenized, batches, devices, show_progress_bar, collate)
            else:
                out = self._encode_local(tokenized, batches, devices[0], show_progress_bar, collate)
        truncate_dim = truncate_dim if truncate_dim is not None else self.truncate_dim
        if truncate_dim is not None:
            out = out[:, :truncate_dim]
        if normalize_embeddings:
            out = torch.nn.functional.normalize(out, dim=-1)
        if precision != "float32" and len(out):
            out = torch.from_numpy(quantize_embeddings(out.numpy(), precision))
        if single:
            out = out[0]
        if convert_to_numpy and not convert_to_tensor:
            return out.numpy()
        return out

    def _resolve_prompt(self, prompt: str | None, prompt_name: str | None) -> str | None:
        if prompt is not None and prompt_name is not None:
            raise ValueError("Pass either prompt or prompt_name, not both.")
        if prompt_name is None:
            return prompt
        if prompt_name not in self.config.prompts:
            raise ValueError(
                f"Unknown prompt_name {prompt_name!r}; this encoder's prompts are {sorted(self.config.prompts)} "
                "(set them with Encoder.from_pretrained(..., prompts={...}))."
            )
        return self.config.prompts[prompt_name]

    @staticmethod
    def _with_prompt(item: TextInput, prompt: str, index: int) -> TextInput:
        if item.prefix:
            raise ValueError(
                f"Input {index} already carries an instruction; a prompt applies to plain-string inputs only."
            )
        return parse_input([prompt, item.text], index)

    def encode_query(self, sentences, *args, **kwargs) -> torch.Tensor | np.ndarray:
        """``encode`` with the ``query`` prompt (when the encoder has one and no other prompt is given)."""
        return self._encode_role("query", sentences, *args, **kwargs)

    def encode_document(self, sentences, *args, **kwargs) -> torch.Tensor | np.ndarray:
        """``encode`` with the ``document`` prompt (when the encoder has one and no other prompt is given)."""
        return self._encode_role("document", sentences, *args, **kwargs)

    def _encode_role(self, role: str, sentences, *args, **kwargs):
        if kwargs.get("prompt") is None and kwargs.get("prompt_name") is None and role in self.config.prompts:
            kwargs["prompt_name"] = role
        return self.encode(sentences, *args, **kwargs)

    def similarity(self, embeddings1, embeddings2) -> torch.Tensor:
        """(n x m) scores between two sets of embeddings with ``config.similarity_fn_name``."""
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

    def _encode_local(self, tokenized, batches, device, show_progress_bar, collate) -> torch.Tensor:
        if device is not None and torch.device(device) != self.device:
            self.to(device)
        out = torch.empty((len(tokenized), self.embedding_dim), dtype=torch.float32)
        was_training = self.training
        self.eval()
        with torch.inference_mode(), onednn_linear(self.model, self.device):
            for batch in tqdm(batches, desc="Encoding", disable=not show_progress_bar):
                features = collate([tokenized[i] for i in batch])
                features = {k: v.to(self.device) for k, v in features.items()}
                out[batch] = self(features).float().cpu()
        self.train(was_training)
        return out

    def _encode_on_pool(self, tokenized, batches, devices, show_progress_bar, collate) -> torch.Tensor:
        if self._pool_workers is None or self._pool_workers.devices != list(devices):
            self.start_pool(devices)
        out = torch.empty((len(tokenized), self.embedding_dim), dtype=torch.float32)
        features = [collate([tokenized[i] for i in batch]) for batch in batches]
        for index, embeddings in tqdm(
            self._pool_workers.run(features), total=len(batches), desc="Encoding", disable=not show_progress_bar
        ):
            out[batches[index]] = embeddings
        return out

    def start_pool(self, devices: Sequence[str]) -> None:
        """Start one persistent worker per device; later ``encode`` calls with these devices reuse them."""
        from diffusion_embedder.multiprocess import DevicePool

        self.stop_pool()
        self._pool_workers = DevicePool(self, list(devices))

    def stop_pool(self) -> None:
        if self._pool_workers is not None:
            self._pool_workers.close()
            self._pool_workers = None

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_pool_workers"] = None
        return state

    # ------------------------------------------------------------------ saving
    def save(
        self, output_path: str, merge_before_save: bool = False, save_config: bool = True, *, format: str = "encoder"
    ) -> None:
        """Write an encoder folder: weights or adapter (safetensors), tokenizer, configs and a model card.

        LLM2Vec's signature. With ``merge_before_save`` a LoRA adapter is merged into the weights first
        (the encoder then holds the merged model); such a folder also loads in LLM2Vec 0.2.3 (the
        tokenizer and config files are written in forms transformers 4.4x reads). ``save_config=False``
        leaves out ``llm2vec_config.json`` and ``encoder_config.json`` (the settings), as LLM2Vec does.
        ``format="sentence-transformers"`` also makes the folder a sentence-transformers model (merged;
        see ``diffusion_embedder.export``).
        """
        from diffusion_embedder.legacy import write_legacy_files

        if format != "encoder":
            from diffusion_embedder.export import export

            export(self, output_path, format)
            return
        os.makedirs(output_path, exist_ok=True)
        config = self.config
        if merge_before_save and hasattr(self.model, "merge_and_unload"):
            self.model = self.model.merge_and_unload()
        self.model.save_pretrained(output_path, safe_serialization=True)
        if hasattr(self.model, "peft_config"):
            _describe_adapter(os.path.join(output_path, "adapter_config.json"), config.base_model_name_or_path)
        else:
            config = config.replace(merged_adapters=[])
        self.tokenizer.save_pretrained(output_path)
        write_legacy_files(output_path)
        if self.latent is not None:
            state = {k: v.detach().cpu().contiguous() for k, v in self.latent.state_dict().items()}
            save_file(state, os.path.join(output_path, POOLING_WEIGHTS))
        if save_config:
            write_json(os.path.join(output_path, LLM2VEC_CONFIG), {k: getattr(config, k) for k in LLM2VEC_KEYS})
            write_json(os.path.join(output_path, ENCODER_CONFIG), config.to_dict())
        from diffusion_embedder.export import write_model_card

        write_model_card(self, output_path)
        logger.info("Saved encoder to %s", output_path)


def _describe_adapter(path: str, base_model_name_or_path: str) -> None:
    """Name the base as it was loaded (not a resolved cache path) and mark the adapter as an embedding model's."""
    from diffusion_embedder.legacy import legacy_adapter_config

    adapter = read_optional_json_object(path)
    if base_model_name_or_path:
        adapter["base_model_name_or_path"] = base_model_name_or_path
    adapter["task_type"] = "FEATURE_EXTRACTION"
    adapter = legacy_adapter_config(adapter)  # peft 0.12 (LLM2Vec 0.2.3) reads it too
    write_json(path, adapter)


LLM2Vec = Encoder


def _is_single_triple(sentences) -> bool:
    return (
        isinstance(sentences, list | tuple)
        and len(sentences) == 3
        and isinstance(sentences[0], str)
        and isinstance(sentences[1], str)
        and isinstance(sentences[2], int)
    )


def _resolve_devices(device, encoder: Encoder) -> list:
    if device is None:
        on_gpu = encoder.device.type == "cuda" and not hasattr(encoder.model, "hf_device_map")
        if on_gpu and torch.cuda.device_count() > 1:
            return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
        return [None]
    if isinstance(device, str | torch.device):
        return [device]
    devices = list(device)
    if not devices:
        raise ValueError("device=[] names no device: give a device, a list of devices, or None (automatic).")
    return devices


@dataclass(frozen=True)
class _LoadPlan:
    """What to load for a checkpoint name, read from its small files only (no weights)."""

    weights_from: str
    tokenizer_from: str
    #: Names that select LLM2Vec's known settings (the name given, the config's ``_name_or_path``, the base).
    names: list[str | None]
    base_model_name_or_path: str
    model_type: str
    merges: tuple[str, ...]
    own_adapter: str | None


def _plan_load(base: str, saved: dict, keep_own_adapter: bool, hub_kwargs: dict) -> _LoadPlan:
    """Where the weights, adapters and tokenizer of ``base`` are.

    ``base`` may be a plain checkpoint, an LLM2Vec folder whose adapter sits beside a config naming its
    base (merged, as LLM2Vec does), or one of our encoder folders holding only an adapter (its base
    and earlier merges are recorded in ``saved``; the adapter stays a trainable PEFT model when
    ``keep_own_adapter``). Nothing heavy is read, so settings and the tokenizer are checked before the weights.
    """
    has_weights = any(find_file(base, f, **hub_kwargs) for f in ("model.safetensors", "model.safetensors.index.json"))
    own_adapter = read_optional_json_object(find_file(base, "adapter_config.json", **hub_kwargs))
    is_encoder_folder = bool(saved)
    if has_weights:
        weights_from = base
    elif own_adapter:
        weights_from = saved.get("base_model_name_or_path") or own_adapter["base_model_name_or_path"]
    else:
        raise FileNotFoundError(
            f"No model found at {base!r}: expected model.safetensors (or its index) or a PEFT adapter "
            "(adapter_config.json), in a local folder or a reachable hub repo. Only safetensors weights are loaded."
        )
    names = [base, weights_from]
    if find_file(base, "config.json", **hub_kwargs):
        names.insert(1, backbones.read_config_dict(base, **hub_kwargs).get("_name_or_path"))
    # an encoder folder keeps its original base as provenance
    provenance = saved.get("base_model_name_or_path") if is_encoder_folder else None
    model_type = saved.get("model_type") or backbones.get_spec(
        backbones.read_config_dict(weights_from, **hub_kwargs).get("model_type", "<missing>")
    ).model_type
    merges = list(dict.fromkeys(saved.get("merged_adapters", [])))
    keep_own = bool(own_adapter) and is_encoder_folder and keep_own_adapter
    if own_adapter and not keep_own and base not in merges:
        merges.append(base)
    return _LoadPlan(
        weights_from=weights_from,
        tokenizer_from=base if find_file(base, "tokenizer_config.json", **hub_kwargs) else weights_from,
        names=names,
        base_model_name_or_path=provenance or weights_from,
        model_type=model_type,
        merges=tuple(merges),
        own_adapter=base if keep_own else None,
    )


def _load_model(plan: _LoadPlan, backbone_kwargs: dict) -> nn.Module:
    """Load the base weights and merge the adapters that belong under them, in order."""
    hub_kwargs = hub_kwargs_of(backbone_kwargs)
    model = backbones.load_backbone(plan.weights_from, **backbone_kwargs)
    if plan.merges or plan.own_adapter:
        from peft import PeftModel

        for adapter in plan.merges:
            model = PeftModel.from_pretrained(model, adapter, **hub_kwargs).merge_and_unload()
        if plan.own_adapter:
            model = PeftModel.from_pretrained(model, plan.own_adapter, **hub_kwargs)
    return model


def check_batch_size(batch_size) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}.")


def length_batches(lengths: Sequence[int], batch_size: int, max_tokens_per_batch: int | None = None) -> list[list[int]]:
    """Indices grouped into batches, longest first.

    By count, or, with ``max_tokens_per_batch``, by padded size (rows x longest row): long documents
    don't exhaust memory and short ones fill it. A single text longer than the budget gets its own batch.
    """
    check_batch_size(batch_size)
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = lengths[current[0]] if current else lengths[i]
        full = len(current) >= batch_size if max_tokens_per_batch is None else (
            (len(current) + 1) * longest > max_tokens_per_batch
        )
        if current and full:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches
