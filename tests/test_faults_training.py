"""Fault injection for training: every fault ends in an exact resume or a clear error, never a silent wrong run.

Kill and resume inside epoch 2 (torchrun, 2 processes), each checkpoint file deleted or truncated in
turn, a different run started in a used folder, NaN at a high learning rate then a resume with a
lower one, and numeric settings out of range. Tiny configs; in-process runs share one module-scoped
run folder.
"""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import LLAMA_FIXTURE, ROOT, TINY_RUN_ID, TINY_TRAIN_CONFIG, torchrun
from safetensors.torch import load_file
from transformers import TrainerCallback

from diffusion_embedder import cli
from diffusion_embedder.backbones import BackboneConfigError
from diffusion_embedder.data import DataFormatError
from diffusion_embedder.data.hub import DatasetUnavailableError
from diffusion_embedder.training import checkpoints, lm
from diffusion_embedder.training.arguments import SUPERVISED, ConfigError, load_config, validate
from diffusion_embedder.training.checkpoints import (
    COMPLETE_MARKER,
    TRAIN_CONFIG,
    TRAINABLE_WEIGHTS,
    CheckpointError,
    CheckpointWriteError,
    find_last_checkpoint,
    required_files,
    validate_checkpoint,
)
from diffusion_embedder.training.runner import fit, run_cli
from diffusion_embedder.training.supervised import build_trainer, start_run, train
from diffusion_embedder.training.trainer import NonFiniteLossError

#: 16 samples in batches of 4: 4 optimizer steps per epoch, so step 6 lies inside epoch 2.
IN_PROCESS = ["--report_to", "none", "--max_train_samples", "16", "--max_steps", "6", "--save_steps", "2"]


def tiny_config(output_dir: Path, *overrides: str):
    return load_config(TINY_TRAIN_CONFIG, ["--output_dir", str(output_dir), *IN_PROCESS, *overrides])


def trainable(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / TRAINABLE_WEIGHTS)


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and a
    for name, value in b.items():
        torch.testing.assert_close(a[name], value, atol=1e-6, rtol=0, msg=name)


@pytest.fixture(scope="module")
def used_run(tmp_path_factory) -> Path:
    """One finished in-process run: checkpoints 2, 4 and 6 of the tiny config."""
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.chdir(ROOT)  # the tiny config names repository-relative paths
    out = tmp_path_factory.mktemp("used")
    run = Path(train(tiny_config(out)))
    monkeypatch.undo()
    return run


@pytest.fixture
def used_copy(used_run, tmp_path, monkeypatch) -> Path:
    """A copy of the used run's parent folder (the output_dir a config names)."""
    monkeypatch.chdir(ROOT)
    shutil.copytree(used_run, tmp_path / TINY_RUN_ID)
    return tmp_path


# ---------------------------------------------------------------- kill and resume inside epoch 2


def test_kill_and_resume_inside_epoch_two_is_exact(tiny_full_run, tmp_path):
    """2 ranks, 12 steps per epoch: killed after step 14, resumed past a half-written checkpoint-16.

    Before the fix the resumed epoch replayed epoch 1's order (the sampler never learnt the epoch
    behind accelerate's skip wrapper), so the weights differed from the uninterrupted run's.
    """
    stopped = torchrun(tmp_path, "--stop_after_n_steps", "14")
    assert "Stopping at optimizer step 14: stop_after_n_steps=14" in stopped.stdout + stopped.stderr
    run = tmp_path / TINY_RUN_ID
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-10", "checkpoint-14"]
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= {p.name for p in (run / "checkpoint-14").iterdir()}
    half = run / "checkpoint-16"  # a kill while checkpoint-16 was being written
    half.mkdir()
    (half / TRAINABLE_WEIGHTS).write_bytes(b"truncated")
    resumed = torchrun(tmp_path, "--resume_from_checkpoint", "last")
    assert "Skipping" in resumed.stdout + resumed.stderr
    assert_same_weights(trainable(run), trainable(tiny_full_run))


# ---------------------------------------------------------------- every checkpoint file is needed

RESUME_FILES = [name for name in required_files(world_size=1) if name != COMPLETE_MARKER]


