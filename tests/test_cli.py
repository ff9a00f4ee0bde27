"""The ``diffusion-embedder`` dispatcher reaches every driver."""

from __future__ import annotations

import importlib

import pytest
from conftest import LLAMA_FIXTURE, ROOT

from diffusion_embedder import cli


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_every_command_has_a_main(command):
    module = importlib.import_module(cli.COMMANDS[command][0])
    assert callable(module.main)


def test_help_and_unknown_command(capsys):
    assert cli.main(["--help"]) == 0
    assert "train" in capsys.readouterr().out
    assert cli.main(["trian"]) == 2
    assert "unknown command 'trian'" in capsys.readouterr().err


def test_dispatch_passes_arguments(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["report", "--help"])
    assert exit_.value.code == 0
    assert "usage" in capsys.readouterr().out.lower()


def test_demo_command_names_the_checkout_script_and_runs_nothing(tmp_path, monkeypatch, capsys):
    """The package never runs experiments/: from a checkout, ``diffusion-embedder demo`` names the command."""
    from diffusion_embedder import cli

    monkeypatch.chdir(tmp_path)
    assert cli.main(["demo", "--output_dir", "out"]) == 1
    err = capsys.readouterr().err
    assert "make demo" in err and "experiments/demo.py --output_dir out" in err, err
    assert not (tmp_path / "out").exists()
    cli.main(["demo", "--output_dir", "my runs"])  # the printed command keeps an argument with a space whole
    assert "experiments/demo.py --output_dir 'my runs'" in capsys.readouterr().err


# ------------------------------------------------------------------ every refusal in our words, before any work
def _exit(argv: list[str], capsys) -> tuple[int, str]:
    """``diffusion-embedder ARGV``'s exit status and what it printed on stderr (argparse's refusals exit too)."""
    try:
        code = cli.main(argv)
    except SystemExit as stop:
        code = stop.code
    return code, capsys.readouterr().err


def _must_not_load(*args, **kwargs):
    raise AssertionError("a model was loaded for a command line that cannot run")


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "taken.txt"
    path.write_text("not a folder")
    return path


@pytest.mark.parametrize(("flags", "message"), [
    (["--fused_head", "true"], "unknown key 'fused_head': a field of the mntp (diffusion-embedder mntp) stage only, "
                               "not of the supervised or simcse stage"),
    (["--activation_checkpointing", "yes"], "activation_checkpointing: 'yes' (str) is not of type bool or int or "
                                            "'auto' or null"),
    (["--compile_layers", "1"], "compile_layers: 1 (int) is not of type bool"),
    (["--output_dir", "{a_file}"], "output_dir {a_file} is a file, not a folder"),
])
def test_train_refuses_a_bad_override_naming_field_and_value_before_anything(flags, message, tmp_path, a_file,
                                                                             monkeypatch, caplog):
    """Before, ``--fused_head true`` on the supervised stage answered "did you mean 'use_cache'?", and an output_dir
    that is a file ended in a traceback as the run claimed it."""
    from diffusion_embedder.training import supervised

    monkeypatch.setattr(supervised, "prepare_encoder", _must_not_load)
    flags = [flag.format(a_file=a_file) for flag in flags]
    argv = ["train", str(ROOT / "train_configs" / "tiny" / "custom.json"), "--output_dir", str(tmp_path / "out"),
            *flags]
    assert cli.main(argv) == 2
    assert message.format(a_file=a_file) in caplog.text and "Traceback" not in caplog.text
    assert not (tmp_path / "out").exists() and a_file.read_text() == "not a folder"


def _encode_argv(tmp_path) -> list[str]:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"_id": "1", "text": "a"}\n')
    return ["encode", "--base_model_name_or_path", str(LLAMA_FIXTURE), "--corpus", str(corpus),
            "--output_dir", str(tmp_path / "out"), "--no_progress_bar"]


ENCODE_REFUSALS = [
    (["--max_tokens_per_batch", "0"], "max_tokens_per_batch: must be >= 1, got 0"),
    (["--batch_size", "0"], "batch_size: must be >= 1, got 0"),
    (["--batch_size=true"], "batch_size: True (bool) is not of type int"),
    (["--chunk_size", "0"], "chunk_size: must be >= 1, got 0"),
    (["--num_shards", "0"], "num_shards: must be >= 1, got 0"),
    (["--shard_index", "-1"], "shard_index: must be >= 0, got -1"),
    (["--num_shards", "2", "--shard_index", "2"], "--shard_index 2 is not in 0 .. --num_shards - 1 = 1"),
    (["--skip_instruction", "1"], "skip_instruction: 1 (int) is not of type bool"),
    (["--pooling_mode", "meen"], "pooling_mode: 'meen' is not one of"),
    (["--torch_dtype", "fp16"], "torch_dtype: 'fp16' is not one of ['auto', 'bfloat16', 'float16', 'float32']"),
    (["--device", "nonsense"], "--device='nonsense' is not a device name"),
    (["--output_dir", "{a_file}/sub"], "--output_dir {a_file}/sub lies under {a_file}, which is a file"),
    (["--corpus", "{a_file}.missing"], "--corpus not found: {a_file}.missing"),
    (["--task_name", "SciFact"], "Give one of --corpus (a JSONL file) or --task_name (an mteb task)."),
]


