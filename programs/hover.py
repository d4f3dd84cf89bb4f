"""HoVer: multi-hop retrieval for claim verification, scored by recall of the gold titles.

Per hop the program retrieves k passages ("title | text"): hop 0 searches with the claim itself,
later hops with a query written by module `write_query` from the claim and the notes so far;
module `take_notes` (after every hop but the last) turns the new passages into key facts. Both
modules run once per hop, so module-level grouping sees several invocations of each. The paper's
shape is 4 hops x 25 passages (Recall@100).

Local splits (a local copy need not hold the train release; docs/tasks.md gives the layout):
the labelled dev release, claims with num_hops == 3 (= 3 distinct gold titles), first claim per
hpqa_id (772 claims), shuffled with `random.Random(seed)`, cut 50 / 25 / 25 % into train / dev /
test (386 / 193 / 193). From the hub (the default) the same recipe runs on the train release,
cut into the paper's 500 / 500 and the rest as test.
"""

from __future__ import annotations

import html
import json
import random
import re
import unicodedata
from pathlib import Path
from typing import Any

from mmgrpo_jax.program import Example, Module, Predict, Prediction
from mmgrpo_jax.program.signature import Field, Signature
from programs.data import HUB, Splits, read_hub, read_jsonl, resolve_data_dir
from programs.retrieval import Retriever, title_of

HUB_NAME = "hover-nlp/hover"


def gold_titles(row: dict[str, Any]) -> list[str]:
    """Distinct supporting titles in first-seen order (either file layout)."""
    titles = [f["key"] if isinstance(f, dict) else f[0] for f in row["supporting_facts"]]
    return list(dict.fromkeys(str(t) for t in titles))


def three_hop_claims(rows: list[dict[str, Any]]) -> list[Example]:
    seen: set[str] = set()
    examples = []
    for row in rows:
        if row["num_hops"] != 3 or row["hpqa_id"] in seen:
            continue
        seen.add(row["hpqa_id"])
        examples.append(Example(claim=row["claim"], titles=gold_titles(row)).with_inputs("claim"))
    return examples


def load_hover(data_dir: str | Path | None = None, seed: int = 0) -> Splits:
    root = resolve_data_dir(data_dir)
    if root == HUB:
        pool = three_hop_claims(read_hub(HUB_NAME, "train"))
        random.Random(seed).shuffle(pool)
        return Splits(train=pool[:500], dev=pool[500:1000], test=pool[1000:])
    pool = three_hop_claims(read_jsonl(Path(root) / "hover" / "hf_layout" / "validation.jsonl"))
    random.Random(seed).shuffle(pool)
    half, three_quarters = len(pool) // 2, 3 * len(pool) // 4
    return Splits(train=pool[:half], dev=pool[half:three_quarters], test=pool[three_quarters:])


def write_title_proxy_corpus(data_dir: str | Path | None, out_path: str | Path) -> Path:
    """A stand-in for the 2017 Wikipedia abstracts: every title any labelled claim cites.

    Each record is {"title": t, "text": ""}: the gold titles of a claim sit among the ~9k titles of
    the other claims as distractors, so retrieval and Recall@k run end to end, but with titles
    only, numbers are not comparable with the paper's. Point `corpus_path` at a JSONL of the real
    abstracts ({"title", "text"} per line) for those.
    """
    root = resolve_data_dir(data_dir)
    if root == HUB:
        rows = read_hub(HUB_NAME, "validation")  # the hub's layout is hf_layout's
    else:
        rows = read_jsonl(Path(root) / "hover" / "hf_layout" / "validation.jsonl")
    titles = dict.fromkeys(t for row in rows for t in gold_titles(row))
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps({"title": t, "text": ""}) + "\n" for t in titles))
    return out


class HoverMultiHop(Module):
    """claim -> hops of (query, retrieve k, notes) -> every retrieved title."""

    def __init__(self, retriever: Retriever, hops: int = 4, k: int = 25) -> None:
        if hops < 1 or k < 1:
            raise ValueError(f"hops and k must be >= 1, got hops={hops}, k={k}")
        self.retrieve, self.hops, self.k = retriever, hops, k
        claim = Field("claim", str, "a claim to verify")
        notes = Field("key_facts", list[str], "what the passages so far established")
        self.write_query = Predict(
            Signature(
                (claim, notes),
                (Field("query", str, "a search query"),),
                "Write a search query that finds the Wikipedia articles still needed to "
                "verify the claim.",
            )
        )
        self.take_notes = Predict(
            Signature(
                (claim, notes, Field("passages", list[str], "newly retrieved passages")),
                (Field("new_key_facts", list[str], "the facts that bear on the claim"),),
                "Extract the facts from the passages that help verify the claim, keeping "
                "the earlier facts.",
            )
        )

    def forward(self, claim: str) -> Prediction:
        key_facts: list[str] = []
        retrieved: list[str] = []
        for hop in range(self.hops):
            query = claim if hop == 0 else self.write_query(claim=claim, key_facts=key_facts).query
            passages = self.retrieve(query, self.k)
            retrieved += passages
            if hop < self.hops - 1:
                notes = self.take_notes(claim=claim, key_facts=key_facts, passages=passages)
                key_facts = notes.new_key_facts
        titles = list(dict.fromkeys(title_of(p) for p in retrieved))
        return Prediction(titles=titles, key_facts=key_facts)


def normalize_title(title: str) -> str:
    text = unicodedata.normalize("NFKC", html.unescape(title)).lower()
    return re.sub(r"\s+", " ", text).strip()


def title_recall(example: Example, prediction: Prediction) -> float:
    """Fraction of the distinct gold titles among the retrieved ones (normalised)."""
    gold = {normalize_title(t) for t in example.titles}
    if not gold:
        raise ValueError(f"example has no gold titles: {example!r}")
    found = {normalize_title(t) for t in prediction.titles}
    return len(gold & found) / len(gold)
