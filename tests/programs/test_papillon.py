import pytest

from mmgrpo_jax.program import Example, Prediction
from mmgrpo_jax.program.adapter import format_outputs
from mmgrpo_jax.rl.rollout import run_trajectory
from mmgrpo_jax.testing import ScriptedLM
from programs.papillon import Papillon, PapillonJudge, load_pupa, pii_units
from tests.paper_data import needs_paper_data


@needs_paper_data
def test_pupa_splits_in_file_order_and_pii_units():
    splits = load_pupa()
    assert (len(splits.train), len(splits.dev), len(splits.test)) == (111, 111, 221)
    first = splits.train[0]
    assert first.inputs() == {"user_query": first.user_query}
    assert "napco national company" in first.pii_units
    assert all(unit == unit.strip() and unit for e in splits.test for unit in e.pii_units)
    assert pii_units("a || b||  ||c ") == ["a", "b", "c"]
    assert pii_units("") == [] and pii_units(None) == []


def judge_lm(better: dict[tuple[str, str], bool], leaked: int):
    """Quality: looks up (response A, response B); leakage: always `leaked`."""
    judge = PapillonJudge(None)

    def respond(messages):
        text = messages[-1]["content"]
        if "response_a" in text:
            a = text.split("[[ ## response_a ## ]]\n")[1].split("\n\n")[0]
            b = text.split("[[ ## response_b ## ]]\n")[1].split("\n\n")[0]
            return format_outputs(judge.quality.signature, {"judgment": better[(a, b)]})
        return format_outputs(judge.leakage.signature, {"num_pii_leaked": leaked})

    return ScriptedLM(respond)


EXAMPLE = Example(
    user_query="q", target_response="REF", pii_units=["ann", "paris", "42"]
).with_inputs("user_query")
PRED = Prediction(llm_request="req", llm_response="x", response="OURS")


@pytest.mark.parametrize(
    ("ours_vs_ref", "ref_vs_ours", "quality"),
    [(True, False, 1.0), (True, True, 1.0), (False, False, 1.0), (False, True, 0.0)],
)
def test_quality_is_judged_in_both_orders(ours_vs_ref, ref_vs_ours, quality):
    lm = judge_lm({("OURS", "REF"): ours_vs_ref, ("REF", "OURS"): ref_vs_ours}, leaked=1)
    score, got_quality, leakage = PapillonJudge(lm).score(EXAMPLE, PRED)
    assert got_quality == quality and leakage == pytest.approx(1 / 3)
    assert score == pytest.approx((quality + 1 - 1 / 3) / 2)
    assert len(lm.calls) == 3


@pytest.mark.parametrize(("leaked", "leakage"), [(0, 0.0), (2, 2 / 3), (3, 1.0), (7, 1.0)])
def test_leakage_is_the_fraction_of_units_capped(leaked, leakage):
    lm = judge_lm({("OURS", "REF"): False, ("REF", "OURS"): True}, leaked=leaked)
    assert PapillonJudge(lm).score(EXAMPLE, PRED) == pytest.approx((0.5 - leakage / 2, 0, leakage))


def test_empty_pii_means_no_leakage_and_no_leakage_call():
    lm = judge_lm({("OURS", "REF"): True, ("REF", "OURS"): False}, leaked=5)
    example = Example(user_query="q", target_response="REF", pii_units=[])
    assert PapillonJudge(lm)(example, PRED) == 1.0
    assert len(lm.calls) == 2


def test_program_sends_the_redacted_request_to_the_untrusted_lm():
    untrusted = ScriptedLM(lambda m: "external answer")
    program = Papillon(untrusted)
    request = format_outputs(
        program.craft_redacted_request.signature,
        {"reasoning": "drop the name", "llm_request": "Write a resume for a compliance officer."},
    )
    final = format_outputs(program.respond_to_query.signature, {"response": "Here it is."})
    policy = ScriptedLM.from_replies([request, final], token_ids=True)
    lm = judge_lm({("Here it is.", "REF"): True, ("REF", "Here it is."): False}, leaked=0)
    t = run_trajectory(program, EXAMPLE, PapillonJudge(lm), lm=policy)
    assert t.status == "ok" and t.reward == 1.0
    assert untrusted.calls[0][0] == (
        {"role": "user", "content": "Write a resume for a compliance officer."},
    )
    assert [c.predictor for c in t.calls] == ["craft_redacted_request", "respond_to_query"]
    assert "external answer" in t.calls[1].messages[-1]["content"]
