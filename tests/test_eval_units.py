"""Evaluation plumbing without running mteb: task names, instructions, encoder inputs, lengths, cache, identity."""

from __future__ import annotations

import json
import os
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import LLAMA_FIXTURE
from numerics import ORDER_EPS, assert_close_normwise

from diffusion_embedder import Encoder
from diffusion_embedder.evaluation import local, tasks
from diffusion_embedder.evaluation.cache import EmbeddingCache
from diffusion_embedder.evaluation.mteb_model import MTEBEncoder
from diffusion_embedder.evaluation.results import check_identity

BRIGHT_INSTRUCTION = (
    "Given this reasoning-intensive query, find relevant documents that could help answer the question:"
)


class RecordingStandIn:
    """Deterministic encoder with the Encoder.encode signature; records its inputs and config at call time."""

    def __init__(self):
        self.config = SimpleNamespace(max_length=512, doc_max_length=400)
        self.config.to_dict = lambda: {"max_length": self.config.max_length, "kind": "stand-in"}
        self.calls: list[dict] = []

    def encode(self, sentences, batch_size=32, show_progress_bar=True, convert_to_numpy=False, **kwargs):
        self.calls.append({"inputs": [list(s) for s in sentences],
                           "max_length": kwargs.get("max_length", self.config.max_length),
                           "doc_max_length": kwargs.get("doc_max_length", self.config.doc_max_length)})
        return np.array([[len(t), t.count("a") + 1.0] for _, t in sentences], dtype=np.float32)


def metadata(name: str):
    import mteb

    return mteb.get_task(name).metadata


# ------------------------------------------------------------------ task names and instructions
def test_unknown_task_name_lists_close_matches():
    with pytest.raises(ValueError, match="Unknown mteb task 'Core17InstructionRetrievl'.*Core17InstructionRetrieval"):
        tasks.resolve_task_names(["Core17InstructionRetrievl"])
    with pytest.raises(ValueError, match="Unknown benchmark 'brigth'"):
        tasks.resolve_task_names(benchmark="brigth")


def test_benchmarks_name_real_mteb_tasks_and_upstream_aliases_resolve():
    import mteb

    known = {t.metadata.name for t in mteb.get_tasks(exclude_superseded=False)}
    assert set(tasks.BENCHMARKS["all"]) <= known
    assert len(tasks.BENCHMARKS["all"]) == 3 + 6 + 12
    assert tasks.resolve_task_names(["BrightAops", "BrightStackOverflow"]) == [
        "BrightAopsRetrieval",
        "BrightStackoverflowRetrieval",
    ]
    assert tasks.resolve_task_names(["BrightPonyRetrieval"], benchmark="followir")[-1] == "BrightPonyRetrieval"


def test_shipped_instructions_cover_every_task_we_run():
    instructions = tasks.load_instructions()
    for name in tasks.BENCHMARKS["all"]:
        assert name in instructions, name
    for domain in ("EarthScience", "Psychology", "Robotics", "SustainableLiving"):  # missing upstream
        assert instructions[f"Bright{domain}Retrieval"] == BRIGHT_INSTRUCTION
    assert instructions["News21InstructionRetrieval"] == "Retrieve text based on user query:"
    # the upstream file's entries are kept
    assert instructions["SciFact"] == "Given a scientific claim, retrieve documents that support or refute the claim:"


def test_query_instruction_fallbacks_and_override_file(tmp_path):
    assert tasks.query_instruction("X", {}, {"query": "Represent this biology post for searching: "}) == (
        "Represent this biology post for searching:"
    )
    assert tasks.query_instruction("X", {}, None) == "Retrieve text based on user query:"
    assert tasks.query_instruction("BrightAopsRetrieval", {"BrightAops": "old name"}, None) == "old name"
    path = tmp_path / "inst.json"
    path.write_text(json.dumps({"News21InstructionRetrieval": "Find news:"}))
    assert tasks.load_instructions(str(path)) == {"News21InstructionRetrieval": "Find news:"}
    path.write_text('{"A": 3}')
    with pytest.raises(ValueError, match="inst.json: the instruction of 'A' must be a string"):
        tasks.load_instructions(str(path))


