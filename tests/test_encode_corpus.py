"""``diffusion-embedder encode``: the same arrays from 1 process, 2 torchrun ranks or a 2-job array; a killed
rank leaves complete chunks only and the rerun encodes just the rest; a folder never mixes models, settings or
corpora; ``load_embeddings`` reads it back in corpus order and refuses what is incomplete or damaged.

The tiny llama fixture encodes the ReasonAug BEIR corpus (100 documents) in 7 chunks of at most 16.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import LLAMA_FIXTURE, ROOT

from diffusion_embedder.data.jsonl import DataFormatError
from diffusion_embedder.evaluation import encode_corpus as ec
from diffusion_embedder.evaluation import store
from diffusion_embedder.evaluation.options import process_share

CORPUS = ROOT / "tests" / "fixtures" / "beir" / "reasonaug" / "corpus.jsonl"
SCRIPT = ROOT / "experiments" / "encode_corpus.py"
NUM_CHUNKS = 7


def argv(out: Path, *extra: str, corpus: Path = CORPUS) -> list[str]:
    return ["--base_model_name_or_path", str(LLAMA_FIXTURE), "--corpus", str(corpus), "--output_dir", str(out),
            "--chunk_size", "16", "--batch_size", "8", "--no_progress_bar", *extra]


def torchrun(script: Path, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def complete_chunks(folder: Path) -> list[int]:
    return sorted(int(p.name[len("chunk-"):-len(".json")]) for p in folder.glob("chunk-*.json"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, list[str], np.ndarray]:
    """One process, the whole corpus."""
    out = tmp_path_factory.mktemp("one_process")
    stats = ec.encode_corpus(ec.parse_args(argv(out, "--device", "cpu")))
    assert (stats.encoded_chunks, stats.encoded_texts, stats.skipped_chunks) == (NUM_CHUNKS, 100, 0)
    ids, matrix = store.load_embeddings(str(out))
    return out, ids, matrix


def test_the_folder_and_what_it_reads_back(reference):
    out, ids, matrix = reference
    corpus = [json.loads(line) for line in CORPUS.read_text().splitlines()]
    assert ids == [d["_id"] for d in corpus] and matrix.shape == (100, 64) and matrix.dtype == np.float32
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["model"]["base_model_name_or_path"] == str(LLAMA_FIXTURE)
    assert len(manifest["model"]["weights_sha256"]) == 64 and manifest["torch_dtype"] == "float32"
    assert manifest["settings"]["pooling_mode"] == "mean" and manifest["embedding_dim"] == 64
    assert manifest["corpus"]["num_rows"] == 100 and manifest["chunks"]["num_chunks"] == NUM_CHUNKS
    assert {"version", "num_shards"} <= manifest.keys()
    assert complete_chunks(out) == list(range(NUM_CHUNKS)) and not list(out.glob("*tmp*"))
    # the documents are encoded as the evaluation encodes them (one chunk = one encode call of ["", text])
    from diffusion_embedder.evaluation.sharding import ShardedEncoder, load_checkpoint

    encoder = load_checkpoint(str(LLAMA_FIXTURE), device="cpu")
    evaluated = ShardedEncoder(encoder, chunk_size=16).encode([["", d["text"]] for d in corpus], batch_size=8)
    assert np.array_equal(evaluated, matrix)


def test_two_torchrun_ranks_and_a_two_job_array_write_the_same_arrays(reference, tmp_path, capsys):
    _, ids, matrix = reference
    result = torchrun(SCRIPT, *argv(tmp_path / "torchrun"))
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]
    assert result.stdout.count("Encoded 7 chunks (100 texts); 0 chunks were complete already.") == 1  # rank 0 prints
    read_ids, read = store.load_embeddings(str(tmp_path / "torchrun"))
    assert read_ids == ids and np.array_equal(read, matrix)
    array = tmp_path / "array"
    assert ec.main(argv(array, "--num_shards", "2", "--shard_index", "0")) == 0
    assert complete_chunks(array) == [0, 2, 4, 6]
    assert "4 of 7 chunks, other shards still to run" in capsys.readouterr().out
    with pytest.raises(ValueError, match="chunk-000001.json: missing .*rerun the command that wrote"):
        store.load_embeddings(str(array))
    assert ec.main(argv(array, "--num_shards", "2", "--shard_index", "1")) == 0
    assert "7 of 7 chunks, complete" in capsys.readouterr().out
    read_ids, read = store.load_embeddings(str(array))
    assert read_ids == ids and np.array_equal(read, matrix)


DYING = """
import os, signal, sys
from diffusion_embedder.evaluation import encode_corpus as ec

