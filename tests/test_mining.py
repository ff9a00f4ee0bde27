"""``diffusion-embedder mine``: the negatives equal a float64 brute-force reference written here from the documented
rules, for every filter; positives (by id and by normalized text, also repeated in the corpus) and the query's own
text are never negatives; queries are encoded as training encodes them; FAISS and any block size give the exact
search's negatives; bad input is refused before the model loads; every flag reaches the code it controls; a rerun
reuses only what was made with the same model, settings and inputs.

The data: the ReasonAug BEIR fixture's 100 documents plus three copies (a positive's text in other case and
spacing, a non-positive's, a query's), and 24 pairs whose queries are the first words of their positive, so the
positives rank high and every filter has something to keep and something to drop.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import random
import shutil
import unicodedata
from pathlib import Path

import numpy as np
import pytest
from conftest import LLAMA_FIXTURE, ROOT
from numerics import HAND_EPS, ORDER_EPS, assert_close_normwise

from diffusion_embedder.evaluation.store import load_embeddings
from diffusion_embedder.mining import mine_hard_negatives

BEIR = ROOT / "tests" / "fixtures" / "beir" / "reasonaug" / "corpus.jsonl"
INSTRUCTION = "Given the start of a problem, retrieve the whole problem"


def build_inputs(folder: Path) -> tuple[Path, Path]:
    """corpus.jsonl (103 documents) and pairs.jsonl (24 records, 20 queries) in ``folder``."""
    docs = [json.loads(line) for line in BEIR.read_text().splitlines()]
    docs.append({"_id": "copy-of-positive", "title": "", "text": "  " + docs[0]["text"].upper().replace(" ", "   ")})
    docs.append({"_id": "copy-of-other", "title": "", "text": docs[50]["text"].replace(" ", "\t", 3)})
    pairs = []
    for i in range(0, 60, 3):  # 20 queries, each the first words of its positive
        words = docs[i]["text"].split()
        pairs.append({"query": " ".join(words[:14]), "positive": docs[i]["text"],
                      **({"instruction": INSTRUCTION} if i % 2 else {})})
    for i, j in ((0, 1), (3, 4), (6, 70)):  # three queries with a second positive
        pairs.append({**pairs[i // 3], "positive": docs[j]["text"]})
    docs.append({"_id": "copy-of-query", "title": "", "text": pairs[4]["query"].lower()})
    # a positive the corpus lacks (added to the documents), whose id names the corpus's own version of it
    pairs.append({"query": "Which problem is about a library's book recommendations?",
                  "positive": docs[90]["text"] + " (edited)", "positive_id": docs[90]["_id"]})
    corpus, pair_file = folder / "corpus.jsonl", folder / "pairs.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in docs))
    pair_file.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    return corpus, pair_file


@pytest.fixture(scope="module")
def encoder():
    from diffusion_embedder.evaluation.sharding import load_checkpoint

    return load_checkpoint(str(LLAMA_FIXTURE), device="cpu")


@pytest.fixture(scope="module")
def stores(tmp_path_factory, encoder) -> Path:
    """Inputs and both embedding stores, encoded once (a first mining run); tests copy the folder."""
    folder = tmp_path_factory.mktemp("mining")
    corpus, pairs = build_inputs(folder)
    mine_hard_negatives(str(pairs), str(folder / "out"), str(corpus), encoder=encoder,
                        positive_id_field="positive_id", chunk_size=32, batch_size=16)
    return folder


def copy_of(stores: Path, tmp_path: Path) -> tuple[Path, Path, Path]:
    shutil.copytree(stores, tmp_path / "in")
    return tmp_path / "in" / "corpus.jsonl", tmp_path / "in" / "pairs.jsonl", tmp_path / "in" / "out"


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---------------------------------------------------------------- the reference, from the documented rules


def normalized(text: str) -> str:
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


def trained_instruction(instruction: str | None) -> str:
    text = (instruction or "").strip()
    return text if not text or text.endswith((";", ":")) else text + ";"


def reference(folder: Path, options: dict, similarity: str = "cosine") -> list[list[str]]:
    """Each record's negative ids, brute force in float64 over the stored vectors (cosine, the fixture's, or
    negative euclidean distance)."""
    corpus = read_jsonl(folder / "corpus.jsonl")
    pairs = read_jsonl(folder / "pairs.jsonl")
    text_of = {d["_id"]: d["text"].strip() for d in corpus}  # no titles in these corpora
    text_of |= {f"pairs:{n}": p["positive"] for n, p in enumerate(pairs, 1) if normalized(p["positive"]) not in
                {normalized(d["text"]) for d in corpus}}
    doc_ids, doc_vectors = load_embeddings(str(folder / "out" / "documents"))
    query_ids, query_vectors = load_embeddings(str(folder / "out" / "queries"))
    unit = lambda m: m.astype(np.float64) / np.linalg.norm(m.astype(np.float64), axis=1, keepdims=True)  # noqa: E731
    if similarity == "cosine":
        scores = unit(query_vectors) @ unit(doc_vectors).T
    else:
        q, d = query_vectors.astype(np.float64), doc_vectors.astype(np.float64)
        scores = -np.linalg.norm(q[:, None, :] - d[None, :, :], axis=-1)
    texts = [text_of[i] for i in doc_ids]
    first_doc, first_normalized = {}, {}  # a positive is the document of its text, else of its normalized text
    for j, t in enumerate(texts):
        first_doc.setdefault(t, j)
        first_normalized.setdefault(normalized(t), j)
    queries: dict[tuple[str, str], dict] = {}
    for n, p in enumerate(pairs, 1):
        key = (trained_instruction(p.get("instruction")), p["query"])
        if key not in queries:
            queries[key] = {"row": query_ids.index(f"q:{n}"), "positives": [], "banned": {normalized(p["query"])}}
        q = queries[key]
        q["positives"].append(first_doc.get(p["positive"], first_normalized.get(normalized(p["positive"]))))
        q["banned"] |= {normalized(p["positive"])} | ({normalized(text_of[p["positive_id"]])}
                                                       if "positive_id" in p else set())
    room = max(len(q["banned"] & {normalized(t) for t in texts}) for q in queries.values())
    o = {"range_min": 0, "range_max": 50, "relative_margin": 0.05, "absolute_margin": None, "max_score": None,
         "min_score": None, "sampling": "top", "seed": 42, "num_negatives": 3} | options
    negatives = {}
    for (instruction, text), q in queries.items():
        s = scores[q["row"]]
        positive = min(s[j] for j in q["positives"])
        pool, distinct = [], set()  # the best documents up to the (range_max + room)-th distinct text
        for j in sorted(range(len(texts)), key=lambda j: (-s[j], j)):
            if len(distinct) == o["range_max"] + room:
                break
            pool.append(j)
            distinct.add(normalized(texts[j]))
        seen, kept = set(), []
        for j in pool:
            t = normalized(texts[j])
            if t in q["banned"] or t in seen:
                seen.add(t)
                continue
            seen.add(t)
            if o["absolute_margin"] is not None and s[j] + o["absolute_margin"] > positive:
                continue
            if o["relative_margin"] is not None and s[j] > positive - abs(positive) * o["relative_margin"]:
                continue
            if (o["max_score"] is not None and s[j] > o["max_score"]) or (
                    o["min_score"] is not None and s[j] < o["min_score"]):
                continue
            kept.append(j)
        window = kept[o["range_min"]:o["range_max"]]
        if o["sampling"] == "random":
            seed = json.dumps([o["seed"], instruction, text], ensure_ascii=False).encode()
            draw = random.Random(int.from_bytes(hashlib.sha256(seed).digest()[:8], "big"))
            window = [window[i] for i in sorted(draw.sample(range(len(window)), min(o["num_negatives"],
                                                                                    len(window))))]
        negatives[(instruction, text)] = [doc_ids[j] for j in window[:o["num_negatives"]]]
        # no near-tie can make float rounding choose: neighbours in the pool differ by far more than rounding
        ordered = np.sort(s[pool])
        assert np.diff(ordered).min() > 1e-9
    return [negatives[(trained_instruction(p.get("instruction")), p["query"])] for p in pairs]


FILTERS = {
    "no filter": {"relative_margin": None, "range_max": 10},
    "relative_margin": {"relative_margin": 0.05, "range_max": 10},
    "absolute_margin": {"relative_margin": None, "absolute_margin": 0.01, "range_max": 10},
    "max_score": {"relative_margin": None, "max_score": 0.7, "range_max": 10},
    "min_score": {"relative_margin": None, "min_score": 0.6, "range_max": 10},
    "relative_margin on negative scores": {"relative_margin": 0.05, "range_max": 10, "similarity": "euclidean"},
    "range_min and range_max": {"relative_margin": None, "range_min": 2, "range_max": 6},
    "random sampling": {"relative_margin": None, "range_max": 12, "sampling": "random", "seed": 7},
    "all at once": {"relative_margin": 0.01, "absolute_margin": 0.005, "max_score": 0.75, "min_score": 0.5,
                    "range_min": 1, "range_max": 9, "sampling": "random", "seed": 3},
}


@pytest.mark.parametrize("name", FILTERS)
def test_every_filter_gives_the_float64_reference_s_negatives(stores, tmp_path, encoder, name):
    """With euclidean similarity (negative scores) the relative margin is |positive| * margin below the positive,
    as sentence-transformers defines it (not (1 - margin) times the positive)."""
    corpus, pairs, out = copy_of(stores, tmp_path)
    options = dict(FILTERS[name])
    similarity = options.pop("similarity", "cosine")
    if similarity != "cosine":
        shutil.rmtree(out)  # the stores of another encoder setting are refused: encode again
        encoder = encoder.__class__.from_pretrained(str(LLAMA_FIXTURE), device="cpu", similarity_fn_name=similarity)
    summary = mine_hard_negatives(str(pairs), str(out), str(corpus), encoder=encoder, positive_id_field="positive_id",
                                  chunk_size=32, keep_fewer=True, **options)
    got = [r["negative_ids"] for r in read_jsonl(out / "negatives.jsonl")]
    assert got == reference(tmp_path / "in", options, similarity)
    # the filter did something: it dropped candidates, and records still got negatives
    for reason in ("relative_margin", "absolute_margin", "max_score", "min_score", "range_min"):
        if options.get(reason):
            assert summary.candidates_dropped[reason] > 0, (reason, summary.candidates_dropped)
    assert sum(map(len, got)) > len(got) and summary.candidates_dropped["excluded"] > 0
    assert summary.candidates_dropped["duplicate"] > 0  # the copy of another document


def test_positives_by_id_and_by_text_and_the_query_s_own_text_are_never_negatives(stores, tmp_path, encoder):
    corpus, pairs, out = copy_of(stores, tmp_path)
    mine_hard_negatives(str(pairs), str(out), str(corpus), encoder=encoder, positive_id_field="positive_id",
                        chunk_size=32, keep_fewer=True, relative_margin=None, range_max=30, num_negatives=30)
    docs = {d["_id"]: d["text"] for d in read_jsonl(corpus)}
    records = read_jsonl(out / "negatives.jsonl")
    positives: dict[str, set[str]] = {}
    for r in read_jsonl(pairs):
        positives.setdefault(r["query"], set()).add(normalized(r["positive"]))
        if "positive_id" in r:
            positives[r["query"]].add(normalized(docs[r["positive_id"]]))
    for r in records:
        banned = positives[r["query"]] | {normalized(r["query"])}
        assert not banned & {normalized(n) for n in r["negatives"]}, r["query"]
        assert len({normalized(n) for n in r["negatives"]}) == len(r["negatives"])  # no text twice
    by_query = {r["query"]: r["negative_ids"] for r in records}
    # the situations the data sets up are there: without the exclusions these documents would be negatives
    first = read_jsonl(pairs)[0]["query"]
    assert "copy-of-positive" not in by_query[first] and "c1r2" not in by_query[first]
    assert "copy-of-query" not in by_query[read_jsonl(pairs)[4]["query"]]
    assert docs_id_90(corpus) not in by_query["Which problem is about a library's book recommendations?"]


def test_copies_of_a_document_take_no_room_from_the_window(stores, tmp_path, encoder):
    """The search counts distinct texts, as sentence-transformers searches a de-duplicated corpus: five copies of a
    query's best negative, appended to the corpus, leave every record's negatives as they were (before, each copy
    took a place among the range_max + M candidates, and records lost negatives). Texts are compared: a copy,
    encoded in another batch, may score a rounding above the original and stand in for it."""
    corpus, pairs, out = copy_of(stores, tmp_path)
    common = {"encoder": encoder, "chunk_size": 32, "keep_fewer": True, "relative_margin": None, "range_max": 3}
    mine_hard_negatives(str(pairs), str(tmp_path / "before"), str(corpus), **common)
    before = read_jsonl(tmp_path / "before" / "negatives.jsonl")
    docs = read_jsonl(corpus)
    best = next(d for d in docs if d["_id"] == before[1]["negative_ids"][0])
    copied = tmp_path / "copied.jsonl"
    copied.write_text("".join(json.dumps(d) + "\n" for d in docs + [{**best, "_id": f"again{i}"} for i in range(5)]))
    summary = mine_hard_negatives(str(pairs), str(tmp_path / "after"), str(copied), **common)
    assert [r["negatives"] for r in read_jsonl(tmp_path / "after" / "negatives.jsonl")] == [
        r["negatives"] for r in before]
    assert all(len(r["negatives"]) == 3 for r in before) and summary.candidates_dropped["duplicate"] >= 5


def test_a_positive_given_without_its_title_is_its_titled_corpus_document(tmp_path, encoder):
    """A BEIR corpus with titles and pairs whose positive is the text field alone (or differs from it in case and
    spacing): each positive is its corpus document, so that document never comes back as the query's negative, and
    nothing is added to the documents. Before, the titled document was a candidate like any other."""
    docs = [{**d, "title": f"Problem {i}"} for i, d in enumerate(read_jsonl(BEIR)[:30])]
    pairs = [{"query": " ".join(d["text"].split()[:10]), "positive": d["text"]} for d in docs[:6]]
    pairs[1]["positive"] = "  " + docs[1]["text"].upper()
    corpus, pair_file = tmp_path / "corpus.jsonl", tmp_path / "pairs.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in docs))
    pair_file.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    mine_hard_negatives(str(pair_file), str(tmp_path / "out"), str(corpus), encoder=encoder, chunk_size=32,
                        keep_fewer=True, relative_margin=None, range_max=29, num_negatives=29)
    records = read_jsonl(tmp_path / "out" / "negatives.jsonl")
    assert len(records) == 6
    for d, record in zip(docs, records, strict=False):
        assert d["_id"] not in record["negative_ids"] and len(record["negative_ids"]) == 29  # all but itself
    assert load_embeddings(str(tmp_path / "out" / "documents"))[0] == [d["_id"] for d in docs]


def test_the_positive_is_the_document_its_id_names_and_every_copy_of_it_is_excluded(tmp_path, encoder):
    """Two titled documents share one text field and the pair names the second: its score is the positive's (the
    first document with that field was taken). An untitled copy of the positive's text, and the other titled one,
    are never its negatives (the copy had come back once the positive matched the titled document)."""
    docs = read_jsonl(BEIR)[:20]
    body = docs[0]["text"]
    docs = [{"_id": "cake", "title": "Cake", "text": body}, {"_id": "bread", "title": "Bread", "text": body},
            {"_id": "copy", "title": "", "text": "  " + body.upper()}, *docs[1:]]
    pairs = [{"query": " ".join(body.split()[:10]), "positive": body, "pid": "bread"},
             {"query": "Which problem is this?", "positive": body}]
    corpus, pair_file = tmp_path / "corpus.jsonl", tmp_path / "pairs.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in docs))
    pair_file.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    mine_hard_negatives(str(pair_file), str(tmp_path / "out"), str(corpus), encoder=encoder, chunk_size=32,
                        positive_id_field="pid", keep_fewer=True, relative_margin=None, range_max=30,
                        num_negatives=30, output_scores=True)
    records = read_jsonl(tmp_path / "out" / "negatives.jsonl")
    for record in records:
        assert not {"cake", "bread", "copy"} & set(record["negative_ids"]), record["negative_ids"]
    ids, vectors = load_embeddings(str(tmp_path / "out" / "documents"))
    query_ids, queries = load_embeddings(str(tmp_path / "out" / "queries"))
    unit = lambda v: v.astype(np.float64) / np.linalg.norm(v.astype(np.float64))  # noqa: E731
    by_id = dict(zip(ids, vectors, strict=True))
    named = float(unit(queries[query_ids.index("q:1")]) @ unit(by_id["bread"]))
    other = float(unit(queries[query_ids.index("q:1")]) @ unit(by_id["cake"]))
    assert abs(named - other) > 1e-4  # the titles make them two vectors
    assert records[0]["positive_score"] == pytest.approx(named, abs=1e-6)


def test_loading_options_beside_an_encoder_are_refused(tmp_path, encoder):
    """An ``Encoder`` given to ``mine_hard_negatives`` is used as it is: a setting that would only reach a model
    loaded from ``base_model_name_or_path`` is refused, not ignored."""
    from diffusion_embedder.mining.options import MiningError

    corpus, pairs = build_inputs(tmp_path)
    for option in ({"pooling_mode": "weighted_mean"}, {"torch_dtype": "bfloat16"},
                   {"peft_model_name_or_path": str(tmp_path)}, {"similarity_fn_name": "dot"}):
        name = next(iter(option))
        with pytest.raises(MiningError, match=f"encoder= is given, so {name} would not reach it"):
            mine_hard_negatives(str(pairs), str(tmp_path / "out"), str(corpus), encoder=encoder, **option)
    assert not (tmp_path / "out").exists()


def docs_id_90(corpus: Path) -> str:
    return read_jsonl(corpus)[90]["_id"]


def test_queries_are_encoded_as_training_encodes_them_and_documents_as_the_evaluation_does(stores, encoder):
    """The query store's vectors are ``Encoder.forward`` of ``Encoder.tokenize`` of [instruction;, query] (the
    collator's path), a long query whole up to max_length; documents are ``encode`` of ["", text]."""
    import torch

    from diffusion_embedder.evaluation.encode_corpus import Corpus, encode_chunks, store_manifest

    pairs = read_jsonl(stores / "pairs.jsonl")
    ids, vectors = load_embeddings(str(stores / "out" / "queries"))
    by_line = {f"q:{n}": p for n, p in enumerate(pairs, 1)}
    inputs = [[trained_instruction(by_line[i].get("instruction")), by_line[i]["query"]] for i in ids]
    with torch.no_grad():
        trained = encoder(encoder.tokenize(inputs))
    assert_close_normwise(vectors, trained, eps_multiple=ORDER_EPS, rows=True, msg="queries")
    doc_ids, doc_vectors = load_embeddings(str(stores / "out" / "documents"))
    texts = {d["_id"]: d["text"].strip() for d in read_jsonl(stores / "corpus.jsonl")}
    evaluated = encoder.encode([["", texts[i]] for i in doc_ids[:100]], batch_size=16, show_progress_bar=False)
    assert_close_normwise(doc_vectors[:100], evaluated, eps_multiple=ORDER_EPS, rows=True, msg="documents")
    # a query longer than doc_max_length is kept whole (up to max_length), as training keeps it
    long = Corpus("long", ["q"], ["word " * 600], [trained_instruction(INSTRUCTION)])
    folder = stores.parent / "long_query"
    encoder_short = encoder.__class__.from_pretrained(str(LLAMA_FIXTURE), device="cpu", doc_max_length=32)
    encode_chunks(encoder_short, long, str(folder), store_manifest(encoder_short, long, 8, "fixture"))
    with torch.no_grad():
        whole = encoder_short(encoder_short.tokenize([[long.instructions[0], long.texts[0]]]))
    assert_close_normwise(load_embeddings(str(folder))[1], whole, eps_multiple=ORDER_EPS, msg="long query")