def test_data_dir_points_the_real_task_at_a_local_copy(tmp_path):
    (tmp_path / "mteb" / "Core17InstructionRetrieval").mkdir(parents=True)
    task = tasks.get_mteb_task("Core17InstructionRetrieval", str(tmp_path))
    assert task.metadata.name == "Core17InstructionRetrieval"
    assert task.metadata.dataset["path"] == str(tmp_path / "mteb" / "Core17InstructionRetrieval")
    with pytest.raises(FileNotFoundError, match="no local copy of 'dwzhu/LongEmbed'"):
        tasks.get_mteb_task("LEMBQMSumRetrieval", str(tmp_path))


# ------------------------------------------------------------------ what the encoder receives
def test_queries_get_the_task_instruction_and_followir_template_documents_none():
    stand_in = RecordingStandIn()
    instructions = {"News21InstructionRetrieval": "Retrieve news:"}
    model = MTEBEncoder(stand_in, instructions=instructions, revision="r0",
                        query_template="Instruct: {instruction}\nQuery: {query}")
    from mteb.types import PromptType

    meta = metadata("News21InstructionRetrieval")
    queries = [{"id": ["1-og"], "query": ["q text"], "instruction": ["narrative"], "text": ["q text narrative"]}]
    docs = [{"id": ["d1", "d2"], "text": ["t1 body", "b2"], "title": ["t1", ""], "body": ["body", "b2"]}]
    model.encode(queries, task_metadata=meta, hf_split="test", hf_subset="default", prompt_type=PromptType.query)
    model.encode(docs, task_metadata=meta, hf_split="test", hf_subset="default", prompt_type=PromptType.document)
    assert stand_in.calls[0]["inputs"] == [["Retrieve news:", "Instruct: narrative\nQuery: q text"]]
    assert stand_in.calls[1]["inputs"] == [["", "t1 body"], ["", "b2"]]
    # the default template: query then instruction (upstream and mteb)
    default = MTEBEncoder(stand_in, instructions=instructions, revision="r0")
    default.encode(queries, task_metadata=meta, hf_split="test", hf_subset="default", prompt_type=PromptType.query)
    assert stand_in.calls[2]["inputs"] == [["Retrieve news:", "q text narrative"]]
    with pytest.raises(ValueError, match="query_template must contain"):
        MTEBEncoder(stand_in, revision="r0", query_template="{query}")


def test_longembed_length_splits_pass_per_call_lengths_and_leave_the_config_alone():
    from mteb.types import PromptType

    stand_in = RecordingStandIn()
    model = MTEBEncoder(stand_in, revision="r0", max_length_cap=8192, cache=None)
    meta = metadata("LEMBPasskeyRetrieval")
    batch = [{"id": ["d"], "text": ["a passkey doc"], "title": [""], "body": ["a passkey doc"]}]
    for split in ("test_4096", "test_32768", "test"):
        model.encode(batch, task_metadata=meta, hf_split=split, hf_subset="default", prompt_type=PromptType.document)
    seen = [(c["max_length"], c["doc_max_length"]) for c in stand_in.calls]
    assert seen == [(4096, 4096), (8192, 8192), (512, 400)]
    assert (stand_in.config.max_length, stand_in.config.doc_max_length) == (512, 400)


# ------------------------------------------------------------------ cache and identity
def test_cache_is_hit_on_the_second_pass_and_invalidated_by_model_or_settings(tmp_path, family_checkpoint):
    from mteb.types import PromptType

    texts = ["alpha beta", "gamma", "alpha beta", "delta epsilon zeta"]
    batch = [{"id": [str(i) for i in range(4)], "text": texts, "title": [""] * 4, "body": texts}]
    meta = metadata("LEMBQMSumRetrieval")
    cache = EmbeddingCache(str(tmp_path / "cache"))
    encoder = Encoder.from_pretrained(str(LLAMA_FIXTURE), torch_dtype=torch.float32, device="cpu")

    def run(model):
        before = cache.stats.encoded
        out = model.encode(batch, task_metadata=meta, hf_split="test", hf_subset="default",
                           prompt_type=PromptType.document)
        return out, cache.stats.encoded - before

    first, encoded = run(MTEBEncoder(encoder, cache=cache))
    assert encoded == 3  # the duplicate text is encoded once
    expected = encoder.encode([["", t] for t in texts], convert_to_numpy=True)
    assert_close_normwise(first, expected, eps_multiple=ORDER_EPS, rows=True)
    second, encoded = run(MTEBEncoder(encoder, cache=EmbeddingCache(str(tmp_path / "cache"))))
    assert encoded == 0
    np.testing.assert_array_equal(second, first)
    # settings change -> new key
    encoder.pooling_mode = "weighted_mean"
    third, encoded = run(MTEBEncoder(encoder, cache=cache))
    assert encoded == 3 and not np.allclose(third, first)
    encoder.pooling_mode = "mean"
    # another checkpoint (same architecture, other weights) -> new key
    other = Encoder.from_pretrained(str(family_checkpoint("llama")), torch_dtype=torch.float32, device="cpu")
    fourth, encoded = run(MTEBEncoder(other, cache=cache))
    assert encoded == 3 and not np.allclose(fourth, first)


