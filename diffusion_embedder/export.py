"""Folders other libraries load with our vectors: a sentence-transformers export, and a model card for every folder.

``save_sentence_transformers`` writes merged weights with ``config.json`` (``is_causal: false``; Dream is
written as the Qwen2 architecture it runs on), the tokenizer, ``modules.json`` and
``config_sentence_transformers.json`` (prompts, similarity function). Where sentence-transformers' own
``Transformer`` + ``Pooling`` compute exactly what ``Encoder.encode`` does, those modules are written, so
the folder needs nothing of ours. Otherwise (see ``custom_module_reasons``) the folder names
``diffusion_embedder.st_modules.EncoderModule``, which runs this package's tokenization and pooling,
or, with ``stock_only``, the export is refused with the settings that prevent it: never a folder that
loads as a different model.

``diffusion-embedder export CHECKPOINT OUT --format sentence-transformers`` is the command line.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from diffusion_embedder.files import read_json_object, write_json

if TYPE_CHECKING:
    from diffusion_embedder.encoder import Encoder

logger = logging.getLogger(__name__)

#: Our pooling modes that sentence-transformers' ``Pooling`` computes identically (over the whole sequence).
ST_POOLING_MODES = {
    "mean": "mean",
    "weighted_mean": "weightedmean",
    "bos_token": "cls",
    "eos_token": "lasttoken",
    "last_token": "lasttoken",
}
#: What llm2vec 0.2.3 runs bidirectionally (its Qwen2BiModel only under flash_attention_2) and pools.
LLM2VEC_BACKBONES = ("llama", "mistral", "gemma")
LLM2VEC_POOLING_MODES = ("mean", "weighted_mean", "eos_token", "last_token", "bos_token")
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
PACKAGE_REQUIREMENT = {
    "diffusion_embedder": {
        "specifier": ">=0.1",
        "reason": "modules.json names diffusion_embedder.st_modules.EncoderModule",
    }
}


def custom_module_reasons(encoder: Encoder) -> list[str]:
    """The encoder settings sentence-transformers' own modules cannot reproduce exactly (empty: stock modules)."""
    config = encoder.config
    reasons = []
    if config.pooling_mode not in ST_POOLING_MODES:
        reasons.append(f"pooling_mode={config.pooling_mode!r} has no sentence-transformers Pooling equivalent")
    if config.prompt_template:
        reasons.append(f"prompt_template={config.prompt_template!r} wraps every text in a chat template")
    suffix = encoder._eos_suffix()
    if suffix:
        reasons.append(f"eos_suffix={suffix!r} is appended to every text before {config.pooling_mode} pooling")
    if config.skip_instruction and config.pooling_mode in SPAN_POOLING_MODES:
        reasons.append(
            f"skip_instruction=True with {config.pooling_mode} pooling: the pooled span is the text's own tokens "
            "(no BOS, and the token joining instruction and text belongs to the text), which sentence-transformers' "
            "prompt-length exclusion does not reproduce"
        )
    doc_limit = config.doc_max_length + special_token_count(encoder.tokenizer)
    if doc_limit < config.max_length and any(text.strip() for text in config.prompts.values()):
        reasons.append(
            f"prompts with doc_max_length={config.doc_max_length} < max_length={config.max_length}: the encoder cuts "
            "a long text to doc_max_length tokens and keeps its whole instruction, sentence-transformers cuts prompt "
            "and text together at one max_seq_length"
        )
    return reasons


def st_prompt(instruction: str) -> str:
    """The literal prefix sentence-transformers prepends for one of our instructions (LLM2Vec's join)."""
    instruction = instruction.strip()
    return f"{instruction} " if instruction else ""


def special_token_count(tokenizer) -> int:
    """How many special tokens (BOS, EOS...) the tokenizer adds around a text."""
    return len(tokenizer("a")["input_ids"]) - len(tokenizer("a", add_special_tokens=False)["input_ids"])


