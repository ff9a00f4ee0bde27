"""``Encoder.save``'s work: encoder folders, in forms LLM2Vec 0.2.3 reads too, with a model card.

An encoder folder holds the weights (or a LoRA adapter over a recorded base), the tokenizer,
``llm2vec_config.json`` (LLM2Vec's four keys, so LLM2Vec reads our checkpoints),
``encoder_config.json`` (every setting), the latent head's weights where there is one, and a
``README.md`` saying how each library loads it; ``Encoder.from_pretrained(folder)`` gives back the
same vectors.

LLM2Vec 0.2.3 runs on transformers 4.44 and tokenizers 0.19, and transformers 5 writes a few things
those releases cannot parse: BPE merges as pairs (tokenizers >= 0.20), ``tokenizer_class:
TokenizersBackend``, and RoPE settings only under ``rope_parameters``; peft 0.12 refuses the keys newer
peft adds to ``adapter_config.json``. ``write_legacy_files`` and ``legacy_adapter_config`` rewrite them;
the rewrite is lossless for the current releases, which read the older forms as well.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import logging
import os
from collections.abc import Sequence

from safetensors.torch import save_file
from torch import nn

from diffusion_embedder.config import ENCODER_CONFIG, LLM2VEC_CONFIG, LLM2VEC_KEYS, POOLING_WEIGHTS
from diffusion_embedder.files import make_folder, read_json_object, read_optional_json_object, write_json

logger = logging.getLogger(__name__)

#: What llm2vec 0.2.3 runs bidirectionally (its Qwen2BiModel only under flash_attention_2) and pools.
LLM2VEC_BACKBONES = ("llama", "mistral", "gemma")
LLM2VEC_POOLING_MODES = ("mean", "weighted_mean", "eos_token", "last_token", "bos_token")


# --------------------------------------------------------------------------- encoder folders
def save(encoder: nn.Module, output_path: str, merge_before_save: bool = False, save_config: bool = True) -> None:
    """``Encoder.save(format="encoder")``: weights or adapter (safetensors), tokenizer, configs and a model card.

    With ``merge_before_save`` a LoRA adapter is merged into the saved weights; ``encoder.model`` is left
    as it was (see ``merged_copy``).
    """
    make_folder(output_path, "Output folder")
    config = encoder.config
    model = encoder.model
    if merge_before_save and hasattr(model, "merge_and_unload"):
        model = merged_copy(model)
    model.save_pretrained(output_path, safe_serialization=True)
    if hasattr(model, "peft_config"):
        _describe_adapter(os.path.join(output_path, "adapter_config.json"), config.base_model_name_or_path)
    else:
        config = config.replace(merged_adapters=[])
    encoder.tokenizer.save_pretrained(output_path)
    write_legacy_files(output_path)
    if encoder.latent is not None:
        state = {k: v.detach().cpu().contiguous() for k, v in encoder.latent.state_dict().items()}
        save_file(state, os.path.join(output_path, POOLING_WEIGHTS))
    if save_config:
        write_json(os.path.join(output_path, LLM2VEC_CONFIG), {k: getattr(config, k) for k in LLM2VEC_KEYS})
        write_json(os.path.join(output_path, ENCODER_CONFIG), config.to_dict())
    write_model_card(encoder, output_path)
    logger.info("Saved encoder to %s", output_path)


def merged_copy(model: nn.Module) -> nn.Module:
    """``model.merge_and_unload()`` (peft) on a copy, leaving ``model`` as it was.

    Only the tensors of the modules peft unloads (adapter layers with the base weights a merge writes
    into, and wrapped modules) are copied, on their device; every other tensor is shared with ``model``.
    The merge is peft's own on the same devices, so the merged weights are those an in-place merge gives;
    the cost is memory for a copy of the adapted layers while saving.
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    def tensors(module: nn.Module):
        return itertools.chain(module.parameters(), module.buffers())

    def unloaded(module: nn.Module) -> bool:
        return isinstance(module, BaseTunerLayer) or hasattr(module, "unload_and_optionally_merge_module")

    adapted = {id(t) for m in model.modules() if unloaded(m) for t in tensors(m)}
    shared = {id(t): t for t in tensors(model) if id(t) not in adapted}
    return copy.deepcopy(model, shared).merge_and_unload()


def _describe_adapter(path: str, base_model_name_or_path: str) -> None:
    """Name the base as it was loaded (not a resolved cache path) and mark the adapter as an embedding model's."""
    adapter = read_optional_json_object(path)
    if base_model_name_or_path:
        adapter["base_model_name_or_path"] = base_model_name_or_path
    adapter["task_type"] = "FEATURE_EXTRACTION"
    adapter = legacy_adapter_config(adapter)  # peft 0.12 (LLM2Vec 0.2.3) reads it too
    write_json(path, adapter)


# --------------------------------------------------------------------------- files older releases read
#: tokenizer_config.json keys of transformers 5 that older releases don't know (and would keep as kwargs).
NEW_TOKENIZER_KEYS = ("backend", "is_local", "local_files_only")
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def _read_optional(path: str) -> dict | None:
    return read_json_object(path) if os.path.isfile(path) else None


def legacy_merges(merges: list) -> list[str]:
    """BPE merges as ``"a b"`` strings (the only form tokenizers < 0.20 reads)."""
    out = []
    for merge in merges:
        if isinstance(merge, str):
            out.append(merge)
            continue
        left, right = merge
        if " " in left or " " in right:
            raise ValueError(
                f"The merge {merge!r} holds a space, which tokenizers < 0.20 cannot read; this tokenizer "
                "cannot be saved for older releases."
            )
        out.append(f"{left} {right}")
    return out


