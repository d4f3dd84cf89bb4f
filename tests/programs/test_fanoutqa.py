import pytest

from mmgrpo_jax.program import Example, Prediction
from mmgrpo_jax.rl.rollout import run_trajectory
from mmgrpo_jax.testing import ScriptedLM
from programs import registry_data
from programs.fanoutqa import (
    DEV_SIZE,
    MAX_NAMES,
    PASSAGES_PER_HOP,
    TEST_SIZE,
    FanoutSearch,
    evidence_titles,
    load_fanoutqa,
    page_recall,
    question_pool,
    split_names,
)
from programs.retrieval import BM25Retriever, passage

DEV_LAYOUT = {  # the dev file's layout: evidence inside a tree of sub-questions
    "id": "d1",
    "question": "What are the capitals of Norway and Sweden?",
    "decomposition": [
        {"id": "a", "question": "Capital of Norway?", "decomposition": [],
         "evidence": {"title": "Norway"}},
        {"id": "b", "question": "Which Nordic country?", "evidence": None, "decomposition": [
            {"id": "c", "question": "Capital of Sweden?", "decomposition": [],
             "evidence": {"title": "Sweden"}},
            {"id": "d", "question": "Again", "decomposition": [], "evidence": {"title": "Norway"}},
        ]},
    ],
}  # fmt: skip
TEST_LAYOUT = {
    "id": "t1",
    "question": "How tall are the Eiffel Tower and Big Ben?",
    "necessary_evidence": [{"title": "Eiffel Tower"}, {"title": "Big Ben"}, {"title": "Paris"}],
}


def test_evidence_titles_read_either_file_layout_in_first_seen_order():
    assert evidence_titles(DEV_LAYOUT) == ["Norway", "Sweden"]
    assert evidence_titles(TEST_LAYOUT) == ["Eiffel Tower", "Big Ben", "Paris"]


def test_the_pool_keeps_questions_with_two_to_eight_gold_pages_in_the_corpus():
    corpus = {"Norway", "Sweden", "Eiffel Tower"}
    many = {"id": "m", "question": "q", "necessary_evidence": [{"title": t} for t in "ABCDEFGHI"]}
    pool = question_pool([DEV_LAYOUT, TEST_LAYOUT, many], corpus | set("ABCDEFGHI"))
    # TEST_LAYOUT has one page in the corpus, `many` nine: only DEV_LAYOUT's two remain
    assert [(e.id, e.titles) for e in pool] == [("d1", ["Norway", "Sweden"])]
    assert pool[0].inputs() == {"question": DEV_LAYOUT["question"]}


@pytest.mark.parametrize(
    ("reply", "names"),
    [
        ("Norway, Sweden, Finland.", ["Norway", "Sweden", "Finland"]),
        ("Norway; Sweden\nFinland", ["Norway", "Sweden", "Finland"]),
        ("Norway, Norway, , Sweden", ["Norway", "Sweden"]),
        ("", []),
    ],
)
def test_split_names(reply, names):
    assert split_names(reply) == names


def test_page_recall_on_hand_worked_cases():
    example = Example(question="q", titles=["Norway", "Sweden", "Finland", "Iceland"])
    assert page_recall(example, Prediction(titles=["Norway", "Oslo", "Iceland"])) == 0.5
    assert page_recall(example, Prediction(titles=[])) == 0.0
    assert page_recall(example, Prediction(titles=["Iceland", "Finland", "Sweden", "Norway"])) == 1
    with pytest.raises(ValueError, match="no gold pages"):
        page_recall(Example(question="q", titles=[]), Prediction(titles=["Norway"]))


PAGES = {
    "Nordic countries": "The Nordic countries are a region in Northern Europe.",
    "Norway": "Norway is a Nordic country. Its capital is Oslo.",
    "Sweden": "Sweden is a Nordic country. Its capital is Stockholm.",
    "Finland": "Finland is a Nordic country east of Sweden. Its capital is Helsinki.",
    "Iceland": "Iceland is a Nordic island country. Its capital is Reykjavik.",
    "Denmark": "Denmark is a Nordic country. Its capital is Copenhagen.",
    "Oslo": "Oslo is the capital of Norway.",
    "Mount Everest": "Mount Everest is the highest mountain above sea level.",
    "Sahara": "The Sahara is a desert in Africa.",
}


