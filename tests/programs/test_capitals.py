import pytest

from mmgrpo_jax.program import Example, Prediction
from mmgrpo_jax.rl.rollout import score_examples
from mmgrpo_jax.testing import ScriptedLM
from programs.capitals import CAPITALS, Capitals, capital_match, load_capitals, normalize
from programs.tasks import TaskConfig, build_task


def test_splits_are_seeded_and_hold_out_countries():
    splits = load_capitals(0)
    assert (len(splits.train), len(splits.dev), len(splits.test)) == (60, 30, 30)
    countries = [{e.country for e in split} for split in (splits.train, splits.dev, splits.test)]
    assert not (countries[0] & countries[1] or countries[0] & countries[2])
    assert all(e.capital == CAPITALS[e.country] and e.country in e.question for e in splits.train)
    assert [e.question for e in load_capitals(0).dev] == [e.question for e in splits.dev]
    assert [e.question for e in load_capitals(1).dev] != [e.question for e in splits.dev]
    assert len(CAPITALS) == 120


@pytest.mark.parametrize(
    ("reply", "score"),
    [
        ("Bogotá.", 1.0),
        ("bogota", 1.0),
        ("The capital of Colombia is Bogota.", 0.5),
        ("Bogotazo", 0.0),
        ("Medellin", 0.0),
        ("", 0.0),
    ],
)
def test_the_reward_grades_the_reply(reply, score):
    example = Example(question="?", country="Colombia", capital="Bogota").with_inputs("question")
    assert capital_match(example, Prediction(capital=reply)) == score


def test_normalize():
    assert normalize("  Port-au-Prince!! ") == "port au prince"
    assert normalize("Asunción") == "asuncion"


def test_the_program_chains_its_two_modules():
    lm = ScriptedLM(lambda messages: "Japan" if "question" in messages[-1]["content"] else "Tokyo")
    example = Example(question="What is the capital of Japan?", capital="Tokyo").with_inputs(
        "question"
    )
    [trajectory] = score_examples(Capitals(), [example], capital_match, lm=lm)
    assert [c.predictor for c in trajectory.calls] == ["country", "capital"]
    assert "Japan" in lm.calls[1][0][-1]["content"]  # the capital module reads the country reply
    assert trajectory.reward == 1.0


def test_the_task_is_registered():
    task = build_task(TaskConfig(name="capitals", split_seed=3))
    assert isinstance(task.program, Capitals) and task.metric is capital_match
    assert [e.question for e in task.splits.dev] == [e.question for e in load_capitals(3).dev]
