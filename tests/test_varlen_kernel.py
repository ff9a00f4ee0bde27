"""What would fail on a GPU, caught on the CPU: our attention function driven through torch's real
``torch.nn.attention.varlen.varlen_attn`` on fake CUDA tensors, for each family's head layout, checked against the
flash kernel's own requirements; the kernel's call without ``enable_gqa`` (torch 2.10-2.11); and the padded path's
offsets derived once per forward, not once per layer.

How far the fake path reaches (torch 2.13's CPU build, ``FakeTensorMode``): the real wrapper runs its own checks
(head counts against ``enable_gqa``, its keywords) and the op's schema checks argument types (``max_q`` an int);
then the op's fake implementation returns a fake ``cuda:0`` tensor of the output's shape. It does not run
flash's C++ checks (dtype, int32 offsets, contiguous last dimension, head dimension, shapes): ``flash_contract``
below restates them from flash-attention's ``mha_varlen_fwd``. It stops where an op takes a CUDA device guard,
which a CPU build lacks: ``Tensor.__getitem__`` and ``Tensor.contiguous`` on a fake CUDA tensor raise "PyTorch is
not linked with support for cuda devices" (our attention indexes with ``index_select`` and reshapes, so it gets
through), and a fake CUDA tensor that requires a gradient aborts the process in autograd's ``AccumulateGrad``:
the forward is checked here in ``no_grad``, the backward only on a GPU (tests/test_gpu.py).
"""

from __future__ import annotations

import functools
import types

import pytest
import torch
from conftest import LLAMA_FIXTURE
from numerics import ORDER_EPS, assert_close_normwise
from torch._subclasses.fake_tensor import FakeTensorMode

from diffusion_embedder import packing, varlen
from diffusion_embedder.host_syncs import HostSyncs
from diffusion_embedder.random_models import SHAPES_7B, TINY_SHAPE, random_encoder

varlen_module = pytest.importorskip("torch.nn.attention.varlen", reason="torch >= 2.10 has the varlen kernel")


def heads(shape: str) -> tuple[int, int, int]:
    dims = SHAPES_7B[shape][1]
    return dims["num_attention_heads"], dims["num_key_value_heads"], dims["hidden_size"] // dims["num_attention_heads"]


#: The released checkpoints' attention layouts (their config.json): query heads, key/value heads, head dimension.
LAYOUTS = {
    "Llama-3-8B": (32, 8, 128),  # grouped-query 4:1
    "Mistral-7B": (32, 8, 128),
    "Qwen2.5-7B / Dream-7B": heads("qwen2.5-7b"),  # 28:4
    "Gemma-7B": (16, 16, 256),  # the kernel's largest head dimension
    "Gemma-2B": (8, 1, 256),  # multi-query
    "LLaDA-8B": heads("llada-8b"),  # 32:32
}


def flash_contract(q, k, v, cu_q, cu_k, max_q, max_k) -> None:
    """flash-attention's ``mha_varlen_fwd`` checks (TORCH_CHECK, CHECK_DEVICE, CHECK_SHAPE), which the fake op
    skips: each one a failure on the GPU."""
    assert q.dtype in (torch.float16, torch.bfloat16), f"FlashAttention runs fp16 and bf16, not {q.dtype}"
    assert k.dtype == q.dtype and v.dtype == q.dtype, "query, key and value must have the same dtype"
    assert cu_q.dtype == torch.int32 and cu_k.dtype == torch.int32, f"offsets must be int32, not {cu_q.dtype}"
    devices = {t.device for t in (q, k, v, cu_q, cu_k)}
    assert len(devices) == 1 and devices.pop().type == "cuda", "every tensor on the same CUDA device"
    assert q.dim() == k.dim() == v.dim() == 3, "(tokens, heads, head dimension)"
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1, "contiguous last dimension"
    assert cu_q.is_contiguous() and cu_k.is_contiguous(), "contiguous offsets"
    head_dim = q.shape[2]
    assert head_dim <= 256 and head_dim % 8 == 0, f"head dimension {head_dim}"
    assert q.shape[1] % k.shape[1] == 0, "key/value heads must divide query heads"
    assert k.shape == v.shape and k.shape[2] == head_dim, "key and value shapes"
    assert cu_q.dim() == 1 and cu_q.shape == cu_k.shape, "one offset per sequence, plus one"
    assert type(max_q) is int and type(max_k) is int, f"longest lengths as Python ints, not {type(max_q)}"


