"""GPU checks (``make test-gpu``): dtypes, attention implementations, packing, device pool, GradCache, 7B shapes.

Every test is marked ``gpu`` and skips without CUDA (CI never has one). ``bench/gpu_run.sh`` runs them
first on a GPU machine, then the 7B benchmarks.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch
from conftest import FAMILIES, LLAMA_FIXTURE, MIXED_TEXTS, default_attention, randomize_lora_b
from numerics import GRAD_EPS, ORDER_EPS, assert_close_normwise, log_normwise
from test_bidirectional import REFUSED_AT_LOAD, check_no_causal_path
from test_bidirectional import cases as attention_cases
from test_grad_cache import (
    BOTH_DROPOUTS,
    DROPOUTS,
    PACK_LENGTH,
    built,
    check_checkpointing,
    check_equals_direct,
    check_replays,
    check_same_masks,
)

from diffusion_embedder import Encoder
from diffusion_embedder.backbones import AttentionSelfTestError, check_attention, load_backbone, set_bidirectional
from diffusion_embedder.pooling import POOLING_MODES
from diffusion_embedder.random_models import SHAPES_7B, random_encoder
from diffusion_embedder.training.grad_cache import RandState, cuda_devices

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (make test-gpu)"),
]

TEXTS = MIXED_TEXTS
#: Float32 on CUDA with TF32 off (the fixture below): cuBLAS and the attention kernels pick other reduction orders
#: per shape (split-K, tiling), so two shapes of one computation differ by more roundings than on the CPU. Not yet
#: measured on a GPU: 8x the CPU bounds (numerics.py), still ~1e-4 norm-relative at most, where a wrong scale or a
#: dropped chunk is ~1e-2. NUMERICS_LOG=file records the observed errors (make test-gpu) to set them from a run.
CUDA_ORDER_EPS = 8 * ORDER_EPS
CUDA_GRAD_EPS = 8 * GRAD_EPS


@pytest.fixture(autouse=True)
def exact_float32():
    """TF32 matmuls would make float32 comparisons meaningless."""
    previous = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous
    torch.cuda.empty_cache()


def load(path, **kwargs) -> Encoder:
    kwargs.setdefault("torch_dtype", torch.float32)
    return Encoder.from_pretrained(str(path), device="cuda", **kwargs)


def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_is_close_to_float32(family_checkpoint, family):
    attn = default_attention(family)
    full = load(family_checkpoint(family), attn_implementation=attn).encode(TEXTS, show_progress_bar=False)
    half = load(family_checkpoint(family), attn_implementation=attn, torch_dtype=torch.bfloat16)
    low = half.encode(TEXTS, show_progress_bar=False)
    assert cosine(full, low).min() >= 0.999, (family, cosine(full, low))


@pytest.mark.parametrize("family", [f for f in FAMILIES if default_attention(f) == "sdpa"])
def test_sdpa_flex_and_eager_agree(family_checkpoint, family):
    outputs = {
        attn: load(family_checkpoint(family), attn_implementation=attn).encode(
            TEXTS, packing=False, show_progress_bar=False
        )
        for attn in ("sdpa", "flex_attention", "eager")
    }
    for attn in ("flex_attention", "eager"):
        assert_close_normwise(outputs[attn], outputs["sdpa"], eps_multiple=CUDA_ORDER_EPS, rows=True, msg=attn)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("bidirectional", [True, False])
def test_attention_self_test_under_bfloat16(family_checkpoint, family, bidirectional):
    model = load_backbone(
        str(family_checkpoint(family)), enable_bidirectional=bidirectional, torch_dtype=torch.bfloat16,
        attn_implementation=default_attention(family), device_map="cuda",
    )
    check_attention(model, expect_bidirectional=bidirectional)  # raises on the wrong direction
    set_bidirectional(model, not bidirectional)
    with pytest.raises(AttentionSelfTestError, match="self-test failed"):
        check_attention(model, expect_bidirectional=bidirectional)


@pytest.mark.parametrize(("family", "impl"), [c for c in attention_cases() if tuple(c.values)
                                             not in REFUSED_AT_LOAD])
def test_no_attention_module_is_left_causal_on_cuda(family_checkpoint, family, impl):
    """test_bidirectional's checks on CUDA, where sdpa's flash/cuDNN kernels and flash-attn read ``is_causal``."""
    model = load_backbone(str(family_checkpoint(family)), attn_implementation=impl, device_map="cuda")
    check_no_causal_path(model, "cuda")


@pytest.mark.parametrize("attn", ["sdpa", "eager", "flex_attention"])
@pytest.mark.parametrize("bidirectional", [True, False])
def test_packed_equals_padded_on_gpu(attn, bidirectional):
    base = load(LLAMA_FIXTURE, attn_implementation=attn, enable_bidirectional=bidirectional)
    for mode in POOLING_MODES:
        if mode == "mask_token":
            continue  # the llama fixture has no mask token; Dream/LLaDA are covered on CPU
        encoder = Encoder(base.model, base.tokenizer, replace(base.config, pooling_mode=mode, eos_suffix=None))
        padded = encoder.encode(TEXTS, batch_size=2, packing=False, show_progress_bar=False)
        packed = encoder.encode(TEXTS, max_tokens_per_batch=48, packing=True, show_progress_bar=False)
        assert_close_normwise(packed, padded, eps_multiple=CUDA_ORDER_EPS, rows=True, msg=(attn, mode))


def test_device_pool_over_every_gpu_equals_one_device():
    encoder = load(LLAMA_FIXTURE)
    one = encoder.encode(TEXTS * 4, batch_size=2, device="cuda:0", show_progress_bar=False)
    devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    try:
        pooled = encoder.encode(TEXTS * 4, batch_size=2, device=devices, show_progress_bar=False)
    finally:
        encoder.stop_pool()
    assert_close_normwise(pooled, one, eps_multiple=CUDA_ORDER_EPS, rows=True)


# --------------------------------------------------------------------------------------- GradCache on CUDA
# The checks of tests/test_grad_cache.py on the GPU, where dropout draws from CUDA's counter-based generator.
@pytest.mark.parametrize("pack_length", [None, PACK_LENGTH], ids=["padded", "packed"])
@pytest.mark.parametrize(("dropout", "dtype"), [("lora", None), ("attention", None), ("lora", "bfloat16")])
def test_grad_cache_replays_each_chunk_bit_for_bit_on_cuda(tmp_path, dropout, dtype, pack_length):
    trainer = built(tmp_path, "cuda", torch_dtype=dtype, **DROPOUTS[dropout])
    assert trainer.model.device.type == "cuda"
    check_replays(trainer, pack_length)


@pytest.mark.parametrize("pack_length", [None, PACK_LENGTH], ids=["padded", "packed"])
def test_grad_cache_without_dropout_equals_the_direct_step_on_cuda(tmp_path, pack_length):
    check_equals_direct(built(tmp_path, "cuda", lora_dropout=0.0), pack_length, CUDA_GRAD_EPS)


@pytest.mark.parametrize("pack_length", [None, PACK_LENGTH], ids=["padded", "packed"])
@pytest.mark.parametrize("dropout", list(DROPOUTS))
def test_grad_cache_with_dropout_equals_a_direct_step_with_the_same_masks_on_cuda(tmp_path, dropout, pack_length):
    check_same_masks(built(tmp_path, "cuda", **DROPOUTS[dropout]), pack_length, CUDA_GRAD_EPS)


def test_grad_cache_with_activation_checkpointing_on_cuda(tmp_path):
    plain = built(tmp_path / "plain", "cuda", **BOTH_DROPOUTS)
    checkpointed = built(tmp_path / "checkpointed", "cuda", gradient_checkpointing=True, **BOTH_DROPOUTS)
    check_checkpointing(plain, checkpointed, CUDA_GRAD_EPS)


def test_nan_check_reduces_a_cuda_tensor(tmp_path, monkeypatch):
    """NCCL reduces CUDA tensors only: a CPU flag would stop every multi-GPU run at its first step."""
    from test_training_step import check_reduces_on_the_ranks_device

    trainer = built(tmp_path, "cuda")
    assert trainer.args.device.type == "cuda"
    check_reduces_on_the_ranks_device(trainer, monkeypatch)


def dropout_stage(device: str) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Dropout(0.3), torch.nn.GELU()).to(device)


class To(torch.nn.Module):
    def __init__(self, device: str):
        super().__init__()
        self.device = device

    def forward(self, x):
        return x.to(self.device)


def replays(model: torch.nn.Module, x: torch.Tensor) -> bool:
    """A RandState over the model's devices makes a graph-building forward repeat a no-graph one."""
    model.train()
    state = RandState(cuda_devices(model, {"x": x}))
    with torch.no_grad():
        first = model(x)
    with state:
        second = model(x)
    return torch.equal(first, second.detach()) and not torch.equal(model(x).detach(), first)


