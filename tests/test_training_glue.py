"""Every training setting reaches the code it controls; GradCache with several chunks, dropout and
accumulation equals the direct path through the real training loop; the completion marker is last;
an in-process resume inside epoch 2 is exact with group_by="device", GradCache and accumulation.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT, TINY_RUN_ID, TINY_TRAIN_CONFIG, randomize_lora_b
from numerics import GRAD_EPS, assert_all_close_normwise
from safetensors.torch import load_file
from transformers import TrainingArguments

from diffusion_embedder.losses import RepllamaLoss
from diffusion_embedder.training import trainer as trainer_module
from diffusion_embedder.training.arguments import load_config
from diffusion_embedder.training.checkpoints import COMPLETE_MARKER, TRAINABLE_WEIGHTS, required_files
from diffusion_embedder.training.grad_cache import split_features
from diffusion_embedder.training.supervised import build_trainer, start_run, train
from diffusion_embedder.training.trainer import EncoderTrainer, assemble, text_columns

BASE = ["--report_to", "none", "--max_train_samples", "16", "--activation_checkpointing", "false"]


@pytest.fixture(autouse=True)
def _at_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # the tiny config names repository-relative paths


def built(tmp_path: Path, *overrides: str) -> EncoderTrainer:
    cfg = load_config(TINY_TRAIN_CONFIG, ["--output_dir", str(tmp_path), *BASE, *overrides])
    start_run(cfg)
    return build_trainer(cfg)


def embeddings(seed: int = 0, batch: int = 3, dim: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q, p = torch.randn(batch, dim, generator=g), torch.randn(batch, dim, generator=g)
    return q, p, torch.randn(batch, 1, dim, generator=g)


def infonce(q, p, n, scale):
    """By hand: each query against every positive and hard negative of the batch, cosine times scale."""
    candidates = F.normalize(torch.cat([p, n.reshape(-1, n.shape[-1])]), dim=-1)
    logits = scale * F.normalize(q, dim=-1) @ candidates.T
    return F.cross_entropy(logits, torch.arange(q.shape[0]))


def sampler_blocks_homogeneous(trainer: EncoderTrainer, block: int) -> bool:
    order = list(trainer._get_train_sampler())
    groups = trainer.train_dataset.groups
    return len(order) % block == 0 and all(
        len({groups[i] for i in order[start : start + block]}) == 1 for start in range(0, len(order), block)
    )


def lora_ranks(trainer: EncoderTrainer) -> set[int]:
    return {p.shape[0] for n, p in trainer.model.named_parameters() if "lora_A" in n}


# (overrides, check on the built trainer): each check fails with the default config.
FIELDS: dict[str, tuple[list[str], Callable[[EncoderTrainer], bool]]] = {
    "loss_scale": (
        ["--loss_scale", "7.0"],
        lambda t: torch.allclose(t.loss_fn(*embeddings()), infonce(*embeddings(), scale=7.0)),
    ),
    "loss_class+scale_by_dim": (
        ["--loss_class", "RepllamaLoss", "--scale_by_dim", "false"],
        lambda t: torch.allclose(t.loss_fn(*embeddings()), RepllamaLoss(scale_by_dim=False)(*embeddings())),
    ),
    "in_batch_negatives": (
        ["--loss_class", "RepllamaLoss", "--in_batch_negatives", "true"],
        lambda t: torch.allclose(
            t.loss_fn(*embeddings()), RepllamaLoss(scale_by_dim=False, in_batch_negatives=True)(*embeddings())
        ),
    ),
    "gradient_accumulation_steps": (
        ["--gradient_accumulation_steps", "2"],
        lambda t: sampler_blocks_homogeneous(t, 8),
    ),
    "per_device_train_batch_size": (
        ["--per_device_train_batch_size", "2"],
        lambda t: next(iter(t.get_train_dataloader()))["query"]["input_ids"].shape[0] == 2,
    ),
    "seed": (
        ["--seed", "7"],
        lambda t: list(t._get_train_sampler()) != list(built_default()._get_train_sampler()),
    ),
    "data_seed": (  # transformers' meaning: the data order's seed; the seed alone set it before
        ["--data_seed", "7"],
        lambda t: list(t._get_train_sampler()) != list(built_default()._get_train_sampler()),
    ),
    "grad_cache_chunk_size": (["--grad_cache_chunk_size", "3"], lambda t: forwards_per_step(t) == 2 * 3 * 2),
    "max_train_samples": (["--max_train_samples", "8"], lambda t: len(t.train_dataset) == 8),
    "lora_r": (["--lora_r", "2"], lambda t: lora_ranks(t) == {2}),
    "lora_alpha": (["--lora_alpha", "3"], lambda t: t.model.model.peft_config["default"].lora_alpha == 3),
    "lora_dropout": (
        ["--lora_dropout", "0.5"],
        lambda t: {m.p for n, m in t.model.named_modules() if isinstance(m, torch.nn.Dropout) and "lora" in n} == {0.5},
    ),
    "lora_target_modules": (
        ["--lora_target_modules", '["v_proj"]'],
        lambda t: {n.split(".")[-4] for n, _ in t.model.named_parameters() if "lora_A" in n} == {"v_proj"},
    ),
    "max_seq_length": (
        ["--max_seq_length", "40"],  # the longest instruction alone takes 33 tokens
        lambda t: t.model.config.max_length == 40
        and next(iter(t.get_train_dataloader()))["query"]["input_ids"].shape[1] <= 40,
    ),
    "run_config": (["--save_steps", "3"], lambda t: t.run_config["save_steps"] == 3),
}

_default: dict[str, EncoderTrainer] = {}


def built_default() -> EncoderTrainer:
    return _default["trainer"]


def forwards_per_step(trainer: EncoderTrainer) -> int:
    """Encoder forwards in one training step (GradCache: two per chunk of each text column)."""
    calls = []
    handle = trainer.model.register_forward_hook(lambda *args: calls.append(1))
    try:
        trainer.training_step(trainer.model, next(iter(trainer.get_train_dataloader())))
    finally:
        handle.remove()
        trainer.model.zero_grad()
    return len(calls)


@pytest.mark.parametrize("field", list(FIELDS))
def test_setting_reaches_the_code_it_controls(tmp_path_factory, field):
    if "trainer" not in _default:
        _default["trainer"] = built(tmp_path_factory.mktemp("default"))
    overrides, check = FIELDS[field]
    assert not check(built_default()), f"{field}: the check already holds with the default config"
    assert check(built(tmp_path_factory.mktemp(field), *overrides)), f"{field} did not reach its code"


def test_group_by_reaches_the_sampler(tmp_path):
    """2 accumulated micro-batches of 4: 'global' keeps each optimizer step's 8 samples in one group,
    'device' only each micro-batch's 4."""
    accumulated = ["--gradient_accumulation_steps", "2"]
    assert sampler_blocks_homogeneous(built(tmp_path / "global", *accumulated, "--group_by", "global"), 8)
    device = built(tmp_path / "device", *accumulated, "--group_by", "device")
    assert sampler_blocks_homogeneous(device, 4) and not sampler_blocks_homogeneous(device, 8)
    mixed = built(tmp_path / "none", *accumulated, "--group_by", "none")
    assert not sampler_blocks_homogeneous(mixed, 4)


