"""Retrievers for HoVer: BM25 over a local corpus, or a ColBERTv2-style HTTP server.

Both are callables `retriever(query, k) -> list[str]` of "title | text" passages. The BM25 index
is built once per corpus file and cached on disk under the file's sha256 (and the BM25
parameters), written to a temporary folder and renamed, so a cache is complete or absent.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import urllib.parse
from collections.abc import Callable
from pathlib import Path

from mmgrpo_jax.engines.http_json import ServerError, fetch_json

logger = logging.getLogger(__name__)

DEFAULT_CACHE = Path(os.environ.get("MMGRPO_CACHE", Path.home() / ".cache" / "mmgrpo_jax"))


Retriever = Callable[[str, int], list[str]]  # (query, k) -> "title | text" passages


def passage(title: str, text: str) -> str:
    return f"{title} | {text}" if text else title


def title_of(passage_text: str) -> str:
    return passage_text.split(" | ", 1)[0]


def read_corpus(path: Path) -> list[str]:
    """Passages of a JSONL corpus of {"title", "text"} records; a bad line is named."""
    passages = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                passages.append(passage(record["title"], record.get("text", "")))
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                message = f"{path}:{number}: not a {{'title', 'text'}} record ({err})"
                raise ValueError(message) from None
    if not passages:
        raise ValueError(f"corpus {str(path)!r} has no records")
    return passages


def file_sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _bm25s():
    """bm25s, imported on first use (it is not on the sampler/train path)."""
    import bm25s

    # bm25s sets its logger to DEBUG on import: its per-call lines are not the user's
    logging.getLogger("bm25s").setLevel(logging.WARNING)
    return bm25s


class BM25Retriever:
    """BM25 (k1 0.9, b 0.4: docs/design.md#programs) with English stopwords, via `bm25s`."""

    def __init__(
        self,
        corpus_path: str | Path,
        *,
        cache_dir: str | Path | None = None,
        k1: float = 0.9,
        b: float = 0.4,
    ) -> None:
        self.corpus_path: Path | None = Path(corpus_path)
        if not self.corpus_path.is_file():
            raise FileNotFoundError(f"retrieval corpus {str(self.corpus_path)!r} does not exist")
        self.passages = read_corpus(self.corpus_path)
        key = f"{file_sha256(self.corpus_path)[:32]}-k1={k1}-b={b}"
        self.index_dir = Path(cache_dir or DEFAULT_CACHE / "bm25") / key
        self.built_index = not (self.index_dir / "params.index.json").is_file()
        if self.built_index:
            self.index = self._build(self.passages, k1, b)
            self._save()
        else:
            self.index = _bm25s().BM25.load(self.index_dir, show_progress=False)
        self._lock = threading.Lock()

    @classmethod
    def over(cls, passages: list[str], *, k1: float = 0.9, b: float = 0.4) -> BM25Retriever:
        """An index of passages held in memory, built now and not cached (a few thousand at
        most: a program's own labelled examples)."""
        if not passages:
            raise ValueError("BM25Retriever.over needs at least one passage")
        self = cls.__new__(cls)
        self.corpus_path, self.index_dir, self.built_index = None, None, True
        self.passages = list(passages)
        self.index = self._build(self.passages, k1, b)
        self._lock = threading.Lock()
        return self

    def _build(self, passages: list[str], k1: float, b: float):
        index = _bm25s().BM25(k1=k1, b=b)
        index.index(self._tokenize(passages), show_progress=False)
        return index

    def _tokenize(self, texts: list[str]):
        return _bm25s().tokenize(texts, stopwords="en", show_progress=False)

    def _save(self) -> None:
        self.index_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=self.index_dir.parent, prefix=".building-"))
        try:
            self.index.save(tmp, show_progress=False)
            os.replace(tmp, self.index_dir)
        except OSError:  # another process finished first: its cache is as good as ours
            shutil.rmtree(tmp, ignore_errors=True)
        logger.info("BM25 index of %s cached in %s", self.corpus_path, self.index_dir)

    def __call__(self, query: str, k: int) -> list[str]:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        k = min(k, len(self.passages))
        with self._lock:
            ids, _ = self.index.retrieve(self._tokenize([query]), k=k, show_progress=False)
        return [self.passages[i] for i in ids[0]]


class ColBERTv2Client:
    """A ColBERTv2 search server (`GET url?query=...&k=...` -> {"topk": [{"long_text"}]})."""

    def __init__(self, url: str, *, timeout_s: float = 30.0, max_retries: int = 3) -> None:
        self.url, self.timeout_s, self.max_retries = url, timeout_s, max_retries

    def __call__(self, query: str, k: int) -> list[str]:
        body = fetch_json(
            f"{self.url}?{urllib.parse.urlencode({'query': query, 'k': k})}",
            timeout_s=self.timeout_s,
            max_retries=self.max_retries,
            what=f"ColBERTv2 server {self.url}",
        )
        try:
            return [hit.get("long_text") or hit["text"] for hit in body["topk"][:k]]
        except (KeyError, TypeError, AttributeError):
            raise ServerError(
                f"ColBERTv2 server {self.url} sent no topk passages: {str(body)[:200]}"
            ) from None