@pytest.mark.parametrize(("flags", "message"), ENCODE_REFUSALS, ids=[" ".join(f) for f, _ in ENCODE_REFUSALS])
def test_encode_refuses_every_bad_flag_with_status_2_before_loading_or_writing(flags, message, tmp_path, a_file,
                                                                              monkeypatch, capsys):
    """Before, ``--max_tokens_per_batch 0`` loaded the model and wrote manifest.json before a traceback."""
    from diffusion_embedder.evaluation import encode_corpus

    monkeypatch.setattr(encode_corpus, "load_checkpoint", _must_not_load)
    code, err = _exit([*_encode_argv(tmp_path), *[flag.format(a_file=a_file) for flag in flags]], capsys)
    assert code == 2
    assert message.format(a_file=a_file) in err and "Traceback" not in err
    assert not (tmp_path / "out").exists() and a_file.read_text() == "not a folder"


EVAL_REFUSALS = [
    (["--top_k", "0"], "top_k: must be >= 1, got 0"),
    (["--max_length_cap", "0"], "max_length_cap: must be >= 1, got 0"),
    (["--batch_size", "-2"], "batch_size: must be >= 1, got -2"),
    (["--enable_bidirectional", "yes"], "enable_bidirectional: 'yes' (str) is not of type bool"),
    (["--output_dir", "{a_file}"], "--output_dir {a_file} is a file, not a folder"),
    (["--embedding_cache_dir", "{a_file}"], "--embedding_cache_dir {a_file} is a file, not a folder"),
    (["--local_task", "{a_file}.missing"], "--local_task: no such folder: {a_file}.missing"),
    (["--task_name", "News21InstructionRetreival"], "Unknown mteb task 'News21InstructionRetreival'"),
    (["--task_to_instructions_fp", "{a_file}.missing"], "not found"),
    (["--base_model_name_or_path", ""], "--base_model_name_or_path is required."),
]


@pytest.mark.parametrize(("flags", "message"), EVAL_REFUSALS, ids=[" ".join(f) for f, _ in EVAL_REFUSALS])
def test_eval_refuses_every_bad_flag_with_status_2_before_loading_or_writing(flags, message, tmp_path, a_file,
                                                                            monkeypatch, capsys):
    """Before, a missing local task folder failed as a task after the model had loaded, and "nothing to evaluate"
    or an unknown task was a traceback."""
    from diffusion_embedder.evaluation import sharding

    monkeypatch.setattr(sharding, "load_checkpoint", _must_not_load)
    local = ROOT / "tests" / "fixtures" / "beir" / "reasonaug"
    argv = ["eval", "--base_model_name_or_path", str(LLAMA_FIXTURE), "--local_task", str(local),
            "--output_dir", str(tmp_path / "out"), *[flag.format(a_file=a_file) for flag in flags]]
    code, err = _exit(argv, capsys)
    assert code == 2
    assert message.format(a_file=a_file) in err and "Traceback" not in err
    assert not (tmp_path / "out").exists() and a_file.read_text() == "not a folder"


def test_report_and_export_refuse_an_output_folder_that_is_a_file_before_reading(tmp_path, a_file, monkeypatch,
                                                                                 capsys):
    from diffusion_embedder import encoder
    from diffusion_embedder.evaluation import report

    monkeypatch.setattr(report, "load_results", _must_not_load)
    monkeypatch.setattr(encoder.Encoder, "from_pretrained", _must_not_load)
    code, err = _exit(["report", str(tmp_path / "results"), "--out_dir", str(a_file)], capsys)
    assert code == 2 and err == f"error: --out_dir {a_file} is a file, not a folder; choose another path, or move " \
                                "the file away.\n"
    code, err = _exit(["export", str(LLAMA_FIXTURE), str(a_file / "st")], capsys)
    assert code == 2 and f"OUTPUT {a_file / 'st'} lies under {a_file}, which is a file" in err
    assert a_file.read_text() == "not a folder"


def test_export_of_a_missing_checkpoint_is_refused_in_our_words(tmp_path, capsys):
    code, err = _exit(["export", str(tmp_path / "no_such_checkpoint"), str(tmp_path / "st")], capsys)
    assert code == 2 and err.startswith("error: ") and "no_such_checkpoint" in err and "Traceback" not in err
    assert not (tmp_path / "st").exists()


@pytest.mark.parametrize(("script", "argv", "message"), [
    ("demo", ["--nproc", "0"], "argument --nproc: nproc: must be >= 1, got 0"),
    ("demo", ["--max_steps", "-5"], "argument --max_steps: max_steps: must be >= 1, got -5"),
    ("demo", ["--output_dir", "{a_file}"], "--output_dir {a_file} is a file, not a folder"),
    ("study", ["--embed_steps", "0"], "argument --embed_steps: embed_steps: must be >= 1, got 0"),
    ("study", ["--output_dir", "{a_file}/runs"], "--output_dir {a_file}/runs lies under {a_file}, which is a file"),
    ("build_reasonaug", ["--rounds", "-2"], "argument --rounds: rounds: must be >= 1, got -2"),
    ("build_reasonaug", ["--heldout-fraction", "1.5"], "argument --heldout-fraction: heldout_fraction: must be < 1"),
])
def test_the_experiments_refuse_numbers_out_of_range_and_an_output_that_is_a_file(script, argv, message, a_file,
                                                                                   capsys):
    """Their flags had no range: ``--nproc 0`` reached torchrun, ``--rounds -2`` the stages."""
    module = importlib.import_module(script)
    with pytest.raises(SystemExit) as stop:
        module.main([arg.format(a_file=a_file) for arg in argv])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and message.format(a_file=a_file) in err and "Traceback" not in err
    assert a_file.read_text() == "not a folder"
