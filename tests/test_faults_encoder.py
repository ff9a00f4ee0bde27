"""Fault injection, encoder side: every text has a defined embedding, every bad input or file a clear error.

Each case runs for every backbone family (Dream included), on the tiny checkpoints of ``conftest``.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from dataclasses import replace

import pytest
import torch
from conftest import DREAM_FIXTURE, FAMILIES, default_attention
from numerics import HAND_EPS, ORDER_EPS, assert_close_normwise
from safetensors.torch import load_file, save_file

import diffusion_embedder.backbones as backbones
from diffusion_embedder import Encoder
from diffusion_embedder.dtypes import TORCH_DTYPES, resolve_dtype
from diffusion_embedder.pooling import POOLING_MODES
from diffusion_embedder.templates import placeholder_token

#: Every backbone the empty-text guarantee covers (a new backbone is one more name here).
BACKBONES = FAMILIES
EMPTY_INPUTS = ["", " ", "\n\t ", ["Retrieve the theorem", ""], ["", ""], ["  ", "  "]]
OTHER_INPUTS = ["A triangle has sides 3, 4 and 5; find its area.", ["Find the formula", "x"]]


@pytest.fixture(scope="module")
def encoders(family_checkpoint):
    """One loaded encoder per backbone (mean pooling); other modes share its weights."""
    made: dict[str, Encoder] = {}

    def get(family: str) -> Encoder:
        if family not in made:
            made[family] = Encoder.from_pretrained(
                str(family_checkpoint(family)), attn_implementation=default_attention(family), device="cpu"
            )
        return made[family]

    return get


def with_mode(encoder: Encoder, mode: str, skip_instruction: bool) -> Encoder:
    config = replace(encoder.config, pooling_mode=mode, skip_instruction=skip_instruction, eos_suffix=None)
    torch.manual_seed(0)
    return Encoder(encoder.model, encoder.tokenizer, config)


# ---------------------------------------------------------------- empty and whitespace texts


@pytest.mark.parametrize("family", BACKBONES)
def test_empty_text_is_finite_and_batch_independent(encoders, family):
    """Alone, in a padded batch with longer texts, at every batch size and packed: the same finite vector,
    every pooling mode."""
    base = encoders(family)
    inputs = EMPTY_INPUTS + OTHER_INPUTS
    has_mask = getattr(base.model.config, "mask_token_id", None) is not None
    for mode in [m for m in POOLING_MODES if m != "mask_token" or has_mask]:  # mask_token: Dream, LLaDA only
        for skip_instruction in (True, False):
            encoder = with_mode(base, mode, skip_instruction)
            runs = {
                "padded": encoder.encode(inputs, batch_size=len(inputs), packing=False, show_progress_bar=False),
                "pairs": encoder.encode(inputs, batch_size=2, packing=False, show_progress_bar=False),
                "packed": encoder.encode(inputs, packing=True, show_progress_bar=False),
            }
            for i, item in enumerate(EMPTY_INPUTS):
                alone = encoder.encode([item], packing=False, show_progress_bar=False)[0]
                for name, out in runs.items():
                    where = (family, mode, skip_instruction, i, name)
                    assert torch.isfinite(out).all() and out.abs().sum(-1).min() > 0, where  # never a zero vector
                    assert_close_normwise(alone, out[i], eps_multiple=ORDER_EPS, msg=where)


@pytest.mark.parametrize("family", BACKBONES)
def test_empty_text_is_the_documented_one_token_row(encoders, family):
    """A row with no tokens at all becomes [BOS], else [EOS]: its mean-pooled vector is that token's state."""
    encoder = with_mode(encoders(family), "mean", True)
    tokenizer = encoder.tokenizer
    expected_id = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    assert placeholder_token(tokenizer) == expected_id
    with torch.no_grad():
        state = encoder.model(input_ids=torch.tensor([[expected_id]]), use_cache=False).last_hidden_state[0, 0]
    assert_close_normwise(encoder.encode([""], show_progress_bar=False)[0], state, eps_multiple=HAND_EPS)
    assert encoder.tokenize([""])["attention_mask"].sum() == 1


