"""Training config validation: every problem named before any model loads; overrides; the paper's configs."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from diffusion_embedder.training import supervised as run_module
from diffusion_embedder.training.arguments import (
    ARGUMENT_CLASSES,
    ConfigError,
    load_config,
    parse_overrides,
    read_config_values,
    validate,
)
from diffusion_embedder.training.supervised import experiment_id

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "train_configs" / "tiny" / "custom.json"
MINIMAL = {"model_name_or_path": "m", "dataset_name": "Custom", "output_dir": "out", "report_to": "none"}


def errors_of(values: dict) -> str:
    with pytest.raises(ConfigError) as info:
        validate(values)
    return str(info.value)


def test_unknown_key_names_closest_valid_key():
    message = errors_of({**MINIMAL, "learning_rte": 1e-4, "lora_rr": 4})
    assert "unknown key 'learning_rte'; did you mean 'learning_rate'?" in message
    assert "unknown key 'lora_rr'; did you mean 'lora_r'?" in message


def test_wrong_types_name_field_value_and_type():
    message = errors_of({**MINIMAL, "lora_r": "16", "bf16": "yes", "learning_rate": True, "loss_scale": [1]})
    assert "lora_r: '16' (str) is not of type int" in message
    assert "bf16: 'yes' (str) is not of type bool" in message
    assert "learning_rate: True (bool) is not of type float" in message
    assert "loss_scale: [1] (list) is not of type float" in message


def test_missing_required_fields_are_named():
    message = errors_of({"report_to": "none"})
    for name in ("model_name_or_path", "dataset_name", "output_dir"):
        assert f"missing required field {name!r}" in message


def test_choices_are_checked_with_suggestions():
    message = errors_of({**MINIMAL, "pooling_mode": "meen", "lr_scheduler_type": "linaer", "loss_class": "Repllama"})
    assert "pooling_mode: 'meen' is not one of" in message and "did you mean 'mean'?" in message
    assert "lr_scheduler_type: 'linaer'" in message and "did you mean 'linear'?" in message
    assert "loss_class: 'Repllama'" in message and "'RepllamaLoss'" in message
    assert "lora_r: must be >= 1, got 0" in errors_of({**MINIMAL, "lora_r": 0})


def test_valid_config_builds_all_groups_with_upstream_defaults():
    cfg = validate({**MINIMAL, "lora_r": 16, "learning_rate": 1, "gradient_checkpointing": True})
    assert cfg.custom.lora_alpha == 32  # 2r
    assert cfg.custom.lora_dropout == 0.05
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert cfg.custom.lora_target_modules == targets
    assert cfg.training.learning_rate == 1 and cfg.training.remove_unused_columns is False
    assert cfg.model.attn_implementation == "sdpa" and cfg.data.group_by == "global"
    assert validate({**MINIMAL, "lora_r": 4, "lora_alpha": 4}).custom.lora_alpha == 4


def test_cli_overrides_are_typed_and_win(tmp_path):
    argv = ["--learning_rate", "1e-4", "--bf16", "--lora_r=4", "--lora_target_modules", '["q_proj"]']
    overrides = parse_overrides([*argv, "--torch_dtype", "null", "--report_to", "none", "--lora_alpha", "None"])
    assert overrides == {
        "learning_rate": 1e-4,
        "bf16": True,
        "lora_r": 4,
        "lora_target_modules": ["q_proj"],
        "torch_dtype": None,
        "report_to": "none",
        "lora_alpha": None,
    }
    cfg = load_config(TINY, ["--learning_rate", "0.5", "--experiment_id", "x1", "--output_dir", str(tmp_path)])
    assert cfg.training.learning_rate == 0.5 and cfg.custom.experiment_id == "x1"
    with pytest.raises(ConfigError, match="lora_r: 'four'"):
        load_config(TINY, ["--lora_r", "four"])
    with pytest.raises(ConfigError, match="Expected --key value"):
        load_config(TINY, ["lora_r", "4"])


def test_bad_json_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{\n  "lora_r": 4,\n  "lr" 1\n}')
    with pytest.raises(ConfigError, match=r"bad.json:3: not valid JSON \(line 3"):
        load_config(bad)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.json")


def test_bad_config_stops_before_any_model_loads(tmp_path, monkeypatch, caplog):
    def must_not_load(*args, **kwargs):
        raise AssertionError("the model was loaded for an invalid config")

    monkeypatch.setattr(run_module, "prepare_encoder", must_not_load)
    config = json.loads(TINY.read_text())
    config["poolng_mode"] = "mean"
    path = tmp_path / "c.json"
    path.write_text(json.dumps(config))
    assert run_module.main([str(path)]) == 2
    assert "did you mean 'pooling_mode'?" in caplog.text


def test_experiment_id_matches_upstream_pattern():
    cfg = validate(
        {
            "model_name_or_path": "siyue/Dream_emb",
            "dataset_name": "E5Mix",
            "output_dir": "out",
            "report_to": "none",
            "bidirectional": True,
            "max_seq_length": 4096,
            "per_device_train_batch_size": 16,
            "num_train_epochs": 1,
            "warmup_steps": 100,
            "learning_rate": 1e-4,
            "lora_r": 16,
        }
    )
    expected = "E5Mix_train_m-Dream_emb_p-mean_b-16_l-4096_bidirectional-True_e-1_s-42_w-100_lr-0.0001_lora_r-16"
    assert experiment_id(cfg) == expected


@pytest.mark.parametrize("path", sorted((ROOT / "train_configs").glob("*/*.json")), ids=lambda p: p.stem)
def test_shipped_configs_validate(path):
    from diffusion_embedder.training import lm, simcse

    overrides = ["--bf16", "false"]  # bf16 is refused on a CPU without bf16 support
    if path.parent.name in ("mntp", "mdm", "study") or path.stem in ("mntp", "mdm"):
        _, training = lm.LM_STAGE.validate(
            lm.read_config_values(path, overrides, lm.LM_STAGE.classes)
        )
        assert training.output_dir
        return
    if "simcse" in (path.parent.name, path.stem):
        cfg = validate({**simcse.SIMCSE_DEFAULTS, **read_config_values(path, overrides)})
        simcse.check_simcse(cfg, str(path))
        assert cfg.data.dataset_name == "Wiki1M" and cfg.custom.simcse_dropout == 0.3
        return
    cfg = load_config(path, overrides)
    assert cfg.training.output_dir


#: The paper's configs (``train_configs/<stage>/<Model>[_task].json``) and the family of their model.
PAPER_CONFIGS = sorted(
    p for stage in ("supervised", "mntp", "mdm", "simcse") for p in (ROOT / "train_configs" / stage).glob("*.json")
)
FAMILY_OF = {
    "Dream": "Dream",
    "LLaDA": "llada",
    "MetaLlama3": "llama",
    "Mistral": "mistral",
    "Qwen2": "qwen2",
    "Qwen3": "qwen3",
    "Gemma2": "gemma2",
}


def test_paper_configs_name_an_attention_kernel_that_runs_here(family_checkpoint):
    """17 of them named flash_attention_2, which stops every machine without flash-attn; each now names a
    kernel this machine has, and a tiny checkpoint of its model's family loads with it."""
    from diffusion_embedder.backbones import load_backbone
    from diffusion_embedder.training.schema import requirement_errors

    assert len(PAPER_CONFIGS) == 28
    kernels = {}
    for path in PAPER_CONFIGS:
        values = json.loads(path.read_text())
        assert not requirement_errors(values), path
        kernels[(FAMILY_OF[path.stem.split("_")[0]], values.get("attn_implementation", "sdpa"))] = path
    for family, kernel in kernels:
        model = load_backbone(str(family_checkpoint(family)), attn_implementation=kernel)
        assert model.config._attn_implementation == kernel, (family, kernel)


