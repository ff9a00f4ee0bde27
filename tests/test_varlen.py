"""attn_implementation="varlen": the reference path (CPU) equals padded sdpa for every family, pooling mode and
direction; the glue (from_pretrained, training config, command line) reaches it; what it cannot honour is refused;
the kernel's call adapts to each torch signature. tests/test_gpu.py runs the real kernel."""

from __future__ import annotations

import json
import logging
from dataclasses import replace

import pytest
import torch
from conftest import DREAM_FIXTURE, FAMILIES, LLADA_FIXTURE, LLAMA_FIXTURE, MIXED_TEXTS, ROOT
from numerics import HAND_EPS, ORDER_EPS, REFERENCE_EPS, assert_close_normwise
from transformers import AttentionInterface

from diffusion_embedder import Encoder, packed_chunks, packing, varlen
from diffusion_embedder.backbones import load_backbone
from diffusion_embedder.loading import check_attn_implementation
from diffusion_embedder.pooling import POOLING_MODES

#: Mixed inputs plus an empty text, alone and after an instruction.
TEXTS = [*MIXED_TEXTS, "", ["Retrieve the passage", ""]]
PACK = {"packing": True, "max_tokens_per_batch": 48}  # several texts per row, the longest in a row of its own


@pytest.fixture
def calls(monkeypatch) -> list:
    """Every call of the registered varlen attention function, as (causal, offsets given, mask given)."""
    seen: list = []
    inner = varlen.varlen_attention_forward

    def spy(module, query, key, value, attention_mask, **kwargs):
        causal = kwargs.get("is_causal")
        seen.append((getattr(module, "is_causal", True) if causal is None else causal,
                     kwargs.get("cu_seq_lens_q") is not None, attention_mask is not None))
        return inner(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, varlen.NAME, spy)
    return seen


def load(path, **kwargs) -> Encoder:
    return Encoder.from_pretrained(str(path), torch_dtype=torch.float32, **kwargs)


def with_pooling(encoder: Encoder, mode: str) -> Encoder:
    return Encoder(encoder.model, encoder.tokenizer, replace(encoder.config, pooling_mode=mode, eos_suffix=None))


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "gemma2"])
def test_packed_varlen_equals_padded_sdpa_for_every_family_and_pooling_mode(family_checkpoint, family, calls):
    """Float32 on the CPU: the per-text reference path, packed and padded, gives padded sdpa's vectors within 1e-5
    (both compute the same sums; measured differences are below 1e-6)."""
    path = family_checkpoint(family)
    sdpa, fast = load(path, attn_implementation="sdpa"), load(path, attn_implementation="varlen")
    assert fast.model.config._attn_implementation == "varlen"
    has_mask_token = getattr(fast.model.config, "mask_token_id", None) is not None
    for mode in POOLING_MODES:
        if mode == "mask_token" and not has_mask_token:
            continue
        reference = with_pooling(sdpa, mode)
        expected = reference.encode(TEXTS, batch_size=len(TEXTS), packing=False, show_progress_bar=False)
        pooled = Encoder(fast.model, fast.tokenizer, reference.config, latent=reference.latent)  # the same head
        calls.clear()
        packed = pooled.encode(TEXTS, show_progress_bar=False, **PACK)
        assert calls and all(given for _, given, _ in calls)  # the packing's offsets reached the attention
        padded = pooled.encode(TEXTS, batch_size=3, packing=False, show_progress_bar=False)
        for got in (packed, padded):
            assert_close_normwise(got, expected, eps_multiple=ORDER_EPS, rows=True, msg=(family, mode))


@pytest.mark.parametrize("family", ["llama", "qwen2", "Dream", "llada"])
def test_causal_varlen_equals_causal_sdpa(family_checkpoint, family, calls):
    path = family_checkpoint(family)
    sdpa = load(path, attn_implementation="sdpa", enable_bidirectional=False)
    fast = load(path, attn_implementation="varlen", enable_bidirectional=False)
    expected = sdpa.encode(TEXTS, batch_size=len(TEXTS), packing=False, show_progress_bar=False)
    calls.clear()
    for kwargs in (PACK, {"packing": False, "batch_size": 3}):
        got = fast.encode(TEXTS, show_progress_bar=False, **kwargs)
        assert_close_normwise(got, expected, eps_multiple=ORDER_EPS, rows=True, msg=(family, kwargs))
    assert calls and all(causal for causal, _, _ in calls)


