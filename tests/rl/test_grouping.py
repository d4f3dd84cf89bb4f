import math

import pytest

from mmgrpo_jax.program import CallRecord
from mmgrpo_jax.rl.grouping import (
    flatten_rewards,
    module_level_groups,
    select_k_diverse,
    trajectory_level_groups,
)
from mmgrpo_jax.rl.types import Trajectory

REWARDS = [1.0, 0.0, 0.5, 0.25]
B_CALLS = [1, 2, 3, 0]  # module B's call count in rollouts 0..3


def call(module, rollout, k):
    return CallRecord(
        predictor=module,
        invocation=k,
        messages=(),
        completion=f"r{rollout}{module}{k}",
        prompt_ids=None,
        completion_ids=None,
        logprobs=None,
        finish_reason="stop",
        parsed=True,
        parse_error=None,
        outputs={},
    )


def rollouts(example_index=0):
    trajectories = []
    for r, (reward, n_b) in enumerate(zip(REWARDS, B_CALLS, strict=True)):
        calls = [call("A", r, 0)]
        for k in range(n_b):
            calls.append(call("B", r, k))
        trajectories.append(Trajectory(example_index, r, tuple(calls), reward, "ok"))
    return trajectories


def layout(groups, module):
    """Each group of `module` as the list of member call names, checked against its rewards."""
    out = []
    for g in groups:
        if g.module != module:
            continue
        names = []
        for m in g.members:
            [c] = m.calls
            assert m.reward == REWARDS[m.rollout_index]
            assert c.completion.startswith(f"r{m.rollout_index}")
            names.append(c.completion)
        assert g.invocation == len(out)
        out.append(names)
    return out


EXPECTED_B = {
    "truncate": [["r0B0", "r1B0", "r2B0", "r0B0"]],
    "fill_last": [
        ["r0B0", "r1B0", "r2B0", "r0B0"],
        ["r0B0", "r1B1", "r2B1", "r0B0"],
        ["r0B0", "r1B1", "r2B2", "r0B0"],
    ],
    "ragged": [
        ["r0B0", "r1B0", "r2B0", "r0B0"],
        ["r1B1", "r2B1", "r1B1", "r2B1"],
        ["r2B2", "r2B2", "r2B2", "r2B2"],
    ],
}


@pytest.mark.parametrize("align", sorted(EXPECTED_B))
def test_documented_groups_for_1_2_3_0_calls(align):
    groups = module_level_groups(rollouts(), align=align)
    assert layout(groups, "A") == [["r0A0", "r1A0", "r2A0", "r3A0"]]
    assert layout(groups, "B") == EXPECTED_B[align]
    assert [g.module for g in groups] == ["A"] + ["B"] * len(EXPECTED_B[align])


def test_fill_random_draws_from_the_rollouts_own_calls_reproducibly():
    seen_r1_k2 = set()
    for seed in range(20):
        b = layout(module_level_groups(rollouts(), align="fill_random", seed=seed), "B")
        assert b[0] == ["r0B0", "r1B0", "r2B0", "r0B0"]
        assert b[1] == ["r0B0", "r1B1", "r2B1", "r0B0"]  # r0 has one call; r1, r2 their own
        assert b[2][0] == "r0B0" and b[2][2] == "r2B2" and b[2][3] == "r0B0"
        assert b[2][1] in ("r1B0", "r1B1")
        seen_r1_k2.add(b[2][1])
        again = layout(module_level_groups(rollouts(), align="fill_random", seed=seed), "B")
        assert again == b
    assert seen_r1_k2 == {"r1B0", "r1B1"}


def test_groups_are_per_example_and_ordered():
    trajectories = rollouts(example_index=1) + rollouts(example_index=0)
    groups = module_level_groups(trajectories, align="ragged")
    assert [(g.example_index, g.module, g.invocation) for g in groups] == [
        (e, m, k) for e in (0, 1) for m, k in [("A", 0), ("B", 0), ("B", 1), ("B", 2)]
    ]


def test_select_k_on_module_groups_keeps_extremes():
    groups = module_level_groups(rollouts(), align="truncate", select_k=2)
    [a, b] = groups
    assert [m.reward for m in a.members] == [1.0, 0.0]
    assert [m.reward for m in b.members] == [1.0, 0.0]


def test_trajectory_groups_hold_whole_trajectories():
    trajectories = rollouts(0) + rollouts(1)
    groups = trajectory_level_groups(trajectories)
    assert [(g.example_index, g.module, g.invocation) for g in groups] == [
        (0, None, None),
        (1, None, None),
    ]
    for g in groups:
        assert [m.rollout_index for m in g.members] == [0, 1, 2, 3]
        assert g.rewards == REWARDS
        assert [len(m.calls) for m in g.members] == [1 + n for n in B_CALLS]
        assert [m.calls for m in g.members] == [t.calls for t in rollouts(g.example_index)]


