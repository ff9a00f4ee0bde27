"""Every ``diffusion-embedder eval`` flag reaches the code it controls: each test goes through the command line
(``cli.main``) or ``parse_args`` and checks the effect where it happens (encoder inputs, token counts, ranks)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import LLAMA_FIXTURE
from numerics import ORDER_EPS, assert_close_normwise

from diffusion_embedder import Encoder, cli, clihelp
from diffusion_embedder.config import setting_fields
from diffusion_embedder.evaluation import run
from diffusion_embedder.evaluation.cache import EmbeddingCache
from diffusion_embedder.evaluation.mteb_model import MTEBEncoder

INSTRUCTIONS = Path(__file__).parent / "fixtures" / "beir" / "instructions"
REASONAUG = Path(__file__).parent / "fixtures" / "beir" / "reasonaug"


class VectorStandIn:
    """Embeds the vector written in each text (``v=1,0``); records inputs and encode's keyword arguments."""

    def __init__(self):
        self.config = SimpleNamespace(max_length=512, doc_max_length=400, to_dict=lambda: {"kind": "vectors"})
        self.calls: list[dict] = []

    def encode(self, sentences, batch_size=32, show_progress_bar=True, convert_to_numpy=False, **kwargs):
        self.calls.append({"inputs": [list(s) for s in sentences], "batch_size": batch_size,
                           "show_progress_bar": show_progress_bar})
        return np.array([[float(x) for x in re.search(r"v=([\d,]+)", t).group(1).split(",")] for _, t in sentences])


@pytest.fixture
def stand_in(monkeypatch):
    """``eval`` on the command line, with the stand-in in place of the loaded checkpoint."""
    model = VectorStandIn()
    monkeypatch.setattr(run, "load_encoder", lambda args: model)
    return model


def cli_eval(out: Path, *flags: str) -> int:
    """(A checkpoint is named, as the command requires before anything runs; the stand-in replaces it.)"""
    return cli.main(["eval", "--base_model_name_or_path", "stand-in", "--output_dir", str(out), "--model_name",
                     "test/vectors", "--revision", "r0", *flags])


def stored_score(out: Path, task: str) -> float:
    files = list(out.rglob(f"{task}.json"))
    assert len(files) == 1, files
    return json.loads(files[0].read_text())["scores"]["test"][0]["main_score"]


