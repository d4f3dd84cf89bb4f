"""Banking77 for the real-LM tier: keywords, a shortlist of intents retrieved, then the intent.

The paper's program is one chain-of-thought module choosing among all 77 intents, in a headed
format SmolLM2-135M does not write; asked to choose a topic among eight first, the 135M model is
at chance (14 of 80 dev queries). Here the choice is narrowed by retrieval, as a kNN classifier
would: `keywords` writes a few words on what the customer wants; BM25 over a labelled reference
set (`REFERENCE_SIZE` queries of Banking77's train file that neither train, dev nor test holds,
and each intent's name) ranks them for the message and its keywords, and the first `SHORTLIST`
distinct intents become the choices; `intent` names one of them. The reward flows to both calls:
keywords that pull the right intent into the shortlist, and the pick.

Each reply is read for the one choice it names (`named_choice`: "The intent is card arrival."
names `card_arrival`; a reply listing two names none), since the 135M model wraps its answer in a
sentence. The metric is the paper's exact match on the intent named; naming none scores 0.

Splits (`seed`, 0 by default): train is Banking77's 250 (`load_banking77`'s, the paper's size),
dev the first `DEV_SIZE` of its dev, and test `TEST_PER_INTENT` queries of each intent from the
official test file (seeded): 154 queries, every intent equally, few enough to score on a CPU
after every stage. The reference set follows the dev split in the same shuffled pool.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

from mmgrpo_jax.program import Example, Module, Predict, Prediction
from programs.banking77 import DEV_SIZE as FULL_DEV_SIZE
from programs.banking77 import TRAIN_SIZE, load_banking77, training_pool
from programs.data import Splits
from programs.retrieval import BM25Retriever, passage, title_of
from programs.text import phrase

DEV_SIZE, TEST_PER_INTENT, REFERENCE_SIZE, SHORTLIST = 80, 2, 250, 4
# Worked queries written here (not from the dataset), with choices as retrieval might list them:
# the reply formats shown in the chat's own turns, which a 135M model follows where an
# instruction alone is not enough.
DEMOS = (
    (
        "I ordered a new card last week and it still has not come.",
        "new card not arrived",
        ("card_delivery_estimate", "card_arrival", "order_physical_card", "activate_my_card"),
        "card_arrival",
    ),
    (
        "How much will it cost me to send money to my sister's account?",
        "fee for a transfer",
        ("transfer_timing", "cancel_transfer", "transfer_fee_charged", "exchange_charge"),
        "transfer_fee_charged",
    ),
    (
        "The cash machine gave me less money than I asked for.",
        "wrong amount from ATM",
        (
            "wrong_amount_of_cash_received",
            "atm_support",
            "declined_cash_withdrawal",
            "card_swallowed",
        ),
        "wrong_amount_of_cash_received",
    ),
)


def named_choice(reply: str, choices: Sequence[str]) -> str | None:
    """The one choice the reply names, as words ('The intent is: card arrival.' -> card_arrival);
    None when it names none or several. A choice inside a longer one named ('exchange rate' in
    'wrong exchange rate for cash withdrawal') does not count apart from it."""
    said = f" {phrase(reply)} "
    named = [c for c in choices if f" {phrase(c)} " in said]
    named = [c for c in named if not any(c != o and phrase(c) in phrase(o) for o in named)]
    return named[0] if len(named) == 1 else None


def listed(choices: Sequence[str]) -> str:
    """Choices as the prompt lists them: plain words, which the model writes back."""
    return "; ".join(phrase(c) for c in choices)


def load_banking77_shortlist(data_dir: str | Path | None = None, seed: int = 0) -> Splits:
    """Train 250 and dev `DEV_SIZE` from Banking77's train file, test 2 per intent (154)."""
    full = load_banking77(data_dir, seed)
    by_intent: dict[str, list[Example]] = {}
    for example in full.test:
        by_intent.setdefault(example.label, []).append(example)
    rng = random.Random(seed)
    test = [e for label in sorted(by_intent) for e in rng.sample(by_intent[label], TEST_PER_INTENT)]
    return Splits(train=full.train, dev=full.dev[:DEV_SIZE], test=test)


def load_reference(data_dir: str | Path | None = None, seed: int = 0) -> list[Example]:
    """The labelled queries retrieval ranks: the `REFERENCE_SIZE` after Banking77's dev."""
    start = TRAIN_SIZE + FULL_DEV_SIZE
    return training_pool(data_dir, seed)[start : start + REFERENCE_SIZE]


class Banking77Shortlist(Module):
    """text -> keywords -> BM25 shortlist of intents -> intent, two bare predictors."""

    def __init__(self, reference: Sequence[Example], labels: Sequence[str]) -> None:
        unknown = sorted({e.label for e in reference} - set(labels))
        if unknown or not labels:
            raise ValueError(f"reference labels {unknown} are not among the {len(labels)} labels")
        # an intent's name is a passage too, so every intent can be retrieved
        passages = [passage(e.label, e.text) for e in reference]
        self.retrieve = BM25Retriever.over(passages + [passage(n, phrase(n)) for n in labels])
        self.keywords = Predict(
            "text -> keywords",
            instructions="A customer wrote to their bank. In a few words, what does the customer "
            "want?",
            bare=True,
        )
        self.intent = Predict(
            "text, choices -> intent",
            instructions="A customer wrote to their bank. Which of the choices is the intent of "
            "the message? Reply with one choice only, written as it is listed.",
            bare=True,
        )
        for text, keywords, choices, intent in DEMOS:
            self.keywords.demos.append({"text": text, "keywords": keywords})
            demo = {"text": text, "choices": listed(choices), "intent": phrase(intent)}
            self.intent.demos.append(demo)

    def shortlist(self, query: str) -> list[str]:
        """The first `SHORTLIST` distinct intents of the passages BM25 ranks for `query`."""
        choices: list[str] = []
        for hit in self.retrieve(query, k=len(self.retrieve.passages)):
            if title_of(hit) not in choices:
                choices.append(title_of(hit))
            if len(choices) == SHORTLIST:
                break
        return choices

    def forward(self, text: str) -> Prediction:
        keywords = self.keywords(text=text).keywords
        choices = self.shortlist(f"{text} {keywords}")
        reply = self.intent(text=text, choices=listed(choices)).intent
        return Prediction(keywords=keywords, choices=choices, label=named_choice(reply, choices))


def intent_match(example: Example, prediction: Prediction) -> float:
    """The paper's exact match: the intent the program named is the label; none scores 0."""
    return float(prediction.label == example.label)
