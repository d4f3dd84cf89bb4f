import logging
import math

import pytest

from mmgrpo_jax.program import Example, Module, ParseError, Predict
from mmgrpo_jax.rl.rollout import run_rollouts, run_trajectory, summarize
from mmgrpo_jax.testing import ScriptedLM

GOOD = "[[ ## a ## ]]\nyes"


class TwoStep(Module):
    def __init__(self, swallow_parse_errors=False, crash=False):
        self.first = Predict("q -> a")
        self.second = Predict("q -> a")
        self.swallow, self.crash = swallow_parse_errors, crash

    def forward(self, q):
        self.first(q=q)
        if self.crash:
            raise ZeroDivisionError("tool failed")
        try:
            return self.second(q=q)
        except ParseError:
            if not self.swallow:
                raise
            return None


EXAMPLE = Example(q="x", a="yes").with_inputs("q")


def exact(example, prediction):
    return prediction.a == example.a


def test_ok_trajectory_has_reward_and_calls():
    t = run_trajectory(TwoStep(), EXAMPLE, exact, lm=ScriptedLM(lambda m: GOOD))
    assert (t.status, t.reward, t.error) == ("ok", 1.0, None)
    assert [c.predictor for c in t.calls] == ["first", "second"]


def test_parse_failure_scores_format_failure_and_keeps_calls():
    lm = ScriptedLM.from_replies([GOOD, "nonsense"])
    t = run_trajectory(TwoStep(), EXAMPLE, exact, lm=lm, format_failure_score=-3.0)
    assert (t.status, t.reward) == ("format_failure", -3.0)
    assert "missing output field 'a'" in t.error
    assert [c.parsed for c in t.calls] == [True, False]


def test_parse_failure_caught_by_the_program_still_counts():
    lm = ScriptedLM.from_replies([GOOD, "nonsense"])
    t = run_trajectory(TwoStep(swallow_parse_errors=True), EXAMPLE, exact, lm=lm)
    assert (t.status, t.reward) == ("format_failure", -1.0)
    assert t.error.startswith("second[0] failed to parse")


def test_program_exception_gets_failure_score_and_keeps_earlier_calls():
    t = run_trajectory(
        TwoStep(crash=True), EXAMPLE, exact, lm=ScriptedLM(lambda m: GOOD), failure_score=0.25
    )
    assert (t.status, t.reward) == ("error", 0.25)
    assert t.error == "program raised ZeroDivisionError: tool failed"
    assert [c.predictor for c in t.calls] == ["first"]


@pytest.mark.parametrize(
    ("metric", "message"),
    [
        (lambda e, p: 1 / 0, "metric raised ZeroDivisionError"),
        (lambda e, p: math.nan, "non-finite reward nan"),
        (lambda e, p: "good", "metric returned 'good'"),
        (lambda e, p: None, "metric returned None; expected a real number or a bool"),
        (lambda e, p: 1e30, "metric returned 1e+30, beyond +-1e+15: advantages are computed"),
    ],
)
def test_metric_failures_become_errors(metric, message):
    t = run_trajectory(TwoStep(), EXAMPLE, metric, lm=ScriptedLM(lambda m: GOOD))
    assert t.status == "error" and t.reward == 0.0
    assert message in t.error
    assert t.prediction is not None and len(t.calls) == 2


def test_rollouts_return_every_pair_in_order_and_never_stop(caplog):
    caplog.set_level(logging.WARNING, logger="mmgrpo_jax.rl.rollout")
    replies = {"x0": GOOD, "x1": "[[ ## a ## ]]\nno", "x2": "broken"}
    lm = ScriptedLM(lambda m: replies[m[-1]["content"].split("\n")[1]])
    examples = [Example(q=f"x{i}", a="yes").with_inputs("q") for i in range(3)]
    trajectories = run_rollouts(TwoStep(), examples, exact, num_rollouts=5, lm=lm)
    assert [(t.example_index, t.rollout_index) for t in trajectories] == [
        (e, r) for e in range(3) for r in range(5)
    ]
    assert [t.status for t in trajectories] == ["ok"] * 10 + ["format_failure"] * 5
    assert summarize(trajectories) == {
        "trajectories": 15,
        "status_ok": 10,
        "status_format_failure": 5,
        "status_error": 0,
        "reward_mean": (5 * 1.0 + 5 * 0.0 + 5 * -1.0) / 15,
        "calls": 10 * 2 + 5 * 1,
    }
    assert sum("ParseError" in r.getMessage() for r in caplog.records) == 5


def test_rollouts_reject_examples_without_inputs_before_running():
    with pytest.raises(ValueError, match="with_inputs"):
        run_rollouts(TwoStep(), [Example(q="x")], exact, num_rollouts=2, lm=ScriptedLM(str))


def test_rollouts_reject_a_row_missing_an_input_the_program_takes_before_running():
    examples = [EXAMPLE, Example(question="x", a="yes").with_inputs("question")]
    with pytest.raises(
        ValueError,
        match=r"^example 1: TwoStep.forward\(q\) cannot take its "
        r"inputs \['question'\] \(missing a required argument: 'q'\)$",
    ):
        run_rollouts(TwoStep(), examples, exact, num_rollouts=2, lm=ScriptedLM(lambda m: GOOD))
