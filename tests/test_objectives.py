"""Objectives against hand computations; maskers' rates and the positions they must never touch."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from numerics import HAND_EPS, assert_close_normwise

from diffusion_embedder.objectives import (
    OBJECTIVES,
    ClmMasker,
    MdmMasker,
    MntpMasker,
    ObjectiveOptions,
    clm_loss,
    mask_token_for,
    mdm_loss,
    mntp_loss,
)

FIXTURES = Path(__file__).parent / "fixtures"

# B=2, L=4, V=3; every logit row distinct so a shift by one position changes every term.
LOGITS = torch.tensor(
    [
        [[2.0, 0.0, -1.0], [0.5, 1.5, 0.0], [0.0, 0.3, 2.2], [1.0, -1.0, 0.4]],
        [[-0.5, 0.7, 1.1], [1.9, 0.2, -0.3], [0.0, 0.0, 0.9], [0.6, 2.4, -1.2]],
    ]
)
IDS = torch.tensor([[0, 2, 1, 0], [1, 0, 2, 1]])


def ce(b: int, pos: int, target: int) -> float:
    """-log softmax(LOGITS[b, pos])[target], by hand."""
    row = LOGITS[b, pos].tolist()
    return -(row[target] - math.log(sum(math.exp(x) for x in row)))


def mask(*positions: tuple[int, int]) -> torch.Tensor:
    m = torch.zeros(2, 4, dtype=torch.bool)
    for b, i in positions:
        m[b, i] = True
    return m


def test_mntp_loss_predicts_each_masked_token_from_the_previous_position():
    masked = mask((0, 2), (1, 1), (1, 3))
    expected = (ce(0, 1, IDS[0, 2]) + ce(1, 0, IDS[1, 1]) + ce(1, 2, IDS[1, 3])) / 3
    assert_close_normwise(mntp_loss(LOGITS, IDS, masked), expected, eps_multiple=HAND_EPS)


def test_mntp_loss_ignores_padding_and_refuses_a_masked_first_position():
    masked = mask((0, 2), (1, 1), (1, 3))
    attention = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])  # (1, 3) is padding: never counts
    expected = (ce(0, 1, IDS[0, 2]) + ce(1, 0, IDS[1, 1])) / 2
    assert_close_normwise(mntp_loss(LOGITS, IDS, masked, attention), expected, eps_multiple=HAND_EPS)
    with pytest.raises(ValueError, match="position 0"):
        mntp_loss(LOGITS, IDS, mask((0, 0), (1, 2)))
    empty = mntp_loss(LOGITS.clone().requires_grad_(), IDS, mask())
    assert empty.item() == 0.0 and empty.requires_grad


def test_mdm_loss_shifted_is_dreams_alignment():
    masked = mask((0, 1), (0, 3), (1, 2))
    t = torch.tensor([0.5, 0.25])
    expected = (ce(0, 0, IDS[0, 1]) / 0.5 + ce(0, 2, IDS[0, 3]) / 0.5 + ce(1, 1, IDS[1, 2]) / 0.25) / (2 * 4)
    assert_close_normwise(mdm_loss(LOGITS, IDS, masked, t, shift=True), expected, eps_multiple=HAND_EPS)
    with pytest.raises(ValueError, match="position 0"):
        mdm_loss(LOGITS, IDS, mask((1, 0)), t, shift=True)


def test_mdm_loss_unshifted_is_lladas_alignment():
    masked = mask((0, 0), (0, 3), (1, 2))
    t = torch.tensor([0.5, 0.25])
    expected = (ce(0, 0, IDS[0, 0]) / 0.5 + ce(0, 3, IDS[0, 3]) / 0.5 + ce(1, 2, IDS[1, 2]) / 0.25) / (2 * 4)
    assert_close_normwise(mdm_loss(LOGITS, IDS, masked, t, shift=False), expected, eps_multiple=HAND_EPS)


def test_mdm_loss_with_padding_divides_by_real_tokens_and_skips_masked_padding():
    masked = mask((0, 1), (1, 0), (1, 2))
    attention = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])  # left padding in row 1: (1, 0) never counts
    t = torch.tensor([0.8, 0.4])
    expected = (ce(0, 1, IDS[0, 1]) / 0.8 + ce(1, 2, IDS[1, 2]) / 0.4) / 7
    assert_close_normwise(
        mdm_loss(LOGITS, IDS, masked, t, shift=False, attention_mask=attention), expected, eps_multiple=HAND_EPS
    )


def test_clm_loss_by_hand_with_and_without_padding():
    full = sum(ce(b, i - 1, IDS[b, i]) for b in range(2) for i in range(1, 4)) / 6
    assert_close_normwise(clm_loss(LOGITS, IDS), full, eps_multiple=HAND_EPS)
    attention = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])  # row 1: only token 3 has a real predecessor
    padded = (sum(ce(0, i - 1, IDS[0, i]) for i in range(1, 4)) + ce(1, 2, IDS[1, 3])) / 4
    assert_close_normwise(clm_loss(LOGITS, IDS, attention), padded, eps_multiple=HAND_EPS)


def test_objective_registry_routes_options_to_masker_and_loss():
    batch = MdmMasker(mask_token_id=2, eps=0.5, shift=False)(IDS, generator=torch.Generator().manual_seed(0))
    options = ObjectiveOptions(mask_token_id=2, vocab_size=3, mdm_shift=False)
    expected = mdm_loss(LOGITS, IDS, batch.masked, batch.t, False, batch.attention_mask)
    assert OBJECTIVES["mdm"].loss(LOGITS, batch, options) == expected
    assert OBJECTIVES["mdm"].masker(options).shift is False
    assert OBJECTIVES["mntp"].masker(ObjectiveOptions(7, 50, mntp_collator="all_mask")).collator == "all_mask"
    assert [name for name, o in OBJECTIVES.items() if not o.bidirectional] == ["clm"]


# ---------------------------------------------------------------------------------------------- maskers
def padded_batch(rows: int = 64, length: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(10, 1000, (rows, length), generator=generator)
    attention = torch.ones_like(ids)
    for r in range(rows):  # left padding of varying width, pad id 3
        width = r % 7 * 10
        attention[r, :width] = 0
        ids[r, :width] = 3
    return ids, attention


def test_mntp_default_collator_rates_and_untouchable_positions():
    ids, attention = padded_batch()
    ids[:, 5] = 1  # a special token (e.g. EOS) inside the text
    masker = MntpMasker(mask_token_id=4, vocab_size=1000, mlm_probability=0.2, special_ids=(1,))
    out = masker(ids, attention, generator=torch.Generator().manual_seed(0))
    allowed = attention.bool() & (ids != 1)
    allowed[:, 0] = False
    assert not out.masked[~allowed].any()  # padding, position 0 and special tokens never masked
    assert (out.masked.sum() / allowed.sum()).item() == pytest.approx(0.2, abs=0.01)
    chosen = out.input_ids[out.masked]
    original = ids[out.masked]
    to_mask = (chosen == 4).float().mean().item()
    kept = (chosen == original).float().mean().item()
    assert to_mask == pytest.approx(0.8, abs=0.015)
    assert kept == pytest.approx(0.1, abs=0.01)  # 10% unchanged (+ random draws equal to the original: 0.1%)
    assert torch.equal(out.input_ids[~out.masked], ids[~out.masked]) and torch.equal(out.labels, ids)


def test_mntp_all_mask_collator_masks_every_chosen_token():
    ids, attention = padded_batch()
    out = MntpMasker(4, 1000, mlm_probability=0.8, collator="all_mask")(ids, attention)
    allowed = attention.bool().clone()
    allowed[:, 0] = False
    assert (out.input_ids[out.masked] == 4).all() and not out.masked[~allowed].any()
    assert (out.masked.sum() / allowed.sum()).item() == pytest.approx(0.8, abs=0.01)
    with pytest.raises(ValueError, match="collator"):
        MntpMasker(4, 1000, collator="bert")


def test_mdm_masker_rate_follows_each_sequences_t():
    ids = torch.randint(10, 1000, (32, 4096), generator=torch.Generator().manual_seed(2))
    attention = torch.ones_like(ids)
    attention[::2, :1000] = 0  # padding in every other row
    out = MdmMasker(mask_token_id=4, eps=0.05, shift=True)(ids, attention, generator=torch.Generator().manual_seed(3))
    assert out.t.shape == (32,) and (out.t >= 0.05).all() and (out.t <= 1).all()
    assert out.t.std() > 0.1  # drawn per sequence
    assert not out.masked[:, 0].any() and not out.masked[attention == 0].any()
    rate = out.masked.sum(1) / (attention.sum(1) - 1)
    torch.testing.assert_close(rate, out.t, atol=0.03, rtol=0)
    assert (out.input_ids[out.masked] == 4).all() and torch.equal(out.input_ids[~out.masked], ids[~out.masked])
    unshifted = MdmMasker(4, eps=0.99, shift=False)(ids, generator=torch.Generator().manual_seed(4))
    assert unshifted.masked[:, 0].float().mean() > 0.9  # LLaDA's alignment may mask position 0


def test_clm_masker_changes_nothing():
    ids, attention = padded_batch(4, 16)
    out = ClmMasker()(ids, attention)
    assert torch.equal(out.input_ids, ids) and torch.equal(out.masked, attention.bool())


def test_mask_token_is_the_tokenizers_else_blank_as_llm2vec():
    from transformers import AutoTokenizer, Qwen2Tokenizer

    llama = AutoTokenizer.from_pretrained(FIXTURES / "llm2vec_parity" / "llama")
    assert llama.mask_token is None
    assert mask_token_for(llama) == llama.convert_tokens_to_ids("_") != llama.unk_token_id
    assert mask_token_for(llama, "eos") == llama.eos_token_id
    dream = Qwen2Tokenizer.from_pretrained(FIXTURES / "dream_reference")
    assert mask_token_for(dream) == dream.convert_tokens_to_ids("<|mask|>")
    with pytest.raises(ValueError, match="mask_token_type"):
        mask_token_for(llama, "star")
