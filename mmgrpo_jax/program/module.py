"""Modules and predictors: the building blocks of an LM program.

A program is a `Module` whose `forward` is ordinary Python calling predictors (`Predict`,
`ChainOfThought`) and tools. Predictors are found by walking attributes, which gives each one a
stable dotted name (``"hop.query"``, ``"steps[1]"``) used by traces, grouping and saved state.
"""

from __future__ import annotations

import copy
import inspect
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mmgrpo_jax.program import adapter
from mmgrpo_jax.program.example import Prediction
from mmgrpo_jax.program.lm import LM, LMOutput
from mmgrpo_jax.program.signature import Field, Signature, ensure_signature
from mmgrpo_jax.program.trace import CallRecord, calling, current

REASONING = Field("reasoning", str, "Think step by step before giving the other outputs.")


class Module:
    """Base class of LM programs; subclasses set predictors as attributes and define forward."""

    def __call__(self, **inputs: Any) -> Any:
        return self.forward(**inputs)

    def forward(self, **inputs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must define forward(**inputs)")

    def check_inputs(self, inputs: Mapping[str, Any], where: str) -> None:
        """Refuse, before anything runs, inputs that `forward` cannot take (a dataset row
        missing a field the program reads, or one it does not know); `where` names the row."""
        check_call(self.forward, type(self).__name__, inputs, where)

    def named_predictors(self) -> list[tuple[str, Predict]]:
        """Every predictor reachable from this module with its dotted name, first name wins."""
        found: dict[int, tuple[str, Predict]] = {}
        _walk(self, "", found, visited=set())
        return list(found.values())

    def predictors(self) -> list[Predict]:
        return [p for _, p in self.named_predictors()]

    def copy(self) -> Module:
        """A deep copy that shares the original's LMs and tools (they hold weights, indexes and
        locks): predictors' LMs and every callable attribute that is not itself a module."""
        shared = {id(p.lm): p.lm for p in self.predictors() if p.lm is not None}
        _collect_callables(self, shared, visited=set())
        return copy.deepcopy(self, memo=shared)

    def set_lm(self, lm: LM | None) -> None:
        for predictor in self.predictors():
            predictor.lm = lm

    def dump_state(self) -> dict[str, dict[str, Any]]:
        """Each predictor's prompt state (instructions and demos), keyed by name."""
        return {name: p.predictor_state() for name, p in self.named_predictors()}

    def load_state(self, state: Mapping[str, Mapping[str, Any]]) -> None:
        named = dict(self.named_predictors())
        missing, unknown = sorted(set(named) - set(state)), sorted(set(state) - set(named))
        if missing or unknown:
            raise ValueError(
                f"prompt state does not match the program: missing {missing}, unknown {unknown}"
            )
        for name, predictor_state in state.items():
            named[name].load_predictor_state(predictor_state)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.dump_state(), indent=2, ensure_ascii=False))

    def load(self, path: str | Path) -> None:
        self.load_state(json.loads(Path(path).read_text()))


def check_call(forward: Any, owner: str, inputs: Mapping[str, Any], where: str) -> None:
    """Raise a ValueError naming `where` if `forward` cannot take `inputs` as keywords."""
    try:
        signature = inspect.signature(forward)
    except (TypeError, ValueError):  # a builtin or C callable: nothing to check
        return
    try:
        signature.bind(**inputs)
    except TypeError as err:
        raise ValueError(
            f"{where}: {owner}.forward{signature} cannot take its inputs {sorted(inputs)} ({err})"
        ) from None


def _collect_callables(obj: Any, found: dict[int, Any], visited: set[int]) -> None:
    if id(obj) in visited:
        return
    visited.add(id(obj))
    values = vars(obj).values() if isinstance(obj, Module) else ()
    if isinstance(obj, list | tuple):
        values = obj
    elif isinstance(obj, dict):
        values = obj.values()
    for value in values:
        if callable(value) and not isinstance(value, Module | type):
            found[id(value)] = value
        else:
            _collect_callables(value, found, visited)


