"""Diffusion backbones as encoders: LLaDA end to end (LoRA, save/load) and mask-token readout pooling."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import DREAM_FIXTURE, LLADA_FIXTURE, LLAMA_FIXTURE, randomize_lora_b
from numerics import HAND_EPS, MERGE_EPS, ORDER_EPS, assert_close_normwise
from peft import LoraConfig, get_peft_model

from diffusion_embedder import Encoder
from diffusion_embedder.training.arguments import LORA_TARGETS

ROOT = Path(__file__).resolve().parents[1]
TEXTS = [
    ["Given a math problem, retrieve the theorem", "A triangle has sides 3, 4 and 5. Find its area."],
    "Two pointers sweep the array from both ends.",
    ["Retrieve text based on user query", "What is the capital of France?"],
]


def test_llada_lora_save_and_reload_records_the_base(tmp_path):
    encoder = Encoder.from_pretrained(str(LLADA_FIXTURE), torch_dtype=torch.float32, device="cpu")
    base = encoder.encode(TEXTS, show_progress_bar=False)
    encoder.model = get_peft_model(encoder.model, LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS))
    wrapped = {n.rsplit(".", 1)[0] for n, _ in encoder.model.named_parameters() if "lora_B" in n}
    assert len(wrapped) == 2 * 7  # the default targets name every mapped projection of both blocks
    torch.manual_seed(0)
    randomize_lora_b(encoder.model, 0.5)
    expected = encoder.encode(TEXTS, show_progress_bar=False)
    assert not torch.allclose(expected, base, atol=1e-3)

    encoder.save(str(tmp_path / "adapter"))
    saved = json.loads((tmp_path / "adapter" / "encoder_config.json").read_text())
    assert saved["model_type"] == "llada" and saved["base_model_name_or_path"] == str(LLADA_FIXTURE)
    adapter = Encoder.from_pretrained(str(tmp_path / "adapter"), device="cpu")
    assert_close_normwise(adapter.encode(TEXTS, show_progress_bar=False), expected, eps_multiple=MERGE_EPS, rows=True)

    encoder.save(str(tmp_path / "merged"), merge_before_save=True)
    merged = Encoder.from_pretrained(str(tmp_path / "merged"), device="cpu")
    assert merged.config.model_type == "llada" and merged.model.config.mask_token_id == 956
    assert merged.tokenizer.mask_token_id == 956
    assert_close_normwise(merged.encode(TEXTS, show_progress_bar=False), expected, eps_multiple=MERGE_EPS, rows=True)


def mask_encoder(path, **kwargs) -> Encoder:
    return Encoder.from_pretrained(
        str(path), pooling_mode="mask_token", torch_dtype=torch.float32, device="cpu", **kwargs
    )


@pytest.mark.parametrize("fixture", [LLADA_FIXTURE, DREAM_FIXTURE], ids=["llada", "Dream"])
def test_mask_readout_is_the_mean_of_k_appended_masks(fixture):
    """Inputs are the templated text then K mask tokens; the vector is the mean of those K raw states."""
    k = 3
    encoder = mask_encoder(fixture, mask_readout_tokens=k, prompt_template="<x>{text}</x>")
    mask_id = encoder.model.config.mask_token_id
    batched = encoder.encode(TEXTS, batch_size=len(TEXTS), show_progress_bar=False)
    for i, text in enumerate(TEXTS):
        instruction, body = ("", text) if isinstance(text, str) else (text[0].strip() + " ", text[1])
        expected_text = encoder.tokenizer(f"<x>{instruction}{body}</x>")["input_ids"]
        ids = encoder.tokenize([text])["input_ids"][0].tolist()
        assert ids == expected_text + [mask_id] * k
        with torch.no_grad():
            hidden = encoder.model(input_ids=torch.tensor([ids]), use_cache=False).last_hidden_state[0]
        alone = encoder.encode([text], show_progress_bar=False)[0]
        assert_close_normwise(alone, hidden[-k:].mean(0), eps_multiple=HAND_EPS)
        assert not torch.allclose(alone, hidden[-k - 1 :].mean(0), atol=1e-3)
        assert_close_normwise(batched[i], alone, eps_multiple=ORDER_EPS)


def test_mask_readout_fits_max_length_and_round_trips(tmp_path):
    encoder = mask_encoder(LLADA_FIXTURE, mask_readout_tokens=2, max_length=12)
    ids = encoder.tokenize(["a long text " * 20])["input_ids"][0].tolist()
    assert len(ids) == 12 and ids[-2:] == [956, 956] and ids[-3] != 956
    encoder.max_length = 64
    expected = encoder.encode(TEXTS, show_progress_bar=False)
    encoder.save(str(tmp_path / "enc"))
    saved = json.loads((tmp_path / "enc" / "encoder_config.json").read_text())
    assert (saved["pooling_mode"], saved["mask_readout_tokens"]) == ("mask_token", 2)
    assert "| pooling | mask_token (2 mask token(s) appended" in (tmp_path / "enc" / "README.md").read_text()
    reloaded = Encoder.from_pretrained(str(tmp_path / "enc"), device="cpu")
    assert reloaded.config.mask_readout_tokens == 2
    assert torch.equal(reloaded.encode(TEXTS, show_progress_bar=False), expected)


def test_mask_readout_is_refused_without_a_mask_token():
    with pytest.raises(ValueError, match="pooling_mode='mask_token' needs a backbone with a mask token"):
        mask_encoder(LLAMA_FIXTURE)
    with pytest.raises(ValueError, match="mask_readout_tokens: must be >= 1, got 0"):
        mask_encoder(LLADA_FIXTURE, mask_readout_tokens=0)


def test_evaluation_with_mask_readout(tmp_path, monkeypatch):
    """The eval CLI's flags reach the encoder; mteb's nDCG@10 on a local task is that of the readout vectors."""
    monkeypatch.setenv("MTEB_CACHE", str(tmp_path / "mteb_cache"))
    from test_eval_local import REASONAUG, REASONAUG_INSTRUCTION, ndcg_at_10, read_jsonl

    from diffusion_embedder.evaluation import run

    args = run.parse_args(["--base_model_name_or_path", str(LLADA_FIXTURE), "--pooling_mode", "mask_token",
                           "--mask_readout_tokens", "2", "--device", "cpu", "--local_task", str(REASONAUG),
                           "--output_dir", str(tmp_path / "results"), "--no_progress_bar"])
    encoder = run.load_encoder(args)
    assert (encoder.config.pooling_mode, encoder.config.mask_readout_tokens) == ("mask_token", 2)
    assert encoder.tokenize(["x"])["input_ids"][0, -2:].tolist() == [956, 956]
    outcome = run.evaluate(run.wrap_encoder(encoder, args), run.task_factories(args), args)
    assert not outcome.failures
    queries, corpus = read_jsonl(REASONAUG / "queries.jsonl"), read_jsonl(REASONAUG / "corpus.jsonl")
    doc_index = {d["_id"]: i for i, d in enumerate(corpus)}
    qrels = [{doc_index[f"c{q['_id'][1:]}r{r}"] for r in range(2, 7)} for q in queries]
    query_emb = encoder.encode([[REASONAUG_INSTRUCTION, q["text"]] for q in queries], convert_to_numpy=True)
    doc_emb = encoder.encode([["", d["text"]] for d in corpus], convert_to_numpy=True)
    assert outcome.scores["ReasonAugConceptRetrieval"] == pytest.approx(ndcg_at_10(query_emb, doc_emb, qrels), abs=1e-5)


@pytest.mark.parametrize("fixture", [DREAM_FIXTURE, LLADA_FIXTURE], ids=["Dream", "llada"])
def test_tiny_supervised_run_with_mask_readout(tmp_path, monkeypatch, fixture):
    """train_configs/tiny/mask_readout.json through run.train: the readout setting is trained and saved."""
    from diffusion_embedder.training.arguments import load_config
    from diffusion_embedder.training.supervised import train

    monkeypatch.chdir(ROOT)
    overrides = ["--output_dir", str(tmp_path), "--report_to", "none", "--model_name_or_path", str(fixture)]
    run_dir = Path(train(load_config(ROOT / "train_configs" / "tiny" / "mask_readout.json", overrides)))
    state = json.loads((run_dir / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["global_step"] == 3 and all(math.isfinite(e["loss"]) for e in state["log_history"] if "loss" in e)
    trained = Encoder.from_pretrained(str(run_dir), device="cpu")
    assert (trained.config.pooling_mode, trained.config.mask_readout_tokens) == ("mask_token", 2)
    assert trained.config.model_type == json.loads((fixture / "config.json").read_text())["model_type"]
    mask_id = trained.model.config.mask_token_id
    assert trained.tokenize(["a text"])["input_ids"][0, -2:].tolist() == [mask_id, mask_id]
    base = mask_encoder(fixture, mask_readout_tokens=2, max_length=48)
    texts = ["The red apple.", ["Retrieve the fruit", "An apple is red."]]
    after = trained.encode(texts, show_progress_bar=False)
    assert torch.isfinite(after).all() and not torch.allclose(after, base.encode(texts, show_progress_bar=False))


def test_llada_and_mask_readout_configs_keep_dreams_hyperparameters():
    """LLaDA_{if,long,theorem} are Dream's configs on another base; the mask-readout variant changes only pooling."""
    from diffusion_embedder.training.arguments import load_config

    def values(name):
        cfg = load_config(ROOT / "train_configs" / "supervised" / f"{name}.json", ["--bf16", "false"])
        return {k: v for k, v in cfg.values.items() if k not in ("model_name_or_path", "output_dir")}, cfg

    for task in ("if", "long", "theorem"):
        (llada, cfg), (dream, _) = values(f"LLaDA_{task}"), values(f"Dream_{task}")
        assert llada == dream and cfg.model.model_name_or_path == "GSAI-ML/LLaDA-8B-Instruct"
    (mask, cfg), (dream, _) = values("Dream_theorem_mask_token"), values("Dream_theorem")
    assert (cfg.model.pooling_mode, cfg.model.mask_readout_tokens) == ("mask_token", 1)
    assert {k: v for k, v in mask.items() if k not in ("pooling_mode", "mask_readout_tokens")} == {
        k: v for k, v in dream.items() if k != "pooling_mode"
    }


