"""Group-relative advantages as one jitted segment-reduction kernel (docs/design.md#losses).

A_i = (r_i - mean_g r) / (std_g r + eps), std with Bessel's correction, matching TRL. Inputs are
padded to a fixed size N so a run compiles once per bucket: group ids live in [0, N) and -1
marks padding. NaN rewards and padding are left out of the statistics and get A = 0, as does
every member of a group with fewer than two finite rewards. How centred rewards are scaled is a
registry (`register_advantage_scale`): "group" (TRL's), "batch" and "none" are its built-ins.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mmgrpo_jax.rl.grouping import Group, flatten_rewards
from mmgrpo_jax.rl.registry import Registry
from mmgrpo_jax.sampler.shapes import bucket


@dataclasses.dataclass(frozen=True)
class GroupStats:
    """What an advantage scale reads inside the kernel, per row (padding and NaN rows hold 0
    and `finite` False; the kernel zeroes their advantage whatever a scale returns)."""

    rewards: jax.Array  # [N]
    centered: jax.Array  # [N] r - the mean of the row's group
    finite: jax.Array  # [N] bool
    count: jax.Array  # [N] finite rewards in the row's group
    group_sum: Callable[[jax.Array], jax.Array]  # [N] -> each row's group total, per row
    eps: float


AdvantageScale = Callable[[GroupStats], jax.Array]
SCALES: Registry[AdvantageScale] = Registry(
    "advantage scale", "mmgrpo_jax.register_advantage_scale"
)


def register_advantage_scale(name: str, scale: AdvantageScale) -> None:
    """Make `advantage_scale=name` turn a step's centred rewards into advantages with `scale`."""
    SCALES.add(name, scale, scale)


def _group_scale(x: GroupStats) -> jax.Array:
    """TRL's: divided by the group's std (Bessel), a zero-spread group giving 0."""
    std = jnp.sqrt(x.group_sum(x.centered**2) / jnp.maximum(x.count - 1.0, 1.0))
    return jnp.where(std > 0, x.centered / (std + x.eps), 0.0)


def _batch_scale(x: GroupStats) -> jax.Array:
    """Divided by the std of every reward of the step (the mean still per group)."""
    total = jnp.sum(x.finite)
    batch_mean = jnp.sum(x.rewards) / jnp.maximum(total, 1)
    deviation = jnp.where(x.finite, x.rewards - batch_mean, 0.0)
    batch_std = jnp.sqrt(jnp.sum(deviation**2) / jnp.maximum(total - 1, 1))
    return jnp.where(batch_std > 0, x.centered / (batch_std + x.eps), 0.0)


def _no_scale(x: GroupStats) -> jax.Array:
    """The centred reward itself (Dr. GRPO's advice)."""
    return x.centered


register_advantage_scale("group", _group_scale)
register_advantage_scale("batch", _batch_scale)
register_advantage_scale("none", _no_scale)


@functools.partial(jax.jit, static_argnames=("scale", "eps"))
def _group_advantages(
    rewards: jax.Array,  # [N] float
    group_ids: jax.Array,  # [N] int, -1 = padding
    scale: str,
    eps: float,
) -> jax.Array:  # [N]
    n = rewards.shape[0]
    finite = (group_ids >= 0) & jnp.isfinite(rewards)
    # Padding and NaN rows go to an extra segment n that is sliced away.
    segment = jnp.where(finite, group_ids, n)
    r = jnp.where(finite, rewards, 0.0)

    def per_group(values: jax.Array) -> jax.Array:
        return jax.ops.segment_sum(values, segment, num_segments=n + 1)[segment]

    count = per_group(finite.astype(r.dtype))
    # Centre on a member's own value first: equal rewards then differ by exactly 0, where a
    # float32 mean (3 x 1.9060161 / 3) can miss them by an ulp and, divided by a std of the
    # same size, give a zero-variance group advantages of order 1 / eps * 1e-7 (or 1 at eps 0).
    shift = jax.ops.segment_max(r, segment, num_segments=n + 1)[segment]
    delta = r - shift
    centered = jnp.where(finite, delta - per_group(delta) / jnp.maximum(count, 1.0), 0.0)
    advantages = SCALES[scale](GroupStats(r, centered, finite, count, per_group, eps))
    return jnp.where(finite & (count >= 2), advantages, 0.0)


def group_advantages(
    rewards: jax.Array | np.ndarray,  # [N]
    group_ids: jax.Array | np.ndarray,  # [N]
    scale: str = "group",
    eps: float = 1e-4,
) -> jax.Array:  # [N]
    """Per-row advantages. `group_ids` in [0, N), -1 for padding rows; see the module doc."""
    SCALES.lookup(scale, "scale")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    rewards, group_ids = jnp.asarray(rewards, jnp.float32), jnp.asarray(group_ids, jnp.int32)
    if rewards.ndim != 1 or rewards.shape != group_ids.shape:
        raise ValueError(
            f"rewards and group_ids must be 1-D of one length, got {rewards.shape} and "
            f"{group_ids.shape}"
        )
    try:
        ids = np.asarray(group_ids)
    except jax.errors.TracerArrayConversionError:
        pass  # called inside a caller's jit: values are not known here, only shapes
    else:
        bad = ids[(ids < -1) | (ids >= ids.shape[0])]
        if bad.size:
            raise ValueError(
                f"group ids must be in [0, {ids.shape[0]}) or -1 for padding, "
                f"got {bad[:5].tolist()}"
            )
    return _group_advantages(rewards, group_ids, scale=scale, eps=float(eps))


MIN_ROWS_BUCKET = 16


def advantages_for_groups(
    groups: Sequence[Group], scale: str = "group", eps: float = 1e-4
) -> list[np.ndarray]:
    """Advantages of each group's members, computed in one padded kernel call."""
    if not groups:
        return []
    rewards, ids = flatten_rewards(groups)
    size = bucket(len(rewards), MIN_ROWS_BUCKET)
    padded_rewards = np.zeros(size, np.float32)
    padded_ids = np.full(size, -1, np.int32)
    padded_rewards[: len(rewards)], padded_ids[: len(ids)] = rewards, ids
    flat = np.asarray(group_advantages(padded_rewards, padded_ids, scale, eps))[: len(rewards)]
    sizes = np.cumsum([len(g.members) for g in groups])[:-1]
    return np.split(flat, sizes)