def write_legacy_files(folder: str) -> None:
    """Rewrite the tokenizer and config files of a saved folder in the forms transformers 4.4x reads."""
    tokenizer_path = os.path.join(folder, "tokenizer.json")
    tokenizer = _read_optional(tokenizer_path)
    if tokenizer is not None and isinstance(tokenizer.get("model", {}).get("merges"), list):
        tokenizer["model"]["merges"] = legacy_merges(tokenizer["model"]["merges"])
        write_json(tokenizer_path, tokenizer, ensure_ascii=False)

    config_path = os.path.join(folder, "tokenizer_config.json")
    tokenizer_config = _read_optional(config_path)
    if tokenizer_config is not None:
        if tokenizer_config.get("tokenizer_class") in (None, "TokenizersBackend") and tokenizer is not None:
            tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
        for key in NEW_TOKENIZER_KEYS:
            tokenizer_config.pop(key, None)
        write_json(config_path, tokenizer_config, ensure_ascii=False)
        special_path = os.path.join(folder, "special_tokens_map.json")
        if not os.path.isfile(special_path):
            special = {k: tokenizer_config[k] for k in SPECIAL_TOKENS if tokenizer_config.get(k) is not None}
            write_json(special_path, special, ensure_ascii=False)

    model_config_path = os.path.join(folder, "config.json")
    config = _read_optional(model_config_path)
    if config is not None:
        rope = config.get("rope_parameters")
        if isinstance(rope, dict) and "rope_theta" not in config and "rope_theta" in rope:
            config["rope_theta"] = rope["rope_theta"]
            scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
            config["rope_scaling"] = None if scaling.get("rope_type", "default") == "default" else scaling
        if "dtype" in config and "torch_dtype" not in config:
            config["torch_dtype"] = config["dtype"]
        write_json(model_config_path, config, ensure_ascii=False)


#: LoraConfig fields peft 0.12 (LLM2Vec 0.2.3's) knows; it refuses any other key in adapter_config.json.
PEFT_012_LORA_FIELDS = frozenset(
    (
        "alpha_pattern auto_mapping base_model_name_or_path bias fan_in_fan_out inference_mode init_lora_weights "
        "layer_replication layers_pattern layers_to_transform loftq_config lora_alpha lora_dropout megatron_config "
        "megatron_core modules_to_save peft_type r rank_pattern revision runtime_config target_modules task_type "
        "use_dora use_rslora"
    ).split()
)


def legacy_adapter_config(adapter: dict) -> dict:
    """Drop the keys newer peft writes at their default values (and ``peft_version``), so peft 0.12 reads the file.

    A newer setting in use (not at its default) stays: peft 0.12 then refuses it by name rather than
    loading another model.
    """
    if adapter.get("peft_type") != "LORA":
        return adapter
    from peft import LoraConfig

    defaults = {}
    for f in dataclasses.fields(LoraConfig):
        if f.default is not dataclasses.MISSING:
            defaults[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            defaults[f.name] = f.default_factory()
    return {
        key: value
        for key, value in adapter.items()
        if key in PEFT_012_LORA_FIELDS or (key != "peft_version" and (key not in defaults or value != defaults[key]))
    }


# --------------------------------------------------------------------------- model card
def _settings_table(encoder: nn.Module) -> str:
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


def llm2vec_blockers(encoder: nn.Module, is_adapter: bool) -> list[str]:
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


def _llm2vec_section(encoder: nn.Module, path: str, is_adapter: bool) -> str:
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


def model_card(encoder: nn.Module, path: str, sentence_transformers: Sequence[str] | None = None) -> str:
    """README.md text: what the folder is and how to load it with each library that can.

    ``sentence_transformers``: None for an encoder folder; for a sentence-transformers folder, the reasons it
    names our ``EncoderModule`` (empty: sentence-transformers' own modules).
    """
    config = encoder.config
    is_adapter = os.path.isfile(os.path.join(path, "adapter_config.json"))
    base = config.base_model_name_or_path
    name = os.path.basename(os.path.normpath(path))
    exported = sentence_transformers is not None
    tags = ["diffusion_embedder", "feature-extraction", "text-embeddings"]
    if exported:
        tags += ["sentence-transformers", "sentence-similarity"]
    front = ["---", "library_name: " + ("sentence-transformers" if exported else "transformers")]
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
    if exported:
        flag = ", trust_remote_code=True" if sentence_transformers else ""
        note = (
            "\n\nThis folder names `diffusion_embedder.st_modules.EncoderModule`, which runs this package's "
            "tokenization and pooling, because sentence-transformers' own modules would give other vectors here:\n\n"
            + "".join(f"- {reason}\n" for reason in sentence_transformers)
            + "\nInstall `diffusion_embedder` and pass `trust_remote_code=True`: sentence-transformers 6.2 imports a "
            "module class from outside its own package only with that flag (its #3801). The folder itself holds no "
            "code; without the flag sentence-transformers refuses to load it rather than load a different model."
            if sentence_transformers
            else "\n\nsentence-transformers' own `Transformer` + `Pooling` modules (no `trust_remote_code`); needs "
            "transformers >= 5.2, which reads `is_causal: false` from config.json (older releases would run the "
            "model causal)."
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


def write_model_card(encoder: nn.Module, path: str, sentence_transformers: Sequence[str] | None = None) -> None:
    with open(os.path.join(path, "README.md"), "w", encoding="utf-8") as f:
        f.write(model_card(encoder, path, sentence_transformers))
