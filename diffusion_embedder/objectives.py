"""Pretraining objectives and their maskers: MNTP (LLM2Vec), masked diffusion (Dream / LLaDA), causal LM.

Each loss is a pure function of the logits, the original ids and which positions were masked, so it
can be checked against a hand computation. Each masker returns the corrupted ids and the masked
positions; padding (``attention_mask == 0``) is never masked, and neither is position 0 where the
objective predicts position i from the logits at i - 1 (no logits precede position 0).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

#: LLM2Vec's run_mntp.py collators: HF's 80/10/10 one, or every masked token replaced by the mask token.
MNTP_COLLATORS = ("default", "all_mask")
#: LLM2Vec's ``mask_token_type`` for tokenizers without a mask token: "_", EOS, or a new "<mask>" token.
MASK_TOKEN_TYPES = ("blank", "eos", "mask")


def _check_no_first(masked: torch.Tensor, name: str) -> None:
    if masked[:, 0].any():
        raise ValueError(f"{name}: position 0 is masked, but no logits precede it (the masker must never mask it).")


def _real(masked: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Masked positions that are real tokens: padding never counts."""
    masked = masked.bool()
    return masked if attention_mask is None else masked & attention_mask.bool()


def _zero(logits: torch.Tensor) -> torch.Tensor:
    """A zero loss that keeps the graph (a batch with nothing masked: no NaN, no update)."""
    return logits.sum() * 0.0


@dataclass(frozen=True)
class Targets:
    """What a loss reads: the logits at ``positions`` (bool, B x L) predict ``ids``; the loss is the mean
    cross-entropy, or, with ``divisors``, the sum of each cross-entropy over its divisor, over ``denominator``.
    The LM stage's fused head (``fused_head``) computes the head at these positions only."""

    positions: torch.Tensor
    ids: torch.Tensor
    divisors: torch.Tensor | None = None
    denominator: torch.Tensor | None = None


def _before(target: torch.Tensor) -> torch.Tensor:
    """``target`` over positions 1.. as the positions 0.. of the logits that predict them."""
    return F.pad(target, (0, 1), value=False)


def reduce_targets(token_loss: torch.Tensor, targets: Targets) -> torch.Tensor:
    """Per-token cross-entropies (in ``targets.ids`` order) as the objective's loss."""
    if targets.divisors is None:
        return token_loss.mean()
    return (token_loss / targets.divisors).sum() / targets.denominator.clamp_min(1).to(token_loss.device)


def targets_loss(logit_rows: torch.Tensor, targets: Targets) -> torch.Tensor:
    """The objective's loss from the logits at ``targets.positions`` (n x vocab)."""
    if targets.divisors is None:
        return F.cross_entropy(logit_rows.float(), targets.ids)
    return reduce_targets(F.cross_entropy(logit_rows.float(), targets.ids, reduction="none"), targets)


def mntp_targets(input_ids, masked, attention_mask=None) -> Targets | None:
    """MNTP's: the logits at i - 1 predict the original token at each masked real position i >= 1."""
    _check_no_first(masked, "mntp_loss")
    target = _real(masked, attention_mask)[:, 1:]
    return Targets(_before(target), input_ids[:, 1:][target]) if target.any() else None


