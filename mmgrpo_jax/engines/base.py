"""The rollout-engine protocol: what the trainer needs from any sampler (docs/design.md#engine).

A rollout's LM calls become `Request`s; an engine answers each with the sampled ids, their
log-probs and a finish reason. After every update the trainer hands the engine the new trainable
parameters with `update_weights`, which must validate them (tree structure, shapes, dtypes) and
raise naming the first mismatch (`engines.local.check_weights` does); the engine never reads a
model the trainer mutates. `state_dict` / `load_state_dict` carry what an exact resume needs (a
sampling counter, say). The JAX engine is one implementation; a wrapper around vLLM or SGLang
serving the LoRA adapter would be another. This module imports no JAX.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from mmgrpo_jax.sampler.types import Completion, Request, Sampling

if TYPE_CHECKING:  # the protocol names the weights' type; an engine that takes them imports it
    from flax import nnx

__all__ = [
    "Completion",
    "EngineStats",
    "Request",
    "RolloutEngine",
    "Sampling",
]


@dataclasses.dataclass
class EngineStats:
    """Where an engine's time goes and how full it kept the sampler: the numbers behind 'keep
    the sampler busy'. Counters only grow; `since` takes one step's share."""

    dispatches: int = 0  # sampler calls (a continuous engine: prefill and decode passes)
    requests: int = 0  # requests answered
    max_batch: int = 1  # rows one call can hold (a continuous engine: its slots)
    tokens: int = 0  # tokens sampled
    sample_s: float = 0.0  # seconds inside sampler calls
    queue_wait_s: float = 0.0  # summed over requests: seconds from submit to sampling start
    row_steps: int = 0  # continuous: decode steps x the rows live in them
    slot_steps: int = 0  # continuous: decode steps x the pool's slots
    compiles: int = 0  # sampler programs compiled (a continuous engine counts its own)
    prompt_tokens: int = 0  # prompt tokens of the requests prefilled (shared or not)
    shared_prefix_tokens: int = 0  # prompt tokens copied from a slot instead of prefilled

    @property
    def mean_batch(self) -> float:
        return self.requests / self.dispatches if self.dispatches else 0.0

    @property
    def occupancy(self) -> float:
        """The share of sampler rows doing work: live rows per slot over the decode steps of a
        continuous engine, else requests per call over max_batch."""
        if self.slot_steps:
            return self.row_steps / self.slot_steps
        return self.mean_batch / self.max_batch

    @property
    def prefill_saved(self) -> float:
        """The share of prompt tokens not prefilled (their keys and values copied instead)."""
        return self.shared_prefix_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def mean_queue_wait_s(self) -> float:
        return self.queue_wait_s / self.requests if self.requests else 0.0

    def since(self, earlier: EngineStats) -> EngineStats:
        """The calls made after `earlier` (a copy taken then): one step's share."""
        counted = {
            f.name: getattr(self, f.name) - getattr(earlier, f.name)
            for f in dataclasses.fields(self)
            if f.name != "max_batch"
        }
        return EngineStats(max_batch=self.max_batch, **counted)


@runtime_checkable
class RolloutEngine(Protocol):
    def submit(self, request: Request) -> Future[Completion]:
        """Queue one request; the future holds its completion (or the sampler's exception)."""
        ...

    def update_weights(self, params: nnx.State) -> None:
        """Sample from `params` (the trainable part) from now on; validated, then copied."""
        ...

    @property
    def stats(self) -> EngineStats: ...

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state that an exact resume restores."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...

    def open_client(self) -> None:
        """A caller (a running rollout) may send requests: a batcher waits for it."""
        ...

    def close_client(self) -> None: ...

    def close(self) -> None: ...