def test_rand_state_replays_a_compiled_model_on_cuda():
    """Inductor draws its dropout seeds from the CUDA generator: replaying it replays the masks."""
    torch.manual_seed(0)
    assert replays(torch.compile(dropout_stage("cuda")), torch.randn(8, 64, device="cuda"))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_rand_state_replays_every_device_the_model_spans():
    torch.manual_seed(0)
    model = torch.nn.Sequential(dropout_stage("cuda:0"), To("cuda:1"), dropout_stage("cuda:1"))
    assert cuda_devices(model) == [0, 1]
    assert replays(model, torch.randn(8, 64, device="cuda:0"))


# --------------------------------------------------------------------------------------- 7B shapes
def random_7b(shape: str, attn: str = "sdpa") -> Encoder:
    model_type, dims = SHAPES_7B[shape]
    return random_encoder(model_type, dims, LLAMA_FIXTURE, device="cuda", dtype=torch.bfloat16, attn=attn)


def random_text(tokens: int, encoder: Encoder, seed: int = 0) -> str:
    """A text of about ``tokens`` tokens for the fixture tokenizer."""
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa"]
    generator = torch.Generator().manual_seed(seed)
    text = " ".join(words[i] for i in torch.randint(0, len(words), (tokens,), generator=generator).tolist())
    ids = encoder.tokenizer(text, add_special_tokens=False)["input_ids"][: tokens - 2]
    return encoder.tokenizer.decode(ids)


