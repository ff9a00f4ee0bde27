"""Regional compilation: compiled decoder layers give the eager embeddings and gradients, a batch of another
shape reuses the graph, ``encode(compile=True)`` and the ``compile_layers`` field reach the layers, and over 20
steps the fast paths (checkpointing some layers, compiled layers) train as the plain path does."""

from __future__ import annotations

import pytest
import torch
from conftest import LLAMA_FIXTURE
from numerics import ORDER_EPS, assert_close_normwise
from torch._dynamo.utils import counters

from diffusion_embedder import compilation
from diffusion_embedder.random_models import TINY_SHAPE, random_encoder

TEXTS = [f"item {i} " + "a little more text " * i for i in range(1, 9)]


@pytest.fixture(autouse=True)
def aot_eager(monkeypatch):
    """Inductor's code generation takes about a minute per graph on the CI machine; aot_eager traces and runs the
    same graphs (forward and backward) without it."""
    monkeypatch.setattr(compilation, "BACKEND", "aot_eager")
    torch._dynamo.reset()
    counters.clear()


def test_encode_compiled_equals_eager_and_reuses_the_graph_for_other_shapes(monkeypatch):
    """The CPU stands in for CUDA (where encode compiles): no graph break, and no new graph for new lengths."""
    monkeypatch.delitem(compilation.REFUSED_ON, "cpu")
    encoder = random_encoder(*TINY_SHAPE, LLAMA_FIXTURE)
    eager = encoder.encode(TEXTS, show_progress_bar=False)
    assert compilation.compiled_layers(encoder.model) == 0
    compiled = encoder.encode(TEXTS, show_progress_bar=False, compile=True)
    assert compilation.compiled_layers(encoder.model) == TINY_SHAPE[1]["num_hidden_layers"]
    assert_close_normwise(compiled, eager, eps_multiple=ORDER_EPS, rows=True)  # measured: 2.4e-7 abs (float32)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0
    other = ["b " * n for n in (3, 11, 5, 17)]  # 4 texts in batches of 2 (>1 row: dynamo specializes 1)
    again = encoder.encode(other, batch_size=2, show_progress_bar=False, compile=True)
    assert counters["stats"]["unique_graphs"] == graphs  # no recompilation for new lengths and row counts
    assert not counters["graph_break"], dict(counters["graph_break"])
    expected = encoder.encode(other, batch_size=2, show_progress_bar=False)
    assert_close_normwise(again, expected, eps_multiple=ORDER_EPS, rows=True)


def test_varlen_layers_compile_without_a_graph_break_or_a_new_graph_per_length(monkeypatch):
    """Where varlen's kernel runs (here a stand-in that reads nothing on the host, as the GPU kernel), padded and
    packed forwards of compiled layers break no graph and compile once for every length: the padded rows'
    offsets reach the layers already derived (no ``.item()`` in a layer)."""
    from test_varlen_kernel import device_only_kernel

    from diffusion_embedder import varlen

    monkeypatch.setattr(varlen, "kernel", lambda: varlen.Kernel(device_only_kernel, True, True, True))
    monkeypatch.setattr(varlen, "kernel_problem", lambda *args: None)
    encoder = random_encoder(*TINY_SHAPE, LLAMA_FIXTURE, attn="varlen")
    eager = {packing: encoder.encode(TEXTS, batch_size=4, packing=packing, show_progress_bar=False)
             for packing in (False, True)}  # fmt: skip
    compilation.compile_layers(encoder.model)
    for packing in (False, True):  # padded, then packed rows
        compiled = encoder.encode(TEXTS, batch_size=4, packing=packing, show_progress_bar=False)
        assert_close_normwise(compiled, eager[packing], eps_multiple=ORDER_EPS, rows=True, msg=packing)
    graphs = counters["stats"]["unique_graphs"]
    for packing in (False, True):
        encoder.encode(["c " * n for n in (2, 29, 7, 13)], batch_size=2, packing=packing, show_progress_bar=False)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == graphs


def test_encode_compile_is_refused_on_the_cpu_and_on_varlens_reference_path(monkeypatch):
    """Refused up front, in our words, with nothing compiled: on the CPU, where it does not pay, and wherever varlen
    runs its per-text reference path (the CPU standing in for a device where compile is allowed)."""
    encoder = random_encoder(*TINY_SHAPE, LLAMA_FIXTURE)
    with pytest.raises(ValueError, match="compile=True is refused: on the CPU compiled layers ran no faster"):
        encoder.encode(TEXTS, show_progress_bar=False, compile=True)
    assert compilation.compiled_layers(encoder.model) == 0
    monkeypatch.delitem(compilation.REFUSED_ON, "cpu")
    varlen_encoder = random_encoder(*TINY_SHAPE, LLAMA_FIXTURE, attn="varlen")
    with pytest.raises(ValueError, match="attn_implementation='varlen' runs its reference path here \\(the kernel "
                       "runs on CUDA only .*every compiled layer would break its graph"):
        varlen_encoder.encode(TEXTS, show_progress_bar=False, compile=True)
    assert compilation.compiled_layers(varlen_encoder.model) == 0


