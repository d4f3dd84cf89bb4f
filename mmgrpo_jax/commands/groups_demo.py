"""`mmgrpo groups`: rollouts of the synthetic program with a scripted LM, then the module-level
groups and advantages mmGRPO would train on; a look at the data, no model involved."""

from __future__ import annotations

import dataclasses
from typing import TextIO

import numpy as np

from mmgrpo_jax.errors import check_field_types
from mmgrpo_jax.rl.advantages import SCALES, advantages_for_groups
from mmgrpo_jax.rl.grouping import ALIGN_MODES, Group, module_level_groups
from mmgrpo_jax.rl.rollout import quiet_failure_warnings, run_rollouts, summarize
from mmgrpo_jax.rl.types import Trajectory
from programs import synthetic


@dataclasses.dataclass(frozen=True)
class GroupsDemoConfig:
    num_examples: int = 3
    num_rollouts: int = 4
    align: str = "ragged"
    scale: str = "group"
    accuracy: float = 0.7
    format_error_rate: float = 0.05
    num_words: int = 6
    max_links: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.num_examples < 1:
            raise ValueError(f"GroupsDemoConfig.num_examples must be >= 1, got {self.num_examples}")
        if self.num_rollouts < 1:
            raise ValueError(f"GroupsDemoConfig.num_rollouts must be >= 1, got {self.num_rollouts}")
        if self.align not in ALIGN_MODES:
            raise ValueError(
                f"GroupsDemoConfig.align must be one of {ALIGN_MODES}, got {self.align!r}"
            )
        if self.scale not in SCALES:
            raise ValueError(
                f"GroupsDemoConfig.scale must be one of {sorted(SCALES)}, got {self.scale!r}"
            )
        for name in ("accuracy", "format_error_rate"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(
                    f"GroupsDemoConfig.{name} must be in [0, 1], got {getattr(self, name)}"
                )


@dataclasses.dataclass(frozen=True)
class GroupsDemoResult:
    trajectories: list[Trajectory]
    groups: list[Group]
    advantages: list[np.ndarray]


def run_demo(config: GroupsDemoConfig) -> GroupsDemoResult:
    table = synthetic.LinkTable.make(config.num_words, seed=config.seed)
    program = synthetic.LinkFollower(table, max_links=config.max_links)
    examples = synthetic.make_examples(table, config.num_examples, config.max_links, config.seed)
    lm = synthetic.noisy_policy(
        program,
        accuracy=config.accuracy,
        format_error_rate=config.format_error_rate,
        seed=config.seed,
    )
    trajectories = run_rollouts(
        program, examples, synthetic.metric, num_rollouts=config.num_rollouts, lm=lm
    )
    groups = module_level_groups(trajectories, align=config.align, seed=config.seed)
    return GroupsDemoResult(trajectories, groups, advantages_for_groups(groups, config.scale))


def _numbers(values: list[float] | np.ndarray) -> str:
    return "[" + ", ".join(f"{v:+.2f}" for v in values) + "]"


def print_demo(config: GroupsDemoConfig, result: GroupsDemoResult, out: TextIO) -> None:
    def say(line: str = "") -> None:
        print(line, file=out)

    say(
        f"mmGRPO demo: synthetic link-following program, scripted LM (accuracy {config.accuracy}),"
        f" {config.num_examples} examples x G={config.num_rollouts} rollouts"
    )
    say("\nTrajectories")
    say(f"{'ex':>3} {'r':>2}  {'status':<15}{'reward':>7}  calls")
    for t in result.trajectories:
        calls = " ".join(f"{c.predictor}[{c.invocation}]{'' if c.parsed else '!'}" for c in t.calls)
        say(f"{t.example_index:>3} {t.rollout_index:>2}  {t.status:<15}{t.reward:>7.1f}  {calls}")
    stats = summarize(result.trajectories)
    say(
        f"{stats['trajectories']} trajectories: ok {stats['status_ok']}, format_failure "
        f"{stats['status_format_failure']}, error {stats['status_error']};"
        f" mean reward {stats['reward_mean']:.3f}  ('!' marks a call that failed to parse)"
    )
    say(f"\nModule-level groups (align={config.align}, scale={config.scale})")
    say(f"{'ex':>3} {'module':<8}{'k':>2}  {'members':<14}{'rewards':<34}advantages")
    for group, adv in zip(result.groups, result.advantages, strict=True):
        members = ",".join(str(m.rollout_index) for m in group.members)
        say(
            f"{group.example_index:>3} {group.module:<8}{group.invocation:>2}  {members:<14}"
            f"{_numbers(group.rewards):<34}{_numbers(adv)}"
        )
    zero = sum(1 for a in result.advantages if not np.any(a))
    say(f"{len(result.groups)} groups, {zero} with all-zero advantages (no learning signal)")


def main(config: GroupsDemoConfig, out: TextIO) -> int:
    with quiet_failure_warnings():  # the demo prints every status itself
        print_demo(config, run_demo(config), out)
    return 0