def checked_wrapper(real, calls: list):
    @functools.wraps(real)  # inspect.signature reads the real keywords through __wrapped__
    def checked(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):
        flash_contract(q, k, v, cu_q, cu_k, max_q, max_k)
        calls.append({"kv_heads": k.shape[1], **kwargs})
        return real(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)

    return checked


def older_release(real, release: str):
    """torch's wrapper in an older release's form, calling the installed one: 2.11 takes ``scale`` and
    ``window_size`` but no ``enable_gqa`` (key/value heads must then equal the query's); 2.10 takes ``is_causal``
    and no ``scale``."""
    if release == "2.11":
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                        window_size=(-1, -1)):  # fmt: skip
            return real(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, window_size=window_size)
    else:
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
            return real(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k,
                        window_size=(-1, 0) if is_causal else (-1, -1))  # fmt: skip
    return varlen_attn


@pytest.fixture
def kernel_calls(monkeypatch) -> list:
    """torch's real varlen_attn, checked against flash's contract, as what ``varlen.kernel()`` finds; an H100's
    compute capability (the CPU build has no device to ask)."""
    calls: list = []
    monkeypatch.setattr(varlen_module, "varlen_attn", checked_wrapper(varlen_module.varlen_attn, calls))
    monkeypatch.setattr(varlen, "_capability", lambda index: (9, 0))
    varlen.kernel.cache_clear()
    yield calls
    varlen.kernel.cache_clear()


def attention_module(causal: bool) -> torch.nn.Module:
    module = torch.nn.Module()
    module.is_causal = causal
    module.config = types.SimpleNamespace(model_type="fake", attn_logit_softcapping=None)
    return module


def model_layout(rows: int, length: int, n_heads: int, head_dim: int, rotated: bool) -> torch.Tensor:
    """(B, H, L, D) as the attention modules pass it: rotated query/key contiguous, value a transposed view."""
    if rotated:
        return torch.empty(rows, n_heads, length, head_dim, dtype=torch.bfloat16, device="cuda")
    return torch.empty(rows, length, n_heads, head_dim, dtype=torch.bfloat16, device="cuda").transpose(1, 2)


def inputs(how: str) -> tuple[int, int, dict]:
    """Rows, their width and what a layer receives with them, made on the CPU by the code that makes them on the
    GPU: packed rows (``packing.pack``'s offsets), padded rows (``varlen_mask``'s sequences, made once per forward)
    or rows without padding."""
    if how == "packed":
        features = packing.pack([(list(range(n)), n) for n in (10, 20, 30, 7, 60)], capacity=64, pad_token_id=0)
        rows, width = features["input_ids"].shape
        return rows, width, packing.varlen_offsets(features)
    mask = torch.ones(2, 64, dtype=torch.long)
    if how == "padded":
        mask[0, :24] = 0  # left padding, as Encoder.tokenize lays rows out
    return 2, 64, {"attention_mask": varlen.varlen_mask(2, 64, 64, attention_mask=mask)}


def fake_cuda(value):
    """A fake CUDA tensor of ``value``'s shape and dtype (inside FakeTensorMode); other values as they are."""
    if isinstance(value, torch.Tensor):
        return torch.empty(value.shape, dtype=value.dtype, device="cuda")
    if isinstance(value, varlen.Unpadded):
        return varlen.Unpadded(*(fake_cuda(field) for field in value))
    return value


def fake_forward(layout: tuple[int, int, int], how: str, causal: bool, scale: float | None = None) -> torch.Tensor:
    """One call of our attention function on fake CUDA tensors in bf16, as a layer makes it (``scale``: the
    module's scaling, 1/sqrt(head dimension) unless given)."""
    n_heads, n_kv, head_dim = layout
    rows, length, given = inputs(how)
    with FakeTensorMode(), torch.no_grad():
        q = model_layout(rows, length, n_heads, head_dim, rotated=True)
        k = model_layout(rows, length, n_kv, head_dim, rotated=True)
        v = model_layout(rows, length, n_kv, head_dim, rotated=False)
        kwargs = {name: fake_cuda(value) for name, value in given.items()}
        mask = kwargs.pop("attention_mask", None)
        scaling = scale or head_dim**-0.5
        out, _ = varlen.varlen_attention_forward(attention_module(causal), q, k, v, mask, scaling=scaling, **kwargs)
        return out


