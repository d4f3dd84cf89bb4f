import io
import random

import numpy as np
import pytest

from mmgrpo_jax.program import Example, Module, Predict, Prediction
from mmgrpo_jax.program.adapter import format_outputs
from mmgrpo_jax.prompt_opt.mipro import MIPROv2, PromptOptConfig
from mmgrpo_jax.prompt_opt.proposer import PROPOSE, SUMMARIZE
from mmgrpo_jax.prompt_opt.search import Candidates, apply, num_trials, search
from mmgrpo_jax.testing import ScriptedLM

OPTIONS = 3
BEST = ((2, 1), (1, 2))  # (instruction, demo set) of predictors a and b


def success_probability(config):
    (ai, ad), (bi, bd) = config
    p = 0.1 + 0.15 * (ai == 2) + 0.15 * (ad == 1) + 0.15 * (bi == 1) + 0.1 * (bd == 2)
    return p + 0.2 * (config == BEST)  # an interaction only the full combination gets


class Planted(Module):
    """Succeeds with a fixed probability per (instruction, demo set) of its two predictors."""

    def __init__(self, seed):
        self.a = Predict("x -> y", instructions="a0")
        self.b = Predict("x -> y", instructions="b0")
        self.seed = seed

    def forward(self, x):
        config = tuple(
            (int(p.signature.instructions[1:]), p.demos[0]["set"] if p.demos else 0)
            for p in (self.a, self.b)
        )
        draw = random.Random(f"{self.seed}/{x}/{config}").random()
        return Prediction(y=float(draw < success_probability(config)))


def metric(example, prediction):
    return prediction.y


CANDIDATES = Candidates(
    instructions={"a": [f"a{i}" for i in range(OPTIONS)], "b": [f"b{i}" for i in range(OPTIONS)]},
    demo_sets={n: [[]] + [[{"x": "x", "y": "y", "set": d}] for d in (1, 2)] for n in "ab"},
)
VALSET = [Example(x=f"v{i}").with_inputs("x") for i in range(60)]


def full_score(program, config):
    return np.mean([metric(e, program(**e.inputs())) for e in VALSET])


def random_search(seed, runs):
    """Random configurations, each on the full valset, as many as the same runs allow."""
    rng = random.Random(seed)
    program = Planted(seed)
    best, best_score = None, -1.0
    for _ in range(runs // len(VALSET)):
        config = tuple((rng.randrange(OPTIONS), rng.randrange(OPTIONS)) for _ in "ab")
        score = full_score(apply(program, CANDIDATES, config), config)
        if score > best_score:
            best, best_score = config, score
    return best


def test_tpe_finds_the_planted_optimum_more_often_than_random_search():
    tpe_hits = random_hits = 0
    for seed in range(20):
        program = Planted(seed)
        result = search(
            program, CANDIDATES, VALSET, metric, trials=30, minibatch_size=15, seed=seed
        )
        tpe_hits += result.config == BEST
        random_hits += random_search(seed, result.runs) == BEST
        default = full_score(program, None)
        assert result.score >= default  # never worse than the program as given
    assert tpe_hits > random_hits, (tpe_hits, random_hits)
    assert tpe_hits >= 10


def test_same_seed_same_trial_log_and_choice():
    first = search(Planted(0), CANDIDATES, VALSET, metric, trials=12, minibatch_size=10, seed=4)
    again = search(Planted(0), CANDIDATES, VALSET, metric, trials=12, minibatch_size=10, seed=4)
    assert first.trial_log == again.trial_log and first.config == again.config
    other = search(Planted(0), CANDIDATES, VALSET, metric, trials=12, minibatch_size=10, seed=0)
    assert other.trial_log != first.trial_log
    minibatch = [r for r in first.trial_log if r["kind"] == "minibatch"]
    assert len(minibatch) == 12 and all(r["minibatches"] >= 1 for r in minibatch)
    assert first.trial_log[0] == {
        "trial": 0,
        "kind": "full",
        "config": ((0, 0), (0, 0)),
        "score": pytest.approx(full_score(Planted(0), None)),
    }


def prompt_model():
    def respond(messages):
        if "[[ ## examples ## ]]" in messages[-1]["content"]:
            return format_outputs(SUMMARIZE, {"observations": "rows"})
        return format_outputs(PROPOSE, {"proposed_instruction": "a1"})

    return ScriptedLM(respond)


def test_dry_run_budget_equals_the_runs_made_without_the_cache():
    train = [Example(x=f"t{i}", y="1").with_inputs("x") for i in range(20)]
    config = PromptOptConfig(
        auto=None, num_candidates=3, minibatch_size=10, bootstrap_pool=8, cache=False, seed=0
    )
    lm = prompt_model()
    optimizer = MIPROv2(metric, config, prompt_lm=lm)
    printed = io.StringIO()
    same = optimizer.compile(Planted(0), train, VALSET, dry_run=True, out=printed)
    assert isinstance(same, Planted) and not lm.calls and optimizer.runs == 0
    budget = optimizer.budget(Planted(0), len(train), len(VALSET))
    assert f"{budget.program_runs} program runs" in printed.getvalue()
    assert budget.trials == num_trials(2, 3)
    optimizer.compile(Planted(0), train, VALSET, out=io.StringIO())
    assert optimizer.runs == budget.program_runs
    assert len(lm.calls) == budget.prompt_model_calls


def test_seed_zero_means_zero_and_modes():
    assert PromptOptConfig(seed=0).seed == 0
    assert PromptOptConfig(auto="medium").candidates == 12
    with pytest.raises(ValueError, match="auto"):
        PromptOptConfig(auto="huge")
