"""Trace recording: every predictor call made inside a rollout, in order.

The current rollout's trace (and optionally its LM) lives in one context variable, so rollouts
running on different threads never see each other's calls. This is the only mutable state the
program layer shares.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from mmgrpo_jax.program.lm import LM, LMOutput


@dataclasses.dataclass(frozen=True)
class CallRecord:
    """One predictor call: what was asked, what came back, and whether it parsed.

    `invocation` is the call's index among the same predictor's calls in this trajectory (the k of
    module-level grouping). Token ids and log-probs are present when the LM provides them.
    """

    predictor: str
    invocation: int
    messages: tuple[dict[str, str], ...]
    completion: str
    prompt_ids: tuple[int, ...] | None
    completion_ids: tuple[int, ...] | None
    logprobs: tuple[float, ...] | None
    finish_reason: str
    parsed: bool
    parse_error: str | None
    outputs: dict[str, Any] | None
    inputs: dict[str, Any] | None = None  # the field values rendered into `messages`
    # a copy of another rollout's call, not sampled here (branch rollouts' shared prefix)
    replayed: bool = False

    @property
    def output(self) -> LMOutput:
        """What the LM returned for this call."""
        return LMOutput(
            self.completion,
            self.prompt_ids,
            self.completion_ids,
            self.logprobs,
            self.finish_reason,  # type: ignore[arg-type]
        )

    @classmethod
    def from_output(
        cls,
        predictor: str,
        invocation: int,
        messages: list[dict[str, str]],
        output: LMOutput,
        outputs: dict[str, Any] | None,
        parse_error: str | None,
        inputs: dict[str, Any] | None = None,
        replayed: bool = False,
    ) -> CallRecord:
        return cls(
            predictor=predictor,
            invocation=invocation,
            messages=tuple(dict(m) for m in messages),
            completion=output.text,
            prompt_ids=output.prompt_ids,
            completion_ids=output.completion_ids,
            logprobs=output.logprobs,
            finish_reason=output.finish_reason,
            parsed=parse_error is None,
            parse_error=parse_error,
            outputs=outputs,
            inputs=None if inputs is None else dict(inputs),
            replayed=replayed,
        )


class Trace:
    """The calls of one trajectory; maps predictor objects to the program's dotted names."""

    def __init__(
        self,
        names: dict[int, str],
        key: tuple[int, ...] | None = None,
        key_path: tuple[int, ...] | None = None,
        replay: Sequence[CallRecord] = (),
    ) -> None:
        self._names = names
        # calls answered from these records instead of the LM, by (predictor, invocation)
        self.replay = {(c.predictor, c.invocation): c for c in replay}
        self.key = key  # (example, rollout) in a rollout: lets a batching LM order requests
        # (step, example, rollout) in a training rollout: its calls' sampling keys derive from it
        self.key_path = key_path
        self._calls: list[CallRecord] = []
        self._sent = 0  # LM calls sent so far (recorded ones are appended when they finish)
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()  # a program may fan calls out to its own threads

    def name_of(self, predictor: object) -> str:
        try:
            return self._names[id(predictor)]
        except KeyError:
            raise RuntimeError(
                f"{predictor!r} was called inside a trace but is not a predictor of the traced "
                "program; make it an attribute of the program (or of one of its modules)"
            ) from None

    def next_invocation(self, name: str) -> int:
        with self._lock:
            index = self._counts.get(name, 0)
            self._counts[name] = index + 1
            return index

    def next_call(self) -> int:
        """The index of an LM call being sent: numbered when sent, under the lock, so calls
        a program makes from several threads never share one (and with it a sampling key)."""
        with self._lock:
            index, self._sent = self._sent, self._sent + 1
            return index

    def record(self, call: CallRecord) -> None:
        with self._lock:
            self._calls.append(call)

    @property
    def calls(self) -> tuple[CallRecord, ...]:
        with self._lock:
            return tuple(self._calls)


@dataclasses.dataclass(frozen=True)
class RunContext:
    trace: Trace | None
    lm: LM | None
    # the traced predictor whose LM call is in progress: lets an LM serve each module with its
    # own weights (per-module adapters)
    predictor: str | None = None


_CONTEXT: contextvars.ContextVar[RunContext] = contextvars.ContextVar(
    "mmgrpo_run_context",
    default=RunContext(trace=None, lm=None),  # noqa: B039 (frozen)
)


def current() -> RunContext:
    return _CONTEXT.get()


@contextlib.contextmanager
def using_lm(lm: LM) -> Iterator[None]:
    """Run predictors without their own LM on `lm` in this context (thread)."""
    token = _CONTEXT.set(dataclasses.replace(_CONTEXT.get(), lm=lm))
    try:
        yield
    finally:
        _CONTEXT.reset(token)


@contextlib.contextmanager
def calling(predictor: str) -> Iterator[None]:
    """Mark the LM calls made in this context (thread) as `predictor`'s."""
    token = _CONTEXT.set(dataclasses.replace(_CONTEXT.get(), predictor=predictor))
    try:
        yield
    finally:
        _CONTEXT.reset(token)


@contextlib.contextmanager
def record_trace(
    program: Any,
    lm: LM | None = None,
    key: tuple[int, ...] | None = None,
    key_path: tuple[int, ...] | None = None,
    replay: Sequence[CallRecord] = (),
) -> Iterator[Trace]:
    """Record every call of `program`'s predictors made in this context into a fresh Trace.
    A call matching a `replay` record's (predictor, invocation) gets that record's output
    instead of the LM's, provided its prompt is the record's (branch rollouts)."""
    names = {id(predictor): name for name, predictor in program.named_predictors()}
    trace = Trace(names, key, key_path, replay)
    outer = _CONTEXT.get()
    token = _CONTEXT.set(RunContext(trace=trace, lm=lm if lm is not None else outer.lm))
    try:
        yield trace
    finally:
        _CONTEXT.reset(token)
