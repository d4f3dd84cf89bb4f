import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from mmgrpo_jax.program import (
    ChainOfThought,
    Module,
    ParseError,
    Predict,
    Prediction,
    Signature,
    adapter,
    record_trace,
    using_lm,
)
from mmgrpo_jax.testing import ScriptedLM


class Inner(Module):
    def __init__(self):
        self.query = Predict("claim -> query")
        self.notes = ChainOfThought("claim, passages: list[str] -> notes")


class Outer(Module):
    def __init__(self):
        self.first = Predict("question -> claim")
        self.hops = [Inner(), Inner()]
        self.shared = self.first  # the same predictor again: keeps its first name
        self.by_name = {"final": Predict("notes -> answer")}

    def forward(self, question):
        return self.first(question=question)


def test_named_predictors_are_stable_dotted_names():
    names = [name for name, _ in Outer().named_predictors()]
    assert names == [
        "first",
        "hops[0].query",
        "hops[0].notes",
        "hops[1].query",
        "hops[1].notes",
        "by_name[final]",
    ]
    assert names == [name for name, _ in Outer().named_predictors()]


def test_standalone_predictor_is_named_self():
    predict = Predict("q -> a")
    assert predict.named_predictors() == [("self", predict)]


def test_chain_of_thought_adds_reasoning_first():
    cot = ChainOfThought("question -> answer: int")
    assert cot.signature.output_names == ("reasoning", "answer")
    reply = adapter.format_outputs(cot.signature, {"reasoning": "2 and 2", "answer": 4})
    lm = ScriptedLM(lambda messages: reply)
    cot.lm = lm
    out = cot(question="2+2?")
    assert out.reasoning == "2 and 2" and out.answer == 4
    system = lm.calls[0][0][0]["content"]
    assert system.index("[[ ## reasoning ## ]]") < system.index("[[ ## answer ## ]]")


def test_state_round_trips_through_json(tmp_path):
    program = Outer()
    program.hops[1].query.signature = program.hops[1].query.signature.with_instructions("Be brief.")
    program.by_name["final"].demos = [{"notes": "n", "answer": "a"}]
    path = tmp_path / "state.json"
    program.save(path)
    fresh = Outer()
    fresh.load(path)
    assert fresh.dump_state() == program.dump_state()
    assert fresh.hops[1].query.signature.instructions == "Be brief."
    assert json.loads(path.read_text())["by_name[final]"]["demos"] == [
        {"notes": "n", "answer": "a"}
    ]


def test_load_state_names_missing_and_unknown_predictors():
    state = Outer().dump_state()
    state["ghost"] = state.pop("first")
    with pytest.raises(ValueError, match=r"missing \['first'\], unknown \['ghost'\]"):
        Outer().load_state(state)


def test_predictor_without_lm_says_how_to_fix():
    with pytest.raises(RuntimeError, match="set_lm"):
        Predict("q -> a")(q="x")


def test_unknown_input_is_rejected():
    with pytest.raises(ValueError, match=r"unknown inputs \['z'\]"):
        Predict("q -> a", lm=ScriptedLM(lambda m: ""))(q="x", z=1)


def test_sampling_and_context_lm_reach_the_lm():
    lm = ScriptedLM(lambda m: "[[ ## a ## ]]\nok", token_ids=True)
    predict = Predict("q -> a", sampling={"temperature": 0.3})
    with using_lm(lm):
        assert predict(q="x").a == "ok"
    assert lm.calls[0][1] == {"temperature": 0.3}