@pytest.mark.parametrize("pooling_mode", ["mean", "mask_token"])
def test_llada_sentence_transformers_export(tmp_path, pooling_mode):
    """A LLaDA encoder exports (stock modules for mean pooling, ours for the readout) and gives the same vectors."""
    from test_export_st import load_st

    encoder = Encoder.from_pretrained(
        str(LLADA_FIXTURE), pooling_mode=pooling_mode, mask_readout_tokens=2, skip_instruction=False, device="cpu"
    )
    encoder.save(str(tmp_path), format="sentence-transformers")
    texts = [t if isinstance(t, str) else t[1] for t in TEXTS]
    got = torch.as_tensor(load_st(tmp_path).encode(texts))
    assert_close_normwise(got, encoder.encode(texts, show_progress_bar=False), eps_multiple=ORDER_EPS, rows=True)


def test_llada_mdm_stage_adapter_merges_into_the_encoder(tmp_path):
    """LLaDA's own objective (masked diffusion, no shift) runs on the LM-head model; its adapter merges."""
    from diffusion_embedder.training import lm

    tiny = ROOT / "train_configs" / "tiny" / "mntp.json"
    overrides = ["--model_name_or_path", str(LLADA_FIXTURE), "--objective", "mdm", "--mdm_shift", "false",
                 "--max_steps", "2", "--save_steps", "2", "--output_dir", str(tmp_path), "--report_to", "none"]
    assert lm.main([str(tiny), *overrides]) == 0
    (run_dir,) = [p for p in tmp_path.iterdir() if (p / "adapter_config.json").is_file()]
    encoder = Encoder.from_pretrained(str(run_dir), device="cpu")
    assert encoder.config.model_type == "llada" and encoder.config.merged_adapters == (str(run_dir),)
    base = Encoder.from_pretrained(str(LLADA_FIXTURE), device="cpu")
    after, before = (e.encode(TEXTS, show_progress_bar=False) for e in (encoder, base))
    assert torch.isfinite(after).all() and not torch.allclose(after, before, atol=1e-4)