def save_sentence_transformers(encoder: Encoder, output_path: str, stock_only: bool = False) -> None:
    """Write a folder ``sentence_transformers.SentenceTransformer(output_path)`` loads with ``encode``'s vectors.

    A LoRA adapter is merged first (the encoder then holds the merged model, as with
    ``save(merge_before_save=True)``). ``stock_only`` refuses settings that need our module.
    """
    reasons = custom_module_reasons(encoder)
    if reasons and stock_only:
        raise ValueError(
            "Cannot export to sentence-transformers with its own modules only: " + "; ".join(reasons) + ". "
            "Export without stock_only to use diffusion_embedder's EncoderModule instead."
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
    write_model_card(encoder, output_path, sentence_transformers="custom" if reasons else "stock")
    logger.info(
        "Exported a sentence-transformers folder to %s (%s)",
        output_path,
        "diffusion_embedder's EncoderModule: " + "; ".join(reasons) if reasons else "Transformer + Pooling",
    )


# --------------------------------------------------------------------------- model card
def _settings_table(encoder: Encoder) -> str:
    config = encoder.config
    rows = [
        ("base model", config.base_model_name_or_path or "(unknown)"),
        ("model type", config.model_type),
        ("attention", "bidirectional" if config.enable_bidirectional else "causal"),
        ("pooling", config.pooling_mode + (
            f" ({config.mask_readout_tokens} mask token(s) appended, their states averaged)"
            if config.pooling_mode == "mask_token" else ""
        )),
        ("max_length / doc_max_length", f"{config.max_length} / {config.doc_max_length} tokens"),
        ("skip_instruction", str(config.skip_instruction)),
        ("chat template", repr(config.prompt_template) if config.prompt_template else "none"),
        ("prompts", json.dumps(config.prompts) if config.prompts else "none"),
        ("similarity", config.similarity_fn_name),
        ("embedding size", str(encoder.embedding_dim)),
    ]
    if config.merged_adapters:
        rows.append(("adapters merged under this one", ", ".join(config.merged_adapters)))
    return "\n".join(["| setting | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)])


def llm2vec_blockers(encoder: Encoder, is_adapter: bool) -> list[str]:
    """Why LLM2Vec 0.2.3 would not give this encoder's vectors (empty: its recipe goes in the model card)."""
    config = encoder.config
    blockers = []
    weights_type = getattr(encoder.model.config, "model_type", config.model_type)
    if config.model_type not in LLM2VEC_BACKBONES or weights_type not in LLM2VEC_BACKBONES:
        blockers.append(
            f"it runs {config.model_type!r} bidirectionally only as Llama, Mistral or Gemma (its Qwen2 model stays "
            "causal under SDPA and eager attention)"
        )
    if config.pooling_mode not in LLM2VEC_POOLING_MODES:
        blockers.append(f"it has no {config.pooling_mode!r} pooling")
    if config.prompt_template:
        blockers.append("it applies chat templates by hub name only, not this folder's prompt_template")
    if is_adapter and len(config.merged_adapters) > 1:
        blockers.append(f"it merges one adapter under this one, not {len(config.merged_adapters)}")
    return blockers


def _llm2vec_section(encoder: Encoder, path: str, is_adapter: bool) -> str:
    blockers = llm2vec_blockers(encoder, is_adapter)
    if blockers:
        return (
            "## LLM2Vec\n\nThe llm2vec package (0.2.3) would not reproduce this encoder: " + "; ".join(blockers) + ". "
            "`from diffusion_embedder import LLM2Vec` is a drop-in with LLM2Vec's API that does."
        )
    config = encoder.config
    causal = "" if config.enable_bidirectional else ", enable_bidirectional=False"
    if not is_adapter:
        call = f'"{path}"{causal}'
    else:
        # An adapter trained over an LLM2Vec -mntp folder: LLM2Vec merges the adapter stored in that folder first.
        base = config.merged_adapters[0] if config.merged_adapters else config.base_model_name_or_path
        call = f'"{base}", peft_model_name_or_path="{path}"{causal}'
    return f"## LLM2Vec\n\n```python\nfrom llm2vec import LLM2Vec\n\nmodel = LLM2Vec.from_pretrained({call})\n```"


def _base_loading(model_type: str, base: str) -> str:
    """How to load the bare base model for peft: Dream and LLaDA need our loader (their releases are remote code)."""
    if model_type in ("Dream", "llada"):
        return (
            "from diffusion_embedder import load_backbone\n\n"
            f'base = load_backbone("{base}")  # bidirectional; {model_type} ships remote code, this needs none\n'
        )
    return (
        "from transformers import AutoModel\n\n"
        f'base = AutoModel.from_pretrained("{base}")\nbase.config.is_causal = False  # bidirectional\n'
    )


def model_card(encoder: Encoder, path: str, sentence_transformers: str | None = None) -> str:
    """README.md text: what the folder is and how to load it with each library that can."""
    config = encoder.config
    is_adapter = os.path.isfile(os.path.join(path, "adapter_config.json"))
    base = config.base_model_name_or_path
    name = os.path.basename(os.path.normpath(path))
    tags = ["diffusion_embedder", "feature-extraction", "text-embeddings"]
    if sentence_transformers:
        tags += ["sentence-transformers", "sentence-similarity"]
    front = ["---", "library_name: " + ("sentence-transformers" if sentence_transformers else "transformers")]
    if base and not os.path.isabs(base):
        front.append(f"base_model: {base}")
    front += ["pipeline_tag: feature-extraction", "tags:", *(f"- {t}" for t in tags), "---"]
    kind = "a LoRA adapter over the base model" if is_adapter else "merged weights"
    sections = [
        "\n".join(front),
        f"# {name}\n\nA text encoder saved by diffusion_embedder ({kind}). "
        "Its embeddings come from the settings below; every loader listed here reproduces them.",
        _settings_table(encoder),
        "## diffusion_embedder\n\n```python\nfrom diffusion_embedder import Encoder\n\n"
        f'encoder = Encoder.from_pretrained("{path}")\n'
        'vectors = encoder.encode(["a text", ["an instruction", "a text with its instruction"]])\n```',
    ]
    if sentence_transformers:
        flag = ", trust_remote_code=True" if sentence_transformers == "custom" else ""
        note = (
            "\n\nThis folder names `diffusion_embedder.st_modules.EncoderModule` (the settings above need this "
            "package's tokenization or pooling): install `diffusion_embedder`. sentence-transformers 6 asks for "
            "`trust_remote_code=True` before importing any class outside its own package; the folder itself holds "
            "no code."
            if sentence_transformers == "custom"
            else "\n\nsentence-transformers' own `Transformer` + `Pooling` modules; needs transformers >= 5.2, "
            "which reads `is_causal: false` from config.json (older releases would run the model causal)."
        )
        prompt_line = (
            f'\nqueries = model.encode(["a query"], prompt_name="{next(iter(config.prompts))}")'
            if config.prompts
            else ""
        )
        sections.append(
            "## sentence-transformers\n\n```python\nfrom sentence_transformers import SentenceTransformer\n\n"
            f'model = SentenceTransformer("{path}"{flag})\nvectors = model.encode(["a text"]){prompt_line}\n```'
            + note
        )
    else:
        sections.append(
            "## sentence-transformers\n\nExport first: `diffusion-embedder export "
            f"{path} OUT --format sentence-transformers`, then `SentenceTransformer(OUT)`."
        )
    sections.append(_llm2vec_section(encoder, path, is_adapter))
    if is_adapter:
        merged = (
            f" The adapters {', '.join(config.merged_adapters)} must be merged into the base first, in that order."
            if config.merged_adapters
            else ""
        )
        sections.append(
            "## peft\n\n```python\nfrom peft import PeftModel\n"
            + _base_loading(config.model_type, base)
            + f'model = PeftModel.from_pretrained(base, "{path}")\n```\n\n'
            "This gives token states; pooling and the input format are the settings above." + merged
        )
    return "\n\n".join(sections) + "\n"


def write_model_card(encoder: Encoder, path: str, sentence_transformers: str | None = None) -> None:
    with open(os.path.join(path, "README.md"), "w", encoding="utf-8") as f:
        f.write(model_card(encoder, path, sentence_transformers))


# --------------------------------------------------------------------------- command line
def _save_encoder(encoder: Encoder, output_path: str, stock_only: bool = False) -> None:
    encoder.save(output_path, merge_before_save=True)


#: ``diffusion-embedder export --format`` choices: writer(encoder, output_path, stock_only).
FORMATS: dict[str, Callable[..., None]] = {
    "encoder": _save_encoder,
    "sentence-transformers": save_sentence_transformers,
}


def export(encoder: Encoder, output_path: str, format: str, stock_only: bool = False) -> None:
    if format not in FORMATS:
        raise ValueError(f"Unknown export format {format!r}; choose one of {', '.join(FORMATS)}.")
    FORMATS[format](encoder, output_path, stock_only=stock_only)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="diffusion-embedder export",
        description="Write an encoder (checkpoint, encoder folder or base + adapter) as a folder another library loads",
    )
    p.add_argument("checkpoint", help="encoder folder, training checkpoint, LLM2Vec folder or base model")
    p.add_argument("output", help="folder to write")
    p.add_argument("--format", choices=list(FORMATS), default="sentence-transformers")
    p.add_argument("--peft_model_name_or_path", help="LoRA adapter over CHECKPOINT (merged into the export)")
    p.add_argument(
        "--torch_dtype", choices=["float32", "bfloat16", "float16"], default="float32", help="dtype of the weights"
    )
    p.add_argument(
        "--stock_only",
        action="store_true",
        help="refuse settings that need diffusion_embedder's module instead of sentence-transformers' own",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    from diffusion_embedder.encoder import Encoder

    encoder = Encoder.from_pretrained(
        args.checkpoint,
        peft_model_name_or_path=args.peft_model_name_or_path,
        merge_peft=args.peft_model_name_or_path is not None,
        torch_dtype=getattr(torch, args.torch_dtype),
        device="cpu",
    )
    try:
        export(encoder, args.output, args.format, stock_only=args.stock_only)
    except ValueError as error:
        print(f"error: {error}")
        return 2
    print(f"wrote {args.format} folder {args.output}")
    return 0
