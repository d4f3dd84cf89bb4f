"""The task registry: a new task is one `register_task` call, and every command can name it."""

import pytest

from mmgrpo_jax.program import Example, Predict
from programs.data import Splits
from programs.tasks import TASKS, TaskConfig, build_task, load_splits, register_task


@pytest.fixture
def echo_task():
    rows = [Example(text=f"word{i}", label=f"word{i}").with_inputs("text") for i in range(6)]
    seen = []

    def build(cfg, local_lm):
        seen.append(local_lm)
        return Predict("text -> label", bare=True), lambda e, p: p.label == e.label

    register_task("echo", load=lambda cfg: Splits(rows[:4], rows[4:5], rows[5:]), build=build)
    yield seen
    TASKS.pop("echo")


def test_a_registered_task_is_built_from_its_name(echo_task):
    task = build_task(TaskConfig(name="echo"), local_lm="the frozen base")
    assert [e.text for e in task.splits.train] == ["word0", "word1", "word2", "word3"]
    assert task.program.signature.input_names == ("text",)
    assert echo_task == ["the frozen base"]  # the role's LM reaches the task's build
    assert len(load_splits(TaskConfig(name="echo")).dev) == 1


def test_names_are_checked_against_the_registry(echo_task):
    with pytest.raises(ValueError, match=r"TaskConfig.name must be a registered task \(\[.*'echo'"):
        TaskConfig(name="ecco")
    with pytest.raises(ValueError, match="task 'echo' is already registered"):
        register_task("echo", load=lambda cfg: None, build=lambda cfg, lm: None)
    assert set(TASKS) >= {"banking77", "papillon", "hover", "capitals", "echo"}
