"""samples.jsonl: a step's calls with their rewards, groups and advantages, read back from a
`mmgrpo demo` run folder and checked against the step's metrics and GRPO's formula."""

import io
import json
from collections import defaultdict

import numpy as np
import pytest

from mmgrpo_jax.cli import main
from mmgrpo_jax.commands.demo import DemoConfig, run_demo
from mmgrpo_jax.errors import UserError
from mmgrpo_jax.program.trace import CallRecord
from mmgrpo_jax.rl.grouping import Group, GroupMember
from mmgrpo_jax.rl.types import Trajectory
from mmgrpo_jax.trainer.config import MMGRPOConfig
from mmgrpo_jax.trainer.run_log import RunLogger, samples_markdown
from mmgrpo_jax.trainer.samples import print_step, read_samples, step_samples


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("samples") / "run"
    config = DemoConfig(
        num_steps=2,
        examples_per_step=4,
        num_rollouts=4,
        samples_per_step=-1,
        checkpoint_every=1,
        run_dir=str(run_dir),
        progress=False,
    )
    run_demo(config)
    return run_dir


def _metrics(run_dir, step):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (row,) = [r for r in rows if r["step"] == step and "reward_mean" in r]
    return row


def test_a_steps_samples_give_back_its_groups_rewards_and_advantages(demo_run):
    records = read_samples(demo_run)
    assert sorted({r["step"] for r in records}) == [1, 2]
    for step in (1, 2):
        mine = [r for r in records if r["step"] == step]
        metrics = _metrics(demo_run, step)
        # every trajectory of the step, its reward once
        rewards = {(r["example"], r["rollout"]): r["reward"] for r in mine}
        assert len(rewards) == 4 * 4
        assert np.mean(list(rewards.values())) == pytest.approx(metrics["reward_mean"])
        groups = defaultdict(list)
        for r in mine:
            if r["group"] is not None:
                groups[r["group"]].append(r)
        assert len(groups) == metrics["groups"]
        for members in groups.values():
            assert sorted(m["member"] for m in members) == list(range(4))  # G places each
            assert len({(m["example"], m["module"], m["invocation"]) for m in members}) == 1
            # GRPO's advantage from the logged rewards: (r - mean) / (std, ddof 1, + 1e-4)
            r = np.array([m["reward"] for m in sorted(members, key=lambda m: m["member"])])
            expected = (r - r.mean()) / (r.std(ddof=1) + 1e-4)
            logged = [m["advantage"] for m in sorted(members, key=lambda m: m["member"])]
            np.testing.assert_allclose(logged, expected, rtol=1e-5, atol=1e-6)
        for module in {r["module"] for r in mine if r["group"] is not None}:
            values = [
                r["advantage"] for r in mine if r["group"] is not None and r["module"] == module
            ]
            assert np.mean(values) == pytest.approx(metrics[f"advantage_mean/{module}"], abs=1e-6)
            assert np.std(values) == pytest.approx(metrics[f"advantage_std/{module}"], abs=1e-6)
            assert (
                len({r["group"] for r in mine if r["module"] == module})
                == metrics[f"groups/{module}"]
            )
        for r in mine:
            assert r["prompt"] and r["prompt"][-1]["role"] == "user"
            assert r["trained"] == (r["group"] is not None)  # one-word replies, none cut short


def test_the_samples_command_prints_a_steps_groups(demo_run, capsys):
    out = io.StringIO()
    assert print_step(read_samples(demo_run), 1, out) == 0
    text = out.getvalue()
    assert text.startswith("step 1: 4 example(s)")
    assert text.count("group ") == _metrics(demo_run, 1)["groups"]
    assert "advantage" in text and "prompt: [[ ## clue ## ]]" in text
    assert main(["samples", str(demo_run)]) == 0
    assert capsys.readouterr().out.startswith("step 2:")  # the last step by default
    assert main(["samples", str(demo_run), "--step", "9"]) == 2
    assert "no samples of step 9; the steps logged: 1..2" in capsys.readouterr().err
    assert main(["samples", str(demo_run / "nowhere")]) == 2
    assert "samples.jsonl does not exist" in capsys.readouterr().err


