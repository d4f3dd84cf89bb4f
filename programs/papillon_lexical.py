"""PAPILLON for the real-LM tier: privacy-conscious delegation on PUPA's real queries, scored
without a judge LM.

`redact` rewrites the user's private query as a request for an untrusted model (the frozen base
policy: nothing here is sent off the machine); the untrusted model answers it; `respond` writes
the reply to the user from the query and that answer. Both are bare predictors (the 135M model
does not write the paper's headed format).

The score keeps the paper's shape, (quality + 1 - leakage) / 2, with both parts programmatic:

* leakage: the share of the example's PII units (PUPA's annotations) whose words appear, in
  order, in the request (`leaked_units`). WildChat's own placeholders (`<PRESIDIO_ANONYMIZED_...>`,
  annotated as units in 31 queries) are not the detail they replace, so they are not counted.
  The paper's judge also counts a paraphrased detail; this measure counts only the words.
* quality: F1 between the reply's and the reference response's content words, each without the
  words the user's query already holds (`new_content_f1`). The paper asks a judge whether the
  reply is at least as good as the reference; this proxy measures only how much of what the
  reference adds to the query the reply adds too. Copying the query into the reply earns
  nothing; fluency, order and correctness are not measured, and a reply listing many reference
  words with no sense could score.

Splits: PUPA_New in file order, the paper's cuts (train [0:111], dev [111:222], test
[222:443]), each kept to queries of at most `MAX_QUERY_CHARS` characters (about 150 tokens: the
prompt budget of a CPU run) and rid of repeats: PUPA_New holds the same query more than once
(22 of test's queries are in train, 20 in dev), so a query an earlier split holds is dropped.
Dev and test are then cut to their first `DEV_SIZE` and `TEST_SIZE` (three generations a query
make an evaluation of 64 about five minutes on 2 cores).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from mmgrpo_jax.program import Example, Module, Predict, Prediction
from mmgrpo_jax.program.lm import LM
from programs.data import Splits
from programs.papillon import load_pupa
from programs.text import phrase, words

MAX_QUERY_CHARS, DEV_SIZE, TEST_SIZE = 600, 24, 64
PLACEHOLDER = "presidio_anonymized"
# words that carry no content: articles, pronouns, auxiliaries, common prepositions
_STOPWORD_TEXT = (
    "a an and are as at be but by for if in into is it no not of on or such that the their then "
    "there these they this to was will with i you your my me we our he she his her its can do "
    "have has from so all any"
)
STOPWORDS = frozenset(_STOPWORD_TEXT.split())


def real_units(units: Sequence[str]) -> list[str]:
    """PII units with WildChat's placeholders dropped (they are not the detail)."""
    return [u for u in units if PLACEHOLDER not in u.lower().replace(" ", "_") and words(u)]


def leaked_units(request: str, units: Sequence[str]) -> list[str]:
    """The units whose words appear, in order and whole, in the request."""
    said = f" {phrase(request)} "
    return [u for u in real_units(units) if f" {phrase(u)} " in said]


def leakage(request: str, units: Sequence[str]) -> float:
    """Share of the real PII units the request holds; 0 for a query with none."""
    real = real_units(units)
    return len(leaked_units(request, real)) / len(real) if real else 0.0


def new_content_f1(reply: str, reference: str, query: str) -> float:
    """F1 of the content words reply and reference add to the query (sets of words)."""
    known = set(words(query)) | STOPWORDS
    ours, theirs = set(words(reply)) - known, set(words(reference)) - known
    common = len(ours & theirs)
    if not common:
        return 0.0
    precision, recall = common / len(ours), common / len(theirs)
    return 2 * precision * recall / (precision + recall)


def load_pupa_short(data_dir: str | Path | None = None) -> Splits:
    """The paper's PUPA_New cuts, each kept to queries of <= `MAX_QUERY_CHARS` characters and
    to queries no earlier split (nor an earlier row of its own) holds; dev and test then cut to
    their first `DEV_SIZE` and `TEST_SIZE`."""
    full, seen = load_pupa(data_dir), set()

    def held_out(examples: list[Example]) -> list[Example]:
        kept = []
        for e in examples:
            if len(e.user_query) <= MAX_QUERY_CHARS and e.user_query not in seen:
                kept.append(e)
                seen.add(e.user_query)
        return kept

    train, dev, test = held_out(full.train), held_out(full.dev), held_out(full.test)
    return Splits(train=train, dev=dev[:DEV_SIZE], test=test[:TEST_SIZE])


class PapillonLexical(Module):
    """user_query -> request -> untrusted LM -> response, two bare predictors."""

    def __init__(self, untrusted_lm: LM) -> None:
        self.untrusted_lm = untrusted_lm
        self.redact = Predict(
            "user_query -> request",
            instructions="Rewrite the user's query as a request for an external assistant. Keep "
            "the task; leave out names, places, companies, dates and other personal details.",
            bare=True,
        )
        self.respond = Predict(
            "user_query, assistant_reply -> response",
            instructions="Write the reply to the user's query, using the external assistant's "
            "reply to a privacy-preserving version of it.",
            bare=True,
        )

    def forward(self, user_query: str) -> Prediction:
        request = self.redact(user_query=user_query).request
        answer = self.untrusted_lm([{"role": "user", "content": request}]).text
        response = self.respond(user_query=user_query, assistant_reply=answer).response
        return Prediction(request=request, assistant_reply=answer, response=response)


def privacy_score(example: Example, prediction: Prediction) -> float:
    """(quality + 1 - leakage) / 2, both parts programmatic (see the module docstring)."""
    quality = new_content_f1(prediction.response, example.target_response, example.user_query)
    return (quality + 1.0 - leakage(prediction.request, example.pii_units)) / 2.0
