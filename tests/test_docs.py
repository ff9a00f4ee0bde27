"""The site's generated reference pages hold every config field of every stage and every flag of every command,
read from the live objects (so an added field or flag appears with no other edit), and the strict build's check
names an undocumented parameter."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import types
from importlib import import_module
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs" / "hooks"))
reference = import_module("reference")


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


def test_every_field_of_every_stage_is_in_the_config_reference():
    from diffusion_embedder.training.schema import argument_fields
    from diffusion_embedder.training.stages import STAGES

    page = reference.config_reference()
    schemas = reference.stage_schemas()
    assert set(schemas) == set(STAGES)
    names = {name for schema in schemas.values() for cls in schema.classes for name in argument_fields(cls)}
    assert {"lora_r", "pooling_mode", "objective", "learning_rate", "break_run_claim"} <= names
    missing = [name for name in names if f"| `{name}` |" not in page]
    assert not missing


def test_every_key_of_a_shipped_training_config_is_in_the_config_reference():
    page = reference.config_reference()
    keys = {key for path in (ROOT / "train_configs").rglob("*.json") for key in json.loads(path.read_text())}
    assert len(keys) > 30
    missing = [key for key in keys if f"| `{key}` |" not in page and f"`{key}` (" not in page]
    assert not missing


def test_config_rows_give_type_default_range_choices_stages_and_other_spellings():
    by_class = {cls.__name__: {r["name"]: r for r in rs} for cls, rs in reference.config_rows().items()}
    rows = {name: r for rs in by_class.values() for name, r in rs.items()}
    assert rows["lora_dropout"]["default"] == "`0.05`" and rows["lora_dropout"]["allowed"] == ">= 0, < 1"
    assert rows["pooling_mode"]["allowed"].startswith('one of `"mean"`')
    assert rows["max_length"]["allowed"] == ">= 1" and "`max_seq_length`" in rows["max_length"]["also"]
    assert rows["lora_r"]["stages"] == "supervised, mntp, simcse"
    assert rows["objective"]["stages"] == "mntp"
    assert by_class["DataArguments"]["dataset_name"]["default"] == "required"
    assert by_class["LMStageArguments"]["dataset_name"]["default"] == "`null`"
    assert rows["remove_unused_columns"]["default"] == "`false`"  # ours, not transformers' default
    spellings = {name: r["also"] for name, r in rows.items() if "transformers" in r["also"]}
    assert "gradient_checkpointing" in " ".join(spellings.values()) or "activation_checkpointing" in " ".join(
        spellings.values())


def test_a_field_added_to_a_stage_appears_with_no_other_edit(monkeypatch):
    from transformers import TrainingArguments

    from diffusion_embedder.training.schema import StageSchema
    from diffusion_embedder.training.stages import STAGES, Stage

    @dataclasses.dataclass
    class NewArguments:
        """A stage added in a test."""

        brand_new_field: int = dataclasses.field(default=7, metadata={"help": "Added by the test."})

    module = types.ModuleType("docs_test_stage")
    module.SCHEMA = StageSchema((NewArguments, TrainingArguments), ranges={"brand_new_field": ((2, True), None)})
    monkeypatch.setitem(sys.modules, "docs_test_stage", module)
    monkeypatch.setitem(STAGES, "docs_test", Stage("docs_test_stage", "a test stage", command="docs-test"))
    page = reference.config_reference()
    assert "| `brand_new_field` | int | `7` | >= 2 | docs_test |  | Added by the test. |" in page


def test_every_flag_of_every_command_is_in_the_cli_reference():
    from diffusion_embedder.cli import COMMANDS

    page = reference.cli_reference()
    for command in COMMANDS:
        assert f"## `diffusion-embedder {command}`" in page
    parsers = _all_parsers()
    flags = {o for p in parsers for a in p._actions for o in a.option_strings if o not in ("-h", "--help")}
    assert {"--max_tokens_per_batch", "--benchmark", "--num_shards", "--stock_only", "--check"} <= flags
    missing = [flag for flag in flags if f"`{flag}`" not in page]
    assert not missing
    assert "python experiments/mteb_eval_custom.py" in page  # the evaluation script is the eval parser


def test_a_flag_added_to_a_parser_appears_with_no_other_edit(monkeypatch):
    from diffusion_embedder.evaluation import run

    build = run.build_parser

    def with_new_flag():
        parser = build()
        parser.add_argument("--brand_new_flag", default=3, help="added by the test")
        return parser

    monkeypatch.setattr(run, "build_parser", with_new_flag)
    assert "| `--brand_new_flag` | `value` | `3` |  | added by the test |" in reference.cli_reference()


def test_the_strict_check_names_an_undocumented_parameter(monkeypatch):
    module = types.ModuleType("docs_test_api")

    def documented(text: str, count: int = 1) -> str:
        """Repeat ``text`` ``count`` times."""
        return text * count

    def undocumented(text: str, count: int = 1) -> str:
        """Repeat ``text``."""
        return text * count

    for fn in (documented, undocumented):
        fn.__module__ = "docs_test_api"
        fn.__qualname__ = fn.__name__
        setattr(module, fn.__name__, fn)
    monkeypatch.setitem(sys.modules, "docs_test_api", module)
    assert reference.undocumented_parameters("docs_test_api.documented") == []
    assert reference.undocumented_parameters("docs_test_api") == ["docs_test_api.undocumented: count"]


@pytest.mark.parametrize("page", sorted((ROOT / "docs" / "reference" / "api").glob("*.md")), ids=lambda p: p.name)
def test_every_parameter_of_the_documented_api_is_in_its_docstring(page):
    identifiers = reference.api_identifiers(page.read_text())
    assert identifiers
    assert [p for i, m in identifiers for p in reference.undocumented_parameters(i, m)] == []


def test_every_parameter_of_encode_is_documented_on_the_api_page():
    import inspect

    from diffusion_embedder import Encoder

    identifiers = dict(reference.api_identifiers((ROOT / "docs/reference/api/encoder.md").read_text()))
    assert "encode" in identifiers["diffusion_embedder.encoder.Encoder"]
    doc = inspect.getdoc(Encoder.encode)
    for name in list(inspect.signature(Encoder.encode).parameters)[1:]:
        assert f"``{name}" in doc, name


def test_every_test_the_guarantees_page_names_exists():
    import re

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
