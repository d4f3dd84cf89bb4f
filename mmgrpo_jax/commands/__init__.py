"""The commands that run a config, in one registry the command line and sweeps both read.

Each `mmgrpo <name>` here takes a config class's keys (a YAML file, then `key=value`
overrides) and runs an entry point `main(config, out) -> exit code`; both are imported only when
the command runs, so `mmgrpo --help` stays light. A command a sweep can run names the config
keys the sweep sets on every run (`SweepKeys`). The `mmgrpo` executable (`mmgrpo_jax.cli`) adds
the commands with arguments of their own (`sweep`, `models`) and the exit-code policy.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from mmgrpo_jax.config_files import load_config
from mmgrpo_jax.errors import UserError


@dataclasses.dataclass(frozen=True)
class SweepKeys:
    """Where a command's config keeps the fields a sweep sets on every run."""

    seed: str
    run_dir: str
    resume: str
    progress: str
    # a key only the command's own summary.json has: better-together's weight stage writes a
    # summary.json of its own first, which does not make the run finished
    finished_key: str | None = None

    @property
    def owned(self) -> set[str]:
        """The config keys the sweep sets itself (a grid may not)."""
        return {self.seed, self.run_dir, self.resume, self.progress}


@dataclasses.dataclass(frozen=True)
class Command:
    """One `mmgrpo <name>` that runs a config."""

    name: str
    help: str  # the line `mmgrpo --help` shows
    module: str  # where the config class and the entry point live
    config: str  # the config class: the keys `mmgrpo <name>` takes
    entry: str | None  # `main(config, out) -> int` in `module`; None: the cli runs it (plan)
    sweep: SweepKeys | None = None  # None: a sweep cannot run it

    def config_class(self) -> type:
        return getattr(importlib.import_module(self.module), self.config)

    def main(self) -> Callable[[Any, TextIO], int]:
        if self.entry is None:
            raise AssertionError(f"`mmgrpo {self.name}` has no config entry point")
        return getattr(importlib.import_module(self.module), self.entry)


_EXPERIMENT = "mmgrpo_jax.commands.experiment"
_TRAINER_KEYS = SweepKeys("mmgrpo.seed", "mmgrpo.run_dir", "mmgrpo.resume", "mmgrpo.progress")

COMMANDS: dict[str, Command] = {
    c.name: c
    for c in (
        Command(
            "demo",
            "train a tiny policy from scratch with mmGRPO on a CPU testbed (default two_doors)",
            "mmgrpo_jax.commands.demo",
            "DemoConfig",
            "main",
            SweepKeys("seed", "run_dir", "resume", "progress"),
        ),
        Command(
            "groups",
            "scripted rollouts of the synthetic program and the groups formed from them",
            "mmgrpo_jax.commands.groups_demo",
            "GroupsDemoConfig",
            "main",
        ),
        Command(
            "train",
            "mmGRPO on a paper task from a local checkpoint (experiments/configs/)",
            _EXPERIMENT,
            "ExperimentConfig",
            "train_command",
            _TRAINER_KEYS,
        ),
        Command(
            "optimize-prompts",
            "MIPROv2 instructions and demos for a paper task (same configs as train)",
            _EXPERIMENT,
            "ExperimentConfig",
            "optimize_prompts_command",
        ),
        Command(
            "better-together",
            "prompt and weight optimization in the order of `strategy` (same configs as train)",
            _EXPERIMENT,
            "ExperimentConfig",
            "better_together_command",
            dataclasses.replace(_TRAINER_KEYS, finished_key="strategy"),
        ),
        Command(
            "eval",
            "greedy evaluation of a checkpoint (and adapter) on a task split",
            _EXPERIMENT,
            "EvalConfig",
            "eval_command",
        ),
        Command(
            "plan",
            "per-device memory of a train config's train step and sampler, before any weight",
            _EXPERIMENT,
            "ExperimentConfig",
            None,
        ),
    )
}

SWEEP_COMMANDS: dict[str, SweepKeys] = {
    name: c.sweep for name, c in COMMANDS.items() if c.sweep is not None
}


def command(name: str) -> Command:
    if name not in COMMANDS:
        raise UserError(f"no command {name!r}; the commands: {', '.join(COMMANDS)}")
    return COMMANDS[name]


def command_config(name: str, path: str | None, overrides: Sequence[str]) -> Any:
    """What `mmgrpo <name> --config path key=value ...` would run with (a sweep's check)."""
    return load_config(command(name).config_class(), path, overrides)