@pytest.mark.parametrize(
    ("stage", "config"), [("train", "supervised/Qwen2_theorem.json"), ("mntp", "mntp/Qwen2.json")]
)
def test_flash_attention_where_it_is_missing_stops_with_the_fix(stage, config, tmp_path, monkeypatch, caplog):
    """A kernel we cannot honour stops the run with the config, naming field, file and fix; no fallback."""
    import transformers.utils

    from diffusion_embedder import cli
    from diffusion_embedder.training import lm

    def must_not_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: False)
    monkeypatch.setattr(run_module, "prepare_encoder", must_not_load)
    monkeypatch.setattr(lm, "build_model", must_not_load)
    monkeypatch.chdir(ROOT)
    path = f"train_configs/{config}"
    argv = [stage, path, "--attn_implementation", "flash_attention_2", "--output_dir", str(tmp_path), "--bf16", "false"]
    assert cli.main(argv) == 2
    assert f"Invalid training config {path}:" in caplog.text
    assert "attn_implementation: 'flash_attention_2' needs the flash-attn package and a CUDA GPU" in caplog.text
    assert "which this machine lacks (no other kernel is used instead)" in caplog.text
    assert '"attn_implementation": "sdpa" in the config' in caplog.text and "--attn_implementation sdpa" in caplog.text
    assert not any(tmp_path.iterdir())


