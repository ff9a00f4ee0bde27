"""CPU encoding runs forwards side by side in threads: in order, bounded, with errors raised where they are read,
only for models whose forward writes nothing shared, and with the vectors of one forward at a time."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch
from conftest import LLAMA_FIXTURE, MIXED_TEXTS
from numerics import ORDER_EPS, assert_close_normwise
from transformers import AutoModel, LlamaConfig

from diffusion_embedder import Encoder, cpu_forwards
from diffusion_embedder.compilation import COMPILED, decoder_layers

CPU = torch.device("cpu")


@contextlib.contextmanager
def torch_threads(count: int):
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def tiny_llama(attn: str = "sdpa", **config) -> torch.nn.Module:
    return AutoModel.from_config(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=2, **config),
                                 attn_implementation=attn)


def test_forwards_run_side_by_side_in_order_and_bounded():
    """Two forwards must be in flight at once to pass the barrier; results come in input order; no more than two
    items are taken ahead of the results read."""
    barrier = threading.Barrier(2, timeout=10)
    taken, seen = [], []

    def items():
        for i in range(6):
            taken.append(i)
            yield i

    def forward(i):
        seen.append((threading.current_thread().name, torch.get_num_threads(), torch.is_inference_mode_enabled()))
        barrier.wait()
        return i * 10

    with torch_threads(2):
        results = []
        for value in cpu_forwards.run_concurrently(forward, items(), 2):
            assert len(taken) - len(results) <= 2
            results.append(value)
        assert torch.get_num_threads() == 2  # the caller's own count is left as it was
    assert results == [0, 10, 20, 30, 40, 50]
    assert all(name.startswith("encode-forward") and threads == 1 and inference for name, threads, inference in seen)


def test_one_forward_at_a_time_runs_in_the_caller():
    names = list(cpu_forwards.run_concurrently(lambda i: threading.current_thread().name, range(3), 1))
    assert names == [threading.current_thread().name] * 3


def test_an_error_in_a_forward_is_raised_to_the_reader_and_stops_the_threads():
    def forward(i):
        if i == 2:
            raise KeyError("bad batch")
        return i

    before = threading.active_count()
    with torch_threads(2), pytest.raises(KeyError, match="bad batch"):
        list(cpu_forwards.run_concurrently(forward, range(10), 2))
    assert threading.active_count() == before


def test_how_many_forwards_at_once(monkeypatch):
    model = tiny_llama()
    with torch_threads(4):
        assert cpu_forwards.concurrent_forwards(model, CPU) == 2  # the default
        assert cpu_forwards.concurrent_forwards(model, torch.device("cuda")) == 1
    with torch_threads(1):
        assert cpu_forwards.concurrent_forwards(model, CPU) == 1  # the default: at most one per intra-op thread
        monkeypatch.setenv(cpu_forwards.ENV_SETTING, "3")
        assert cpu_forwards.concurrent_forwards(model, CPU) == 3  # a number set is run as given
        monkeypatch.setenv(cpu_forwards.ENV_SETTING, "1")
        assert cpu_forwards.concurrent_forwards(model, CPU) == 1
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv(cpu_forwards.ENV_SETTING, bad)
        with pytest.raises(ValueError, match=f"DIFFUSION_EMBEDDER_CPU_FORWARDS='{bad}'"):
            cpu_forwards.concurrent_forwards(model, CPU)


def test_models_that_write_state_in_their_forward_run_one_at_a_time():
    with torch_threads(2):
        assert cpu_forwards.concurrent_forwards(tiny_llama(attn="eager"), CPU) == 2
        for attn in ("flex_attention", "varlen"):
            model = tiny_llama(attn="eager")
            model.config._attn_implementation = attn
            assert cpu_forwards.concurrent_forwards(model, CPU) == 1, attn
        dynamic = tiny_llama(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
        assert "dynamic" in cpu_forwards.sharing_problem(dynamic)
        assert cpu_forwards.concurrent_forwards(dynamic, CPU) == 1
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(cpu_forwards.ENV_SETTING, "2")  # asked for, and not possible: refused, not ignored
            with pytest.raises(ValueError, match="DIFFUSION_EMBEDDER_CPU_FORWARDS=2 cannot be honoured .* dynamic"):
                cpu_forwards.concurrent_forwards(dynamic, CPU)
        compiled = tiny_llama()
        setattr(decoder_layers(compiled)[0], COMPILED, True)
        assert cpu_forwards.sharing_problem(compiled) == "compiled layers"


def test_encode_runs_its_forwards_side_by_side_with_the_vectors_of_one_at_a_time(monkeypatch):
    """The setting reaches ``encode``: 2 runs the forwards in the threads, 1 in the caller; the vectors agree."""
    encoder = Encoder.from_pretrained(str(LLAMA_FIXTURE), torch_dtype=torch.float32)
    texts = MIXED_TEXTS * 4
    names: set[str] = set()
    forward = type(encoder).forward

    def spy(self, features):
        names.add(threading.current_thread().name)
        return forward(self, features)

    monkeypatch.setattr(type(encoder), "forward", spy)
    with torch_threads(2):
        side_by_side = encoder.encode(texts, batch_size=2, show_progress_bar=False)
        assert names and all(name.startswith("encode-forward") for name in names)
        names.clear()
        monkeypatch.setenv(cpu_forwards.ENV_SETTING, "1")
        one_at_a_time = encoder.encode(texts, batch_size=2, show_progress_bar=False)
        assert names == {threading.current_thread().name}
    assert_close_normwise(side_by_side, one_at_a_time, eps_multiple=ORDER_EPS, rows=True)


def test_a_model_whose_device_map_offloads_layers_runs_one_forward_at_a_time(tmp_path):
    """accelerate's hooks load an offloaded layer's weights in its forward and drop them after: two forwards at once
    broke each other ("Tensor on device cpu is not on the expected device meta"). Such a model, and a quantized one,
    runs one forward at a time, and an explicit setting is refused."""
    offloaded = {"embed_tokens": "cpu", "layers.0": "cpu", "layers.1": "disk", "norm": "cpu", "rotary_emb": "cpu"}
    encoder = Encoder.from_pretrained(str(LLAMA_FIXTURE), torch_dtype=torch.float32, device_map=offloaded,
                                      offload_folder=str(tmp_path))
    texts = [" ".join(["alpha", "beta", "gamma"][i % 3] for i in range(n)) for n in range(1, 200, 7)]
    with torch_threads(2):
        assert "accelerate hooks" in cpu_forwards.sharing_problem(encoder.model)
        assert cpu_forwards.concurrent_forwards(encoder.model, CPU) == 1
        vectors = encoder.encode(texts, batch_size=2, show_progress_bar=False)
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(cpu_forwards.ENV_SETTING, "2")
            with pytest.raises(ValueError, match="cannot be honoured for this model: accelerate hooks"):
                encoder.encode(texts, batch_size=2, show_progress_bar=False)
    plain = Encoder.from_pretrained(str(LLAMA_FIXTURE), torch_dtype=torch.float32)
    assert_close_normwise(vectors, plain.encode(texts, batch_size=2, show_progress_bar=False), eps_multiple=ORDER_EPS,
                          rows=True)
    quantized = tiny_llama()
    quantized.config.quantization_config = {"quant_method": "bitsandbytes"}
    assert cpu_forwards.sharing_problem(quantized) == "quantized weights"


def test_rotary_kinds_per_layer_type_are_read_and_the_thread_default_is_kept():
    """Gemma 3 keeps a rope type per layer type (a dict): it was a TypeError, and could hide a ``dynamic`` layer.
    The forward threads' thread count is torch's default for threads started later: it is put back after."""
    from transformers import Gemma3TextConfig

    gemma3 = AutoModel.from_config(Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                    num_hidden_layers=2, num_attention_heads=2,
                                                    num_key_value_heads=1, head_dim=16), attn_implementation="sdpa")
    assert any(isinstance(getattr(m, "rope_type", None), dict) for m in gemma3.modules())
    assert cpu_forwards.sharing_problem(gemma3) is None
    rotary = next(m for m in gemma3.modules() if isinstance(getattr(m, "rope_type", None), dict))
    rotary.rope_type = {**rotary.rope_type, "full_attention": "dynamic"}
    assert "dynamic" in cpu_forwards.sharing_problem(gemma3)

    def in_a_new_thread() -> int:
        seen = []
        thread = threading.Thread(target=lambda: seen.append(torch.ones(4).sum() and torch.get_num_threads()))
        thread.start()
        thread.join()
        return seen[0]

    with torch_threads(2):
        before = in_a_new_thread()
        assert list(cpu_forwards.run_concurrently(lambda x: x * 2, range(6), 2)) == [0, 2, 4, 6, 8, 10]
        assert in_a_new_thread() == before == 2 and torch.get_num_threads() == 2
    # two runs at once, the second started in a thread born while the first's forward threads ran (it inherits
    # their count): the last to end puts back the count from before the first
    import time

    def slow(x):
        time.sleep(0.2)
        return x

    with torch_threads(4):
        first = threading.Thread(target=lambda: list(cpu_forwards.run_concurrently(slow, range(4), 2)))
        first.start()
        time.sleep(0.1)
        second = threading.Thread(target=lambda: list(cpu_forwards.run_concurrently(slow, range(8), 2)))
        second.start()
        first.join()
        second.join()
        assert in_a_new_thread() == 4