def test_the_parity_fixtures_hold_with_varlen():
    """LLM2Vec 0.2.3's own vectors, and Dream's and LLaDA's reference hidden states, on varlen."""
    for fixture in (LLAMA_FIXTURE, ROOT / "tests" / "fixtures" / "llm2vec_parity" / "mistral"):
        for case in json.loads((fixture / "cases.json").read_text()):
            settings = {k: case[k] for k in ("enable_bidirectional", "doc_max_length") if k in case}
            encoder = load(fixture, attn_implementation="varlen", pooling_mode=case["pooling_mode"],
                           skip_instruction=case["skip_instruction"], max_length=case["max_length"], **settings)
            expected = torch.tensor(case["embeddings"])
            for kwargs in ({"batch_size": 3, "packing": False}, PACK):
                got = encoder.encode(case["inputs"], show_progress_bar=False, **kwargs)
                assert_close_normwise(got, expected, eps_multiple=REFERENCE_EPS, rows=True, msg=fixture.name)
    for fixture in (DREAM_FIXTURE, LLADA_FIXTURE):
        cases = json.loads((fixture / "cases.json").read_text())
        for bidirectional, key in ((True, "last_hidden_state"), (False, "last_hidden_state_causal")):
            if key not in cases[0]:
                continue
            model = load_backbone(str(fixture), enable_bidirectional=bidirectional, attn_implementation="varlen")
            for case in cases:
                with torch.no_grad():
                    out = model(input_ids=torch.tensor(case["input_ids"]), use_cache=False).last_hidden_state
                assert_close_normwise(out, torch.tensor(case[key]), eps_multiple=REFERENCE_EPS, rows=True,
                                      msg=(fixture.name, key))


def test_offsets_of_packed_rows():
    """Each text is a sequence; a row's padding follows in pieces no longer than the longest text."""
    features = packing.pack([([11, 12, 13], 2), ([21], 1), ([31, 32], 0)], capacity=4, pad_token_id=0)
    assert features["cu_seq_lens"].tolist() == [0, 3, 4, 6, 8] and features["cu_seq_lens"].dtype == torch.int32
    bounded = packing.pack([([1, 2], 1), ([3, 4], 1), ([5], 1)], capacity=2, pad_token_id=0, bounded=True)
    assert bounded["input_ids"].shape == (4, 2)  # three rows, rounded up to four: the last is padding
    assert bounded["cu_seq_lens"].tolist() == [0, 2, 4, 5, 6, 8]
    assert packing.varlen_offsets(bounded)["max_length_q"] == 2
    wide = packing.pack([([1, 2], 1), ([3], 1)], capacity=8, pad_token_id=0, bounded=True)  # 5 padding tokens
    assert wide["cu_seq_lens"].tolist() == [0, 2, 3, 5, 7, 8]  # in pieces of at most 2, the longest text


