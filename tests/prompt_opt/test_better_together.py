import pytest

from mmgrpo_jax.engines.base import Sampling
from mmgrpo_jax.engines.jax_engine import JaxEngine
from mmgrpo_jax.engines.lm import EngineLM
from mmgrpo_jax.program import Example, Module, Predict
from mmgrpo_jax.program.adapter import format_outputs
from mmgrpo_jax.prompt_opt.better_together import (
    BetterTogether,
    LoadedPrompts,
    StartScores,
    parse_strategy,
)
from mmgrpo_jax.prompt_opt.mipro import MIPROv2, PromptOptConfig
from mmgrpo_jax.prompt_opt.proposer import PROPOSE, SUMMARIZE
from mmgrpo_jax.testing import ScriptedLM, word_policy
from mmgrpo_jax.trainer.config import MMGRPOConfig, OptimConfig, SamplerConfig
from mmgrpo_jax.trainer.mmgrpo import MMGRPO, evaluate
from programs import synthetic


class Echo(Module):
    def __init__(self):
        self.qa = Predict("q -> a")

    def forward(self, q):
        return self.qa(q=q)


class FakePrompts:
    def __init__(self, instruction):
        self.instruction = instruction

    def compile(self, program, trainset, valset):
        program = program.copy()
        program.qa.load_predictor_state({"instructions": self.instruction})
        return program


class FakeWeights:
    """Weights are one number; the compile adds one."""

    def __init__(self):
        self.value, self.seen = 0, []

    def compile(self, program, trainset, valset):
        self.seen.append([e.q for e in trainset])
        self.value += 1
        return program

    def snapshot_weights(self):
        return self.value

    def restore_weights(self, snapshot):
        self.value = snapshot


def test_best_stage_wins_earliest_on_ties_and_its_weights_come_back():
    weights = FakeWeights()
    scores = {("start", 0): 0.1, ("better", 0): 0.5, ("better", 1): 0.5, ("better", 2): 0.3}

    def score(program, valset):
        return scores[(program.qa.signature.instructions.split()[0], weights.value)]

    start = Echo()
    start.qa.load_predictor_state({"instructions": "start"})
    together = BetterTogether(score, FakePrompts("better prompt"), weights, seed=0)
    train = [Example(q=f"q{i}").with_inputs("q") for i in range(10)]
    best = together.compile(start, train, strategy="p -> w -> w")
    assert [s.name for s in together.stages] == ["start", "p", "w", "w"]
    assert [s.score for s in together.stages] == [0.1, 0.5, 0.5, 0.3]
    assert best.qa.signature.instructions == "better prompt" and weights.value == 0  # stage p
    assert len(weights.seen[0]) == 8 and weights.seen[0] != weights.seen[1]  # 2 held out
    with pytest.raises(ValueError, match="strategy"):
        parse_strategy("p -> x")


def test_known_start_scores_stand_for_the_start_stage_which_is_not_scored_again():
    weights, scored = FakeWeights(), []

    def score(program, valset):
        scored.append(weights.value)
        return 0.2 * weights.value

    together = BetterTogether(score, FakePrompts("better"), weights, seed=0)
    trainset = [Example(q=str(i)).with_inputs("q") for i in range(6)]
    together.compile(Echo(), trainset, trainset[:2], "w", start_score=0.9)
    assert [(s.name, s.score) for s in together.stages] == [("start", 0.9), ("w", 0.2)]
    assert scored == [1]  # the weight stage only
    assert together.best_index == 0  # the known score competes like a scored one


@pytest.mark.parametrize(
    ("summary", "message"),
    [
        ('{"strategy": "w", "stages": []}', r"not the summary.json of a strategy=none run .*'w'"),
        ("[1, 2]", r"strategy=none run \(strategy: 'list'\)"),
        ('{"strategy": "none", "stages": [{"stage": "start"}]}', "no start stage with a valset"),
        ('{"strategy": "none", "stages": [{"stage": "start", "valset": true}]}', "no start"),
        ("not json", "is not JSON"),
    ],
)
def test_start_scores_are_read_only_from_a_run_of_the_program_as_written(
    tmp_path, summary, message
):
    path = tmp_path / "summary.json"
    path.write_text(summary)
    with pytest.raises(ValueError, match=message):
        StartScores.read(path)
    with pytest.raises(ValueError, match="cannot be read"):
        StartScores.read(tmp_path / "missing.json")
    path.write_text('{"strategy": "none", "stages": [{"stage": "start", "valset": 0.5}]}')
    assert StartScores.read(path) == StartScores(0.5, None)


