"""mteb's own tools read our results: ``ResultCache(cache_path=OUTPUT_DIR).load_results()`` with its defaults,
readable per-run model names, one revision per weights however they are loaded, and a ``ModelMeta`` that
says what we know and can load the model again."""

from __future__ import annotations

import json
from pathlib import Path

import mteb
import pytest
import torch
from conftest import LLAMA_FIXTURE, randomize_lora_b
from peft import LoraConfig, get_peft_model

from diffusion_embedder import Encoder, cli
from diffusion_embedder.evaluation.mteb_model import MTEBEncoder
from diffusion_embedder.evaluation.results import checkpoint_name

INSTRUCTIONS = Path(__file__).parent / "fixtures" / "beir" / "instructions"
TASK = "HandInstructionRetrieval"


def load(path, **kw) -> Encoder:
    return Encoder.from_pretrained(str(path), torch_dtype=torch.float32, device="cpu", **kw)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A training run's adapter checkpoint (random non-zero LoRA) with its train_config.json, plus the same
    weights saved merged as a full encoder folder."""
    run_dir = tmp_path_factory.mktemp("runs") / "reasonaug-run"
    checkpoint = run_dir / "checkpoint-10"
    encoder = load(LLAMA_FIXTURE)
    encoder.model = get_peft_model(encoder.model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(0)
    randomize_lora_b(encoder.model, 0.5)
    encoder.save(str(checkpoint))
    (checkpoint / "train_config.json").write_text(json.dumps({"dataset_name": "ReasonAug", "learning_rate": 1e-4}))
    merged = run_dir / "merged"
    load(checkpoint).save(str(merged), merge_before_save=True)
    return checkpoint, merged


@pytest.fixture(scope="module")
def evaluated(trained, tmp_path_factory):
    """The checkpoint evaluated through the CLI with its own settings, then with a pooling ablation."""
    checkpoint, _ = trained
    out = tmp_path_factory.mktemp("out")
    common = ["eval", "--base_model_name_or_path", str(checkpoint), "--local_task", str(INSTRUCTIONS),
              "--output_dir", str(out), "--device", "cpu", "--torch_dtype", "float32", "--no_progress_bar"]
    assert cli.main(common) == 0
    assert cli.main([*common, "--pooling_mode", "weighted_mean"]) == 0
    return out


def test_mteb_result_cache_reads_our_results_with_its_defaults(evaluated):
    results = mteb.ResultCache(cache_path=evaluated).load_results()
    assert [m.model_name for m in results.model_results] == ["diffusion_embedder/reasonaug-run-checkpoint-10"]
    model = results.model_results[0]
    assert [t.task_name for t in model.task_results] == [TASK]
    ours = json.loads(next(p for p in evaluated.rglob(f"{TASK}.json") if "experiments" not in p.parts).read_text())
    assert model.task_results[0].get_score() == pytest.approx(ours["scores"]["test"][0]["main_score"])
    # the ablation is an mteb experiment of the same name: loaded when asked for
    everything = mteb.ResultCache(cache_path=evaluated).load_results(load_experiments="match_name")
    experiments = sorted(str(m.experiment_name) for m in everything.model_results)
    assert experiments == ["None", "pooling_mode_weighted_mean"]
    # nothing in the results tree is a *.json mteb would misread
    for path in (evaluated / "results").rglob("*.json"):
        assert path.name == "model_meta.json" or json.loads(path.read_text())["task_name"] == TASK, path


def test_model_names_are_readable_and_differ_per_run():
    assert checkpoint_name("runs/dream-if/checkpoint-10") == "diffusion_embedder/dream-if-checkpoint-10"
    assert checkpoint_name("runs/llada-if/checkpoint-10/") == "diffusion_embedder/llada-if-checkpoint-10"
    assert checkpoint_name("runs/dream-if") == "diffusion_embedder/dream-if"
    assert checkpoint_name("Dream-org/Dream-v0-Instruct-7B") == "diffusion_embedder/Dream-v0-Instruct-7B"


def test_the_same_weights_get_the_same_revision_however_they_are_loaded(trained):
    checkpoint, merged = trained
    adapter_kept = MTEBEncoder(load(checkpoint))  # the encoder folder: LoRA beside its base, unmerged
    assert hasattr(adapter_kept.model.model, "peft_config")
    revisions = {
        adapter_kept.mteb_model_meta.revision,
        MTEBEncoder(load(LLAMA_FIXTURE, peft_model_name_or_path=str(checkpoint), merge_peft=True))
        .mteb_model_meta.revision,
        MTEBEncoder(load(merged)).mteb_model_meta.revision,
    }
    assert len(revisions) == 1
    assert MTEBEncoder(load(LLAMA_FIXTURE)).mteb_model_meta.revision not in revisions  # the LoRA counts


def test_model_meta_fills_what_we_know_and_loads_the_model(trained, evaluated):
    checkpoint, _ = trained
    meta_file = next(p for p in evaluated.rglob("model_meta.json") if "experiments" not in p.parts)
    meta = json.loads(meta_file.read_text())
    base = load(LLAMA_FIXTURE)
    assert meta["adapted_from"] == str(LLAMA_FIXTURE)
    assert meta["training_datasets"] == ["ReasonAug"]
    assert meta["n_parameters"] == sum(p.numel() for p in base.parameters())  # LoRA folded in, not added
    assert meta["n_embedding_parameters"] == base.model.get_input_embeddings().weight.numel()
    assert meta["embed_dim"] == base.embedding_dim and meta["max_tokens"] == 512
    assert meta["open_weights"] is True and meta["reference"].startswith("https://")
    assert meta["loader_kwargs"] == {"base_model_name_or_path": str(checkpoint), "torch_dtype": "float32"}

    model = MTEBEncoder(load(checkpoint), source={"base_model_name_or_path": str(checkpoint)})
    again = model.mteb_model_meta.load_model(device="cpu")
    assert isinstance(again, MTEBEncoder)
    assert again.mteb_model_meta.revision == model.mteb_model_meta.revision == meta_file.parent.name
    texts = [["", "a document"], ["Find it:", "a query"]]
    torch.testing.assert_close(again.model.encode(texts), model.model.encode(texts))
