"""``attn_implementation="varlen"``: attention over variable-length sequences given as cumulative offsets.

Registered through transformers' own ``AttentionInterface`` (and ``AttentionMaskInterface``, so no dense mask
is ever built), for every family whose attention modules call the interface: Llama (LLaDA), Mistral, Qwen2
(Dream), Qwen3, Gemma. On CUDA it runs PyTorch's own Flash Attention variable-length kernel
(``torch.nn.attention.varlen.varlen_attn``, torch >= 2.10; bf16/fp16): no padding, no mask, grouped-query
heads, forward and backward, no flash-attn package. Elsewhere (CPU, float32, an older torch) the reference
path computes the same attention one sequence at a time with ``scaled_dot_product_attention`` on the same
layout and offsets; on CUDA it says so once and names what would be fast.

Where the sequences come from, per forward:
- packed rows (``packing.pack``): the offsets travel as transformers' FlashAttention keywords
  ``cu_seq_lens_q/k`` and ``max_length_q/k``, which every model's forward passes down to its attention;
- padded rows: the mask function (``varlen_mask``, once per forward) turns the 2D padding mask into each row's
  real tokens as one sequence (``Unpadded``: their indices, offsets and longest length, from one host read),
  which every layer receives as its attention mask;
- neither: each row is one sequence.
Bidirectional or causal as the module says (``is_causal``, which ``backbones.set_bidirectional`` sets).

What the kernel cannot honour is refused with the reason, never dropped: attention dropout in training
(SimCSE's ``simcse_dropout``, a config's ``attention_dropout``), logit soft-capping (Gemma2), and a sliding
window shorter than a sequence. ``dispatched`` lets a model loaded with ``sdpa`` run its packed inference
forwards here (same attention as sdpa's block mask, computed without the mask).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

logger = logging.getLogger(__name__)

NAME = "varlen"
#: What the flash kernel runs on: half precision, head dimensions up to 256 in steps of 8, Ampere or newer.
KERNEL_DTYPES = (torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256
MIN_CAPABILITY = (8, 0)
#: What runs fast where the kernel cannot (named in the one-time message).
FAST = "bfloat16 or float16 weights (torch_dtype) on an Ampere-or-newer GPU with torch >= 2.10"


@dataclass(frozen=True)
class Kernel:
    """torch's ``varlen_attn`` and which of its keywords this torch has (2.10: ``is_causal``, no ``scale``;
    2.11: ``scale`` and ``window_size``; 2.12 on: ``enable_gqa`` too)."""

    fn: Callable
    scale: bool
    window: bool
    gqa: bool


@functools.cache
def kernel() -> Kernel | None:
    """torch's variable-length flash kernel, its signature read once; None where torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" not in params and "is_causal" not in params:
        return None  # no way to ask for causal attention: not a signature this module knows
    return Kernel(varlen_attn, "scale" in params, "window_size" in params, "enable_gqa" in params)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def kernel_problem(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why the flash kernel cannot run attention on ``device`` in ``dtype``; None when it can."""
    if device.type != "cuda":
        return f"the kernel runs on CUDA only (tensors on {device.type})"
    if kernel() is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn (torch >= 2.10)"
    if dtype not in KERNEL_DTYPES:
        return f"the kernel runs in bfloat16/float16, the model in {str(dtype).removeprefix('torch.')}"
    if head_dim > MAX_HEAD_DIM or head_dim % 8:
        return f"head dimension {head_dim} (the kernel takes multiples of 8 up to {MAX_HEAD_DIM})"
    capability = _capability(device.index if device.index is not None else torch.cuda.current_device())
    if capability < MIN_CAPABILITY:
        return f"compute capability {capability[0]}.{capability[1]} (the kernel needs 8.0 or newer)"
    return None


def config_problem(config) -> str | None:
    """A setting of the model's attention that the varlen backend cannot honour at all; None when there is none."""
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap:
        return (
            f"{getattr(config, 'model_type', 'this model')} soft-caps its attention logits "
            f"(attn_logit_softcapping={softcap}), which the varlen kernel cannot do; use attn_implementation='eager'"
        )
    return None


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


_said: set[str] = set()


def say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        logger.warning(message)


# ------------------------------------------------------------------------------------------- attention
def _reference(q, k, v, cu_q: torch.Tensor, cu_k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """The same attention, one sequence at a time: (T, H, D) from (T, H, D) and (T, Hkv, D)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out = torch.empty_like(q)
    for qs, qe, ks, ke in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist(),
                              strict=True):
        if qe > qs:
            out[qs:qe] = torch.nn.functional.scaled_dot_product_attention(
                q[qs:qe].transpose(0, 1), k[ks:ke].transpose(0, 1), v[ks:ke].transpose(0, 1),
                is_causal=causal, scale=scale,
            ).transpose(0, 1)
    return out


def _flash(q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float) -> torch.Tensor:
    """torch's kernel, called in the form this torch takes: a missing ``scale`` becomes a scaled query, a
    missing ``enable_gqa`` repeated key/value heads."""
    call = kernel()
    kwargs: dict = {}
    if call.scale:
        kwargs["scale"] = scale
    elif scale != q.shape[-1] ** -0.5:
        q = q * (scale * q.shape[-1] ** 0.5)
    if call.window:
        kwargs["window_size"] = (-1, 0) if causal else (-1, -1)
    else:
        kwargs["is_causal"] = causal
    if k.shape[1] != q.shape[1]:
        if call.gqa:
            kwargs["enable_gqa"] = True
        else:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return call.fn(q, k, v, cu_q.to(torch.int32), cu_k.to(torch.int32), max_q, max_k, **kwargs)


def attend(q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float) -> torch.Tensor:
    """Attention within each sequence of the flattened (T, H, D) tokens: the kernel where it runs, else the
    reference path (said once on CUDA)."""
    problem = kernel_problem(q.device, q.dtype, q.shape[-1])
    if problem is None:
        return _flash(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale)
    if q.device.type == "cuda":
        say_once(f"attn_implementation='varlen' runs its reference path (per-text attention, same vectors, slower): "
                  f"{problem}. Fast: {FAST}.")
    return _reference(q, k, v, cu_q, cu_k, causal, scale)


def _refusal(module, dropout: float, softcap, sliding_window, longest: int) -> str | None:
    if dropout:
        return (
            f"the model's config sets attention_dropout={dropout} (its config.json, or SimCSE's simcse_dropout, which "
            "sets it), and the varlen kernel has no dropout; set config.attention_dropout = 0.0, run the forward in "
            "eval mode, or use attn_implementation='sdpa', which applies it"
        )
    if softcap:
        return config_problem(module.config) or f"attention soft-capping {softcap}"
    if sliding_window is not None and longest > sliding_window:
        return (
            f"sliding-window attention (window {sliding_window}) over a sequence of {longest} tokens: the varlen "
            "backend attends over whole sequences; keep texts within the window or use attn_implementation='sdpa'"
        )
    return None


class Unpadded(NamedTuple):
    """Padded rows' real tokens as sequences: what every layer of one forward needs, derived once."""

    keep: torch.Tensor  # indices of the real tokens among the rows' flattened positions
    cu_seq_lens: torch.Tensor  # int32 offsets of each row's real tokens among the kept ones (rows + 1)
    max_length: int  # the longest row's real tokens


def unpadded(mask: torch.Tensor) -> Unpadded | None:
    """A 2D padding mask as sequences (None when nothing is padded), with one host read: the rows' lengths, which
    give the longest (the kernel takes it as a Python int) and the count of real tokens (so the indices come
    from ``nonzero_static``, which does not wait for the device)."""
    real = mask.bool()
    lengths = real.sum(-1, dtype=torch.int32)
    counts = lengths.tolist()
    if min(counts, default=real.shape[1]) == real.shape[1]:
        return None
    keep = torch.nonzero_static(real.reshape(-1), size=sum(counts)).squeeze(1)
    return Unpadded(keep, torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0)), max(counts))


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Unpadded | torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | None = None,
    max_length_k: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: (B, H, L, D) query/key/value in, (B, L, H, D) out; the mask is
    ``varlen_mask``'s (or a 2D padding mask, unpadded here), the offsets those of packed rows."""
    rows, heads, length, dim = query.shape
    q = query.transpose(1, 2).reshape(rows * length, heads, dim)
    k = key.transpose(1, 2).reshape(rows * length, key.shape[1], dim)
    v = value.transpose(1, 2).reshape(rows * length, value.shape[1], dim)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    scale = scaling if scaling is not None else dim**-0.5
    keep = None
    if isinstance(attention_mask, torch.Tensor):  # a 2D mask that did not come through ``varlen_mask``
        if attention_mask.dim() != 2:
            raise ValueError(
                f"attn_implementation='varlen' takes a 2D padding mask or sequence offsets, not a "
                f"{attention_mask.dim()}D mask (it cannot honour an arbitrary mask); use 'sdpa' for custom masks."
            )
        attention_mask = unpadded(attention_mask)
    if cu_seq_lens_q is not None:
        cu_q, cu_k = cu_seq_lens_q, cu_seq_lens_k if cu_seq_lens_k is not None else cu_seq_lens_q
        max_q, max_k = max_length_q, max_length_k if max_length_k is not None else max_length_q
    elif attention_mask is not None:
        keep, cu_q, max_q = attention_mask
        cu_k, max_k = cu_q, max_q
        q, k, v = q.index_select(0, keep), k.index_select(0, keep), v.index_select(0, keep)
    else:
        cu_q = cu_k = torch.arange(0, rows * length + 1, length, dtype=torch.int32, device=q.device)
        max_q = max_k = length
    problem = _refusal(module, dropout, softcap, sliding_window, max(max_q, max_k))
    if problem:
        raise ValueError(f"attn_implementation='varlen' cannot run this forward: {problem}.")
    out = attend(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale)
    if keep is not None:  # padding positions get zeros: never pooled, and they attend to nothing
        out = torch.zeros((rows * length, heads, dim), dtype=out.dtype, device=out.device).index_copy_(0, keep, out)
    return out.reshape(rows, length, heads, dim), None


