import io

import numpy as np
import pytest

from mmgrpo_jax import cli
from mmgrpo_jax.demo import DemoConfig, print_demo, run_demo


def test_demo_groups_match_traces_and_advantages_are_normalised():
    config = DemoConfig(num_examples=4, num_rollouts=6, align="ragged", seed=3)
    result = run_demo(config)
    assert len(result.trajectories) == 24
    by_key = {(t.example_index, t.rollout_index): t for t in result.trajectories}
    for group, adv in zip(result.groups, result.advantages, strict=True):
        assert len(group.members) == 6 and adv.shape == (6,)
        for member in group.members:
            [call] = member.calls
            trajectory = by_key[(group.example_index, member.rollout_index)]
            assert call in trajectory.calls and member.reward == trajectory.reward
            assert (call.predictor, call.invocation) == (group.module, group.invocation)
        rewards = np.array(group.rewards)
        if rewards.std() > 0:
            np.testing.assert_allclose(adv.mean(), 0.0, atol=1e-5)
            np.testing.assert_allclose(adv.std(ddof=1), 1.0, atol=1e-3)
        else:
            assert not adv.any()
    out = io.StringIO()
    print_demo(config, result, out)
    assert "Module-level groups (align=ragged, scale=group)" in out.getvalue()


def test_cli_demo_runs_with_overrides(capsys):
    assert cli.main(["demo", "num_examples=2", "num_rollouts=3", "align=truncate"]) == 0
    printed = capsys.readouterr().out
    assert "2 examples x G=3 rollouts" in printed
    assert "start" in printed and "hop" in printed


def test_cli_demo_rejects_bad_values_with_the_field_name(capsys):
    with pytest.raises(SystemExit):
        cli.main(["demo", "accuracy=2"])
    assert "DemoConfig.accuracy must be in [0, 1], got 2" in capsys.readouterr().err
