"""The site's generated reference pages say what the code does: every config field of every stage, with the rule the
validator applies (checked against the validator itself, value by value), every flag of every command with its
help, read from the live objects (so an added field or flag appears with no other edit); and the strict build's
check names a parameter an API docstring does not list."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import re
import sys
import types
from importlib import import_module
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs" / "hooks"))
reference = import_module("reference")
config_page = import_module("config_page")
cli_page = import_module("cli_page")

#: The smallest config each stage accepts (the validator says so: ``test_the_minimal_configs_are_valid``).
MINIMAL = {
    "supervised": {"model_name_or_path": "m", "dataset_name": "Custom", "output_dir": "out"},
    "simcse": {"model_name_or_path": "m", "dataset_name": "Custom", "output_dir": "out"},
    "mntp": {"model_name_or_path": "m", "train_file": ["t.txt"], "output_dir": "out"},
}
#: Fields whose null default the run turns into a value, as their help says (lora_alpha: 2 * lora_r).
DERIVED_DEFAULTS = {"lora_alpha"}


def _all_parsers() -> list[argparse.ArgumentParser]:
    from diffusion_embedder.cli import COMMANDS

    parsers = []
    todo = [import_module(m).build_parser() for m, _ in COMMANDS.values() if hasattr(import_module(m), "build_parser")]
    while todo:
        parser = todo.pop()
        parsers.append(parser)
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo += list(action.choices.values())
    return parsers


def _about(schema, values: dict, name: str) -> list[str]:
    """The validator's messages about field ``name`` (what this machine lacks aside: the page states it as a need)."""
    return [p for p in schema.problems(values) if re.match(rf"{re.escape(name)}\b", p) and "machine lacks" not in p]


def _sample(doc) -> object:
    """A value that sets the field (to see whether a stage refuses it when set)."""
    if doc.choices:
        return next((c for c in doc.choices if c), doc.choices[0])  # do_eval allows false only
    samples = {"bool": True, "dict": {"x": True}, "int": 1, "float": 0.5, "str": "x", "list": ["x"]}
    kinds = [t.split("[")[0] for t in doc.type.split(" or ")]
    return next((samples[t] for t in samples if t in kinds), None)  # None: a type with no sample (a config object)


# ------------------------------------------------------------------------------------------------ config reference
def test_the_minimal_configs_are_valid():
    schemas = config_page.stage_schemas()
    assert set(schemas) == set(MINIMAL)
    for stage, schema in schemas.items():
        assert schema.problems(dict(MINIMAL[stage])) == [], stage


def test_every_field_of_every_stage_has_a_block_with_a_stable_anchor():
    from diffusion_embedder.training.schema import argument_fields

    page = config_page.config_reference()
    schemas = config_page.stage_schemas()
    names = {name for schema in schemas.values() for cls in schema.classes for name in argument_fields(cls)}
    assert {"lora_r", "pooling_mode", "objective", "learning_rate", "break_run_claim", "pack_length"} <= names
    anchors = re.findall(r"^### `(\w+)` \{ #([\w-]+) \}$", page, re.M)
    assert {name for name, _ in anchors} == names
    assert len({anchor for _, anchor in anchors}) == len(anchors)  # unique
    assert ("pack_length", "field-pack_length") in anchors
    assert ("dataset_name", "field-dataset_name") in anchors and ("dataset_name", "field-dataset_name-mntp") in anchors


def test_every_key_of_a_shipped_training_config_has_a_block_or_is_another_spelling():
    page = config_page.config_reference()
    keys = {key for path in (ROOT / "train_configs").rglob("*.json") for key in json.loads(path.read_text())}
    assert len(keys) > 30
    missing = [key for key in keys if f"### `{key}` {{" not in page and f"`{key}` (" not in page]
    assert not missing


def test_our_fields_come_first_then_the_hugging_face_fields_we_restrict_then_the_others():
    page = config_page.config_reference()
    restricted = page.index("## Hugging Face fields with our rules")
    passed = page.index("## Hugging Face fields passed through")
    assert page.index("## ModelArguments") < page.index("## LMStageArguments") < restricted < passed

    def where(name: str) -> int:
        return page.index(f"### `{name}` {{")

    for ours in ("lora_r", "pooling_mode", "pack_length", "objective", "fused_head"):
        assert where(ours) < restricted, ours
    for hf in ("eval_strategy", "activation_checkpointing", "fsdp", "fsdp_config", "use_liger_kernel",
               "liger_kernel_config", "learning_rate", "output_dir"):
        assert restricted < where(hf) < passed, hf
    for hf in ("eval_steps", "report_to", "bf16"):
        assert where(hf) > passed, hf


