"""Branch rollouts: G rollouts of an example that share everything before one module's call and
differ from it on, so that call's group shares its input and its credit is counterfactual.

Per example, a stem rollout runs the whole program first; the other G - 1 then replay the
stem's calls made before the branch call (same prompts, same replies, nothing sampled: see
`record_trace`) and sample from the branch call on. The branch call's G completions thus come
from one prompt, and their rewards differ only by what was sampled there and after. The shared
calls are marked `replayed` and left out of every group (they are one action, not G); the calls
from the branch point on are grouped module-level as usual. A stem that never reaches the
branch call (it failed first, or called that module fewer times), or whose shared calls include
a reply that did not parse, leaves its example's other rollouts to run from the start: that
example has no branch group that step. The prefix is the stem's calls in the order they were
recorded: a program that calls its predictors from threads of its own may not branch.

The cost is explicit: the stems run before the branches (two waves of sampling per step), and
the replayed calls cost nothing (`calls_replayed` in the step's metrics).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from mmgrpo_jax.program.example import Example
from mmgrpo_jax.program.lm import LM
from mmgrpo_jax.program.module import Module
from mmgrpo_jax.program.trace import CallRecord
from mmgrpo_jax.rl.grouping import (
    Group,
    GroupingSettings,
    module_level_groups,
    register_grouping,
)
from mmgrpo_jax.rl.rollout import RolloutJob, run_jobs, run_rollouts
from mmgrpo_jax.rl.types import Metric, Trajectory


def branch_prefix(stem: Trajectory, module: str, invocation: int) -> tuple[CallRecord, ...] | None:
    """The stem's calls made before its `module`[`invocation`] call; None if it has none, or
    if one of them failed to parse (every branch would replay the failure: a group of equal
    rewards), so that its example's rollouts run from the start instead."""
    for index, call in enumerate(stem.calls):
        if call.predictor == module and call.invocation == invocation:
            prefix = stem.calls[:index]
            return prefix if all(c.parsed for c in prefix) else None
    return None


def run_branch_rollouts(
    program: Module,
    examples: Sequence[Example],
    metric: Metric,
    *,
    settings: GroupingSettings,
    num_rollouts: int,
    lm: LM | None = None,
    failure_score: float = 0.0,
    format_failure_score: float = -1.0,
    first_example: int = 0,
    key_prefix: tuple[int, ...] | None = None,
    progress: bool = False,
) -> list[Trajectory]:
    """G trajectories per example, ordered by (example, rollout): rollout 0 the stem, 1..G-1
    its branches at `settings.branch_module`[`settings.branch_invocation`]."""
    if settings.branch_module is None:
        raise ValueError("branch rollouts need settings.branch_module (MMGRPOConfig.branch_module)")
    if num_rollouts < 2:
        raise ValueError(f"branch rollouts need num_rollouts >= 2, got {num_rollouts}")
    common = {
        "lm": lm,
        "failure_score": failure_score,
        "format_failure_score": format_failure_score,
        "key_prefix": key_prefix,
        "progress": progress,
    }
    stems = run_rollouts(
        program, examples, metric, num_rollouts=1, first_example=first_example, **common
    )
    jobs = [
        RolloutJob(
            program,
            example,
            stem.example_index,
            rollout,
            branch_prefix(stem, settings.branch_module, settings.branch_invocation) or (),
        )
        for example, stem in zip(examples, stems, strict=True)
        for rollout in range(1, num_rollouts)
    ]
    branches = run_jobs(jobs, metric, **common)
    per_stem = num_rollouts - 1
    ordered: list[Trajectory] = []
    for i, stem in enumerate(stems):
        ordered += [stem, *branches[i * per_stem : (i + 1) * per_stem]]
    return ordered


def branch_groups(trajectories: Sequence[Trajectory], settings: GroupingSettings) -> list[Group]:
    """Module-level groups of the calls each example's rollouts made apart: the calls its
    branches replayed (and the stem's originals of them) are left out."""
    shared: dict[int, set[tuple[str, int]]] = {}
    for t in trajectories:
        keys = {(c.predictor, c.invocation) for c in t.calls if c.replayed}
        shared.setdefault(t.example_index, set()).update(keys)
    apart = [
        dataclasses.replace(
            t,
            calls=tuple(
                c for c in t.calls if (c.predictor, c.invocation) not in shared[t.example_index]
            ),
        )
        for t in trajectories
    ]
    groups = module_level_groups(
        apart,
        align=settings.align,
        select_k=settings.select_k,
        seed=settings.seed,
        num_rollouts=settings.num_rollouts,
    )
    # a group's invocation counts the module's calls in the trajectory, shared ones included
    return [
        dataclasses.replace(
            g,
            invocation=g.invocation
            + sum(m == g.module for m, _ in shared.get(g.example_index, ())),
        )
        for g in groups
    ]


register_grouping("branch", branch_groups, unit="row", rollouts=run_branch_rollouts)
