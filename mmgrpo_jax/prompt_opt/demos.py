"""Candidate few-shot demo sets for every predictor of a program.

Slot 0 holds the predictor's own demos, so that candidate 0 everywhere is the program as given
(zero-shot when it has none, as DSPy's default program); slot 1 holds labeled examples only;
slot 2 the teacher's first successful traces in trainset order; slots 3.. successes in a
shuffled order, a random number in [1, max_bootstrapped] of them. Bootstrapped sets are topped
up with labeled examples to `max_labeled` demos. The teacher (the program with labeled demos,
minus the example it is running on) runs once on each example of a fixed pool, so the cost is
known before anything runs: `len(pool)` program runs, or none when max_bootstrapped is 0. The
pool runs concurrently, so a batching LM samples the teachers together.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from mmgrpo_jax.program.example import Example
from mmgrpo_jax.program.lm import LM
from mmgrpo_jax.program.module import Module, Predict
from mmgrpo_jax.rl.rollout import run_pairs
from mmgrpo_jax.rl.types import Metric, Trajectory

Demo = dict[str, Any]
DemoSets = dict[str, list[list[Demo]]]  # predictor name -> slot -> demos


def usable_as_demo(predictor: Predict, row: Mapping[str, Any]) -> bool:
    """A row can show `predictor` an example call: every input, and the outputs it must write."""
    names = set(row)
    if not set(predictor.signature.input_names) <= names:
        return False
    outputs = [f.name for f in predictor.signature.outputs]
    return all(o in names for o in outputs) if predictor.bare else any(o in names for o in outputs)


def labeled_demos(
    predictor: Predict, examples: Sequence[Example], k: int, rng: random.Random, skip=()
) -> list[Demo]:
    """Up to k examples (a seeded sample) that fit the predictor's signature."""
    rows = [
        dict(e) for i, e in enumerate(examples) if i not in skip and usable_as_demo(predictor, e)
    ]
    return rng.sample(rows, min(k, len(rows)))


def passes(score: float, threshold: float | None) -> bool:
    return score >= threshold if threshold is not None else bool(score)


def bootstrap_pool_size(trainset_size: int, max_bootstrapped: int, pool: int | None) -> int:
    if max_bootstrapped == 0:
        return 0
    return min(trainset_size, pool if pool is not None else trainset_size)


def run_teacher(
    program: Module,
    pool: Sequence[Example],
    metric: Metric,
    *,
    lm: LM | None,
    max_labeled: int,
    seed: int,
) -> list[Trajectory]:
    """One run per pool example, all at once; each run's teacher demos leave its example out."""
    teachers = []
    for i in range(len(pool)):
        teacher = program.copy()
        for name, predictor in teacher.named_predictors():
            rng = random.Random(f"{seed}/teacher/{name}/{i}")
            predictor.demos = labeled_demos(predictor, pool, max_labeled, rng, skip={i})
        teachers.append(teacher)
    return run_pairs(list(zip(teachers, pool, strict=True)), metric, lm=lm)


def demos_from_trace(trajectory: Trajectory) -> dict[str, Demo]:
    """Each predictor's first parsed call in a trajectory, as inputs + outputs."""
    demos: dict[str, Demo] = {}
    for call in trajectory.calls:
        if call.parsed and call.inputs is not None and call.predictor not in demos:
            demos[call.predictor] = {**call.inputs, **(call.outputs or {})}
    return demos


def build_demo_sets(
    program: Module,
    trainset: Sequence[Example],
    metric: Metric,
    *,
    lm: LM | None = None,
    num_sets: int,
    max_bootstrapped: int = 4,
    max_labeled: int = 4,
    threshold: float | None = None,
    pool: int | None = None,
    seed: int = 0,
) -> tuple[DemoSets, int]:
    """(demo sets per predictor, program runs made)."""
    if num_sets < 2:
        raise ValueError(f"num_sets must be >= 2 (the program's own and labeled), got {num_sets}")
    if max_bootstrapped < 0 or max_labeled < 0:
        raise ValueError(
            f"max_bootstrapped and max_labeled must be >= 0, got {max_bootstrapped}, {max_labeled}"
        )
    size = bootstrap_pool_size(len(trainset), max_bootstrapped, pool)
    teacher_pool = list(trainset[:size])
    runs = run_teacher(program, teacher_pool, metric, lm=lm, max_labeled=max_labeled, seed=seed)
    successes = [
        (i, demos_from_trace(t))
        for i, t in enumerate(runs)
        if t.status == "ok" and passes(t.reward, threshold)
    ]
    sets: DemoSets = {}
    for name, predictor in program.named_predictors():
        slots: list[list[Demo]] = [
            [dict(d) for d in predictor.demos],  # the program as given
            labeled_demos(predictor, trainset, max_labeled, _rng(seed, name, 1)),
        ]
        for slot in range(2, num_sets):
            rng = _rng(seed, name, slot)
            order = list(successes)
            if slot == 2:
                count = max_bootstrapped
            else:
                rng.shuffle(order)
                count = rng.randint(1, max_bootstrapped) if max_bootstrapped else 0
            chosen = [(i, d[name]) for i, d in order if name in d][:count]
            used = {i for i, _ in chosen}
            top_up = labeled_demos(
                predictor, trainset, max(0, max_labeled - len(chosen)), rng, skip=used
            )
            slots.append([d for _, d in chosen] + top_up)
        sets[name] = slots
    return sets, len(runs)


def _rng(seed: int, name: str, slot: int) -> random.Random:
    return random.Random(f"{seed}/{name}/{slot}")  # seed 0 is 0: strings hash deterministically
