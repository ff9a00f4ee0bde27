"""Liger Kernel (optional extra): refused in our words where it is missing or not wired, and, where installed,
applied by the family's function to the backbone under the adapter (a stand-in module shows the glue on CPU;
tests/test_gpu.py compares the real kernels with the plain model)."""

from __future__ import annotations

import sys
import types

import pytest
import transformers.utils
from test_training_trainer import make_config

from diffusion_embedder.training import liger
from diffusion_embedder.training.arguments import ConfigError
from diffusion_embedder.training.supervised import prepare_encoder


def test_use_liger_kernel_is_refused_where_liger_kernel_is_missing(tmp_path, monkeypatch):
    monkeypatch.setattr(transformers.utils, "is_liger_kernel_available", lambda: False)  # missing on every machine
    with pytest.raises(ConfigError, match="use_liger_kernel: True needs the liger-kernel package") as err:
        make_config(tmp_path, use_liger_kernel=True)
    assert "pip install 'diffusion-embedder[liger]'" in str(err.value) and "--use_liger_kernel false" in str(err.value)


@pytest.fixture
def fake_liger(monkeypatch):
    """A stand-in ``liger_kernel.transformers`` recording which family function ran on which model."""
    calls = []
    module = types.ModuleType("liger_kernel.transformers")
    for name in liger.LIGER_FAMILIES.values():
        setattr(module, name, lambda name=name, **kwargs: calls.append((name, kwargs)))
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", module)
    monkeypatch.setattr(transformers.utils, "is_liger_kernel_available", lambda: True)
    return calls


def test_use_liger_kernel_reaches_the_family_function_on_the_backbone(tmp_path, fake_liger):
    cfg = make_config(tmp_path, use_liger_kernel=True)
    encoder = prepare_encoder(cfg.model, cfg.custom, cfg.training)
    (name, kwargs), = fake_liger
    assert name == "apply_liger_kernel_to_llama"  # the tiny fixture is a Llama
    assert kwargs.pop("model") is encoder.model.get_base_model()  # the backbone under the adapter
    assert kwargs == {"rope": True, "rms_norm": True, "swiglu": True, "cross_entropy": False,
                      "fused_linear_cross_entropy": False}  # fmt: skip
    assert not cfg.training.use_liger_kernel  # applied here: the Trainer's own would find no PreTrainedModel
    plain = make_config(tmp_path)
    prepare_encoder(plain.model, plain.custom, plain.training)
    assert len(fake_liger) == 1


def test_liger_refuses_a_family_or_a_loss_kernel_it_is_not_wired_for(tmp_path, fake_liger, monkeypatch):
    with pytest.raises(ConfigError, match="liger_kernel_config: fused_linear_cross_entropy is not wired"):
        make_config(tmp_path, use_liger_kernel=True, liger_kernel_config={"fused_linear_cross_entropy": True})
    from diffusion_embedder.training import lm  # the LM stages refuse it with the config too, before any model loads

    assert lm.LM_STAGE.problems({"model_name_or_path": "m", "train_file": ["t.txt"], "output_dir": "o",
                                 "liger_kernel_config": {"cross_entropy": True}}) == [
        "liger_kernel_config: cross_entropy is not wired to our losses (they read the logits at the masked "
        "positions); leave it false"]
    monkeypatch.delitem(liger.LIGER_FAMILIES, "llama")
    cfg = make_config(tmp_path, use_liger_kernel=True)
    with pytest.raises(ConfigError, match="use_liger_kernel: Liger Kernel is not wired for the 'llama' family"):
        prepare_encoder(cfg.model, cfg.custom, cfg.training)
    assert not fake_liger
