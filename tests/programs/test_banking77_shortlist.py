import pytest

from mmgrpo_jax.program import Example, Prediction
from mmgrpo_jax.rl.rollout import run_trajectory
from mmgrpo_jax.testing import ScriptedLM
from programs.banking77 import label_names, load_banking77
from programs.banking77_shortlist import (
    REFERENCE_SIZE,
    SHORTLIST,
    Banking77Shortlist,
    intent_match,
    load_banking77_shortlist,
    load_reference,
    named_choice,
)
from tests.paper_data import needs_paper_data

CHOICES = (
    "exchange_rate", "wrong_exchange_rate_for_cash_withdrawal", "card_arrival", "atm_support"
)  # fmt: skip


@pytest.mark.parametrize(
    ("reply", "named"),
    [
        ("card arrival", "card_arrival"),
        ("Card_Arrival.", "card_arrival"),
        ("The intent is: card arrival.", "card_arrival"),
        ("card arrival; atm support", None),  # two named: none
        ("wrong exchange rate for cash withdrawal", "wrong_exchange_rate_for_cash_withdrawal"),
        ("exchange rate", "exchange_rate"),
        ("card arrivals", None),  # words, not letters
        ("", None),
    ],
)
def test_named_choice_reads_the_one_choice_a_reply_names(reply, named):
    assert named_choice(reply, CHOICES) == named


def test_the_exact_match_metric():
    example = Example(text="where is my card", label="card_arrival").with_inputs("text")
    assert intent_match(example, Prediction(label="card_arrival")) == 1.0
    assert intent_match(example, Prediction(label="card_delivery_estimate")) == 0.0
    assert intent_match(example, Prediction(label=None)) == 0.0


def _program() -> Banking77Shortlist:
    reference = [
        Example(text="my card has still not arrived", label="card_arrival"),
        Example(text="how long does card delivery take", label="card_delivery_estimate"),
        Example(text="the ATM kept my card", label="card_swallowed"),
        Example(text="what is the exchange rate", label="exchange_rate"),
        Example(text="my card arrived, how do I activate it", label="activate_my_card"),
    ]
    names = ["card_arrival", "card_delivery_estimate", "card_swallowed", "exchange_rate",
             "activate_my_card", "atm_support"]  # fmt: skip
    return Banking77Shortlist(reference, names)


def test_traces_on_a_scripted_lm_keywords_then_the_pick_among_the_shortlist():
    program = _program()

    def reply(messages):
        prompt = messages[-1]["content"]
        return "card not arrived" if "choices" not in prompt else "The intent is card arrival."

    example = Example(text="Where is my new card?", label="card_arrival").with_inputs("text")
    trajectory = run_trajectory(program, example, intent_match, lm=ScriptedLM(reply))
    assert trajectory.status == "ok" and trajectory.reward == 1.0
    assert [c.predictor for c in trajectory.calls] == ["keywords", "intent"]
    choices = trajectory.prediction.choices
    assert len(choices) == SHORTLIST == len(set(choices)) and choices[0] == "card_arrival"
    # the intent call lists the shortlist in words, after the demos' turns
    asked = trajectory.calls[1].messages[-1]["content"]
    assert "card arrival; " in asked and trajectory.calls[1].inputs["text"] == example.text
    assert len(trajectory.calls[1].messages) == 2 + 2 * len(program.intent.demos)
    # a pick outside the shortlist names no intent and scores 0
    off = ScriptedLM(lambda m: "x" if "choices" not in m[-1]["content"] else "pin blocked")
    assert run_trajectory(program, example, intent_match, lm=off).reward == 0.0


def test_an_intent_no_reference_query_has_is_still_retrievable_by_its_name():
    assert "atm_support" in _program().shortlist("atm support")


def test_reference_labels_must_be_intents():
    with pytest.raises(ValueError, match=r"reference labels \['nope'\]"):
        Banking77Shortlist([Example(text="t", label="nope")], ["card_arrival"])


@needs_paper_data
def test_splits_sizes_and_disjointness_with_the_reference_set():
    splits = load_banking77_shortlist()
    assert (len(splits.train), len(splits.dev), len(splits.test)) == (250, 80, 154)
    assert splits.train == load_banking77().train
    names = label_names()
    assert sorted({e.label for e in splits.test}) == sorted(names)  # two per intent
    reference = load_reference()
    assert len(reference) == REFERENCE_SIZE
    texts = [{e.text for e in part} for part in (splits.train, splits.dev, reference)]
    assert not (texts[0] & texts[1] or texts[0] & texts[2] or texts[1] & texts[2])
    test_texts = {e.text for e in splits.test}
    assert not test_texts & (texts[0] | texts[1] | texts[2])
    assert load_banking77_shortlist(seed=1).test != splits.test
