"""The LM stages (MNTP / MDM / CLM) and SimCSE: validation, a 2-process torchrun MNTP run whose output an
Encoder merges and a supervised run starts from, exact resume, and SimCSE's loss on its two dropout views."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from numerics import HAND_EPS, assert_close_normwise
from safetensors.torch import load_file

from diffusion_embedder import Encoder
from diffusion_embedder.training import lm, simcse
from diffusion_embedder.training.arguments import ConfigError
from diffusion_embedder.training.checkpoints import COMPLETE_MARKER, TRAINABLE_WEIGHTS

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "train_configs" / "tiny"
LLAMA = ROOT / "tests" / "fixtures" / "llm2vec_parity" / "llama"
TEXTS = [["Retrieve the sentence that answers the riddle;", "I am red and I am an apple."], "The red apple."]


def lm_values(**overrides) -> dict:
    return {**json.loads((TINY / "mntp.json").read_text()), **overrides}


# ---------------------------------------------------------------------------------------------- validation
def test_lm_stage_config_errors_name_every_field():
    values = lm_values(output_dir="x", objective="mdn", mlm_probability=1.5, lora_r=0, learnig_rate=1e-4)
    del values["model_name_or_path"]
    with pytest.raises(ConfigError) as err:
        lm.LM_STAGE.validate(values)
    message = str(err.value)
    for expected in (
        "objective: 'mdn' is not one of",
        "did you mean 'mdm'",
        "mlm_probability: must be <= 1, got 1.5",
        "lora_r: must be >= 1, got 0",
        "unknown key 'learnig_rate'; did you mean 'learning_rate'?",
        "missing required field 'model_name_or_path'",
    ):
        assert expected in message, message


def test_lm_stage_refuses_bad_data_choice_before_any_model_loads(tmp_path, caplog):
    config = tmp_path / "c.json"
    config.write_text(json.dumps(lm_values(dataset_name="wikitext", model_name_or_path=str(tmp_path / "nothing"))))
    assert lm.main([str(config), "--output_dir", str(tmp_path / "out")]) == 2
    assert "either dataset_name (hub) or train_file (local)" in caplog.text
    config.write_text(json.dumps(lm_values(mdm_eps=0.0)))
    assert lm.main([str(config)]) == 2 and "mdm_eps: must be > 0" in caplog.text


def test_cli_overrides_are_typed_by_the_stage_fields(tmp_path):
    values = lm.read_config_values(
        TINY / "mntp.json",
        ["--mlm_probability", "0.5", "--mdm_shift", "false", "--train_file", '["a.txt"]'],
        lm.LM_STAGE.classes,
    )
    args, training = lm.LM_STAGE.validate({**values, "output_dir": str(tmp_path)})
    assert (args.mlm_probability, args.mdm_shift, args.train_file) == (0.5, False, ["a.txt"])
    assert training.learning_rate == 0.002


@pytest.mark.parametrize(("objective", "causal"), [("mntp", False), ("mdm", False), ("clm", True)])
def test_attention_follows_the_objective(objective, causal, tmp_path):
    args, training = lm.LM_STAGE.validate(lm_values(objective=objective, output_dir=str(tmp_path)))
    model = lm.build_model(args, lm.OBJECTIVES[objective], training)
    assert model.lm.config.is_causal is causal
    ids = torch.tensor([[5, 6, 7, 8]])
    changed = ids.clone()
    changed[0, -1] = 9
    model.eval()
    with torch.no_grad():
        first = model(ids, torch.ones_like(ids))[0, 0]
        second = model(changed, torch.ones_like(ids))[0, 0]
    assert torch.equal(first, second) is causal  # the first position sees the last token unless causal


# ---------------------------------------------------------------------------------------------- MNTP run
def torchrun(script: str, config: Path, output_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        str(ROOT / "experiments" / script), str(config), "--output_dir", str(output_dir), *overrides,
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


@pytest.fixture(scope="module")
def mntp_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mntp")
    torchrun("run_mntp.py", TINY / "mntp.json", out)
    return out / "tiny-mntp"


def test_two_process_mntp_run_writes_llm2vecs_mntp_layout(mntp_run):
    assert sorted(p.name for p in mntp_run.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-6"]
    assert all((mntp_run / f"checkpoint-{s}" / COMPLETE_MARKER).is_file() for s in (3, 6))
    state = json.loads((mntp_run / "checkpoint-6" / "trainer_state.json").read_text())
    losses = [e["loss"] for e in state["log_history"] if "loss" in e]
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
    assert losses[0] == pytest.approx(math.log(1024), abs=1.0)  # a random LM starts near ln(vocab)
    assert not (mntp_run / "model.safetensors").exists()  # an adapter over the base, not full weights
    config = json.loads((mntp_run / "config.json").read_text())
    assert config["model_type"] == "llama" and config["_name_or_path"] == str(LLAMA)
    adapter = json.loads((mntp_run / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(LLAMA) and adapter["r"] == 4 and adapter["lora_alpha"] == 8
    card = (mntp_run / "README.md").read_text()
    assert card.startswith("# mntp stage output") and "LoRA adapter" in card and str(LLAMA) in card
    assert "Provide a quick summary" not in card  # not peft's empty template


def test_encoder_merges_the_mntp_adapter(mntp_run):
    """The merged q_proj equals the base's plus the adapter's B @ A * alpha / r, by hand."""
    encoder = Encoder.from_pretrained(str(mntp_run), device="cpu")
    assert encoder.config.merged_adapters == (str(mntp_run),) and encoder.config.enable_bidirectional
    adapter = load_file(mntp_run / "adapter_model.safetensors")
    a = adapter["base_model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    b = adapter["base_model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    assert b.abs().max() > 0  # trained (LoRA's B starts at zero)
    base = load_file(LLAMA / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"]
    merged = encoder.model.layers[0].self_attn.q_proj.weight.detach()
    assert_close_normwise(merged, base + b @ a * (8 / 4), eps_multiple=HAND_EPS)


def test_supervised_run_starts_from_the_mntp_output(mntp_run, tmp_path):
    from diffusion_embedder.training import supervised

    args = [str(TINY / "custom.json"), "--model_name_or_path", str(mntp_run), "--output_dir", str(tmp_path)]
    assert supervised.main([*args, "--max_steps", "2", "--save_steps", "2", "--report_to", "none"]) == 0
    encoder = Encoder.from_pretrained(str(tmp_path / "tiny_custom"), device="cpu")
    assert encoder.config.merged_adapters == (str(mntp_run),)
    assert torch.isfinite(encoder.encode(TEXTS, show_progress_bar=False)).all()


def test_lm_stage_resumes_to_the_same_weights(tmp_path, caplog):
    """In one process: a run stopped at step 2 and resumed ends where the uninterrupted run does; the run
    folder then belongs to that run (a new run stops, ``last`` refuses another objective's checkpoint)."""
    common = ["--max_steps", "4", "--save_steps", "2", "--report_to", "none", "--objective", "mdm"]
    assert lm.main([str(TINY / "mntp.json"), "--output_dir", str(tmp_path / "full"), *common]) == 0
    stopped = tmp_path / "resumed"
    args = [str(TINY / "mntp.json"), "--output_dir", str(stopped), *common]
    assert lm.main([*args, "--stop_after_n_steps", "2"]) == 0
    assert sorted(p.name for p in (stopped / "tiny-mntp").glob("checkpoint-*")) == ["checkpoint-2"]
    assert lm.main([*args, "--resume_from_checkpoint", "last"]) == 0
    full = load_file(tmp_path / "full" / "tiny-mntp" / TRAINABLE_WEIGHTS)
    resumed = load_file(stopped / "tiny-mntp" / TRAINABLE_WEIGHTS)
    assert full.keys() == resumed.keys()
    half = load_file(stopped / "tiny-mntp" / "checkpoint-2" / TRAINABLE_WEIGHTS)
    assert any(not torch.equal(half[k], full[k]) for k in full)  # steps 3-4 changed the weights
    for name, value in full.items():
        torch.testing.assert_close(resumed[name], value, atol=1e-6, rtol=0, msg=name)
    assert lm.main(args) == 2 and "already holds" in caplog.text and "--overwrite_output_dir" in caplog.text
    assert lm.main([*args, "--objective", "clm", "--resume_from_checkpoint", "last"]) == 2
    assert "objective: 'mdm' there, 'clm' now" in caplog.text


# ---------------------------------------------------------------------------------------------- SimCSE
def test_simcse_loss_is_hard_negative_nll_on_two_dropout_views(tmp_path):
    from transformers import TrainingArguments

    from diffusion_embedder.data import ContrastiveCollator, Wiki1M
    from diffusion_embedder.losses import HardNegativeNLLLoss
    from diffusion_embedder.training.arguments import validate
    from diffusion_embedder.training.supervised import prepare_encoder
    from diffusion_embedder.training.trainer import EncoderTrainer

    values = {**json.loads((TINY / "simcse.json").read_text()), "model_name_or_path": str(LLAMA)}
    cfg = validate({**simcse.SIMCSE_DEFAULTS, **values, "output_dir": str(tmp_path)})
    encoder = prepare_encoder(cfg.model, cfg.custom, cfg.training)
    assert encoder.model.base_model.model.config.attention_dropout == 0.3  # simcse_dropout reaches the backbone
    data = Wiki1M(TINY / "data" / "wiki1m_sample.txt")
    batch = ContrastiveCollator(encoder, num_negatives=0)([data[i] for i in range(8)])
    trainer = EncoderTrainer(
        model=encoder, args=TrainingArguments(str(tmp_path), report_to=[]), loss_fn=HardNegativeNLLLoss(scale=20.0)
    )
    encoder.train()
    torch.manual_seed(0)
    loss = trainer.compute_loss(encoder, batch)
    torch.manual_seed(0)
    q, p = encoder(batch["query"]), encoder(batch["positive"])
    assert not torch.allclose(q, p)  # the same texts, two dropout masks
    scores = torch.nn.functional.normalize(q, dim=-1) @ torch.nn.functional.normalize(p, dim=-1).T * 20.0
    by_hand = (torch.logsumexp(scores, dim=1) - scores.diag()).mean()
    assert_close_normwise(loss, by_hand, eps_multiple=HAND_EPS)
    encoder.eval()
    torch.testing.assert_close(encoder(batch["query"]), encoder(batch["positive"]))


def test_simcse_stage_runs_from_the_mntp_output_and_refuses_no_dropout(mntp_run, tmp_path, caplog):
    args = [str(TINY / "simcse.json"), "--model_name_or_path", str(mntp_run), "--output_dir", str(tmp_path)]
    assert simcse.main([*args, "--simcse_dropout", "0"]) == 2
    assert "simcse_dropout: must be > 0" in caplog.text
    assert simcse.main(args) == 0
    out = tmp_path / "tiny-mntp-simcse"
    assert json.loads((out / "train_config.json").read_text())["dataset_name"] == "Wiki1M"
    encoder = Encoder.from_pretrained(str(out), device="cpu")
    assert encoder.config.merged_adapters == (str(mntp_run),)
    assert torch.isfinite(encoder.encode(TEXTS, show_progress_bar=False)).all()


def test_stage_registry_and_cli(capsys):
    from diffusion_embedder.cli import main
    from diffusion_embedder.training.stages import STAGES

    assert set(STAGES) == {"supervised", "mntp", "simcse"}
    assert main(["mntp", "--help"]) == 0
    assert "usage: diffusion-embedder mntp CONFIG.json" in capsys.readouterr().out
    assert main(["simcse", "--help"]) == 0 and "simcse_dropout" in capsys.readouterr().out
    for script in ("run_mntp.py", "run_simcse.py"):
        assert "STAGES[" in (ROOT / "experiments" / script).read_text()