@pytest.mark.parametrize("damage", ["delete", "truncate"])
@pytest.mark.parametrize("name", RESUME_FILES)
def test_damaged_checkpoint_file_is_named_with_the_previous_checkpoint(used_copy, name, damage):
    newest = used_copy / TINY_RUN_ID / "checkpoint-6"
    path = newest / name
    if damage == "delete":
        path.unlink()
    else:
        path.write_bytes(path.read_bytes()[: max(1, path.stat().st_size // 2)])
    with pytest.raises(ConfigError) as err:
        train(tiny_config(used_copy, "--resume_from_checkpoint", "last"))
    message = str(err.value)
    assert str(path) in message and ("missing" if damage == "delete" else "unreadable") in message
    assert f"previous complete checkpoint is {used_copy / TINY_RUN_ID / 'checkpoint-4'}" in message


def test_every_ranks_rng_state_is_required(used_copy):
    """A checkpoint of 2 ranks needs rng_state_0.pth and rng_state_1.pth (the Trainer would skip a missing one)."""
    folder = used_copy / TINY_RUN_ID / "checkpoint-6"
    (folder / "rng_state.pth").rename(folder / "rng_state_0.pth")
    marker = json.loads((folder / COMPLETE_MARKER).read_text())
    (folder / COMPLETE_MARKER).write_text(json.dumps({**marker, "world_size": 2}))
    with pytest.raises(CheckpointError, match=r"rng_state_1\.pth is missing"):
        validate_checkpoint(folder, world_size=2)
    shutil.copy(folder / "rng_state_0.pth", folder / "rng_state_1.pth")
    validate_checkpoint(folder, world_size=2)
    with pytest.raises(CheckpointError, match="written by 2 process"):
        validate_checkpoint(folder, world_size=1)


# ---------------------------------------------------------------- a run folder belongs to one run


def test_new_run_in_a_used_folder_stops(used_copy):
    with pytest.raises(ConfigError, match="already holds 3 checkpoint.*another config.*--overwrite_output_dir"):
        train(tiny_config(used_copy, "--lora_r", "8"))
    with pytest.raises(ConfigError, match="already holds .* of this config.*--resume_from_checkpoint last"):
        train(tiny_config(used_copy))


def test_last_never_resumes_another_configs_checkpoint(used_copy):
    with pytest.raises(CheckpointError, match="another config.*lora_r: 4 there, 8 now"):
        train(tiny_config(used_copy, "--lora_r", "8", "--resume_from_checkpoint", "last"))
    explicit = used_copy / TINY_RUN_ID / "checkpoint-4"
    with pytest.raises(CheckpointError, match="another config.*loss_scale: 50.0 there, 20.0 now"):
        train(tiny_config(used_copy, "--loss_scale", "20.0", "--resume_from_checkpoint", str(explicit)))


def test_overwrite_output_dir_starts_afresh(used_copy):
    run = Path(train(tiny_config(used_copy, "--lora_r", "8", "--max_steps", "2", "--overwrite_output_dir")))
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-2"]  # 4 and 6 of the old run: gone
    assert json.loads((run / "checkpoint-2" / TRAIN_CONFIG).read_text())["lora_r"] == 8
    assert {t.shape[0] for n, t in trainable(run).items() if "lora_A" in n} == {8}


# ---------------------------------------------------------------- NaN at a high learning rate


def test_nan_at_high_learning_rate_then_resume_lower(tmp_path, monkeypatch):
    """Warmup makes step 1's rate 0; step 2 at 5e19 ruins the weights (still finite); step 3's loss is NaN.

    The good checkpoint is checkpoint-1 (checkpoint-2's weights give a NaN loss), and resuming from
    it at 1e-3 must equal an uninterrupted run at 1e-3, whose step 1 also moved nothing.
    """
    monkeypatch.chdir(ROOT)
    high = ["--save_steps", "1", "--learning_rate", "1e20"]
    with pytest.raises(NonFiniteLossError) as err:
        train(tiny_config(tmp_path / "nan", *high))
    run = tmp_path / "nan" / TINY_RUN_ID
    good = run / "checkpoint-1"
    message = str(err.value)
    assert "Loss is nan at optimizer step 3" in message
    assert f"last finite checkpoint is {good}" in message and "lower learning rate" in message
    assert find_last_checkpoint(run) == str(good)
    assert not (run / "checkpoint-2" / COMPLETE_MARKER).exists()
    assert all(torch.isfinite(t).all() for t in trainable(good).values())

    lower = ["--learning_rate", "1e-3"]
    resumed = Path(train(tiny_config(tmp_path / "nan", *lower, "--resume_from_checkpoint", str(good))))
    reference = Path(train(tiny_config(tmp_path / "ref", *lower)))
    assert_same_weights(trainable(resumed), trainable(reference))
    state = json.loads((resumed / "checkpoint-6" / "trainer_state.json").read_text())
    rates = [e["learning_rate"] for e in state["log_history"] if "learning_rate" in e]
    assert max(rates) <= 1e-3  # the schedule continued at the new rate, not the checkpoint's 1e20


class PoisonAtStep(TrainerCallback):
    """Stands for an optimizer step that left a trainable tensor infinite (the step's loss was finite)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.step:
            with torch.no_grad():
                next(p for p in model.parameters() if p.requires_grad).fill_(float("inf"))


def test_non_finite_weights_are_never_checkpointed(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg = tiny_config(tmp_path, "--save_steps", "1", "--max_steps", "2")
    resume = start_run(cfg)
    trainer = build_trainer(cfg)
    trainer.add_callback(PoisonAtStep(2))
    run = tmp_path / TINY_RUN_ID
    with pytest.raises(NonFiniteLossError, match="not finite after optimizer step 2.*last finite checkpoint is .*-1;"):
        fit(trainer, resume, None)
    assert not (run / "checkpoint-2").exists()
    assert find_last_checkpoint(run) == str(run / "checkpoint-1")


# ---------------------------------------------------------------- numbers out of range


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("learning_rate", 0, "learning_rate: must be > 0, got 0"),
        ("learning_rate", -1e-4, "learning_rate: must be > 0"),
        ("per_device_train_batch_size", 0, "per_device_train_batch_size: must be >= 1, got 0"),
        ("gradient_accumulation_steps", 0, "gradient_accumulation_steps: must be >= 1"),
        ("lora_dropout", 1.0, "lora_dropout: must be < 1"),
        ("lora_alpha", 0, "lora_alpha: must be > 0"),
        ("loss_scale", 0, "loss_scale: must be > 0"),
        ("max_steps", 0, "max_steps: must be >= 1 (or -1"),
        ("num_train_epochs", 0, "num_train_epochs: must be > 0"),
        ("warmup_steps", -1, "warmup_steps: must be >= 0"),
        ("max_train_samples", 0, "max_train_samples: must be >= 1"),
        ("save_steps", 0, "save_steps: must be > 0"),
        ("simcse_dropout", 1.5, "simcse_dropout: must be < 1, got 1.5"),  # transformers raised mid-training
        ("simcse_dropout", -0.1, "simcse_dropout: must be >= 0"),
        ("eval_strategy", "steps", "eval_strategy: 'steps' is not supported (there is no evaluation during training"),
        # accepted, then never read: now refused
        ("label_smoothing_factor", 0.1, "label_smoothing_factor: 0.1 is not supported (transformers smooths its own"),
        ("neftune_noise_alpha", 5, "neftune_noise_alpha: 5 is not supported (NEFTune's noise is hooked"),
    ],
)
def test_out_of_range_setting_is_refused_with_the_config(key, value, expected):
    values = json.loads(TINY_TRAIN_CONFIG.read_text())
    with pytest.raises(ConfigError) as err:
        validate({**values, key: value})
    assert expected in str(err.value)


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("max_seq_length", 1, "max_seq_length: must be >= 2, got 1"),  # failed after the model loaded
        ("mlm_probability", 0, "mlm_probability: must be > 0"),
        ("mlm_probability", 1.5, "mlm_probability: must be <= 1"),
        ("mdm_eps", 1, "mdm_eps: must be < 1"),
        ("lora_dropout", 1.0, "lora_dropout: must be < 1"),
    ],
)
def test_lm_stage_lengths_and_probabilities_are_refused_before_the_model_loads(
    key, value, expected, tmp_path, monkeypatch, caplog
):
    def must_not_load(*args, **kwargs):
        raise AssertionError("the model was loaded for an invalid config")

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(lm, "build_model", must_not_load)
    argv = ["mntp", "train_configs/tiny/mntp.json", "--output_dir", str(tmp_path), "--report_to", "none"]
    assert cli.main([*argv, f"--{key}", json.dumps(value)]) == 2
    assert expected in caplog.text and not any(tmp_path.iterdir())


# ---------------------------------------------------------------- LoRA targets

LORA_STAGES = {
    "train": "train_configs/tiny/custom.json",
    "mntp": "train_configs/tiny/mntp.json",
    "simcse": "train_configs/tiny/simcse.json",
}


@pytest.mark.parametrize("stage", LORA_STAGES)
def test_a_lora_target_that_matches_no_layer_is_refused(stage, tmp_path, monkeypatch, caplog):
    """Before, peft dropped the misspelt name (it only complains when no name matches) and trained on q_proj."""
    monkeypatch.chdir(ROOT)
    out = tmp_path / "out"
    argv = [stage, LORA_STAGES[stage], "--output_dir", str(out), "--report_to", "none"]
    argv += ["--model_name_or_path", str(LLAMA_FIXTURE), "--lora_target_modules", '["q_proj", "nonexistent_proj"]']
    assert cli.main(argv) == 2
    assert "lora_target_modules: 'nonexistent_proj' match(es) no Linear layer of" in caplog.text
    assert "its Linear layers are named down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj" in caplog.text
    assert not out.exists() or not any(out.rglob("*"))  # the claimed run folder is removed again


@pytest.mark.parametrize("fault", ["bad data", "bad LoRA target"])
def test_overwrite_output_dir_loses_nothing_when_the_new_run_cannot_start(used_copy, tmp_path, fault):
    """The old run is deleted only once the new one has read its data and built its model."""
    run = used_copy / TINY_RUN_ID
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    if fault == "bad data":
        data = tmp_path / "bad.jsonl"
        data.write_bytes(b"\xff\xfe not UTF-8\n")
        problem, overrides = DataFormatError, ["--dataset_file_path", str(data)]
    else:
        problem, overrides = ConfigError, ["--lora_target_modules", '["q_prj"]']
    with pytest.raises(problem):
        train(tiny_config(used_copy, "--lora_r", "8", "--overwrite_output_dir", *overrides))
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == before
    assert find_last_checkpoint(run) == str(run / "checkpoint-6")


# ---------------------------------------------------------------- a checkpoint that cannot be written

#: What torch.save raised when the disk filled up during a checkpoint (it names no file and no reason).
TORCH_WRITE_ERROR = (
    "[enforce fail at inline_container.cc:664] . unexpected pos 512 vs 400\nbasic_ios::clear: iostream error"
)


@pytest.mark.parametrize("failure", ["ENOSPC from safetensors", "torch's iostream error"])
def test_a_failed_checkpoint_write_is_named_and_resume_is_exact(used_run, tmp_path, monkeypatch, failure):
    """Before, the run died with torch's "basic_ios::clear: iostream error" and never said the disk was full."""
    monkeypatch.chdir(ROOT)
    run = tmp_path / TINY_RUN_ID
    half = run / "checkpoint-4"
    if failure.startswith("ENOSPC"):
        real = checkpoints.save_file

        def full_disk(tensors, path, *args, **kwargs):
            if str(half) in str(path):
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            return real(tensors, path, *args, **kwargs)

        monkeypatch.setattr(checkpoints, "save_file", full_disk)
    else:
        real = torch.save

        def failing_stream(obj, path, *args, **kwargs):
            if str(half) in str(path) and str(path).endswith("optimizer.pt"):
                raise RuntimeError(TORCH_WRITE_ERROR)
            return real(obj, path, *args, **kwargs)

        monkeypatch.setattr(torch, "save", failing_stream)
    with pytest.raises(CheckpointWriteError) as err:
        train(tiny_config(tmp_path))
    message = str(err.value)
    assert message.startswith(f"Writing {half} failed: ")
    why = "the disk is full (No space left on device)" if failure.startswith("ENOSPC") else "the write failed ("
    assert why in message and "free on its file system now" in message
    assert f"It has no {COMPLETE_MARKER} (that file is written last), so a resume never uses it" in message
    assert f"resume_from_checkpoint last: it continues from the newest complete checkpoint, {run / 'checkpoint-2'}" in (
        message
    )
    assert find_last_checkpoint(run) == str(run / "checkpoint-2") and not (half / COMPLETE_MARKER).exists()
    monkeypatch.undo()
    monkeypatch.chdir(ROOT)
    resumed = Path(train(tiny_config(tmp_path, "--resume_from_checkpoint", "last")))
    assert_same_weights(trainable(resumed), trainable(used_run))


# ---------------------------------------------------------------- exit statuses


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (ConfigError("lora_r: must be >= 1, got 0"), 2),
        (DataFormatError("data.jsonl:2: not valid UTF-8"), 2),
        (DatasetUnavailableError("dataset_name 'x' is not in the local datasets cache"), 2),
        (FileNotFoundError("train_file not found: x.txt"), 2),
        (BackboneConfigError("config.json of 'm' does not match its weights"), 2),
        (NonFiniteLossError("Loss is nan at optimizer step 3"), 1),
        (CheckpointWriteError("Writing checkpoint-4 failed: the disk is full"), 1),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, Exception) else str(value),
)
def test_errors_in_our_words_exit_with_their_status_and_one_message(error, status, caplog):
    """Before, only ConfigError and NonFiniteLossError were caught: a data error printed a traceback, exit 1."""

    def start(argv):
        raise error

    assert run_cli(["c.json"], "usage", SUPERVISED, start) == status
    assert str(error) in caplog.text and "Traceback" not in caplog.text


def test_unexpected_errors_keep_their_traceback():
    def start(argv):
        raise KeyError("a bug")

    with pytest.raises(KeyError):
        run_cli(["c.json"], "usage", SUPERVISED, start)