def test_faiss_and_any_block_size_give_the_exact_search_s_negatives(stores, tmp_path, encoder, monkeypatch):
    pytest.importorskip("faiss")  # the exact path is the reference test's, always run
    import faiss

    corpus, pairs, out = copy_of(stores, tmp_path)
    common = {"encoder": encoder, "positive_id_field": "positive_id", "chunk_size": 32, "keep_fewer": True,
              "relative_margin": None, "range_max": 20, "output_scores": True}
    mine_hard_negatives(str(pairs), str(out), str(corpus), **common)
    exact = (out / "negatives.jsonl").read_bytes()
    mine_hard_negatives(str(pairs), str(out), str(corpus), query_block_size=3, document_block_size=7, **common)
    assert (out / "negatives.jsonl").read_bytes() == exact
    factories = []
    real = faiss.index_factory
    monkeypatch.setattr(faiss, "index_factory", lambda d, spec, metric: factories.append(spec) or real(d, spec, metric))
    mine_hard_negatives(str(pairs), str(out), str(corpus), search="faiss", **common)
    assert (out / "negatives.jsonl").read_bytes() == exact and factories == ["Flat"]
    # an index that needs training (trained on the corpus): all of its lists probed, it is exhaustive, so exact too
    mine_hard_negatives(str(pairs), str(out), str(corpus), search="faiss", faiss_index="IVF2,Flat", **common)
    assert factories == ["Flat", "IVF2,Flat"]


