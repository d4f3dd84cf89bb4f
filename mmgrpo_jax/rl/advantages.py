"""Group-relative advantages as one jitted segment-reduction kernel (DESIGN section 4).

A_i = (r_i - mean_g r) / (std_g r + eps), std with Bessel's correction, matching TRL. Inputs are
padded to a fixed size N so a run compiles once per bucket: group ids live in [0, N) and -1
marks padding. NaN rewards and padding are left out of the statistics and get A = 0, as does
every member of a group with fewer than two finite rewards.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Literal, get_args

import jax
import jax.numpy as jnp
import numpy as np

from mmgrpo_jax.rl.grouping import Group, flatten_rewards
from mmgrpo_jax.shapes import bucket

Scale = Literal["group", "batch", "none"]
SCALES: tuple[str, ...] = get_args(Scale)


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
    if scale == "group":
        std = jnp.sqrt(per_group(centered**2) / jnp.maximum(count - 1.0, 1.0))
        advantages = jnp.where(std > 0, centered / (std + eps), 0.0)
    elif scale == "batch":
        total = jnp.sum(finite)
        batch_mean = jnp.sum(r) / jnp.maximum(total, 1)
        batch_var = jnp.sum(jnp.where(finite, r - batch_mean, 0.0) ** 2) / jnp.maximum(total - 1, 1)
        batch_std = jnp.sqrt(batch_var)
        advantages = jnp.where(batch_std > 0, centered / (batch_std + eps), 0.0)
    else:
        advantages = centered
    return jnp.where(finite & (count >= 2), advantages, 0.0)


def group_advantages(
    rewards: jax.Array | np.ndarray,  # [N]
    group_ids: jax.Array | np.ndarray,  # [N]
    scale: Scale = "group",
    eps: float = 1e-4,
) -> jax.Array:  # [N]
    """Per-row advantages. `group_ids` in [0, N), -1 for padding rows; see the module doc."""
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
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
    groups: Sequence[Group], scale: Scale = "group", eps: float = 1e-4
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
