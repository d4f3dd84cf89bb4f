import math

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmgrpo_jax.rl import advantages
from mmgrpo_jax.rl.advantages import MIN_ROWS_BUCKET, advantages_for_groups, group_advantages
from mmgrpo_jax.rl.grouping import Group, GroupMember
from mmgrpo_jax.sampler.shapes import bucket

N = 64  # the fixed padded size every hypothesis case uses


def reference(rewards, ids, scale, eps):
    """docs/design.md#losses restated in float64 with explicit loops."""
    rewards, ids = np.asarray(rewards, np.float64), np.asarray(ids)
    finite = (ids >= 0) & np.isfinite(rewards)
    out = np.zeros(len(rewards))
    batch_std = np.std(rewards[finite], ddof=1) if finite.sum() >= 2 else math.nan
    for g in set(ids[ids >= 0].tolist()):
        rows = [i for i in range(len(rewards)) if ids[i] == g and finite[i]]
        if len(rows) < 2:
            continue
        values = rewards[rows]
        mean = values.mean()
        for i in rows:
            if scale == "group":
                out[i] = (rewards[i] - mean) / (np.std(values, ddof=1) + eps)
            elif scale == "batch":
                out[i] = (rewards[i] - mean) / (batch_std + eps)
            else:
                out[i] = rewards[i] - mean
    return out


reward_values = st.one_of(
    st.sampled_from([0.0, 1.0, -1.0, math.nan]),  # ties, zero variance and NaN
    st.floats(-5, 5, allow_nan=False, width=32),
)


@st.composite
def padded_batches(draw):
    sizes = draw(st.lists(st.integers(1, 6), min_size=1, max_size=10))  # singletons included
    ids = np.concatenate([np.full(s, g) for g, s in enumerate(sizes)])
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    ids = rng.permutation(rng.permutation(N)[: len(sizes)][ids])  # sparse ids, rows shuffled
    rewards = np.array([draw(reward_values) for _ in ids], np.float32)
    padded_ids = np.full(N, -1, np.int32)
    padded_rewards = np.full(N, draw(reward_values), np.float32)  # padding holds junk
    padded_ids[: len(ids)], padded_rewards[: len(ids)] = ids, rewards
    return padded_rewards, padded_ids


@settings(max_examples=150, deadline=None)
@given(padded_batches(), st.sampled_from(["group", "batch", "none"]))
def test_kernel_equals_numpy_restatement(batch, scale):
    rewards, ids = batch
    got = np.asarray(group_advantages(rewards, ids, scale=scale))
    np.testing.assert_allclose(got, reference(rewards, ids, scale, 1e-4), rtol=1e-4, atol=1e-4)
    assert np.all(got[ids < 0] == 0) and np.all(np.isfinite(got))


@pytest.mark.parametrize("eps", [1e-4, 0.0])
@pytest.mark.parametrize("scale", ["group", "batch"])
def test_equal_float32_rewards_get_exactly_zero_advantage(scale, eps):
    # 3 x 1.9060161 / 3 is not 1.9060161 in float32 (hypothesis found it): a mean-centred
    # kernel gave this zero-variance group 0.0012 at eps 1e-4 and NaN at eps 0
    rewards = np.array([1.9060161, 1.9060161, 1.9060161, 0.0], np.float32)
    got = np.asarray(group_advantages(rewards, np.array([0, 0, 0, -1]), scale=scale, eps=eps))
    np.testing.assert_array_equal(got, np.zeros(4))


def test_hand_computed_group():
    # rewards 1, 0, 0: mean 1/3, std (ddof=1) = sqrt(1/3)
    got = group_advantages(np.array([1.0, 0.0, 0.0, 0.0]), np.array([0, 0, 0, -1]))
    std = math.sqrt(1 / 3)
    np.testing.assert_allclose(
        got,
        [(2 / 3) / (std + 1e-4), (-1 / 3) / (std + 1e-4), (-1 / 3) / (std + 1e-4), 0.0],
        rtol=1e-6,
    )


