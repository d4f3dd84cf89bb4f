"""What a sampler is asked and what it answers, free of JAX: the engine protocol, the program
layer and an external LM client import these without loading a compiler."""

from __future__ import annotations

import dataclasses
from typing import Literal


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Per-request sampling settings; temperature 0 is greedy."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


@dataclasses.dataclass(frozen=True)
class Request:
    prompt_ids: tuple[int, ...]
    sampling: Sampling
    order: tuple[int, ...] | None = None  # (example, rollout, call) inside a rollout
    # (step, example, rollout, call) in a training rollout: the sampling key is derived from it
    # and the engine's seed, so a sample does not depend on batch composition, timing, the
    # number of processes or resumption; None draws from the engine's own stream
    key_path: tuple[int, ...] | None = None
    adapter: int = 0  # the LoRA adapter that serves it: its module's (per-module adapters)


@dataclasses.dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    logprobs: list[float]  # log-softmax of logits / temperature (T=1 when greedy), full vocab
    finish_reason: Literal["stop", "length"]