real_replace, moved = os.replace, []

def replace(src, dst):
    real_replace(src, dst)
    if os.environ["RANK"] == "1" and "chunk-" in os.fspath(dst):
        moved.append(dst)
        if len(moved) == 3:  # rank 1 dies inside its second chunk's write, its first file just in place
            os.kill(os.getpid(), signal.SIGKILL)

os.replace = replace
sys.exit(ec.main())
"""


def test_a_killed_rank_leaves_complete_chunks_and_the_rerun_encodes_only_the_rest(reference, tmp_path):
    _, ids, matrix = reference
    script = tmp_path / "dying.py"
    script.write_text(textwrap.dedent(DYING))
    out = tmp_path / "out"
    result = torchrun(script, *argv(out))
    assert result.returncode != 0
    done = complete_chunks(out)
    assert 1 in done and 3 not in done and 5 not in done  # rank 1 has chunks 1, 3, 5 and died on 3
    assert (out / "chunk-000003.npy").exists()  # its rows are there, without their record
    made_by = store.identity(json.loads((out / "manifest.json").read_text()))
    for index in done:
        store.check_chunk(str(out), index, 64, made_by)  # every chunk with a record is complete and intact
    with pytest.raises(ValueError, match="was not completed"):
        store.load_embeddings(str(out))
    stats = ec.encode_corpus(ec.parse_args(argv(out, "--device", "cpu")))
    missing = sorted(set(range(NUM_CHUNKS)) - set(done))
    assert stats.chunks == missing and stats.skipped_chunks == len(done)
    assert stats.encoded_texts == sum(16 if i < 6 else 4 for i in missing)
    read_ids, read = store.load_embeddings(str(out))
    assert read_ids == ids and np.array_equal(read, matrix)


def test_a_damaged_chunk_is_refused_by_the_reader_and_encoded_again(reference, tmp_path, caplog):
    out = tmp_path / "copy"
    shutil.copytree(reference[0], out)
    path = out / "chunk-000002.npy"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="chunk-000002.npy: its bytes changed"):
        store.load_embeddings(str(out))
    with caplog.at_level(logging.WARNING):
        stats = ec.encode_corpus(ec.parse_args(argv(out, "--device", "cpu")))
    assert stats.chunks == [2] and "Encoding chunk 2 again" in caplog.text
    assert np.array_equal(store.load_embeddings(str(out))[1], reference[2])


def test_chunks_of_another_model_or_setting_are_never_reused_even_without_the_manifest(reference, tmp_path, caplog):
    """Deleting manifest.json (to get past the refusal) and rerunning with other settings re-encodes every chunk,
    and a manifest put back beside chunks it did not make is refused by the reader."""
    out = tmp_path / "copy"
    shutil.copytree(reference[0], out)
    original = (out / "manifest.json").read_text()
    (out / "manifest.json").unlink()
    with caplog.at_level(logging.WARNING):
        stats = ec.encode_corpus(ec.parse_args(argv(out, "--device", "cpu", "--pooling_mode", "weighted_mean")))
    assert stats.chunks == list(range(NUM_CHUNKS)) and stats.skipped_chunks == 0
    assert "made by another model, settings or corpus" in caplog.text
    _, weighted = store.load_embeddings(str(out))
    assert not np.allclose(weighted, reference[2])
    (out / "manifest.json").write_text(original)
    with pytest.raises(ValueError, match="chunk-000000.json: made by another model, settings or corpus"):
        store.load_embeddings(str(out))


def test_another_model_setting_or_corpus_is_refused_naming_what_differs(reference, tmp_path, family_checkpoint):
    out = reference[0]
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(ValueError, match=r"another model.*encoder setting pooling_mode: 'mean' there, 'weighted_mean'"):
        ec.encode_corpus(ec.parse_args(argv(out, "--device", "cpu", "--pooling_mode", "weighted_mean")))
    edited = tmp_path / "corpus.jsonl"
    lines = CORPUS.read_text().splitlines()
    edited.write_text("\n".join([lines[0].replace("book", "film", 1), *lines[1:]]) + "\n")
    with pytest.raises(ValueError, match=r"corpus.fingerprint: '[0-9a-f]{64}' there"):
        ec.encode_corpus(ec.parse_args(argv(out, "--device", "cpu", corpus=edited)))
    other = argv(out, "--device", "cpu")
    other[1] = str(family_checkpoint("llama"))
    with pytest.raises(ValueError, match=r"model.weights_sha256"):
        ec.encode_corpus(ec.parse_args(other))
    assert sorted(p.name for p in out.iterdir()) == before  # nothing written


def test_the_command_refuses_another_setting_with_status_2_and_the_message_alone(reference, tmp_path, capsys,
                                                                                   monkeypatch):
    """Before, the refusal came as a traceback with exit status 1. Another corpus is refused before the model loads
    (it is known without the model); another setting once the model says what it computes."""
    out = reference[0]
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert ec.main(argv(out, "--device", "cpu", "--pooling_mode", "weighted_mean")) == 2
    err = capsys.readouterr().err  # transformers' weight-loading bar, then the message alone
    assert err.splitlines()[-1].startswith(f"error: {out} holds the embeddings of another model, settings or corpus")
    assert "encoder setting pooling_mode: 'mean' there, 'weighted_mean' now" in err and "Traceback" not in err
    edited = tmp_path / "corpus.jsonl"
    edited.write_text(CORPUS.read_text().replace("book", "film", 1))
    monkeypatch.setattr(ec, "load_checkpoint", lambda *a, **k: pytest.fail("the model was loaded"))
    assert ec.main(argv(out, "--device", "cpu", corpus=edited)) == 2
    assert re.search(r"^error: .*corpus.fingerprint: '[0-9a-f]{64}' there, '[0-9a-f]{64}' now", capsys.readouterr().err)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # nothing written


def drop_chunks(folder: Path, indices: list[int]) -> None:
    for index in indices:
        for suffix in (".json", ".npy"):
            (folder / f"{store.chunk_name(index)}{suffix}").unlink()


def test_the_same_checkpoint_copied_elsewhere_resumes_the_run(reference, tmp_path, family_checkpoint):
    """The manifest names the model by its weights and settings: a copy of the checkpoint at another path finishes
    the run (encoding only the missing chunks, to the same vectors); other weights are still refused."""
    out = tmp_path / "out"
    shutil.copytree(reference[0], out)
    drop_chunks(out, [2, 5])
    moved = shutil.copytree(LLAMA_FIXTURE, tmp_path / "elsewhere" / "renamed-llama")
    resumed = argv(out, "--device", "cpu")
    resumed[1] = str(moved)
    stats = ec.encode_corpus(ec.parse_args(resumed))
    assert (stats.chunks, stats.skipped_chunks) == ([2, 5], NUM_CHUNKS - 2)
    ids, matrix = store.load_embeddings(str(out))
    assert ids == reference[1] and np.array_equal(matrix, reference[2])
    drop_chunks(out, [0])
    before = sorted(p.name for p in out.iterdir())
    other = argv(out, "--device", "cpu")
    other[1] = str(family_checkpoint("llama"))  # same architecture and settings, other weights
    with pytest.raises(ValueError, match=r"another model.*model.weights_sha256"):
        ec.encode_corpus(ec.parse_args(other))
    assert sorted(p.name for p in out.iterdir()) == before
    # the same weights with an edited config.json (what the model computes with): another model too
    config = json.loads((moved / "config.json").read_text())
    (moved / "config.json").write_text(json.dumps({**config, "rope_theta": 10.0}))
    with pytest.raises(ValueError, match=r"another model.*model.backbone_sha256"):
        ec.encode_corpus(ec.parse_args(resumed))
    assert sorted(p.name for p in out.iterdir()) == before


def test_the_same_adapter_copied_elsewhere_resumes_the_run_and_another_adapter_is_refused(tmp_path):
    from conftest import randomize_lora_b
    from peft import LoraConfig, get_peft_model

    from diffusion_embedder import Encoder

    def adapter(folder: Path, seed: int) -> Path:
        encoder = Encoder.from_pretrained(str(LLAMA_FIXTURE), device="cpu")
        encoder.model = get_peft_model(encoder.model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
        torch.manual_seed(seed)
        randomize_lora_b(encoder.model, 0.5)
        encoder.save(str(folder))
        return folder

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(CORPUS.read_text().splitlines()[:20]) + "\n")  # 2 chunks of 16 and 4
    first, out = adapter(tmp_path / "run" / "checkpoint-10", 0), tmp_path / "out"
    run = argv(out, "--device", "cpu", corpus=corpus)
    run[1] = str(first)
    assert ec.encode_corpus(ec.parse_args(run)).chunks == [0, 1]
    _, whole = store.load_embeddings(str(out))
    drop_chunks(out, [1])
    run[1] = str(shutil.copytree(first, tmp_path / "copied" / "adapter"))
    stats = ec.encode_corpus(ec.parse_args(run))
    assert (stats.chunks, stats.skipped_chunks) == ([1], 1)
    assert np.array_equal(store.load_embeddings(str(out))[1], whole)
    drop_chunks(out, [1])
    run[1] = str(adapter(tmp_path / "other" / "checkpoint-10", 1))  # same base, same path name, other LoRA weights
    with pytest.raises(ValueError, match=r"model.weights_sha256"):
        ec.encode_corpus(ec.parse_args(run))


def test_an_mteb_task_s_corpus_is_the_same_corpus(reference, monkeypatch, capsys):
    from diffusion_embedder.evaluation import tasks
    from diffusion_embedder.evaluation.local import load_local_task

    monkeypatch.setattr(tasks, "get_mteb_task", lambda name, data_dir=None: load_local_task(str(CORPUS.parent)))
    args = [a for a in argv(reference[0], "--device", "cpu") if a != str(CORPUS)]
    args[args.index("--corpus")] = "--task_name"
    args.insert(args.index("--task_name") + 1, "ReasonAugConceptRetrieval")
    assert ec.main(args) == 0  # same documents, same fingerprint: every chunk is already there
    assert "Encoded 0 chunks (0 texts); 7 chunks were complete already." in capsys.readouterr().out


def test_documents_are_joined_as_mteb_joins_them():
    from mteb._create_dataloaders import _corpus_to_dict

    for title, text in [("", " body "), ("Title", "body"), ("Title ", " body\n"), ("T", "")]:
        row = {"id": "1", "title": title, "text": text}
        assert ec.document_text(title, text) == _corpus_to_dict(row)["text"]
    assert ec.document_text(None, " body ") == "body"


def test_any_jsonl_with_an_id_and_a_text_field(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"doc": 7, "body": "first text", "title": "ignored"}\n{"doc": "b", "body": "second"}\n')
    out = tmp_path / "out"
    assert ec.main(argv(out, "--id_field", "doc", "--text_field", "body", "--title_field", "", corpus=path)) == 0
    ids, matrix = store.load_embeddings(str(out))
    from diffusion_embedder.evaluation.sharding import load_checkpoint

    expected = load_checkpoint(str(LLAMA_FIXTURE), device="cpu").encode(
        [["", "first text"], ["", "second"]], convert_to_numpy=True, batch_size=8)
    assert ids == ["7", "b"] and np.array_equal(matrix, expected)


@pytest.mark.parametrize(("content", "message"), [
    ('{"_id": "1", "text": "a"}\n{"_id": "2"}\n', r"docs.jsonl:2: missing field 'text'"),
    ('{"_id": "1", "text": "a"}\n{"_id": "2", "text": "b"}\n{"_id": "1", "text": "c"}\n',
     r"docs.jsonl:3: duplicate _id '1' \(first on line 1\)"),
    ("", "no records"),
])
def test_bad_corpus_files_name_file_and_line(tmp_path, content, message):
    path = tmp_path / "docs.jsonl"
    path.write_text(content)
    with pytest.raises(DataFormatError, match=message):
        ec.encode_corpus(ec.parse_args(argv(tmp_path / "out", corpus=path)))


def test_shares_of_a_job_array_under_torchrun(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    args = ec.parse_args(argv(Path("out"), "--num_shards", "3", "--shard_index", "2"))
    assert process_share(args) == (5, 6)  # job 2 of 3, rank 1 of 2: share 5 of 6
    args.shard_index = 3  # checked with every flag, before the model loads
    with pytest.raises(ValueError, match="--shard_index 3 is not in 0 .. --num_shards - 1 = 2"):
        ec.check_arguments(args)


def test_help_lists_every_option_with_its_default(capsys, monkeypatch):
    from test_config import _entries

    from diffusion_embedder import cli

    monkeypatch.setenv("COLUMNS", "400")
    with pytest.raises(SystemExit):
        cli.main(["encode", "--help"])
    text = capsys.readouterr().out
    assert text.startswith("usage: diffusion-embedder encode ")
    entries = _entries(text)
    for action in ec.build_parser()._actions:
        if action.option_strings and action.dest != "help":
            assert "default: " in entries[action.option_strings[-1]], action.option_strings
    assert "--pooling_mode" in entries and "--max_tokens_per_batch" in entries  # the encoder settings, as eval's
