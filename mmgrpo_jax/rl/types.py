"""What the RL layer reads from a rollout: the trajectory, how it ended, and the metric protocol.

A trajectory keeps every call its program made (the trace), the reward of the final output and
a status; grouping, advantages and batching read only these, never the thread pool that made them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

from mmgrpo_jax.program.example import Example
from mmgrpo_jax.program.trace import CallRecord

Status = Literal["ok", "format_failure", "error"]
Metric = Callable[[Example, Any], float | bool]


@dataclasses.dataclass(frozen=True)
class Trajectory:
    """One run of the program on one example: its calls, reward and how it ended."""

    example_index: int
    rollout_index: int
    calls: tuple[CallRecord, ...]
    reward: float
    status: Status
    error: str | None = None
    prediction: Any = None