@pytest.fixture(scope="module", params=list(SHAPES_7B))
def big_encoder(request):
    encoder = random_7b(request.param)
    yield encoder
    del encoder
    torch.cuda.empty_cache()


@pytest.mark.parametrize("length", [512, 4096])
def test_7b_encodes_within_memory(big_encoder, length):
    texts = [random_text(length, big_encoder, seed=i) for i in range(4)]
    torch.cuda.reset_peak_memory_stats()
    out = big_encoder.encode(texts, batch_size=4, show_progress_bar=False)
    assert out.shape == (4, big_encoder.embedding_dim) and torch.isfinite(out).all()
    assert torch.cuda.max_memory_allocated() < 0.95 * torch.cuda.get_device_properties(0).total_memory


def test_7b_one_document_of_32768_tokens(big_encoder):
    text = random_text(32768, big_encoder)
    out = big_encoder.encode([text], show_progress_bar=False)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("length", [512, 4096])
def test_7b_one_lora_step_within_memory(big_encoder, length):
    from peft import LoraConfig, get_peft_model

    from diffusion_embedder.losses import HardNegativeNLLLoss

    backbone = big_encoder.model
    lora = get_peft_model(backbone, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    encoder = Encoder(lora, big_encoder.tokenizer, big_encoder.config)
    lora.enable_input_require_grads()
    lora.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        encoder.train()
        texts = [random_text(length, encoder, seed=i) for i in range(6)]
        torch.cuda.reset_peak_memory_stats()
        q, p, n = (encoder({k: v.cuda() for k, v in encoder.tokenize(texts[i::3]).items()}) for i in range(3))
        loss = HardNegativeNLLLoss()(q, p, n.unsqueeze(1))
        loss.backward()
        assert torch.isfinite(loss)
        assert torch.cuda.max_memory_allocated() < 0.95 * torch.cuda.get_device_properties(0).total_memory
        grads = [p.grad for n_, p in lora.named_parameters() if "lora_" in n_]
        assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    finally:
        big_encoder.model = lora.unload()
        big_encoder.model.gradient_checkpointing_disable()
        big_encoder.eval()


# --------------------------------------------------------------------------------------------- varlen's kernel
#: A 7B model's heads (head dimension 128, grouped-query 4:1 as Qwen2.5-7B's 28:4) in a tiny model.
VARLEN_SHAPE = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=1, vocab_size=1024)
LONG_TEXTS = [*MIXED_TEXTS, "", "one more text " * 300]