def test_compile_on_a_device_pool_is_refused(monkeypatch):
    monkeypatch.delitem(compilation.REFUSED_ON, "cpu")
    encoder = random_encoder(*TINY_SHAPE, LLAMA_FIXTURE)
    with pytest.raises(ValueError, match="compile=True runs on one device"):
        encoder.encode(TEXTS, device=["cpu", "cpu"], compile=True)


def test_compile_layers_field_reaches_the_layers(tmp_path):
    from test_training_trainer import make_config

    from diffusion_embedder.training.supervised import prepare_encoder

    cfg = make_config(tmp_path, compile_layers=True)
    encoder = prepare_encoder(cfg.model, cfg.custom, cfg.training)
    assert compilation.compiled_layers(encoder.model) == 2
    plain = make_config(tmp_path)
    assert compilation.compiled_layers(prepare_encoder(plain.model, plain.custom, plain.training).model) == 0
    with pytest.raises(Exception, match="compile_layers: 'yes' .* is not of type bool"):
        make_config(tmp_path, compile_layers="yes")


def losses_over_20_steps(tmp_path, **overrides) -> list[float]:
    from test_training_trainer import make_trainer

    trainer = make_trainer(tmp_path / str(sorted(overrides.items())), lora_dropout=0.0, learning_rate=1e-3,
                           **overrides)  # fmt: skip
    optimizer = trainer.create_optimizer()
    samples = [trainer.train_dataset[i] for i in range(8)]
    losses = []
    for step in range(20):
        inputs = trainer.data_collator(samples[(step % 2) * 4:(step % 2) * 4 + 4])  # two batches of other shapes
        losses.append(float(trainer.training_step(trainer.model, inputs)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses


def test_fast_paths_train_as_the_plain_path_over_20_steps(tmp_path):
    plain = losses_over_20_steps(tmp_path)
    assert plain[-1] < plain[0]  # it trains
    checkpointed = losses_over_20_steps(tmp_path, activation_checkpointing=1)
    assert checkpointed == plain  # the same float32 arithmetic recomputed: bit for bit
    both = losses_over_20_steps(tmp_path, activation_checkpointing=1, compile_layers=True)
    # measured: identical losses (aot_eager runs the eager kernels on the traced graphs); inductor's generated
    # kernels are not exercised here (about a minute per graph on this machine)
    assert both == plain


def test_bench_train_speed_rows_dry_run():
    """bench/train.py --gpu's fast-path rows on the CPU: the checkpointing policy on varlen, and Liger (not run where
    liger-kernel does not import). Two rows, not all of --speed: each is a process of its own, and a compiled row
    takes minutes on a CPU (varlen's reference path reads its offsets on the host, so the compiled layers recompile
    per batch there; the GPU kernel takes them as tensors); the compile field's glue is tested above."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    names = ["packed, varlen, ckpt auto, direct", "packed, varlen, ckpt auto, Liger, direct"]
    command = [sys.executable, str(root / "bench" / "train.py"), "--gpu", "--dry-run"]
    command += [arg for name in names for arg in ("--rows", name)]
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {line.split(" | ")[0][2:]: line for line in done.stdout.splitlines() if line.startswith("| packed")}
    assert list(rows) == names
    assert not any("failed" in line for line in rows.values()), done.stdout[-3000:]
    assert ("not run: liger-kernel" in rows[names[1]]) != _liger_imports()
    assert "'checkpointed': 0" in done.stdout  # the tiny step fits: "auto" checkpoints no layer


def _liger_imports() -> bool:
    from transformers.utils import is_liger_kernel_available

    return is_liger_kernel_available()


def test_onednn_linear_stays_off_for_compiled_layers():
    """CPU inference swaps plain linear layers' ``forward`` for oneDNN's; in a compiled layer that would make dynamo
    recompile at every encode call, so a compiled model keeps PyTorch's path."""
    from diffusion_embedder.cpu_linear import onednn_linear

    encoder = random_encoder(*TINY_SHAPE, LLAMA_FIXTURE)
    with torch.inference_mode(), onednn_linear(encoder.model, torch.device("cpu")) as switched:
        assert switched > 0  # this machine has the op
    compilation.compile_layers(encoder.model)
    with torch.inference_mode(), onednn_linear(encoder.model, torch.device("cpu")) as switched:
        assert switched == 0


def test_uncompile_layers_runs_the_layers_eagerly_again():
    """What the GPU benchmark relies on to measure the compiled row and then the eager ones on one model."""
    encoder = random_encoder(*TINY_SHAPE, LLAMA_FIXTURE)
    layers = compilation.decoder_layers(encoder.model)
    compilation.compile_layers(encoder.model, backend="aot_eager")
    assert compilation.compiled_layers(encoder.model) == len(layers) > 0
    assert all(layer._compiled_call_impl is not None for layer in layers)
    compilation.uncompile_layers(encoder.model)
    assert compilation.compiled_layers(encoder.model) == 0
    assert all(layer._compiled_call_impl is None for layer in layers)
