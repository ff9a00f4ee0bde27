"""oneDNN linear layers for CPU encoding: the same embeddings, used by encode, never in training or under hooks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import LLAMA_FIXTURE, MIXED_TEXTS
from numerics import ORDER_EPS, assert_close_normwise
from torch import nn

from diffusion_embedder import Encoder, cpu_linear
from diffusion_embedder.cpu_linear import ENV_SWITCH, onednn_linear

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="this PyTorch build has no oneDNN linear")


@pytest.fixture
def calls(monkeypatch):
    """Counts the oneDNN op's calls (it still computes)."""
    count = []
    real = cpu_linear._onednn

    def counted(x, weight, bias, post_op="none"):
        count.append(post_op)
        return real(x, weight, bias, post_op)

    monkeypatch.setattr(cpu_linear, "_onednn", counted)
    return count


def test_same_values_as_f_linear_for_every_input_shape():
    generator = torch.Generator().manual_seed(0)
    layer = nn.Linear(64, 48)
    no_bias = nn.Linear(64, 48, bias=False)
    for shape in ((7, 64), (3, 5, 64), (2, 3, 4, 64), (1, 64)):
        x = torch.randn(*shape, generator=generator)
        for module in (layer, no_bias):
            with torch.no_grad():
                expected = F.linear(x, module.weight, module.bias)
                with onednn_linear(module, torch.device("cpu")) as switched:
                    got = module(x)
            assert switched == 1
            assert got.shape == expected.shape
            assert_close_normwise(got, expected, eps_multiple=ORDER_EPS, msg=(shape, (got - expected).abs().max()))


def test_encode_uses_it_and_gives_the_default_paths_embeddings(calls, monkeypatch):
    encoder = Encoder.from_pretrained(str(LLAMA_FIXTURE), torch_dtype=torch.float32)
    for packing in (True, False):
        calls.clear()
        fast = encoder.encode(MIXED_TEXTS, batch_size=2, packing=packing, show_progress_bar=False)
        assert calls, "encode on CPU did not run the oneDNN linear"
        monkeypatch.setenv(ENV_SWITCH, "0")
        calls.clear()
        default = encoder.encode(MIXED_TEXTS, batch_size=2, packing=packing, show_progress_bar=False)
        monkeypatch.delenv(ENV_SWITCH)
        assert not calls, f"{ENV_SWITCH}=0 did not switch it off"
        assert_close_normwise(fast, default, eps_multiple=ORDER_EPS, rows=True, msg=(fast - default).abs().max())
    # The layers are restored after encode: a forward with gradients runs PyTorch's own path.
    assert not any("forward" in m.__dict__ for m in encoder.modules() if type(m) is nn.Linear)


@pytest.mark.parametrize("family", ["llama", "qwen2", "Dream", "llada", "qwen3", "mistral", "gemma2"])
def test_gated_mlps_fuse_silu_and_product_into_the_matmuls(family_checkpoint, family, calls, monkeypatch):
    """Llama/Mistral/Qwen MLPs (LLaDA and Dream included) run SiLU and the product as oneDNN post-ops; Gemma's
    GELU MLP only gets the plain linears. Embeddings equal PyTorch's own path either way."""
    encoder = Encoder.from_pretrained(str(family_checkpoint(family)), torch_dtype=torch.float32)
    fast = encoder.encode(MIXED_TEXTS, batch_size=3, show_progress_bar=False)
    fused = calls.count("swish")
    monkeypatch.setenv(ENV_SWITCH, "0")
    default = encoder.encode(MIXED_TEXTS, batch_size=3, show_progress_bar=False)
    assert_close_normwise(fast, default, eps_multiple=ORDER_EPS, rows=True, msg=(family, (fast - default).abs().max()))
    layers = encoder.model.config.num_hidden_layers
    assert fused == (0 if family == "gemma2" else layers * 2), (family, fused)  # 2 batches x every layer
    assert calls, family


def test_mlp_with_a_replaced_projection_is_not_fused(calls):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    mlp = LlamaMLP(LlamaConfig(hidden_size=16, intermediate_size=32, num_attention_heads=4, num_key_value_heads=4))
    x = torch.randn(3, 16)
    with torch.no_grad():
        expected = mlp(x)
        with onednn_linear(mlp, torch.device("cpu")):
            assert_close_normwise(mlp(x), expected, eps_multiple=ORDER_EPS)
        assert calls.count("swish") == 1
        calls.clear()
        mlp.up_proj.forward = lambda t: F.linear(t, mlp.up_proj.weight)  # e.g. an accelerate hook
        with onednn_linear(mlp, torch.device("cpu")):
            assert_close_normwise(mlp(x), expected, eps_multiple=ORDER_EPS)
        assert "swish" not in calls and len(calls) == 2  # gate and down, plain


def test_never_with_gradients(calls):
    layer = nn.Linear(8, 4)
    with pytest.raises(RuntimeError, match="inference"), onednn_linear(layer, torch.device("cpu")):
        pass
    layer(torch.randn(2, 8)).sum().backward()
    assert not calls and layer.weight.grad is not None


def test_leaves_replaced_forwards_and_other_dtypes_alone(calls):
    """accelerate's hooks replace ``forward`` on the instance: such layers, and non-float32 ones, keep theirs."""
    hooked, half, plain = nn.Linear(8, 4), nn.Linear(8, 4).to(torch.bfloat16), nn.Linear(8, 4)
    marker = []
    hooked.forward = lambda x: marker.append(1) or F.linear(x, hooked.weight, hooked.bias)
    model = nn.ModuleList([hooked, half, plain])
    with torch.no_grad(), onednn_linear(model, torch.device("cpu")) as switched:
        hooked(torch.randn(2, 8))
        half(torch.randn(2, 8, dtype=torch.bfloat16))
        plain(torch.randn(2, 8))
    assert switched == 1 and len(calls) == 1 and marker == [1]
    assert "forward" in hooked.__dict__ and "forward" not in plain.__dict__


def test_two_blocks_at_once_on_one_model_share_the_switch(calls):
    """Two ``encode`` calls in two threads on one encoder: the first to leave keeps the switch for the other, and
    the last undoes it. Before, the first undid it under the other, which then failed leaving."""
    layer = nn.Linear(8, 4)
    first, second = onednn_linear(layer, torch.device("cpu")), onednn_linear(layer, torch.device("cpu"))
    with torch.no_grad():
        assert first.__enter__() == 1 and second.__enter__() == 1
        first.__exit__(None, None, None)
        layer(torch.randn(2, 8))
        assert len(calls) == 1 and "forward" in layer.__dict__
        second.__exit__(None, None, None)
        layer(torch.randn(2, 8))
    assert len(calls) == 1 and "forward" not in layer.__dict__ and not cpu_linear._switched


def test_off_on_other_devices_and_when_the_self_check_fails(calls, monkeypatch):
    layer = nn.Linear(8, 4)
    with torch.no_grad(), onednn_linear(layer, torch.device("meta")) as switched:
        assert switched == 0
    monkeypatch.setattr(cpu_linear, "_checked", None)
    monkeypatch.setattr(cpu_linear, "_onednn", lambda x, w, b: F.linear(x, w, b) + 1)  # a wrong result
    assert not cpu_linear.available()
    with torch.no_grad(), onednn_linear(layer, torch.device("cpu")) as switched:
        assert switched == 0
