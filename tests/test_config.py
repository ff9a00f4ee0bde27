"""EncoderConfig: one resolution order, one validation, and every derived field reaching the encoder."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from conftest import LLAMA_FIXTURE
from numerics import ORDER_EPS, REFERENCE_EPS, assert_close_normwise

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
    "mask_readout_tokens": 3,
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
    with pytest.raises(ConfigError, match="- max_seq_length: must be >= 1"):  # named as the config spells it
        validate({**base, "max_seq_length": 0})
    with pytest.raises(ConfigError, match="- max_length: must be >= 1"):
        validate({**base, "max_length": 0})


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
    with pytest.raises(ValueError, match=r"llm2vec_config.json:1: not valid JSON \(line 1"):
        read_settings(str(path))


# ------------------------------------------------------------------ derived fields reach the encoder
def test_training_model_arguments_are_derived_and_reach_the_encoder():
    from diffusion_embedder.training.supervised import prepare_encoder

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
        text = json.dumps(value) if isinstance(value, dict) else str(value)
        argv += [f"--{key}", text.lower() if isinstance(value, bool) else text]
    args = eval_run.parse_args(argv)
    encoder = eval_run.load_encoder(args)
    assert {k: getattr(encoder.config, k) for k in NON_DEFAULT} == NON_DEFAULT
    unset = eval_run.parse_args(["--local_task", "x"])
    assert eval_run.encoder_overrides(unset) == {}  # the checkpoint's own settings apply


# ------------------------------------------------------------------ --help, usage names, --version
def _help(argv, capsys) -> str:
    from diffusion_embedder import cli

    try:
        code = cli.main(argv)
    except SystemExit as exit_:
        code = exit_.code
    assert code == 0
    return capsys.readouterr().out


def _parsers():
    """Every argparse parser behind ``diffusion-embedder eval | report | reasonaug [stage]`` (and the demo's)."""
    import argparse

    import demo  # experiments/demo.py

    from diffusion_embedder.evaluation import report
    from diffusion_embedder.reasonaug import cli as reasonaug_cli

    captured = {}
    for name, module in (("report", report), ("demo", demo)):
        real = argparse.ArgumentParser.parse_args

        def grab(self, args=None, namespace=None, _name=name):
            captured[_name] = self
            raise SystemExit(0)

        argparse.ArgumentParser.parse_args = grab
        try:
            with pytest.raises(SystemExit):
                module.main([])
        finally:
            argparse.ArgumentParser.parse_args = real
    yield ["eval"], eval_run.build_parser()
    yield ["report"], captured["report"]
    yield ["demo"], captured["demo"]
    reasonaug = reasonaug_cli.build_parser()
    yield ["reasonaug"], reasonaug
    subparsers = next(a for a in reasonaug._actions if isinstance(a, argparse._SubParsersAction))
    for stage, parser in subparsers.choices.items():
        yield ["reasonaug", stage], parser


def _entries(text: str) -> dict[str, str]:
    """Option -> its help entry (argparse puts a long option's help on the next line)."""
    entries: dict[str, str] = {}
    current: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("-"):  # "-h, --help" or "--flag-name, --flag_name VALUE": each spelling
            current = [word.rstrip(",") for word in stripped.split("  ")[0].split() if word.startswith("-")]
            current = ["--help" if name == "-h" else name for name in current]
            entries.update(dict.fromkeys(current, stripped))
        elif current and line.startswith("   ") and stripped:
            for name in current:
                entries[name] += " " + stripped
        else:
            current = []
    return entries


def test_help_of_every_subcommand_lists_every_option_with_default_and_choices(capsys, monkeypatch):
    import argparse

    monkeypatch.setenv("COLUMNS", "400")  # one line per option
    for argv, parser in _parsers():
        if argv == ["demo"]:  # an experiment, not a package command: its own script prints the help
            import demo  # experiments/demo.py

            with pytest.raises(SystemExit):
                demo.main(["--help"])
            text = capsys.readouterr().out
            assert text.startswith("usage: python experiments/demo.py "), text[:80]
        else:
            text = _help([*argv, "--help"], capsys)
            assert text.startswith(f"usage: diffusion-embedder {' '.join(argv)} "), text[:80]
        for action in parser._actions:
            if not action.option_strings or action.default is argparse.SUPPRESS:
                continue
            line = _entries(text)[action.option_strings[-1]]
            assert "default: " in line, (argv, line)
            for choice in action.choices or ():
                assert str(choice) in line, (argv, line)


def test_train_help_lists_every_config_field_with_default_and_choices(capsys):
    from diffusion_embedder.training.arguments import ARGUMENT_CLASSES

    text = _help(["train", "--help"], capsys)
    assert text.startswith("usage: diffusion-embedder train CONFIG.json")
    lines = {line.split()[0]: line for line in text.splitlines() if line.startswith("  --")}
    for cls in ARGUMENT_CLASSES[:3]:
        for f in dataclasses.fields(cls):
            line = lines[f"--{f.name}"]
            default = "required" if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING else (
                repr(f.default) if f.default is not dataclasses.MISSING else repr(f.default_factory())
            )
            assert f"(default: {default}" in line, line
            for choice in f.metadata.get("choices") or ():
                assert str(choice) in line, line
    assert "--prompt_template" in lines and "--max_length" in lines  # EncoderConfig's fields are there


def test_version(capsys):
    from diffusion_embedder import __version__

    assert _help(["--version"], capsys).strip() == f"diffusion-embedder {__version__}"


# ------------------------------------------------------------------ loading reports only what matters
def test_loading_a_causal_lm_checkpoint_prints_no_load_report(caplog, capfd):
    """The fixture holds lm_head.weight (a *ForCausalLM checkpoint): dropping it is expected, not reported."""
    import logging

    with caplog.at_level(logging.INFO):
        Encoder.from_pretrained(str(LLAMA_FIXTURE), device="cpu")
    shown = caplog.text + capfd.readouterr().err
    assert "LOAD REPORT" not in shown and "UNEXPECTED" not in shown and "lm_head" not in shown


def test_an_unused_tensor_other_than_the_head_is_still_reported(tmp_path, caplog):
    import logging

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "extra"
    shutil.copytree(LLAMA_FIXTURE, folder)
    weights = load_file(folder / "model.safetensors")
    weights["model.stray.weight"] = torch.zeros(2)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING):
        Encoder.from_pretrained(str(folder), device="cpu")
    assert "1 tensor(s) not used by the model: ['model.stray.weight']" in caplog.text