def test_dream_has_no_bos_so_its_empty_row_is_eos(encoders):
    tokenizer = encoders("Dream").tokenizer
    assert tokenizer.bos_token_id is None
    assert placeholder_token(tokenizer) == tokenizer.eos_token_id


# ---------------------------------------------------------------- bad arguments to encode


@pytest.mark.parametrize("family", BACKBONES)
def test_bad_encode_arguments_name_the_problem(encoders, family):
    encoder = encoders(family)
    for bad, kind in ((5, "int"), (None, "NoneType"), (b"bytes", "bytes"), (3.5, "float")):
        with pytest.raises(TypeError, match=f"got {kind}"):
            encoder.encode(bad, show_progress_bar=False)
    with pytest.raises(TypeError, match=r"decode bytes to str"):
        encoder.encode(b"text", show_progress_bar=False)
    surrogate = r"Input 2: the text is not valid Unicode: lone surrogate '\\ud800' at character 4"
    with pytest.raises(ValueError, match=surrogate):
        encoder.encode(["fine", "also fine", "bad \ud800 text"], show_progress_bar=False)
    with pytest.raises(ValueError, match=r"Input 1: the instruction is not valid Unicode.*character 0"):
        encoder.encode(["fine", ["\udc00instr", "text"]], show_progress_bar=False)
    for batch_size in (None, 2.0, True):
        with pytest.raises(ValueError, match=rf"batch_size: {batch_size!r} \({type(batch_size).__name__}\) is not of "
                                             "type int"):
            encoder.encode(["a", "b"], batch_size=batch_size, show_progress_bar=False)
    for batch_size in (0, -1):
        with pytest.raises(ValueError, match=rf"batch_size: must be >= 1, got {batch_size!r}"):
            encoder.encode(["a", "b"], batch_size=batch_size, show_progress_bar=False)
    with pytest.raises(ValueError, match=r"device=\[\] names no device"):
        encoder.encode(["a"], device=[], show_progress_bar=False)
    # a tuple of texts and a generator are lists of inputs too
    expected = encoder.encode(["a", "b"], show_progress_bar=False)
    assert torch.equal(encoder.encode(("a", "b"), show_progress_bar=False), expected)
    assert torch.equal(encoder.encode((t for t in ["a", "b"]), show_progress_bar=False), expected)


@pytest.mark.parametrize("family", BACKBONES)
def test_bad_encode_limits_and_devices_name_the_argument(encoders, family):
    """No limit is silently read as "none" or as an empty vector, no device error comes from deep inside torch, and a
    length message names the value in force for the call."""
    encoder = encoders(family)
    for value in (0, -1):
        with pytest.raises(ValueError, match=rf"max_tokens_per_batch: must be >= 1, got {value!r}"):
            encoder.encode(["a", "b"], max_tokens_per_batch=value, show_progress_bar=False)
    for value in (2.5, True, 2.0):
        for name in ("max_tokens_per_batch", "truncate_dim"):
            expected = rf"{name}: {value!r} \({type(value).__name__}\) is not of type int or null"
            with pytest.raises(ValueError, match=expected):
                encoder.encode(["a", "b"], **{name: value}, show_progress_bar=False)
    for value in (0, -3, 65):
        expected = rf"truncate_dim must be an integer from 1 to the embedding dimension 64 .*got {value!r}"
        with pytest.raises(ValueError, match=expected):
            encoder.encode(["a", "b"], truncate_dim=value, show_progress_bar=False)
    missing = f"cuda:{torch.cuda.device_count()}"  # one past the last GPU (any GPU, on a CPU-only machine)
    for device in (missing, ["cpu", missing]):
        with pytest.raises(ValueError, match=rf"device='{missing}': .*; available: cpu"):
            encoder.encode(["a"], device=device, show_progress_bar=False)
    with pytest.raises(ValueError, match=r"device='nonsense' is not a device name .*; available: cpu"):
        encoder.encode(["a"], device="nonsense", show_progress_bar=False)
    with pytest.raises(ValueError, match=r"take \d+ tokens, more than max_length=5;"):
        encoder.encode([["Retrieve the theorem that proves " * 3, "x"]], max_length=5, show_progress_bar=False)
    if getattr(encoder.model.config, "mask_token_id", None) is not None:
        readout = with_mode(encoder, "mask_token", True)
        with pytest.raises(ValueError, match=r"max_length=1 leaves no token for the text: mask_token pooling"):
            readout.encode(["a"], max_length=1, show_progress_bar=False)