def _record(step, reply="left"):
    return {
        "step": step,
        "example": 0,
        "rollout": 1,
        "module": "door",
        "invocation": 0,
        "group": 0,
        "member": 1,
        "reward": 1.0,
        "advantage": 0.5,
        "trained": True,
        "status": "ok",
        "finish_reason": "stop",
        "replayed": False,
        "prompt": [{"role": "user", "content": "clue"}],
        "reply": reply,
    }


def test_a_resumed_run_keeps_the_samples_its_checkpoint_holds_and_a_fresh_one_starts_anew(
    tmp_path,
):
    log = RunLogger(tmp_path, tensorboard=False)
    for step in (1, 2, 3):
        log.log_samples([_record(step), _record(step, "right")])
    assert [r["step"] for r in read_samples(tmp_path)] == [1, 1, 2, 2, 3, 3]
    RunLogger(tmp_path, tensorboard=False, resumed_step=2)  # step 3 is sampled again
    assert [r["step"] for r in read_samples(tmp_path)] == [1, 1, 2, 2]
    RunLogger(tmp_path, tensorboard=False)
    assert read_samples(tmp_path) == []
    with pytest.raises(UserError, match="holds no records yet"):
        print_step([], None, io.StringIO())
    table = samples_markdown([_record(1, "a | b")])
    assert "| 0 | 1 | door[0] | 0 | 1.000 | +0.500 | yes | a \\| b |" in table


def _call(reply, ids=(7,), finish="stop"):
    return CallRecord(
        "door", 0, ({"role": "user", "content": "clue"},), reply, (1, 2), ids, None, finish,
        True, None, {"door": reply},
    )  # fmt: skip


def test_samples_per_step_chooses_the_examples_and_marks_what_trained():
    calls = {(e, r): _call(f"e{e}r{r}") for e in (0, 1) for r in (0, 1)}
    extra = _call("cut", finish="length")  # example 1's second call: cut at the token limit
    trajectories = [
        Trajectory(e, r, (calls[e, r], extra) if (e, r) == (1, 0) else (calls[e, r],), e + r, "ok")
        for e in (0, 1)
        for r in (0, 1)
    ]
    groups = [
        Group(e, "door", 0, tuple(GroupMember(r, e + r, (calls[e, r],)) for r in (0, 1, 1)))
        for e in (0, 1)
    ]
    groups.append(Group(1, "door", 1, (GroupMember(0, 1.0, (extra,)),)))
    advantages = [np.array([-1.0, 0.5, 0.5]), np.array([-1.0, 0.5, 0.5]), np.array([0.0])]
    first = step_samples(3, trajectories, groups, advantages, examples=1)
    assert {r["example"] for r in first} == {0} and {r["step"] for r in first} == {3}
    # example 0's rollout 1 sits twice in its group (padding): one record per place
    assert [(r["rollout"], r["member"], r["advantage"]) for r in first] == [
        (0, 0, -1.0), (1, 1, 0.5), (1, 2, 0.5)
    ]  # fmt: skip
    every = step_samples(3, trajectories, groups, advantages, examples=-1)
    assert len(every) == 7 and step_samples(3, trajectories, groups, advantages, examples=0) == []
    (cut,) = [r for r in every if r["reply"] == "cut"]
    assert cut["trained"] and cut["group"] == 2
    masked = step_samples(
        3, trajectories, groups, advantages, examples=-1, mask_truncated_completions=True
    )
    assert not next(r for r in masked if r["reply"] == "cut")["trained"]
    alone = step_samples(3, trajectories, groups[:2], advantages[:2], examples=-1)
    (ungrouped,) = [r for r in alone if r["reply"] == "cut"]
    assert ungrouped["group"] is None and ungrouped["advantage"] is None
    assert not ungrouped["trained"]


def test_samples_per_step_is_checked():
    with pytest.raises(ValueError, match="samples_per_step"):
        MMGRPOConfig(samples_per_step=-2)
    assert MMGRPOConfig().samples_per_step == 2