def _walk(obj: Any, prefix: str, found: dict[int, tuple[str, Predict]], visited: set[int]) -> None:
    if isinstance(obj, Predict):
        found.setdefault(id(obj), (prefix or "self", obj))
        return
    if id(obj) in visited:
        return
    if isinstance(obj, Module):
        visited.add(id(obj))
        for attr, value in vars(obj).items():
            _walk(value, f"{prefix}.{attr}" if prefix else attr, found, visited)
    elif isinstance(obj, list | tuple):
        for i, value in enumerate(obj):
            _walk(value, f"{prefix}[{i}]", found, visited)
    elif isinstance(obj, dict):
        for key, value in obj.items():
            _walk(value, f"{prefix}[{key}]", found, visited)


class Predict(Module):
    """One LM module: renders its signature, calls the LM, parses the typed outputs.

    The LM is the predictor's own (`lm=` or `Module.set_lm`) or else the one of the current run
    context (`record_trace(program, lm=...)`, `using_lm`). `sampling` is passed to every LM call.
    `bare=True` (one output field) asks for the value alone instead of headed fields: a format a
    tiny policy can produce.
    """

    def __init__(
        self,
        signature: str | Signature,
        *,
        instructions: str | None = None,
        lm: LM | None = None,
        sampling: Mapping[str, Any] | None = None,
        bare: bool = False,
    ) -> None:
        self.signature = ensure_signature(signature)
        if bare:
            adapter.check_bare(self.signature)
        self.bare = bare
        if instructions is not None:
            self.signature = self.signature.with_instructions(instructions)
        self.demos: list[dict[str, Any]] = []
        self.lm = lm
        self.sampling = dict(sampling or {})

    def __call__(self, **inputs: Any) -> Prediction:
        unknown = sorted(set(inputs) - set(self.signature.input_names))
        if unknown:
            raise ValueError(f"unknown inputs {unknown} for signature `{self.signature}`")
        context = current()
        lm = self.lm if self.lm is not None else context.lm
        if lm is None:
            raise RuntimeError(
                f"no LM for predictor `{self.signature}`: pass lm=..., call program.set_lm(lm), "
                "or run inside record_trace(program, lm=lm)"
            )
        messages = adapter.render(self.signature, inputs, self.demos, self.bare)
        trace = context.trace
        replayed = None
        if trace is not None:
            name = trace.name_of(self)
            invocation = trace.next_invocation(name)
            replayed = trace.replay.get((name, invocation))
        if replayed is not None:
            if tuple(dict(m) for m in messages) != replayed.messages:
                raise RuntimeError(
                    f"branch replay diverged at {name}[{invocation}]: the program asked "
                    "something else than in the rollout it replays (is it deterministic given "
                    "its LM's replies?)"
                )
            output = replayed.output
        elif trace is not None:
            with calling(name):
                output = lm(messages, **self.sampling)
        else:
            output = lm(messages, **self.sampling)
        if not isinstance(output, LMOutput):
            raise TypeError(f"the LM must return LMOutput, got {type(output).__name__}")
        error: adapter.ParseError | None = None
        outputs = None
        try:
            outputs = adapter.parse(self.signature, output.text, self.bare)
        except adapter.ParseError as err:
            error = err
        if trace is not None:
            record = CallRecord.from_output(
                name,
                invocation,
                messages,
                output,
                outputs,
                None if error is None else str(error),
                inputs,
                replayed=replayed is not None,
            )
            trace.record(record)
        if error is not None:
            raise error
        return Prediction(**outputs)

    def named_predictors(self) -> list[tuple[str, Predict]]:
        return [("self", self)]

    def predictor_state(self) -> dict[str, Any]:
        return {"instructions": self.signature.instructions, "demos": [dict(d) for d in self.demos]}

    def load_predictor_state(self, state: Mapping[str, Any]) -> None:
        unknown = sorted(set(state) - {"instructions", "demos"})
        if unknown:
            raise ValueError(
                f"unknown predictor state keys {unknown}; expected instructions, demos"
            )
        if "instructions" in state:
            self.signature = self.signature.with_instructions(state["instructions"])
        if "demos" in state:
            self.demos = [dict(d) for d in state["demos"]]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.signature)!r})"


class ChainOfThought(Predict):
    """A Predict whose LM writes a `reasoning` field before the other outputs."""

    def __init__(self, signature: str | Signature, **kwargs: Any) -> None:
        super().__init__(signature, **kwargs)
        self.signature = self.signature.prepend_output(REASONING)
        if self.bare:
            adapter.check_bare(self.signature)  # reasoning makes a second output field
