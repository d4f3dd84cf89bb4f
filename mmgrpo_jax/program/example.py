"""Examples (dataset rows) and Predictions (module outputs): named fields with attribute access."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any


class _Fields(Mapping[str, Any]):
    def __init__(self, **fields: Any) -> None:
        object.__setattr__(self, "_fields", dict(fields))

    def __getattr__(self, name: str) -> Any:
        fields = object.__getattribute__(self, "_fields")
        if name in fields:
            return fields[name]
        raise AttributeError(f"{type(self).__name__} has no field {name!r}; it has {list(fields)}")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is read-only; build a new one")

    def __getitem__(self, name: str) -> Any:
        return self._fields[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self._fields.items())
        return f"{type(self).__name__}({inner})"


class Prediction(_Fields):
    """The typed outputs of a predictor, or the final output of a program."""


class Example(_Fields):
    """One dataset row. `with_inputs` names the fields the program receives; the rest are labels."""

    def __init__(self, _input_keys: tuple[str, ...] = (), **fields: Any) -> None:
        super().__init__(**fields)
        missing = [k for k in _input_keys if k not in fields]
        if missing:
            raise ValueError(f"input keys {missing} are not fields of the example {list(fields)}")
        object.__setattr__(self, "_input_keys", tuple(_input_keys))

    def with_inputs(self, *keys: str) -> Example:
        return Example(keys, **self._fields)

    @property
    def input_keys(self) -> tuple[str, ...]:
        return self._input_keys

    def inputs(self) -> dict[str, Any]:
        if not self._input_keys:
            raise ValueError(
                f"{self!r} has no input keys; mark them with example.with_inputs('field', ...)"
            )
        return {k: self._fields[k] for k in self._input_keys}

    def labels(self) -> dict[str, Any]:
        return {k: v for k, v in self._fields.items() if k not in self._input_keys}

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Example)
            and self._fields == other._fields
            and self._input_keys == other._input_keys
        )

    __hash__ = None  # type: ignore[assignment]