def test_a_loaded_prompt_stage_gives_the_stages_of_the_search_it_was_read_from():
    """A sweep's BetterTogether cell reads its p stage from its MIPROv2 cell: every stage, and
    the trainset order the weight stage sees, must be what searching again would give."""
    scores = {"start": 0.1, "better": 0.5}

    def run(prompts):
        weights = FakeWeights()
        start = Echo()
        start.qa.load_predictor_state({"instructions": "start"})
        together = BetterTogether(
            lambda program, valset: (
                scores[program.qa.signature.instructions.split()[0]] + weights.value / 10
            ),
            prompts,
            weights,
            seed=3,
        )
        train = [Example(q=f"q{i}").with_inputs("q") for i in range(10)]
        best = together.compile(start, train, train[:2], strategy="p -> w")
        assert start.qa.signature.instructions == "start"  # the start program is not changed
        return together, best, weights

    searched, searched_best, searched_weights = run(FakePrompts("better prompt"))
    state = searched.stages[1].prompt_state  # what the search's own run saves
    loaded, loaded_best, loaded_weights = run(LoadedPrompts(state))
    assert [(s.name, s.score, s.prompt_state, s.weights) for s in loaded.stages] == [
        (s.name, s.score, s.prompt_state, s.weights) for s in searched.stages
    ]
    assert loaded_weights.seen == searched_weights.seen  # the same order after the p stage
    assert loaded_best.dump_state() == searched_best.dump_state() == state


def test_p_then_w_on_the_two_door_program_keeps_the_prompts_byte_identical(tmp_path):
    model, tokenizer = word_policy([*synthetic.SIGN_WORDS, *synthetic.DOORS], num_layers=1)
    stop = [tokenizer.eos_token_id]
    train = synthetic.two_door_examples(repeats=2)
    val = synthetic.two_door_examples()
    # one engine: mmGRPO pushes its updates into it, so the greedy scores see the trained weights
    engine = JaxEngine(model, stop_token_ids=stop, max_wait_s=1.0)
    lm = EngineLM(engine, tokenizer, sampling=Sampling(1, temperature=1.0))
    greedy = EngineLM(engine, tokenizer, sampling=Sampling(1, temperature=0.0))

    def prompt_lm_reply(messages):
        if "[[ ## examples ## ]]" in messages[-1]["content"]:
            return format_outputs(SUMMARIZE, {"observations": "clues and doors"})
        return format_outputs(PROPOSE, {"proposed_instruction": "left right amber birch"})

    prompts = MIPROv2(
        synthetic.two_door_metric,
        PromptOptConfig(
            auto=None, num_candidates=2, num_trials=2, minibatch_size=4, bootstrap_pool=4
        ),
        prompt_lm=ScriptedLM(prompt_lm_reply),
        lm=lm,
    )
    weights = MMGRPO(
        synthetic.two_door_metric,
        MMGRPOConfig(
            num_rollouts=4,
            examples_per_step=4,
            num_steps=2,
            sampler=SamplerConfig(max_completion_tokens=1, max_wait_s=1.0),
            train="full",
            optim=OptimConfig(lr=1e-2, micro_batch_size=64),
            eval_every=100,
            run_dir=str(tmp_path / "w"),
            progress=False,
        ),
        model=model,
        tokenizer=tokenizer,
        stop_token_ids=stop,
        engine=engine,
    )

    def score(program, valset):
        return evaluate(program, valset, synthetic.two_door_metric, greedy)

    together = BetterTogether(score, prompts, weights, seed=1)
    try:
        best = together.compile(synthetic.TwoDoors(), train, val, strategy="p -> w")
    finally:
        engine.close()
    start, p, w = together.stages
    assert (start.name, p.name, w.name) == ("start", "p", "w")
    assert repr(p.prompt_state) == repr(w.prompt_state)  # the weight stage left prompts alone
    chosen = max(together.stages, key=lambda s: s.score)
    assert best.dump_state() == chosen.prompt_state
    assert together.stages.index(chosen) == min(
        i for i, s in enumerate(together.stages) if s.score == chosen.score
    )
