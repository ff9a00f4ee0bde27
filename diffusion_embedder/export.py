"""The sentence-transformers folder format: a folder ``SentenceTransformer`` loads with ``Encoder.encode``'s vectors.

``save_sentence_transformers`` writes merged weights with ``config.json`` (``is_causal: false``; Dream is
written as the Qwen2 architecture it runs on), the tokenizer, ``modules.json`` and
``config_sentence_transformers.json`` (prompts, similarity function). Where sentence-transformers' own
``Transformer`` + ``Pooling`` compute exactly what ``Encoder.encode`` does, those modules are written, so
the folder needs nothing of ours. Otherwise (see ``custom_module_reasons``) the folder names
``diffusion_embedder.st_modules.EncoderModule``, which runs this package's tokenization and pooling,
or, with ``stock_only``, the export is refused with the settings that prevent it: never a folder that
loads as a different model.

It reads only the encoder's public state (``config``, ``tokenizer``, ``model``, ``save``), so
``Encoder.save(format=...)`` can write it; ``diffusion-embedder export`` (``export_cli``) is its command line.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from torch import nn

from diffusion_embedder.files import read_json_object, write_json
from diffusion_embedder.folders import write_model_card
from diffusion_embedder.templates import placeholder_token
from diffusion_embedder.values import checked

logger = logging.getLogger(__name__)

#: Our pooling modes that sentence-transformers' ``Pooling`` computes identically (over the whole sequence).
ST_POOLING_MODES = {
    "mean": "mean",
    "weighted_mean": "weightedmean",
    "bos_token": "cls",
    "eos_token": "lasttoken",
    "last_token": "lasttoken",
}
#: Modes that pool the text span only when ``skip_instruction`` is on.
SPAN_POOLING_MODES = ("mean", "weighted_mean")
ST_TRANSFORMER = "sentence_transformers.base.modules.transformer.Transformer"
ST_POOLING = "sentence_transformers.sentence_transformer.modules.pooling.Pooling"
ENCODER_MODULE = "diffusion_embedder.st_modules.EncoderModule"
#: transformers reads ``is_causal: false`` from config.json only from 5.2 on; before, the model would run causal.
ST_REQUIREMENTS = {
    "transformers": {
        "specifier": ">=5.2",
        "reason": "config.json's is_causal: false (bidirectional attention) is ignored before transformers 5.2, "
        "which would silently run the model causal",
    }
}
#: Why a folder naming EncoderModule needs the flag, and how to give it (model card, warning, refusal).
TRUST_REMOTE_CODE = (
    "sentence-transformers 6.2 imports a module class from outside its own package only with "
    "trust_remote_code=True (its #3801); the folder holds no code, the class comes from the installed "
    "diffusion_embedder: SentenceTransformer({path!r}, trust_remote_code=True)."
)
PACKAGE_REQUIREMENT = {
    "diffusion_embedder": {
        "specifier": ">=0.1",
        "reason": "modules.json names diffusion_embedder.st_modules.EncoderModule",
    }
}


def custom_module_reasons(encoder: nn.Module) -> list[str]:
    """The encoder settings sentence-transformers' own modules cannot reproduce exactly (empty: stock modules)."""
    config = encoder.config
    reasons = []
    if config.pooling_mode not in ST_POOLING_MODES:
        reasons.append(f"pooling_mode={config.pooling_mode!r} has no sentence-transformers Pooling equivalent")
    if config.prompt_template:
        reasons.append(f"prompt_template={config.prompt_template!r} wraps every text in a chat template")
    suffix = config.applied_eos_suffix
    if suffix:
        reasons.append(f"eos_suffix={suffix!r} is appended to every text before {config.pooling_mode} pooling")
    if config.skip_instruction and config.pooling_mode in SPAN_POOLING_MODES:
        reasons.append(
            f"skip_instruction=True with {config.pooling_mode} pooling: the pooled span is the text's own tokens "
            "(no BOS, and the token joining instruction and text belongs to the text), which sentence-transformers' "
            "Pooling(include_prompt=False) does not reproduce: it drops as many tokens as the prompt has alone, and "
            "the prompt's trailing space is a token of its own there but joins the text's first word in the row"
        )
    if not encoder.tokenizer("")["input_ids"]:
        stand_in = encoder.tokenizer.convert_ids_to_tokens(placeholder_token(encoder.tokenizer))
        reasons.append(
            "the tokenizer adds no BOS (or any token) around a text, so an empty text has no tokens: the encoder "
            f"encodes it as one stand-in token ({stand_in!r}), sentence-transformers' Transformer would give it none "
            "(a different vector inside a batch, an error alone)"
        )
    doc_limit = config.doc_max_length + special_token_count(encoder.tokenizer)
    if any(text.strip() for text in config.prompts.values()):
        if doc_limit < config.max_length:
            reasons.append(
                f"prompts with doc_max_length={config.doc_max_length} < max_length={config.max_length}: the encoder "
                "cuts a long text to doc_max_length tokens and keeps its whole instruction, sentence-transformers "
                "cuts prompt and text together at one max_seq_length"
            )
        else:
            reasons.append(
                "prompts: the encoder cuts a long prompted text at a character of the text, sentence-transformers "
                "cuts the row at a token, and a character spread over several tokens (byte fallback: most non-ASCII "
                "text) leaves the two rows a token apart"
            )
    return reasons


