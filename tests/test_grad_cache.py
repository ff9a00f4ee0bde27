"""GradCache tested for what makes it exact (CPU here; tests/test_gpu.py runs the same checks on CUDA).

(a) each chunk's second forward (with the graph) equals its first (without) bit for bit under dropout
(LoRA's, attention's), so the cached gradients belong to the embeddings the loss saw; (b) without
dropout the GradCache step equals the direct step (loss and every LoRA gradient); (c) with dropout its
gradients equal a direct step's taken chunk by chunk under the same RNG sequence (so the same masks),
with the graph kept, then one loss and one backward; (d) activation checkpointing keeps (a) and (c).
A whole-batch direct step with dropout is no reference: one draw over the batch is not the per-chunk
draws (on CUDA's counter-based generator not even in distribution of offsets).
"""

from __future__ import annotations

import pytest
import torch
from conftest import randomize_lora_b
from numerics import GRAD_EPS, assert_all_close_normwise, assert_close_normwise
from test_training_trainer import make_trainer
from test_training_trainer import step_grads as step
from torch import nn

from diffusion_embedder.data import ContrastiveCollator
from diffusion_embedder.training.grad_cache import RandState, cuda_devices, grad_cache_step, split_features
from diffusion_embedder.training.trainer import EncoderTrainer, assemble, text_columns

#: Dropout on the LoRA path, or on the backbone's attention probabilities (SimCSE's) alone.
DROPOUTS = {"lora": {"lora_dropout": 0.3}, "attention": {"lora_dropout": 0.0, "simcse_dropout": 0.3}}
PACK_LENGTH = 128  # several texts per packed row


def built(tmp_path, device: str = "cpu", **overrides) -> EncoderTrainer:
    """The tiny Llama encoder with a LoRA whose B matrices are non-zero (so the adapter, and its dropout, matter)."""
    trainer = make_trainer(tmp_path, use_cpu=device == "cpu", **overrides)
    torch.manual_seed(1)
    randomize_lora_b(trainer.model, 0.2)
    return trainer


def batch(trainer: EncoderTrainer, pack_length: int | None = None, rows: int = 6) -> dict:
    collator = ContrastiveCollator(trainer.model, num_negatives=1, pack_length=pack_length)
    return trainer._prepare_inputs(collator([trainer.train_dataset[i] for i in range(rows)]))


class Recorder(nn.Module):
    """The model, recording each forward's output and whether a graph was being built."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.outputs: list[tuple[bool, torch.Tensor]] = []

    def forward(self, features):
        out = self.inner(features)
        self.outputs.append((torch.is_grad_enabled(), out.detach().clone()))
        return out


def replayed_pairs(trainer: EncoderTrainer, inputs: dict, chunk: int, seed: int = 0) -> list[tuple]:
    """(first forward, second forward) of every chunk of one GradCache step, in step order."""
    model = trainer.model
    model.train()
    model.zero_grad()
    recorder = Recorder(model)
    columns, k = text_columns(inputs)
    torch.manual_seed(seed)
    grad_cache_step(recorder, columns, chunk, lambda reps: trainer.loss_fn(*assemble(reps, k)), torch.Tensor.backward)
    model.zero_grad()
    first = [out for graph, out in recorder.outputs if not graph]
    second = [out for graph, out in recorder.outputs if graph]
    assert len(first) == len(second) > 1 and recorder.outputs[len(first) - 1][0] is False
    return list(zip(first, second, strict=True))


def assert_replays_exactly(trainer: EncoderTrainer, inputs: dict, chunk: int) -> None:
    pairs = replayed_pairs(trainer, inputs, chunk)
    differ = [(i, (a - b).abs().max().item()) for i, (a, b) in enumerate(pairs) if not torch.equal(a, b)]
    assert not differ, f"second forwards differ from the first (chunk, max |diff|): {differ}"


def assert_dropout_is_live(trainer: EncoderTrainer, inputs: dict) -> None:
    """Two forwards of the same texts differ: without the replay, the check above would fail."""
    trainer.model.train()
    with torch.no_grad():
        a, b = (trainer.model(inputs["query"]) for _ in range(2))
    assert not torch.equal(a, b)


def chunked_direct(trainer: EncoderTrainer, inputs: dict, chunk: int, seed: int = 0) -> tuple:
    """The reference under dropout: every chunk forwarded once with its graph, in GradCache's order and
    from the same seed (so the same masks), then one loss and one backward."""
    model = trainer.model
    model.train()
    model.zero_grad()
    columns, k = text_columns(inputs)
    torch.manual_seed(seed)
    reps = [torch.cat([model(part) for part in split_features(column, chunk)]) for column in columns]
    loss = trainer.loss_fn(*assemble(reps, k))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    return loss.detach(), grads


def assert_same(a: tuple, b: tuple, eps_multiple: float = GRAD_EPS) -> None:
    assert_close_normwise(a[0], b[0], eps_multiple=eps_multiple, msg="loss")
    assert a[1].keys() == b[1].keys() and any("lora_A" in n for n in a[1])
    assert_all_close_normwise(a[1], b[1], eps_multiple=eps_multiple, msg="grad")


# ---------------------------------------------------------------- the checks, on any device
def check_replays(trainer: EncoderTrainer, pack_length: int | None) -> None:
    """(a) the second forward is the first, bit for bit."""
    inputs = batch(trainer, pack_length)
    assert_dropout_is_live(trainer, inputs)
    for chunk in (2, 4):
        assert_replays_exactly(trainer, inputs, chunk)


def check_equals_direct(trainer: EncoderTrainer, pack_length: int | None, eps_multiple: float = GRAD_EPS) -> None:
    """(b) without dropout: the direct step."""
    inputs = batch(trainer, pack_length)
    direct = step(trainer, inputs, None)
    for chunk in (1, 4):
        assert_same(step(trainer, inputs, chunk), direct, eps_multiple)


def check_same_masks(trainer: EncoderTrainer, pack_length: int | None, eps_multiple: float = GRAD_EPS) -> None:
    """(c) with dropout: a direct step taken chunk by chunk from the same seed."""
    inputs = batch(trainer, pack_length)
    reference = chunked_direct(trainer, inputs, 2, seed=3)
    other_masks = chunked_direct(trainer, inputs, 2, seed=4)
    assert (reference[0] - other_masks[0]).abs() > 1e-4  # the masks matter here
    assert_same(step(trainer, inputs, 2, seed=3), reference, eps_multiple)


def check_checkpointing(plain: EncoderTrainer, checkpointed: EncoderTrainer, eps_multiple: float = GRAD_EPS) -> None:
    """(d) non-reentrant checkpointing restores the RNG state it saw at the (replayed) forward when it
    recomputes, so GradCache over a checkpointed model still trains on the loss's own masks."""
    inputs = batch(plain)
    assert_replays_exactly(checkpointed, inputs, 2)
    assert_same(step(checkpointed, inputs, 2, seed=3), chunked_direct(plain, inputs, 2, seed=3), eps_multiple)


