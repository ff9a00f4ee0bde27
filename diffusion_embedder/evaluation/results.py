"""The results ledger: which weights, settings, data and query instruction a stored result belongs to.

A rerun never reuses a result that no longer matches its weights, settings or data. The results
name is the checkpoint's folder (``checkpoint_name``) and the revision a hash of the weights the
forward pass uses and of the encoder settings (``model_revision``), so a retrained checkpoint never
picks up another's scores, and the same weights loaded as base + adapter or as an encoder folder get
the same revision. ``identity.jsonl`` beside the results records those weights and settings and is
checked on every run (``check_identity``). A stored result is reused only for the same data (dataset
revision; for local tasks a hash of their files) and the same query instruction (recorded in
``query_instructions.jsonl``, with the metric of the task's main score): ``rescore_reason`` says why one must be
scored again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from diffusion_embedder.files import read_json_object

#: Beside the results: the weights and settings they belong to. Not ``*.json``: mteb's ResultCache reads
#: every ``*.json`` next to ``model_meta.json`` as a task result.
IDENTITY_FILE = "identity.jsonl"
#: The identity file of older versions (renamed to ``IDENTITY_FILE`` when met; the report skips it).
LEGACY_IDENTITY_FILE = "identity.json"
#: Beside the results: the query instruction each task was scored with and the metric of its main score (a local
#: task's comes from its task.json, which the report cannot read), one JSON line per task.
INSTRUCTIONS_FILE = "query_instructions.jsonl"
#: Where the weights came from, not what they are: never part of the revision or the identity (a copied
#: checkpoint, or an adapter loaded beside its base instead of merged, is the same one).
PROVENANCE_KEYS = ("base_model_name_or_path", "merged_adapters")


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


#: Backbone config keys that say where, with which library and with which head a checkpoint was saved, not what
#: its backbone computes (the backbone loads without the head: a merged encoder folder says ``LlamaModel`` where
#: its base said ``LlamaForCausalLM``).
BACKBONE_PROVENANCE = ("_name_or_path", "transformers_version", "_commit_hash", "architectures")


def backbone_hash(encoder) -> str:
    """SHA-256 of what the model computes with besides its tensors and encoder settings: the backbone's config
    (``rope_theta``, windows, norms' epsilon, ...) and the tokenizer (vocabulary, merges, normalizer, special
    tokens). A checkpoint edited there is another model; a copy of it at another path is the same."""
    config = {k: v for k, v in encoder.model.config.to_dict().items() if k not in BACKBONE_PROVENANCE}
    tokenizer = encoder.tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    if backend is not None:  # less its truncation and padding: call state, set by every Hugging Face call
        state = {k: v for k, v in json.loads(backend.to_str()).items() if k not in ("truncation", "padding")}
        digest.update(json.dumps(state, sort_keys=True).encode())
    else:
        digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    digest.update(json.dumps([type(tokenizer).__name__, tokenizer.special_tokens_map, tokenizer.padding_side],
                             sort_keys=True, default=str).encode())
    return digest.hexdigest()


def checkpoint_name(path: str) -> str:
    """``diffusion_embedder/<run>-checkpoint-<N>`` for a training checkpoint, else ``diffusion_embedder/<folder>``.

    Readable, and different for two runs' ``checkpoint-10``; the revision tells apart weights that share a name.
    """
    parts = [p for p in os.path.normpath(path).replace("\\", "/").split("/") if p not in ("", ".")]
    tail = parts[-1] if parts else "model"
    if re.fullmatch(r"checkpoint-\d+", tail) and len(parts) > 1:
        tail = f"{parts[-2]}-{tail}"
    return "diffusion_embedder/" + re.sub(r"[^A-Za-z0-9._-]+", "_", tail)


def computed_settings(settings: dict) -> dict:
    """The encoder settings that change what the model computes: ``settings`` less ``PROVENANCE_KEYS``.

    With ``weights_hash`` this is the one definition of a model's identity: the results ledger, the revision
    and the ``encode`` command's manifest all use it, so a copied checkpoint is the same model everywhere.
    """
    return {k: v for k, v in settings.items() if k not in PROVENANCE_KEYS}


def model_revision(weights: str, settings: dict, overrides: dict | None = None, backbone: str | None = None) -> str:
    """Hash of the weights, the backbone's config and tokenizer (``backbone_hash``) and the settings the
    checkpoint brings (overridden ones are experiment kwargs)."""
    stable = {k: v for k, v in computed_settings(settings).items() if k not in (overrides or {})}
    blob = json.dumps({"weights": weights, "backbone": backbone, "settings": stable}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def check_identity(results_dir: Path, identity: dict) -> None:
    """Refuse a results folder written by another checkpoint (same name/revision, different weights)."""
    path = results_dir / IDENTITY_FILE
    legacy = results_dir / LEGACY_IDENTITY_FILE
    if legacy.exists() and not path.exists():  # older runs wrote a .json that mteb's ResultCache reads as a result
        legacy.rename(path)
    record = {"weights": identity["weights"], "backbone": identity.get("backbone"),
              "settings": computed_settings(identity["settings"])}
    if path.exists():
        try:
            stored = read_json_object(path, RuntimeError)
        except RuntimeError as e:
            raise RuntimeError(f"{e} Delete it to re-record this folder.") from None
        record = json.loads(json.dumps(record, default=str))
        if stored != record:
            differ = ", ".join(f"{k} {str(stored.get(k))[:12]}... there, {str(v)[:12]}... now"
                               for k, v in record.items() if stored.get(k) != v)
            raise RuntimeError(f"{results_dir} holds results of another checkpoint ({differ}); choose another "
                               f"--output_dir or --revision.")
        return
    results_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, sort_keys=True, default=str) + "\n")


def recorded_identity(results_dir: Path) -> dict | None:
    """The weights and settings recorded beside results (``IDENTITY_FILE``, or an older version's
    ``LEGACY_IDENTITY_FILE``); None where neither is. An unreadable record is a ``ValueError`` naming it."""
    for name in (IDENTITY_FILE, LEGACY_IDENTITY_FILE):
        if (results_dir / name).is_file():
            return read_json_object(results_dir / name)
    return None


def _stored_records(results_dir: Path) -> dict[str, dict]:
    """Task -> its record in ``INSTRUCTIONS_FILE``; unreadable lines count as no record."""
    path = results_dir / INSTRUCTIONS_FILE
    records: dict[str, dict] = {}
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            with contextlib.suppress(json.JSONDecodeError, TypeError, KeyError):
                record = json.loads(line)
                records[str(record["task"])] = dict(record)
    return records


def stored_instructions(results_dir: Path) -> dict[str, str]:
    """Task -> query instruction its stored result was scored with."""
    return {task: str(r["query_instruction"]) for task, r in _stored_records(results_dir).items()
            if "query_instruction" in r}


def stored_main_scores(results_dir: Path) -> dict[str, str]:
    """Task -> the metric its stored main score is; absent for results of versions that did not record it."""
    return {task: str(r["main_score"]) for task, r in _stored_records(results_dir).items() if "main_score" in r}


def record_instruction(results_dir: Path, task_name: str, instruction: str, main_score: str) -> None:
    """Note the instruction ``task_name`` was just scored with and its main score's metric (written after its
    result, replaced atomically)."""
    record = {"task": task_name, "query_instruction": instruction, "main_score": main_score}
    records = {**_stored_records(results_dir), task_name: record}
    path = results_dir / INSTRUCTIONS_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(records[k]) + "\n" for k in sorted(records)), encoding="utf-8")
    os.replace(tmp, path)


def rescore_reason(cache, task, meta, instruction: str) -> str | None:
    """Why the stored result of ``task`` must not be reused (its data or query instruction changed), or None.

    mteb reuses a complete result whatever data it was computed on; the result records the dataset
    revision (for a local task, the hash of its files), so we compare it with the task's own. The query
    instruction resolved for the task (from the shipped file, a user file or mteb's prompt, whichever
    applies) is recorded beside the results and compared too, so an upgrade that changes the shipped
    instruction scores again. An unreadable result is an error naming the file, never a silent rerun or a
    crash inside mteb.
    """
    from mteb.results import TaskResult

    path = cache.get_task_result_path(task.metadata.name, meta)
    if not path.is_file():
        return None
    try:
        stored = TaskResult.from_disk(path)
    except Exception as e:  # noqa: BLE001 - truncated JSON, wrong schema: all mean the same to the user
        raise ValueError(
            f"{path}: cannot read this stored result ({type(e).__name__}: {str(e)[:200]}); "
            f"rerun with --overwrite to score {task.metadata.name} again."
        ) from None
    if stored.dataset_revision != task.metadata.revision:
        return (f"its data changed since {path} was written "
                f"(dataset revision {stored.dataset_revision} -> {task.metadata.revision})")
    used = stored_instructions(path.parent).get(task.metadata.name)
    if used is None:
        return f"{path.parent / INSTRUCTIONS_FILE} does not record the query instruction {path.name} was scored with"
    if used != instruction:
        return f"its query instruction changed since {path} was written ({used!r} -> {instruction!r})"
    return None