#: Encodings of the same weights that must not share cached vectors: (encoder settings, evaluation split).
#: ``test_8`` / ``test_16`` are LongEmbed-style length splits (the split sets max_length and doc_max_length).
CACHE_VARIANTS = {
    "checkpoint's own settings": ({}, "test"),
    "pooling_mode": ({"pooling_mode": "weighted_mean"}, "test"),
    "doc_max_length": ({"doc_max_length": 5}, "test"),
    "skip_instruction": ({"skip_instruction": False}, "test"),
    "prompt_template": ({"prompt_template": "Passage: {text}"}, "test"),
    "LongEmbed split test_8": ({}, "test_8"),
    "LongEmbed split test_16": ({}, "test_16"),
}


def test_one_cache_folder_never_hands_one_encodings_vectors_to_another(tmp_path):
    """Same weights, same name and revision (as with ``--revision``), one cache folder: each encoding gets its
    own vectors, equal to the same call without a cache, and a second pass serves each its own."""
    from mteb.types import PromptType

    texts = ["alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu",
             "the quick brown fox jumps over the lazy dog and runs far away into the woods",
             "one two three four five six seven eight nine ten eleven twelve"]
    batch = [{"id": ["1", "2", "3"], "text": texts, "title": [""] * 3, "body": texts}]
    meta = metadata("LEMBQMSumRetrieval")
    encoders = {what: Encoder.from_pretrained(str(LLAMA_FIXTURE), torch_dtype=torch.float32, device="cpu", **settings)
                for what, (settings, _) in CACHE_VARIANTS.items()}

    def encode(what, cache):
        model = MTEBEncoder(encoders[what], name="same/name", revision="same-revision", cache=cache,
                            max_length_cap=8192)
        return model.encode(batch, task_metadata=meta, hf_split=CACHE_VARIANTS[what][1], hf_subset="default",
                            prompt_type=PromptType.document)

    first: dict[str, np.ndarray] = {}
    cache = EmbeddingCache(str(tmp_path / "shared"))
    for what in CACHE_VARIANTS:
        before = cache.stats.encoded
        first[what] = encode(what, cache)
        assert cache.stats.encoded - before == len(texts), f"{what}: served another encoding's vectors"
        # same texts, same batches as the cache's encode: the same float32 rows, bit for bit
        np.testing.assert_array_equal(first[what], encode(what, None), err_msg=what)
    names = list(CACHE_VARIANTS)
    for i, a in enumerate(names):  # each setting changes the vectors (else this test could not see a shared key)
        for b in names[i + 1:]:
            assert not np.allclose(first[a], first[b], atol=1e-4), f"{a} and {b} give the same vectors"
    again = EmbeddingCache(str(tmp_path / "shared"))
    for what in CACHE_VARIANTS:
        np.testing.assert_array_equal(encode(what, again), first[what], err_msg=what)
    assert again.stats.encoded == 0 and again.stats.hits == len(texts) * len(CACHE_VARIANTS)