def kernel_calls(monkeypatch) -> list:
    """Every call of torch's varlen kernel (through ``varlen._flash``), as its (max_q, causal)."""
    from diffusion_embedder import varlen

    seen, inner = [], varlen._flash

    def spy(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        seen.append((max_q, causal))
        return inner(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale)

    monkeypatch.setattr(varlen, "_flash", spy)
    return seen


#: The backbone families' head layouts (query heads, key/value heads, head dimension; their checkpoints' config.json).
KERNEL_LAYOUTS = {"Qwen2.5-7B": (28, 4, 128), "Llama-3-8B": (32, 8, 128), "LLaDA-8B": (32, 32, 128),
                  "Gemma-2B": (8, 1, 256), "Gemma-7B": (16, 16, 256)}  # fmt: skip
#: Our call of the kernel in bf16 against the reference path in float32 on the same bf16 inputs, norm-relative in
#: bf16 eps: only the kernel's own rounding (bf16 probabilities and output) separates them, where a wrong scale,
#: direction or head grouping is ~1 (over 100 eps). Not yet measured on a GPU (2026-11-28): NUMERICS_LOG records it.
KERNEL_BF16_EPS = 4
KERNEL_BF16_GRAD_EPS = 16


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("family", list(KERNEL_LAYOUTS))
def test_varlen_kernel_takes_each_familys_head_layout_forward_and_backward(monkeypatch, family, causal):
    """The GPU half of tests/test_varlen_kernel.py (fake tensors stop before the backward): the kernel runs our call
    for every family's heads, and its output and gradients are the reference path's."""
    from diffusion_embedder import varlen

    n_heads, n_kv, head_dim = KERNEL_LAYOUTS[family]
    lengths = [5, 64, 1, 200, 37]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    torch.manual_seed(0)
    shapes = [(sum(lengths), heads, head_dim) for heads in (n_heads, n_kv, n_kv)]
    inputs = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for shape in shapes]
    weight = torch.randn(sum(lengths), n_heads, head_dim, device="cuda")
    seen = kernel_calls(monkeypatch)
    results = []
    for fast in (True, False):  # the kernel in bf16, then the reference path in float32 on the same values
        q, k, v = (x.detach().clone().requires_grad_() for x in inputs)
        if fast:
            out = varlen.attend(q, k, v, cu, cu, max(lengths), max(lengths), causal, head_dim**-0.5)
        else:
            out = varlen._reference(q.float(), k.float(), v.float(), cu, cu, causal, head_dim**-0.5)
        (out.float() * weight).sum().backward()
        results.append((out.float().detach(), [x.grad.float() for x in (q, k, v)]))
    assert len(seen) == 1  # the kernel ran (and the reference path did not call it)
    (out, grads), (expected, expected_grads) = results
    assert_close_normwise(out, expected, eps_multiple=KERNEL_BF16_EPS, dtype=torch.bfloat16, msg=(family, causal))
    for name, grad, reference in zip("qkv", grads, expected_grads, strict=True):
        assert_close_normwise(grad, reference, eps_multiple=KERNEL_BF16_GRAD_EPS, dtype=torch.bfloat16,
                              msg=(family, causal, f"d{name}"))  # fmt: skip