def test_traces_on_a_scripted_lm_a_query_then_the_pages_still_needed():
    program = FanoutSearch(BM25Retriever.over([passage(t, x) for t, x in PAGES.items()]))
    asked = []

    def reply(messages):
        prompt = messages[-1]["content"]
        asked.append(prompt)
        if "found" not in prompt.lower():
            return "Nordic countries capitals"
        return "Iceland, Oslo, Mount Everest, Iceland"

    example = Example(
        question="What are the capitals of the Nordic countries?",
        titles=["Norway", "Sweden", "Finland", "Iceland", "Denmark"],
    ).with_inputs("question")
    trajectory = run_trajectory(program, example, page_recall, lm=ScriptedLM(reply))
    assert trajectory.status == "ok"
    assert [c.predictor for c in trajectory.calls] == ["write_query", "name_pages"]
    titles = trajectory.prediction.titles
    first_hop = titles[:PASSAGES_PER_HOP]
    assert len(first_hop) == len(set(first_hop)) == PASSAGES_PER_HOP
    # the second call sees the first hop's titles; each name adds its best page unless found
    assert "; ".join(first_hop) in asked[1]
    assert trajectory.prediction.names == ["Iceland", "Oslo", "Mount Everest"]
    added = [t for t in ("Iceland", "Oslo", "Mount Everest") if t not in first_hop]
    assert titles == first_hop + added and len(titles) == len(set(titles))
    gold = set(example.titles)
    assert trajectory.reward == len(gold & set(titles)) / len(gold)
    assert 0 < trajectory.reward < 1
    # both modules show their demos' turns before the question
    for call, module in zip(
        trajectory.calls, (program.write_query, program.name_pages), strict=True
    ):
        assert len(call.messages) == 2 + 2 * len(module.demos)


def test_names_past_the_cap_are_not_searched():
    program = FanoutSearch(BM25Retriever.over([passage(t, x) for t, x in PAGES.items()]))
    many = ", ".join(PAGES)
    lm = ScriptedLM(lambda m: many if "found" in m[-1]["content"].lower() else "x")
    example = Example(question="Which deserts?", titles=["Sahara", "Oslo"]).with_inputs("question")
    trajectory = run_trajectory(program, example, page_recall, lm=lm)
    assert trajectory.prediction.names == list(PAGES)[:MAX_NAMES]
    assert len(trajectory.prediction.titles) <= PASSAGES_PER_HOP + MAX_NAMES


FETCHED = not (registry_data.damaged("fanoutqa") or registry_data.damaged("vital_articles"))
needs_fetched_data = pytest.mark.skipif(
    not FETCHED, reason="FanOutQA / Vital Articles not fetched: run `make data` (make test does)"
)


@needs_fetched_data
def test_the_real_splits_sizes_disjointness_and_seeds():
    splits = load_fanoutqa(seed=0)
    sizes = (len(splits.train), len(splits.dev), len(splits.test))
    assert sizes == (202, DEV_SIZE, TEST_SIZE)
    ids = [e.id for split in (splits.train, splits.dev, splits.test) for e in split]
    assert len(ids) == len(set(ids)) == 402
    assert all(2 <= len(e.titles) <= 8 for e in splits.test)
    again, other = load_fanoutqa(seed=0), load_fanoutqa(seed=1)
    assert [e.id for e in again.test] == [e.id for e in splits.test]
    assert [e.id for e in other.test] != [e.id for e in splits.test]
    assert {e.id for e in other.train + other.dev + other.test} == set(ids)


def test_the_settings_it_would_not_read_are_refused_before_any_data_is_read():
    from programs.tasks import TaskConfig, load_splits

    with pytest.raises(
        ValueError, match=r"does not read task\.corpus_path='c\.jsonl', task\.hops=2"
    ):
        load_splits(TaskConfig(name="fanoutqa", corpus_path="c.jsonl", hops=2))
    with pytest.raises(ValueError, match=r"task\.data_dir='/data'"):
        load_splits(TaskConfig(name="fanoutqa", data_dir="/data"))


def test_the_corpus_is_the_leads_as_title_text_records_rewritten_when_the_source_is_newer(
    tmp_path, monkeypatch
):
    import json
    import os

    from programs import fanoutqa
    from programs.retrieval import read_corpus

    source = tmp_path / "summaries_en-us.json"
    leads = {"Oslo": {"title": "Oslo", "extract": "Oslo is the capital of Norway."}}
    source.write_text(json.dumps(leads))
    monkeypatch.setattr(fanoutqa, "data_file", lambda name, member, cache=None: source)
    corpus = fanoutqa.corpus_jsonl()
    assert read_corpus(corpus) == ["Oslo | Oslo is the capital of Norway."]
    leads["Bergen"] = {"title": "Bergen", "extract": "Bergen is a city in Norway."}
    source.write_text(json.dumps(leads))
    os.utime(corpus, (0, 0))  # older than its source: written again
    assert len(read_corpus(fanoutqa.corpus_jsonl())) == 2
    assert {p.name for p in tmp_path.iterdir()} == {corpus.name, source.name}  # no leftovers