def test_what_a_block_says_is_what_the_validator_does():
    """Per field and stage: the default the page shows is what the validated config holds when the field is left
    out; every listed choice and word is accepted; a range's bound is accepted or refused as the page says and the
    value beyond it refused; "only X" refuses the field's other values; a stage the page lists accepts the field
    set, a stage it says refuses it refuses it; a value the page says needs something is refused, where this
    machine lacks it, naming that need."""
    from diffusion_embedder.training.schema import field_table
    from diffusion_embedder.values import enum_choices

    schemas = config_page.stage_schemas()
    built = {stage: schema.resolve(dict(MINIMAL[stage]))[1] for stage, schema in schemas.items()}
    checked = 0
    for doc in config_page.config_fields():
        if doc.same_as:
            continue
        for stage in doc.stages + list(doc.refused_by):
            schema, values = schemas[stage], dict(MINIMAL[stage])
            sample = _sample(doc)
            refusals = [p for p in _about(schema, {**values, doc.name: sample}, doc.name)
                        if "not supported by this stage" in p]
            assert sample is not None or stage not in doc.refused_by, doc.name
            assert bool(refusals) == (stage in doc.refused_by), (stage, doc.name)
            if stage in doc.refused_by:
                continue
            if doc.section != config_page.PASSED and doc.name not in values and doc.name not in DERIVED_DEFAULTS:
                # the default a run sees (the fields passed through show transformers' declared default)
                if doc.default is config_page.REQUIRED:
                    assert any(f"missing required field {doc.name!r}" in p for p in schema.problems(
                        {k: v for k, v in values.items() if k != doc.name})), doc.name
                else:
                    value = next(getattr(o, doc.name) for o in built[stage] if hasattr(o, doc.name))
                    value = value.value if isinstance(value, enum.Enum) else value
                    assert json.dumps(value) == json.dumps(doc.default), (stage, doc.name, value, doc.default)
            for choice in doc.choices or ():
                assert _about(schema, {**values, doc.name: choice}, doc.name) == [], (stage, doc.name, choice)
            if doc.allowed.startswith("only "):
                others = [c for c in enum_choices(field_table(schema.classes)[doc.name][2]) or [not doc.choices[0]]
                          if c != doc.choices[0]]
                assert others and all(_about(schema, {**values, doc.name: c}, doc.name) for c in others), doc.name
            for word in doc.words:
                assert f'`"{word}"`' in doc.allowed, (doc.name, word)
                assert _about(schema, {**values, doc.name: word}, doc.name) == [], (doc.name, word)
            for op, bound in re.findall(r"(>=|>|<=|<) (-?\d+(?:\.\d+)?)(?!\))", doc.allowed):
                number = int if "int" in doc.type.split(" or ") and "." not in bound else float
                at, beyond = number(bound), number(bound) + (-1 if op.startswith(">") else 1)
                assert bool(_about(schema, {**values, doc.name: at}, doc.name)) == (op in (">", "<")), (doc.name, op)
                assert _about(schema, {**values, doc.name: beyond}, doc.name), (doc.name, op, beyond)
            for value, needs in re.findall(r"`(\"?\w+\"?)` needs ([^;]+)", doc.allowed):
                problems = [p for p in schema.problems({**values, doc.name: json.loads(value)})
                            if p.startswith(doc.name) and "machine lacks" in p]
                assert all(needs in p for p in problems), (doc.name, needs, problems)
            checked += 1
    assert checked > 150


def test_the_restricted_hugging_face_fields_show_our_rule_not_transformers_help():
    docs = {d.name: d for d in config_page.config_fields() if d.section != config_page.OURS}
    assert docs["eval_strategy"].allowed == 'only `"no"`' and docs["eval_strategy"].choices == ("no",)
    assert "steps" not in docs["eval_strategy"].allowed
    checkpointing = docs["activation_checkpointing"]
    assert checkpointing.default is False and '`"auto"`' in checkpointing.allowed and ">= 0" in checkpointing.allowed
    assert "20%" not in checkpointing.help and "auto" in checkpointing.help
    assert docs["fsdp"].stages == ["mntp"] and set(docs["fsdp"].refused_by) == {"supervised", "simcse"}
    assert docs["fsdp_config"].stages == ["mntp"]
    assert "20%" not in docs["use_liger_kernel"].help and "`qwen2`" in docs["use_liger_kernel"].allowed
    assert "`fused_linear_cross_entropy` must stay `false`" in docs["liger_kernel_config"].allowed
    assert docs["gradient_checkpointing"].same_as == "activation_checkpointing"
    assert docs["remove_unused_columns"].default is False  # ours, not transformers' default
    assert docs["bf16"].section == config_page.PASSED