def test_paper_configs_carry_section9_hyperparameters():
    def load(name):
        return load_config(ROOT / "train_configs" / "supervised" / f"{name}.json", ["--bf16", "false"])

    dream_if = load("Dream_if")
    assert (dream_if.model.model_name_or_path, dream_if.custom.loss_class) == ("siyue/Dream_emb", "RepllamaLoss")
    assert dream_if.custom.scale_by_dim and dream_if.custom.lora_r == 32 and dream_if.custom.lora_alpha == 64
    assert (dream_if.model.max_length, dream_if.model.doc_max_length) == (304, 196)
    t = dream_if.training
    assert (t.learning_rate, t.warmup_steps, t.per_device_train_batch_size, t.gradient_accumulation_steps) == (
        1e-4,
        20,
        8,
        4,
    )
    assert (t.save_steps, dream_if.custom.stop_after_n_steps, dream_if.data.num_negatives) == (50, 1000, 15)
    dream_long = load("Dream_long")
    assert (dream_long.training.learning_rate, dream_long.custom.stop_after_n_steps) == (5e-5, 4000)
    assert dream_long.custom.loss_scale == 50.0 and dream_long.model.max_length == 4096
    llama_long = load("MetaLlama3_long")
    assert llama_long.training.warmup_steps == 200 and "mntp" in llama_long.model.peft_model_name_or_path
    mistral_theorem = load("Mistral_theorem")
    assert mistral_theorem.model.peft_model_name_or_path.endswith("mntp-unsup-simcse")
    assert mistral_theorem.data.dataset_name == "ReasonAug" and mistral_theorem.training.save_steps == 500
    for name in ("Dream_if", "Dream_long", "Dream_theorem", "Qwen2_if", "Mistral_long"):
        cfg = load(name)
        assert cfg.model.enable_bidirectional and cfg.model.pooling_mode == "mean" and cfg.training.seed == 42
        assert cfg.training.report_to == ["tensorboard"] and cfg.custom.lora_dropout == 0.05


def test_config_accepts_exactly_the_registered_losses():
    """``losses.LOSSES`` is the one list of losses: every registered loss validates and builds from a config
    (its options are config fields), and the config accepts no loss_class that is not registered."""
    from diffusion_embedder.losses import LOSSES, loss_from_config
    from diffusion_embedder.training.arguments import CustomArguments

    accepted = next(f for f in dataclasses.fields(CustomArguments) if f.name == "loss_class").metadata["choices"]
    assert sorted(accepted) == sorted(LOSSES)
    fields = {f.name for f in dataclasses.fields(CustomArguments)}
    for name, spec in LOSSES.items():
        assert set(spec.options.values()) <= fields, name
        cfg = validate({**MINIMAL, "loss_class": name})
        assert isinstance(loss_from_config(cfg.custom.loss_class, cfg.custom), spec.loss)
    assert "loss_class: 'Triplet' is not one of" in errors_of({**MINIMAL, "loss_class": "Triplet"})


@pytest.mark.parametrize("installed", ["activation_checkpointing", "gradient_checkpointing"])
def test_checkpointing_is_read_under_the_installed_transformers_spelling(installed):
    """transformers 5.23 names it activation_checkpointing, 5.17 (the GPU machines) gradient_checkpointing: the
    shipped configs use one spelling and must validate on both releases."""
    from diffusion_embedder.training.schema import StageSchema

    @dataclasses.dataclass
    class Release:  # stands in for the installed TrainingArguments, holding only one spelling
        output_dir: str | None = None
        remove_unused_columns: bool = True

    field = dataclasses.field(default=False)
    field_kwargs = dataclasses.field(default=None)
    Release = dataclasses.make_dataclass(
        "Release", [(installed, bool, field), (f"{installed}_kwargs", dict | None, field_kwargs)], bases=(Release,)
    )
    schema = StageSchema((Release,))
    for spelling in ("activation_checkpointing", "gradient_checkpointing"):
        values = {"output_dir": "o", spelling: True, f"{spelling}_kwargs": {"use_reentrant": False}}
        (args,) = schema.validate(values)
        assert getattr(args, installed) is True and getattr(args, f"{installed}_kwargs") == {"use_reentrant": False}
    both = {"output_dir": "o", "activation_checkpointing": True, "gradient_checkpointing": True}
    with pytest.raises(ConfigError, match="same setting"):
        schema.validate(both)


