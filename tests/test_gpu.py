"""GPU checks (``make test-gpu``): dtypes, attention implementations, packing, device pool, GradCache, 7B shapes.

Every test is marked ``gpu`` and skips without CUDA (CI never has one). ``bench/gpu.sh`` runs them
first on a GPU machine, then the 7B benchmarks.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import FAMILIES, LLAMA_FIXTURE, MIXED_TEXTS, default_attention
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
        assert torch.allclose(outputs[attn], outputs["sdpa"], atol=1e-4, rtol=0), attn


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
        assert torch.allclose(packed, padded, atol=1e-4, rtol=0), (attn, mode, (packed - padded).abs().max())


def test_device_pool_over_every_gpu_equals_one_device():
    encoder = load(LLAMA_FIXTURE)
    one = encoder.encode(TEXTS * 4, batch_size=2, device="cuda:0", show_progress_bar=False)
    devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    try:
        pooled = encoder.encode(TEXTS * 4, batch_size=2, device=devices, show_progress_bar=False)
    finally:
        encoder.stop_pool()
    assert torch.allclose(pooled, one, atol=1e-5, rtol=0)


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
    check_equals_direct(built(tmp_path, "cuda", lora_dropout=0.0), pack_length, atol=1e-4)


@pytest.mark.parametrize("pack_length", [None, PACK_LENGTH], ids=["padded", "packed"])
@pytest.mark.parametrize("dropout", list(DROPOUTS))
def test_grad_cache_with_dropout_equals_a_direct_step_with_the_same_masks_on_cuda(tmp_path, dropout, pack_length):
    check_same_masks(built(tmp_path, "cuda", **DROPOUTS[dropout]), pack_length, atol=1e-4)


def test_grad_cache_with_activation_checkpointing_on_cuda(tmp_path):
    plain = built(tmp_path / "plain", "cuda", **BOTH_DROPOUTS)
    checkpointed = built(tmp_path / "checkpointed", "cuda", gradient_checkpointing=True, **BOTH_DROPOUTS)
    check_checkpointing(plain, checkpointed, atol=1e-4)


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
    8 x 1024 tokens. The tolerance is not measured yet (no GPU in the session that wrote it): 20%, to be set from
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