def test_a_block_shows_each_fact_of_its_field():
    page = config_page.config_reference()
    block = page.split("### `eval_strategy` { #field-eval_strategy }", 1)[1].split("\n### ", 1)[0]
    assert "- **Default**: `\"no\"`" in block and "- **Allowed**: only `\"no\"`" in block
    assert "evaluate checkpoints with `diffusion-embedder eval`" in block
    block = page.split("### `fsdp` { #field-fsdp }", 1)[1].split("\n### ", 1)[0]
    assert "- **Stages**: mntp" in block and "- **Refused by** supervised, simcse: it trains a LoRA" in block
    block = page.split("### `max_length` { #field-max_length }", 1)[1].split("\n### ", 1)[0]
    assert "- **Also accepted as**: `max_seq_length` (upstream (LLM2Vec) name)" in block


def test_a_field_added_to_a_stage_appears_with_no_other_edit(monkeypatch):
    from transformers import TrainingArguments

    from diffusion_embedder.training.schema import StageSchema
    from diffusion_embedder.training.stages import STAGES, Stage

    @dataclasses.dataclass
    class NewArguments:
        """A stage added in a test."""

        brand_new_field: int = dataclasses.field(default=7, metadata={"help": "Added by the test."})

    module = types.ModuleType("docs_test_stage")
    module.SCHEMA = StageSchema((NewArguments, TrainingArguments), ranges={"brand_new_field": ((2, True), None)},
                                refused={"fsdp": "the test stage refuses it"})
    monkeypatch.setitem(sys.modules, "docs_test_stage", module)
    monkeypatch.setitem(STAGES, "docs_test", Stage("docs_test_stage", "a test stage", command="docs-test"))
    page = config_page.config_reference()
    block = page.split("### `brand_new_field` { #field-brand_new_field }", 1)[1].split("\n#", 1)[0]
    assert block.split("\n") == ["", "", "Added by the test.", "", "- **Type**: int", "- **Default**: `7`",
                                 "- **Allowed**: >= 2", "- **Stages**: docs_test", ""]
    fsdp = page.split("### `fsdp` { #field-fsdp }", 1)[1].split("\n### ", 1)[0]
    assert "- **Refused by** docs_test: the test stage refuses it" in fsdp


# ------------------------------------------------------------------------------------------------ CLI reference
def test_every_flag_of_every_command_is_in_the_cli_reference():
    from diffusion_embedder.cli import COMMANDS

    page = cli_page.cli_reference()
    for command in COMMANDS:
        assert f"## `diffusion-embedder {command}`" in page
    flags = {o for p in _all_parsers() for a in p._actions for o in a.option_strings if o not in ("-h", "--help")}
    assert {"--max_tokens_per_batch", "--benchmark", "--num_shards", "--stock_only", "--check"} <= flags
    missing = [flag for flag in flags if f"`{flag}`" not in page]
    assert not missing


def test_every_flag_has_help_text():
    empty = [f"{p.prog} {a.option_strings or a.dest}" for p in _all_parsers() for a in p._actions
             if not isinstance(a, argparse._SubParsersAction) and not (a.help or "").strip()]
    assert empty == []


def test_usage_is_the_installed_command_and_values_read_as_typed():
    page = cli_page.cli_reference()
    usage = [ln for ln in page.splitlines() if re.match(r"\s*(usage|or):", ln)]
    assert len(usage) > 10 and not [ln for ln in usage if "experiments/" in ln or re.search(r"(^|\s)python ", ln)]
    for command in ("train", "mntp", "simcse"):
        assert f"usage: diffusion-embedder {command} CONFIG.json" in page
        assert f"torchrun --nproc_per_node=N --no-python diffusion-embedder {command} CONFIG.json" in page
    assert "PosixPath" not in page and not re.search(r"<br>value\b", page)  # a flag without a type reads a string
    assert "Default `ReasonAug/concepts.jsonl`." in page  # a Path default, printed as the path
    assert "| `--output_dir` <br>str | results folder" in page  # a flag without a type is a string