def test_revision_is_a_hash_of_weights_and_settings_ablations_go_to_experiment_kwargs(family_checkpoint):
    def meta(path, overrides=None, **kw):
        enc = Encoder.from_pretrained(str(path), torch_dtype=torch.float32, device="cpu", **kw, **(overrides or {}))
        return MTEBEncoder(enc, overrides=overrides).mteb_model_meta

    a, a_again = meta(LLAMA_FIXTURE), meta(LLAMA_FIXTURE)
    assert (a.name, a.revision) == (a_again.name, a_again.revision)
    assert meta(family_checkpoint("llama")).revision != a.revision
    # other settings without saying they are an override (an API user): another revision, never a's scores
    assert meta(LLAMA_FIXTURE, max_length=256).revision != a.revision
    assert meta(LLAMA_FIXTURE, enable_bidirectional=False).revision != a.revision
    # the checkpoint's own settings: mteb's standard path; an override: an experiments/ folder naming it
    assert a.experiment_name is None
    causal = meta(LLAMA_FIXTURE, overrides={"enable_bidirectional": False, "pooling_mode": "eos_token"})
    assert causal.experiment_name == "enable_bidirectional_False__pooling_mode_eos_token"


def test_an_edited_backbone_config_or_tokenizer_is_another_revision_and_a_copy_is_not(tmp_path):
    """The weights and encoder settings alone missed what else a checkpoint computes with: a context stretched by
    ``rope_theta`` in config.json, or an edited tokenizer, kept the revision, so the old scores (and cached document
    vectors) were reused. A copy at another path is still the same revision."""
    def revision(path):
        return MTEBEncoder(Encoder.from_pretrained(str(path), torch_dtype=torch.float32, device="cpu")).identity[
            "revision"]

    copy = shutil.copytree(LLAMA_FIXTURE, tmp_path / "copy")
    assert revision(copy) == revision(LLAMA_FIXTURE)
    stretched = shutil.copytree(LLAMA_FIXTURE, tmp_path / "stretched")
    config = json.loads((stretched / "config.json").read_text())
    (stretched / "config.json").write_text(json.dumps({**config, "rope_theta": 10.0}))
    retokenized = shutil.copytree(LLAMA_FIXTURE, tmp_path / "retokenized")
    tokenizer = json.loads((retokenized / "tokenizer.json").read_text())
    tokenizer["normalizer"] = {"type": "Lowercase"}
    (retokenized / "tokenizer.json").write_text(json.dumps(tokenizer))
    revisions = {revision(LLAMA_FIXTURE), revision(stretched), revision(retokenized)}
    assert len(revisions) == 3
    # the tokenizer's truncation and padding are call state (any Hugging Face call sets them), not the model's
    from diffusion_embedder.evaluation.results import backbone_hash

    encoder = Encoder.from_pretrained(str(LLAMA_FIXTURE), torch_dtype=torch.float32, device="cpu")
    before = backbone_hash(encoder)
    encoder.tokenizer(["a b c d"], truncation=True, max_length=2, padding="max_length")
    assert encoder.tokenizer.backend_tokenizer.truncation is not None and backbone_hash(encoder) == before


def test_a_store_written_before_the_backbone_hash_still_reads():
    """Its chunks were stamped with the identity of the keys then: a manifest without ``model.backbone_sha256``
    still hashes to that (computed here by hand), so the store reads; one with it is another identity."""
    import hashlib

    from diffusion_embedder.evaluation.store import IDENTITY_KEYS, identity

    old = {"format": "f", "model": {"weights_sha256": "w"}, "settings": {"pooling_mode": "mean"},
           "torch_dtype": "float32", "embedding_dim": 4, "corpus": {"fingerprint": "c", "num_rows": 3},
           "chunks": {"chunk_size": 2, "chunk_chars": 100, "num_chunks": 2}}
    then = [k for k in IDENTITY_KEYS if k != "model.backbone_sha256"]
    values = [old["format"], "w", old["settings"], "float32", 4, "c", 3, 2, 100, 2]
    assert len(then) == len(values)
    assert identity(old) == hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()
    assert identity({**old, "model": {"weights_sha256": "w", "backbone_sha256": "b"}}) != identity(old)


