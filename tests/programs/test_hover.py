import json

import pytest

from mmgrpo_jax.program import Example, Prediction
from mmgrpo_jax.program.adapter import format_outputs
from mmgrpo_jax.rl.rollout import run_trajectory
from mmgrpo_jax.testing import ScriptedLM
from programs.hover import (
    HoverMultiHop,
    gold_titles,
    load_hover,
    three_hop_claims,
    title_recall,
    write_title_proxy_corpus,
)
from programs.retrieval import BM25Retriever
from tests.paper_data import needs_paper_data


@needs_paper_data
def test_offline_splits_are_three_title_claims_one_per_hpqa_id():
    splits = load_hover()
    assert (len(splits.train), len(splits.dev), len(splits.test)) == (386, 193, 193)
    every = splits.train + splits.dev + splits.test
    assert len({e.claim for e in every}) == 772
    assert all(len(e.titles) == 3 == len(set(e.titles)) for e in every)
    assert load_hover(seed=0).dev == splits.dev and load_hover(seed=1).dev != splits.dev


def test_gold_titles_of_both_layouts_and_the_filter():
    pairs = {"supporting_facts": [["A", 0], ["B", 2], ["A", 1], [5.15, 0]]}
    objects = {"supporting_facts": [{"key": "A", "value": 0}, {"key": "B", "value": 2}]}
    assert gold_titles(pairs) == ["A", "B", "5.15"] and gold_titles(objects) == ["A", "B"]
    rows = [
        {"claim": "c1", "num_hops": 3, "hpqa_id": "h", "supporting_facts": [["A", 0]]},
        {"claim": "c2", "num_hops": 3, "hpqa_id": "h", "supporting_facts": [["B", 0]]},
        {"claim": "c3", "num_hops": 2, "hpqa_id": "g", "supporting_facts": [["C", 0]]},
    ]
    assert [e.claim for e in three_hop_claims(rows)] == ["c1"]


def test_title_recall_counts_distinct_normalised_titles():
    example = Example(claim="c", titles=["Lucky Luciano", "Davina (R&amp;B singer)", "Hoodlum"])
    found = Prediction(titles=["lucky luciano", "Lucky Luciano", "Davina (R&B singer)", "X"])
    assert title_recall(example, found) == pytest.approx(2 / 3)
    assert title_recall(example, Prediction(titles=[])) == 0.0
    assert title_recall(example, Prediction(titles=["Hoodlum", *example.titles])) == 1.0
    with pytest.raises(ValueError, match="no gold titles"):
        title_recall(Example(claim="c", titles=[]), found)


def corpus(tmp_path, titles):
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"title": t, "text": f"about {t}"}) + "\n" for t in titles))
    return path


def test_program_hops_through_both_modules_and_scores_recall(tmp_path):
    titles = ["Harrier (dog)", "Greater Swiss Mountain Dog", "Beagle", "Paris", "Oslo", "Rome"]
    retriever = BM25Retriever(corpus(tmp_path, titles), cache_dir=tmp_path / "cache")
    program = HoverMultiHop(retriever, hops=3, k=2)
    notes = format_outputs(program.take_notes.signature, {"new_key_facts": ["dogs"]})
    query = format_outputs(program.write_query.signature, {"query": "Beagle"})
    policy = ScriptedLM.from_replies([notes, query, notes, query], token_ids=True)
    claim = "Greater Swiss Mountain Dog and Harrier are both dog breeds."
    example = Example(claim=claim, titles=["Harrier (dog)", "Beagle"]).with_inputs("claim")
    t = run_trajectory(program, example, title_recall, lm=policy)
    assert t.status == "ok" and t.reward == 1.0
    assert [(c.predictor, c.invocation) for c in t.calls] == [
        ("take_notes", 0),
        ("write_query", 0),
        ("take_notes", 1),
        ("write_query", 1),
    ]
    assert t.prediction.titles[:2] == ["Greater Swiss Mountain Dog", "Harrier (dog)"]


@needs_paper_data
def test_title_proxy_corpus_holds_every_cited_title(tmp_path):
    path = write_title_proxy_corpus(None, tmp_path / "titles.jsonl")
    titles = [json.loads(line)["title"] for line in path.read_text().splitlines()]
    assert len(titles) == len(set(titles)) > 4000
    cited = {t for e in load_hover().test for t in e.titles}
    assert cited <= set(titles)