def test_select_k_diverse_down_and_up_samples():
    rewards = [0.2, 0.9, 0.5, 0.1, 0.7]  # descending order: 1, 4, 2, 0, 3
    assert select_k_diverse(rewards, 3) == [1, 2, 3]
    assert select_k_diverse(rewards, 2) == [1, 3]
    assert select_k_diverse(rewards, 1) == [1]
    assert select_k_diverse(rewards, 5) == [1, 4, 2, 0, 3]
    assert select_k_diverse(rewards, 7) == [1, 4, 4, 2, 0, 0, 3]


def test_select_k_diverse_rounds_half_to_even_and_sorts_stably():
    # linspace(0, 5, 3) = [0, 2.5, 5]; 2.5 rounds to 2, not 3.
    assert select_k_diverse([6.0, 5.0, 4.0, 3.0, 2.0, 1.0], 3) == [0, 2, 5]
    assert select_k_diverse([1.0, 1.0, 0.0], 2) == [0, 2]
    assert select_k_diverse([math.nan, 0.0, 1.0], 2) == [2, 0]  # NaN sorts last


@pytest.mark.parametrize(("rewards", "k"), [([], 2), ([1.0], 0)])
def test_select_k_diverse_rejects_bad_arguments(rewards, k):
    with pytest.raises(ValueError):
        select_k_diverse(rewards, k)


def test_bad_align_and_repeated_rollouts_are_errors():
    with pytest.raises(ValueError, match="align must be one of"):
        module_level_groups(rollouts(), align="fill")
    with pytest.raises(ValueError, match="repeated rollout indices"):
        module_level_groups(rollouts() + rollouts())


def test_flatten_rewards_numbers_groups_in_order():
    groups = module_level_groups(rollouts(), align="ragged")
    rewards, ids = flatten_rewards(groups)
    assert ids.tolist() == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    assert rewards[4:8].tolist() == [1.0, 0.0, 0.5, 1.0]


def test_groups_pad_to_the_configured_group_size_not_to_the_trajectories_given():
    """docs/design.md#grouping: two of G=4 rollouts reached grouping; every group still has G
    members, padded by repeating its own members in order (the DSPy cross-check's finding)."""
    short = rollouts()[:2]  # rollouts 0 and 1: A once each, B once and twice
    groups = module_level_groups(short, align="ragged", num_rollouts=4)
    names = [[m.calls[0].completion for m in g.members] for g in groups]
    assert names == [
        ["r0A0", "r1A0", "r0A0", "r1A0"],
        ["r0B0", "r1B0", "r0B0", "r1B0"],
        ["r1B1", "r1B1", "r1B1", "r1B1"],
    ]
    [whole] = trajectory_level_groups(short, num_rollouts=4)
    assert [m.rollout_index for m in whole.members] == [0, 1, 0, 1]
    # without a configured size the example's own trajectories set it, as before
    assert all(len(g.members) == 2 for g in module_level_groups(short, align="ragged"))
    with pytest.raises(ValueError, match="num_rollouts must be >= 1 or None, got 0"):
        module_level_groups(short, num_rollouts=0)


def test_the_built_in_rules_are_registered_with_their_units():
    from mmgrpo_jax.rl.grouping import GroupingSettings, grouping_rule

    settings = GroupingSettings(num_rollouts=4, align="ragged")
    assert grouping_rule("module").unit == "row"
    assert grouping_rule("trajectory").unit == "trajectory"
    via_rule = grouping_rule("module").group(rollouts(), settings)
    assert via_rule == module_level_groups(rollouts(), align="ragged", num_rollouts=4)
    assert grouping_rule("branch").unit == "row"
    with pytest.raises(ValueError, match=r"grouping rule \(\['branch', 'module', 'trajectory'"):
        grouping_rule("per-call")


def test_registering_a_rule_twice_or_without_a_function_is_refused():
    from mmgrpo_jax.rl.grouping import register_grouping

    with pytest.raises(ValueError, match="grouping rule 'module' is already registered"):
        register_grouping("module", module_level_groups)
    with pytest.raises(TypeError, match="grouping rule 'x' must be callable"):
        register_grouping("x", "not a function")
    with pytest.raises(ValueError, match="a grouping rule needs a non-empty name"):
        register_grouping("", module_level_groups)
