"""Every LM-stage masking setting reaches the masker and the loss the stage trains with.

Each trainer is built from the tiny LM config through ``lm.train`` (the fit itself skipped), so a setting is
followed from the config to the built ``LMStageTrainer``: its masker's output, and its ``compute_loss`` against
a float64 hand computation on the same corrupted batch and logits.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import ROOT
from numerics import assert_close_normwise, normwise_error

from diffusion_embedder.objectives import MaskedBatch
from diffusion_embedder.training import lm

TINY_LM = ROOT / "train_configs" / "tiny" / "mntp.json"
ROWS = 64  # blocks of 32 tokens: enough draws that each check below fails by chance with probability < 1e-6
#: compute_loss (float32: ~1,000 cross-entropies summed) against the float64 hand loss on the same logits: measured
#: 0.51-0.57 eps (AMD EPYC); a setting that does not reach the loss (another alignment, no 1/t weights) is off > 1e-2.
LOSS_EPS = 16


@pytest.fixture(autouse=True)
def _at_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # the tiny config names repository-relative paths


def built(tmp_path: Path, monkeypatch, **overrides) -> lm.LMStageTrainer:
    """The trainer ``lm.train`` builds from the tiny LM config with ``overrides``, not fitted."""
    trainers: list[lm.LMStageTrainer] = []

    def build_only(build, run, stop_after_n_steps):
        with run:
            trainers.append(build())
        return ""

    monkeypatch.setattr(lm, "fit_built", build_only)
    values = {**json.loads(TINY_LM.read_text()), "output_dir": str(tmp_path), "report_to": "none", **overrides}
    lm.train(values)
    trainer = trainers[0]
    trainer.model.eval()  # no dropout: the hand loss below sees the same logits
    return trainer


def blocks(trainer: lm.LMStageTrainer) -> torch.Tensor:
    return trainer.data_collator([trainer.train_dataset[i] for i in range(ROWS)])["input_ids"]


def masked(trainer: lm.LMStageTrainer, seed: int = 0) -> MaskedBatch:
    torch.manual_seed(seed)
    return trainer.masker(blocks(trainer))


def hand_loss(logits: torch.Tensor, batch: MaskedBatch, shift: bool, diffusion: bool) -> float:
    """By hand, in float64: each masked token's cross-entropy from the logits at i - 1 (shift) or i; masked
    diffusion divides each by its row's t and sums over B x L, MNTP takes the mean."""
    terms = []
    for b, i in batch.masked.nonzero().tolist():
        row = logits[b, i - 1 if shift else i].double()
        ce = -torch.log_softmax(row, dim=-1)[batch.labels[b, i]].item()
        terms.append(ce / batch.t[b].item() if diffusion else ce)
    return sum(terms) / (batch.labels.numel() if diffusion else len(terms))


def loss_is(trainer: lm.LMStageTrainer, shift: bool, diffusion: bool, seed: int = 0) -> bool:
    """``compute_loss`` equals the hand loss of this alignment and weighting on its own masked batch."""
    ids = blocks(trainer)
    with torch.no_grad():
        torch.manual_seed(seed)
        loss = trainer.compute_loss(trainer.model, {"input_ids": ids})
        torch.manual_seed(seed)  # the same draws: the batch compute_loss masked
        batch = trainer.masker(ids)
        logits = trainer.model(batch.input_ids, batch.attention_mask)
    expected = hand_loss(logits, batch, shift, diffusion)
    if normwise_error(loss, expected) > 1e-3:
        return False
    assert_close_normwise(loss, expected, eps_multiple=LOSS_EPS, msg="compute_loss vs hand")
    return True


def masked_share(batch: MaskedBatch) -> float:
    return (batch.masked[:, 1:].sum() / batch.masked[:, 1:].numel()).item()


def mask_id(trainer: lm.LMStageTrainer, kind: str) -> int:
    tokenizer = trainer.model.tokenizer
    return {"eos": tokenizer.eos_token_id, "blank": tokenizer.convert_tokens_to_ids("_")}[kind]


MDM = {"objective": "mdm"}
#: (base overrides, the setting's overrides, check on the built trainer): each check fails on the base config.
FIELDS: dict[str, tuple[dict, dict, Callable[[lm.LMStageTrainer], bool]]] = {
    "objective": (  # the tiny config's mntp -> mdm: Dream's alignment, 1/t weights, sum over B x L
        {},
        MDM,
        lambda t: masked(t).t is not None and loss_is(t, shift=True, diffusion=True),
    ),
    "mdm_eps": (MDM, {"mdm_eps": 0.9}, lambda t: masked(t).t.min().item() >= 0.9 and masked_share(masked(t)) > 0.8),
    "mdm_shift": (  # LLaDA's alignment: position 0 may be masked, each token predicted from its own logits
        MDM,
        {"mdm_shift": False},
        lambda t: bool(masked(t).masked[:, 0].any()) and loss_is(t, shift=False, diffusion=True),
    ),
    "mask_token_type": (
        MDM,
        {"mask_token_type": "eos"},
        lambda t: bool((masked(t).input_ids[masked(t).masked] == mask_id(t, "eos")).all()),
    ),
    "mlm_probability": ({}, {"mlm_probability": 0.6}, lambda t: abs(masked_share(masked(t)) - 0.6) < 0.06),
    "data_collator_type": (
        {},
        {"data_collator_type": "all_mask"},
        lambda t: bool((masked(t).input_ids[masked(t).masked] == mask_id(t, "blank")).all()),
    ),
}


def test_the_base_configs_mask_and_score_as_their_objective(tmp_path, monkeypatch):
    """The two base configs themselves: MNTP's 20% with the blank token, MDM's shifted 1/t-weighted loss."""
    mntp = built(tmp_path / "mntp", monkeypatch)
    assert abs(masked_share(masked(mntp)) - 0.2) < 0.05 and loss_is(mntp, shift=True, diffusion=False)
    mdm = built(tmp_path / "mdm", monkeypatch, **MDM)
    assert not masked(mdm).masked[:, 0].any()
    assert (masked(mdm).input_ids[masked(mdm).masked] == mask_id(mdm, "blank")).all()


@pytest.mark.parametrize("field", list(FIELDS))
def test_lm_stage_setting_reaches_the_masker_and_the_loss(tmp_path, monkeypatch, field):
    base, overrides, check = FIELDS[field]
    assert not check(built(tmp_path / "base", monkeypatch, **base)), f"{field}: the check already holds by default"
    assert check(built(tmp_path / "set", monkeypatch, **base, **overrides)), f"{field} did not reach its code"
