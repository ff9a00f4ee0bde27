"""After a bidirectional load no attention module is left causal, by any path: under every attention
implementation the training config accepts and for every family, each layer's attention lets an unpadded text's
early tokens see a later one, with no mask (the self-test's path, where sdpa reads ``module.is_causal``) and with
an all-ones mask (the encoder's path), and every attention module's ``is_causal`` is off.

The load-time self-test only looks at the model's first output position, which a single causal layer (any but
the first) leaves changed through the layers before it; here each layer is run again on its own inputs with a
later token changed. A new attention implementation is one more entry in ``ATTN_IMPLEMENTATIONS``.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from conftest import FAMILIES

from diffusion_embedder import load_backbone
from diffusion_embedder.training.arguments import ATTN_IMPLEMENTATIONS

#: Kernels with no CPU path: they run where CUDA and the flash-attn package are (none of our CI machines).
NEEDS_FLASH_ATTN = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}
#: Pairs refused at load (an error, never a silent fallback), by transformers itself or by us (the varlen kernel
#: cannot soft-cap Gemma2's attention logits): checked to stay refused.
REFUSED_AT_LOAD = {
    ("gemma2", "sdpa"): "does not support an attention implementation",
    ("gemma2", "varlen"): "soft-caps its attention logits",
}
#: Smallest relative change of an early position's attention output when a later token changes. Measured on
#: the tiny models (float32, CPU, eager and sdpa): at least 4.7e-2 bidirectional; a causal layer leaves exactly 0.
MIN_CHANGE = 1e-5
LENGTH = 12


def attention_modules(model) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in model.named_modules() if type(m).__name__.endswith("Attention")}


def relative_change(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per position of ``(1, L, d)`` outputs: max |a - b| over the position's max |a|."""
    return ((a - b).abs().amax(-1) / a.abs().amax(-1).clamp_min(1e-12))[0]


def layer_inputs(model, ids: torch.Tensor, mask: torch.Tensor | None) -> dict[str, tuple[tuple, dict]]:
    """The arguments each attention module is called with in one forward pass (with this mask path)."""
    seen: dict[str, tuple[tuple, dict]] = {}
    hooks = [module.register_forward_pre_hook(lambda m, args, kwargs, name=name: seen.setdefault(name, (args, kwargs)),
                                              with_kwargs=True)
             for name, module in attention_modules(model).items()]
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def early_change_per_layer(model, ids: torch.Tensor, mask: torch.Tensor | None) -> dict[str, float]:
    """Per attention module: the smallest relative change of positions 0 .. L-2 of its output when its input at
    the last position changes (all else as in the forward pass)."""
    changes = {}
    modules = attention_modules(model)
    for name, (args, kwargs) in layer_inputs(model, ids, mask).items():
        args, kwargs = list(args), dict(kwargs)
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        changed = hidden.clone()
        changed[:, -1] += torch.randn(changed.shape[-1], generator=torch.Generator().manual_seed(0)).to(changed)
        outputs = []
        for states in (hidden, changed):
            if "hidden_states" in kwargs:
                kwargs["hidden_states"] = states
            else:
                args[0] = states
            with torch.no_grad():
                outputs.append(modules[name](*args, **kwargs)[0].float())
        changes[name] = relative_change(*outputs)[:-1].min().item()
    return changes


def cases() -> list:
    params = []
    for impl in ATTN_IMPLEMENTATIONS:
        marks = []
        if impl in NEEDS_FLASH_ATTN:
            missing = not torch.cuda.is_available() or importlib.util.find_spec(NEEDS_FLASH_ATTN[impl]) is None
            marks.append(pytest.mark.skipif(missing, reason=f"{impl} needs CUDA and {NEEDS_FLASH_ATTN[impl]}"))
        for family in FAMILIES:
            params.append(pytest.param(family, impl, marks=marks, id=f"{family}-{impl}"))
    return params


def check_no_causal_path(model, device: str) -> None:
    """The assertions of this file on one loaded model (the GPU tests reuse them on CUDA)."""
    modules = attention_modules(model)
    assert len(modules) == model.config.num_hidden_layers, sorted(modules)
    assert model.config.is_causal is False
    assert {name: m.is_causal for name, m in modules.items()} == dict.fromkeys(modules, False)
    vocab = model.config.vocab_size
    ids = torch.tensor([[(37 * i + 11) % vocab for i in range(LENGTH)]], device=device)
    later = ids.clone()
    later[0, -1] = (int(ids[0, -1]) + 1) % vocab
    for mask in (None, torch.ones_like(ids)):
        path = "no mask" if mask is None else "all-ones mask"
        per_layer = early_change_per_layer(model, ids, mask)
        assert all(change > MIN_CHANGE for change in per_layer.values()), (path, per_layer)
        with torch.no_grad():
            a, b = (model(input_ids=x, attention_mask=mask, use_cache=False).last_hidden_state.float()
                    for x in (ids, later))
        assert relative_change(a, b)[:-1].min().item() > MIN_CHANGE, path


@pytest.fixture
def flex_attention_uncompiled(monkeypatch):
    """transformers compiles flex_attention and its block masks with inductor, whose CPU code generation took 40 to
    130 s per family on the CI machine (most of this file's time); run uncompiled, flex_attention computes the same
    attention from the same block masks, and the mask is what this file checks. Its compiled function, kept in a
    singleton, is made anew here and dropped after the test."""
    from transformers.integrations import flex_attention as integration

    monkeypatch.setattr(integration.WrappedFlexAttention, "_instance", None)
    monkeypatch.setattr(integration.WrappedFlexAttention, "_is_flex_compiled", False)
    monkeypatch.setattr(torch, "compile", lambda model=None, **kwargs: model)


@pytest.mark.parametrize(("family", "impl"), cases())
def test_no_attention_module_is_left_causal_by_any_path(family_checkpoint, family, impl, request):
    if impl == "flex_attention":
        request.getfixturevalue("flex_attention_uncompiled")
    path = str(family_checkpoint(family))
    if (family, impl) in REFUSED_AT_LOAD:
        with pytest.raises(ValueError, match=REFUSED_AT_LOAD[(family, impl)]):
            load_backbone(path, attn_implementation=impl)
        return
    model = load_backbone(path, attn_implementation=impl)
    assert model.config._attn_implementation == impl
    check_no_causal_path(model, "cpu")