#: Both kinds of dropout at once, for (d).
BOTH_DROPOUTS = {"lora_dropout": 0.3, "simcse_dropout": 0.3}


@pytest.mark.parametrize("pack_length", [None, PACK_LENGTH], ids=["padded", "packed"])
@pytest.mark.parametrize("dropout", list(DROPOUTS))
def test_each_chunk_replays_its_first_forward_bit_for_bit(tmp_path, dropout, pack_length):
    check_replays(built(tmp_path, **DROPOUTS[dropout]), pack_length)


@pytest.mark.parametrize("pack_length", [None, PACK_LENGTH], ids=["padded", "packed"])
def test_without_dropout_grad_cache_equals_the_direct_step(tmp_path, pack_length):
    check_equals_direct(built(tmp_path, lora_dropout=0.0), pack_length)


@pytest.mark.parametrize("pack_length", [None, PACK_LENGTH], ids=["padded", "packed"])
@pytest.mark.parametrize("dropout", list(DROPOUTS))
def test_with_dropout_grad_cache_equals_a_direct_step_with_the_same_masks(tmp_path, dropout, pack_length):
    check_same_masks(built(tmp_path, **DROPOUTS[dropout]), pack_length)


def test_activation_checkpointing_keeps_the_replay_exact(tmp_path):
    plain = built(tmp_path / "plain", **BOTH_DROPOUTS)
    checkpointed = built(tmp_path / "checkpointed", gradient_checkpointing=True, **BOTH_DROPOUTS)
    backbone = checkpointed.model.model.base_model.model
    assert backbone.is_gradient_checkpointing and not plain.model.model.base_model.model.is_gradient_checkpointing
    check_checkpointing(plain, checkpointed)


# ---------------------------------------------------------------- RandState
def test_rand_state_replays_and_then_restores_the_generator():
    torch.manual_seed(5)
    state = RandState(cuda_devices(torch.nn.Linear(2, 2)))
    first = torch.rand(4)
    after = torch.get_rng_state()
    with state:
        assert torch.equal(torch.rand(4), first)
        torch.rand(100)
    assert torch.equal(torch.get_rng_state(), after)  # the replay does not move the run's generator


def test_cuda_devices_lists_the_models_and_the_inputs_devices_only():
    assert cuda_devices(torch.nn.Linear(2, 2), {"input_ids": torch.zeros(1)}) == []


def test_split_features_cuts_each_padded_chunk_to_its_own_width():
    mask = torch.tensor([[0, 0, 0, 1], [0, 0, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0]])
    features = {"input_ids": torch.arange(20).view(5, 4), "attention_mask": mask}
    widths = [chunk["attention_mask"].shape[1] for chunk in split_features(features, 2)]
    assert widths == [2, 4, 1]  # rows 0-1: two used columns; 2-3: all; row 4 alone has none: one column
    assert torch.equal(split_features(features, 2)[0]["input_ids"], torch.tensor([[2, 3], [6, 7]]))