@pytest.mark.parametrize("family", BACKBONES)
def test_bad_from_pretrained_arguments_fail_before_the_weights_load(family_checkpoint, family, monkeypatch, tmp_path):
    """An unknown attn_implementation, an adapter path with no adapter, an unknown keyword or device: our message
    naming the argument, the value and the choices (or the closest name), before any weight is read."""
    path = str(family_checkpoint(family))
    monkeypatch.setattr(backbones.AutoModel, "from_pretrained", _no_weights)
    choices = r"choose one of eager, .*sdpa.*, or a hub kernel 'org/repo' \(did you mean 'sdpa'\?\)"
    with pytest.raises(ValueError, match=rf"Unknown attn_implementation 'sdpaa'; {choices}"):
        Encoder.from_pretrained(path, attn_implementation="sdpaa")
    nowhere = str(tmp_path / "no-adapter")
    with pytest.raises(FileNotFoundError, match=rf"peft_model_name_or_path='{re.escape(nowhere)}' is not a PEFT"):
        Encoder.from_pretrained(path, peft_model_name_or_path=nowhere)
    with pytest.raises(FileNotFoundError, match=r"that folder has no adapter_config.json"):
        Encoder.from_pretrained(path, peft_model_name_or_path=str(tmp_path))
    for name, value, closest in (("pooling_mod", "mean", "pooling_mode"), ("revsion", "main", "revision"),
                                 ("attn_implementaton", "eager", "attn_implementation")):
        with pytest.raises(TypeError, match=rf"unknown keyword argument {name}='{value}'.*did you mean '{closest}'"):
            Encoder.from_pretrained(path, **{name: value})
    with pytest.raises(ValueError, match=r"device='nonsense' is not a device name"):
        Encoder.from_pretrained(path, device="nonsense")


# ---------------------------------------------------------------- torch_dtype


def test_one_dtype_parser_lists_the_choices():
    assert resolve_dtype(None) is torch.float32
    assert resolve_dtype("bfloat16") is torch.bfloat16
    assert resolve_dtype(torch.float16) is torch.float16
    assert resolve_dtype("auto") == "auto"
    for bad in ("float", "fp16", "bf16", torch.int64, 16, ""):
        with pytest.raises(ValueError, match=r"torch_dtype: .* (is not|nor) one of \['auto', 'bfloat16', 'float16', "
                                             r"'float32'\]"):
            resolve_dtype(bad)


@pytest.mark.parametrize("family", BACKBONES)
def test_invalid_torch_dtype_fails_before_the_weights_load(family_checkpoint, family, monkeypatch):
    monkeypatch.setattr(backbones.AutoModel, "from_pretrained", _no_weights)
    with pytest.raises(ValueError, match=r"torch_dtype: 'fp16' is not one of \['auto', 'bfloat16'"):
        Encoder.from_pretrained(str(family_checkpoint(family)), torch_dtype="fp16")


def test_torch_dtype_names_reach_the_weights(family_checkpoint):
    encoder = Encoder.from_pretrained(str(DREAM_FIXTURE), torch_dtype="bfloat16", device="cpu")
    assert encoder.model.dtype == torch.bfloat16


def test_eval_and_training_use_the_same_dtype_names(capsys):
    from diffusion_embedder.evaluation.run import build_parser
    from diffusion_embedder.training.arguments import ModelArguments

    dtype = next(f for f in dataclasses.fields(ModelArguments) if f.name == "torch_dtype")
    assert dtype.metadata["choices"] == (None, *TORCH_DTYPES)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--base_model_name_or_path", "m", "--torch_dtype", "fp16"])
    assert "torch_dtype: 'fp16' is not one of ['auto', 'bfloat16', 'float16', 'float32']" in capsys.readouterr().err
    assert build_parser().parse_args(["--torch_dtype", "bfloat16"]).torch_dtype == "bfloat16"


