"""EncoderConfig: one resolution order, one validation, and every derived field reaching the encoder."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from conftest import LLAMA_FIXTURE

from diffusion_embedder import Encoder
from diffusion_embedder.config import (
    LAYERS,
    EncoderConfig,
    read_settings,
    resolve_config,
    setting_fields,
)
from diffusion_embedder.evaluation import run as eval_run
from diffusion_embedder.templates import known_settings
from diffusion_embedder.training.arguments import ConfigError, ModelArguments, validate

BAD_TEMPLATES = ["no slot here", "{text} and {text}"]

#: A value for every setting that differs from its default (each derived field must carry it through).
NON_DEFAULT = {
    "pooling_mode": "weighted_mean",
    "max_length": 77,
    "doc_max_length": 33,
    "skip_instruction": False,
    "enable_bidirectional": False,
    "prompt_template": "<u>{text}</u>",
    "eos_suffix": "</s>",
    "latent_num_latents": 4,
    "latent_num_heads": 2,
    "prompts": {"query": "Find the passage"},
    "similarity_fn_name": "dot",
}


def test_non_default_table_covers_every_setting():
    defaults = EncoderConfig()
    assert set(NON_DEFAULT) == {f.name for f in setting_fields()}
    assert all(getattr(defaults, k) != v for k, v in NON_DEFAULT.items())


# ------------------------------------------------------------------ resolution order, without weights
def test_resolution_order_each_layer_beats_the_ones_below():
    assert LAYERS == (
        "defaults", "llm2vec_config.json", "encoder_config.json", "known checkpoint names", "explicit arguments"
    )
    llm2vec = {"pooling_mode": "eos_token", "max_length": 100, "doc_max_length": 90, "skip_instruction": False}
    encoder = {"max_length": 200, "doc_max_length": 190, "skip_instruction": True}
    known = {"doc_max_length": 300, "skip_instruction": False}
    explicit = {"skip_instruction": True, "pooling_mode": None}  # None: not given
    config = resolve_config(llm2vec, encoder, known, explicit)
    assert config.pooling_mode == "eos_token"  # llm2vec_config.json beats the default, explicit None doesn't count
    assert config.max_length == 200  # encoder_config.json beats llm2vec_config.json
    assert config.doc_max_length == 300  # known names beat encoder_config.json
    assert config.skip_instruction is True  # explicit beats known
    assert config.enable_bidirectional is True and config.latent_num_heads == 8  # defaults
    assert resolve_config() == EncoderConfig()


def test_known_names_give_llm2vec_settings_and_templates():
    e5 = known_settings(["intfloat/e5-mistral-7b-instruct"])
    assert e5["pooling_mode"] == "eos_token" and e5["max_length"] == 4096 and e5["skip_instruction"] is False
    assert known_settings(["some/folder", "Qwen/Qwen2-7B-Instruct"])["prompt_template"].startswith("<|im_start|>")
    assert known_settings(["some/folder"]) == {}


def test_files_layers_resolve_in_order_when_loading(tmp_path):
    """A folder with both files: encoder_config.json wins over llm2vec_config.json, explicit over both."""
    folder = tmp_path / "enc"
    shutil.copytree(LLAMA_FIXTURE, folder)
    (folder / "llm2vec_config.json").write_text(json.dumps({"pooling_mode": "eos_token", "max_length": 64}))
    (folder / "encoder_config.json").write_text(json.dumps({"max_length": 48}))
    encoder = Encoder.from_pretrained(str(folder), doc_max_length=20, torch_dtype=torch.float32, device="cpu")
    assert (encoder.config.pooling_mode, encoder.config.max_length, encoder.config.doc_max_length) == (
        "eos_token", 48, 20
    )


def test_config_is_frozen_and_attributes_replace_it_validated():
    config = EncoderConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_length = 3  # type: ignore[misc]
    assert config.replace(max_length=3).max_length == 3 and config.max_length == 512


# ------------------------------------------------------------------ validation
@pytest.mark.parametrize("template", BAD_TEMPLATES)
def test_prompt_template_needs_text_exactly_once_everywhere(template, capsys):
    with pytest.raises(ValueError, match="prompt_template.*exactly once") as err:
        EncoderConfig(prompt_template=template)
    assert repr(template) in str(err.value)
    with pytest.raises(ValueError, match="exactly once"):
        Encoder.from_pretrained(str(LLAMA_FIXTURE), prompt_template=template, device="cpu")
    with pytest.raises(ConfigError, match="prompt_template.*exactly once"):
        validate({"model_name_or_path": "m", "dataset_name": "Custom", "output_dir": "o", "prompt_template": template})
    with pytest.raises(SystemExit):
        eval_run.parse_args(["--local_task", "x", "--prompt_template", template])
    assert "exactly once" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["max_length", "doc_max_length"])
def test_lengths_must_be_at_least_one_everywhere(name, capsys):
    with pytest.raises(ValueError, match=f"{name}: must be >= 1, got 0"):
        EncoderConfig(**{name: 0})
    with pytest.raises(ValueError, match=f"{name}: must be >= 1"):
        Encoder.from_pretrained(str(LLAMA_FIXTURE), device="cpu", **{name: 0})
    with pytest.raises(ConfigError, match=f"{name}: must be >= 1"):
        validate({"model_name_or_path": "m", "dataset_name": "Custom", "output_dir": "o", name: 0})
    with pytest.raises(SystemExit):
        eval_run.parse_args(["--local_task", "x", f"--{name}", "0"])
    assert f"{name}: must be >= 1" in capsys.readouterr().err


def test_upstream_training_names_are_aliases():
    base = {"model_name_or_path": "m", "dataset_name": "Custom", "output_dir": "o"}
    cfg = validate({**base, "max_seq_length": 99, "bidirectional": False})
    assert cfg.model.max_length == 99 and cfg.model.enable_bidirectional is False
    with pytest.raises(ConfigError, match="max_seq_length and max_length are the same setting"):
        validate({**base, "max_seq_length": 99, "max_length": 98})
    with pytest.raises(ConfigError, match="max_length: must be >= 1"):
        validate({**base, "max_seq_length": 0})


@pytest.mark.parametrize(
    ("filename", "key", "value"),
    [
        ("llm2vec_config.json", "max_length", "512"),
        ("llm2vec_config.json", "skip_instruction", "yes"),
        ("llm2vec_config.json", "pooling_mode", "average"),
        ("encoder_config.json", "doc_max_length", 1.5),
        ("encoder_config.json", "prompt_template", ["{text}"]),
    ],
)
def test_wrong_value_in_a_settings_file_names_file_and_key(tmp_path, filename, key, value):
    folder = tmp_path / "ckpt"
    shutil.copytree(LLAMA_FIXTURE, folder)
    (folder / filename).write_text(json.dumps({key: value}))
    with pytest.raises(ValueError) as err:
        Encoder.from_pretrained(str(folder), device="cpu")
    assert filename in str(err.value) and key in str(err.value) and repr(value) in str(err.value)


def test_malformed_settings_file_names_the_file(tmp_path):
    path = tmp_path / "llm2vec_config.json"
    path.write_text('{"max_length": 5')
    with pytest.raises(ValueError, match="llm2vec_config.json: not valid JSON"):
        read_settings(str(path))


# ------------------------------------------------------------------ derived fields reach the encoder
def test_training_model_arguments_are_derived_and_reach_the_encoder():
    from diffusion_embedder.training.trainer import prepare_encoder

    names = {f.name for f in dataclasses.fields(ModelArguments)}
    assert {f.name for f in setting_fields()} <= names
    for f in setting_fields():
        assert next(g for g in dataclasses.fields(ModelArguments) if g.name == f.name).default == f.default
    cfg = validate({"model_name_or_path": str(LLAMA_FIXTURE), "dataset_name": "Custom", "output_dir": "o",
                    "lora_r": 2, "use_cpu": True, **NON_DEFAULT})
    encoder = prepare_encoder(cfg.model, cfg.custom, cfg.training)
    assert {k: getattr(encoder.config, k) for k in NON_DEFAULT} == NON_DEFAULT
    assert encoder.model.config.is_causal is True  # enable_bidirectional=False reached the backbone


def test_eval_flags_are_derived_and_reach_the_encoder():
    argv = ["--base_model_name_or_path", str(LLAMA_FIXTURE), "--local_task", "x", "--device", "cpu"]
    for key, value in NON_DEFAULT.items():
        text = json.dumps(value) if isinstance(value, dict) else str(value).lower() if isinstance(value, bool) else value
        argv += [f"--{key}", str(text)]
    args = eval_run.parse_args(argv)
    encoder = eval_run.load_encoder(args)
    assert {k: getattr(encoder.config, k) for k in NON_DEFAULT} == NON_DEFAULT
    unset = eval_run.parse_args(["--local_task", "x"])
    assert eval_run.encoder_overrides(unset) == {}  # the checkpoint's own settings apply
