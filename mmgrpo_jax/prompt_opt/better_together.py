"""BetterTogether: prompt and weight optimization in sequence ("p -> w", "p -> w -> p", ...).

Each stage sees the trainset in a fresh seeded order; with no valset, a seeded fraction of the
trainset is held out. The program before any stage and after each stage is scored on the valset;
the best is returned, the earliest on ties, with its weights restored (a weight optimizer that
can snapshot and restore them makes that possible). A weight stage trains on the exact prompts
its rollouts used (demos included) and leaves them untouched.

A prompt stage already searched elsewhere (a finished MIPROv2 run of the same program, seed and
trainset order) can be loaded instead of searched again (`LoadedPrompts`): the stage is then
scored as any other, and the stages after it see the trainset order they would have seen.
Likewise the start stage's scores: the program as given, under greedy decoding, scores the same
in every run of one config, so a finished `strategy=none` run's can stand for them
(`StartScores`).
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Callable, Sequence
from pathlib import Path
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


@dataclasses.dataclass(frozen=True)
class StartScores:
    """The start stage's scores of a finished `strategy=none` run (its summary.json)."""

    valset: float
    test: float | None

    @classmethod
    def read(cls, path: str | Path) -> StartScores:
        """Refuses, naming the file, anything but a finished run of the program as written."""
        where = f"start_scores={str(path)!r}"
        try:
            summary = json.loads(Path(path).read_text())
        except OSError as err:
            raise ValueError(f"{where} cannot be read ({err.strerror})") from None
        except ValueError:
            raise ValueError(f"{where} is not JSON: name a better-together summary.json") from None
        if not isinstance(summary, dict) or summary.get("strategy") != "none":
            got = summary.get("strategy") if isinstance(summary, dict) else type(summary).__name__
            raise ValueError(
                f"{where} is not the summary.json of a strategy=none run (strategy: {got!r}): "
                "only the program as written has nothing but a start stage"
            )
        start = (summary.get("stages") or [{}])[0]
        valset, test = start.get("valset"), start.get("test")
        if start.get("stage") != "start" or not _is_score(valset) or not _is_score(test, None):
            raise ValueError(f"{where} holds no start stage with a valset score: {start!r}")
        return cls(float(valset), None if test is None else float(test))


def _is_score(value: Any, *also: Any) -> bool:
    return value in also or (isinstance(value, int | float) and not isinstance(value, bool))


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
        *,
        start_score: float | None = None,
    ) -> Module:
        """`start_score`: the program as given, already scored on this valset (a finished
        run of the same config scored it; greedy decoding gives the same number again)."""
        stages = parse_strategy(strategy)
        rng = random.Random(self.seed)
        trainset = list(trainset)
        if valset is None:
            rng.shuffle(trainset)
            held = max(1, int(len(trainset) * self.valset_fraction))
            valset, trainset = trainset[:held], trainset[held:]
        valset = list(valset)
        self.stages = [self._record("start", program, valset, start_score)]
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

    def _record(
        self, name: str, program: Module, valset: list[Example], score: float | None = None
    ) -> Stage:
        return Stage(
            name,
            self.evaluate(program, valset) if score is None else score,
            program.dump_state(),
            self.weights.snapshot_weights(),
        )