def test_trace_records_success_and_parse_failure():
    replies = ["[[ ## claim ## ]]\nsky is blue", "garbage"]
    program = Outer()
    lm = ScriptedLM.from_replies(replies, token_ids=True, logprob=-0.25)
    with record_trace(program, lm=lm) as trace:
        assert program(question="color?") == Prediction(claim="sky is blue")
        with pytest.raises(ParseError):
            program(question="again?")
    ok, bad = trace.calls
    assert (ok.predictor, ok.invocation, bad.invocation) == ("first", 0, 1)
    assert ok.parsed and ok.outputs == {"claim": "sky is blue"} and ok.parse_error is None
    assert ok.messages[-1]["content"] == "[[ ## question ## ]]\ncolor?"
    assert ok.completion_ids == tuple(replies[0].encode())
    assert ok.logprobs == (-0.25,) * len(replies[0].encode())
    assert ok.prompt_ids is not None and ok.finish_reason == "stop"
    assert not bad.parsed and bad.outputs is None and "garbage" in bad.parse_error


def test_predictor_outside_traced_program_is_an_error():
    stray = Predict("q -> a", lm=ScriptedLM(lambda m: "[[ ## a ## ]]\nx"))
    with record_trace(Outer()), pytest.raises(RuntimeError, match="not a predictor of the traced"):
        stray(q="x")


class Echo(Module):
    """Calls its predictor a rollout-specific number of times, with sleeps to interleave threads."""

    def __init__(self):
        self.say = Predict("tag, step: int -> echo")

    def forward(self, tag, times):
        return [self.say(tag=tag, step=i).echo for i in range(times)]


ECHO_INPUTS = Echo().say.signature.inputs


def test_concurrent_rollouts_keep_their_traces_apart():
    def respond(messages):
        time.sleep(0.001)
        inputs = adapter.parse(Signature((), ECHO_INPUTS), messages[-1]["content"])
        return f"[[ ## echo ## ]]\n{inputs['tag']}-{inputs['step']}"

    program, lm = Echo(), ScriptedLM(respond)
    start = threading.Barrier(16)

    def rollout(r):
        start.wait()  # all 16 run at once
        with record_trace(program, lm=lm) as trace:
            program(tag=f"r{r}", times=1 + r % 5)
        return trace.calls

    with ThreadPoolExecutor(16) as pool:
        traces = list(pool.map(rollout, range(16)))
    for r, calls in enumerate(traces):
        assert [c.invocation for c in calls] == list(range(1 + r % 5))
        assert [c.outputs["echo"] for c in calls] == [f"r{r}-{i}" for i in range(1 + r % 5)]


def test_copy_is_independent_but_shares_the_lm():
    lm = ScriptedLM(lambda m: "[[ ## claim ## ]]\nc")
    program = Outer()
    program.set_lm(lm)
    clone = program.copy()
    clone.first.demos.append({"question": "q", "claim": "c"})
    assert program.first.demos == [] and clone.first.lm is lm
    assert [n for n, _ in clone.named_predictors()] == [n for n, _ in program.named_predictors()]
    assert clone.shared is clone.first


class Tool:
    """A tool that cannot be deep-copied, like a retriever holding a lock or an index."""

    def __init__(self):
        self.lock = threading.Lock()

    def __call__(self, query):
        return [query]


def test_copy_shares_tools_and_untraced_lms():
    program = Outer()
    program.tools = {"search": Tool()}
    program.untrusted = ScriptedLM(lambda m: "x")
    program.untrusted.lock = threading.Lock()
    clone = program.copy()
    assert clone.tools["search"] is program.tools["search"]
    assert clone.untrusted is program.untrusted and clone.first is not program.first


def test_bare_predictor_reads_the_reply_as_the_value():
    predict = Predict("q -> n: int", bare=True, lm=ScriptedLM(lambda m: " 42 "))
    assert predict(q="x").n == 42
    with pytest.raises(ValueError, match="exactly one output field"):
        ChainOfThought("q -> a", bare=True)


def test_calls_sent_from_several_threads_get_distinct_indices():
    """The index of a call (part of its sampling key) is taken when it is sent, not when it is
    recorded, so concurrent calls of one rollout never share a key."""
    from mmgrpo_jax.program.trace import Trace

    trace = Trace({})
    with ThreadPoolExecutor(8) as pool:
        indices = list(pool.map(lambda _: trace.next_call(), range(200)))
    assert sorted(indices) == list(range(200))
