"""CPU testbeds: small multi-module programs on which the paper's design choices have an answer.

Each testbed is a program of bare (one-word-reply) predictors with its examples, metric and word
vocabulary, so the demo's tiny from-scratch policy learns it in minutes on 2 cores
(`mmgrpo demo testbed=<name>`, and `mmgrpo sweep` over its settings). Each names the question it
asks; the README's "CPU testbeds" section says what the sweeps showed
(`experiments/results/testbed_*/`).

* `two_doors`: the demo (`programs.synthetic.TwoDoors`): two modules, each one's signal depends
  on the other.
* `counter`: the policy decides how many times its module is called (go / stop), so rollouts of
  one input have different invocation counts: per-invocation-index groups need an align rule,
  and `truncate` drops the late calls, which are the ones that decide when to stop.
* `weak_link`: two easy modules (always "yes") around one hard one (a word's successor in a
  hidden cycle); the reward is all-or-nothing, so with uniform credit the easy modules' calls
  carry the hard one's failures. With one call per module and one-token replies, module- and
  trajectory-level groups hold the same rewards and weigh each token alike (GRPO's loss): the
  groupings differ only where a rollout stops early (a reply that does not parse).
* `long_chain`: one module called `length` times in a row (each hop: the next word), rewarded by
  the fraction of right hops: trajectory-level groups give every hop its trajectory's advantage
  in one group; module-level groups normalise each invocation index on its own.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Literal

from mmgrpo_jax.program import Example, Field, Module, Predict, Prediction, Signature
from programs import synthetic

CYCLE = synthetic.SIGN_WORDS  # amber -> birch -> cedar -> dune -> amber
NEXT = {w: CYCLE[(i + 1) % len(CYCLE)] for i, w in enumerate(CYCLE)}
NUMBERS = ("zero", "one", "two", "three")


@dataclasses.dataclass(frozen=True)
class Testbed:
    """Everything the demo needs to train a word policy on a program."""

    name: str
    question: str
    program: Callable[[], Module]
    trainset: Callable[[], list[Example]]
    valset: Callable[[], list[Example]]
    metric: Callable[[Example, Prediction], float]
    vocabulary: tuple[str, ...]


def exact_answer(example: Example, prediction: Prediction) -> float:
    return float(prediction.answer == example.answer)


# -- counter: the policy decides its module's invocation count ------------------------------


class Counter(Module):
    """step (left -> go | stop), until stop or `max_calls`; the answer is the count reached.

    `left` is what remains to the target (the program counts), so the right policy is one word
    per input (zero -> stop, else go), yet the number of calls is the policy's: a rollout that
    stops early makes fewer calls than one that goes on.
    """

    def __init__(self, max_calls: int = 3) -> None:
        if not 1 <= max_calls < len(NUMBERS):
            raise ValueError(f"max_calls must be in [1, {len(NUMBERS) - 1}], got {max_calls}")
        self.max_calls = max_calls
        self.step = Predict(
            Signature(
                (Field("left", str, "how many counts are left to the target"),),
                (Field("action", Literal["go", "stop"], "go: count one more; stop: answer"),),
                "Count up to the target, then stop.",
            ),
            bare=True,
        )

    def forward(self, target: str) -> Prediction:
        goal, count = NUMBERS.index(target), 0
        for _ in range(self.max_calls):
            left = NUMBERS[goal - count] if count <= goal else "none"
            if self.step(left=left).action == "stop":
                break
            count += 1
        return Prediction(answer=NUMBERS[count])


def counter_examples(repeats: int = 1) -> list[Example]:
    """Targets zero to three: one, two, three and three calls (the cap) when the policy is right."""
    return [
        Example(target=n, answer=n).with_inputs("target") for _ in range(repeats) for n in NUMBERS
    ]


def successor() -> Predict:
    """word -> the word after it in the cycle: the hard module of weak_link and long_chain."""
    return Predict(
        Signature(
            (Field("word", str, "a word"),),
            (Field("next", Literal[CYCLE], "the word that follows it"),),
            "Name the word that follows this one.",
        ),
        bare=True,
    )


# -- weak_link: one hard module between two easy ones ---------------------------------------

AGREE = ("yes", "no")


class WeakLink(Module):
    """begin (word -> yes) -> shift (word -> its successor) -> end (word -> yes).

    `begin` and `end` are easy (one constant reply, a bias to learn); `shift` is hard (a mapping
    of its input). The easy modules reply from their own words (yes / no), not from the cycle's:
    when they said "amber", the policy learnt amber for every call and shift collapsed onto it
    (right for one input in four, every group flat). The answer is shift's word, kept only when
    both easy calls said yes.
    """

    def __init__(self) -> None:
        def agree(instructions: str) -> Predict:
            return Predict(
                Signature(
                    (Field("word", str, "a word"),),
                    (Field("agree", Literal[AGREE], "yes to go on"),),
                    instructions,
                ),
                bare=True,
            )

        self.begin = agree("Begin the cycle at this word.")
        self.shift = successor()
        self.end = agree("End the cycle at this word.")

    def forward(self, word: str) -> Prediction:
        opened = self.begin(word=word).agree == "yes"
        after = self.shift(word=word).next
        closed = self.end(word=after).agree == "yes"
        return Prediction(answer=after if opened and closed else "refused")


def word_examples(repeats: int = 1, hops: int = 1) -> list[Example]:
    """Every word of the cycle once per repeat; the answer is `hops` words further on."""
    examples = []
    for _ in range(repeats):
        for word in CYCLE:
            answer = word
            for _ in range(hops):
                answer = NEXT[answer]
            examples.append(Example(word=word, answer=answer).with_inputs("word"))
    return examples


# -- long_chain: one module, `length` hops ----------------------------------------------------


class LongChain(Module):
    """hop (word -> its successor) `length` times, each hop reading the previous one's reply."""

    def __init__(self, length: int = 4) -> None:
        if length < 1:
            raise ValueError(f"length must be >= 1, got {length}")
        self.length = length
        self.hop = successor()

    def forward(self, word: str) -> Prediction:
        path = [word]
        for _ in range(self.length):
            path.append(self.hop(word=path[-1]).next)
        return Prediction(answer=path[-1], path=path)