def write_store(folder: Path, rows: np.ndarray, chunk: int) -> None:
    """An embedding store of ``rows`` in chunks of ``chunk``, as ``encode`` writes one."""
    from diffusion_embedder.evaluation.store import FORMAT, identity, write_chunk

    ids = [f"{folder.name}{i}" for i in range(len(rows))]
    spans = [(lo, min(lo + chunk, len(rows))) for lo in range(0, len(rows), chunk)]
    manifest = {"format": FORMAT, "embedding_dim": rows.shape[1], "corpus": {"num_rows": len(rows)},
                "chunks": {"num_chunks": len(spans), "chunk_size": chunk}}
    folder.mkdir()
    (folder / "manifest.json").write_text(json.dumps(manifest))
    for index, (lo, hi) in enumerate(spans):
        write_chunk(str(folder), index, ids[lo:hi], (lo, hi), rows[lo:hi], identity(manifest))


def test_search_ranks_ties_by_corpus_order_and_holds_one_block_of_scores_at_a_time(tmp_path, monkeypatch):
    """Candidates and their float64 scores equal a brute force over the stores; equal scores rank by corpus position,
    whatever the block sizes; no similarity call sees more than query_block x document_block pairs."""
    import torch

    from diffusion_embedder.evaluation.store import EmbeddingStore
    from diffusion_embedder.mining import search as search_mod

    rng = np.random.default_rng(0)
    docs = rng.normal(size=(40, 8)).astype(np.float32)
    docs[[5, 17, 33]] = docs[9]  # four equal documents
    queries = np.concatenate([docs[9:10] * 2, rng.normal(size=(4, 8)).astype(np.float32)])
    write_store(tmp_path / "docs", docs, 16)
    write_store(tmp_path / "queries", queries, 3)
    documents, asked = EmbeddingStore(str(tmp_path / "docs")), EmbeddingStore(str(tmp_path / "queries"))
    shapes = []
    real = search_mod.SIMILARITY_FUNCTIONS["cosine"]
    monkeypatch.setattr(search_mod, "SIMILARITY_FUNCTIONS",
                        {"cosine": lambda a, b: shapes.append((a.shape[0], b.shape[0])) or real(a, b)})
    unit = lambda m: m.astype(np.float64) / np.linalg.norm(m.astype(np.float64), axis=1, keepdims=True)  # noqa: E731
    brute = unit(queries) @ unit(docs).T
    expected = np.stack([sorted(range(40), key=lambda j, row=row: (-row[j], j))[:6] for row in brute])
    assert list(expected[0, :4]) == [5, 9, 17, 33]  # the tie: equal float64 scores, corpus order
    for query_block, document_block in ((5, 40), (2, 7), (1, 3)):
        shapes.clear()
        blocks = list(search_mod.search(asked, documents, 6, "cosine", query_block=query_block,
                                        document_block=document_block))
        assert max(a for a, _ in shapes) <= query_block and max(b for _, b in shapes) <= document_block
        indices = np.concatenate([b.indices for _, b in blocks])
        assert np.array_equal(indices, expected), (query_block, document_block)
        scores = np.concatenate([b.scores for _, b in blocks])
        assert_close_normwise(scores, np.take_along_axis(brute, expected, 1), eps_multiple=HAND_EPS,
                              dtype=torch.float64, msg="float64 scores")


