"""The ``diffusion-embedder`` dispatcher reaches every driver."""

from __future__ import annotations

import importlib

import pytest

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