def test_world_size_reaches_the_sampler(tmp_path, monkeypatch):
    trainer = built(tmp_path)
    assert not sampler_blocks_homogeneous(trainer, 8)
    monkeypatch.setattr(TrainingArguments, "world_size", property(lambda self: 2))
    assert sampler_blocks_homogeneous(trainer, 8)  # 4 per device x 2 ranks per optimizer step


# ---------------------------------------------------------------- GradCache through the training loop


def trained(tmp_path: Path, *overrides: str) -> dict[str, torch.Tensor]:
    """Weights after 3 SGD steps of 2 accumulated micro-batches (SGD: a wrong gradient scale shows)."""
    cfg = load_config(
        TINY_TRAIN_CONFIG,
        ["--output_dir", str(tmp_path), *BASE, "--max_steps", "3", "--save_steps", "3", "--warmup_steps", "0"]
        + ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--lora_dropout", "0"]
        + ["--optim", "sgd", "--learning_rate", "0.01", "--max_grad_norm", "0", *overrides],
    )
    return load_file(Path(train(cfg)) / TRAINABLE_WEIGHTS)


def test_grad_cache_several_chunks_with_accumulation_trains_like_the_direct_path(tmp_path):
    direct = trained(tmp_path / "direct")
    assert any("lora_B" in name and value.abs().max() > 0 for name, value in direct.items())  # it trained
    for chunk in ("1", "3"):  # 4 and 2 chunks per text column, the last one short
        cached = trained(tmp_path / chunk, "--grad_cache_chunk_size", chunk)
        assert_all_close_normwise(cached, direct, eps_multiple=GRAD_EPS, msg=f"chunk {chunk}")


def chunked_direct_grads(trainer: EncoderTrainer, batches, seeds, chunk: int) -> dict[str, torch.Tensor]:
    """The reference: every chunk forwarded once with its graph (so the same dropout masks), one backward."""
    model = trainer.model
    model.zero_grad()
    model.train()
    for inputs, seed in zip(batches, seeds, strict=True):
        torch.manual_seed(seed)
        columns, k = text_columns(inputs)
        reps = [torch.cat([model(part) for part in split_features(column, chunk)]) for column in columns]
        (trainer.loss_fn(*assemble(reps, k)) / len(batches)).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    return grads


