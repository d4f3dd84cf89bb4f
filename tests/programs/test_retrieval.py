import http.server
import json
import logging
import threading

import pytest

from mmgrpo_jax.engines.http_json import ServerError
from programs import retrieval
from programs.retrieval import BM25Retriever, ColBERTv2Client, title_of

TITLES = {
    "Eiffel Tower": "wrought-iron lattice tower in Paris, France",
    "Brandenburg Gate": "neoclassical monument in Berlin, Germany",
    "Banana": "an elongated edible fruit",
    "Colosseum": "oval amphitheatre in the centre of Rome, Italy",
}


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"title": t, "text": x}) + "\n" for t, x in TITLES.items()))
    return path


def test_bm25_finds_the_expected_passage(corpus, tmp_path):
    retriever = BM25Retriever(corpus, cache_dir=tmp_path / "cache")
    hits = retriever("amphitheatre in Rome", 2)
    assert title_of(hits[0]) == "Colosseum"
    assert hits[0] == "Colosseum | oval amphitheatre in the centre of Rome, Italy"
    assert len(retriever("tower", 10)) == 4  # k is capped at the corpus size


def test_bm25s_debug_lines_are_not_shown(corpus, tmp_path, caplog):
    """bm25s sets its own logger to DEBUG: with any root handler (a notebook, a script's
    basicConfig) its "Building index" lines would print on every index and query."""
    with caplog.at_level(logging.DEBUG):
        retriever = BM25Retriever(corpus, cache_dir=tmp_path / "cache")
        retriever("chess", k=1)
    assert not [r for r in caplog.records if r.name.startswith("bm25s")]


def test_bm25_index_is_built_once_and_reused(corpus, tmp_path, monkeypatch):
    builds = []
    original = retrieval.BM25Retriever._save
    monkeypatch.setattr(
        retrieval.BM25Retriever, "_save", lambda self: (builds.append(1), original(self))
    )
    first = BM25Retriever(corpus, cache_dir=tmp_path / "cache")
    second = BM25Retriever(corpus, cache_dir=tmp_path / "cache")
    assert (first.built_index, second.built_index, len(builds)) == (True, False, 1)
    assert second("fruit", 1) == first("fruit", 1)
    corpus.write_text(corpus.read_text() + json.dumps({"title": "Apple", "text": "fruit"}) + "\n")
    third = BM25Retriever(corpus, cache_dir=tmp_path / "cache")  # new content, new key
    assert third.built_index and len(builds) == 2


def test_bad_corpus_lines_and_paths_are_named(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"title": "a"}\n{"text": "no title"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        BM25Retriever(bad, cache_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match=r"missing\.jsonl"):
        BM25Retriever(tmp_path / "missing.jsonl")


class ColBERTHandler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"topk": [{"long_text": "Banana | fruit", "score": 1.0}]}).encode()
        if "broken" in self.path:
            body = b'{"oops": 1}'
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_colbert_client_reads_topk_and_names_a_bad_body():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), ColBERTHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/search"
        assert ColBERTv2Client(url)("yellow fruit", 1) == ["Banana | fruit"]
        with pytest.raises(ServerError, match="no topk"):
            ColBERTv2Client(url + "/broken")("x", 1)
    finally:
        server.shutdown()
