"""GradCache without waiting for the device: at most 2 host synchronisations per chunk in one real step
(``EncoderTrainer.training_step``), counted on the CPU by ``host_syncs.HostSyncs`` (what it counts, and why each
waits on CUDA, is in its docstring), and the chunk-by-chunk packed layout that lets the step cut packed columns
without reading them back."""

from __future__ import annotations

import pytest
import torch
from test_grad_cache import PACK_LENGTH, built
from test_training_trainer import PAIRS, Custom, make_config

from diffusion_embedder import packed_chunks, packing
from diffusion_embedder.data import ContrastiveCollator
from diffusion_embedder.host_syncs import HostSyncs
from diffusion_embedder.training.grad_cache import split_columns, split_features
from diffusion_embedder.training.supervised import build_trainer
from diffusion_embedder.training.trainer import text_columns

ROWS = 6  # triples per step


def step_syncs(trainer, inputs, chunk: int | None) -> HostSyncs:
    trainer.grad_cache_chunk_size = chunk
    trainer.training_step(trainer.model, inputs)  # warm: lazy set-up is not the step's
    trainer.model.zero_grad()
    with HostSyncs() as syncs:
        trainer.training_step(trainer.model, inputs)
    trainer.model.zero_grad()
    return syncs


@pytest.mark.parametrize("chunk", [2])
@pytest.mark.parametrize("layout", ["padded", "packed", "packed by chunk"])
def test_grad_cache_step_waits_at_most_twice_per_chunk(tmp_path, layout, chunk):
    trainer = built(tmp_path, lora_dropout=0.1)
    pack_length = None if layout == "padded" else PACK_LENGTH
    collator = ContrastiveCollator(trainer.model, num_negatives=1, pack_length=pack_length,
                                   chunk_size=chunk if layout == "packed by chunk" else None)  # fmt: skip
    inputs = trainer._prepare_inputs(collator([trainer.train_dataset[i] for i in range(ROWS)]))
    columns = text_columns(inputs)[0]
    chunks = sum(-(-c["attention_mask"].shape[0] // chunk) for c in columns)
    syncs = step_syncs(trainer, inputs, chunk)
    assert syncs.count <= 2 * chunks, dict(syncs.sites)
    if layout == "packed by chunk":  # cut by shape: the NaN check is the step's only wait
        assert syncs.count == 1, dict(syncs.sites)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_the_direct_step_of_a_packed_or_padded_batch_waits_once(tmp_path, layout):
    """The direct step's one wait is the NaN check, padded or packed: a padded batch's key-padding mask is passed
    as it is (transformers' own mask building read each column's mask: 3 more waits a step)."""
    trainer = built(tmp_path, lora_dropout=0.1)
    collator = ContrastiveCollator(trainer.model, num_negatives=1, pack_length=None if layout == "padded" else 128)
    inputs = trainer._prepare_inputs(collator([trainer.train_dataset[i] for i in range(ROWS)]))
    sites = step_syncs(trainer, inputs, None).sites
    assert sum(sites.values()) == 1 and next(iter(sites)).startswith("trainer.py"), dict(sites)


def test_host_syncs_counts_each_kind_of_wait():
    x = torch.arange(6.0)
    cases = {
        "item": lambda: x.sum().item(),
        "bool": lambda: bool(x.sum() > 0),
        "int": lambda: int(x[0]),
        "tolist": lambda: x.tolist(),
        "cpu": lambda: x.cpu(),
        "to cpu": lambda: x.to("cpu"),
        "numpy": lambda: x.numpy(),
        "nonzero": lambda: x.nonzero(),
        "masked_select": lambda: x.masked_select(x > 2),
        "boolean index": lambda: x[x > 2],
        "boolean index_put": lambda: x.clone().index_put_((x > 2,), torch.tensor(0.0, device=x.device)),
        "equal": lambda: torch.equal(x, x),
        "unique": lambda: torch.unique(x),
        "repeat_interleave": lambda: torch.repeat_interleave(torch.tensor([1, 2], device=x.device)),
        "host-made tensor to the device": lambda: torch.zeros(3).to(x.device),
        "read back and copied again": lambda: x.cpu().to(x.device),  # two waits
    }
    counts = {}
    for name, case in cases.items():
        with HostSyncs() as syncs:
            case()
        counts[name] = syncs.count
    assert counts == {name: 2 if name == "read back and copied again" else 1 for name in cases}
    quiet = {  # device work, host work on host tensors, and non-blocking copies do not wait
        "device ops": lambda: (x * 2).softmax(0).argmax(),
        "host tensor read": lambda: torch.zeros(3).tolist(),
        "non-blocking copy": lambda: torch.zeros(3).to(x.device, non_blocking=True),
        "index by integers": lambda: x[torch.arange(2, device=x.device)],
        "dtype only": lambda: torch.zeros(3).to(torch.float64),
    }
    for name, case in quiet.items():
        with HostSyncs() as syncs:
            case()
        assert syncs.count == 0, (name, dict(syncs.sites))


# ---------------------------------------------------------------- the chunk-by-chunk packed layout
SEQUENCES = [([11, 12, 13], 2), ([21], 1), ([31, 32], 0), ([41, 42, 43, 44], 4), ([51], 1)]


def test_pack_chunks_cuts_by_shape_into_each_chunks_own_packing():
    chunks = [packing.pack(SEQUENCES[i : i + 2], capacity=4, pad_token_id=0) for i in range(0, 5, 2)]
    column = packed_chunks.pack_chunks(chunks)
    assert column[packed_chunks.CHUNKS_KEY].tolist() == [[True, True], [True, True], [True, False]]
    assert column["input_ids"].shape == (3 * 2, 4)  # chunk 2 needs two rows of 4: every chunk gets two
    assert packing.unpack_sequences(column) == SEQUENCES
    cut = packed_chunks.split_packed(column, 2)
    assert [packing.unpack_sequences(c) for c in cut] == [SEQUENCES[0:2], SEQUENCES[2:4], SEQUENCES[4:]]
    for mine, own in zip(cut, chunks, strict=True):  # the chunk's own rows, positions and spans, then padding
        rows, width = own["input_ids"].shape
        assert torch.equal(mine["input_ids"][:rows, :width], own["input_ids"])
        assert torch.equal(mine["position_ids"][:rows, :width], own["position_ids"])
        assert not mine["input_ids"][rows:].any() and not mine["position_ids"][rows:].any()
        assert torch.equal(mine["embed_mask"][:, -own["embed_mask"].shape[1] :], own["embed_mask"])
    other = packed_chunks.split_packed(column, 3)  # another chunk size: packed again, by the host
    assert [packing.unpack_sequences(c) for c in other] == [SEQUENCES[0:3], SEQUENCES[3:]]


def test_pack_leaves_out_segment_ids_only_for_one_whole_text_per_row():
    whole = packing.pack([([1, 2], 2), ([3, 4], 2)], capacity=2, pad_token_id=0)
    assert "segment_ids" not in whole and torch.equal(packed_chunks.segments_of(whole), torch.tensor([[0, 0], [1, 1]]))
    assert "segment_ids" in packing.pack([([1, 2], 2), ([3], 1)], capacity=2, pad_token_id=0)  # padding
    assert "segment_ids" in packing.pack([([1], 1), ([3], 1)], capacity=2, pad_token_id=0)  # two texts a row


@pytest.mark.parametrize("layout", ["padded", "packed", "packed by chunk"])
def test_chunks_embed_as_the_whole_column(tmp_path, layout):
    """Each chunk's embeddings are the whole column's rows (float64: a wrong row, span or position would show)."""
    trainer = built(tmp_path, lora_dropout=0.0)
    encoder = trainer.model.double().eval()
    collator = ContrastiveCollator(encoder, num_negatives=1, pack_length=None if layout == "padded" else PACK_LENGTH,
                                   chunk_size=2 if layout == "packed by chunk" else None)  # fmt: skip
    columns = text_columns(collator([trainer.train_dataset[i] for i in range(5)]))[0]
    padded_reference = text_columns(ContrastiveCollator(encoder, 1)([trainer.train_dataset[i] for i in range(5)]))[0]
    with torch.no_grad():
        for column, reference, chunks in zip(columns, padded_reference, split_columns(columns, 2, rows=True),
                                             strict=True):  # fmt: skip
            assert encoder(column).dtype == torch.float64
            whole = encoder(reference)
            torch.testing.assert_close(torch.cat([encoder(c) for c in chunks]), whole, atol=1e-12, rtol=1e-12)
            torch.testing.assert_close(encoder(column), whole, atol=1e-12, rtol=1e-12)


def test_grad_cache_chunk_size_reaches_the_collator(tmp_path):
    """The config field packs the columns by chunk (and the split then cuts them as packed)."""
    cfg = make_config(tmp_path, grad_cache_chunk_size=2, pack_length=PACK_LENGTH)
    trainer = build_trainer(cfg, (Custom(PAIRS), 1))
    assert trainer.data_collator.chunk_size == 2 == trainer.grad_cache_chunk_size
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(3)])
    assert batch["query"][packed_chunks.CHUNKS_KEY].shape == (2, 2)
    assert len(split_features(batch["query"], 2)) == 2
    plain = make_config(tmp_path / "plain", pack_length=PACK_LENGTH)
    unchunked = build_trainer(plain, (Custom(PAIRS), 1)).data_collator
    assert unchunked.chunk_size is None
    assert packed_chunks.CHUNKS_KEY not in unchunked([trainer.train_dataset[0]])["query"]
