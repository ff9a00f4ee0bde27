"""The LM stages' fused head (``fused_head``): the head at the positions the objective reads gives the plain
path's loss and gradients for every objective; the field reaches the trainer, and Liger's kernel where asked."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F
from test_training_stages import lm_values

from diffusion_embedder.training import lm, lm_head
from diffusion_embedder.training.schema import ConfigError


def built(objective: str, tmp_path):
    args, training = lm.LM_STAGE.validate(lm_values(objective=objective, output_dir=str(tmp_path),
                                                    activation_checkpointing=False, lora_dropout=0.0))  # fmt: skip
    torch.manual_seed(0)
    model = lm.build_model(args, lm.OBJECTIVES[objective], training)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.05)
    return model, lm.objective_options(args, model)


def loss_and_grads(model, loss):
    model.zero_grad()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("objective", ["mntp", "mdm", "clm"])
def test_fused_head_gives_the_plain_loss_and_gradients(objective, tmp_path):
    model, options = built(objective, tmp_path)
    objective_ = lm.OBJECTIVES[objective]
    ids = torch.randint(5, 200, (4, 32), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(2)
    batch = objective_.masker(options)(ids, torch.ones_like(ids))
    plain = loss_and_grads(model, objective_.loss(model(batch.input_ids, batch.attention_mask), batch, options))
    targets = objective_.targets(batch, options)
    hidden = model.hidden(batch.input_ids, batch.attention_mask)
    fused = loss_and_grads(model, lm_head.plain_rows(hidden[targets.positions], model.get_output_embeddings(),
                                                     targets))  # fmt: skip
    # the same float32 arithmetic on fewer rows (a few float32 eps apart at most: reductions may run in another order)
    torch.testing.assert_close(fused[0], plain[0], rtol=1e-6, atol=0)
    assert len(plain[1]) > 0
    for name, grad in plain[1].items():
        torch.testing.assert_close(fused[1][name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_fused_head_field_reaches_the_trainer(tmp_path, monkeypatch):
    seen = {}

    class Built(Exception):
        pass

    def trainer(**kwargs):
        seen.update(kwargs)
        raise Built

    monkeypatch.setattr(lm, "LMStageTrainer", trainer)
    with pytest.raises(Built):
        lm.train(lm_values(output_dir=str(tmp_path), fused_head=True, report_to="none"))
    assert seen["fused_head"] is lm_head.plain_rows
    with pytest.raises(Built):
        lm.train(lm_values(output_dir=str(tmp_path / "b"), report_to="none"))
    assert seen["fused_head"] is None
    with pytest.raises(ConfigError, match="fused_head: not with fsdp"):
        lm.LM_STAGE.validate(lm_values(output_dir="o", fused_head=True, fsdp=True, full_training=True))


def test_liger_fused_cross_entropy_is_used_and_reduced_as_the_objective(monkeypatch):
    calls = []

    class FakeFused:  # Liger's interface: (head weight, rows, target ids, bias) -> per-token losses
        def __init__(self, reduction):
            assert reduction == "none"

        def __call__(self, weight, rows, ids, bias):
            calls.append(rows.shape)
            return F.cross_entropy(F.linear(rows, weight, bias), ids, reduction="none")

    module = types.ModuleType("liger_kernel.transformers")
    module.LigerFusedLinearCrossEntropyLoss = FakeFused
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", module)
    assert lm_head.head_loss(True) is lm_head.liger_rows
    head = torch.nn.Linear(8, 20, bias=False)
    rows = torch.randn(5, 8)
    targets = lm_head.Targets(torch.ones(1, 5, dtype=torch.bool), torch.tensor([1, 2, 3, 4, 5]),
                              torch.tensor([0.5, 0.5, 1.0, 1.0, 2.0]), torch.tensor(7))  # fmt: skip
    expected = (F.cross_entropy(head(rows), targets.ids, reduction="none") / targets.divisors).sum() / 7
    torch.testing.assert_close(lm_head.liger_rows(rows, head, targets), expected)
    assert calls == [(5, 8)]


def test_fused_head_with_liger_is_refused_where_liger_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "liger_kernel", None)
    with pytest.raises(ConfigError, match="fused_head with use_liger_kernel: true needs the liger-kernel package"):
        lm_head.head_loss(True)


def test_bench_lm_head_dry_run():
    """bench/train_lm_head.py (the MNTP step with and without the fused head) on the CPU, tiny shape."""
    import os
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    command = [sys.executable, str(root / "bench" / "train_lm_head.py"), "--dry-run"]
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| MNTP")]
    assert [row.split(" | ")[0] for row in rows] == ["| MNTP, full logits", "| MNTP, fused head",
                                                      "| MNTP, fused head, Liger"]  # fmt: skip
    assert rows[0].split(" | ")[1] == rows[1].split(" | ")[1] == "256"  # 4 blocks of 64 tokens each step


def test_data_seed_orders_the_lm_stage_s_blocks(tmp_path, monkeypatch):
    """transformers' ``data_seed`` seeds the data order, ``seed`` where it is unset; before, the LM stage read only
    ``seed``."""
    seeds = []

    class Built(Exception):
        pass

    real = lm.load_text_blocks
    monkeypatch.setattr(lm, "load_text_blocks", lambda *a, seed, **k: seeds.append(seed) or real(*a, seed=seed, **k))
    monkeypatch.setattr(lm, "LMStageTrainer", lambda **kwargs: (_ for _ in ()).throw(Built()))
    for folder, extra in (("plain", {}), ("data_seed", {"data_seed": 5})):
        with pytest.raises(Built):
            lm.train(lm_values(output_dir=str(tmp_path / folder), report_to="none", seed=3, **extra))
    assert seeds == [3, 5]
