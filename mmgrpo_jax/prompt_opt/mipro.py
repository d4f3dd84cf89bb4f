"""`MIPROv2(metric, config, prompt_lm=...).compile(program, trainset, valset)`: demo sets, then
instruction proposals, then the TPE search; the result is a program copy with the chosen prompts,
saved as prompt state JSON with the trial log next to it.

`dry_run=True` prints the budget and returns the program unchanged. Program runs are counted
exactly for the bootstrap and full evaluations; for minibatches, cache hits (a configuration and
example scored before) are not runs, so the budget is an upper bound that is reached exactly with
`cache=False`. Prompt-model calls are exact.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from pathlib import Path
from typing import Literal, TextIO

from mmgrpo_jax.config_files import setting
from mmgrpo_jax.errors import check_field_types
from mmgrpo_jax.program.example import Example
from mmgrpo_jax.program.lm import LM
from mmgrpo_jax.program.module import Module
from mmgrpo_jax.prompt_opt.demos import bootstrap_pool_size, build_demo_sets
from mmgrpo_jax.prompt_opt.proposer import InstructionProposer
from mmgrpo_jax.prompt_opt.search import Candidates, apply, num_trials, search, write_trial_log
from mmgrpo_jax.rl.types import Metric

logger = logging.getLogger(__name__)

AUTO = {"light": (6, 100), "medium": (12, 300), "heavy": (18, 1000)}  # candidates, valset size


@dataclasses.dataclass(frozen=True)
class PromptOptConfig:
    auto: Literal["light", "medium", "heavy"] | None = "light"
    num_candidates: int | None = setting(
        None, "instructions and demo sets per predictor; overrides auto"
    )
    num_trials: int | None = setting(None, "default: MIPROv2's rule from predictors and candidates")
    max_valset: int | None = setting(None, "default: from auto")
    minibatch_size: int = 35
    full_eval_every: int = 5
    parallel_trials: int = setting(4, "configurations scored together; 1 = strictly sequential TPE")
    max_bootstrapped_demos: int = 4
    max_labeled_demos: int = 4
    bootstrap_pool: int | None = setting(40, "teacher runs; None = the whole trainset")
    metric_threshold: float | None = setting(
        None, "a bootstrapped trace passes at >=; None: truthy"
    )
    summary_examples: int = 30
    summary_batch: int = 10
    cache: bool = True
    seed: int = 0
    out_dir: str | None = setting(None, "prompt state JSON + trial log")

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.auto is None and self.num_candidates is None:
            raise ValueError("PromptOptConfig: set auto or num_candidates")
        if self.auto is not None and self.auto not in AUTO:
            raise ValueError(f"PromptOptConfig.auto must be one of {sorted(AUTO)} or null")
        for name in ("num_candidates", "num_trials", "max_valset"):
            value = getattr(self, name)
            if value is not None and value < (2 if name == "num_candidates" else 1):
                raise ValueError(f"PromptOptConfig.{name} is too small: {value}")
        for name in ("minibatch_size", "full_eval_every", "parallel_trials"):
            if getattr(self, name) < 1:
                raise ValueError(f"PromptOptConfig.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def candidates(self) -> int:
        return self.num_candidates or AUTO[self.auto][0]

    @property
    def valset_size(self) -> int:
        return self.max_valset or (AUTO[self.auto][1] if self.auto else 10**9)


@dataclasses.dataclass(frozen=True)
class Budget:
    bootstrap_runs: int
    search_runs: int  # at most; exact without the cache
    prompt_model_calls: int
    trials: int

    @property
    def program_runs(self) -> int:
        return self.bootstrap_runs + self.search_runs


class MIPROv2:
    def __init__(
        self, metric: Metric, config: PromptOptConfig, *, prompt_lm: LM, lm: LM | None = None
    ) -> None:
        """`lm` runs the program (else its predictors' own LMs); `prompt_lm` writes proposals."""
        self.metric, self.config, self.lm = metric, config, lm
        self.proposer = InstructionProposer(
            prompt_lm,
            summary_examples=config.summary_examples,
            summary_batch=config.summary_batch,
            seed=config.seed,
        )
        self.result = None
        self.runs = 0

    def budget(self, program: Module, trainset_size: int, valset_size: int) -> Budget:
        cfg = self.config
        predictors = len(program.named_predictors())
        n = cfg.candidates
        trials = cfg.num_trials or num_trials(predictors, n)
        val = min(valset_size, cfg.valset_size)
        batch = min(cfg.minibatch_size, val)
        full_evals = 1 + sum(
            1 for t in range(1, trials + 1) if t % cfg.full_eval_every == 0 or t == trials
        )
        return Budget(
            bootstrap_runs=bootstrap_pool_size(
                trainset_size, cfg.max_bootstrapped_demos, cfg.bootstrap_pool
            ),
            search_runs=trials * batch + full_evals * val,
            prompt_model_calls=self.proposer.num_calls(trainset_size, predictors, n),
            trials=trials,
        )

    def compile(
        self,
        program: Module,
        trainset: list[Example],
        valset: list[Example],
        *,
        lm: LM | None = None,
        dry_run: bool = False,
        out: TextIO | None = None,
    ) -> Module:
        cfg = self.config
        lm = lm if lm is not None else self.lm
        valset = valset[: cfg.valset_size]
        budget = self.budget(program, len(trainset), len(valset))
        print(
            f"MIPROv2 budget: {budget.program_runs} program runs at most "
            f"({budget.bootstrap_runs} bootstrap + {budget.search_runs} search over "
            f"{budget.trials} trials), {budget.prompt_model_calls} prompt-model calls",
            file=out or sys.stdout,  # looked up now: a redirected stdout counts
        )
        if dry_run:
            return program
        demo_sets, bootstrap_runs = build_demo_sets(
            program,
            trainset,
            self.metric,
            lm=lm,
            num_sets=cfg.candidates,
            max_bootstrapped=cfg.max_bootstrapped_demos,
            max_labeled=cfg.max_labeled_demos,
            threshold=cfg.metric_threshold,
            pool=cfg.bootstrap_pool,
            seed=cfg.seed,
        )
        instructions = self.proposer.propose_instructions(
            program, trainset, demo_sets, cfg.candidates
        )
        candidates = Candidates(instructions, demo_sets)
        result = search(
            program,
            candidates,
            valset,
            self.metric,
            lm=lm,
            trials=budget.trials,
            minibatch_size=cfg.minibatch_size,
            full_eval_every=cfg.full_eval_every,
            seed=cfg.seed,
            cache=cfg.cache,
            parallel_trials=cfg.parallel_trials,
        )
        self.result, self.runs = result, bootstrap_runs + result.runs
        best = apply(program, candidates, result.config)
        logger.info("MIPROv2 chose %s: full valset %.4f", result.config, result.score)
        if cfg.out_dir is not None:
            directory = Path(cfg.out_dir)
            directory.mkdir(parents=True, exist_ok=True)
            best.save(directory / "prompt_state.json")
            write_trial_log(result, directory / "trials.jsonl")
        return best
