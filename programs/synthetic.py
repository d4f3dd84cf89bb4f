"""A small two-module program for tests and the demo: follow links through a word table.

The clue names a start word and a number of links ("Start at cedar and follow 2 links."). Module
`start` picks the start word; a deterministic tool follows one link of a fixed table; module `hop`
is called after every step, a variable number of times, to say whether enough links were
followed. Only the final word is scored, so credit must reach both modules through the reward.
"""

from __future__ import annotations

import dataclasses
import re
import threading
from typing import Literal

import numpy as np

from mmgrpo_jax.program import Example, Field, Module, Predict, Prediction, Signature, adapter
from mmgrpo_jax.testing import Messages, ScriptedLM

WORDS = ("amber", "birch", "cedar", "dune", "ember", "fjord", "grove", "heath", "iris", "juniper")
_CLUE = re.compile(r"Start at (\w+) and follow (\d+) links?\.")


@dataclasses.dataclass(frozen=True)
class LinkTable:
    """The tool: every word links to the next word of a seeded cycle."""

    links: dict[str, str]

    @classmethod
    def make(cls, num_words: int = 6, seed: int = 0) -> LinkTable:
        if not 2 <= num_words <= len(WORDS):
            raise ValueError(f"num_words must be in [2, {len(WORDS)}], got {num_words}")
        order = np.random.default_rng(seed).permutation(num_words)
        cycle = [WORDS[i] for i in order]
        return cls({w: cycle[(i + 1) % num_words] for i, w in enumerate(cycle)})

    @property
    def words(self) -> tuple[str, ...]:
        return tuple(sorted(self.links))

    def follow(self, word: str) -> str:
        return self.links[word]


class LinkFollower(Module):
    """start (once) -> [follow a link, hop] (1..max_links times) -> final word."""

    def __init__(self, table: LinkTable, max_links: int = 3) -> None:
        if max_links < 1:
            raise ValueError(f"max_links must be >= 1, got {max_links}")
        self.table = table
        self.max_links = max_links
        clue = Field("clue", str, "where to start and how many links to follow")
        self.start = Predict(
            Signature(
                (clue,),
                (Field("start", Literal[table.words], "the word the clue starts from"),),
                "Read the clue and name the word it says to start from.",
            )
        )
        self.hop = Predict(
            Signature(
                (clue, Field("path", list[str], "the words visited so far, start first")),
                (Field("done", bool, "whether the clue's number of links has been followed"),),
                "Compare the path with the clue and say whether enough links were followed.",
            )
        )

    def forward(self, clue: str) -> Prediction:
        path = [self.start(clue=clue).start]
        for _ in range(self.max_links):
            if self.hop(clue=clue, path=path).done:
                break
            path.append(self.table.follow(path[-1]))
        return Prediction(answer=path[-1], path=path)


def make_examples(table: LinkTable, n: int, max_links: int = 3, seed: int = 0) -> list[Example]:
    rng = np.random.default_rng(seed)
    examples = []
    for _ in range(n):
        word = table.words[rng.integers(len(table.words))]
        links = int(rng.integers(1, max_links + 1))
        answer = word
        for _ in range(links):
            answer = table.follow(answer)
        clue = f"Start at {word} and follow {links} link{'s' if links > 1 else ''}."
        examples.append(Example(clue=clue, answer=answer).with_inputs("clue"))
    return examples


def metric(example: Example, prediction: Prediction) -> float:
    return float(prediction.answer == example.answer)


def noisy_policy(
    program: LinkFollower, *, accuracy: float = 0.7, format_error_rate: float = 0.05, seed: int = 0
) -> ScriptedLM:
    """A scripted LM that answers each call right with probability `accuracy`.

    It reads the inputs back with the adapter (the same headers the prompt was rendered with) and
    sometimes writes an unparseable reply, so rollouts show every status.
    """
    rng = np.random.default_rng(seed)
    lock = threading.Lock()

    def respond(messages: Messages) -> str:
        is_start = adapter.header("start") in messages[0]["content"]
        predictor = program.start if is_start else program.hop
        inputs = adapter.parse(Signature((), predictor.signature.inputs), messages[-1]["content"])
        match = _CLUE.search(inputs["clue"])
        if match is None:
            raise ValueError(f"clue {inputs['clue']!r} is not of the synthetic form")
        word, links = match.group(1), int(match.group(2))
        with lock:
            broken, right, pick = rng.random(), rng.random() < accuracy, rng.integers(1 << 30)
        if broken < format_error_rate:
            return "I am not sure what to write."
        if is_start:
            others = [w for w in program.table.words if w != word]
            outputs = {"start": word if right else others[pick % len(others)]}
        else:
            done = len(inputs["path"]) - 1 >= links
            outputs = {"done": done if right else not done}
        return adapter.format_outputs(predictor.signature, outputs)

    return ScriptedLM(respond, token_ids=True)


# --------------------------------------------------------------------------------------------
# Two doors: the demo task, built so a tiny policy trained from scratch can learn it in minutes.

SIGN_WORDS = ("amber", "birch", "cedar", "dune")
DOORS = ("left", "right")
_NEXT = {w: SIGN_WORDS[(i + 1) % len(SIGN_WORDS)] for i, w in enumerate(SIGN_WORDS)}
_DECOY = {w: SIGN_WORDS[(i - 1) % len(SIGN_WORDS)] for i, w in enumerate(SIGN_WORDS)}
_RIGHT_DOOR = {w: DOORS[i % 2] for i, w in enumerate(SIGN_WORDS)}


class TwoDoors(Module):
    """door (clue -> left | right) -> tool: the sign behind it -> answer (sign -> word).

    The right door shows the word after the clue's word, the wrong one a decoy (the word before
    it). Only the answer is scored. Why this shape: module `door` is right half the time at init,
    and module `answer` sees only the sign, so it cannot win with a constant (4 answers) and
    copying the sign pays exactly when `door` was right: each module's signal depends on the
    other, as in the paper's programs, yet neither starts at zero. Both predictors are bare:
    one-word replies. One way round the door exists: with a constant door the four clues show
    four different signs, so an answer module that maps each sign to its clue's answer (rather
    than copying it) scores 1.0 alone. The demo's failing seeds are the ones that head there
    (README, "Why seeds fail").
    """

    def __init__(self) -> None:
        self.door = Predict(
            Signature(
                (Field("clue", str, "a word"),),
                (Field("door", Literal[DOORS], "the door to open"),),
                "Open the door that hides the sign for this clue.",
            ),
            bare=True,
        )
        self.answer = Predict(
            Signature(
                (Field("sign", str, "the word written behind the door"),),
                (Field("answer", Literal[SIGN_WORDS], "the answer"),),
                "Answer with the word on the sign.",
            ),
            bare=True,
        )

    def forward(self, clue: str) -> Prediction:
        door = self.door(clue=clue).door
        sign = _NEXT[clue] if door == _RIGHT_DOOR[clue] else _DECOY[clue]
        return self.answer(sign=sign)


def two_door_examples(repeats: int = 1) -> list[Example]:
    """Every clue once per repeat; the answer is the word after the clue's."""
    return [
        Example(clue=w, answer=_NEXT[w]).with_inputs("clue")
        for _ in range(repeats)
        for w in SIGN_WORDS
    ]


def two_door_metric(example: Example, prediction: Prediction) -> float:
    return float(prediction.answer == example.answer)