def test_a_flag_added_to_a_parser_appears_with_no_other_edit(monkeypatch):
    from diffusion_embedder.evaluation import run

    build = run.build_parser

    def with_new_flag():
        parser = build()
        parser.add_argument("--brand_new_flag", type=int, default=3, help="added by the test")
        parser.add_argument("--brand_new_path", type=Path, default=Path("a/b.jsonl"), help="a path")
        return parser

    monkeypatch.setattr(run, "build_parser", with_new_flag)
    page = cli_page.cli_reference()
    assert "| `--brand_new_flag` <br>int | added by the test. Default `3`. |" in page
    assert "| `--brand_new_path` <br>path | a path. Default `a/b.jsonl`. |" in page


# ------------------------------------------------------------------------------------------------ API pages
def test_the_strict_check_names_a_parameter_the_args_section_does_not_list(monkeypatch):
    module = types.ModuleType("docs_test_api")

    def documented(text: str, count: int = 1) -> str:
        """Repeat a text.

        Args:
            text: What to repeat.
            count: How many times.
        """
        return text * count

    def named_in_prose(text: str, count: int = 1) -> str:
        """Repeat ``text`` ``count`` times.

        Args:
            text: What to repeat.
        """
        return text * count

    for fn in (documented, named_in_prose):
        fn.__module__ = "docs_test_api"
        fn.__qualname__ = fn.__name__
        setattr(module, fn.__name__, fn)
    monkeypatch.setitem(sys.modules, "docs_test_api", module)
    assert reference.undocumented_parameters("docs_test_api.documented") == []
    assert reference.undocumented_parameters("docs_test_api") == ["docs_test_api.named_in_prose: count"]


@pytest.mark.parametrize("page", sorted((ROOT / "docs" / "reference" / "api").glob("*.md")), ids=lambda p: p.name)
def test_every_parameter_of_the_documented_api_is_in_its_args_section(page):
    identifiers = reference.api_identifiers(page.read_text())
    assert identifiers
    assert [p for i, m in identifiers for p in reference.undocumented_parameters(i, m)] == []


def test_the_encoder_api_page_documents_the_public_methods_in_google_style():
    import inspect

    from diffusion_embedder import Encoder

    members = dict(reference.api_identifiers((ROOT / "docs/reference/api/encoder.md").read_text()))[
        "diffusion_embedder.encoder.Encoder"]
    wanted = ("from_pretrained", "encode", "encode_query", "encode_document", "save", "similarity")
    assert set(wanted) <= set(members)
    for name in wanted:
        doc = inspect.getdoc(getattr(Encoder, name))
        assert "\nArgs:\n" in doc, name
        assert "\nReturns:\n" in doc or name == "save", name
    listed = reference.documented_parameters(inspect.getdoc(Encoder.encode))
    assert {"output_value", "pool", "chunk_size"} <= listed
    assert set(inspect.signature(Encoder.encode).parameters) - {"self"} == listed


def test_mkdocs_parses_docstrings_as_the_check_does():
    text = (ROOT / "mkdocs.yml").read_text()
    assert f"docstring_style: {reference.DOCSTRING_STYLE}" in text
    for key, value in reference.DOCSTRING_OPTIONS.items():
        assert f"{key}: {json.dumps(value)}" in text


# ------------------------------------------------------------------------------------------------ other pages
def test_every_test_the_guarantees_page_names_exists():
    page = (ROOT / "docs" / "guarantees.md").read_text()
    named = re.findall(r"`tests/(test_\w+\.py)::(test_\w+)`", page)
    assert len(named) > 50
    missing = [f"{f}::{t}" for f, t in named if not re.search(rf"^def {t}\(", (ROOT / "tests" / f).read_text(), re.M)]
    assert not missing


def test_the_results_index_lists_every_results_file_with_its_dates(tmp_path):
    (tmp_path / "a.md").write_text("# Speed\n\nCommand (2 CPU cores, torch 2.13.0, 2026-01-02):\n\nlater 2026-02-03\n")
    (tmp_path / "b.md").write_text("# GPU\n\n**Not run** on 2026-03-04, no device. More.\n")
    index = reference.results_index(tmp_path)
    assert "| [Speed](results/a.md) | 2 CPU cores, torch 2.13.0, 2026-01-02 | 2026-01-02, 2026-02-03 |" in index
    assert "| [GPU](results/b.md) | Not run on 2026-03-04, no device. | 2026-03-04 |" in index
    shipped = reference.results_index(ROOT / "bench" / "results")
    assert all(f"](results/{p.name})" in shipped for p in (ROOT / "bench" / "results").glob("*.md"))