@pytest.mark.parametrize("how", ["packed", "padded", "unpadded"])
@pytest.mark.parametrize("family", list(LAYOUTS))
def test_our_attention_calls_torchs_varlen_kernel_as_the_gpu_takes_it(kernel_calls, family, how):
    n_heads, n_kv, head_dim = LAYOUTS[family]
    assert varlen.kernel_problem(torch.device("cuda:0"), torch.bfloat16, head_dim) is None  # the fast path is taken
    for causal in (False, True):
        out = fake_forward(LAYOUTS[family], how, causal)
        rows, width, _ = inputs(how)
        assert out.shape == (rows, width, n_heads, head_dim) and out.device.type == "cuda"
        assert out.dtype == torch.bfloat16
        call = kernel_calls[-1]
        assert call["window_size"] == ((-1, 0) if causal else (-1, -1)) and call["scale"] == head_dim**-0.5
        assert call["kv_heads"] == n_kv and call.get("enable_gqa", False) == (n_kv != n_heads)
    assert len(kernel_calls) == 2


@pytest.mark.parametrize("release", ["2.11", "2.10"])
@pytest.mark.parametrize("family", ["Qwen2.5-7B / Dream-7B", "Gemma-2B", "LLaDA-8B"])
def test_a_torch_without_enable_gqa_gets_repeated_key_value_heads(monkeypatch, kernel_calls, family, release):
    """The GPU machine's torch may be such a release: grouped-query heads must reach it repeated, and the causal
    flag and scale in its keywords (the installed wrapper behind it refuses unequal head counts); a scale other
    than 1/sqrt(head dimension) (Gemma's query_pre_attn_scalar) goes into the query where there is no keyword."""
    older = older_release(varlen_module.varlen_attn, release)
    monkeypatch.setattr(varlen_module, "varlen_attn", older)
    varlen.kernel.cache_clear()
    assert not varlen.kernel().gqa and varlen.kernel().scale == (release == "2.11")
    n_heads, _, head_dim = LAYOUTS[family]
    for causal in (False, True):
        out = fake_forward(LAYOUTS[family], "packed", causal, scale=0.5 * head_dim**-0.5)
        assert out.shape[2:] == (n_heads, head_dim) and out.dtype == torch.bfloat16
        assert kernel_calls[-1]["kv_heads"] == n_heads  # repeated before the call


# ------------------------------------------------------------------------------------ host waits per forward
def device_only_kernel(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
    """The kernel's arithmetic without reading anything on the host: a block-diagonal mask made on the device
    from the offsets (what a GPU kernel does), so that only our own waits are counted."""
    position = torch.arange(q.shape[0], device=q.device)
    sequence = torch.searchsorted(cu_q[1:].contiguous(), position, right=True)
    allowed = sequence[:, None] == sequence[None, :]
    if tuple(window_size) == (-1, 0):
        allowed = allowed & (position[:, None] >= position[None, :])
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=allowed, scale=scale, enable_gqa=enable_gqa
    )
    return out.transpose(0, 1)


@pytest.mark.parametrize("layers", [2, 4])
def test_padded_rows_on_varlen_wait_for_the_device_once_per_forward_whatever_the_layers(monkeypatch, layers):
    """The offsets of padded rows (a ``nonzero`` and a ``max``, each a host wait) are derived once per forward by
    the mask function and handed to every layer; the kernel's conditions met and its call made with the device
    only (``device_only_kernel``). The vectors are padded sdpa's."""
    monkeypatch.setattr(varlen, "kernel", lambda: varlen.Kernel(device_only_kernel, True, True, True))
    monkeypatch.setattr(varlen, "kernel_problem", lambda *args: None)
    model_type, dims = TINY_SHAPE
    encoder = random_encoder(model_type, {**dims, "num_hidden_layers": layers}, LLAMA_FIXTURE, attn="varlen")
    features = encoder.tokenizer(["a short text", "a much longer text than the other one, with more words"],
                                 padding=True, return_tensors="pt")  # fmt: skip
    assert not features["attention_mask"].all()
    with torch.no_grad(), HostSyncs() as syncs:
        hidden = encoder.model(**features).last_hidden_state
    assert syncs.count == 1 and all("varlen.py" in site for site in syncs.sites), syncs.sites
    encoder.model.set_attn_implementation("sdpa")
    with torch.no_grad():
        expected = encoder.model(**features).last_hidden_state
    real = features["attention_mask"].bool()
    assert_close_normwise(hidden[real], expected[real], eps_multiple=ORDER_EPS, rows=True)
