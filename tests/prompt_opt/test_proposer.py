from mmgrpo_jax.program import Example, Module, Predict
from mmgrpo_jax.program.adapter import format_outputs
from mmgrpo_jax.prompt_opt.proposer import PROPOSE, SUMMARIZE, TIPS, InstructionProposer
from mmgrpo_jax.testing import ScriptedLM


class TwoStep(Module):
    """Drafts an answer, then polishes it."""

    def __init__(self):
        self.draft = Predict("question -> draft", instructions="Draft an answer.")
        self.polish = Predict("question, draft -> answer", instructions="Polish the draft.")

    def forward(self, question):
        return self.polish(question=question, draft=self.draft(question=question).draft)


def prompt_model():
    count = [0]

    def respond(messages):
        if "[[ ## examples ## ]]" in messages[-1]["content"]:
            return format_outputs(SUMMARIZE, {"observations": "short factual questions"})
        count[0] += 1
        return format_outputs(PROPOSE, {"proposed_instruction": f"new instruction {count[0]}"})

    return ScriptedLM(respond)


def test_proposals_see_the_documented_fields_and_one_tip():
    lm = prompt_model()
    train = [Example(question=f"q{i}", answer="a").with_inputs("question") for i in range(25)]
    demo_sets = {"draft": [[], [{"question": "q1", "draft": "d1"}]], "polish": [[], []]}
    proposer = InstructionProposer(lm, summary_examples=25, summary_batch=10, seed=3)
    found = proposer.propose_instructions(TwoStep(), train, demo_sets, num_candidates=4)
    assert found["draft"][0] == "Draft an answer." and found["polish"][0] == "Polish the draft."
    assert len(found["draft"]) == len(found["polish"]) == 4
    assert len(set(found["draft"][1:] + found["polish"][1:])) == 6
    assert len(lm.calls) == proposer.num_calls(25, 2, 4) == 3 + 2 * 3
    proposals = [m for m, _ in lm.calls if "[[ ## tip ## ]]" in m[-1]["content"]]
    tips = set(TIPS.values())
    for messages in proposals:
        text = messages[-1]["content"]
        for field in PROPOSE.input_names:
            assert f"[[ ## {field} ## ]]" in text
        assert "short factual questions" in text and "Drafts an answer, then polishes it." in text
        tip = text.split("[[ ## tip ## ]]\n")[1].split("\n\n")[0].strip()
        assert tip in tips or (tip == "" and "" in tips)
    assert "Draft an answer." in proposals[0][-1]["content"]  # the current instruction


def test_same_seed_same_prompts():
    train = [Example(question="q", answer="a").with_inputs("question")]
    runs = []
    for _ in range(2):
        lm = prompt_model()
        InstructionProposer(lm, seed=0).propose_instructions(TwoStep(), train, {}, 3)
        runs.append([m for m, _ in lm.calls])
    assert runs[0] == runs[1]


def test_unparsed_replies_are_dropped_counted_and_warned(caplog):
    count = [0]

    def respond(messages):
        if "[[ ## examples ## ]]" in messages[-1]["content"]:
            return "no fields at all"
        count[0] += 1
        if count[0] % 2:  # every other proposal is garbage
            return "I would suggest something"
        return format_outputs(PROPOSE, {"proposed_instruction": f"new {count[0]}"})

    train = [Example(question=f"q{i}", answer="a").with_inputs("question") for i in range(5)]
    proposer = InstructionProposer(ScriptedLM(respond), summary_examples=5, summary_batch=5)
    found = proposer.propose_instructions(TwoStep(), train, {}, num_candidates=3)
    assert found == {
        "draft": ["Draft an answer.", "new 2"],
        "polish": ["Polish the draft.", "new 4"],
    }
    assert proposer.unparsed == 1 + 2  # the summary and two proposals
    assert sum("dropped" in r.message for r in caplog.records) == 3