def test_the_lm_stages_model_runs_on_varlen():
    """MNTP/MDM (bidirectional) and CLM (causal) blocks: the LM head's logits on varlen equal sdpa's."""
    ids = torch.tensor([[5, 9, 17, 33, 65, 129, 257, 3], [7, 8, 9, 10, 11, 12, 13, 14]])
    for bidirectional in (True, False):
        logits = {}
        for attn in ("sdpa", "varlen"):
            lm = load_backbone(str(LLAMA_FIXTURE), enable_bidirectional=bidirectional, attn_implementation=attn,
                               lm_head=True)
            with torch.no_grad():
                logits[attn] = lm(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
        assert_close_normwise(logits["varlen"], logits["sdpa"], eps_multiple=ORDER_EPS, rows=True, msg=bidirectional)


# --------------------------------------------------------------------------------------------- glue
def test_from_pretrained_reaches_the_registered_attention(calls):
    check_attn_implementation("varlen")  # in the loaders' list of valid names
    with pytest.raises(ValueError, match="did you mean 'varlen'"):
        check_attn_implementation("varlenn")
    encoder = load(LLAMA_FIXTURE, attn_implementation="varlen")
    assert calls  # the load's attention self-test ran on it
    calls.clear()
    encoder.encode(TEXTS[:3], show_progress_bar=False)
    assert calls
    calls.clear()
    load(LLAMA_FIXTURE, attn_implementation="sdpa").encode(TEXTS[:3], packing=True, show_progress_bar=False)
    assert not calls  # on the CPU a packed sdpa forward keeps its block mask


def train_one_step(tmp_path, *overrides: str) -> int:
    from diffusion_embedder import cli

    argv = ["train", "train_configs/tiny/custom.json", "--output_dir", str(tmp_path), "--max_steps", "1",
            "--report_to", "none", "--save_steps", "100", *overrides]
    return cli.main(argv)


def test_the_training_config_field_and_the_command_line_flag_reach_the_attention(tmp_path, monkeypatch, calls):
    monkeypatch.chdir(ROOT)
    assert train_one_step(tmp_path / "sdpa") == 0
    assert not calls
    assert train_one_step(tmp_path / "varlen", "--attn_implementation", "varlen") == 0
    assert calls and not any(given for _, given, _ in calls)  # padded rows on the CPU: the 2D mask path
    assert any(mask for _, _, mask in calls)
    calls.clear()
    assert train_one_step(tmp_path / "packed", "--attn_implementation", "varlen", "--pack_length", "64") == 0
    assert any(given for _, given, _ in calls)


# --------------------------------------------------------------------------------------------- refusals
def test_attention_dropout_in_training_is_refused():
    encoder = load(LLAMA_FIXTURE, attn_implementation="varlen", attention_dropout=0.1)
    features = encoder.tokenize(TEXTS[:3], pack_length=64)
    with torch.no_grad():
        encoder.eval()(features)  # no dropout in eval: runs
    encoder.train()
    with pytest.raises(ValueError, match="config sets attention_dropout=0.1 .*varlen kernel has no dropout; set "
                       "config.attention_dropout = 0.0"):
        encoder(features)


def test_a_varlen_training_refusal_names_where_the_attention_dropout_comes_from(tmp_path):
    """The model's own config.json (here 0.1, as LLaDA's default) or SimCSE's simcse_dropout: the refusal names the
    one that set it, its value and the fix."""
    import shutil

    from test_training_trainer import PAIRS, make_config

    from diffusion_embedder.training import supervised
    from diffusion_embedder.training.rows import training_rows
    from diffusion_embedder.training.schema import ConfigError

    model = tmp_path / "model"
    shutil.copytree(LLAMA_FIXTURE, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.1}))
    cfg = make_config(tmp_path / "run", model_name_or_path=str(model), attn_implementation="varlen",
                      dataset_file_path=str(PAIRS))
    own = rf"the model's own config sets attention_dropout 0.1 \({model}/config.json\).*set it to 0.0 there"
    with pytest.raises(ConfigError, match=own) as refused:
        supervised.build_trainer(cfg)
    assert "simcse" not in str(refused.value)
    encoder = load(LLAMA_FIXTURE, attn_implementation="varlen", attention_dropout=0.3)  # as SimCSE's run loads it
    with pytest.raises(ConfigError, match="simcse_dropout 0.3 is the model's attention dropout") as refused:
        training_rows("auto", encoder, simcse_dropout=0.3)
    assert "config.json" not in str(refused.value)


def test_simcse_dropout_with_varlen_is_refused_before_loading(tmp_path):
    from test_training_trainer import make_config

    from diffusion_embedder.training.schema import ConfigError

    with pytest.raises(ConfigError, match="attn_implementation: 'varlen' has no attention dropout, and simcse_dropout"):
        make_config(tmp_path, attn_implementation="varlen", simcse_dropout=0.3)
    with pytest.raises(ConfigError, match="pack_length: 'wide' \\(str\\) is not of type int or 'auto' or null"):
        make_config(tmp_path, pack_length="wide")


def test_softcapping_sliding_windows_and_4d_masks_are_refused(family_checkpoint):
    with pytest.raises(ValueError, match="soft-caps its attention logits"):
        load(family_checkpoint("gemma2"), attn_implementation="varlen")
    module = torch.nn.Module()
    module.is_causal = False
    q = torch.randn(1, 4, 6, 8)
    with pytest.raises(ValueError, match="sliding-window attention \\(window 4\\) over a sequence of 6 tokens"):
        varlen.varlen_attention_forward(module, q, q, q, None, sliding_window=4)
    out, _ = varlen.varlen_attention_forward(module, q, q, q, None, sliding_window=6)  # the window does not bind
    assert out.shape == (1, 6, 4, 8)
    with pytest.raises(ValueError, match="not a 4D mask"):
        varlen.varlen_attention_forward(module, q, q, q, torch.ones(1, 1, 6, 6, dtype=torch.bool))