@pytest.mark.parametrize("similarity", ["cosine", "dot", "euclidean", "manhattan"])
def test_more_ties_than_the_slack_still_rank_by_corpus_order(tmp_path, similarity):
    """A document repeated 60 times, the k-th place inside the repeats: the float32 search returns only k + SLACK of
    them, an arbitrary few; the queries it concerns are searched again wider, so both searches and every block size
    give the brute force's first k, the repeats in corpus order."""
    import torch

    from diffusion_embedder.evaluation.store import EmbeddingStore
    from diffusion_embedder.mining.search import SLACK, search
    from diffusion_embedder.similarity import SIMILARITY_PAIRWISE

    rng = np.random.default_rng(2)
    docs = rng.normal(size=(400, 8)).astype(np.float32)
    repeats = np.sort(rng.choice(400, size=60, replace=False))
    docs[repeats] = docs[repeats[-1]] * 3  # long, so it leads for the dot product too
    queries = np.concatenate([docs[repeats[:1]] * 1.01, docs[repeats[:1]] * 0.5 + rng.normal(size=(1, 8)) * 0.1,
                              rng.normal(size=(3, 8))]).astype(np.float32)
    write_store(tmp_path / "docs", docs, 64)
    write_store(tmp_path / "queries", queries, 64)
    documents, asked = EmbeddingStore(str(tmp_path / "docs")), EmbeddingStore(str(tmp_path / "queries"))
    # pair by pair, so equal documents get equal float64 scores (a matrix product can round rows differently)
    brute = SIMILARITY_PAIRWISE[similarity](torch.from_numpy(queries).double()[:, None],
                                            torch.from_numpy(docs).double()[None])
    k = 30
    expected = np.stack([sorted(range(400), key=lambda j, row=row: (-row[j], j))[:k] for row in brute.numpy()])
    assert set(expected[0]) <= set(repeats) and k + SLACK < 60  # the boundary inside the repeats
    methods = ["exact", "faiss"] if importlib.util.find_spec("faiss") else ["exact"]
    for method, document_block in [(m, b) for m in methods for b in (400, 37)]:
        found = np.concatenate([b.indices for _, b in search(asked, documents, k, similarity, method=method,
                                                             document_block=document_block)])
        assert np.array_equal(found, expected), (method, document_block)