def far_candidate_task(folder: Path, n_above: int = 1100) -> Path:
    """p-MRR task whose changed document drops to rank ``n_above + 1`` under the changed instruction.

    og ``v=1,0``: the target ``t`` (``v=1,0``) is first. changed ``v=0,1``: every ``x<i>`` (``v=i,1``, cosine
    > 0) ranks above ``t`` (cosine 0), so ``t`` is at rank n_above + 1. p-MRR = 1 - 1/new_rank:
    full ranking 1 - 1/1101; a list cut at mteb's default 1000 gives rank 1001, 1 - 1/1001.
    """
    (folder / "qrels").mkdir(parents=True)
    docs = [{"_id": "t", "text": "target v=1,0"}] + [{"_id": f"x{i}", "text": f"other v={i},1"}
                                                     for i in range(1, n_above + 1)]
    (folder / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (folder / "queries.jsonl").write_text(
        json.dumps({"_id": "1-og", "text": "topic", "instruction": "v=1,0"}) + "\n"
        + json.dumps({"_id": "1-changed", "text": "topic", "instruction": "v=0,1"}) + "\n")
    (folder / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n1-og\tt\t1\n1-changed\tx1\t1\n")
    (folder / "task.json").write_text(json.dumps({"name": "FarCandidates"}))
    return folder


def test_default_top_k_ranks_every_candidate_for_p_mrr_and_the_flag_cuts_it(tmp_path, stand_in):
    folder = far_candidate_task(tmp_path / "far")
    assert cli_eval(tmp_path / "default", "--local_task", str(folder), "--no_embedding_cache") == 0
    assert (tmp_path / "default" / "results" / "test__vectors" / "r0" / "FarCandidates.json").is_file()  # name, rev
    assert stored_score(tmp_path / "default", "FarCandidates") == pytest.approx(1 - 1 / 1101, abs=1e-5)
    assert cli_eval(tmp_path / "cut", "--local_task", str(folder), "--top_k", "1000", "--no_embedding_cache") == 0
    assert stored_score(tmp_path / "cut", "FarCandidates") == pytest.approx(1 - 1 / 1001, abs=1e-5)
    # the hand fixture (see test_eval_local): --top_k 2 puts topic 1's changed document at rank 3
    assert cli_eval(tmp_path / "two", "--local_task", str(INSTRUCTIONS), "--top_k", "2") == 0
    assert stored_score(tmp_path / "two", "HandInstructionRetrieval") == pytest.approx(1 / 3, abs=1e-5)


def test_finished_tasks_are_skipped_unless_overwrite(tmp_path, stand_in):
    flags = ("--local_task", str(INSTRUCTIONS), "--no_embedding_cache")
    assert cli_eval(tmp_path, *flags) == 0
    first = len(stand_in.calls)
    assert first == 2  # documents, then queries
    assert cli_eval(tmp_path, *flags) == 0
    assert len(stand_in.calls) == first  # finished: nothing encoded
    assert cli_eval(tmp_path, *flags, "--overwrite") == 0
    assert len(stand_in.calls) == 2 * first


def test_encode_flags_reach_the_encoder_call(tmp_path, stand_in):
    instructions = tmp_path / "inst.json"
    instructions.write_text(json.dumps({"HandInstructionRetrieval": "Custom instruction:"}))
    assert cli_eval(tmp_path / "out", "--local_task", str(INSTRUCTIONS), "--batch_size", "3", "--no_progress_bar",
                    "--task_to_instructions_fp", str(instructions), "--query_template", "{instruction} | {query}",
                    "--embedding_cache_dir", str(tmp_path / "emb"), "--save_predictions") == 0
    queries = next(c for c in stand_in.calls if "topic one" in str(c["inputs"]))
    documents = next(c for c in stand_in.calls if "document 1" in str(c["inputs"]))
    assert {(c["batch_size"], c["show_progress_bar"]) for c in stand_in.calls} == {(3, False)}
    assert {i for i, _ in queries["inputs"]} == {"Custom instruction:"}
    assert ["Custom instruction:", "original narrative v=4,3,2,1 | topic one"] in queries["inputs"]
    assert {i for i, _ in documents["inputs"]} == {""}
    assert list((tmp_path / "emb").rglob("*.npy")) and not (tmp_path / "out" / "embedding_cache").exists()
    assert list((tmp_path / "out").rglob("predictions/*.json"))
    # --no_embedding_cache: nothing cached; by default the cache sits under the output folder
    assert run.wrap_encoder(stand_in, run.parse_args(["--revision", "r", "--no_embedding_cache"])).cache is None
    default = run.wrap_encoder(stand_in, run.parse_args(["--revision", "r", "--output_dir", str(tmp_path / "o")]))
    assert default.cache.root == str(tmp_path / "o" / "embedding_cache")


def test_every_option_is_one_flag_defaulting_to_its_field():
    """The parser is built from ``EvalArguments``: one flag per field, the field's default when unset."""
    actions = {a.dest: a for a in run.build_parser()._actions if a.dest != "help"}
    assert sorted(actions) == sorted(f.name for f in dataclasses.fields(run.EvalArguments))
    assert run.parse_args([]) == run.EvalArguments()
    assert run.parse_args([]).task_name is not run.parse_args([]).task_name  # a fresh list each time
    typed = run.parse_args(["--batch_size", "3", "--max_length_cap", "9", "--top_k", "5"])
    assert (typed.batch_size, typed.max_length_cap, typed.top_k) == (3, 9, 5)
    for f in setting_fields():  # unset: the checkpoint's own, else the default shown (a factory's too)
        assert f"else {clihelp.default_text(f)}" in actions[f.name].help, actions[f.name].help


def test_max_length_cap_reaches_the_longembed_split_lengths():
    model = run.wrap_encoder(VectorStandIn(), run.parse_args(["--revision", "r", "--max_length_cap", "1024"]))
    assert model.max_length_cap == 1024
    assert model.mteb_model_meta.experiment_kwargs["length_cap"] == 1024  # and into the results' identity


@pytest.fixture(scope="module")
def tiny_cli_run(tmp_path_factory):
    """The ReasonAug fixture task through ``eval`` with the real tiny checkpoint, lengths overridden, every
    forward's token counts recorded; and the same without the overrides."""
    seen: dict[str, list[tuple[int, int]]] = {}
    state: dict[str, set] = {}
    real_forward = Encoder.forward

    def forward(self, features):
        seen[current].append((int(features["attention_mask"].sum(1).max()), int(features["embed_mask"].sum(1).max())))
        state[current].add((next(self.parameters()).dtype, self.config.pooling_mode, self.config.enable_bidirectional))
        return real_forward(self, features)

    Encoder.forward = forward
    try:
        overrides = ("--max_length", "48", "--doc_max_length", "6", "--torch_dtype", "bfloat16",
                     "--pooling_mode", "weighted_mean", "--enable_bidirectional", "false")
        for current, flags in (("default", ("--torch_dtype", "float32")), ("override", overrides)):
            seen[current], state[current] = [], set()
            out = tmp_path_factory.mktemp(current)
            code = cli.main(["eval", "--base_model_name_or_path", str(LLAMA_FIXTURE), "--local_task", str(REASONAUG),
                             "--output_dir", str(out), "--device", "cpu", "--batch_size", "64", "--no_progress_bar",
                             "--no_embedding_cache", *flags])
            assert code == 0
    finally:
        Encoder.forward = real_forward
    return SimpleNamespace(seen=seen, state=state)


def test_eval_encoder_flags_reach_the_encoder(tiny_cli_run):
    assert tiny_cli_run.state["default"] == {(torch.float32, "mean", True)}
    assert tiny_cli_run.state["override"] == {(torch.bfloat16, "weighted_mean", False)}
    default, override = tiny_cli_run.seen["default"], tiny_cli_run.seen["override"]
    assert max(total for total, _ in default) > 48 and max(span for _, span in default) > 6  # the flags matter
    assert max(total for total, _ in override) <= 48
    assert max(span for _, span in override) == 6


def test_the_cache_key_changes_with_the_weights_alone(tmp_path):
    import mteb
    from mteb.types import PromptType

    encoder = Encoder.from_pretrained(str(LLAMA_FIXTURE), torch_dtype=torch.float32, device="cpu")
    meta = mteb.get_task("LEMBQMSumRetrieval").metadata
    texts = ["alpha beta", "gamma delta"]
    batch = [{"id": ["1", "2"], "text": texts, "title": ["", ""], "body": texts}]

    def run_once():
        cache = EmbeddingCache(str(tmp_path))
        model = MTEBEncoder(encoder, name="same/name", revision="same-revision", cache=cache)
        out = model.encode(batch, task_metadata=meta, hf_split="test", hf_subset="default",
                           prompt_type=PromptType.document)
        return out, cache.stats.encoded

    first, encoded = run_once()
    assert encoded == 2
    _, encoded = run_once()
    assert encoded == 0
    with torch.no_grad():
        next(encoder.model.parameters()).add_(0.05)  # other weights; name, revision and settings unchanged
    changed, encoded = run_once()
    assert encoded == 2, "vectors of other weights must not be served from the cache"
    assert_close_normwise(
        changed, encoder.encode([["", t] for t in texts], convert_to_numpy=True),
        eps_multiple=ORDER_EPS, rows=True
    )
    assert not np.allclose(changed, first, atol=1e-4)
