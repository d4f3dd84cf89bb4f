import pytest

from mmgrpo_jax.commands.demo import DemoConfig, run_demo
from mmgrpo_jax.program import Signature, adapter
from mmgrpo_jax.rl.rollout import run_rollouts
from mmgrpo_jax.testing import ScriptedLM
from programs import testbeds
from programs.testbeds import NEXT, NUMBERS, TESTBEDS


def oracle(program, *, wrong: str | None = None) -> ScriptedLM:
    """Answers every call right, except the predictor named `wrong`, which answers wrong."""
    predictors = dict(program.named_predictors())

    def respond(messages) -> str:
        name = next(
            n for n, p in predictors.items() if p.signature.instructions in messages[0]["content"]
        )
        signature = predictors[name].signature
        inputs = adapter.parse(Signature((), signature.inputs), messages[-1]["content"])
        right = {
            "step": lambda: "stop" if inputs["left"] in ("zero", "none") else "go",
            "begin": lambda: "yes",
            "end": lambda: "yes",
            "shift": lambda: NEXT[inputs["word"]],
            "hop": lambda: NEXT[inputs["word"]],
            "door": lambda: testbeds.synthetic._RIGHT_DOOR[inputs["clue"]],
            "answer": lambda: inputs["sign"],
        }[name]()
        if name == wrong:
            options = signature.outputs[0].type.__args__
            right = next(o for o in options if o != right)
        return right

    return ScriptedLM(respond, token_ids=True)


@pytest.mark.parametrize("name", sorted(TESTBEDS))
def test_a_right_policy_scores_one_and_a_wrong_module_costs_reward(name):
    bed = TESTBEDS[name]
    program = bed.program()
    examples = bed.valset()
    right = run_rollouts(program, examples, bed.metric, num_rollouts=1, lm=oracle(program))
    assert [t.status for t in right] == ["ok"] * len(examples)
    assert [t.reward for t in right] == [1.0] * len(examples)
    for module, _ in program.named_predictors():
        spoiled = run_rollouts(
            program, examples, bed.metric, num_rollouts=1, lm=oracle(program, wrong=module)
        )
        assert sum(t.reward for t in spoiled) < len(examples), module
    vocabulary = set(bed.vocabulary)  # every reply the program accepts is one word of it
    for _, predictor in program.named_predictors():
        assert set(predictor.signature.outputs[0].type.__args__) <= vocabulary


def test_the_counter_makes_as_many_calls_as_the_policy_decides():
    program = testbeds.Counter(max_calls=3)
    bed = TESTBEDS["counter"]
    trajectories = run_rollouts(
        program, bed.valset(), bed.metric, num_rollouts=1, lm=oracle(program)
    )
    assert [len(t.calls) for t in trajectories] == [1, 2, 3, 3]  # zero..three; three is capped
    assert [t.prediction.answer for t in trajectories] == list(NUMBERS)


def test_the_long_chain_rewards_the_fraction_of_right_hops():
    program = testbeds.LongChain(length=4)
    [example] = testbeds.word_examples(hops=4)[:1]
    replies = ["birch", "cedar", "amber", "birch"]  # amber -> birch -> cedar right, then wrong
    [t] = run_rollouts(
        program,
        [example],
        testbeds.right_hops,
        num_rollouts=1,
        lm=ScriptedLM.from_replies(replies),
    )
    assert t.reward == pytest.approx(3 / 4)  # the last hop (amber -> birch) is right again


def test_an_unknown_testbed_is_refused_by_name():
    with pytest.raises(ValueError, match="testbed must be one of"):
        DemoConfig(testbed="three_doors")


@pytest.mark.parametrize("name", sorted(set(TESTBEDS) - {"two_doors"}))
def test_each_testbed_trains_end_to_end_with_the_tiny_policy(name, tmp_path):
    config = DemoConfig(
        testbed=name,
        num_steps=2,
        examples_per_step=4,
        num_rollouts=2,
        hidden_size=8,
        num_layers=1,
        run_dir=str(tmp_path / name),
        progress=False,
    )
    summary = run_demo(config)
    assert summary["steps"] == 2
    assert 0.0 <= summary["eval_reward_after"] <= 1.0
    assert (tmp_path / name / "metrics.jsonl").is_file()