def test_a_search_whose_rounding_could_hide_a_better_document_is_asked_again_wider(tmp_path):
    """The widening allows for the float32 rounding measured on the returned candidates: a search whose scores are
    off by up to 0.05 (measured), whose weakest candidate is within twice that of the k-th place, is asked again
    until the corpus is exhausted, and finds the document its rounding had hidden."""
    from diffusion_embedder.evaluation.store import EmbeddingStore
    from diffusion_embedder.mining.search import SLACK, _ranked

    true = np.array([1.0, *(0.8 + 0.001 * np.arange(1, 39)), 0.95])  # the last ranks second, truly
    noise = np.array([0.05 * (-1) ** i for i in range(39)] + [-0.2])  # its score is rounded to the last place
    write_store(tmp_path / "docs", true[:, None].astype(np.float32), 16)
    documents, asked = EmbeddingStore(str(tmp_path / "docs")), []

    def nearest(rows, wide):
        asked.append(wide)
        rough = np.tile(true + noise, (len(rows), 1))
        found = np.argsort(-rough, axis=1, kind="stable")[:, :wide]
        return found, np.take_along_axis(rough, found, 1)

    indices, _ = _ranked(np.ones((1, 1), np.float32), documents, 2, 2 + SLACK, "dot", nearest)
    assert list(indices[0]) == [0, 39] and asked == [2 + SLACK, 2 * (2 + SLACK), 40]
    # an approximate index that returned fewer than asked has nothing more to give: not asked again
    asked.clear()
    fewer = lambda rows, wide: tuple(np.where(np.arange(wide) < 3, a, -1) for a in nearest(rows, wide))  # noqa: E731
    indices, _ = _ranked(np.ones((1, 1), np.float32), documents, 2, 2 + SLACK, "dot", fewer)
    assert list(indices[0]) == [0, 38] and asked == [2 + SLACK]