@pytest.mark.parametrize("installed", [("activation_checkpointing",), ("gradient_checkpointing",),
                                       ("activation_checkpointing", "gradient_checkpointing")])
def test_either_checkpointing_spelling_works_on_the_command_line_and_errors_name_it_as_given(installed, tmp_path):
    """On 5.17 ``--activation_checkpointing false`` reached the run as the string 'false' (typed by no field); on
    5.23, which has both fields (the old one a deprecated alias the new one overrides), ``--gradient_checkpointing
    false`` beside a config's ``activation_checkpointing: true`` was silently ignored. Either spelling is read under
    the newest one installed, an override replaces the other spelling, and errors name the spelling given."""
    from diffusion_embedder.training.arguments import parse_overrides, read_config_values
    from diffusion_embedder.training.schema import StageSchema

    Release = dataclasses.make_dataclass(
        "Release", [("output_dir", str | None, dataclasses.field(default=None)),
                    ("remove_unused_columns", bool, dataclasses.field(default=True)),
                    *[(name, bool, dataclasses.field(default=False)) for name in installed]],
    )
    read_as = installed[0]  # the newest spelling installed
    schema = StageSchema((Release,))
    for spelling in ("activation_checkpointing", "gradient_checkpointing"):
        overrides = parse_overrides([f"--{spelling}", "false"], (Release,))
        assert overrides == {spelling: False} and schema.canonical(overrides) == ({read_as: False}, [])
        config = tmp_path / f"{spelling}.json"
        other = "gradient_checkpointing" if spelling == "activation_checkpointing" else "activation_checkpointing"
        config.write_text(json.dumps({"output_dir": "o", other: True}))
        values = read_config_values(config, [f"--{spelling}", "false"], (Release,))
        (args,) = schema.validate(values)
        assert getattr(args, read_as) is False
        with pytest.raises(ConfigError) as err:
            schema.validate({"output_dir": "o", spelling: "maybe"})
        assert f"- {spelling}: 'maybe' (str) is not of type bool" in str(err.value)
    with pytest.raises(ConfigError, match="same setting"):
        schema.validate({"output_dir": "o", "activation_checkpointing": True, "gradient_checkpointing": False})


def test_a_gradient_checkpointing_override_reaches_the_installed_training_arguments():
    """The real TrainingArguments of the installed transformers, through the supervised stage's config reader."""
    from diffusion_embedder.training.arguments import load_config

    config = ROOT / "train_configs" / "tiny" / "custom.json"
    assert json.loads(config.read_text())["activation_checkpointing"] is True
    for spelling in ("activation_checkpointing", "gradient_checkpointing"):
        training = load_config(config, [f"--{spelling}", "false", "--output_dir", "o"]).training
        names = ("activation_checkpointing", "gradient_checkpointing")
        assert not any(getattr(training, name, False) for name in names)


def test_a_nan_is_refused_for_every_field_with_a_range():
    """JSON's NaN (which Python's json reads) passed every range check: each comparison with NaN is false, so a NaN
    learning rate or dropout reached the run. Every ranged field of the supervised stage refuses it by name."""
    from diffusion_embedder.training.schema import RANGES, field_aliases, field_table

    table, aliases = field_table(ARGUMENT_CLASSES), field_aliases(ARGUMENT_CLASSES)
    ranged = [name for name in RANGES if name in table and name not in aliases]  # one spelling of each
    message = errors_of({**MINIMAL, **dict.fromkeys(ranged, float("nan"))})
    for name in ranged:
        assert re.search(rf"- {name}: (must be a number, got nan|nan \(float\) is not of type)", message), name
    assert "learning_rate: must be a number, got nan" in message and "lora_dropout: must be a number" in message