# --------------------------------------------------------------------------------------------- the kernel's call
def reference(q, k, v, cu, causal, scale):
    """Attention per sequence in float64, written out: softmax(q k^T * scale) v."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    out = torch.zeros_like(q, dtype=torch.float64)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        scores = torch.einsum("qhd,khd->hqk", q[s:e].double(), k[s:e].double()) * scale
        if causal:
            scores = scores.masked_fill(torch.ones(e - s, e - s).triu(1).bool(), float("-inf"))
        out[s:e] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v[s:e].double())
    return out


def fake_kernel(signature: str, seen: list):
    """A stand-in for torch's varlen_attn with one release's keywords; it records them and computes the reference
    (refusing, as the kernel does, key/value heads that differ from the query's unless enable_gqa is given)."""

    def run(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, scale=None, window_size=(-1, -1), enable_gqa=False):
        seen.append({"is_causal": is_causal, "scale": scale, "window_size": window_size, "enable_gqa": enable_gqa,
                     "kv_heads": k.shape[1], "max": (max_q, max_k), "cu_dtype": cu_q.dtype})
        assert enable_gqa or k.shape[1] == q.shape[1]
        causal = is_causal or tuple(window_size) == (-1, 0)
        return reference(q, k, v, cu_q, causal, q.shape[-1] ** -0.5 if scale is None else scale).to(q.dtype)

    keywords = {"2.10": dict(scale=False, window=False, gqa=False), "2.11": dict(scale=True, window=True, gqa=False),
                "2.13": dict(scale=True, window=True, gqa=True)}[signature]
    return varlen.Kernel(run, **keywords)


@pytest.mark.parametrize("signature", ["2.10", "2.11", "2.13"])
@pytest.mark.parametrize("causal", [False, True])
def test_the_kernel_is_called_in_each_torch_releases_form(monkeypatch, signature, causal):
    seen: list = []
    monkeypatch.setattr(varlen, "kernel", lambda: fake_kernel(signature, seen))
    monkeypatch.setattr(varlen, "kernel_problem", lambda *args: None)
    torch.manual_seed(0)
    q, k, v = torch.randn(9, 4, 8), torch.randn(9, 2, 8), torch.randn(9, 2, 8)  # grouped-query: 2 key/value heads
    cu = torch.tensor([0, 4, 5, 9])
    scale = 0.3  # not 1/sqrt(8): a release without ``scale`` gets a scaled query instead
    out = varlen.attend(q, k, v, cu, cu, 4, 4, causal, scale)
    assert_close_normwise(out, reference(q, k, v, cu, causal, scale), eps_multiple=HAND_EPS, rows=True, msg=signature)
    call = seen[0]
    assert call["cu_dtype"] == torch.int32 and call["max"] == (4, 4)
    assert call["kv_heads"] == (2 if signature == "2.13" else 4) and call["enable_gqa"] == (signature == "2.13")
    assert call["scale"] == (None if signature == "2.10" else scale)
    if signature == "2.10":
        assert call["is_causal"] is causal and call["window_size"] == (-1, -1)
    else:
        assert call["is_causal"] is False and call["window_size"] == ((-1, 0) if causal else (-1, -1))


def test_the_reference_path_equals_attention_written_out():
    torch.manual_seed(0)
    q, k, v = torch.randn(9, 4, 8), torch.randn(9, 2, 8), torch.randn(9, 2, 8)
    cu = torch.tensor([0, 4, 4, 5, 9])  # an empty sequence too
    for causal in (False, True):
        out = varlen.attend(q, k, v, cu, cu, 4, 4, causal, 0.3)
        assert_close_normwise(out, reference(q, k, v, cu, causal, 0.3), eps_multiple=HAND_EPS, rows=True, msg=causal)


def test_why_the_kernel_cannot_run():
    assert "CUDA only" in varlen.kernel_problem(torch.device("cpu"), torch.bfloat16, 128)
    if varlen.kernel() is not None:
        assert "bfloat16/float16" in varlen.kernel_problem(torch.device("cuda"), torch.float32, 128)
        assert "head dimension 12" in varlen.kernel_problem(torch.device("cuda"), torch.bfloat16, 12)


# --------------------------------------------------------------------------------------------- where it is used
def pretend_the_kernel_runs(monkeypatch) -> None:
    """The kernel's conditions met on the CPU, its call the reference path (the real one: tests/test_gpu.py)."""
    monkeypatch.setattr(varlen, "kernel_problem", lambda *args: None)
    monkeypatch.setattr(varlen, "_flash", lambda q, k, v, cu_q, cu_k, max_q, max_k, causal, scale:
                        varlen._reference(q, k, v, cu_q, cu_k, causal, scale))


def test_packed_sdpa_inference_dispatches_to_varlen_where_the_kernel_runs(monkeypatch, calls):
    encoder = load(LLAMA_FIXTURE, attn_implementation="sdpa")
    expected = encoder.encode(TEXTS, packing=False, show_progress_bar=False)
    pretend_the_kernel_runs(monkeypatch)
    got = encoder.encode(TEXTS, show_progress_bar=False, **PACK)
    assert calls and all(given for _, given, _ in calls)
    assert_close_normwise(got, expected, eps_multiple=ORDER_EPS, rows=True)
    assert encoder.model.config._attn_implementation == "sdpa"  # for that forward only
    calls.clear()
    features = encoder.tokenize(TEXTS, pack_length=64)
    encoder.train()(features).sum().backward()  # a training forward keeps sdpa's block mask
    assert not calls
    assert "training forward" in varlen.dispatch_problem(encoder.model)


def test_auto_packing_on_cuda_follows_the_kernel(monkeypatch, caplog):
    monkeypatch.setattr(varlen, "_said", set())
    model = load(LLAMA_FIXTURE, attn_implementation="sdpa").model
    assert packing.use_packing("auto", model, "cpu", 10) is False  # CPU unchanged
    with caplog.at_level(logging.WARNING, logger="diffusion_embedder.varlen"):
        assert packing.use_packing("auto", model, "cuda", 10) is False  # float32 (or no CUDA build): padded, said
    assert "packing='auto' pads sdpa rows on cuda" in caplog.text
    pretend_the_kernel_runs(monkeypatch)
    assert packing.use_packing("auto", model, "cuda", 10) is True
    model.config._attn_implementation = "flex_attention"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="diffusion_embedder.varlen"):
        assert packing.use_packing(False, model, "cuda", 10) is False
    assert "compile a kernel per batch width" in caplog.text