@pytest.mark.parametrize("similarity", ["cosine", "dot", "euclidean", "manhattan"])
def test_faiss_ranks_as_the_exact_search_for_every_similarity_function(tmp_path, similarity):
    """Vectors of very different norms, so a FAISS metric that ranks otherwise than the similarity (an inner product
    for cosine, say) finds other documents: both searches give the brute-force top 5."""
    pytest.importorskip("faiss")  # the exact path is also the reference test's, always run
    import torch

    from diffusion_embedder.evaluation.store import EmbeddingStore
    from diffusion_embedder.mining.search import search
    from diffusion_embedder.similarity import SIMILARITY_FUNCTIONS

    rng = np.random.default_rng(1)
    docs = (rng.normal(size=(300, 8)) * rng.uniform(0.05, 20, size=(300, 1))).astype(np.float32)
    queries = (rng.normal(size=(7, 8)) * rng.uniform(0.05, 20, size=(7, 1))).astype(np.float32)
    write_store(tmp_path / "docs", docs, 64)
    write_store(tmp_path / "queries", queries, 64)
    documents, asked = EmbeddingStore(str(tmp_path / "docs")), EmbeddingStore(str(tmp_path / "queries"))
    brute = SIMILARITY_FUNCTIONS[similarity](torch.from_numpy(queries).double(), torch.from_numpy(docs).double())
    expected = np.stack([sorted(range(300), key=lambda j, row=row: (-row[j], j))[:5] for row in brute.numpy()])
    for method in ("exact", "faiss"):
        found = np.concatenate([b.indices for _, b in search(asked, documents, 5, similarity, method=method)])
        assert np.array_equal(found, expected), method


def test_positives_of_one_normalized_text_that_the_corpus_lacks_are_added_once():
    from diffusion_embedder.evaluation.encode_corpus import Corpus
    from diffusion_embedder.mining.inputs import PairRecord, collect

    corpus = Corpus("c", ["d0"], ["Another document."], bodies=["Another document."])
    records = [PairRecord(1, "q1", "A new positive.", None, None), PairRecord(2, "q2", "a  NEW positive.", None, None)]
    inputs = collect(records, corpus, "pairs.jsonl")
    assert inputs.documents.ids == ["d0", "pairs:1"]
    assert [r.positive_index for r in inputs.records] == [1, 1]
