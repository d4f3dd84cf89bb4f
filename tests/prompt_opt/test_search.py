import io
import random
import threading
import time

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


class Concurrency:
    """Counts how many program runs are in flight at once."""

    def __init__(self):
        self.lock, self.now, self.most = threading.Lock(), 0, 0

    def __deepcopy__(self, memo):
        return self  # every program copy reports to the same counter

    def __enter__(self):
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)

    def __exit__(self, *exc):
        time.sleep(0.005)  # hold the slot so that concurrent runs overlap
        with self.lock:
            self.now -= 1


class SlowPlanted(Planted):
    def __init__(self, seed, concurrency):
        super().__init__(seed)
        self.concurrency = concurrency

    def forward(self, x):
        with self.concurrency:
            return super().forward(x)


def test_parallel_trials_share_one_pool_keep_the_schedule_and_are_deterministic():
    def run(parallel, concurrency=None):
        program = Planted(3) if concurrency is None else SlowPlanted(3, concurrency)
        return search(
            program,
            CANDIDATES,
            VALSET,
            metric,
            trials=12,
            minibatch_size=5,
            seed=3,
            cache=False,
            parallel_trials=parallel,
        )

    concurrency = Concurrency()
    parallel = run(4, concurrency)
    assert concurrency.most > 5  # more than one trial's minibatch in flight
    assert parallel.trial_log == run(4).trial_log  # same seed, same log
    sequential = run(1)
    for result in (parallel, sequential):
        kinds = [(r["trial"], r["kind"]) for r in result.trial_log]
        assert [t for t, k in kinds if k == "minibatch"] == list(range(1, 13))
        assert [t for t, k in kinds if k == "full"] == [0, 5, 10, 12]  # the same schedule
        assert result.runs == 12 * 5 + 4 * len(VALSET)  # exact without the cache
    with pytest.raises(ValueError, match="parallel_trials"):
        run(0)


def test_parallel_tpe_still_beats_random_search():
    tpe_hits = random_hits = 0
    for seed in range(20):
        result = search(
            Planted(seed),
            CANDIDATES,
            VALSET,
            metric,
            trials=30,
            minibatch_size=15,
            seed=seed,
            parallel_trials=4,
        )
        tpe_hits += result.config == BEST
        random_hits += random_search(seed, result.runs) == BEST
    assert tpe_hits > random_hits, (tpe_hits, random_hits)


class WrittenWithDemos(Module):
    """Right only while its predictor holds the demo it was written with."""

    def __init__(self):
        self.p = Predict("x -> y", instructions="p0")
        self.p.demos.append({"x": "shown", "y": "written"})

    def forward(self, x):
        return Prediction(y=float(any(d.get("y") == "written" for d in self.p.demos)))


def test_the_program_as_given_competes_with_its_own_demos():
    """Trial 0 is the program as written, demos included: a search whose other candidates all
    lose the written demo returns it unchanged (its demos were once replaced by zero-shot)."""
    train = [Example(x=f"t{i}", y=1.0).with_inputs("x") for i in range(12)]
    config = PromptOptConfig(auto=None, num_candidates=3, minibatch_size=10, bootstrap_pool=8)
    optimizer = MIPROv2(metric, config, prompt_lm=prompt_model())
    best = optimizer.compile(WrittenWithDemos(), train, VALSET, out=io.StringIO())
    first = optimizer.result.trial_log[0]
    assert (first["trial"], first["kind"], first["score"]) == (0, "full", 1.0)
    assert optimizer.result.score == 1.0 and {"x": "shown", "y": "written"} in best.p.demos