def mntp_loss(
    logits: torch.Tensor, input_ids: torch.Tensor, masked: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Masked next-token prediction: the logits at i - 1 predict the original token at masked position i.

    Mean cross-entropy over the masked real positions (i >= 1), as LLM2Vec gets it from a causal-LM
    head with labels -100 everywhere but the masked positions.
    """
    targets = mntp_targets(input_ids, masked, attention_mask)
    return _zero(logits) if targets is None else targets_loss(logits[targets.positions], targets)


def mdm_loss(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    masked: torch.Tensor,
    t: torch.Tensor,
    shift: bool,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Masked diffusion: sum over masked positions of cross-entropy / t[b], divided by B x L.

    ``t`` (B,) is each sequence's mask ratio. ``shift=True`` is Dream's alignment (position i from the
    logits at i - 1; position 0 is never masked), ``shift=False`` LLaDA's (position i from the logits
    at i). With padding, the divisor is the number of real tokens (B x L when there is none).
    """
    targets = mdm_targets(input_ids, masked, t, shift, attention_mask)
    return _zero(logits) if targets is None else targets_loss(logits[targets.positions], targets)


def mdm_targets(input_ids, masked, t, shift: bool, attention_mask=None) -> Targets | None:
    """Masked diffusion's: each masked real token, weighted 1 / t of its sequence, over the real tokens."""
    real = _real(masked, attention_mask)
    denominator = attention_mask.sum() if attention_mask is not None else torch.tensor(masked.numel())
    if shift:
        _check_no_first(masked, "mdm_loss(shift=True)")
        real, input_ids = real[:, 1:], input_ids[:, 1:]
    if not real.any():
        return None
    rows = torch.nonzero(real, as_tuple=True)[0]
    return Targets(_before(real) if shift else real, input_ids[real], t[rows].float(), denominator)


def clm_loss(logits: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The causal LM loss: the logits at i - 1 predict token i, mean over real tokens with a real predecessor."""
    target = torch.ones_like(input_ids[:, 1:], dtype=torch.bool)
    if attention_mask is not None:
        real = attention_mask.bool()
        target = real[:, 1:] & real[:, :-1]
    if not target.any():
        return _zero(logits)
    return F.cross_entropy(logits[:, :-1][target].float(), input_ids[:, 1:][target])


def clm_targets(input_ids, attention_mask=None) -> Targets | None:
    """The causal LM's: every real token with a real predecessor, from the logits before it."""
    target = torch.ones_like(input_ids[:, 1:], dtype=torch.bool)
    if attention_mask is not None:
        real = attention_mask.bool()
        target = real[:, 1:] & real[:, :-1]
    return Targets(_before(target), input_ids[:, 1:][target]) if target.any() else None


# ---------------------------------------------------------------------------------------------- maskers
def maskable(
    input_ids: torch.Tensor, attention_mask: torch.Tensor | None, never_first: bool, special_ids: tuple[int, ...] = ()
) -> torch.Tensor:
    """Positions a masker may choose: real tokens, not special, not position 0 when ``never_first``."""
    allowed = torch.ones_like(input_ids, dtype=torch.bool)
    if attention_mask is not None:
        allowed &= attention_mask.bool()
    for token in special_ids:
        allowed &= input_ids != token
    if never_first:
        allowed[:, 0] = False
    return allowed


def _rand(shape: tuple[int, ...], like: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Uniform draws on ``like``'s device (the global RNG unless a generator is given)."""
    return torch.rand(shape, generator=generator, device=like.device)


def mask_token_for(tokenizer, mask_token_type: str = "blank") -> int:
    """LLM2Vec's choice: the tokenizer's own mask token, else "_" (blank), EOS or an added "<mask>"."""
    if tokenizer.mask_token is not None:
        return tokenizer.mask_token_id
    if mask_token_type not in MASK_TOKEN_TYPES:
        raise ValueError(f"mask_token_type {mask_token_type!r} is not one of {MASK_TOKEN_TYPES}")
    if mask_token_type == "eos":
        return tokenizer.eos_token_id
    if mask_token_type == "mask":
        raise ValueError(
            "mask_token_type 'mask' adds a token and resizes the embeddings; use 'blank' (LLM2Vec's default) or "
            "a tokenizer with a mask token."
        )
    token_id = tokenizer.convert_tokens_to_ids("_")
    if token_id is None or token_id == tokenizer.unk_token_id:
        raise ValueError("mask_token_type 'blank': the tokenizer has no '_' token; use 'eos'.")
    return token_id


@dataclass
class MaskedBatch:
    """A corrupted batch: what the model reads, what it must predict, and where."""

    input_ids: torch.Tensor  # corrupted ids fed to the model
    labels: torch.Tensor  # the original ids
    masked: torch.Tensor  # bool (B, L): positions the loss counts
    attention_mask: torch.Tensor
    t: torch.Tensor | None = None  # (B,) mask ratios (masked diffusion)


class BaseMasker:
    """``masker(input_ids, attention_mask=None, generator=None) -> MaskedBatch``; without an attention mask
    every token is real. Subclasses choose and corrupt the positions in ``corrupt``."""

    def __call__(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> MaskedBatch:
        attention_mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        return self.corrupt(input_ids, attention_mask, generator)

    def corrupt(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, generator: torch.Generator | None
    ) -> MaskedBatch:
        raise NotImplementedError


@dataclass
class MntpMasker(BaseMasker):
    """LLM2Vec's MNTP masking: each maskable token chosen with ``mlm_probability``; with the ``default``
    collator 80% of the chosen become the mask token, 10% a random token and 10% stay; with ``all_mask``
    all become the mask token. Position 0 is never chosen (MNTP predicts i from i - 1)."""

    mask_token_id: int
    vocab_size: int
    mlm_probability: float = 0.2
    collator: str = "default"
    special_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.collator not in MNTP_COLLATORS:
            raise ValueError(f"MNTP collator {self.collator!r} is not one of {MNTP_COLLATORS}")
        if not 0 < self.mlm_probability <= 1:
            raise ValueError(f"mlm_probability must be in (0, 1], got {self.mlm_probability}")

    def corrupt(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, generator: torch.Generator | None
    ) -> MaskedBatch:
        allowed = maskable(input_ids, attention_mask, never_first=True, special_ids=self.special_ids)
        masked = (_rand(input_ids.shape, input_ids, generator) < self.mlm_probability) & allowed
        corrupted = input_ids.clone()
        if self.collator == "all_mask":
            corrupted[masked] = self.mask_token_id
        else:
            draw = _rand(input_ids.shape, input_ids, generator)
            to_mask = masked & (draw < 0.8)
            to_random = masked & (draw >= 0.8) & (draw < 0.9)
            corrupted[to_mask] = self.mask_token_id
            random_ids = torch.randint(self.vocab_size, input_ids.shape, generator=generator, device=input_ids.device)
            corrupted[to_random] = random_ids[to_random]
        return MaskedBatch(corrupted, input_ids, masked, attention_mask)


@dataclass
class MdmMasker(BaseMasker):
    """Masked-diffusion forward process: t ~ U(eps, 1) per sequence, each maskable token masked with
    probability t (LLaDA's ``(1 - eps) * u + eps``). ``shift=True`` keeps position 0 unmasked (Dream)."""

    mask_token_id: int
    eps: float = 1e-3
    shift: bool = True
    special_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if not 0 < self.eps < 1:
            raise ValueError(f"mdm eps must be in (0, 1), got {self.eps}")

    def corrupt(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, generator: torch.Generator | None
    ) -> MaskedBatch:
        t = (1 - self.eps) * _rand((input_ids.shape[0],), input_ids, generator) + self.eps
        allowed = maskable(input_ids, attention_mask, never_first=self.shift, special_ids=self.special_ids)
        masked = (_rand(input_ids.shape, input_ids, generator) < t[:, None]) & allowed
        corrupted = torch.where(masked, torch.full_like(input_ids, self.mask_token_id), input_ids)
        return MaskedBatch(corrupted, input_ids, masked, attention_mask, t)


@dataclass
class ClmMasker(BaseMasker):
    """The causal LM reads the text as is."""

    def corrupt(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, generator: torch.Generator | None
    ) -> MaskedBatch:
        return MaskedBatch(input_ids, input_ids, attention_mask.bool(), attention_mask)


@dataclass(frozen=True)
class ObjectiveOptions:
    """The settings an objective's masker and loss read (from the stage config)."""

    mask_token_id: int
    vocab_size: int
    mlm_probability: float = 0.2
    mntp_collator: str = "default"
    mdm_eps: float = 1e-3
    mdm_shift: bool = True
    special_ids: tuple[int, ...] = ()


Masker = Callable[..., MaskedBatch]


@dataclass(frozen=True)
class Objective:
    """One pretraining objective: its attention, its masker and its loss on a masked batch."""

    bidirectional: bool
    masker: Callable[[ObjectiveOptions], Masker]
    loss: Callable[[torch.Tensor, MaskedBatch, ObjectiveOptions], torch.Tensor]
    targets: Callable[[MaskedBatch, ObjectiveOptions], Targets | None]  # what ``loss`` reads (the fused head's)


OBJECTIVES: dict[str, Objective] = {
    "mntp": Objective(
        bidirectional=True,
        masker=lambda o: MntpMasker(o.mask_token_id, o.vocab_size, o.mlm_probability, o.mntp_collator, o.special_ids),
        loss=lambda logits, b, o: mntp_loss(logits, b.labels, b.masked, b.attention_mask),
        targets=lambda b, o: mntp_targets(b.labels, b.masked, b.attention_mask),
    ),
    "mdm": Objective(
        bidirectional=True,
        masker=lambda o: MdmMasker(o.mask_token_id, o.mdm_eps, o.mdm_shift, o.special_ids),
        loss=lambda logits, b, o: mdm_loss(logits, b.labels, b.masked, b.t, o.mdm_shift, b.attention_mask),
        targets=lambda b, o: mdm_targets(b.labels, b.masked, b.t, o.mdm_shift, b.attention_mask),
    ),
    "clm": Objective(
        bidirectional=False,
        masker=lambda o: ClmMasker(),
        loss=lambda logits, b, o: clm_loss(logits, b.labels, b.attention_mask),
        targets=lambda b, o: clm_targets(b.labels, b.attention_mask),
    ),
}
