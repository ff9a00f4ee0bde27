"""Tokenization off the device's critical path: overlap, errors on either side, and unchanged vectors."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from conftest import LLAMA_FIXTURE, MIXED_TEXTS
from numerics import ORDER_EPS, assert_close_normwise

from diffusion_embedder import Encoder, inference
from diffusion_embedder.prefetch import Prefetcher

TEXTS = [f"{i} " + (t if isinstance(t, str) else t[1]) * (1 + i % 4) for i, t in enumerate(MIXED_TEXTS * 11)]


@pytest.fixture(scope="module")
def encoder() -> Encoder:
    return Encoder.from_pretrained(str(LLAMA_FIXTURE), torch_dtype=torch.float32)


def prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "encode-prefetch"]


def test_prefetcher_keeps_order_and_stops_when_the_consumer_does():
    produced = []

    def numbers():
        for i in range(1000):
            produced.append(i)
            yield i

    with Prefetcher(range(50), depth=3) as ahead:
        assert list(ahead) == list(range(50))
    with Prefetcher(numbers(), depth=2) as ahead:
        for i in ahead:
            if i == 5:
                break
    assert not prefetch_threads() and len(produced) < 20


def test_tokenizing_overlaps_the_forward(encoder, monkeypatch):
    """With a tokenizer and a forward that each wait, the wall time is near the larger cost, not the sum."""
    spent = {"tokenize": 0.0, "forward": 0.0}
    tokenize, forward = inference.tokenize_chunk, encoder.forward

    def slow_tokenize(tokenizer, config, readout, items, *args):
        start = time.perf_counter()
        time.sleep(0.012 * len(items))  # stands for the CPU cost of tokenizing
        out = tokenize(tokenizer, config, readout, items, *args)
        spent["tokenize"] += time.perf_counter() - start
        return out

    def slow_forward(features):
        start = time.perf_counter()
        time.sleep(0.05)  # stands for the GPU's time on the batch
        out = forward(features)
        spent["forward"] += time.perf_counter() - start
        return out

    monkeypatch.setattr(inference, "tokenize_chunk", slow_tokenize)
    monkeypatch.setattr(encoder, "forward", slow_forward)
    # Equal costs, the hardest case for overlap: steps of 2 batches keep the producer's lead to a step.
    monkeypatch.setattr(inference, "STEP_BATCHES", 2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on a loaded machine, OpenMP's spinning threads would swamp the waits
    texts = [f"text number {i}" for i in range(64)]  # short: the waits, not the tiny model, are the costs
    try:
        start = time.perf_counter()
        encoder.encode(texts, batch_size=4, show_progress_bar=False)
        wall = time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)
    total = spent["tokenize"] + spent["forward"]
    assert min(spent.values()) > 0.5  # both costs are real: 64 texts, 16 batches
    assert wall < 0.75 * total, (wall, spent)


def test_an_error_while_tokenizing_reaches_the_caller(encoder, monkeypatch):
    class Broken(RuntimeError):
        pass

    calls = []
    tokenize = inference.tokenize_chunk

    def failing(*args):
        calls.append(1)
        if len(calls) == 2:
            raise Broken("the second step failed")
        return tokenize(*args)

    monkeypatch.setattr(inference, "tokenize_chunk", failing)
    with pytest.raises(Broken, match="the second step failed"):
        encoder.encode(TEXTS, batch_size=4, show_progress_bar=False)
    assert not prefetch_threads()


def test_an_error_in_the_forward_stops_the_producer(encoder, monkeypatch):
    forward, seen = encoder.forward, []

    def failing(features):
        seen.append(1)
        if len(seen) == 2:
            raise MemoryError("out of device memory")
        return forward(features)

    monkeypatch.setattr(encoder, "forward", failing)
    was_training = encoder.training
    with pytest.raises(MemoryError, match="out of device memory"):
        encoder.encode(TEXTS, batch_size=2, show_progress_bar=False)
    assert not prefetch_threads() and encoder.training is was_training


def test_stepwise_planning_gives_the_vectors_of_one_text_at_a_time(encoder, monkeypatch):
    monkeypatch.setattr(inference, "FIRST_STEP", 3)
    monkeypatch.setattr(inference, "STEP_BATCHES", 2)
    steps = encoder.encode(TEXTS, batch_size=5, show_progress_bar=False)
    budget = encoder.encode(TEXTS, max_tokens_per_batch=300, show_progress_bar=False)
    alone = torch.cat([encoder.encode([t], show_progress_bar=False) for t in TEXTS[:12]])
    assert torch.allclose(steps[:12], alone, atol=1e-5) and torch.allclose(budget, steps, atol=1e-5)


def test_every_input_is_planned_once_in_steps(encoder, monkeypatch):
    monkeypatch.setattr(inference, "FIRST_STEP", 3)
    monkeypatch.setattr(inference, "STEP_BATCHES", 2)
    items, _ = inference.prepare_inputs(TEXTS, {}, None, None)
    for plan in (inference.BatchPlan(4), inference.BatchPlan(4, 200), inference.BatchPlan(4, packing=True)):
        batches = [indices for indices, _ in inference.planned_batches(encoder, items, encoder.config, plan)]
        assert sorted(i for b in batches for i in b) == list(range(len(TEXTS)))
        if plan.max_tokens_per_batch is None and not plan.packing:
            assert all(len(b) <= 4 for b in batches)


def test_a_pool_gets_batches_as_they_are_made_and_a_tokenizing_error_leaves_it_clean(encoder, monkeypatch):
    """A caller's one-device pool is sent each batch before the next step is tokenized; an error in a later step
    leaves no result of the batches already sent for the pool's next call (other inputs, same pool)."""
    monkeypatch.setattr(inference, "FIRST_STEP", 3)
    monkeypatch.setattr(inference, "STEP_BATCHES", 1)
    reversed_texts = TEXTS[::-1]
    local = encoder.encode(reversed_texts, batch_size=4, show_progress_bar=False)
    pool = encoder.start_multi_process_pool(["cpu"])
    events, tokenize, put = [], inference.tokenize_chunk, pool._tasks.put

    def recorded(*args):
        events.append("tokenize")
        if events.count("tokenize") == 4 and "fail" in events:
            raise RuntimeError("the fourth step failed")
        return tokenize(*args)

    def sent(task, *args, **kwargs):
        events.append("put")
        return put(task, *args, **kwargs)

    try:
        monkeypatch.setattr(inference, "tokenize_chunk", recorded)
        monkeypatch.setattr(pool._tasks, "put", sent)
        streamed = encoder.encode(reversed_texts, batch_size=4, pool=pool, show_progress_bar=False)
        assert_close_normwise(streamed, local, eps_multiple=ORDER_EPS, rows=True)
        assert events.index("put") < len(events) - 1 - events[::-1].index("tokenize")  # sent before the last step
        events[:] = ["fail"]
        with pytest.raises(RuntimeError, match="the fourth step failed"):
            encoder.encode(TEXTS, batch_size=4, pool=pool, show_progress_bar=False)
        assert events.count("put") >= 3
        again = encoder.encode(reversed_texts, batch_size=4, pool=pool, show_progress_bar=False)
        assert_close_normwise(again, local, eps_multiple=ORDER_EPS, rows=True)
    finally:
        encoder.stop_multi_process_pool(pool)