def varlen_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                mask_function: Callable | None = None, attention_mask: torch.Tensor | None = None, **kwargs):
    """transformers' mask-function contract, called once per forward: the 2D padding mask as ``Unpadded`` (None
    when nothing is padded), never a dense mask; packed rows pass no mask (their offsets say where each text is)."""
    return None if attention_mask is None else unpadded(attention_mask[:, -kv_length:])


AttentionInterface.register(NAME, varlen_attention_forward)
AttentionMaskInterface.register(NAME, varlen_mask)


# ------------------------------------------------------------------------------------------- sdpa models
def dispatch_problem(model: torch.nn.Module) -> str | None:
    """Why packed rows of a model loaded with ``sdpa`` do not run on the varlen kernel; None when they do.

    They do where the kernel runs for the model's dtype and device and the forward is inference (eval mode, no
    gradient): a training step keeps the model's own attention throughout, so that GradCache's two forwards of a
    chunk and activation checkpointing's recomputation run the same kernel as the first forward.
    """
    config = model.config
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return f"the model's attention is {getattr(config, '_attn_implementation', None)!r}, not 'sdpa'"
    weight = model.get_input_embeddings().weight
    problem = kernel_problem(weight.device, weight.dtype, head_dim(config)) or config_problem(config)
    if problem is None and (model.training or torch.is_grad_enabled()):
        problem = "a training forward keeps the model's own attention"
    return problem


@contextlib.contextmanager
def dispatched(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, ``model``'s attention is varlen (its config names it; every layer reads it per forward)."""
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = before
