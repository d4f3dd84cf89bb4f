"""BetterTogether: prompt and weight optimization in sequence ("p -> w", "p -> w -> p", ...).

Each stage sees the trainset in a fresh seeded order; with no valset, a seeded fraction of the
trainset is held out. The program before any stage and after each stage is scored on the valset;
the best is returned, the earliest on ties, with its weights restored (a weight optimizer that
can snapshot and restore them makes that possible). A weight stage trains on the exact prompts
its rollouts used (demos included) and leaves them untouched.

A prompt stage already searched elsewhere (a finished MIPROv2 run of the same program, seed and
trainset order) can be loaded instead of searched again (`LoadedPrompts`): the stage is then
scored as any other, and the stages after it see the trainset order they would have seen.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from mmgrpo_jax.program.example import Example
from mmgrpo_jax.program.module import Module


class Optimizer(Protocol):
    def compile(
        self, program: Module, trainset: list[Example], valset: list[Example]
    ) -> Module: ...


class WeightOptimizer(Optimizer, Protocol):
    def snapshot_weights(self) -> Any: ...

    def restore_weights(self, snapshot: Any) -> None: ...


Evaluate = Callable[[Module, Sequence[Example]], float]


class LoadedPrompts:
    """A prompt stage's result read from a finished search, not searched again: a sweep's
    BetterTogether cell and its MIPROv2 cell of the same seed run one search between them."""

    def __init__(self, prompt_state: dict[str, Any]) -> None:
        self.prompt_state = prompt_state

    def compile(self, program: Module, trainset: list[Example], valset: list[Example]) -> Module:
        program = program.copy()
        program.load_state(self.prompt_state)
        return program


def parse_strategy(strategy: str) -> list[str]:
    """'p -> w' -> ['p', 'w']; 'none' is no stage: the program as written, only scored (the
    baseline row of a Table 1 sweep)."""
    if strategy.strip() == "none":
        return []
    stages = [s.strip() for s in strategy.split("->")]
    if any(s not in ("p", "w") for s in stages):
        raise ValueError(
            f"strategy must be stages 'p' or 'w' joined by '->', or 'none', got {strategy!r}"
        )
    return stages


def can_load_prompt_stage(strategy: str) -> bool:
    """A loaded search stands for a strategy's one p stage, run first on the base weights."""
    stages = parse_strategy(strategy)
    return stages[:1] == ["p"] and stages.count("p") == 1


@dataclasses.dataclass
class Stage:
    name: str  # "start", "p", "w"
    score: float
    prompt_state: dict[str, Any]
    weights: Any


class BetterTogether:
    def __init__(
        self,
        evaluate: Evaluate,
        prompt_optimizer: Optimizer,
        weight_optimizer: WeightOptimizer,
        *,
        seed: int = 0,
        valset_fraction: float = 0.2,
    ) -> None:
        if not 0 < valset_fraction < 1:
            raise ValueError(f"valset_fraction must be in (0, 1), got {valset_fraction}")
        self.evaluate = evaluate
        self.optimizers = {"p": prompt_optimizer, "w": weight_optimizer}
        self.weights = weight_optimizer
        self.seed, self.valset_fraction = seed, valset_fraction
        self.stages: list[Stage] = []

    def compile(
        self,
        program: Module,
        trainset: Sequence[Example],
        valset: Sequence[Example] | None = None,
        strategy: str = "p -> w",
    ) -> Module:
        stages = parse_strategy(strategy)
        rng = random.Random(self.seed)
        trainset = list(trainset)
        if valset is None:
            rng.shuffle(trainset)
            held = max(1, int(len(trainset) * self.valset_fraction))
            valset, trainset = trainset[:held], trainset[held:]
        valset = list(valset)
        self.stages = [self._record("start", program, valset)]
        for stage in stages:
            rng.shuffle(trainset)
            program = self.optimizers[stage].compile(program, list(trainset), valset)
            self.stages.append(self._record(stage, program, valset))
        best = self.stages[self.best_index]
        program.load_state(best.prompt_state)
        self.weights.restore_weights(best.weights)
        return program

    @property
    def best_index(self) -> int:
        """The stage `compile` returns: the best valset score, the earliest of equals."""
        return max(range(len(self.stages)), key=lambda i: self.stages[i].score)

    def _record(self, name: str, program: Module, valset: list[Example]) -> Stage:
        return Stage(
            name,
            self.evaluate(program, valset),
            program.dump_state(),
            self.weights.snapshot_weights(),
        )