def right_hops(example: Example, prediction: Prediction) -> float:
    """The fraction of hops that named their word's successor (one reward per trajectory)."""
    path = prediction.path
    return sum(NEXT[a] == b for a, b in itertools.pairwise(path)) / (len(path) - 1)


TESTBEDS = {
    t.name: t
    for t in (
        Testbed(
            "two_doors",
            "does credit reach two modules whose signals depend on each other?",
            synthetic.TwoDoors,
            lambda: synthetic.two_door_examples(repeats=4),
            synthetic.two_door_examples,
            synthetic.two_door_metric,
            (*synthetic.SIGN_WORDS, *synthetic.DOORS),
        ),
        Testbed(
            "counter",
            "with policy-decided invocation counts, which align rule lets the late calls learn?",
            Counter,
            lambda: counter_examples(repeats=4),
            counter_examples,
            exact_answer,
            ("go", "stop", "none", *NUMBERS),
        ),
        Testbed(
            "weak_link",
            "under uniform credit, do module-level groups teach the one hard module faster?",
            WeakLink,
            lambda: word_examples(repeats=4),
            word_examples,
            exact_answer,
            (*CYCLE, *AGREE),
        ),
        Testbed(
            "long_chain",
            "on a 4-hop chain, do trajectory- and module-level groups learn at the same pace?",
            LongChain,
            lambda: word_examples(repeats=4, hops=4),
            lambda: word_examples(hops=4),
            right_hops,
            CYCLE,
        ),
    )
}


def testbed(name: str) -> Testbed:
    if name not in TESTBEDS:
        raise ValueError(f"testbed must be one of {sorted(TESTBEDS)}, got {name!r}")
    return TESTBEDS[name]