def test_singletons_zero_variance_and_nan():
    rewards = np.array([1.0, 0.5, 0.5, 2.0, math.nan, 3.0, math.nan])
    ids = np.array([0, 1, 1, 2, 2, 3, 3])
    got = np.asarray(group_advantages(rewards, ids))
    # group 0 singleton, group 1 zero variance, groups 2 and 3 one finite reward each
    np.testing.assert_array_equal(got, np.zeros(7))


def test_eps_and_scale_none():
    got = group_advantages(np.array([2.0, 0.0]), np.array([0, 0]), scale="none")
    np.testing.assert_allclose(got, [1.0, -1.0])
    got = group_advantages(np.array([2.0, 0.0]), np.array([0, 0]), eps=0.0)
    np.testing.assert_allclose(got, [1 / math.sqrt(2), -1 / math.sqrt(2)], rtol=1e-6)


def test_compiles_once_for_a_fixed_padded_size():
    kernel = advantages._group_advantages
    kernel.clear_cache()
    rng = np.random.default_rng(0)
    for _ in range(5):
        ids = np.sort(rng.integers(-1, 8, size=32)).astype(np.int32)
        group_advantages(rng.normal(size=32).astype(np.float32), ids)
    assert kernel._cache_size() == 1
    group_advantages(np.zeros(64, np.float32), np.zeros(64, np.int32))
    assert kernel._cache_size() == 2


@pytest.mark.parametrize(
    ("rewards", "ids", "kwargs", "message"),
    [
        ([1.0, 2.0], [0, 2], {}, r"group ids must be in \[0, 2\)"),
        ([1.0, 2.0], [0, -2], {}, "got \\[-2\\]"),
        ([1.0], [0, 0], {}, "one length"),
        ([1.0], [0], {"scale": "std"}, "scale must be a registered advantage scale"),
        ([1.0], [0], {"eps": -1.0}, "eps must be >= 0"),
    ],
)
def test_bad_inputs_name_the_value(rewards, ids, kwargs, message):
    with pytest.raises(ValueError, match=message):
        group_advantages(np.array(rewards), np.array(ids), **kwargs)


def test_bucket_size_is_a_power_of_two_at_least_16():
    assert MIN_ROWS_BUCKET == 16
    assert [bucket(n, MIN_ROWS_BUCKET) for n in (0, 1, 16, 17, 100, 1024, 1025)] == [
        16,
        16,
        16,
        32,
        128,
        1024,
        2048,
    ]


def test_advantages_for_groups_matches_per_group_reference():
    def group(rewards):
        return Group(0, "m", 0, tuple(GroupMember(i, r, ()) for i, r in enumerate(rewards)))

    groups = [group([1.0, 0.0, 0.0, 1.0]), group([0.3]), group([2.0, 2.0, -1.0])]
    got = advantages_for_groups(groups)
    for g, adv in zip(groups, got, strict=True):
        np.testing.assert_allclose(
            adv, reference(g.rewards, [0] * len(g.rewards), "group", 1e-4), rtol=1e-5, atol=1e-6
        )
    assert advantages_for_groups([]) == []


def test_a_registered_scale_runs_inside_the_kernel_with_the_padding_rules_kept():
    """A user's scale (here: the sign of the centred reward) is one function of GroupStats; NaN
    rewards, padding and groups of one still get 0, whatever the scale returns."""
    advantages.register_advantage_scale("sign", lambda x: jnp.sign(x.centered) + 0 * x.count)
    try:
        rewards = np.array([1.0, 0.0, 0.5, np.nan, 2.0, 0.0], np.float32)
        ids = np.array([0, 0, 0, 0, 1, -1], np.int32)
        got = np.asarray(group_advantages(rewards, ids, scale="sign"))
        np.testing.assert_array_equal(got, [1.0, -1.0, 0.0, 0.0, 0.0, 0.0])
        with pytest.raises(ValueError, match="advantage scale 'sign' is already registered"):
            advantages.register_advantage_scale("sign", lambda x: x.centered)
    finally:
        advantages.SCALES.pop("sign")
    with pytest.raises(ValueError, match=r"scale must be a registered advantage scale .*'sign'"):
        group_advantages(rewards, ids, scale="sign")
