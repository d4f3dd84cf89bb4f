from mmgrpo_jax.program.adapter import parse
from mmgrpo_jax.prompt_opt.proposer import PROPOSE
from mmgrpo_jax.testing import word_prompt_model

WORDS = ("amber", "birch", "left", "right")


def test_word_prompt_model_writes_its_words_seeded_by_the_prompt():
    lm = word_prompt_model(WORDS, seed=0)

    def propose(text, model=lm):
        reply = model([{"role": "user", "content": text}]).text
        return parse(PROPOSE, reply)["proposed_instruction"]

    words = propose("tip: be creative").split()
    assert 3 <= len(words) <= 8 and set(words) <= set(WORDS)
    assert propose("tip: be creative") == " ".join(words)  # a function of the prompt
    others = [propose(f"tip: number {i}") for i in range(5)]
    assert len(set(others)) > 1  # different tips, different candidates
    assert [propose(f"tip: number {i}", word_prompt_model(WORDS, 1)) for i in range(5)] != others