# ---------------------------------------------------------------- broken checkpoint files


def _no_weights(*args, **kwargs):
    raise AssertionError("the weights were loaded although the checkpoint is unusable")


@pytest.fixture
def broken_copy(family_checkpoint, tmp_path):
    def copy(family: str):
        folder = tmp_path / family
        shutil.copytree(family_checkpoint(family), folder)
        return folder

    return copy


@pytest.mark.parametrize("family", BACKBONES)
@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage"])
def test_corrupted_safetensors_names_the_file(broken_copy, family, damage, monkeypatch):
    folder = broken_copy(family)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes({"truncated": data[: len(data) - 100], "empty": b"", "garbage": b"\x00" * 4096}[damage])
    monkeypatch.setattr(backbones.AutoModel, "from_pretrained", _no_weights)
    with pytest.raises(OSError, match=re.escape(f"{weights} is truncated or corrupted")):
        Encoder.from_pretrained(str(folder))


@pytest.mark.parametrize("family", BACKBONES)
def test_missing_tokenizer_files_fail_before_the_weights_load(broken_copy, family, monkeypatch):
    folder = broken_copy(family)
    for name in ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer.model"):
        (folder / name).unlink(missing_ok=True)
    monkeypatch.setattr(backbones, "load_backbone", _no_weights)
    expected = f"No tokenizer files in '{folder}': expected tokenizer.json or vocab.json+merges.txt"
    with pytest.raises(FileNotFoundError, match=re.escape(expected)):
        Encoder.from_pretrained(str(folder))


#: config.json is required; llm2vec_config.json and encoder_config.json are optional, so only broken ones fail.
CONFIG_DAMAGE = [("config.json", "missing")] + [
    (name, damage)
    for name in ("config.json", "llm2vec_config.json", "encoder_config.json")
    for damage in ("not json", "a list")
]


@pytest.mark.parametrize("family", BACKBONES)
@pytest.mark.parametrize("name,damage", CONFIG_DAMAGE)
def test_broken_config_files_name_the_file(broken_copy, family, name, damage, monkeypatch):
    folder = broken_copy(family)
    path = folder / name
    if damage == "missing":
        path.unlink()
        expected = f"No config.json in '{folder}'"
    elif damage == "not json":
        path.write_text('{"pooling_mode": "mean",')
        expected = f"{path}:1: not valid JSON"
    else:
        path.write_text(json.dumps(["mean"]))
        expected = f"{path}: expected a JSON object, got list"
    monkeypatch.setattr(backbones, "load_backbone", _no_weights)
    with pytest.raises((ValueError, FileNotFoundError), match=re.escape(expected)):
        Encoder.from_pretrained(str(folder))


@pytest.mark.parametrize("family", BACKBONES)
def test_weights_missing_a_tensor_are_refused_not_random(broken_copy, family):
    """A readable file that lacks a tensor would be filled with random values by transformers: refuse it."""
    folder = broken_copy(family)
    weights = load_file(folder / "model.safetensors")
    dropped = sorted(name for name in weights if "layers.1." in name or "blocks.1." in name)[0]
    del weights[dropped]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(OSError, match=rf"The weights in '{re.escape(str(folder))}' lack 1 tensor\(s\)"):
        Encoder.from_pretrained(str(folder))


def test_sharded_checkpoint_names_the_damaged_shard(family_checkpoint, tmp_path, monkeypatch):
    from transformers import AutoModel

    AutoModel.from_pretrained(str(family_checkpoint("llama"))).save_pretrained(tmp_path, max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(family_checkpoint("llama") / name, tmp_path / name)
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 2 and not (tmp_path / "model.safetensors").exists()
    assert Encoder.from_pretrained(str(tmp_path)).encode(["a"], show_progress_bar=False).shape == (1, 64)
    shards[1].write_bytes(shards[1].read_bytes()[:-10])
    monkeypatch.setattr(backbones.AutoModel, "from_pretrained", _no_weights)
    with pytest.raises(OSError, match=re.escape(f"{shards[1]} is truncated or corrupted")):
        Encoder.from_pretrained(str(tmp_path))
