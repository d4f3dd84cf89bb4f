import itertools
import threading

import pytest

from mmgrpo_jax.program import Example, Module, Predict
from mmgrpo_jax.program.trace import CallRecord
from mmgrpo_jax.rl.advantages import advantages_for_groups
from mmgrpo_jax.rl.branch import branch_groups, branch_prefix, run_branch_rollouts
from mmgrpo_jax.rl.grouping import GroupingSettings, grouping_rule
from mmgrpo_jax.rl.types import Trajectory
from mmgrpo_jax.testing.scripted import ScriptedLM
from mmgrpo_jax.trainer.config import MMGRPOConfig


class PlanThenAct(Module):
    """`plan` reads the task, `act` reads the plan; only act's reply is scored."""

    def __init__(self):
        self.plan = Predict("task -> plan", bare=True)
        self.act = Predict("plan -> move", bare=True)

    def forward(self, task):
        return self.act(plan=self.plan(task=task).plan)


def metric(example, prediction):
    return float(prediction.move == example.move)


def scripted(plans, moves):
    """plan's replies from `plans` and act's from `moves`, each in call order."""
    queues = {"plan": iter(plans), "move": iter(moves)}
    lock = threading.Lock()

    def respond(messages):
        field = "plan" if "`plan`" in messages[0]["content"].split("Reply")[-1] else "move"
        with lock:
            return next(queues[field])

    return ScriptedLM(respond, token_ids=True)


SETTINGS = GroupingSettings(num_rollouts=4, branch_module="act")
EXAMPLES = [Example(task="cross", move="left").with_inputs("task")]


def test_branches_share_the_prefix_and_the_branch_calls_group_on_one_prompt():
    # the stem samples plan once; its 3 branches replay it: plan is asked once, act 4 times
    lm = scripted(plans=["go west"], moves=["left", "right", "left", "up"])
    trajectories = run_branch_rollouts(
        PlanThenAct(), EXAMPLES, metric, settings=SETTINGS, num_rollouts=4, lm=lm
    )
    assert [(t.example_index, t.rollout_index) for t in trajectories] == [(0, r) for r in range(4)]
    assert sum("`plan`" in m[0]["content"].split("Reply")[-1] for m, _ in lm.calls) == 1
    assert [[c.replayed for c in t.calls] for t in trajectories] == [[False, False]] + [
        [True, False]
    ] * 3
    plans = {t.calls[0].completion_ids for t in trajectories}
    assert len(plans) == 1  # one plan: the branch point's input is the same for all four
    groups = branch_groups(trajectories, SETTINGS)
    assert [(g.module, g.invocation, len(g.members)) for g in groups] == [("act", 0, 4)]
    assert len({m.calls[0].prompt_ids for m in groups[0].members}) == 1  # one prompt
    (advantages,) = advantages_for_groups(groups)
    rewards = [t.reward for t in trajectories]
    assert rewards == [1.0, 0.0, 1.0, 0.0]
    # the right branch ("left") gets the credit, counterfactually: the plan is the same
    assert all((a > 0) == (r == 1.0) for a, r in zip(advantages, rewards, strict=True))


def test_a_stem_whose_shared_calls_failed_to_parse_is_not_branched():
    stem = Trajectory(0, 0, (_failed_call(),), 0.0, "format_failure")
    assert branch_prefix(stem, "plan", 0) == ()  # nothing before the first call
    failed_first = Trajectory(0, 0, (_failed_call(), _failed_call("act")), 0.0, "format_failure")
    assert branch_prefix(failed_first, "act", 0) is None


def _failed_call(predictor="plan"):
    return CallRecord(predictor, 0, (), "?", (1,), (2,), None, "stop", False, "no parse", None)


def test_a_stem_that_never_reaches_the_branch_call_leaves_plain_rollouts():
    lm = scripted(plans=["a", "b", "c", "d"], moves=["left"] * 4)
    settings = GroupingSettings(num_rollouts=4, branch_module="act", branch_invocation=1)
    trajectories = run_branch_rollouts(
        PlanThenAct(), EXAMPLES, metric, settings=settings, num_rollouts=4, lm=lm
    )
    assert not any(c.replayed for t in trajectories for c in t.calls)  # act[1] never happens
    groups = branch_groups(trajectories, settings)
    assert [g.module for g in groups] == ["plan", "act"]  # grouped module-level as usual


def test_a_program_that_asks_something_else_on_replay_is_an_error_status():
    counter = itertools.count()

    class Drifting(PlanThenAct):
        def forward(self, task):
            plan = self.plan(task=f"{task} {next(counter)}").plan  # a different prompt each run
            return self.act(plan=plan)

    lm = scripted(plans=["p"] * 4, moves=["left"] * 4)
    trajectories = run_branch_rollouts(
        Drifting(), EXAMPLES, metric, settings=SETTINGS, num_rollouts=3, lm=lm
    )
    assert trajectories[0].status == "ok"
    assert all(
        t.status == "error" and "branch replay diverged" in t.error for t in trajectories[1:]
    )


def test_branch_grouping_is_registered_with_its_rollouts_and_configured():
    rule = grouping_rule("branch")
    assert rule.rollouts is run_branch_rollouts and rule.unit == "row"
    cfg = MMGRPOConfig(grouping="branch", branch_module="act")
    assert cfg.branch_module == "act"
    with pytest.raises(ValueError, match="branch_module"):
        MMGRPOConfig(grouping="branch")
    with pytest.raises(ValueError, match="branch_module"):
        MMGRPOConfig(grouping="module", branch_module="act")
    with pytest.raises(ValueError, match="num_rollouts >= 2"):
        run_branch_rollouts(PlanThenAct(), EXAMPLES, metric, settings=SETTINGS, num_rollouts=1)


def test_a_branch_group_keeps_the_invocation_of_its_call():
    class ActTwice(PlanThenAct):
        def forward(self, task):
            first = self.act(plan=self.plan(task=task).plan).move
            return self.act(plan=first)  # act[1] reads act[0]'s reply

    lm = scripted(plans=["p"], moves=["a", "left", "b", "right", "c", "left"])
    settings = GroupingSettings(num_rollouts=3, branch_module="act", branch_invocation=1)
    trajectories = run_branch_rollouts(
        ActTwice(), EXAMPLES, metric, settings=settings, num_rollouts=3, lm=lm
    )
    assert [c.replayed for c in trajectories[1].calls] == [True, True, False]
    groups = branch_groups(trajectories, settings)
    assert [(g.module, g.invocation) for g in groups] == [("act", 1)]  # act[1], not act[0]
