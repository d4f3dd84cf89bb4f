"""A named registry of extensions (loss variants, grouping rules, tasks): open to user code."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(dict[str, T], Generic[T]):
    """name -> entry; `add` refuses duplicates and `lookup` lists the names on a miss."""

    def __init__(self, kind: str, register_with: str) -> None:
        super().__init__()
        # "loss", "mmgrpo_jax.register_loss": what it holds, and where users add to it
        self.kind, self.register_with = kind, register_with

    def add(self, name: str, fn: Callable, entry: T) -> None:
        if not name or not isinstance(name, str):
            raise ValueError(f"a {self.kind} needs a non-empty name, got {name!r}")
        if name in self:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        if not callable(fn):
            raise TypeError(f"the function of {self.kind} {name!r} must be callable, got {fn!r}")
        self[name] = entry

    def lookup(self, name: str, field: str) -> T:
        try:
            return self[name]
        except KeyError:
            raise ValueError(
                f"{field} must be a registered {self.kind} ({sorted(self)}; add one with "
                f"{self.register_with}), got {name!r}"
            ) from None
