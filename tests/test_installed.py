"""The package as a user installs it (a wheel in a fresh virtual environment, not a checkout): the ``demo`` command,
whose code lives in the checkout's experiments/, says where the demo lives instead of failing on a missing file."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", "--no-cache-dir"]


def run(command: list, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in command], capture_output=True, text=True, timeout=180, **kwargs)


def test_installed_demo_command_says_where_the_demo_lives(tmp_path):
    # The wheel is built from a copy, so the build leaves nothing in the checkout; nothing is downloaded.
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "diffusion_embedder", source / "diffusion_embedder",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    built = run([*PIP, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", tmp_path / "dist", source])
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "dist").glob("diffusion_embedder-*.whl")

    venv = tmp_path / "venv"
    assert run([sys.executable, "-m", "venv", "--without-pip", venv]).returncode == 0
    python = venv / "bin" / "python"
    # Installed before the dependencies are visible, so pip never sees (nor touches) this environment's copy.
    installed = run([*PIP, "--python", python, "install", "--no-deps", "--no-index", wheel])
    assert installed.returncode == 0, installed.stderr
    # The dependencies come from this environment: a path in a .pth joins sys.path, the .pth files in it (such as an
    # editable install's finder, which would import the checkout) are not processed.
    (purelib,) = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.split()
    (Path(purelib) / "dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    where = run([python, "-c", "import diffusion_embedder; print(diffusion_embedder.__file__)"], cwd=cwd, env=env)
    assert Path(where.stdout.strip()).is_relative_to(venv), where  # the installed copy, not the checkout

    demo = run([venv / "bin" / "diffusion-embedder", "demo", "--output_dir", "runs/demo"], cwd=cwd, env=env)
    assert demo.returncode == 1, (demo.stdout, demo.stderr)
    assert "runs from a source checkout" in demo.stderr and "make demo" in demo.stderr, demo.stderr
    assert "Traceback" not in demo.stderr and not (cwd / "runs").exists()