@pytest.mark.parametrize("name", ["cosine", "dot", "euclidean", "manhattan"])
def test_scores_are_the_encoders_similarity_function(name):
    stand_in = RecordingStandIn()
    stand_in.config.to_dict = lambda: {"similarity_fn_name": name}
    model = MTEBEncoder(stand_in, revision="r", name="t/pairs")
    a, b = np.array([[3.0, 4.0], [1.0, 0.0]]), np.array([[6.0, 8.0], [0.0, 2.0]])
    expected = np.array({"cosine": [[1.0, 0.8], [0.6, 0.0]], "dot": [[50.0, 8.0], [6.0, 0.0]],
                         "euclidean": [[-5.0, -np.sqrt(13.0)], [-np.sqrt(89.0), -np.sqrt(5.0)]],
                         "manhattan": [[-7.0, -5.0], [-13.0, -3.0]]}[name])
    assert model.similarity(a, b).numpy() == pytest.approx(expected, abs=1e-6)
    assert model.similarity_pairwise(a, b).numpy() == pytest.approx(np.diag(expected), abs=1e-6)
    # mteb's ModelMeta names cosine and dot; it cannot read euclidean or manhattan back, so those are None
    assert model.mteb_model_meta.similarity_fn_name == {"cosine": "cosine", "dot": "dot"}.get(name)


def test_results_folder_of_another_checkpoint_is_refused(tmp_path):
    check_identity(tmp_path, {"weights": "aaa", "settings": {"pooling_mode": "mean"}})
    check_identity(tmp_path, {"weights": "aaa", "settings": {"pooling_mode": "mean"}})  # same: fine
    with pytest.raises(RuntimeError, match="holds results of another checkpoint"):
        check_identity(tmp_path, {"weights": "bbb", "settings": {"pooling_mode": "mean"}})
    # the same weights loaded from another folder are the same checkpoint
    check_identity(tmp_path, {"weights": "aaa", "settings": {"pooling_mode": "mean", "base_model_name_or_path": "/x"}})
    # the record is not a *.json (mteb's ResultCache reads those as results); an older folder's identity.json is
    # renamed on the next run, and still guards the folder
    assert [p.name for p in tmp_path.iterdir()] == ["identity.jsonl"]
    older = tmp_path / "older"
    older.mkdir()
    (older / "identity.json").write_text(json.dumps({"weights": "aaa", "settings": {"pooling_mode": "mean"}}))
    with pytest.raises(RuntimeError, match="holds results of another checkpoint"):
        check_identity(older, {"weights": "bbb", "settings": {"pooling_mode": "mean"}})
    assert [p.name for p in older.iterdir()] == ["identity.jsonl"]


def test_damaged_identity_record_names_the_file_and_the_remedy(tmp_path):
    for text, problem in (("{broken", r"identity.jsonl:1: not valid JSON"), ("[1]", r"expected a JSON object")):
        (tmp_path / "identity.jsonl").write_text(text)
        with pytest.raises(RuntimeError, match=problem + r".* Delete it to re-record this folder"):
            check_identity(tmp_path, {"weights": "aaa", "settings": {"pooling_mode": "mean"}})


# ------------------------------------------------------------------ local data
def test_bad_beir_folders_name_file_and_line(tmp_path):
    (tmp_path / "qrels").mkdir()
    (tmp_path / "corpus.jsonl").write_text('{"_id": "d1", "text": "x"}\n{"_id": "d2"}\n')
    (tmp_path / "queries.jsonl").write_text('{"_id": "q1", "text": "y"}\n')
    (tmp_path / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1\t1\n")
    with pytest.raises(ValueError, match=r"corpus.jsonl:2: missing field 'text'"):
        local.load_local_task(str(tmp_path))
    (tmp_path / "corpus.jsonl").write_text('{"_id": "d1", "text": "x"}\n')
    (tmp_path / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td9\t1\n")
    with pytest.raises(ValueError, match="corpus-id 'd9' is not in corpus.jsonl"):
        local.load_local_task(str(tmp_path))
    (tmp_path / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1\tyes\n")
    with pytest.raises(ValueError, match=r"test.tsv, line 2: score 'yes' is not an integer"):
        local.load_local_task(str(tmp_path))


def test_instruction_fixture_is_detected_and_its_changed_documents_derived():
    folder = os.path.join(os.path.dirname(__file__), "fixtures", "beir", "instructions")
    task = local.load_local_task(folder)
    assert task.metadata.main_score == "p-MRR" and task.metadata.type == "InstructionRetrieval"
    # relevant under the original instruction, not under the changed one
    assert task.changed_qrels == {"1": ["d1"], "2": ["d3", "d4"]}
    assert not local.is_instruction_task(["1-og", "2"])
