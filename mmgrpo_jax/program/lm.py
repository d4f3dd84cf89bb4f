"""The LM protocol: what the program layer needs from any language model.

A local JAX policy, an OpenAI-compatible server and a scripted test LM all fit it. Token ids and
log-probs are optional because only the policy being trained has (and needs) them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal, Protocol, runtime_checkable

FinishReason = Literal["stop", "length"]


@dataclasses.dataclass(frozen=True)
class LMOutput:
    """One completion; ids and log-probs are the exact sampled tokens when the LM has them."""

    text: str
    prompt_ids: tuple[int, ...] | None = None
    completion_ids: tuple[int, ...] | None = None
    logprobs: tuple[float, ...] | None = None
    finish_reason: FinishReason = "stop"

    def __post_init__(self) -> None:
        if self.finish_reason not in ("stop", "length"):
            raise ValueError(
                f"finish_reason must be 'stop' or 'length', got {self.finish_reason!r}"
            )
        if self.logprobs is not None and self.completion_ids is None:
            raise ValueError("logprobs given without completion_ids")
        if (
            self.logprobs is not None
            and self.completion_ids is not None
            and len(self.logprobs) != len(self.completion_ids)
        ):
            raise ValueError(
                f"{len(self.logprobs)} logprobs for {len(self.completion_ids)} completion tokens"
            )


@runtime_checkable
class LM(Protocol):
    def __call__(self, messages: Sequence[dict[str, str]], **sampling: Any) -> LMOutput: ...


@runtime_checkable
class BatchingLM(LM, Protocol):
    """An LM that batches concurrent calls; it dispatches early once every open client waits."""

    def open_client(self) -> None: ...

    def close_client(self) -> None: ...
