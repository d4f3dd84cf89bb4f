"""Banking77: one ChainOfThought module maps a customer query to one of 77 intent names.

Splits (seeded, `seed=0` by default): the local train file (10,003 queries, file order) is
shuffled with `random.Random(seed)`; train = the first 250, dev = the next 500 (the paper's sizes);
test = the official test file (3,080). Label names come from the data (`hf_label_names.json`, the
hub's ClassLabel order), never typed here.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Literal

from mmgrpo_jax.program import ChainOfThought, Example, Module, Prediction
from mmgrpo_jax.program.signature import Field, Signature
from programs.data import (
    HUB,
    Splits,
    load_hub,
    missing_file,
    read_hub,
    read_jsonl,
    resolve_data_dir,
)

TRAIN_SIZE, DEV_SIZE = 250, 500
HUB_NAME = "PolyAI/banking77"


def label_names(data_dir: str | Path | None = None) -> list[str]:
    root = resolve_data_dir(data_dir)
    if root == HUB:
        return list(load_hub(HUB_NAME, "test").features["label"].names)
    path = Path(root) / "banking77" / "hf_label_names.json"
    if not path.is_file():
        raise missing_file(path, "the Banking77 label names")
    return list(json.loads(path.read_text()))


def _rows(data_dir: str | Path | None, split: str, names: list[str]) -> list[dict[str, str]]:
    root = resolve_data_dir(data_dir)
    if root == HUB:
        rows = read_hub(HUB_NAME, split)
        return [{"text": r["text"], "category": names[r["label"]]} for r in rows]
    return read_jsonl(Path(root) / "banking77" / f"{split}.jsonl")


def _examples(rows: list[dict[str, str]]) -> list[Example]:
    return [Example(text=r["text"], label=r["category"]).with_inputs("text") for r in rows]


def training_pool(data_dir: str | Path | None = None, seed: int = 0) -> list[Example]:
    """The train file's queries in the seeded order the splits cut from."""
    pool = _rows(data_dir, "train", label_names(data_dir))
    random.Random(seed).shuffle(pool)
    return _examples(pool)


def load_banking77(data_dir: str | Path | None = None, seed: int = 0) -> Splits:
    pool = training_pool(data_dir, seed)
    return Splits(
        train=pool[:TRAIN_SIZE],
        dev=pool[TRAIN_SIZE : TRAIN_SIZE + DEV_SIZE],
        test=_examples(_rows(data_dir, "test", label_names(data_dir))),
    )


class Banking77(Module):
    """text -> label, the label restricted to the intent names."""

    def __init__(self, labels: list[str]) -> None:
        if len(set(labels)) != len(labels) or not labels:
            raise ValueError(f"labels must be distinct and non-empty, got {len(labels)} names")
        self.classify = ChainOfThought(
            Signature(
                (Field("text", str, "a customer's message to a bank"),),
                (Field("label", Literal[tuple(labels)], "the intent of the message"),),
                "Classify the intent of the customer's message.",
            )
        )

    def forward(self, text: str) -> Prediction:
        return self.classify(text=text)


def exact_match(example: Example, prediction: Prediction) -> float:
    return float(prediction.label == example.label)