@pytest.mark.parametrize("bidirectional", [True, False])
def test_varlen_kernel_equals_padded_sdpa_in_bfloat16(monkeypatch, bidirectional):
    """bf16 tolerance: the bf16-vs-float32 bound of test_bfloat16_is_close_to_float32 (cosine >= 0.999)."""
    encoder = random_encoder("qwen2", VARLEN_SHAPE, LLAMA_FIXTURE, device="cuda", dtype=torch.bfloat16)
    set_bidirectional(encoder.model, bidirectional)
    padded = encoder.encode(LONG_TEXTS, packing=False, show_progress_bar=False)
    seen = kernel_calls(monkeypatch)
    dispatched = encoder.encode(LONG_TEXTS, show_progress_bar=False)  # packing="auto": packed sdpa runs on varlen
    assert seen and all(causal is not bidirectional for _, causal in seen)
    assert encoder.model.config._attn_implementation == "sdpa"
    encoder.model.set_attn_implementation("varlen")
    seen.clear()
    named = encoder.encode(LONG_TEXTS, show_progress_bar=False)
    named_padded = encoder.encode(LONG_TEXTS, packing=False, show_progress_bar=False)  # unpadded by the backend
    assert len(seen) >= 2 * VARLEN_SHAPE["num_hidden_layers"]
    for name, got in (("dispatched", dispatched), ("named", named), ("named, padded rows", named_padded)):
        log_normwise(got, padded, dtype=torch.bfloat16, rows=True, msg=name)  # the bound to set from a GPU run
        assert cosine(got, padded).min() >= 0.999, cosine(got, padded)


def test_varlen_in_float32_on_cuda_runs_the_reference_path_and_says_so_once(monkeypatch, caplog):
    from diffusion_embedder import varlen

    monkeypatch.setattr(varlen, "_said", set())
    encoder = load(LLAMA_FIXTURE, attn_implementation="varlen")
    expected = load(LLAMA_FIXTURE).encode(TEXTS, packing=False, show_progress_bar=False)
    seen = kernel_calls(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="diffusion_embedder.varlen"):
        first = encoder.encode(TEXTS, packing=True, show_progress_bar=False)
        encoder.encode(TEXTS, packing=False, show_progress_bar=False)
    assert not seen and caplog.text.count("runs its reference path") == 1 and "float32" in caplog.text
    assert_close_normwise(first, expected, eps_multiple=CUDA_ORDER_EPS, rows=True)


def test_a_packed_varlen_training_step_equals_a_padded_sdpa_step_on_cuda(tmp_path, monkeypatch):
    """pack_length 'auto' on CUDA in bf16: packed rows on the kernel; the loss and every LoRA gradient agree with
    the padded sdpa step to bf16 precision (cosine of each gradient >= 0.99, loss within 1%: bf16's 8 bits of
    mantissa through two layers and a backward, not a measurement yet)."""
    from test_training_trainer import PAIRS, make_config, step_grads

    from diffusion_embedder.training import supervised

    def built(**overrides):
        cfg = make_config(tmp_path, dataset_file_path=str(PAIRS), use_cpu=False, torch_dtype="bfloat16",
                          lora_dropout=0.0, **overrides)
        torch.manual_seed(0)
        trainer = supervised.build_trainer(cfg)
        torch.manual_seed(1)
        randomize_lora_b(trainer.model, 0.05)
        return trainer

    padded = built(pack_length=None)
    samples = [padded.train_dataset[i] for i in range(4)]
    loss, grads = step_grads(padded, padded._prepare_inputs(padded.data_collator(samples)), None)
    seen = kernel_calls(monkeypatch)
    fast = built()
    assert fast.data_collator.pack_length is not None and fast.model.model.config._attn_implementation == "varlen"
    fast_loss, fast_grads = step_grads(fast, fast._prepare_inputs(fast.data_collator(samples)), None)
    assert seen
    assert abs(fast_loss.item() - loss.item()) <= 0.01 * abs(loss.item())
    assert fast_grads.keys() == grads.keys()
    for name, grad in grads.items():
        log_normwise(fast_grads[name], grad, dtype=torch.bfloat16, msg=name)  # the bound to set from a GPU run
        assert cosine(fast_grads[name].flatten(), grad.flatten()) >= 0.99, name


