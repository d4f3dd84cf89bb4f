import pytest

from mmgrpo_jax.program import Example, Prediction
from mmgrpo_jax.rl.rollout import run_trajectory
from mmgrpo_jax.testing import ScriptedLM
from programs.papillon import load_pupa
from programs.papillon_lexical import (
    DEV_SIZE,
    MAX_QUERY_CHARS,
    TEST_SIZE,
    PapillonLexical,
    leakage,
    leaked_units,
    load_pupa_short,
    new_content_f1,
    privacy_score,
    real_units,
)
from tests.paper_data import needs_paper_data

# PUPA_New row 2's query (shortened) and its annotated units: sara || ipaep || frc
QUERY = (
    "Send a friendly e-mail opening to Sara telling her thank you for calling me back so "
    "quickly, taking the time to discuss with me FRC's IPAEP"
)
UNITS = ["sara", "ipaep", "frc"]


@pytest.mark.parametrize(
    ("request_text", "leaked"),
    [
        ("Write a friendly email thanking someone for calling back quickly.", []),
        ("Write an email to Sara to thank her.", ["sara"]),
        ("Thank SARA for discussing FRC's IPAEP.", ["sara", "ipaep", "frc"]),
        ("Thank Sarah for the call.", []),  # words, whole: 'sarah' is not 'sara'
        ("Discuss the I.P.A.E.P. plan", []),  # split by its dots: not the unit's word
    ],
)
def test_leakage_counts_the_units_whose_words_the_request_holds(request_text, leaked):
    assert leaked_units(request_text, UNITS) == leaked
    assert leakage(request_text, UNITS) == len(leaked) / 3


def test_placeholders_are_not_units_and_a_query_without_units_leaks_nothing():
    units = ["presidio_anonymized_person", "napco national company", " "]
    assert real_units(units) == ["napco national company"]
    assert leakage("my name is <PRESIDIO_ANONYMIZED_PERSON>", units) == 0.0
    assert leakage("I work at Napco National Company", units) == 1.0
    assert leakage("anything", ["presidio_anonymized_url"]) == 0.0


def test_quality_is_f1_of_the_content_words_beyond_the_query():
    query = "write an email to my boss about the meeting"
    reference = "Dear boss, the meeting moved to Friday at noon. Best regards"
    # the reference adds {dear, moved, friday, noon, best, regards}; stopwords do not count
    assert new_content_f1(query, reference, query) == 0.0  # copying the query adds nothing
    assert new_content_f1(reference, reference, query) == 1.0
    # adds {friday, noon, lunch}: precision 2/3, recall 2/6 -> F1 = 4/9
    assert new_content_f1("Friday at noon, lunch", reference, query) == pytest.approx(4 / 9)
    assert new_content_f1("", reference, query) == 0.0


def test_the_score_is_the_papers_shape():
    example = Example(user_query=QUERY, target_response="Dear Sara, thanks", pii_units=UNITS)
    # leakage: "sara" of the three units
    prediction = Prediction(request="email Sara", response="Dear colleague, thanks")
    quality = new_content_f1("Dear colleague, thanks", "Dear Sara, thanks", QUERY)
    assert quality == pytest.approx(0.8)  # ours adds {dear, colleague, thanks}: P 2/3, R 1
    assert privacy_score(example, prediction) == pytest.approx((0.8 + 1 - 1 / 3) / 2)


def test_traces_on_a_scripted_lm_redact_untrusted_respond():
    untrusted = ScriptedLM(lambda m: "Here is a draft: Dear colleague, thanks.")

    def policy(messages):
        asked = messages[-1]["content"]
        return "Write a thank-you email." if "assistant_reply" not in asked else "Dear Sara, thanks"

    program = PapillonLexical(untrusted)
    example = Example(user_query=QUERY, target_response="Dear Sara, thanks", pii_units=UNITS)
    trajectory = run_trajectory(
        program, example.with_inputs("user_query"), privacy_score, lm=ScriptedLM(policy)
    )
    assert trajectory.status == "ok"
    assert [c.predictor for c in trajectory.calls] == ["redact", "respond"]  # untrusted: untraced
    assert untrusted.calls[0][0][-1]["content"] == "Write a thank-you email."  # the request alone
    assert trajectory.calls[1].inputs["assistant_reply"].startswith("Here is a draft")
    assert trajectory.prediction.request == "Write a thank-you email."
    assert trajectory.reward == pytest.approx((1.0 + 1.0 - 0.0) / 2)


@needs_paper_data
def test_splits_are_the_papers_cuts_kept_short_and_disjoint():
    splits, full = load_pupa_short(), load_pupa()
    assert (len(splits.train), len(splits.dev), len(splits.test)) == (61, DEV_SIZE, TEST_SIZE)
    for part, whole in (
        (splits.train, full.train),
        (splits.dev, full.dev),
        (splits.test, full.test),
    ):
        assert all(e in whole and len(e.user_query) <= MAX_QUERY_CHARS for e in part)
    queries = [{e.user_query for e in part} for part in (splits.train, splits.dev, splits.test)]
    assert not (queries[0] & queries[1] or queries[0] & queries[2] or queries[1] & queries[2])
    assert sum(bool(real_units(e.pii_units)) for e in splits.test) > 50  # most hold real PII
