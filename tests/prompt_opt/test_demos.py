import threading

import pytest

from mmgrpo_jax.program import Example, Module, Predict
from mmgrpo_jax.program.adapter import format_outputs
from mmgrpo_jax.prompt_opt.demos import build_demo_sets
from mmgrpo_jax.testing import ScriptedLM

QA = Predict("question -> answer")
TRAIN = [Example(question=f"q{i}", answer=f"a{i}").with_inputs("question") for i in range(12)]
RIGHT = {1, 3, 4, 6, 7, 9, 10}  # the teacher answers these correctly


class Echo(Module):
    def __init__(self):
        self.qa = Predict("question -> answer")

    def forward(self, question):
        return self.qa(question=question)


def teacher_lm():
    def respond(messages):
        i = int(messages[-1]["content"].split("\n")[1][1:])
        answer = f"a{i}" if i in RIGHT else "wrong"
        return format_outputs(QA.signature, {"answer": answer})

    return ScriptedLM(respond)


def metric(example, prediction):
    return float(prediction.answer == example.answer)


def build(**kwargs):
    options = dict(lm=teacher_lm(), num_sets=6, max_bootstrapped=3, max_labeled=4, seed=0)
    return build_demo_sets(Echo(), TRAIN, metric, **{**options, **kwargs})


def test_slots_zero_shot_labeled_then_first_successes_in_order():
    sets, runs = build()
    slots = sets["qa"]
    assert runs == 12 and len(slots) == 6
    assert slots[0] == []
    assert len(slots[1]) == 4 and all(d in [dict(e) for e in TRAIN] for d in slots[1])
    assert [d["question"] for d in slots[2][:3]] == ["q1", "q3", "q4"]  # first 3 successes
    assert len(slots[2]) == 4  # topped up with one labeled example
    for slot in slots[3:]:
        bootstrapped = [d for d in slot if d["question"][1:] and int(d["question"][1:]) in RIGHT]
        assert len(bootstrapped) >= 1 and len(slot) <= 4
    for slot in slots:
        for demo in slot:
            assert demo["answer"] == "a" + demo["question"][1:]  # only correct demos


def test_slot_zero_is_the_programs_own_demos_so_candidate_zero_is_the_program_as_given():
    """A program written with demos (banking77_shortlist's) competes as written: slot 0 is not
    zero-shot, and the teacher's labeled demos do not leak into it."""
    program = Echo()
    own = {"question": "q0", "answer": "a0"}
    program.qa.demos.append(own)
    sets, _ = build_demo_sets(
        program, TRAIN, metric, lm=teacher_lm(), num_sets=4, max_bootstrapped=2, max_labeled=2
    )
    assert sets["qa"][0] == [own] and sets["qa"][0][0] is not own
    assert program.qa.demos == [own]  # the teacher's demos did not stay in the program
    assert all(own not in slot for slot in sets["qa"][1:])


def test_teacher_leaves_the_current_example_out_of_its_demos():
    lm = teacher_lm()
    build(lm=lm, pool=5)
    assert len(lm.calls) == 5
    asked = []
    for messages, _ in lm.calls:  # concurrent runs: call order is not pool order
        question = messages[-1]["content"].split("\n")[1]
        shown = [m["content"] for m in messages[1:-1] if m["role"] == "user"]
        assert question not in [c.split("\n")[1] for c in shown]
        assert len(shown) == 4  # max_labeled demos from the rest of the pool
        asked.append(question)
    assert sorted(asked) == [f"q{i}" for i in range(5)]


def test_the_teacher_pool_runs_concurrently():
    """Every teacher run must be in flight at once for the barrier to open (a batching LM then
    samples them together); run one at a time, each would time out and score as an error."""
    barrier = threading.Barrier(6, timeout=10)
    inner = teacher_lm()

    def respond(messages):
        barrier.wait()
        return inner.respond(messages)

    sets, runs = build(lm=ScriptedLM(respond), pool=6)
    assert runs == 6
    assert [d["question"] for d in sets["qa"][2][:3]] == ["q1", "q3", "q4"]


def test_threshold_is_honoured():
    def half(example, prediction):
        return 0.5 if example.question in ("q1", "q3") else metric(example, prediction)

    sets, _ = build_demo_sets(
        Echo(), TRAIN, half, lm=teacher_lm(), num_sets=3, max_bootstrapped=2, threshold=0.9
    )
    assert [d["question"] for d in sets["qa"][2][:2]] == ["q4", "q6"]
    truthy, _ = build_demo_sets(
        Echo(), TRAIN, half, lm=teacher_lm(), num_sets=3, max_bootstrapped=2
    )
    assert [d["question"] for d in truthy["qa"][2][:2]] == ["q1", "q3"]


def test_zero_bootstrapped_demos_runs_nothing_and_keeps_labeled_sets():
    lm = teacher_lm()
    sets, runs = build(lm=lm, max_bootstrapped=0)
    assert runs == 0 and not lm.calls
    assert sets["qa"][0] == [] and all(len(s) == 4 for s in sets["qa"][1:])
    assert sets["qa"][2] != sets["qa"][3]  # distinct seeded samples


def test_same_seed_same_sets_and_bad_arguments():
    assert build()[0] == build()[0]
    assert build(seed=1)[0] != build()[0]
    with pytest.raises(ValueError, match="num_sets must be >= 2"):
        build(num_sets=1)