# ---------------------------------------------------------- LLM2Vec drop-in: its calls, attributes, saved folders
def test_llm2vec_style_calls_positional_arguments_triples_and_attributes():
    """Calls as in LLM2Vec's README and examples give the fixture's LLM2Vec vectors."""
    import numpy as np

    from diffusion_embedder import LLM2Vec

    cases = json.loads((LLAMA_FIXTURE / "cases.json").read_text())
    triple = next(c for c in cases if c.get("input_form") == "triple")
    l2v = LLM2Vec.from_pretrained(str(LLAMA_FIXTURE), pooling_mode=triple["pooling_mode"],
                                  skip_instruction=triple["skip_instruction"], max_length=triple["max_length"],
                                  torch_dtype=torch.float32, device="cpu")
    # encode(sentences, batch_size, show_progress_bar, convert_to_numpy, convert_to_tensor, device), positionally
    out = l2v.encode(triple["inputs"], 3, False, True, False, "cpu")
    assert isinstance(out, np.ndarray)
    assert_close_normwise(out, np.array(triple["embeddings"]), eps_multiple=REFERENCE_EPS, rows=True)
    single = l2v.encode(triple["inputs"][0], 8, False)  # one [instruction, text, id] triple: one input
    assert_close_normwise(single.numpy(), out[:1], eps_multiple=ORDER_EPS, rows=True)
    # LLM2Vec's attributes and methods, with its meaning
    assert (l2v.pooling_mode, l2v.max_length, l2v.doc_max_length, l2v.skip_instruction) == ("mean", 256, 400, True)
    assert l2v.model is not None and l2v.tokenizer.padding_side == "left"
    l2v.skip_instruction = False
    assert l2v.config.skip_instruction is False and not np.allclose(l2v.encode(triple["inputs"][:2]).numpy(), out[:2])
    with pytest.raises(ValueError, match="max_length: must be >= 1"):
        l2v.max_length = 0
    assert l2v.max_length == 256  # a refused value leaves the encoder as it was
    features = l2v.tokenize([["Retrieve it", "a short text"], ["", "another"]])
    assert {"input_ids", "attention_mask", "embed_mask"} <= set(features)
    assert l2v.forward(features).shape == (2, 64)
    l2v.pooling_mode = "eos_token"  # LLM2Vec appends " </s>" for eos_token pooling and keeps the separator
    assert l2v.prepare_for_tokenization("Find it !@#$%^&*()the text ") == "Find it !@#$%^&*()the text </s>"
    assert l2v.prepare_for_tokenization("plain") == "plain </s>"
    # LLM2Vec's two steps, tokenize(prepare_for_tokenization(x)), add the template and EOS string once
    wrapped = LLM2Vec(l2v.model, l2v.tokenizer, pooling_mode="eos_token", prompt_template="<u>{text}</u>")
    prepared = wrapped.prepare_for_tokenization("Find it !@#$%^&*()the text")
    assert prepared == "<u>Find it !@#$%^&*()the text</u> </s>"
    two_steps, direct = wrapped.tokenize([prepared]), wrapped.tokenize([["Find it", "the text"]])
    assert all(torch.equal(two_steps[k], direct[k]) for k in ("input_ids", "attention_mask", "embed_mask"))


def test_saved_folder_is_written_in_forms_older_releases_read(tmp_path):
    encoder = Encoder.from_pretrained(str(LLAMA_FIXTURE), torch_dtype=torch.float32, device="cpu")
    expected = encoder.encode([["Find it", "a quiet violin"], "plain"], show_progress_bar=False)
    encoder.save(str(tmp_path / "enc"), merge_before_save=True)
    tokenizer = json.loads((tmp_path / "enc" / "tokenizer.json").read_text())
    assert all(isinstance(m, str) for m in tokenizer["model"]["merges"])  # tokenizers < 0.20
    tokenizer_config = json.loads((tmp_path / "enc" / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast"  # not transformers 5's TokenizersBackend
    assert json.loads((tmp_path / "enc" / "config.json").read_text())["rope_theta"] == 10000.0
    assert (tmp_path / "enc" / "special_tokens_map.json").is_file()
    reloaded = Encoder.from_pretrained(str(tmp_path / "enc"), torch_dtype=torch.float32, device="cpu")
    assert_close_normwise(
        reloaded.encode([["Find it", "a quiet violin"], "plain"], show_progress_bar=False), expected,
        eps_multiple=ORDER_EPS, rows=True
    )
    encoder.save(str(tmp_path / "bare"), save_config=False)  # LLM2Vec's save_config
    assert not (tmp_path / "bare" / "llm2vec_config.json").exists()
    assert not (tmp_path / "bare" / "encoder_config.json").exists()