def test_pack_length_auto_trains_packed_on_varlen_where_the_kernel_runs(tmp_path, monkeypatch, calls, caplog):
    """The supervised stage's default on CUDA (here the CPU told it is CUDA): packed rows, the model on varlen, the
    same step as padded sdpa's; SimCSE's dropout keeps sdpa and padded rows; the CPU default stays padded."""
    from conftest import randomize_lora_b
    from test_training_trainer import PAIRS, assert_same, make_config, step_grads

    from diffusion_embedder.training import rows, supervised

    def built(**overrides):
        cfg = make_config(tmp_path, dataset_file_path=str(PAIRS), lora_dropout=0.0, **overrides)
        torch.manual_seed(0)
        trainer = supervised.build_trainer(cfg)
        randomize_lora_b(trainer.model, 0.05)
        return trainer

    with caplog.at_level(logging.INFO, logger="diffusion_embedder.training.rows"):
        padded = built()
    assert padded.data_collator.pack_length is None and "pack_length 'auto' on cpu with sdpa" in caplog.text
    samples = [padded.train_dataset[i] for i in range(4)]
    direct = step_grads(padded, padded.data_collator(samples), None)
    assert not calls
    pretend_the_kernel_runs(monkeypatch)
    monkeypatch.setitem(packing.AUTO_PACKING, ("cpu", "sdpa"), packing.VARLEN_KERNEL)
    fast = built()
    assert calls  # the attention self-test after the switch
    calls.clear()
    assert fast.data_collator.pack_length == rows.AUTO_PACK_LENGTH
    assert fast.model.model.config._attn_implementation == "varlen"
    assert_same(step_grads(fast, fast.data_collator(samples), None), direct)
    assert calls and all(given for _, given, _ in calls)
    chunked = built(grad_cache_chunk_size=2)  # GradCache: each chunk packed apart, its offsets cut by shape
    calls.clear()
    batch = chunked.data_collator(samples)
    assert packed_chunks.CHUNK_OFFSETS_KEY in batch["query"]
    assert_same(step_grads(chunked, batch, 2), direct)
    assert calls and all(given for _, given, _ in calls)
    simcse = built(simcse_dropout=0.1)
    assert simcse.data_collator.pack_length is None and simcse.model.model.config._attn_implementation == "sdpa"