def lora_step_peak(device: str, model_type: str, dims: dict, tokens: tuple[int, int], checkpointed: int):
    """One LoRA step (r 16 on all seven projections, dropout 0.05, AdamW) of a random backbone with the first
    ``checkpointed`` layers checkpointed: the measured peak (None off CUDA) and ``checkpointing.memory_model``'s."""
    from diffusion_embedder.training.arguments import LoraArguments
    from diffusion_embedder.training.checkpointing import checkpoint_first, memory_model
    from diffusion_embedder.training.lora import add_lora

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    encoder = random_encoder(model_type, dims, LLAMA_FIXTURE, device=device, dtype=dtype)
    model = add_lora(encoder.model, LoraArguments(lora_r=16, lora_dropout=0.05)).train()
    model.enable_input_require_grads()  # as the Trainer's checkpointing does: every layer's input needs a gradient
    checkpoint_first(model, checkpointed, {})
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    ids = torch.randint(10, dims["vocab_size"] - 10, tokens, device=device)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for _ in range(2):  # the second step holds AdamW's moments too
        hidden = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).last_hidden_state
        hidden.float().mean(1).pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    measured = torch.cuda.max_memory_allocated() if device == "cuda" else None
    predicted = memory_model(model, ids.numel(), act=dtype.itemsize).peak(checkpointed)
    return measured, predicted


@pytest.mark.parametrize("checkpointed", [28, 20])
def test_memory_model_predicts_the_7b_lora_step_peak(checkpointed):
    """The activation_checkpointing "auto" policy's prediction against max_memory_allocated, Qwen2.5-7B shape,
    8 x 1024 tokens. The tolerance is not yet measured on a GPU (2026-11-28): 20%, to be set from
    the first run's figure, which the assertion message prints."""
    torch.cuda.empty_cache()
    model_type, dims = SHAPES_7B["qwen2.5-7b"]
    measured, predicted = lora_step_peak("cuda", model_type, dims, (8, 1024), checkpointed)
    figures = f"predicted {predicted / 2**30:.2f} GiB, measured {measured / 2**30:.2f} GiB"
    assert abs(predicted / measured - 1) < 0.2, figures


def test_liger_kernel_equals_the_plain_model_in_bfloat16():
    """Liger's RMSNorm, rotary and SwiGLU on a bf16 Qwen2 backbone (Dream's family): embeddings and LoRA gradients
    as the plain model's within bf16 tolerance (cosine >= 0.999: unmeasured, to be set from the first run)."""
    pytest.importorskip("liger_kernel.transformers", reason="pip install 'diffusion-embedder[liger]'")
    from types import SimpleNamespace

    from diffusion_embedder.training.arguments import LoraArguments
    from diffusion_embedder.training.liger import apply_liger
    from diffusion_embedder.training.lora import add_lora

    dims = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=4, num_attention_heads=14,
                num_key_value_heads=2, vocab_size=151936)  # fmt: skip

    def run(liger: bool):
        encoder = random_encoder("qwen2", dims, LLAMA_FIXTURE, device="cuda", dtype=torch.bfloat16)
        torch.manual_seed(1)
        encoder.model = add_lora(encoder.model, LoraArguments(lora_r=8, lora_dropout=0.0))
        for name, param in encoder.model.named_parameters():
            if "lora_B" in name:
                param.data.normal_(0, 0.05)
        if liger:
            apply_liger(encoder.model, SimpleNamespace(use_liger_kernel=True, liger_kernel_config=None))
        encoder.train()
        features = {k: v.cuda() for k, v in encoder.tokenize(MIXED_TEXTS[:8]).items()}
        out = encoder(features)
        out.float().pow(2).sum().backward()
        grads = torch.cat([p.grad.flatten().float() for n, p in encoder.model.named_parameters() if "lora_A" in n])
        return out.float().detach(), grads

    (plain, plain_grads), (fused, fused_grads) = run(False), run(True)
    assert torch.nn.functional.cosine_similarity(plain, fused).min() > 0.999
    assert torch.nn.functional.cosine_similarity(plain_grads, fused_grads, dim=0) > 0.999