def st_prompt(instruction: str) -> str:
    """The literal prefix sentence-transformers prepends for one of our instructions (LLM2Vec's join)."""
    instruction = instruction.strip()
    return f"{instruction} " if instruction else ""


def special_token_count(tokenizer) -> int:
    """How many special tokens (BOS, EOS...) the tokenizer adds around a text."""
    return len(tokenizer("a")["input_ids"]) - len(tokenizer("a", add_special_tokens=False)["input_ids"])


class ExportRefused(ValueError):
    """An export the asked format cannot hold as asked (``stock_only`` with settings that need our module)."""


@checked
def save_sentence_transformers(encoder: nn.Module, output_path: str, stock_only: bool = False) -> None:
    """Write a folder ``sentence_transformers.SentenceTransformer(output_path)`` loads with ``encode``'s vectors.

    A LoRA adapter is merged into the written weights (``save(merge_before_save=True)``; the encoder keeps
    its adapter). Settings sentence-transformers' own modules cannot compute (instructions skipped in
    pooling, mask-token readout, ...) use our ``EncoderModule``, which needs ``trust_remote_code`` there.

    Args:
        encoder: The ``Encoder`` to export.
        output_path: The folder to write.
        stock_only: Refuse such settings instead of using ``EncoderModule``.

    Raises:
        ValueError: With ``stock_only``, a setting sentence-transformers' own modules cannot compute.
    """
    reasons = custom_module_reasons(encoder)
    if reasons and stock_only:
        raise ExportRefused(
            "Cannot export to sentence-transformers with its own modules only: " + "; ".join(reasons) + ". "
            "Export without stock_only to use diffusion_embedder's EncoderModule instead; "
            + TRUST_REMOTE_CODE.format(path=output_path)
        )
    config = encoder.config
    encoder.save(output_path, merge_before_save=True)
    tokenizer_config_path = os.path.join(output_path, "tokenizer_config.json")
    tokenizer_config = read_json_object(tokenizer_config_path)
    # No remote tokenizer code travels with the folder (Dream's DreamTokenizer is Qwen2's tokenizer).
    for key in ("auto_map", "is_local", "local_files_only"):
        tokenizer_config.pop(key, None)

    model_config = {
        "model_type": "SentenceTransformer",
        "prompts": {name: st_prompt(text) for name, text in config.prompts.items()},
        "default_prompt_name": None,
        "similarity_fn_name": config.similarity_fn_name,
        "requirements": dict(ST_REQUIREMENTS),
    }
    if reasons:
        modules = [{"idx": 0, "name": "0", "path": "", "type": ENCODER_MODULE}]
        model_config["requirements"].update(PACKAGE_REQUIREMENT)
    else:
        # Texts without a prompt are cut where the encoder cuts them (doc_max_length text tokens).
        max_seq_length = min(config.max_length, config.doc_max_length + special_token_count(encoder.tokenizer))
        tokenizer_config["model_max_length"] = max_seq_length
        write_json(
            os.path.join(output_path, "sentence_bert_config.json"),
            {
                "transformer_task": "feature-extraction",
                "modality_config": {"text": {"method": "forward", "method_output_name": "last_hidden_state"}},
                "module_output_name": "token_embeddings",
                "max_seq_length": max_seq_length,
            },
        )
        os.makedirs(os.path.join(output_path, "1_Pooling"), exist_ok=True)
        write_json(
            os.path.join(output_path, "1_Pooling", "config.json"),
            {
                "embedding_dimension": encoder.embedding_dim,
                "pooling_mode": ST_POOLING_MODES[config.pooling_mode],
                "include_prompt": True,
            },
        )
        modules = [
            {"idx": 0, "name": "0", "path": "", "type": ST_TRANSFORMER},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": ST_POOLING},
        ]
    write_json(tokenizer_config_path, tokenizer_config)
    write_json(os.path.join(output_path, "modules.json"), modules)
    write_json(os.path.join(output_path, "config_sentence_transformers.json"), model_config)
    write_model_card(encoder, output_path, sentence_transformers=reasons)
    if reasons:
        logger.warning(
            "Exported %s for sentence-transformers with diffusion_embedder's EncoderModule (%s). %s",
            output_path,
            "; ".join(reasons),
            TRUST_REMOTE_CODE.format(path=output_path),
        )
    else:
        logger.info("Exported a sentence-transformers folder to %s (Transformer + Pooling)", output_path)


# --------------------------------------------------------------------------- formats
def _save_encoder(encoder: nn.Module, output_path: str, stock_only: bool = False) -> None:
    encoder.save(output_path, merge_before_save=True)


#: ``Encoder.save(format=...)`` and ``diffusion-embedder export --format`` choices: writer(encoder, output_path,
#: stock_only).
FORMATS: dict[str, Callable[..., None]] = {
    "encoder": _save_encoder,
    "sentence-transformers": save_sentence_transformers,
}


def export(encoder: nn.Module, output_path: str, format: str, stock_only: bool = False) -> None:
    """Write ``encoder`` to ``output_path`` in ``format`` (a key of ``FORMATS``)."""
    if format not in FORMATS:
        raise ValueError(f"Unknown export format {format!r}; choose one of {', '.join(FORMATS)}.")
    FORMATS[format](encoder, output_path, stock_only=stock_only)
