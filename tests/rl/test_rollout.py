import logging
import math
import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest

from mmgrpo_jax.program import Example, Module, ParseError, Predict
from mmgrpo_jax.rl.rollout import run_pairs, run_rollouts, run_trajectory, score_pairs, summarize
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


def test_rollouts_reject_bad_group_size():
    with pytest.raises(ValueError, match="num_rollouts must be >= 1, got 0"):
        run_rollouts(TwoStep(), [EXAMPLE], exact, num_rollouts=0)


class CountingLM(ScriptedLM):
    """A BatchingLM stand-in that records how many clients are open at every call."""

    def __init__(self):
        super().__init__(lambda m: GOOD)
        self.open, self.opened, self.seen = 0, 0, []

    def open_client(self):
        with self._lock:
            self.open += 1
            self.opened += 1

    def close_client(self):
        with self._lock:
            self.open -= 1

    def __call__(self, messages, **sampling):
        with self._lock:
            self.seen.append(self.open)
        return super().__call__(messages, **sampling)


@pytest.mark.parametrize(("examples", "workers"), [(2, 8), (5, 4)])
def test_batching_lm_sees_every_busy_worker_registered(examples, workers):
    lm = CountingLM()
    data = [Example(q=f"x{i}", a="yes").with_inputs("q") for i in range(examples)]
    run_rollouts(TwoStep(), data, exact, num_rollouts=2, lm=lm, max_workers=workers)
    jobs = examples * 2
    assert lm.opened == min(jobs, workers) and lm.open == 0  # balanced
    assert lm.seen[0] == min(jobs, workers)  # registered before the first request
    assert all(1 <= n <= min(jobs, workers) for n in lm.seen)


def test_pairs_run_each_program_on_its_example_and_score_failures_zero():
    crashing = TwoStep(crash=True)
    examples = [EXAMPLE, Example(q="y", a="no").with_inputs("q"), EXAMPLE]
    pairs = list(zip([TwoStep(), TwoStep(), crashing], examples, strict=True))
    lm = ScriptedLM(lambda m: GOOD)
    trajectories = score_pairs(pairs, exact, lm=lm)
    assert [t.example_index for t in trajectories] == [0, 1, 2]
    assert [(t.status, t.reward) for t in trajectories] == [
        ("ok", 1.0),
        ("ok", 0.0),
        ("error", 0.0),
    ]
    assert run_pairs(pairs[2:], exact, lm=lm, failure_score=-2.0)[0].reward == -2.0


@pytest.mark.parametrize(
    ("value", "want"),
    [
        (np.True_, 1.0),
        (np.float32(0.5), 0.5),
        (np.int64(2), 2.0),
        (np.array(0.25), 0.25),
        (jnp.asarray(0.75), 0.75),
        (jnp.asarray(True), 1.0),
        (False, 0.0),
    ],
    ids=["np.bool", "np.float32", "np.int64", "0-d numpy", "0-d jax", "jax bool", "bool"],
)
def test_any_real_scalar_is_a_reward(value, want):
    t = run_trajectory(TwoStep(), EXAMPLE, lambda e, p: value, lm=ScriptedLM(lambda m: GOOD))
    assert (t.status, t.reward) == ("ok", want)


@pytest.mark.parametrize(
    "value", [np.array([1.0, 2.0]), 1 + 2j, np.complex64(1), "1.0", None], ids=str
)
def test_a_non_scalar_or_non_real_reward_is_an_error(value):
    t = run_trajectory(TwoStep(), EXAMPLE, lambda e, p: value, lm=ScriptedLM(lambda m: GOOD))
    assert t.status == "error" and "expected a real number or a bool" in t.error


def test_an_interrupt_does_not_wait_for_the_running_rollouts_and_keeps_the_finished_ones():
    release = threading.Event()

    def reply(messages):
        if "slow" in messages[-1]["content"]:
            release.wait(timeout=30)  # a long sampler call, still running when Ctrl-C comes
        return GOOD

    examples = [Example(q="fast", a="yes").with_inputs("q")] + [
        Example(q=f"slow {i}", a="yes").with_inputs("q") for i in range(3)
    ]
    finished = []

    def on_result(trajectory):
        finished.append(trajectory)
        raise KeyboardInterrupt  # Ctrl-C right after the first rollout came back

    start = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        score_pairs(
            [(TwoStep(), e) for e in examples], exact, lm=ScriptedLM(reply), on_result=on_result
        )
    assert time.perf_counter() - start < 10
    release.set()
    assert [t.example_index for t in finished] == [0]


def test_an_interrupted_run_gives_back_every_client_it_registered():
    lm = CountingLM()
    examples = [Example(q=f"x{i}", a="yes").with_inputs("q") for i in range(6)]

    def interrupt(trajectory):
        raise KeyboardInterrupt

    pairs = [(TwoStep(), e) for e in examples]
    with pytest.raises(KeyboardInterrupt):
        run_pairs(pairs, exact, lm=lm, max_workers=2, on_result=interrupt)
    time.sleep(0.5)  # the running jobs finish in the background
    assert lm.opened == 2 and lm.open == 0
