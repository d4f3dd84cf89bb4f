"""The one exception type for problems with what the user asked for.

A `UserError` names the bad value (a setting, a path, a run directory) and how to fix it; the
command line prints its message on one line and exits with code 2. Anything else that escapes is
our bug and keeps its full traceback.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import types
import typing
from typing import Any


class UserError(ValueError):
    """A bad setting, path or run directory; the message says which and what to do."""


def bad_field(owner: object, field: str, rule: str) -> ValueError:
    """A config field's error: `OptimConfig.lr must be > 0, got 0` (`rule` is "must be > 0")."""
    return ValueError(f"{type(owner).__name__}.{field} {rule}, got {getattr(owner, field)!r}")


# what a plain field type accepts: an int is a float; a bool is neither
_SCALARS = {int: numbers.Integral, float: numbers.Real, str: str, bool: bool}


def check_type(hint: Any, value: Any, key: str) -> None:
    """`value` against a field's type when that type is a scalar (int, float, str, bool), a
    config dataclass, or one of those or None; richer types (tuples, Literal) are left to the
    class's own checks. `key` names the field in the error: `OptimConfig.lr must be float, ...`."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    options = typing.get_args(hint) if union else (hint,)
    if value is None and type(None) in options:
        return
    concrete = [o for o in options if o is not type(None)]
    if not all(o in _SCALARS or dataclasses.is_dataclass(o) for o in concrete):
        return
    for option in concrete:
        if dataclasses.is_dataclass(option):
            if isinstance(value, option):
                return
        elif isinstance(value, bool) and option is not bool:
            continue  # True is not a number of rollouts
        elif isinstance(value, _SCALARS[option]):
            return
    names = " | ".join("None" if o is type(None) else o.__name__ for o in options)
    raise ValueError(f"{key} must be {names}, got {value!r}")


@functools.cache
def field_hints(cls: type) -> dict[str, Any]:
    """A config dataclass's resolved field types, read once per class (every check, loader and
    reference of a config asks for them)."""
    return typing.get_type_hints(cls)


def check_field_types(owner: Any) -> None:
    """Every field of a config dataclass against its type (`check_type`): a config built in
    Python is refused as the command line refuses it, naming the field, before any rule that
    would compare a string with a number."""
    hints = field_hints(type(owner))
    for field in dataclasses.fields(owner):
        key = f"{type(owner).__name__}.{field.name}"
        check_type(hints[field.name], getattr(owner, field.name), key)