def grad_cache_grads(trainer: EncoderTrainer, batches, seeds, chunk: int) -> dict[str, torch.Tensor]:
    model = trainer.model
    model.zero_grad()
    trainer.grad_cache_chunk_size = chunk
    trainer.current_gradient_accumulation_steps = len(batches)
    for inputs, seed in zip(batches, seeds, strict=True):
        torch.manual_seed(seed)
        trainer.training_step(model, inputs)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    return grads


@pytest.mark.parametrize("chunk", [1, 3])
def test_grad_cache_replays_dropout_across_chunks_with_accumulation(tmp_path, chunk):
    trainer = built(tmp_path, "--lora_dropout", "0.3")
    randomize_lora_b(trainer.model, 0.2)  # so dropout on the LoRA path changes every gradient
    samples = [trainer.train_dataset[i] for i in range(8)]
    batches = [trainer.data_collator(samples[:4]), trainer.data_collator(samples[4:])]
    reference = chunked_direct_grads(trainer, batches, (3, 4), chunk)
    other_masks = chunked_direct_grads(trainer, batches, (5, 6), chunk)
    name = next(iter(reference))
    assert (reference[name] - other_masks[name]).abs().max() > 1e-4  # the masks matter here
    cached = grad_cache_grads(trainer, batches, (3, 4), chunk)
    assert_all_close_normwise(cached, reference, eps_multiple=GRAD_EPS, msg="grad")


# ---------------------------------------------------------------- the completion marker is written last


def test_completion_marker_is_written_after_every_other_file(tmp_path, monkeypatch):
    real = trainer_module.write_complete_marker
    seen = []

    def spy(folder, step, world_size, layout=None):
        needed = required_files(world_size, layout)[:-1]
        missing = [name for name in needed if not os.path.isfile(os.path.join(folder, name))]
        seen.append((step, missing))
        real(folder, step, world_size, layout)

    monkeypatch.setattr(trainer_module, "write_complete_marker", spy)
    run = Path(
        train(
            load_config(
                TINY_TRAIN_CONFIG, ["--output_dir", str(tmp_path), *BASE, "--max_steps", "2"] + ["--save_steps", "1"]
            )
        )
    )
    assert seen == [(1, []), (2, [])]
    for folder in (run / "checkpoint-1", run / "checkpoint-2"):
        marker = (folder / COMPLETE_MARKER).stat().st_mtime_ns
        assert all(p.stat().st_mtime_ns <= marker for p in folder.rglob("*") if p.is_file())


# ---------------------------------------------------------------- in-process resume inside epoch 2


def test_resume_inside_epoch_two_with_device_groups_grad_cache_and_accumulation(tmp_path):
    """16 samples, 2 per device x 2 micro-batches: 4 steps per epoch; stopped at step 5, resumed to 7."""
    options = ["--max_steps", "7", "--save_steps", "2", "--per_device_train_batch_size", "2"]
    options += ["--gradient_accumulation_steps", "2", "--group_by", "device", "--grad_cache_chunk_size", "1"]
    options += ["--lora_dropout", "0.1"]

    def run(folder: Path, *extra: str) -> Path:
        return Path(train(load_config(TINY_TRAIN_CONFIG, ["--output_dir", str(folder), *BASE, *options, *extra])))

    full = run(tmp_path / "full")
    run(tmp_path / "killed", "--stop_after_n_steps", "5")
    assert sorted(p.name for p in (tmp_path / "killed" / TINY_RUN_ID).glob("checkpoint-*")) == [
        "checkpoint-2",
        "checkpoint-4",
        "checkpoint-5",
    ]
    resumed = run(tmp_path / "killed", "--resume_from_checkpoint", "last")
    a, b = load_file(resumed / TRAINABLE_WEIGHTS), load_file(full / TRAINABLE_WEIGHTS)
    assert a.keys() == b.keys()
    for name, value in b.items():
        torch.testing.assert_close(a[name], value, atol=1e-6, rtol=0, msg=name)


def test_each_process_draws_its_own_random_numbers(tmp_path):
    """transformers seeds every process with ``seed``: MNTP/MDM masks, diffusion times and dropout were the same
    draws on every rank. From the start of training rank r draws from ``seed + r``; rank 0 (and a one-process run)
    keeps ``seed``'s own stream."""
    from types import SimpleNamespace

    from diffusion_embedder.training.trainer import RankStreams

    def draws_after_start(process_index: int) -> torch.Tensor:
        torch.manual_seed(3)  # what transformers does on every rank
        RankStreams().on_train_begin(SimpleNamespace(seed=3, process_index=process_index), None, None)
        return torch.rand(4)

    torch.manual_seed(3)
    seed_stream = torch.rand(4)
    assert torch.equal(draws_after_start(0), seed_stream)
    assert not torch.equal(draws_after_start(1), draws_after_start(0))
    assert not torch.equal(draws_after_start(2), draws_after_start(1))
    assert any(isinstance(c, RankStreams) for c in built(tmp_path).callback_handler.callbacks)
