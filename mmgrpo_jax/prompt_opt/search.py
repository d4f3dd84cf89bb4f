"""MIPROv2-style search over (instruction, demo set) per predictor with optuna's TPE sampler.

Each trial scores one configuration on a fresh seeded minibatch of the valset; every
`full_eval_every` trials, the configuration with the best minibatch mean (over all its
minibatches; the log says how many) that has no full-valset score yet is scored on the whole
valset, and that score is fed back to the sampler as a trial of its own. The default
configuration (candidate 0 everywhere: the program as given) is scored on the full valset first,
so the choice, the best full-valset score, is never worse than the program as given. Scores are
cached by (configuration, example): a configuration proposed again costs nothing. Trials can run
`parallel_trials` at a time: their minibatches share one thread pool (and the LM's batches).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import optuna

from mmgrpo_jax.program.example import Example
from mmgrpo_jax.program.lm import LM
from mmgrpo_jax.program.module import Module
from mmgrpo_jax.prompt_opt.demos import Demo
from mmgrpo_jax.rl.rollout import score_pairs
from mmgrpo_jax.rl.types import Metric

logger = logging.getLogger(__name__)

Config = tuple[tuple[int, int], ...]  # per predictor (in program order): (instruction, demo set)


@dataclasses.dataclass
class Candidates:
    """What the search chooses among, per predictor name."""

    instructions: dict[str, list[str]]
    demo_sets: dict[str, list[list[Demo]]]


def num_trials(num_predictors: int, num_candidates: int) -> int:
    """max(2 M log2 n, 1.5 n) with M = 2 x predictors (MIPROv2's rule)."""
    m = 2 * num_predictors
    return math.ceil(max(2 * m * math.log2(max(num_candidates, 2)), 1.5 * num_candidates))


def apply(program: Module, candidates: Candidates, config: Config) -> Module:
    """A copy of `program` with the chosen instruction and demos in every predictor."""
    chosen = program.copy()
    for (name, predictor), (i, d) in zip(chosen.named_predictors(), config, strict=True):
        predictor.load_predictor_state(
            {
                "instructions": candidates.instructions[name][i],
                "demos": candidates.demo_sets[name][d],
            }
        )
    return chosen


class Evaluator:
    """Scores (configuration, example) pairs once each, on a thread pool; counts program runs."""

    def __init__(
        self,
        program: Module,
        candidates: Candidates,
        valset: Sequence[Example],
        metric: Metric,
        lm: LM | None,
        cache: bool = True,
    ) -> None:
        self.program, self.candidates, self.valset = program, candidates, list(valset)
        self.metric, self.lm, self.use_cache = metric, lm, cache
        self.cache: dict[tuple[Config, int], float] = {}
        self.runs = 0

    def scores(self, config: Config, indices: Sequence[int]) -> list[float]:
        return self.scores_many([(config, indices)])[0]

    def scores_many(self, requests: Sequence[tuple[Config, Sequence[int]]]) -> list[list[float]]:
        """Several (configuration, minibatch) requests in one thread pool: parallel trials."""
        jobs: list[tuple[int, Config, int]] = []  # (request, configuration, example)
        queued: set[tuple[Config, int]] = set()
        for r, (config, indices) in enumerate(requests):
            for i in indices:
                key = (config, i)
                if self.use_cache and (key in self.cache or key in queued):
                    continue
                queued.add(key)
                jobs.append((r, config, i))
        programs = {c: apply(self.program, self.candidates, c) for c in {c for _, c, _ in jobs}}
        trajectories = score_pairs(
            [(programs[c], self.valset[i]) for _, c, i in jobs], self.metric, lm=self.lm
        )
        self.runs += len(jobs)
        fresh: dict[tuple[int, int], float] = {}
        for (r, config, i), t in zip(jobs, trajectories, strict=True):
            fresh[(r, i)] = self.cache[(config, i)] = t.reward
        return [
            [fresh[(r, i)] if (r, i) in fresh else self.cache[(config, i)] for i in indices]
            for r, (config, indices) in enumerate(requests)
        ]


@dataclasses.dataclass(frozen=True)
class SearchResult:
    config: Config
    score: float  # full-valset mean
    trial_log: list[dict[str, Any]]
    runs: int


def search(
    program: Module,
    candidates: Candidates,
    valset: Sequence[Example],
    metric: Metric,
    *,
    lm: LM | None = None,
    trials: int,
    minibatch_size: int = 35,
    full_eval_every: int = 5,
    seed: int = 0,
    cache: bool = True,
    parallel_trials: int = 1,
) -> SearchResult:
    """`parallel_trials` configurations are asked of the sampler at a time (a constant liar keeps
    them apart) and scored in one thread pool; 1 is MIPROv2's strictly sequential search."""
    names = [n for n, _ in program.named_predictors()]
    for name in names:
        if name not in candidates.instructions or name not in candidates.demo_sets:
            raise ValueError(f"no candidates for predictor {name!r}")
    if not valset:
        raise ValueError("the valset is empty: the search scores configurations on it")
    if parallel_trials < 1:
        raise ValueError(f"parallel_trials must be >= 1, got {parallel_trials}")
    evaluator = Evaluator(program, candidates, valset, metric, lm, cache)
    rng = np.random.default_rng(seed)
    everything = list(range(len(valset)))
    batch = min(minibatch_size, len(valset))
    sampler = optuna.samplers.TPESampler(
        seed=seed, multivariate=True, constant_liar=parallel_trials > 1
    )
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize", sampler=sampler)
    distributions = {}
    for name in names:
        distributions[f"{name}.instruction"] = optuna.distributions.CategoricalDistribution(
            list(range(len(candidates.instructions[name])))
        )
        distributions[f"{name}.demos"] = optuna.distributions.CategoricalDistribution(
            list(range(len(candidates.demo_sets[name])))
        )

    def params(config: Config) -> dict[str, int]:
        out = {}
        for name, (i, d) in zip(names, config, strict=True):
            out[f"{name}.instruction"], out[f"{name}.demos"] = i, d
        return out

    log: list[dict[str, Any]] = []
    minibatch_scores: dict[Config, list[float]] = {}
    full: dict[Config, float] = {}

    def full_eval(config: Config, trial: int) -> None:
        full[config] = float(np.mean(evaluator.scores(config, everything)))
        study.add_trial(
            optuna.trial.create_trial(
                params=params(config), distributions=distributions, value=full[config]
            )
        )
        log.append({"trial": trial, "kind": "full", "config": config, "score": full[config]})

    default: Config = tuple((0, 0) for _ in names)
    full_eval(default, 0)
    t = 0
    while t < trials:
        # A round of parallel trials never crosses a full-evaluation point, so the schedule of
        # full evaluations does not depend on `parallel_trials`.
        k = min(parallel_trials, trials - t, full_eval_every - t % full_eval_every)
        asked = [study.ask(distributions) for _ in range(k)]
        configs: list[Config] = [
            tuple((a.params[f"{n}.instruction"], a.params[f"{n}.demos"]) for n in names)
            for a in asked
        ]
        batches = [
            sorted(rng.choice(len(valset), size=batch, replace=False).tolist()) for _ in asked
        ]
        round_scores = evaluator.scores_many(list(zip(configs, batches, strict=True)))
        for trial, config, scores in zip(asked, configs, round_scores, strict=True):
            t += 1
            score = float(np.mean(scores))
            study.tell(trial, score)
            minibatch_scores.setdefault(config, []).append(score)
            log.append(
                {
                    "trial": t,
                    "kind": "minibatch",
                    "config": config,
                    "score": score,
                    "minibatch_mean": float(np.mean(minibatch_scores[config])),
                    "minibatches": len(minibatch_scores[config]),
                }
            )
        if t % full_eval_every == 0 or t == trials:
            pending = [c for c in minibatch_scores if c not in full]
            if pending:
                best = max(pending, key=lambda c: np.mean(minibatch_scores[c]))
                full_eval(best, t)
    best = max(full, key=lambda c: (full[c], c == default))  # ties keep the default
    return SearchResult(best, full[best], log, evaluator.runs)


def write_trial_log(result: SearchResult, path: str | Path) -> None:
    rows = [{**r, "config": [list(c) for c in r["config"]]} for r in result.trial_log]
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in rows))
