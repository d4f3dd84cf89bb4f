"""GRPO groups from trajectories: module-level (the k-th call of each module) or trajectory-level.

docs/design.md#grouping. Module-level, per example e and module p: collect p's calls per rollout in
invocation order, align the lists across rollouts, make group k from the k-th calls, pad a short
group to the configured G by repeating its members in order, optionally pick K diverse members.
Every member keeps the reward of the trajectory it came from.

Grouping rules live in a registry (`register_grouping`); each declares the unit its loss
normalises by: "row" (every training row is its own sequence) or "trajectory" (all rows of one
group member form one unit: a whole trajectory at trajectory level).
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Sequence
from typing import Literal, get_args

import numpy as np

from mmgrpo_jax.program.trace import CallRecord
from mmgrpo_jax.rl.registry import Registry
from mmgrpo_jax.rl.types import Trajectory

Align = Literal["truncate", "fill_random", "fill_last", "ragged"]
ALIGN_MODES: tuple[str, ...] = get_args(Align)


@dataclasses.dataclass(frozen=True)
class GroupMember:
    """A row source: one call (module-level) or all calls of a trajectory (trajectory-level)."""

    rollout_index: int
    reward: float
    calls: tuple[CallRecord, ...]


@dataclasses.dataclass(frozen=True)
class Group:
    """One GRPO group; `module` and `invocation` are None for trajectory-level groups."""

    example_index: int
    module: str | None
    invocation: int | None
    members: tuple[GroupMember, ...]

    @property
    def rewards(self) -> list[float]:
        return [m.reward for m in self.members]


def select_k_diverse(rewards: Sequence[float], k: int) -> list[int]:
    """Indices of k members spread over the reward range (max and min always kept).

    Sort by reward descending (stable; NaN last), then take positions round(linspace(0, n-1, k))
    with round-half-to-even; k > n repeats members, k < n thins them.
    """
    n = len(rewards)
    if n == 0:
        raise ValueError("select_k_diverse needs at least one reward")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    keyed = [(-r if np.isfinite(r) else np.inf) for r in rewards]
    order = sorted(range(n), key=lambda i: keyed[i])
    positions = np.rint(np.linspace(0, n - 1, k)).astype(int)
    return [order[p] for p in positions]


@dataclasses.dataclass(frozen=True)
class GroupingSettings:
    """What a grouping rule is told each step."""

    num_rollouts: int  # G: the configured group size, and the target of padding
    align: str = "truncate"
    select_k: int | None = None
    seed: int = 0  # fresh per step (fill_random draws)
    branch_module: str | None = None  # grouping=branch: the predictor the rollouts branch at
    branch_invocation: int = 0  # and which of its calls in a trajectory


GroupingFn = Callable[[Sequence[Trajectory], GroupingSettings], list[Group]]
# how a rule's step rollouts are made, when not G independent runs of each example:
# (program, examples, metric, settings, **run_rollouts' keyword arguments) -> trajectories
RolloutFn = Callable[..., list[Trajectory]]
Unit = Literal["row", "trajectory"]
UNITS: tuple[str, ...] = get_args(Unit)


@dataclasses.dataclass(frozen=True)
class GroupingRule:
    group: GroupingFn
    unit: Unit  # what the loss's sequence-level aggregations normalise by
    rollouts: RolloutFn | None = None  # None: rl.rollout.run_rollouts


GROUPINGS: Registry[GroupingRule] = Registry("grouping rule", "mmgrpo_jax.register_grouping")


def register_grouping(
    name: str, group: GroupingFn, *, unit: Unit = "row", rollouts: RolloutFn | None = None
) -> None:
    """Make `MMGRPOConfig(grouping=name)` form its groups with `group(trajectories, settings)`.

    `unit="row"`: every (member, call) row is one sequence of the loss; `unit="trajectory"`: all
    the rows of one group member are one sequence (normalised by their total tokens), as the
    trajectory-level objective does with whole trajectories (a member may hold any calls).
    `rollouts` makes the step's trajectories when the rule needs them made its own way (branch
    rollouts); by default they are G independent runs of each example.
    """
    if unit not in UNITS:
        raise ValueError(f"unit must be one of {UNITS}, got {unit!r}")
    if rollouts is not None and not callable(rollouts):
        raise TypeError(f"rollouts of grouping {name!r} must be callable, got {rollouts!r}")
    GROUPINGS.add(name, group, GroupingRule(group, unit, rollouts))


def grouping_rule(name: str, field: str = "grouping") -> GroupingRule:
    return GROUPINGS.lookup(name, field)


def _pad(members: list[GroupMember], size: int) -> list[GroupMember]:
    return [members[i % len(members)] for i in range(max(size, len(members)))]


def _finish(members: list[GroupMember], size: int, select_k: int | None) -> tuple[GroupMember, ...]:
    members = _pad(members, size)
    if select_k is not None:
        members = [members[i] for i in select_k_diverse([m.reward for m in members], select_k)]
    return tuple(members)


def _by_example(trajectories: Sequence[Trajectory]) -> dict[int, list[Trajectory]]:
    by_example: dict[int, list[Trajectory]] = {}
    for t in trajectories:
        by_example.setdefault(t.example_index, []).append(t)
    for e, group in by_example.items():
        group.sort(key=lambda t: t.rollout_index)
        indices = [t.rollout_index for t in group]
        if len(set(indices)) != len(indices):
            raise ValueError(f"example {e} has repeated rollout indices {indices}")
    return dict(sorted(by_example.items()))


def _aligned_lengths(lengths: list[int], align: str) -> list[int]:
    present = [n for n in lengths if n > 0]
    if align == "truncate":
        return [min(present) if n else 0 for n in lengths]
    if align in ("fill_random", "fill_last"):
        return [max(present) if n else 0 for n in lengths]
    return lengths  # ragged


def _module_groups(
    example_index: int,
    module: str,
    rollouts: list[Trajectory],
    align: str,
    size: int,
    select_k: int | None,
    rng: np.random.Generator,
) -> list[Group]:
    calls = [
        sorted((c for c in t.calls if c.predictor == module), key=lambda c: c.invocation)
        for t in rollouts
    ]
    lengths = _aligned_lengths([len(c) for c in calls], align)
    aligned: list[list[CallRecord]] = []
    for own, length in zip(calls, lengths, strict=True):
        extra = length - len(own)
        if align == "fill_random" and extra > 0:
            fill = [own[i] for i in rng.integers(0, len(own), size=extra)]
        else:
            fill = [own[-1]] * max(extra, 0) if own else []
        aligned.append((own + fill)[:length])
    groups = []
    for k in range(max(lengths)):
        members = [
            GroupMember(t.rollout_index, t.reward, (row[k],))
            for t, row in zip(rollouts, aligned, strict=True)
            if k < len(row)
        ]
        groups.append(Group(example_index, module, k, _finish(members, size, select_k)))
    return groups


def module_level_groups(
    trajectories: Sequence[Trajectory],
    *,
    align: Align = "truncate",
    select_k: int | None = None,
    seed: int = 0,
    num_rollouts: int | None = None,
) -> list[Group]:
    """Module-level groups, ordered by example, module (first appearance), invocation.

    Short groups are padded to `num_rollouts` (the configured G; by default the example's number
    of trajectories), never to how many happen to be passed in. `fill_random` draws from a
    generator seeded by (seed, example, module) so results do not depend on other groups.
    """
    if align not in ALIGN_MODES:
        raise ValueError(f"align must be one of {ALIGN_MODES}, got {align!r}")
    _check_sizes(select_k, num_rollouts)
    groups = []
    for e, rollouts in _by_example(trajectories).items():
        size = len(rollouts) if num_rollouts is None else num_rollouts
        modules = list(dict.fromkeys(c.predictor for t in rollouts for c in t.calls))
        for module in modules:
            rng = np.random.default_rng([seed, e, zlib.crc32(module.encode())])
            groups += _module_groups(e, module, rollouts, align, size, select_k, rng)
    return groups


def trajectory_level_groups(
    trajectories: Sequence[Trajectory],
    *,
    select_k: int | None = None,
    num_rollouts: int | None = None,
) -> list[Group]:
    """One group per example holding its whole trajectories (every call is a row), padded to
    `num_rollouts` (default: the example's number of trajectories)."""
    _check_sizes(select_k, num_rollouts)
    groups = []
    for e, rollouts in _by_example(trajectories).items():
        size = len(rollouts) if num_rollouts is None else num_rollouts
        members = [GroupMember(t.rollout_index, t.reward, t.calls) for t in rollouts]
        groups.append(Group(e, None, None, _finish(members, size, select_k)))
    return groups


def _check_sizes(select_k: int | None, num_rollouts: int | None) -> None:
    if select_k is not None and select_k < 1:
        raise ValueError(f"select_k must be >= 1 or None, got {select_k}")
    if num_rollouts is not None and num_rollouts < 1:
        raise ValueError(f"num_rollouts must be >= 1 or None, got {num_rollouts}")


register_grouping(
    "module",
    lambda trajectories, s: module_level_groups(
        trajectories,
        align=s.align,
        select_k=s.select_k,
        seed=s.seed,
        num_rollouts=s.num_rollouts,
    ),
    unit="row",
)
register_grouping(
    "trajectory",
    lambda trajectories, s: trajectory_level_groups(
        trajectories, select_k=s.select_k, num_rollouts=s.num_rollouts
    ),
    unit="trajectory",
)


def flatten_rewards(groups: Sequence[Group]) -> tuple[np.ndarray, np.ndarray]:
    """Member rewards and group ids (0..len(groups)-1) as flat arrays for the advantage kernel."""
    rewards = np.array([m.reward for g in groups for m in g.members], dtype=np.float32)
    ids = np.array([i for i, g in enumerate(groups) for _ in g.members], dtype=np.int32)
    return rewards, ids
